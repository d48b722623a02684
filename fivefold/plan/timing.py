"""An estimated step time, from FLOPs and link bandwidths — a model, not a measurement (no GPU has
checked it).

Compute runs at ``Hardware.compute_efficiency`` of the peak; attention's FLOPs count the causal half
of the L × L square (a flash kernel skips the rest; MFU keeps PaLM's whole square,
`formulas.model_flops_per_token`). Every transfer takes its ring wire bytes over its group's link
(intra-node when the group fits in a node), no latency term. Per micro-batch and stage, in the
schedule simulation: a pass lasts as long as the longer of its compute and the data-parallel traffic
fivefold overlaps with it (ZeRO-3's prefetched gathers; without pp the bucket reductions beside the
backward), plus its share of TP and expert traffic and of ring attention's K/V beyond the
attention's own compute (on the critical path); pipeline messages delay the next stage. Then what
runs after the micro-batches (a pipeline's deferred reduction, ZeRO-1/2's all-gather of the updated
parameters) and the optimizer streaming its states through memory."""

from __future__ import annotations

from typing import Any

from fivefold import formulas
from fivefold.config import Config
from fivefold.models.parallelize import PipelinedModel
from fivefold.models.recompute_policy import save_plan
from fivefold.pipeline.actions import B, F, I, W
from fivefold.pipeline.simulator import simulate
from fivefold.plan.assembly import Parts, engines_of, local_numels, precision_bytes, stages_of
from fivefold.plan.hardware import GB, Hardware, link
from fivefold.plan.memory import RankMemory
from fivefold.plan.traffic import Transfer
from fivefold.run_plan import RunPlan

__all__ = ["attention_flops_per_token", "step_time", "transfer_seconds"]


def attention_flops_per_token(run: RunPlan, cfg: Config, blocks: int, causal: bool) -> float:
    """Forward + backward FLOPs of attention's scores and weighted values per token of one rank, for
    `blocks` blocks: 12·L·D per block (PaLM), half of it when the causal kernel skips the masked
    half; over tp."""
    return 12 * blocks * cfg.train.seq_len * run.model.dim / run.dims.tp / (2 if causal else 1)


def _stage_flops(
    cfg: Config, run: RunPlan, stage: Any, numels: dict[str, int]
) -> tuple[float, float]:
    """(forward, backward) FLOPs of one micro-batch through one stage on one rank: 2 (forward) and 4
    (backward) per parameter and token it computes (embeddings are lookups; an MoE block's rows go
    to top_k experts, spread over the ep ranks), and attention (causal half); full recompute runs
    the forward again in backward, selective the attention core, selective-op the linears (and
    core) whose outputs its save set does not keep (`formulas.selective_op_recompute_flops`; an
    MoE block priced as a dense one)."""
    m, d = run.model, run.dims
    tokens = run.micro_batch * cfg.train.seq_len / d.cp
    active = 0.0
    for name, numel in numels.items():
        if name.startswith("tok_embeddings"):
            continue
        active += numel * (m.moe.top_k * d.ep / m.moe.experts if ".experts." in name else 1)
    blocks = len(stage.layers) if stage.layers is not None else 0
    attention = attention_flops_per_token(run, cfg, blocks, causal=True) * tokens
    forward = 2 * active * tokens + attention / 3
    backward = 4 * active * tokens + 2 * attention / 3
    if cfg.train.recompute == "full":
        backward += forward
    elif cfg.train.recompute == "selective":
        backward += attention / 3
    elif cfg.train.recompute == "selective-op":  # the linears not saved, the core unless saved
        core = cfg.model.attention if d.cp == 1 else "sdpa"
        backward += blocks * formulas.selective_op_recompute_flops(
            m, tokens, save_plan(cfg.train.recompute_save), tp=d.tp, attention=core,
            core_flops=attention / 3 / max(blocks, 1),
        )  # fmt: skip
    return forward, backward


def transfer_seconds(
    transfers: list[Transfer],
    run: RunPlan,
    hw: Hardware,
    phases: tuple[str, ...],
    dims: tuple[str, ...] | None = None,
) -> float:
    """Seconds the `transfers` of these phases (and dims) take on their links, one after the
    other."""
    return sum(
        t.wire_bytes / (link(t.dim, run.dims, hw, t.group)[1] * GB)
        for t in transfers
        if t.phase in phases and (dims is None or t.dim in dims)
    )


