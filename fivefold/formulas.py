"""The formulas fivefold is checked against (docs/design.md, every section with a formula), pure
Python.

Tests, `bench/` and `fivefold plan` compute here what should happen; `fivefold.observe.memory` and
`comm.CommLog` measure what does. Ψ = parameter count, N = data-parallel degree, P = pipeline ranks,
M = micro-batches, V = model chunks per pipeline rank, B·L·D = batch × sequence × model width.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

__all__ = [
    "BLOCK_LINEARS",
    "MODEL_STATES",
    "RECIPES",
    "STAGE_SHARDS",
    "MicroBatch",
    "ModelShape",
    "SavePlan",
    "activation_bytes_per_block",
    "attention_flops_per_token",
    "backward_working_bytes",
    "bubble_formula",
    "eager_softmax_bytes",
    "elementwise_bytes_per_block",
    "expected_for",
    "flat_model_state_bytes",
    "float8_gather_bytes",
    "head_activation_bytes",
    "hpz_secondary_bytes",
    "hsdp_expected",
    "korthikanti_block_bytes",
    "loss_chunk_bytes",
    "loss_elementwise_bytes",
    "model_flops_per_token",
    "moe_ffn_activation_bytes",
    "muon_step_flops",
    "optimizer_state_bytes",
    "owner_bound",
    "quantized_chunk_bytes",
    "ring_attention_p2p_elements",
    "ring_wire_bytes",
    "saved_linears",
    "selective_op_block_bytes",
    "selective_op_recompute_flops",
    "tp_comm_formula",
    "tp_comm_formula_text",
    "weight_grad_pending_bytes",
    "zero3_gather_bytes",
    "zero_grad_reduce_bytes",
    "zero_model_states",
]

# -- collectives on a ring (docs/design.md#collectives-on-a-ring) ----------------------------------
# bytes one rank sends per payload byte on a ring of n (all-reduce = reduce-scatter + all-gather;
# pipelined broadcast)
_WIRE_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 1.0,
}


def ring_wire_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends over the wire for `op` on a ring of `group_size` ranks."""
    if group_size <= 1 and op not in ("send", "recv"):
        return 0.0
    return _WIRE_FACTOR[op](group_size) * payload_bytes


# -- data parallel and ZeRO (docs/design.md#model-state-memory; fp32 AdamW: parameters 4Ψ, gradients
# 4Ψ, m and v 8Ψ) ---

MODEL_STATES = ("params", "grads", "optimizer")

# Which model states a ZeRO stage shards over the N data-parallel ranks: (params, grads, optimizer)
STAGE_SHARDS: dict[int, tuple[bool, bool, bool]] = {
    0: (False, False, False),
    1: (False, False, True),
    2: (False, True, True),
    3: (True, True, True),
}

_FP32_STATE_BYTES = (4, 4, 8)  # bytes per element of params, grads, optimizer (m and v)
_OP_ABBREVIATIONS = {
    "all_reduce": "AR",
    "reduce_scatter": "RS",
    "all_gather": "AG",
    "broadcast": "BC",
}


def _recipe(
    label: str, memory_formula: str, stage: int, comm: dict[str, int], **notes: str
) -> dict:
    """One `RECIPES` entry: fp32 model states sharded as ZeRO-``stage`` shards them; ``comm``: op
    -> multiple of 4Ψ, written out as ``comm_formula`` ("RS Ψ + AG Ψ")."""
    return dict(
        label=label,
        memory_formula=memory_formula,
        memory=tuple(zip(_FP32_STATE_BYTES, STAGE_SHARDS[stage])),
        comm=comm,
        comm_formula=" + ".join(
            f"{_OP_ABBREVIATIONS[op]} {'' if k == 1 else k}Ψ" for op, k in comm.items()
        ),
        **notes,
    )


# memory: (bytes per element, sharded?) for params, grads, optimizer; comm: op -> multiple of 4Ψ
RECIPES: dict[str, dict[str, Any]] = {
    "ddp": _recipe("DDP", "4Ψ+4Ψ+8Ψ = 16Ψ", 0, {"all_reduce": 1}),
    "zero1": _recipe("ZeRO-1", "4Ψ+4Ψ+8Ψ/N", 1, {"reduce_scatter": 1, "all_gather": 1}),
    "zero2": _recipe("ZeRO-2", "4Ψ+12Ψ/N", 2, {"reduce_scatter": 1, "all_gather": 1}),
    "zero3": _recipe("ZeRO-3", "16Ψ/N", 3, {"all_gather": 2, "reduce_scatter": 1}),
    # ZeRO-3 keeping each unit gathered from its forward to its backward (zero.reshard_after_forward
    # false, DeepSpeed's default when parameters are reused soon): one all-gather per step; the
    # gathered units are held meanwhile
    "zero3-keep": _recipe(
        "ZeRO-3, kept for backward", "16Ψ/N", 3, {"all_gather": 1, "reduce_scatter": 1}
    ),
    # torch's ZeRO-1 recipe: DDP's all-reduce, then every parameter broadcast by its owner; the
    # states sharded as ZeRO-1's
    "ddp+zero_optim": _recipe(
        "ZeRO-1 (DDP+ZeroRedundancyOptimizer)",
        "4Ψ+4Ψ+8Ψ/N",
        1,
        {"all_reduce": 1, "broadcast": 1},
        memory_note="ZeroRedundancyOptimizer partitions whole parameters, not a flat buffer: "
        "its shards are uneven",
    ),
}


