"""The formulas fivefold is checked against (DESIGN.md "The numbers the code must reproduce"), pure Python.

Tests, `bench/` and `fivefold plan` compute here what should happen; `fivefold.memory` and `comm.CommLog` measure
what does. Ψ = parameter count, N = data-parallel degree, P = pipeline ranks, M = micro-batches, V = model chunks
per pipeline rank, B·L·D = batch × sequence × model width.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["MODEL_STATES", "ModelShape", "RECIPES", "bubble_formula", "expected_for", "hpz_secondary_bytes",
           "quantized_chunk_bytes", "ring_attention_p2p_elements", "ring_wire_bytes", "tp_comm_formula",
           "tp_comm_formula_text", "zero3_gather_bytes", "zero_grad_reduce_bytes"]

# -- collectives on a ring (seed 001 §5.5, seed 003 §2.1 / §16) ------------------------------------------
# bytes one rank sends per payload byte on a ring of n (all-reduce = reduce-scatter + all-gather; pipelined broadcast)
_WIRE_FACTOR = {"all_reduce": lambda n: 2.0 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n,
                "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1.0, "recv": lambda n: 1.0}


def ring_wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends over the wire for `op` on a ring of `group_size` ranks."""
    if group_size <= 1 and op not in ("send", "recv"):
        return 0.0
    return _WIRE_FACTOR[op](group_size) * payload_bytes


# -- data parallel and ZeRO (seed 001 §5.1-5.5; fp32 AdamW: parameters 4Ψ, gradients 4Ψ, m and v 8Ψ) ----

MODEL_STATES = ("params", "grads", "optimizer")

RECIPES: dict[str, dict[str, Any]] = {
    # memory: (bytes per element, sharded?) for params, grads, optimizer; comm: op -> multiple of 4Ψ
    "ddp": dict(label="DDP", memory_formula="4Ψ+4Ψ+8Ψ = 16Ψ",
                memory=((4, False), (4, False), (8, False)), comm={"all_reduce": 1}, comm_formula="AR Ψ"),
    "zero1": dict(label="ZeRO-1", memory_formula="4Ψ+4Ψ+8Ψ/N",
                  memory=((4, False), (4, False), (8, True)), comm={"reduce_scatter": 1, "all_gather": 1},
                  comm_formula="RS Ψ + AG Ψ"),
    "zero2": dict(label="ZeRO-2", memory_formula="4Ψ+12Ψ/N",
                  memory=((4, False), (4, True), (8, True)), comm={"reduce_scatter": 1, "all_gather": 1},
                  comm_formula="RS Ψ + AG Ψ"),
    "zero3": dict(label="ZeRO-3", memory_formula="16Ψ/N",
                  memory=((4, True), (4, True), (8, True)), comm={"all_gather": 2, "reduce_scatter": 1},
                  comm_formula="AG 2Ψ + RS Ψ"),
    # torch's ZeRO-1 recipe: DDP's all-reduce, then every parameter broadcast by its owner
    "ddp+zero_optim": dict(label="ZeRO-1 (DDP+ZeroRedundancyOptimizer)", memory_formula="4Ψ+4Ψ+8Ψ/N",
                           memory=((4, False), (4, False), (8, True)), comm={"all_reduce": 1, "broadcast": 1},
                           comm_formula="AR Ψ + BC Ψ",
                           memory_note="ZeroRedundancyOptimizer partitions whole parameters, not a flat buffer: "
                                       "its shards are uneven"),
}


def expected_for(recipe: str, padded_params: int, world: int) -> dict[str, Any]:
    """Model-state bytes per rank and payload bytes per step and rank of ``recipe`` (a `RECIPES` key), for
    ``padded_params`` Ψ as padded (a multiple of N for flat shards) and ``world`` N; wire bytes on a ring."""
    r = RECIPES[recipe]
    memory = {name: nbytes * padded_params / (world if sharded else 1)
              for name, (nbytes, sharded) in zip(MODEL_STATES, r["memory"])}
    memory["total"] = sum(memory.values())
    by_op = {op: int(k * 4 * padded_params) for op, k in r["comm"].items()}
    return dict(memory=memory, by_op=by_op, payload_bytes=sum(by_op.values()),
                wire_bytes=sum(ring_wire_bytes(op, b, world) for op, b in by_op.items()))


# -- ZeRO++ (seed 003 §6; Wang et al. 2023): quantised collectives and the hierarchical partition -----------------
# Bytes are payloads as `CommLog` records them (an all-gather's output, a reduce-scatter's / all-to-all's input) for
# flat buffers already padded to a multiple of N (ZeRO's shards).