def step_time(
    cfg: Config,
    run: RunPlan,
    hw: Hardware,
    parts_by_rank: dict[int, Parts],
    transfers: dict[int, list[Transfer]],
    memory: dict[int, RankMemory],
) -> tuple[dict[str, float], float | None]:
    """Seconds of one step by part, and the simulated bubble (None without pp)."""
    d, M = run.dims, run.grad_accum
    flops_per_s = hw.peak_tflops * 1e12 * hw.compute_efficiency
    cost: dict[int, tuple[float, float]] = {}  # virtual stage -> (F, B) seconds of one micro-batch
    compute: dict[int, float] = {}  # virtual stage -> compute seconds of one micro-batch
    blocking: dict[int, float] = {}
    for r, parts in parts_by_rank.items():
        stages, numels = stages_of(parts), local_numels(parts)
        moved = transfers[r]
        blocks = sum(len(st.layers) if st.layers is not None else 0 for st in stages.values())
        attention = (
            attention_flops_per_token(run, cfg, blocks, causal=True)
            * run.micro_batch
            * cfg.train.seq_len
            / d.cp
            / flops_per_s
        )
        ring = transfer_seconds(moved, run, hw, ("model",), ("cp",)) / M
        # ring attention's K/V travel while the attention computes: only the excess waits
        model = transfer_seconds(moved, run, hw, ("model",)) / M - ring + max(0.0, ring - attention)
        blocking[r] = model * M
        forward_dp = transfer_seconds(moved, run, hw, ("forward",)) / M / len(stages)
        backward_dp = transfer_seconds(moved, run, hw, ("backward",)) / M / len(stages)
        for sid, stage in stages.items():
            f, b = (x / flops_per_s for x in _stage_flops(cfg, run, stage, numels[sid]))
            share = model / len(stages)
            cost[sid] = (max(f, forward_dp) + share / 3, max(b, backward_dp) + 2 * share / 3)
            compute[sid] = f + b
    bubble = None
    if isinstance(next(iter(parts_by_rank.values())), PipelinedModel):
        schedule = next(iter(parts_by_rank.values())).schedule
        heavier = max(
            cost.values(), key=sum
        )  # stages of ranks not laid out (`search`) cost as the heavier end

        def action_cost(a: Any) -> float:
            f, b = cost.get(a.stage, heavier)
            return {F: f, B: b, I: b / 2, W: b / 2}[a.kind]

        seq = cfg.train.seq_len // d.cp
        message = (
            run.micro_batch
            * (seq // d.tp if cfg.parallel.sp else seq)
            * run.model.dim
            * precision_bytes(cfg)[0]
        )
        timeline = simulate(schedule, action_cost, comm_cost=message / (link("pp", d, hw)[1] * GB))
        pipeline, bubble = timeline.makespan, timeline.bubble_fraction
        busiest = max(
            range(d.pp), key=lambda r: sum(compute.get(s, 0.0) for s in schedule.stages_of(r))
        )
        compute_time = (
            sum(compute.get(s, max(compute.values())) for s in schedule.stages_of(busiest)) * M
        )
    else:
        f, b = cost[0]
        pipeline, compute_time = M * (f + b), M * compute[0]
    after = max(transfer_seconds(moved, run, hw, ("after",)) for moved in transfers.values())
    during = max(
        transfer_seconds(moved, run, hw, ("forward", "backward")) for moved in transfers.values()
    )
    pb, gb = precision_bytes(cfg)
    optimizer = max(
        2
        * (
            memory[r].model_states["optimizer"]
            + sum(f.shard_numel for _, e in engines_of(parts) for f in e.flats) * (gb + pb)
        )
        for r, parts in parts_by_rank.items()
    ) / (hw.hbm_gbps * GB)
    time = {
        "compute": compute_time,
        "pipeline": pipeline,
        "model traffic not hidden": max(blocking.values()),
        "data-parallel during passes": during,
        "after the micro-batches": after,
        "optimizer": optimizer,
    }
    time["step"] = pipeline + after + optimizer
    return time, bubble