def zero_model_states(
    params: float,
    stage: int,
    dp: int,
    param_bytes: int = 2,
    grad_bytes: int = 2,
    optimizer_bytes: int = 12,
) -> dict[str, float]:
    """Model-state bytes per rank of ZeRO-``stage`` over ``dp`` ranks
    (docs/design.md#model-state-memory: Ψ = ``params``; mixed-precision Adam by default, 2Ψ + 2Ψ +
    KΨ with K = 12 for the fp32 master, m and v; fp32 training: 4, 4, 8), by part and in total. The
    ZeRO paper's numbers (docs/design.md#reference-figures): 7.5B at N = 64 → 120 / 31.4 / 16.6 /
    1.88 GB for stages 0-3; 1T at N = 1024 with ZeRO-3 → 15.6 GB."""
    if stage not in STAGE_SHARDS:
        raise ValueError(f"zero stage {stage}: choose 0, 1, 2 or 3")
    parts = {
        name: nbytes * params / (dp if sharded else 1)
        for name, nbytes, sharded in zip(
            MODEL_STATES, (param_bytes, grad_bytes, optimizer_bytes), STAGE_SHARDS[stage]
        )
    }
    return {**parts, "total": sum(parts.values())}


def expected_for(recipe: str, padded_params: int, world: int) -> dict[str, Any]:
    """Model-state bytes per rank and payload bytes per step and rank of ``recipe`` (a `RECIPES`
    key), for ``padded_params`` Ψ as padded (a multiple of N for flat shards) and ``world`` N; wire
    bytes on a ring."""
    r = RECIPES[recipe]
    memory = {
        name: nbytes * padded_params / (world if sharded else 1)
        for name, (nbytes, sharded) in zip(MODEL_STATES, r["memory"])
    }
    memory["total"] = sum(memory.values())
    by_op = {op: int(k * 4 * padded_params) for op, k in r["comm"].items()}
    return dict(
        memory=memory,
        by_op=by_op,
        payload_bytes=sum(by_op.values()),
        wire_bytes=sum(ring_wire_bytes(op, b, world) for op, b in by_op.items()),
    )


