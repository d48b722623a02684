"""What one rank sends per step, by mesh dimension and collective, as `CommLog` records it (an
all-gather's output, a reduce-scatter's or all-to-all's input, a send's tensor): ZeRO's collectives
(with ZeRO++ and HSDP) from the engines' flat buffers, TP/SP, ring attention, expert all-to-alls,
pipeline messages and the gradient norm's scalars — docs/design.md#data-parallel-traffic and the
sections after it. Each entry also says when in the step it travels (`PHASES`), for the step-time
estimate. `tests/test_plan.py` holds the totals against `CommLog`, byte for byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from fivefold import formulas
from fivefold.config import Config
from fivefold.models.parallelize import PipelinedModel
from fivefold.optim.clip import DIM_ORDER
from fivefold.pipeline.actions import SEND_B, SEND_F
from fivefold.pipeline.lowering import lower
from fivefold.plan.assembly import (
    Parts,
    engines_of,
    precision_bytes,
    rank_parts,
    resolved,
    stages_of,
)
from fivefold.run_plan import RunPlan

__all__ = ["PHASES", "Transfer", "by_dim", "rank_traffic", "rank_transfers"]

# When a transfer travels: during a micro-batch's forward / backward beside the compute (ZeRO-3's
# prefetched gathers, bucket reductions overlapping the backward), inside the layers on the critical
# path ("model": TP, ring attention, expert all-to-alls), between pipeline stages ("p2p"), or after
# the micro-batches ("after": a pipeline's deferred reduction, ZeRO-1/2's all-gather of updated
# parameters, the norm's scalars)
PHASES = ("forward", "backward", "model", "p2p", "after")


class Transfer(NamedTuple):
    dim: str
    op: str
    phase: str
    nbytes: int
    group: int  # ranks in the group (its ring)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends on a ring of the group (`formulas.ring_wire_bytes`; a receive sends
        nothing)."""
        return (
            0.0 if self.op == "recv" else formulas.ring_wire_bytes(self.op, self.nbytes, self.group)
        )


def by_dim(transfers: list[Transfer]) -> dict[str, dict[str, int]]:
    """Payload bytes per dimension and collective."""
    out: dict[str, dict[str, int]] = {}
    for t in transfers:
        if t.nbytes:
            out.setdefault(t.dim, {})
            out[t.dim][t.op] = out[t.dim].get(t.op, 0) + int(t.nbytes)
    return out


def _engine(engine: Any, cfg: Config, run: RunPlan) -> list[Transfer]:
    """ZeRO's collectives per step, as the engine's stage strategy states them
    (`data_parallel.strategies.Stage.collectives`, its transport's and gather's): per gradient
    reduction an all-reduce (stage 0) or reduce-scatter (1-3; qgZ: an int8 all-to-all) of every
    bucket, HSDP's all-reduce of the shard across replicas; ZeRO-1/2's all-gather of the updated
    parameters once per step; ZeRO-3's all-gathers of every unit in each forward and again in each
    backward (qwZ: int8; hpZ: the backward's inside ``dp_hpz``). A step reduces once under pp
    (``no_sync`` over the micro-batches, after them) or ``defer_reduce`` (in the last backward),
    else in each of the ``grad_accum``."""
    pb, gb = precision_bytes(cfg)
    return [
        Transfer(*c)
        for c in engine.strategy.collectives(
            param_bytes=pb,
            grad_bytes=gb,
            reductions=1 if run.dims.pp > 1 or cfg.zero.defer_reduce else run.grad_accum,
            reduce_phase="after" if run.dims.pp > 1 else "backward",
            micro_batches=run.grad_accum,
        )
    ]


def _norm(parts: Parts, cfg: Config, run: RunPlan) -> list[Transfer]:
    """The global gradient norm (`optim.clip.global_grad_sq_norm`): one small fp32 all-reduce per
    partitioned dimension of size > 1, innermost first, of the 2^(k-1-i) squared sums still holding
    dimension i."""
    if not (cfg.train.grad_clip > 0 or cfg.train.check_finite or cfg.precision.param == "fp16"):
        return []
    dims = {d for d in ("tp", "pp", "ep") if run.dims.size(d) > 1}
    dims |= {e.comm.dim for _, e in engines_of(parts) if e.strategy.sharded and e.comm.size > 1}
    ordered = sorted(
        dims, key=lambda d: (DIM_ORDER.index(d) if d in DIM_ORDER else len(DIM_ORDER), d)
    )
    return [
        Transfer(d, "all_reduce", "after", 4 * 2 ** (len(ordered) - 1 - i), run.dims.size(d))
        for i, d in enumerate(ordered)
    ]


@dataclass(frozen=True)
class _Shape:
    n_layers: int
    dim: int


def _tp_ends(
    batch: int, seq: int, dim: int, s: int, sp: bool, first: bool, last: bool
) -> dict[str, int]:
    """The parts of `formulas.tp_comm_formula` that belong to the model's ends, for a pipeline stage
    without them: the embedding's exit (one B·L·D), the head's entry (one B·L·D), the loss's 3·B·L
    fp32 all-reduces and the final norm's weight-gradient all-reduce (SP, D)."""
    bld, loss = batch * seq * dim * s, 3 * batch * seq * 4
    if not sp:
        return {"all_reduce": (0 if first else bld) + (0 if last else bld + loss)}
    ends = (0 if first else bld) + (0 if last else bld)
    return {"all_gather": ends, "reduce_scatter": ends, "all_reduce": 0 if last else loss + dim * s}


