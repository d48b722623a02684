"""An estimated step time (docs/design.md#step-time-model): a model, calibrated per machine
(`Hardware`), checked against CPU runs by `python bench/run.py plan` and against published GPU runs
in docs/plan.md.

Per micro-batch and stage, `efficiency.stage_work` prices the compute: every matmul by its GEMM
shape, the attention core (the causal half of the L × L square, as MFU counts it:
`formulas.attention_flops_per_token`), the elementwise kernels by their bytes, the host's operator
launches. Every transfer takes its ring wire bytes over its group's link (intra-node when the group
fits in a node) plus a latency per collective. In the schedule simulation a pass lasts as long as
the longer of its compute and the data-parallel traffic fivefold overlaps with it (ZeRO-3's
prefetched gathers; without pp the bucket reductions beside the backward), plus its share of TP
and expert traffic and of ring attention's K/V beyond the attention's own compute (on the critical
path); pipeline messages delay the next stage. Then what runs after the micro-batches (a
pipeline's deferred reduction, ZeRO-1/2's all-gather of the updated parameters) and the optimizer
streaming its states through memory."""

from __future__ import annotations

import math
from typing import Any

from fivefold.config import Config
from fivefold.models.parallelize import PipelinedModel
from fivefold.pipeline.actions import B, F, I, W
from fivefold.pipeline.simulator import simulate
from fivefold.plan.assembly import Parts, engines_of, local_shapes, precision_bytes, stages_of
from fivefold.plan.efficiency import Work, gemm_seconds, stage_work
from fivefold.plan.hardware import GB, Hardware, link
from fivefold.plan.memory import RankMemory
from fivefold.plan.traffic import Transfer
from fivefold.run_plan import RunPlan

__all__ = ["collective_calls", "step_time", "transfer_seconds"]


def muon_seconds(engine: Any, cfg: Config, hw: Hardware) -> float:
    """Seconds of Muon's Newton-Schulz iterations over the matrices this rank's engine owns
    (`formulas.muon_step_flops`), each GEMM at its shape's efficiency (`gemm_seconds`, bf16); 0
    without Muon."""
    if cfg.optim.name != "muon":
        return 0.0
    optimizer = engine.optimizer
    seconds = 0.0
    for f in engine.flats:
        for (gid, _, _), shape in zip(f.segments, f.segment_shapes or ()):
            inner = optimizer.choice.optimizers[optimizer.group_optimizers[gid]]
            if inner.elementwise:  # (AdamW's whole parameters beside the matrices)
                continue
            m, n = min(shape), max(shape)
            step = 2 * gemm_seconds(m, m, n, hw, 2) + gemm_seconds(m, m, m, hw, 2)
            seconds += cfg.optim.muon_ns_steps * step
    return seconds


