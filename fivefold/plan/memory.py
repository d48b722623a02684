"""One rank's bytes by part: model states (per flat buffer with its padding,
docs/design.md#model-state-memory), the buffers that come and go during a step, and the activations
kept for backward (docs/design.md#activation-memory). `tests/test_plan.py` holds each against
`fivefold.observe.memory`'s measurements."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from fivefold import formulas
from fivefold.config import Config
from fivefold.models.parallelize import PipelinedModel
from fivefold.models.recompute_policy import save_plan
from fivefold.pipeline.actions import B, F, I, Schedule, W
from fivefold.pipeline.simulator import simulate
from fivefold.plan.assembly import (
    Parts,
    engines_of,
    local_numels,
    precision_bytes,
    rank_parts,
    resolved,
    stages_of,
)
from fivefold.run_plan import RunPlan

__all__ = [
    "BACKWARD_ALLOCATED",
    "LOGITS_GRAD",
    "LOSS_CHUNK",
    "RECOMPUTED",
    "RankMemory",
    "WORKING",
    "W_GRADS",
    "activation_bytes",
    "block_bytes",
    "in_flight",
    "kind_bytes",
    "rank_memory",
    "runtime_bytes",
]

RECOMPUTED = "recomputed block (in its backward)"
W_GRADS = "output gradients awaiting W"  # allocated by I passes, not by forwards
LOGITS_GRAD = "logits gradient (head backward)"
LOSS_CHUNK = "loss fp32 chunk (head backward)"
WORKING = "a block's backward working set"
BACKWARD_ALLOCATED = (RECOMPUTED, W_GRADS, LOGITS_GRAD, LOSS_CHUNK, WORKING)  # made by a backward


@dataclass
class RankMemory:
    """One pipeline rank's bytes (every dp / tp / cp / ep rank of it alike, dp rank 0 holding the
    most padding)."""

    pp_rank: int
    # parameters this rank's share of the model has, before ZeRO shards them (its stages, TP slice)
    params: int
    model_states: dict[
        str, int
    ]  # params / grads / optimizer / total; host: the part of them in host memory
    transient: dict[str, int]  # buffers alive at the backward's peak besides the model states
    activations: dict[
        str, int
    ]  # kept for backward at the peak (blocks × micro-batches in flight, ends), and the
    # activation-sized tensors a backward makes (`BACKWARD_ALLOCATED`)
    # what the device spends besides tensors (`runtime_bytes`: a plan for a machine adds it)
    runtime: dict[str, int] = field(default_factory=dict)
    total: int = 0  # what the device holds at the peak: everything above but the host part

    def __post_init__(self) -> None:
        self.total = self.tensors + sum(self.runtime.values())

    @property
    def tensors(self) -> int:
        """The device's bytes in tensors at the peak: the total less the runtime's."""
        return (
            self.model_states["total"]
            - self.model_states.get("host", 0)
            + sum(self.transient.values())
            + sum(self.activations.values())
        )


def _engine_states(engine: Any, cfg: Config) -> dict[str, int]:
    """The engine's model states, flat buffer by flat buffer, as its stage strategy states them
    (`data_parallel.strategies.Stage.flat_state_bytes`)."""
    pb, gb = precision_bytes(cfg)
    out = {"params": 0, "grads": 0, "optimizer": 0, "host": 0}
    for f in engine.flats:
        part = engine.strategy.flat_state_bytes(
            f, param_bytes=pb, grad_bytes=gb, state=engine.optimizer.state_bytes(f)
        )
        for k in out:
            out[k] += part[k]
    return out


def _transient(
    engine: Any, cfg: Config, accumulating: bool, reductions: int, deferred_w: bool = False
) -> dict[str, int]:
    """Buffers that come and go during a step, at the backward's peak, as the engine's stage
    strategy states them (`data_parallel.strategies.Stage.transient_bytes`): ZeRO-2/3's full
    gradient buffers (all of them while gradients accumulate unreduced: ``no_sync`` under pp or
    ``defer_reduce``) and the temporaries later reduce-scatters land in; the gradient autograd makes
    before a hook copies it into its bucket; ZeRO-3's gathered units and a unit's gradients.
    ``deferred_w`` (a zero-bubble schedule): a ZeRO-3 unit stays gathered from its I to its W, when
    its last gradient arrives — every unit of the stage."""
    pb, gb = precision_bytes(cfg)
    return engine.strategy.transient_bytes(
        param_bytes=pb,
        grad_bytes=gb,
        accumulating=accumulating,
        reductions=reductions,
        deferred_w=deferred_w,
    )


def _is_moe(block: Any) -> bool:
    """Whether a block's feed-forward routes (an MoE block)."""
    return getattr(block.feed_forward, "router", None) is not None