def quantized_chunk_bytes(n: int, block: int) -> int:
    """Bytes of `n` elements quantised to int8 in blocks of `block`, one fp32 scale per block, the chunk padded to 4
    bytes (`data_parallel.quantize.packed_bytes`): ≈ n·(1 + 4/block) against n·2 (bf16) or n·4 (fp32)."""
    return 4 * -(-n // block) + -(-n // 4) * 4


def zero3_gather_bytes(padded_numels: list[int], world: int, dtype_bytes: int, block: int | None = None) -> int:
    """One all-gather of each ZeRO-3 unit (padded sizes) over `world` ranks: the compute dtype, or with qwZ
    (`block`) every rank's shard as a quantised chunk."""
    if block is None:
        return sum(n * dtype_bytes for n in padded_numels)
    return sum(world * quantized_chunk_bytes(n // world, block) for n in padded_numels)


def zero_grad_reduce_bytes(padded_numels: list[int], world: int, dtype_bytes: int, block: int | None = None) -> int:
    """One gradient reduction of each bucket: a reduce-scatter in the reduce dtype, or qgZ's (`block`) all-to-all
    of one quantised chunk per destination rank."""
    return zero3_gather_bytes(padded_numels, world, dtype_bytes, block)  # the same shapes: N chunks of n/N


def hpz_secondary_bytes(padded_numels: list[int], hpz: int, dtype_bytes: int) -> int:
    """hpZ's extra parameter memory per rank: 1/hpz of every ZeRO-3 unit in the compute dtype (the primary shard is
    1/N; ZeRO++ trades this for backward gathers inside the hpz group)."""
    return sum(n // hpz * dtype_bytes for n in padded_numels)


# -- tensor and sequence parallel (seed 003 §7.2, §8.2) --------------------------------------------------

class ModelShape(Protocol):
    """What the TP formula needs of a model config (`fivefold.models.LlamaConfig` has it)."""

    n_layers: int
    dim: int


def tp_comm_formula(config: ModelShape, batch: int, seq_len: int, sequence_parallel: bool,
                    dtype_bytes: int = 4) -> dict[str, int]:
    """Payload bytes per step and rank of fivefold's TP plan, by op (seed 003 §7.2 / §8.2).

    Per block 4 collectives of B·L·D (2 forward, 2 backward): all-reduces, or under SP 4 AG + 4 RS. Plus the
    embedding's exit (forward AR; SP: RS forward, AG backward), the head's entry (backward AR; SP: AG forward, RS
    backward),
    3 all-reduces of B·L fp32 in the vocab-parallel cross-entropy, and under SP an all-reduce of D per norm weight
    gradient (2 per block + the final norm)."""
    n, bld, bl, d = config.n_layers, batch * seq_len * config.dim, batch * seq_len, config.dim
    if not sequence_parallel:
        return {"all_reduce": ((4 * n + 2) * bld + 3 * bl) * dtype_bytes}
    return {"all_gather": (4 * n + 2) * bld * dtype_bytes,
            "all_reduce": (3 * bl + (2 * n + 1) * d) * dtype_bytes,
            "reduce_scatter": (4 * n + 2) * bld * dtype_bytes}


def tp_comm_formula_text(sequence_parallel: bool) -> str:
    """`tp_comm_formula` in words, for tables."""
    if not sequence_parallel:
        return "AR (4n+2)·BLD + 3·BL"
    return "AG (4n+2)·BLD + RS (4n+2)·BLD + AR 3·BL + (2n+1)·D"


# -- pipeline bubble (seed 003 §9.1-9.4) ------------------------------------------------------------------

def bubble_formula(name: str, P: int, M: int, V: int = 1) -> float:
    """Textbook bubble fraction (idle share of P ranks over one step) of schedule ``name``; exact in the
    simulator under the conditions in `fivefold.pipeline.simulator`."""
    if name in ("gpipe", "1f1b"):
        return (P - 1) / (M + P - 1)
    if name == "interleaved":
        return (P - 1) / (V * M + P - 1)
    if name == "zb-h1":
        return (P - 1) / (3 * M + P - 1)
    raise ValueError(f"no bubble formula for schedule {name!r}; known: gpipe, 1f1b, interleaved, zb-h1")


def pipeline_idle(name: str, P: int, F: float, B: float, W: float, FB: float | None = None) -> float:
    """Idle time of one rank over one step in DeepSeek-V3's accounting (its Table 2), F, B (= I + W) and W being one
    stage's (DualPipeV: one half-size chunk's) pass costs: 1F1B (P-1)(F+B); ZB-H1 (P-1)(F+B-2W); DualPipeV
    (P-1)(F&B+B-3W) — DualPipe's (PP/2-1)(F&B+B-3W) at PP = 2P, DualPipeV being DualPipe cut in half — with F&B an
    overlapped unit's cost (``FB``; F+B when its passes run one after the other). With chunks half a stage, DualPipeV
    idles less than ZB-H1 by (P-1)(F-W)/2 + (P-1)(F+B-F&B)/2 in stage units: nothing when F = W and the unit is not
    overlapped. The simulator gives these exactly (DualPipeV with F&B < F+B: on its most idle rank)."""
    if name in ("gpipe", "1f1b"):
        return (P - 1) * (F + B)
    if name == "zb-h1":
        return (P - 1) * (F + B - 2 * W)
    if name == "dualpipev":
        return (P - 1) * ((F + B if FB is None else FB) + B - 3 * W)
    raise ValueError(f"no idle formula for schedule {name!r}; known: gpipe, 1f1b, zb-h1, dualpipev")


# -- context parallel (seed 003 §10.1) ------------------------------------------------------------------
def ring_attention_p2p_elements(batch: int, seq_len: int, n_kv_heads: int, head_dim: int, cp: int) -> dict[str, int]:
    """Elements one rank sends per attention layer with ring attention over `cp` ranks: its K and V shard
    (2·B·(L/C)·H_kv·d, the seed's 2·L·D/C scaled by H_kv/H for GQA) C-1 times in forward; in backward the shards
    go around again (C-1) and each shard's dK/dV accumulator travels with them and then home (C)."""
    shard = 2 * batch * (seq_len // cp) * n_kv_heads * head_dim
    return {"forward_kv": shard * (cp - 1), "backward_kv": shard * (cp - 1),
            "backward_dkv": shard * cp if cp > 1 else 0}