def hsdp_expected(stage: int, padded_params: int, shard: int, replicate: int) -> dict[str, Any]:
    """HSDP (docs/design.md#hsdp): ZeRO-``stage`` (1-3) inside shard groups of ``shard`` ranks N_s,
    ``replicate`` R copies.

    Model states per rank: the stage's formula with N = N_s (ZeRO-3: 16Ψ/N_s, e.g. 2Ψ at N_s = 8),
    whatever R. Payload bytes per step and rank by sub-dimension (fp32, as `expected_for`): over
    ``dp_shard`` the stage's own (reduce-scatter Ψ + all-gather Ψ; ZeRO-3 all-gather 2Ψ), over
    ``dp_replicate`` an all-reduce of the reduced shard, Ψ/N_s; ``wire_bytes`` per sub-dimension on
    a ring of its size. ``padded_params``: Ψ with every flat buffer padded to a multiple of N_s."""
    if stage not in (1, 2, 3):
        raise ValueError(
            f"HSDP shards with ZeRO-1, 2 or 3, not stage {stage} (stage 0 over both groups is DDP)"
        )
    inner = expected_for(f"zero{stage}", padded_params, shard)
    by_dim = {
        "dp_shard": inner["by_op"],
        "dp_replicate": {"all_reduce": 4 * padded_params // shard},
    }
    wire = {
        "dp_shard": inner["wire_bytes"],
        "dp_replicate": ring_wire_bytes(
            "all_reduce", by_dim["dp_replicate"]["all_reduce"], replicate
        ),
    }
    return dict(
        memory=inner["memory"],
        by_dim=by_dim,
        wire_bytes=wire,
        payload_bytes={dim: sum(ops.values()) for dim, ops in by_dim.items()},
    )


# -- ZeRO++ (Wang et al. 2023; docs/design.md#zero-qwz-qgz-hpz): quantised collectives and the
# hierarchical partition -- Bytes are payloads as `CommLog` records them (an all-gather's output, a
# reduce-scatter's / all-to-all's input) for flat buffers already padded to a multiple of N (ZeRO's
# shards).


def quantized_chunk_bytes(n: int, block: int) -> int:
    """Bytes of `n` elements quantised to int8 in blocks of `block`, one fp32 scale per block, the
    chunk padded to 4 bytes (`data_parallel.quantize.packed_bytes`): ≈ n·(1 + 4/block) against n·2
    (bf16) or n·4 (fp32)."""
    return 4 * -(-n // block) + -(-n // 4) * 4


def zero3_gather_bytes(
    padded_numels: list[int], world: int, dtype_bytes: int, block: int | None = None
) -> int:
    """One all-gather of each ZeRO-3 unit (padded sizes) over `world` ranks: the compute dtype, or
    with qwZ (`block`) every rank's shard as a quantised chunk."""
    if block is None:
        return sum(n * dtype_bytes for n in padded_numels)
    return sum(world * quantized_chunk_bytes(n // world, block) for n in padded_numels)


FLOAT8_ALIGN = 16  # bytes: an FP8 gather lays every parameter on a 16-byte boundary


def float8_gather_bytes(params: list[tuple[int, bool]], param_bytes: int) -> int:
    """One ZeRO-3 gather of a unit whose FP8 linears' weights travel in FP8
    (docs/design.md#fp8-training): per parameter (elements, in FP8?) an FP8 weight's e4m3 bytes
    and its 4-byte fp32 scale, any other parameter in the compute dtype, each rounded up to 16
    bytes — about half of `zero3_gather_bytes` in bf16 for a unit of large weights."""

    def aligned(n: int) -> int:
        return -(-n // FLOAT8_ALIGN) * FLOAT8_ALIGN

    return sum(aligned(n) + FLOAT8_ALIGN if fp8 else aligned(n * param_bytes) for n, fp8 in params)


def zero_grad_reduce_bytes(
    padded_numels: list[int], world: int, dtype_bytes: int, block: int | None = None
) -> int:
    """One gradient reduction of each bucket: a reduce-scatter in the reduce dtype, or qgZ's
    (`block`) all-to-all of one quantised chunk per destination rank."""
    return zero3_gather_bytes(
        padded_numels, world, dtype_bytes, block
    )  # the same shapes: N chunks of n/N


def hpz_secondary_bytes(padded_numels: list[int], hpz: int, dtype_bytes: int) -> int:
    """hpZ's extra parameter memory per rank: 1/hpz of every ZeRO-3 unit in the compute dtype (the
    primary shard is 1/N; ZeRO++ trades this for backward gathers inside the hpz group)."""
    return sum(n // hpz * dtype_bytes for n in padded_numels)


# -- tensor and sequence parallel (docs/design.md#tensor-and-sequence-parallelism) -----------------


class ModelShape(Protocol):
    """What the TP formula needs of a model config (`fivefold.models.LlamaConfig` has it)."""

    n_layers: int
    dim: int
    head_dim: int


def tp_comm_formula(
    config: ModelShape,
    batch: int,
    seq_len: int,
    sequence_parallel: bool,
    dtype_bytes: int = 4,
    recompute: str = "none",
) -> dict[str, int]:
    """Payload bytes per step and rank of fivefold's TP plan, by op (same section).

    Per block 4 collectives of B·L·D (2 forward, 2 backward): all-reduces, or under SP 4 AG + 4 RS.
    Plus the embedding's exit (forward AR; SP: RS forward, AG backward), the head's entry (backward
    AR; SP: AG forward, RS backward),
    3 all-reduces of B·L fp32 (whatever ``dtype_bytes``) in the vocab-parallel cross-entropy, and
    under SP an all-reduce of D per norm weight
    gradient (2 per block + the final norm). ``recompute="full"`` runs a block's forward again in
    backward, up to its last kept tensor (torch stops a recomputation there): per block once more
    the attention's exit (AR; SP: RS) and under SP both entries (AG), not the MLP's exit. Selective
    recomputes only the attention core: no collective; selective-op replays its collectives'
    buffers (`ops.collective_outputs`): none either. The families' options add all-reduces of
    replicated weights' gradients: per-head q/k norms 2 of head_dim per block (each rank's heads
    are a partial sum), and under SP wo's bias (``attention_bias="all"``) one of D per block."""
    n, bld, bl, d = config.n_layers, batch * seq_len * config.dim, batch * seq_len, config.dim
    again = n if recompute == "full" else 0  # blocks recomputed
    loss = 3 * bl * 4  # the cross-entropy's row statistics are fp32 whatever the compute dtype
    head_norms = 2 * n * config.head_dim * dtype_bytes if getattr(config, "qk_norm", False) else 0
    if not sequence_parallel:
        return {"all_reduce": (4 * n + again + 2) * bld * dtype_bytes + loss + head_norms}
    o_bias = n * d * dtype_bytes if getattr(config, "attention_bias", "off") == "all" else 0
    return {
        "all_gather": (4 * n + 2 * again + 2) * bld * dtype_bytes,
        "all_reduce": loss + (2 * n + 1) * d * dtype_bytes + head_norms + o_bias,
        "reduce_scatter": (4 * n + again + 2) * bld * dtype_bytes,
    }


def window_mask_bytes(seq_len: int, window: int | None, dtype_bytes: int) -> int:
    """The sliding window's additive mask SDPA keeps for backward: one [L, L] in the compute dtype
    shared by every layer (`models.llama.window_bias`); none when the window covers the sequence
    (docs/design.md#model-families)."""
    return seq_len * seq_len * dtype_bytes if window is not None and window < seq_len else 0


def tp_comm_formula_text(sequence_parallel: bool) -> str:
    """`tp_comm_formula` in words, for tables."""
    if not sequence_parallel:
        return "AR (4n+2)·BLD + 3·BL"
    return "AG (4n+2)·BLD + RS (4n+2)·BLD + AR 3·BL + (2n+1)·D"


# -- pipeline bubble (docs/design.md#pipeline-schedules) -------------------------------------------


def bubble_formula(name: str, P: int, M: int, V: int = 1) -> float:
    """Textbook bubble fraction (idle share of P ranks over one step) of schedule ``name``; exact in
    the simulator under the conditions in `fivefold.pipeline.simulator`."""
    if name in ("gpipe", "1f1b"):
        return (P - 1) / (M + P - 1)
    if name == "interleaved":
        return (P - 1) / (V * M + P - 1)
    if name == "zb-h1":
        return (P - 1) / (3 * M + P - 1)
    raise ValueError(
        f"no bubble formula for schedule {name!r}; known: gpipe, 1f1b, interleaved, zb-h1"
    )


def pipeline_idle(
    name: str, P: int, F: float, B: float, W: float, FB: float | None = None
) -> float:
    """Idle time of one rank over one step in DeepSeek-V3's accounting (its Table 2), F, B (= I + W)
    and W being one stage's (DualPipeV: one half-size chunk's) pass costs: 1F1B (P-1)(F+B); ZB-H1
    (P-1)(F+B-2W); DualPipeV (P-1)(F&B+B-3W) — DualPipe's (PP/2-1)(F&B+B-3W) at PP = 2P, DualPipeV
    being DualPipe cut in half — with F&B an overlapped unit's cost (``FB``; F+B when its passes run
    one after the other). With chunks half a stage, DualPipeV idles less than ZB-H1 by
    (P-1)(F-W)/2 + (P-1)(F+B-F&B)/2 in stage units: nothing when F = W and the unit is not
    overlapped. The simulator gives these exactly (DualPipeV with F&B < F+B: on its most idle
    rank)."""
    if name in ("gpipe", "1f1b"):
        return (P - 1) * (F + B)
    if name == "zb-h1":
        return (P - 1) * (F + B - 2 * W)
    if name == "dualpipev":
        return (P - 1) * ((F + B if FB is None else FB) + B - 3 * W)
    raise ValueError(f"no idle formula for schedule {name!r}; known: gpipe, 1f1b, zb-h1, dualpipev")


# -- context parallel (docs/design.md#context-parallelism) -----------------------------------------
def ring_attention_p2p_elements(
    batch: int, seq_len: int, n_kv_heads: int, head_dim: int, cp: int
) -> dict[str, int]:
    """Elements one rank sends per attention layer with ring attention over `cp` ranks: its K and V
    shard (2·B·(L/C)·H_kv·d, the textbook 2·L·D/C scaled by H_kv/H for GQA) C-1 times in forward; in
    backward the shards go around again (C-1) and each shard's dK/dV accumulator travels with them
    and then home (C)."""
    shard = 2 * batch * (seq_len // cp) * n_kv_heads * head_dim
    return {
        "forward_kv": shard * (cp - 1),
        "backward_kv": shard * (cp - 1),
        "backward_dkv": shard * cp if cp > 1 else 0,
    }


def ulysses_kv_heads(n_heads: int, n_kv_heads: int, ulysses: int) -> int:
    """The kv heads a rank puts into Ulysses' all-to-all over `ulysses` ranks: its own when U
    divides them, else each repeated U / H_kv times (U heads); H and H_kv per tp rank."""
    return n_kv_heads if n_kv_heads % ulysses == 0 else ulysses


def ulysses_all_to_all_elements(
    batch: int,
    seq_len: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    cp: int,
    ulysses: int,
) -> dict[str, int]:
    """Elements one rank puts into Ulysses' all-to-alls per attention layer (the message, its own
    1/U included; it sends (U-1)/U of it) over U = `ulysses` of the `cp` ranks, with S = L/C
    local tokens and H, H_kv per tp rank: q, k, v packed in one, then the output, in forward; the
    output's gradient, then q's, k's and v's in backward. Constant in C at fixed S·C = L: each is
    B·(L/C)·(H + 2·H_kv')·d with U ≤ C — against ring attention's C-1 K/V hops."""
    if ulysses <= 1:
        return {"forward_qkv": 0, "forward_out": 0, "backward_out": 0, "backward_qkv": 0}
    local = batch * (seq_len // cp) * head_dim
    qkv = local * (n_heads + 2 * ulysses_kv_heads(n_heads, n_kv_heads, ulysses))
    out = local * n_heads
    return {"forward_qkv": qkv, "forward_out": out, "backward_out": out, "backward_qkv": qkv}


def cp_kept_elements(
    batch: int,
    seq_len: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    cp: int,
    ulysses: int,
) -> int:
    """Elements one attention layer's context-parallel collectives receive in forward, which
    selective-op recompute keeps until the backward (`ops.collective_outputs`: issued once, not
    again): Ulysses' q, k, v and output messages over U = `ulysses` ranks, and the ring's R - 1
    incoming K/V shards over R = cp / U ranks with the kv heads a rank holds after the all-to-all
    (H, H_kv per tp rank)."""
    kept = 0
    if ulysses > 1:
        a2a = ulysses_all_to_all_elements(
            batch, seq_len, n_heads, n_kv_heads, head_dim, cp, ulysses
        )
        kept += a2a["forward_qkv"] + a2a["forward_out"]
        n_kv_heads = ulysses_kv_heads(n_heads, n_kv_heads, ulysses) // ulysses
    ring = cp // ulysses
    if ring > 1:
        kept += ring_attention_p2p_elements(batch, seq_len, n_kv_heads, head_dim, ring)[
            "forward_kv"
        ]
    return kept


# -- activation memory (Korthikanti et al. 2023 Table 2; docs/design.md#activation-memory) ---------


class MicroBatch(NamedTuple):
    """One rank's micro-batch of activations, as the activation formulas below take it
    (docs/design.md#activation-memory): ``batch`` sequences of ``seq_len`` tokens (this rank's,
    after context parallelism) of width ``dim``, in ``dtype_bytes`` per element, under ``tp``-way
    tensor parallelism, ``sp`` its sequence parallelism (the norms' tensors and residuals
    [L/T]). A named tuple, immutable: this module imports only `typing`."""

    batch: int
    seq_len: int
    dim: int
    dtype_bytes: int = 4
    tp: int = 1
    sp: bool = False

    @property
    def seq_norm(self) -> int:
        """The tokens a rank's norms and residuals hold: [L/T] under SP, else [L]."""
        return self.seq_len // self.tp if self.sp else self.seq_len


def korthikanti_block_bytes(batch: int, seq_len: int, dim: int, n_heads: int) -> int:
    """Korthikanti et al.'s formula, 34·B·L·D + 5·B·L²·H bytes per block: a GPT-3 block (LayerNorm,
    MHA, GeLU MLP of 4D, dropout masks) in fp16, every activation saved.
    `activation_bytes_per_block` applies the same accounting to fivefold's Llama block."""
    return 34 * batch * seq_len * dim + 5 * batch * seq_len**2 * n_heads


class SavePlan(NamedTuple):
    """Op-level selective recompute's save set (`train.recompute_save`, resolved by
    `fivefold.models.recompute_policy.save_plan`): the op groups whose outputs a block saves at
    every call (``always``) and at its 1st, 3rd, ... call (``every_other``); the rest runs again."""

    always: frozenset[str] = frozenset()
    every_other: frozenset[str] = frozenset()

    def saves(self, group: str) -> bool:
        return group in self.always or group in self.every_other


# A dense block's linears in forward order (its "mm" calls: a biased one is addmm), and which are
# row-parallel under TP (their output is [B, L, D] partial sums, the exit's collective's buffer).
BLOCK_LINEARS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")
_ROW_PARALLEL = ("wo", "w2")


def saved_linears(save: SavePlan, n: int = len(BLOCK_LINEARS)) -> list[bool]:
    """Which of a block's first ``n`` linears' outputs ``save`` keeps."""
    if "mm" in save.always:
        return [True] * n
    return [("mm" in save.every_other and i % 2 == 0) for i in range(n)]


def activation_bytes_per_block(
    mb: MicroBatch,
    n_heads: int,
    n_kv_heads: int,
    ffn_hidden: int,
    *,
    ffn_bytes: int | None = None,
    attention: str = "sdpa",
    recompute: str = "none",
    save: SavePlan | None = None,
) -> int:
    """Bytes one dense Llama block keeps for backward on one rank for the micro-batch ``mb`` (what
    it adds to memory: its saved tensors apart from its input, plus its output, the next block's
    input), counted tensor by tensor as Korthikanti et al. do for the GPT block
    (`korthikanti_block_bytes`; docs/design.md#activation-memory);
    `fivefold.observe.memory.block_activation_bytes` measures it.

    With s = ``mb.dtype_bytes`` and F = ``ffn_hidden``, no recompute:
      attention  block input (fp32 in the RMSNorm), 1/rms (B·L, fp32), normalised (s), the
                 norm's output = the input of wq/wk/wv (s); q, k and v: sdpa with their own
                 heads, B·L·(H + 2·H_kv)·d·s (GQA handed to the kernel), eager with k and v
                 repeated to H heads, 3·B·L·H·d·s; the core's output = wo's input (s); the
                 core's own: sdpa (fused) the log-sum-exp B·H·L fp32, eager the softmax B·H·L²
                 (s) and its L×L causal mask (1 byte)
      MLP        residual h (fp32 in the norm), 1/rms, normalised, the norm's output = input of
                 w1/w3 (s); w1·x, w3·x, silu(w1·x) and their product = w2's input (4·B·L·F·s)
    i.e. (8 + 2·H_kv/H)·BLD + 4·BLF (eager: 10·BLD + 4·BLF; + the core's term) elements in fp32 —
    where GPT's is 34·BLD + 5·BL²H bytes in fp16. ``recompute``: "full" keeps only the block's
    input (B·L·D·s); "selective" recomputes the attention core, keeping its inputs q, k, v (k and v
    with their own H_kv heads) and dropping the eager core's repeats and the core's own term;
    "selective-op" keeps the outputs of the ops ``save`` names (`selective_op_block_bytes`).
    ``mb.tp``: heads and F split T ways; ``mb.sp``: the norms' tensors and the residuals are [L/T]
    too, but the column linears keep their all-gathered [L] inputs (Megatron re-gathers them in
    backward instead: not done here, so SP divides this formula by less than T). An MoE block:
    ``ffn_bytes`` (`moe_ffn_activation_bytes`) in place of the dense feed-forward's 4·B·L·F·s."""
    if recompute not in ("none", "full", "selective", "selective-op"):
        raise ValueError(f"recompute={recompute!r}: choose none, full, selective or selective-op")
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention={attention!r}: choose sdpa or eager")
    batch, seq_len, dim, tp = mb.batch, mb.seq_len, mb.dim, mb.tp
    s, fp32, seq_norm = mb.dtype_bytes, 4, mb.seq_norm
    bl, bld_norm = batch * seq_len, batch * seq_norm * dim
    if recompute == "full":
        return bld_norm * s
    if recompute == "selective-op":
        return selective_op_block_bytes(
            mb,
            n_heads,
            n_kv_heads,
            ffn_hidden,
            save if save is not None else SavePlan(),
            attention=attention,
            ffn_bytes=ffn_bytes,
        )
    heads, kv_heads, hidden = n_heads // tp, n_kv_heads // tp, ffn_hidden // tp
    head_dim = dim // n_heads
    local_d = heads * head_dim
    norms = 2 * (
        bld_norm * fp32 + batch * seq_norm * fp32 + bld_norm * s
    )  # input, 1/rms, normalised: x and h
    linear_inputs = (
        2 * bl * dim * s
    )  # the norms' outputs as the column linears keep them (all-gathered under SP)
    core_out = bl * local_d * s
    mlp = (
        4 * bl * hidden * s if ffn_bytes is None else ffn_bytes
    )  # an MoE block: `moe_ffn_activation_bytes`
    own_heads = bl * (heads + 2 * kv_heads) * head_dim * s  # q, k, v as the projections made them
    if recompute == "selective":
        qkv, core = own_heads, 0
    elif attention == "sdpa":  # the fused kernel keeps k and v un-repeated (enable_gqa)
        qkv, core = own_heads, batch * heads * seq_len * fp32
    else:  # eager: k and v repeated to H heads, the probabilities and the mask
        qkv, core = 3 * bl * local_d * s, batch * heads * seq_len**2 * s + seq_len**2
    return norms + linear_inputs + qkv + core_out + core + mlp


def selective_op_block_bytes(
    mb: MicroBatch,
    n_heads: int,
    n_kv_heads: int,
    ffn_hidden: int,
    save: SavePlan,
    *,
    attention: str = "sdpa",
    ffn_bytes: int | None = None,
) -> int:
    """`activation_bytes_per_block` under ``train.recompute = "selective-op"``: the block keeps
    only the outputs of the ops ``save`` names (torch's selective checkpoint holds them until the
    backward; the inputs are the previous block's), the buffers its collectives wrote (each issued
    once, in the forward: `ops.collective_outputs`) and its output. With s = ``mb.dtype_bytes``:
      mm       the linears' outputs in forward order (`BLOCK_LINEARS`): wq B·L·H·d, wk and wv
               B·L·H_kv·d, wo B·L·D, w1 and w3 B·L·F, w2 B·L·D (× s; heads and F over T); all of
               them, or every other (wq, wv, w1, w2)
      sdpa     the fused core's output B·L·H·d·s and log-sum-exp B·H·L fp32 (sdpa core only)
      bmm      the eager core's scores B·H·L²·s and weighted values B·H·L·d·s
      softmax  the eager core's probabilities B·H·L²·s
      TP       without SP each exit's all-reduce buffer, wo's and w2's output (B·L·D·s: nothing
               more where mm keeps that linear); with SP the two all-gathered inputs (B·L·D·s) and
               the two reduce-scattered exits (B·(L/T)·D·s)
      output   B·(L/T under SP)·D·s
    An MoE block (``ffn_bytes``): its attention half as above (its 4 linears), the feed-forward
    priced at ``ffn_bytes``, its no-recompute bytes (more than it keeps: an upper bound)."""
    batch, seq_len, dim, tp, s = mb.batch, mb.seq_len, mb.dim, mb.tp, mb.dtype_bytes
    heads, kv_heads, hidden = n_heads // tp, n_kv_heads // tp, ffn_hidden // tp
    head_dim = dim // n_heads
    bl, bld_norm = batch * seq_len, batch * mb.seq_norm * dim
    outputs = {
        "wq": heads * head_dim,
        "wk": kv_heads * head_dim,
        "wv": kv_heads * head_dim,
        "wo": dim,
        "w1": hidden,
        "w3": hidden,
        "w2": dim,
    }
    linears = BLOCK_LINEARS if ffn_bytes is None else BLOCK_LINEARS[:4]
    kept = dict(zip(linears, saved_linears(save, len(linears))))
    total = sum(bl * outputs[name] * s for name, saved in kept.items() if saved)
    if attention == "sdpa" and save.saves("sdpa"):
        total += bl * heads * head_dim * s + batch * heads * seq_len * 4
    if attention == "eager":
        scores = batch * heads * seq_len * seq_len * s
        total += (scores + bl * heads * head_dim * s) * save.saves("bmm")
        total += scores * save.saves("softmax")
    if tp > 1 and mb.sp:  # the entries' gathered [L] inputs, the exits' scattered [L/T] outputs
        total += 2 * bl * dim * s + 2 * bld_norm * s
    elif tp > 1:  # the exits' all-reduced buffers: the row-parallel linears' outputs
        total += sum(bl * dim * s for name in _ROW_PARALLEL if name in kept and not kept[name])
        total += bl * dim * s * (ffn_bytes is not None)  # an MoE block's exit
    return total + (ffn_bytes or 0) + bld_norm * s


class BlockShape(Protocol):
    """What `selective_op_recompute_flops` needs of a model config (`LlamaConfig` has it)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    head_dim: int


def selective_op_recompute_flops(
    config: BlockShape,
    tokens: float,
    save: SavePlan,
    *,
    tp: int = 1,
    attention: str = "sdpa",
    core_flops: float = 0.0,
) -> float:
    """Forward FLOPs one dense block runs again in its backward under selective-op, for ``tokens``
    tokens on one rank: 2 per weight and token of each linear whose output ``save`` does not keep
    (`BLOCK_LINEARS`; every other: wk, wo, w3) but the last, w2 — torch's non-reentrant
    checkpoint stops recomputing once the backward has every tensor it saved, and nothing saves
    w2's output —, over ``tp``, and ``core_flops`` (the attention core's forward) unless its
    outputs are kept (sdpa: "sdpa"; eager: "bmm"). ``save`` = `SavePlan()` (nothing kept) is full
    recompute's linears."""
    d, hd, f = config.dim, config.head_dim, config.ffn_hidden
    q, kv = config.n_heads * hd, config.n_kv_heads * hd
    weights = dict(zip(BLOCK_LINEARS, (d * q, d * kv, d * kv, q * d, d * f, d * f, f * d)))
    kept = saved_linears(save)
    again = sum(w for (name, w), k in zip(weights.items(), kept) if not k and name != "w2")
    core_kept = save.saves("sdpa" if attention == "sdpa" else "bmm")
    return 2 * tokens * again / tp + (0.0 if core_kept else core_flops)


# -- one flat buffer's model states, exactly as a rank holds them (what `fivefold.plan` sums) ------


def flat_model_state_bytes(
    padded: int,
    shard: int,
    owned: int,
    segments: int,
    *,
    stage: int,
    param_bytes: int,
    grad_bytes: int,
    separate_master: bool,
    hpz: int = 0,
    offload: bool = False,
    state: int | None = None,
) -> dict[str, int]:
    """Bytes one rank holds for one flat buffer of ``padded`` elements (a bucket; a unit under
    ZeRO-3) whose shard is ``shard`` elements (= ``padded`` at stage 0), ``owned`` of them real (not
    padding), in ``segments`` optimizer tensors: the 2Ψ + 2Ψ + KΨ of
    docs/design.md#model-state-memory per buffer, with the padding and the per-tensor `step`
    counters the formula leaves out. Parameters: the full buffer (stages 0-2) or the shard (3), plus
    hpZ's 1/``hpz`` secondary copy; gradients: the full buffer (0-1; ZeRO-1 reduces into it) or the
    shard (2-3), in the reduce dtype; optimizer: the fp32 master shard when the parameters are not
    fp32 (else the shard itself is the master), Adam's m and v over the owned elements, 4 bytes of
    `step` per tensor — or ``state`` bytes of optimizer state when another optimizer steps the
    buffer (`optimizer_state_bytes`: Muon's momentum). ``offload``: the master is a host buffer of
    its own and the fp32 gradient shard has a host copy; ``host`` says how many of the bytes live
    there."""
    params = (shard if stage == 3 else padded) * param_bytes + (
        padded // hpz * param_bytes if hpz > 1 else 0
    )
    grads = (shard if stage >= 2 else padded) * grad_bytes
    master = shard * 4 if separate_master or offload else 0
    optimizer = master + (8 * owned + 4 * segments if state is None else state)
    host = optimizer + shard * 4 if offload else 0
    return {
        "params": params,
        "grads": grads + (shard * 4 if offload else 0),
        "optimizer": optimizer,
        "host": host,
    }


def optimizer_state_bytes(parts: list[tuple[int, int, int, int]]) -> int:
    """fp32 optimizer state of one rank's shard stepped by several optimizers: per optimizer
    (elements, bytes per element, optimizer tensors, bytes per tensor) — AdamW (8, 4: m and v, its
    step), Muon (4, 0: the momentum buffer) (docs/design.md#muon-under-zero)."""
    return sum(n * per_element + k * per_tensor for n, per_element, k, per_tensor in parts)


def muon_step_flops(rows: int, cols: int, ns_steps: int = 5) -> int:
    """FLOPs of Muon's update of one rows × cols matrix: the Newton-Schulz iteration on X (m × n,
    m = min, n = max: torch transposes a tall matrix), each step A = X Xᵀ (2m²n), B = bA + cA²
    (2m³), X = aX + BX (2m²n) — 4m²n + 2m³ per step, in bf16 (docs/design.md#muon-under-zero). The
    momentum and the update itself are elementwise (a few passes over the matrix, not counted)."""
    m, n = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * m * m * n + 2 * m**3)


def owner_bound(sizes: list[int], world: int) -> int:
    """The most elements the greedy whole-parameter owners (largest first onto the least-loaded
    rank) give one of `world` ranks: ⌈O/N⌉ + p_max, O the elements, p_max the largest parameter —
    a rank receives a parameter only while it holds no more than the mean
    (docs/design.md#muon-under-zero)."""
    if not sizes:
        return 0
    return -(-sum(sizes) // world) + max(sizes)


# -- FLOPs (PaLM appendix B, with causal attention counted as the half a causal kernel runs) ------


def attention_flops_per_token(n_layers: int, seq_len: int, dim: int) -> int:
    """Forward + backward FLOPs per token of attention's scores (Q·Kᵀ) and weighted values (P·V)
    under a causal mask: 6·n_layers·L·D — the half of the L × L square a causal kernel computes;
    ``dim`` is the attention's width, n_heads × head_dim (the model's width in Llama; Qwen3's
    heads are wider).
    PaLM (appendix B) and torchtitan count the whole square, 12·n·L·D; fivefold counts what runs,
    in MFU and in `fivefold plan`'s time alike (docs/design.md#flops-and-mfu)."""
    return 6 * n_layers * seq_len * dim


def model_flops_per_token(active_params: int, n_layers: int, seq_len: int, dim: int) -> int:
    """Training FLOPs per token: 6·N (forward 2N, backward 4N; N the parameters one token goes
    through, embeddings excluded as they are a lookup) + `attention_flops_per_token` (causal:
    6·n_layers·L·D). A PaLM / torchtitan MFU of the same run is this one ×
    (6·N + 12·n·L·D) / (6·N + 6·n·L·D)."""
    return 6 * active_params + attention_flops_per_token(n_layers, seq_len, dim)


def elementwise_bytes_per_block(
    mb: MicroBatch, n_heads: int, n_kv_heads: int, ffn_hidden: int
) -> int:
    """Bytes one block's forward moves through memory outside its matmuls and attention core (the
    eager kernels of fivefold's Llama block, docs/design.md#step-time-model), on one rank, for the
    micro-batch ``mb`` (s = ``mb.dtype_bytes``; N = B·L rows, [L/T] under SP for the norms and
    residuals; ``ffn_hidden``: this block's SwiGLU width per token before tp, top_k × an expert's
    for an MoE block):
      each RMSNorm  (24 + 3s)·N·D: square, mean, scale in fp32, cast, times the weight;
                    + (s + 4)·N·D for the fp32 copy of a 16-bit input
      RoPE          q's and k's elements × (40 + 2·(s + 4) for 16-bit): float copy, rotate-half
                    (negate, concatenate), two products, their sum, the cast back
      attention out 2s per element: the heads' transpose into wo's input
      SwiGLU        5s per hidden element: silu, then the product with w3·x
      residuals     2 × 3s·N·D
    A backward moves about twice its forward's bytes (each kernel's gradient reads the output's
    gradient and its saved input, writes the input's gradient): the planner charges 2×."""
    s, tp = mb.dtype_bytes, mb.tp
    wide = 0 if s == 4 else s + 4  # a 16-bit tensor's fp32 copy, and back
    rows_d = mb.batch * mb.seq_norm * mb.dim
    tokens = mb.batch * mb.seq_len
    head_dim = mb.dim // n_heads
    norms = 2 * rows_d * (24 + 3 * s + wide)
    rope = tokens * (n_heads + n_kv_heads) // tp * head_dim * (40 + 2 * wide)
    out = tokens * n_heads // tp * head_dim * 2 * s
    swiglu = tokens * ffn_hidden // tp * 5 * s
    residuals = 2 * 3 * s * rows_d
    return norms + rope + out + swiglu + residuals


def eager_softmax_bytes(mb: MicroBatch, n_heads: int) -> int:
    """Bytes the eager attention core's forward moves on its B·(H/T)·L² scores besides its two
    matmuls: the scale (read, write), the causal mask's fill (read, write) and the softmax (read,
    write), 6 passes of s bytes per score."""
    return 6 * mb.batch * (n_heads // mb.tp) * mb.seq_len**2 * mb.dtype_bytes


def loss_elementwise_bytes(mb: MicroBatch, vocab: int) -> int:
    """Bytes the head's loss moves in its forward on one rank: the chunked cross-entropy reads the
    logits (B·L·V/T·s) and makes fp32 chunks of them for the log-sum-exp (write and read, 8 bytes
    per logit); its backward writes the logits' gradient, about twice that (2×, as
    `elementwise_bytes_per_block`)."""
    return mb.batch * mb.seq_len * vocab // mb.tp * (mb.dtype_bytes + 8)


def head_activation_bytes(mb: MicroBatch, vocab: int) -> int:
    """What the model's end keeps for backward on the last pipeline rank for the micro-batch ``mb``:
    the final RMSNorm (its fp32 input, 1/rms, the normalised tensor, its output = the head's input,
    all-gathered to the whole sequence under SP) and this tp rank's logits B·L·V/T
    (``mb.dtype_bytes``); the chunked cross-entropy keeps only per-row fp32 statistics
    (`tensor_parallel.loss`): the log-sum-exp and the target logit, 2·B·L·4."""
    batch, seq_len, dim, dtype_bytes, tp = mb.batch, mb.seq_len, mb.dim, mb.dtype_bytes, mb.tp
    seq_norm = mb.seq_norm
    norm = batch * seq_norm * dim * 4 + batch * seq_norm * 4 + batch * seq_norm * dim * dtype_bytes
    return (
        norm
        + batch * seq_len * dim * dtype_bytes
        + batch * seq_len * vocab // tp * dtype_bytes
        + 2 * batch * seq_len * 4
    )


def moe_ffn_activation_bytes(
    tokens: int,
    dim: int,
    experts: int,
    top_k: int,
    hidden: int,
    shared_hidden: int = 0,
    *,
    dtype_bytes: int = 4,
) -> int:
    """What an MoE feed-forward (`models.moe.MoEFeedForward`, dropless) keeps for backward for
    ``tokens`` T tokens with R = T·k (token, expert) rows, balanced routing (under expert
    parallelism a rank's experts receive R rows on average): the router's fp32 logits and scores
    (2·T·E·4), the chosen experts and weights (T·k·(8 + 4 + 4)), the per-expert counts (E·8), the
    rows' token ids, sort order and weights (R·(8 + 8 + 4)), the experts' input rows, their outputs
    and the weighted outputs (3·R·D·s), their SwiGLU tensors as the dense block's (4·R·F·s), and the
    shared experts' (4·T·F_shared·s). Measured (`memory.block_activation_bytes`): within 0.1 %."""
    s, rows = dtype_bytes, tokens * top_k
    router = 2 * tokens * experts * 4 + tokens * top_k * 16 + experts * 8
    return (
        router
        + rows * 20
        + 3 * rows * dim * s
        + 4 * rows * hidden * s
        + 4 * tokens * shared_hidden * s
    )


def weight_grad_pending_bytes(
    mb: MicroBatch, n_heads: int, n_kv_heads: int, ffn_hidden: int
) -> dict[str, int]:
    """What a dense block still holds for the micro-batch ``mb`` (``mb.sp`` changes nothing here)
    between its input-gradient pass (I) and its weight-gradient pass (W) in a zero-bubble schedule
    (`ops.linear`'s deferral): each linear's input and its output's gradient. Inputs: the attention
    norm's output (wq, wk, wv share it), the core's output (wo), the MLP norm's output (w1, w3 share
    it), SwiGLU's product (w2); gradients: of q, k, v, of wo's and w2's outputs (B·L·D each:
    partial sums under tp), of w1's and w3's. The rest of `activation_bytes_per_block` dies at I.
    Returned apart: ``inputs`` (allocated by the forward) and ``grads`` (by the I pass)."""
    s, bl, dim, tp = mb.dtype_bytes, mb.batch * mb.seq_len, mb.dim, mb.tp
    heads, kv_heads, hidden, head_dim = (
        n_heads // tp,
        n_kv_heads // tp,
        ffn_hidden // tp,
        dim // n_heads,
    )
    inputs = 2 * bl * dim + bl * heads * head_dim + bl * hidden
    grads = bl * (heads + 2 * kv_heads) * head_dim + 2 * bl * dim + 2 * bl * hidden
    return {"inputs": inputs * s, "grads": grads * s}


def backward_working_bytes(mb: MicroBatch, ffn_hidden: int) -> int:
    """What a block's backward allocates while it runs for the micro-batch ``mb``, beyond the
    activations it frees: the gradients flowing through it — of its output and its residual (B·L·D
    each, [L/T] under SP), the RMSNorm's fp32 upcasts of its input and gradient (2·B·L·D·4) — and
    the SwiGLU's three B·L·F/T gradients (of w2's input and of w1's and w3's outputs); an upper
    estimate, measured within it in `tests/test_plan.py`."""
    s = mb.dtype_bytes
    return (
        mb.batch * mb.seq_norm * mb.dim * (2 * s + 2 * 4)
        + 3 * mb.batch * mb.seq_len * ffn_hidden // mb.tp * s
    )


def loss_chunk_bytes(
    batch: int, seq_len: int, vocab: int, tp: int = 1, chunk_elements: int = 2**24
) -> int:
    """The chunked cross-entropy's fp32 working chunk (`tensor_parallel.loss`): at most
    ``chunk_elements`` of this rank's B·L × V/T logits, upcast, in forward and again in backward."""
    return min(batch * seq_len * (vocab // tp), max(vocab // tp, chunk_elements)) * 4