def cp_transfers(cfg: Config, run: RunPlan, batch: int, recompute: str) -> list[Transfer]:
    """What context parallelism sends per attention layer and micro-batch of `batch` sequences
    (docs/design.md#context-parallelism), by ``parallel.cp_mode``: the ring's K/V hops over the cp
    group (its forward again under full or selective recompute, which recompute the ring); Ulysses'
    all-to-alls over its U ranks (their forward again under full recompute only: selective
    recomputes the attention inside them) and, in the hybrid, the ring over the R = cp / U ranks
    with the kv heads a rank holds after the all-to-all. Heads per tp rank."""
    m, d, s = run.model, run.dims, precision_bytes(cfg)[0]
    heads, kv_heads = m.n_heads // d.tp, max(m.n_kv_heads // d.tp, 1)
    u, ring = d.cp_ulysses, d.cp // d.cp_ulysses
    out: list[Transfer] = []
    if u > 1:
        a2a = formulas.ulysses_all_to_all_elements(
            batch, cfg.train.seq_len, heads, kv_heads, m.head_dim, d.cp, u
        )
        forward = (a2a["forward_qkv"] + a2a["forward_out"]) * (2 if recompute == "full" else 1)
        nbytes = (forward + a2a["backward_out"] + a2a["backward_qkv"]) * s
        out.append(Transfer("cp_ulysses", "all_to_all", "model", nbytes, u))
        kv_heads = formulas.ulysses_kv_heads(heads, kv_heads, u) // u
    if ring > 1:
        p2p = formulas.ring_attention_p2p_elements(
            batch, cfg.train.seq_len, kv_heads, m.head_dim, ring
        )
        again = 2 if recompute in ("full", "selective") else 1
        nbytes = (p2p["forward_kv"] * again + p2p["backward_kv"] + p2p["backward_dkv"]) * s
        dim = "cp" if u == 1 else "cp_ring"
        out += [Transfer(dim, op, "model", nbytes, ring) for op in ("send", "recv")]
    return out


def _model(parts: Parts, cfg: Config, run: RunPlan, pp_rank: int) -> list[Transfer]:
    """What the model's layers send per step on this rank: TP/SP (`formulas.tp_comm_formula` for its
    blocks), ring attention's K/V, expert all-to-alls and the load-balancing sums, and the
    pipeline's activations and gradients."""
    m, t, d = run.model, cfg.train, run.dims
    s = precision_bytes(cfg)[0]
    M, B, seq = run.grad_accum, run.micro_batch, t.seq_len // d.cp
    n_stages = parts.schedule.n_stages if isinstance(parts, PipelinedModel) else 1
    runs = (
        2 if t.recompute == "full" else 1
    )  # a recomputed block runs its forward collectives again
    out: list[Transfer] = []
    for sid, stage in stages_of(parts).items():
        blocks = list(stage.layers.values()) if stage.layers is not None else []
        if d.tp > 1:
            tp = formulas.tp_comm_formula(
                _Shape(len(blocks), m.dim), B, seq, cfg.parallel.sp, s, t.recompute
            )
            ends = _tp_ends(
                B, seq, m.dim, s, cfg.parallel.sp, first=sid == 0, last=sid == n_stages - 1
            )
            out += [
                Transfer("tp", op, "model", M * (nbytes - ends.get(op, 0)), d.tp)
                for op, nbytes in tp.items()
            ]
        if d.cp > 1:
            out += [
                x._replace(nbytes=M * x.nbytes * len(blocks))
                for x in cp_transfers(cfg, run, B, t.recompute)
            ]
        moe_blocks = sum(1 for b in blocks if getattr(b.feed_forward, "router", None) is not None)
        if moe_blocks and m.moe is not None:
            rows = (
                B * seq * m.moe.top_k
            )  # rows dispatched per micro-batch; a rank receives as many on average
            if d.ep > 1:
                per_layer = runs * (m.moe.experts * 8 + 2 * rows * m.dim * s) + 2 * rows * m.dim * s
                out.append(Transfer("ep", "all_to_all", "model", M * moe_blocks * per_layer, d.ep))
            if parts.loss_comm.size > 1:
                out.append(
                    Transfer(
                        parts.loss_comm.dim,
                        "all_reduce",
                        "model",
                        M * moe_blocks * runs * (m.moe.experts + 1) * 4,
                        parts.loss_comm.size,
                    )
                )
    if isinstance(parts, PipelinedModel):
        sends = sum(1 for a in lower(parts.schedule).actions[pp_rank] if a.kind in (SEND_F, SEND_B))
        message = B * (seq // d.tp if cfg.parallel.sp else seq) * m.dim * s
        out += [Transfer("pp", op, "p2p", sends * message, d.pp) for op in ("send", "recv")]
    return out


def rank_transfers(
    cfg: Config, run: RunPlan, pp_rank: int, parts: Parts | None = None
) -> list[Transfer]:
    """Every transfer of one step on a rank of pipeline rank `pp_rank`, with its phase."""
    cfg = resolved(cfg, run)
    parts = parts if parts is not None else rank_parts(cfg, run, pp_rank)
    out = _model(parts, cfg, run, pp_rank)
    for _, engine in engines_of(parts):
        out += _engine(engine, cfg, run)
    return out + _norm(parts, cfg, run)


def rank_traffic(
    cfg: Config, run: RunPlan, pp_rank: int, parts: Parts | None = None
) -> dict[str, dict[str, int]]:
    """Payload bytes per step on one rank of pipeline rank `pp_rank`, by mesh dimension and
    collective."""
    return by_dim(rank_transfers(cfg, run, pp_rank, parts))
