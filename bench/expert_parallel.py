"""Expert-parallel contestants: a Llama-MoE trained with its experts split over ep against the same model with
every expert on every rank.

Both run fivefold's `parallelize` on the same data-parallel ranks (each rank its own rows of the batch, gradients
averaged over dp), the same seed and routing (dropless, global load balancing): ``fivefold-ep`` keeps E/ep experts
per rank and exchanges tokens by all-to-all (counts, dispatch, combine; the backward mirrored), ``replicated`` keeps
all E experts everywhere and all-reduces their gradients with the rest. What differs is the experts' memory
(1/ep of it), the traffic (all-to-alls of the routed rows instead of an all-reduce of every expert's gradient) and
the expert work per rank (the tokens routed to its experts, from every rank). torch has no expert-parallel
reference to compare with, so the baseline is fivefold's own replicated layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from bench.harness import (
    CPU_LEGEND,
    RATIO_LEGEND,
    Contestant,
    Runner,
    blocks,
    log_bytes,
    markdown_table,
    mib,
    ops_text,
    ratio_line,
    run_contest,
    time_rows,
)
from fivefold.distributed.comm import Comm, CommLog
from fivefold.observe.memory import ModelStateBytes

__all__ = ["EPOverlapSpec", "EPSpec", "bench_ep", "bench_ep_overlap", "format_ep_overlap_table", "format_ep_table"]


@dataclass(frozen=True)
class EPSpec:
    preset: str = "tiny-moe"
    ep: int = 2  # = the data-parallel ranks
    steps: int = 12
    warmup: int = 2
    repeats: int = 4
    micro_batch: int = 8  # sequences per rank per step
    seq_len: int = 128
    seed: int = 0
    threads: int = 1

    shard_batch: ClassVar[bool] = True  # each rank its own rows

    @property
    def world(self) -> int:
        return self.ep

    def rows(self, info: dict[str, Any]) -> int:
        return self.micro_batch * self.ep


def build_moe(config: Any, spec: EPSpec, world: Comm, ep: int) -> Runner:
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize
    from fivefold.observe.memory import model_state_bytes

    cfg = Config()
    cfg.parallel.ep, cfg.train.seq_len, cfg.train.seed, cfg.train.grad_accum = ep, spec.seq_len, spec.seed, 1
    log = CommLog()
    mesh = ParallelMesh(ParallelDims(dp=world.size, ep=ep), "cpu", log)
    parts = parallelize(cfg, config, mesh, "cpu")

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        with during_backward:
            return parts.forward_backward([(x, y)])

    def memory() -> tuple[ModelStateBytes, int]:
        totals = [model_state_bytes(e) for e in parts.engines.values()]
        return ModelStateBytes(*(sum(getattr(t, f) for t in totals) for f in ("params", "grads", "optimizer"))), 0

    experts = sum(len(layer.experts) for module in parts.modules() for layer in module.modules()
                  if hasattr(layer, "experts"))
    what = (f"experts split over ep={ep} ({experts} expert modules on this rank), all-to-all dispatch/combine"
            if ep > 1 else f"every expert on every rank ({experts} expert modules), gradients all-reduced over dp")
    return Runner(step, update=lambda: parts.step(1.0), reset_comm=log.reset, comm=log_bytes(log, world.size),
                  comm_source="measured (CommLog): everything the step sends", memory=memory,
                  notes=[f"fivefold parallelize, dp={world.size}: {what}; AdamW, clipping 1.0"],
                  info=dict(ep=ep, experts_per_rank=experts))


def ep_contestants(spec: EPSpec) -> tuple[Contestant, ...]:
    return (Contestant("fivefold-ep", functools.partial(build_moe, ep=spec.ep), baseline="replicated"),
            Contestant("replicated", functools.partial(build_moe, ep=1)))


def bench_ep(spec: EPSpec | None = None, **overrides: Any) -> dict:
    """Llama-MoE with experts over ep vs replicated experts, on ``spec.ep`` data-parallel gloo ranks."""
    spec = replace(spec or EPSpec(), **overrides)
    return run_contest("ep", spec, ep_contestants(spec))


def format_ep_table(results: dict) -> str:
    spec = results["spec"]
    out = markdown_table(time_rows(results, cpu=True))
    out += [f"{RATIO_LEGEND}; {CPU_LEGEND}", ""]
    rows = [("impl", "model states per rank, MiB (params / grads / optim)", "communication per step and rank")]
    for r in results["impls"]:
        m = r.get("memory") or {}
        rows.append((r["name"], f"{mib(m.get('params', 0))} / {mib(m.get('grads', 0))} / {mib(m.get('optimizer', 0))}"
                     f" = {mib(m.get('total', 0))}", f"{ops_text(r['comm_by_op'])} = {mib(r['payload_bytes'])} MiB"))
    out += markdown_table(rows)
    out += [""] + [ratio_line(p, cpu=True) for p in results["pairs"]]
    out.append(f"preset {spec['preset']} (Ψ={results['params']:,}), ep = dp = {spec['ep']} gloo ranks "
               f"({spec['threads']} thread(s)/rank), {spec['micro_batch']} × {spec['seq_len']} tokens per rank and "
               f"step, {spec['steps']} timed steps (+{spec['warmup']} warmup) in "
               f"{len(blocks(spec['steps'], spec['repeats']))} alternating blocks; step = forward + backward + "
               "AdamW step, slowest rank")
    for r in results["impls"]:
        out += [f"- {note}" for note in r["notes"]]
    return "\n".join(out)



# -- DualPipeV with the expert all-to-alls of one micro-batch beside another's compute -------------------------------

@dataclass(frozen=True)
class EPOverlapSpec:
    """pp × ep(= dp) ranks train a Llama-MoE with DualPipeV, its (F, B) units side by side or one after the other."""

    preset: str = "tiny-moe"
    pp: int = 2
    ep: int = 2  # = dp
    microbatches: int = 4  # M >= 2P
    steps: int = 12
    warmup: int = 2
    repeats: int = 4
    micro_batch: int = 4  # sequences per micro-batch and dp rank
    seq_len: int = 128
    seed: int = 0
    threads: int = 1

    shard_batch: ClassVar[bool] = False  # every rank reads the global batch; each dp rank takes its rows

    @property
    def world(self) -> int:
        return self.pp * self.ep

    def rows(self, info: dict[str, Any]) -> int:
        return self.microbatches * self.micro_batch * self.ep


def build_dualpipev_moe(config: Any, spec: EPOverlapSpec, world: Comm, overlap: str) -> Runner:
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    cfg = Config()
    cfg.parallel.pp, cfg.parallel.ep = spec.pp, spec.ep
    cfg.pipeline.schedule, cfg.pipeline.overlap = "dualpipev", overlap
    cfg.train.seq_len, cfg.train.seed, cfg.train.grad_accum = spec.seq_len, spec.seed, spec.microbatches
    log = CommLog()
    mesh = ParallelMesh(ParallelDims(pp=spec.pp, dp=spec.ep, ep=spec.ep), "cpu", log)
    parts = parallelize(cfg, config, mesh, "cpu")
    dp, M = mesh.comm("dp"), spec.microbatches
    holds_loss = parts.schedule.stage_to_rank[-1] == mesh.comm("pp").rank  # the others return a 0 for the metrics

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor | None:
        x, y = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
        with during_backward:
            loss = parts.forward_backward(list(zip(x.chunk(M), y.chunk(M))))
        return loss if holds_loss else None  # (the harness averages over the ranks that hold a loss)

    how = "side by side (the forward in a second thread)" if parts.overlap else "one after the other"
    return Runner(step, update=lambda: parts.step(1.0), reset_comm=log.reset, comm=log_bytes(log, world.size),
                  comm_source="measured (CommLog)", records=lambda: list(parts.runtime.records),
                  notes=[f"fivefold parallelize pp={spec.pp} × dp=ep={spec.ep}, dualpipev M={M}: (F, B) units {how}"],
                  info=dict(overlap=parts.overlap, units=spec.ep * sum(map(len, parts.schedule.side_by_side))))


def bench_ep_overlap(spec: EPOverlapSpec | None = None, **overrides: Any) -> dict:
    """DualPipeV on pp × ep ranks with its units overlapped vs in sequence; per contestant adds the measured bubble
    (median over timed steps, busy = union of compute intervals) and the units whose passes overlapped."""
    import statistics

    from fivefold.pipeline import Timeline

    spec = replace(spec or EPOverlapSpec(), **overrides)
    contestants = (Contestant("overlap", functools.partial(build_dualpipev_moe, overlap="on"), baseline="sequential"),
                   Contestant("sequential", functools.partial(build_dualpipev_moe, overlap="off")))
    results = run_contest("ep-overlap", spec, contestants)
    for impl in results["impls"]:
        steps = [Timeline(per_rank) for per_rank in impl.pop("records")[spec.warmup:]]
        overlapped = [sum(len(t.overlapped(r)) for r in range(t.n_ranks)) for t in steps]
        impl.update(bubble_measured=statistics.median(t.bubble_fraction for t in steps),
                    overlapped_per_step=statistics.median(overlapped), records_last_step=steps[-1].events)
    return results


def format_ep_overlap_table(results: dict) -> str:
    spec = results["spec"]
    rows = time_rows(results, cpu=True)
    rows[0] = (*rows[0], "bubble measured", "units overlapped per step (all ranks)")
    units = results["impls"][0]["info"]["units"]
    for k, r in enumerate(results["impls"], start=1):
        rows[k] = (*rows[k], f"{r['bubble_measured']:.3f}", f"{r['overlapped_per_step']:g} of {units}")
    out = markdown_table(rows)
    out += [f"{RATIO_LEGEND}; {CPU_LEGEND}; bubble = 1 - Σ busy / (P · makespan), busy = the union of a rank's "
            "compute intervals (a unit's overlapped F and B count once); units: those of every rank",
            ""]
    out += [ratio_line(p, cpu=True) for p in results["pairs"]]
    out.append(f"preset {spec['preset']} (Ψ={results['params']:,}), pp={spec['pp']} × dp=ep={spec['ep']} gloo ranks "
               f"({spec['threads']} thread(s)/rank), M={spec['microbatches']} micro-batches of {spec['micro_batch']}"
               f" × {spec['seq_len']} tokens per dp rank, {spec['steps']} timed steps (+{spec['warmup']} warmup) in "
               f"{len(blocks(spec['steps'], spec['repeats']))} alternating blocks; step = the pipeline step + "
               "AdamW, slowest rank")
    for r in results["impls"]:
        out += [f"- {note}" for note in r["notes"]]
    return "\n".join(out)