def collective_calls(t: Transfer, cfg: Config, run: RunPlan) -> int:
    """How many collectives `t`'s bytes are, for their latency: its bytes over one call's message
    — a micro-batch's activation for TP and pipeline messages, a K/V shard for ring attention, the
    routed rows for the expert all-to-alls, a bucket for ZeRO (``zero.bucket_mb``)."""
    m, d, s = run.model, run.dims, precision_bytes(cfg)[0]
    seq = cfg.train.seq_len // d.cp
    activation = run.micro_batch * seq * m.dim * s
    message = {
        "tp": activation,
        "pp": run.micro_batch * (seq // d.tp if cfg.parallel.sp else seq) * m.dim * s,
        "cp": 2 * run.micro_batch * seq * m.n_kv_heads * m.head_dim * s,
        "ep": activation * (m.moe.top_k if m.moe is not None else 1),
    }.get(t.dim, max(1, int(cfg.zero.bucket_mb * 2**20)))
    return max(1, math.ceil(t.nbytes / max(1, message))) if t.nbytes else 0


def transfer_seconds(
    transfers: list[Transfer],
    run: RunPlan,
    hw: Hardware,
    phases: tuple[str, ...],
    dims: tuple[str, ...] | None = None,
    cfg: Config | None = None,
) -> float:
    """Seconds the `transfers` of these phases (and dims) take on their links, one after the
    other; with ``cfg``, plus ``hw.collective_latency_us`` per call (`collective_calls`)."""
    return sum(
        t.wire_bytes / (link(t.dim, run.dims, hw, t.group)[1] * GB)
        + (collective_calls(t, cfg, run) * hw.collective_latency_us * 1e-6 if cfg else 0.0)
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
    cost: dict[int, tuple[float, float]] = {}  # virtual stage -> (F, B) seconds of one micro-batch
    compute: dict[int, float] = {}  # virtual stage -> compute seconds of one micro-batch
    parts_of: dict[str, float] = {}  # device seconds of the busiest rank's step, by kind
    blocking: dict[int, float] = {}
    for r, parts in parts_by_rank.items():
        stages, shapes = stages_of(parts), local_shapes(parts)
        moved = transfers[r]
        works: dict[int, Work] = {
            sid: stage_work(cfg, run, stage, shapes[sid], hw) for sid, stage in stages.items()
        }
        attention = sum(w.parts.get("attention", 0.0) for w in works.values())
        ring = transfer_seconds(moved, run, hw, ("model",), ("cp",), cfg) / M
        # ring attention's K/V travel while the attention computes: only the excess waits
        model = (
            transfer_seconds(moved, run, hw, ("model",), None, cfg) / M
            - ring
            + max(0.0, ring - attention)
        )
        blocking[r] = model * M
        forward_dp = transfer_seconds(moved, run, hw, ("forward",), None, cfg) / M / len(stages)
        backward_dp = transfer_seconds(moved, run, hw, ("backward",), None, cfg) / M / len(stages)
        for sid, work in works.items():
            f, b = work.seconds(hw)
            share = model / len(stages)
            beside = max if hw.asynchronous else (lambda a, b: a + b)  # the CPU: one after another
            cost[sid] = (beside(f, forward_dp) + share / 3, beside(b, backward_dp) + 2 * share / 3)
            compute[sid] = f + b
        mine: dict[str, float] = {}  # this rank's step, by kind (M micro-batches)
        for w in works.values():
            for kind, seconds in w.parts.items():
                mine[kind] = mine.get(kind, 0.0) + seconds * M
        if sum(mine.values()) > sum(parts_of.values()):
            parts_of = mine
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
        hop = message / (link("pp", d, hw)[1] * GB) + hw.collective_latency_us * 1e-6
        timeline = simulate(schedule, action_cost, comm_cost=hop)
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
    after = max(
        transfer_seconds(moved, run, hw, ("after",), None, cfg) for moved in transfers.values()
    )
    during = max(
        transfer_seconds(moved, run, hw, ("forward", "backward"), None, cfg)
        for moved in transfers.values()
    )
    pb, gb = precision_bytes(cfg)
    optimizer = max(
        2
        * (
            memory[r].model_states["optimizer"]
            + sum(f.shard_numel for _, e in engines_of(parts) for f in e.flats) * (gb + pb)
        )
        for r, parts in parts_by_rank.items()
    ) / (hw.hbm_gbps * GB * hw.memory_efficiency)
    # Muon: each rank orthogonalises the matrices it owns (the busiest rank's), in bf16 GEMMs
    optimizer += max(
        sum(muon_seconds(e, cfg, hw) for _, e in engines_of(parts))
        for parts in parts_by_rank.values()
    )
    time = {
        "compute": compute_time,
        **{f"compute: {kind}": seconds for kind, seconds in parts_of.items()},
        "pipeline": pipeline,
        "model traffic not hidden": max(blocking.values()),
        "data-parallel during passes": during,
        "after the micro-batches": after,
        "optimizer": optimizer,
    }
    time["step"] = pipeline + after + optimizer
    return time, bubble