def block_bytes(cfg: Config, run: RunPlan, block: Any, recompute: str) -> int:
    """`formulas.activation_bytes_per_block` for one block of this rank (an MoE block with its
    feed-forward's)."""
    return kind_bytes(cfg, run, _is_moe(block), recompute)


def micro_batch(cfg: Config, run: RunPlan) -> formulas.MicroBatch:
    """This rank's micro-batch of activations as the formulas take it: its sequences, their
    tokens under cp, the model's width, the compute dtype, tp and (under tp) sp."""
    p = run.dims
    return formulas.MicroBatch(
        run.micro_batch,
        cfg.train.seq_len // p.cp,
        run.model.dim,
        dtype_bytes=precision_bytes(cfg)[0],
        tp=p.tp,
        sp=cfg.parallel.sp and p.tp > 1,
    )


def kind_bytes(cfg: Config, run: RunPlan, is_moe: bool, recompute: str) -> int:
    """`block_bytes` of a dense block or (``is_moe``) an MoE one, told by its kind instead of its
    module (selective-op: with `train.recompute_save`'s save set, and the buffers context
    parallelism's collectives received, which it keeps: `formulas.cp_kept_elements`)."""
    m, p, mb = run.model, run.dims, micro_batch(cfg, run)
    ffn = None
    moe = m.moe if is_moe else None
    if moe is not None and recompute != "full":
        hidden = moe.hidden or m.ffn_hidden
        ffn = formulas.moe_ffn_activation_bytes(
            mb.batch * mb.seq_len,
            m.dim,
            moe.experts,
            moe.top_k,
            hidden,
            moe.shared_experts * hidden,
            dtype_bytes=mb.dtype_bytes,
        )
    kept = 0
    if recompute == "selective-op" and p.cp > 1:  # the cp collectives' received buffers, kept
        kept = mb.dtype_bytes * formulas.cp_kept_elements(
            mb.batch,
            cfg.train.seq_len,
            m.n_heads // p.tp,
            max(m.n_kv_heads // p.tp, 1),
            m.head_dim,
            p.cp,
            p.cp_ulysses,
        )
    return kept + formulas.activation_bytes_per_block(
        mb,
        m.n_heads,
        m.n_kv_heads,
        m.ffn_hidden,
        attention=cfg.model.attention if p.cp == 1 else "sdpa",
        recompute=recompute,
        ffn_bytes=ffn,
        save=save_plan(cfg.train.recompute_save) if recompute == "selective-op" else None,
    )


def in_flight(schedule: Schedule, rank: int) -> tuple[int, int]:
    """(whole activations, activations awaiting W) of (stage, micro-batch) pairs on `rank` when the
    simulated schedule holds the most: a pair is whole from its F's start to its B's or I's end,
    then (after I) awaits its W until that ends; the most is taken with a pair awaiting W worth half
    a whole one (the block formulas' ratio is ~0.4), ties to more whole ones. The order decides, not
    the costs: the simulator's defaults."""
    changes: list[tuple[float, int, int, int]] = []
    for e in simulate(schedule).events[rank]:
        if e.kind == F:
            changes.append((e.start, 1, +1, 0))
        elif e.kind == B:
            changes.append((e.end, 0, -1, 0))
        elif e.kind == I:
            changes.append((e.end, 0, -1, +1))
        elif e.kind == W:
            changes.append((e.end, 0, 0, -1))
    whole = pending = 0
    best = (0, 0)
    for _, _, d_whole, d_pending in sorted(changes):
        whole, pending = whole + d_whole, pending + d_pending
        if 2 * whole + pending > 2 * best[0] + best[1]:
            best = (whole, pending)
    return best


def _activations(cfg: Config, run: RunPlan, parts: Parts, pp_rank: int) -> dict[str, int]:
    """`activation_bytes` of this rank's parts: its stages' blocks by kind, the micro-batches in
    flight (the simulator's count; 1 without pp)."""
    stages = stages_of(parts)
    if isinstance(parts, PipelinedModel):
        n_stages = parts.schedule.n_stages
        whole, pending = in_flight(parts.schedule, pp_rank)
    else:
        n_stages, whole, pending = 1, 1, 0
    blocks = [
        b
        for stage in stages.values()
        for b in (stage.layers.values() if stage.layers is not None else ())
    ]
    n_moe = sum(1 for b in blocks if _is_moe(b))
    return activation_bytes(
        cfg,
        run,
        list(stages),
        n_stages,
        ((False, len(blocks) - n_moe), (True, n_moe)),
        whole,
        pending,
    )


def activation_bytes(
    cfg: Config,
    run: RunPlan,
    stage_ids: Collection[int],
    n_stages: int,
    kinds: Iterable[tuple[bool, int]],
    whole: int,
    pending: int,
) -> dict[str, int]:
    """Bytes kept for backward at the peak by a rank holding stages `stage_ids` (of `n_stages`) with
    blocks of `kinds` ((is_moe, count) pairs) among them, `whole` (stage, micro-batch) pairs in
    flight and `pending` awaiting W (`in_flight`): every block × the micro-batches its stages have
    in flight, the embedding's output on the first stage (under full recompute it is the first
    block's kept input, counted there), the head and loss on the last (× its micro-batches in
    flight: GPipe's last stage keeps all M); and what a backward makes on top, activation-sized:
    with recompute the one block whose discarded part lives again, the head's logits gradient,
    zero-bubble's output gradients awaiting W. `memory.rank_memory` and `fits.predict_rank` both
    price with it."""
    m, t, p = run.model, cfg.train, run.dims
    s = precision_bytes(cfg)[0]
    seq = t.seq_len // p.cp
    sp = cfg.parallel.sp and p.tp > 1
    mb = micro_batch(cfg, run)
    kinds = [(moe, n) for moe, n in kinds if n]
    per_chunk = whole / len(
        stage_ids
    )  # in flight counts (stage, micro-batch) pairs: V chunks share a rank's count
    out: dict[str, int] = {
        "blocks": int(
            sum(kind_bytes(cfg, run, moe, t.recompute) * n for moe, n in kinds) * per_chunk
        )
    }
    if pending:  # zero-bubble: between I and W a block keeps only what its weight gradients need
        moe_ffn = (
            m.moe.top_k * (m.moe.hidden or m.ffn_hidden) if m.moe is not None else m.ffn_hidden
        )
        w = [
            (
                formulas.weight_grad_pending_bytes(
                    mb, m.n_heads, m.n_kv_heads, moe_ffn if moe else m.ffn_hidden
                ),
                n,
            )
            for moe, n in kinds
        ]
        out["blocks awaiting W"] = int(
            sum(x["inputs"] * n for x, n in w) * pending / len(stage_ids)
        )
        out[W_GRADS] = int(sum(x["grads"] * n for x, n in w) * pending / len(stage_ids))
    if 0 in stage_ids and t.recompute != "full":
        out["embedding"] = int(
            run.micro_batch * (seq // p.tp if sp else seq) * m.dim * s * per_chunk
        )
    if n_stages - 1 in stage_ids:
        out["head and loss"] = int(
            formulas.head_activation_bytes(mb, m.vocab_size) * max(1, per_chunk)
        )
        out[LOGITS_GRAD] = run.micro_batch * seq * m.vocab_size // p.tp * s
        out[LOSS_CHUNK] = formulas.loss_chunk_bytes(run.micro_batch, seq, m.vocab_size, p.tp)
    if kinds:
        hidden = m.moe.top_k * (m.moe.hidden or m.ffn_hidden) if m.moe is not None else m.ffn_hidden
        out[WORKING] = formulas.backward_working_bytes(mb, max(hidden, m.ffn_hidden))
    if t.recompute != "none" and kinds:
        out[RECOMPUTED] = max(
            kind_bytes(cfg, run, moe, "none") - kind_bytes(cfg, run, moe, t.recompute)
            for moe, _ in kinds
        )
    return out


def rank_memory(cfg: Config, run: RunPlan, pp_rank: int, parts: Parts | None = None) -> RankMemory:
    """Model states, transient buffers and activations of pipeline rank `pp_rank` (its parts:
    `rank_parts`)."""
    cfg = resolved(cfg, run)
    parts = parts if parts is not None else rank_parts(cfg, run, pp_rank)
    states = {"params": 0, "grads": 0, "optimizer": 0, "host": 0}
    transient: dict[str, int] = {}
    accumulating = run.dims.pp > 1 or (cfg.zero.defer_reduce and run.grad_accum > 1)
    reductions = 1 if accumulating else run.grad_accum
    deferred_w = isinstance(parts, PipelinedModel) and any(
        a.kind == W for acts in parts.schedule.actions for a in acts
    )
    for _, engine in engines_of(parts):
        for k, v in _engine_states(engine, cfg).items():
            states[k] += v
        for k, v in _transient(engine, cfg, accumulating, reductions, deferred_w).items():
            transient[k] = transient.get(k, 0) + v
    states["total"] = states["params"] + states["grads"] + states["optimizer"]
    # the modules' own buffers (RoPE tables; this rank's positions under cp): not model states, held
    # all along
    transient["model buffers"] = sum(
        b.numel() * b.element_size() for m in parts.modules() for b in m.buffers()
    )
    mask = formulas.window_mask_bytes(
        cfg.train.seq_len, run.model.sliding_window, precision_bytes(cfg)[0]
    )
    if mask:
        transient["attention mask"] = mask
    if run.dims.cp_ulysses > 1:  # the q, k, v message of Ulysses' all-to-all: sent and received
        m, d = run.model, run.dims
        qkv = formulas.ulysses_all_to_all_elements(
            run.micro_batch,
            cfg.train.seq_len,
            m.n_heads // d.tp,
            max(m.n_kv_heads // d.tp, 1),
            m.head_dim,
            d.cp,
            d.cp_ulysses,
        )["forward_qkv"]
        transient["Ulysses all-to-all"] = 2 * qkv * precision_bytes(cfg)[0]
    held = sum(sum(n.values()) for n in local_numels(parts).values())
    return RankMemory(pp_rank, held, states, transient, _activations(cfg, run, parts, pp_rank))


def communicators(run: RunPlan, cfg: Config) -> list[str]:
    """The process groups a rank of this layout talks in (each a communicator with its own
    buffers): tp, pp, cp, ep of more than one rank; ZeRO's group (dp, or dp × cp under cp; HSDP's
    shard and replica groups instead), the experts' gradient group (ep_dp), hpZ's secondary group;
    and the world (the launcher's barrier)."""
    d = run.dims
    # (the hybrid talks in Ulysses' and the ring's groups, not in the cp group itself)
    cp = ("cp_ulysses", "cp_ring") if 1 < d.cp_ulysses < d.cp else ("cp",)
    dims = [dim for dim in ("tp", "pp", *cp, "ep") if d.size(dim) > 1]
    if d.dp_replicate > 1:  # HSDP: shard groups and replica groups
        dp = [dim for dim in ("dp_shard", "dp_replicate") if d.size(dim) > 1]
    else:  # ZeRO's group spans dp × cp
        dp = [dim for dim in ("dp_cp" if d.cp > 1 else "dp",) if d.size(dim) > 1]
    if run.model.moe is not None and d.ep > 1 and d.size("ep_dp") > 1:
        dp.append("ep_dp")  # the experts' gradients reduce over the ranks holding the same experts
    if cfg.zero.hpz > 1:
        dp.append("dp_hpz")
    return [*dims, *dp, "world"]


def runtime_bytes(memory: RankMemory, run: RunPlan, cfg: Config, hw: Any) -> dict[str, int]:
    """What a device spends besides tensors, each its own line (docs/design.md#memory-beyond-
    tensors): the process's CUDA context (``hw.context_gb``), the communicators' buffers
    (``hw.comm_buffer_mb`` each, `communicators`), and the caching allocator's reserve
    (``hw.allocator_reserve`` of the tensors' peak). Zero on a machine without them (the CPU)."""
    out: dict[str, int] = {}
    if hw.context_gb:
        out["CUDA context"] = int(hw.context_gb * 1e9)
    groups = communicators(run, cfg)
    if hw.comm_buffer_mb and groups:
        out[f"communicator buffers ×{len(groups)}"] = int(len(groups) * hw.comm_buffer_mb * 1e6)
    if hw.allocator_reserve:
        out[f"allocator reserve {hw.allocator_reserve:.0%}"] = int(
            memory.tensors * hw.allocator_reserve
        )
    return out
