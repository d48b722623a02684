"""Expert-parallel contestants: a Llama-MoE trained with its experts split over ep against the same model with
every expert on every rank.

Both run fivefold's `parallelize` on the same data-parallel ranks (each rank its own rows of the batch, gradients
averaged over dp), the same seed and routing (dropless, global load balancing): ``fivefold-ep`` keeps E/ep experts
per rank and exchanges tokens by all-to-all (counts, dispatch, combine; the backward mirrored), ``replicated`` keeps
all E experts everywhere and all-reduces their gradients with the rest. What differs is the experts' memory
(1/ep of it), the traffic (all-to-alls of the routed rows instead of an all-reduce of every expert's gradient) and
the expert work per rank (the tokens routed to its experts, from every rank). torch has no expert-parallel
reference to compare with, so the baseline is fivefold's own replicated layout.

`bench_experts` (``experts``): one MoE layer's experts as one grouped matmul or one bmm over padded groups against
the loop over experts, forward + backward, in one process, at a few sizes.
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

__all__ = ["EPOverlapSpec", "EPSpec", "ExpertsSpec", "bench_ep", "bench_ep_overlap", "bench_experts",
           "format_ep_overlap_table", "format_ep_table", "format_experts_table"]


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


# -- one MoE layer's experts: grouped matmul / padded bmm against the loop -------------------------------------------

EXPERT_STRATEGIES = ("grouped", "padded", "loop")  # the loop is the baseline of the ratios


@dataclass(frozen=True)
class ExpertsSpec:
    """Forward + backward of one `MoEFeedForward` (dropless, top-k, routing as initialised with a sharpened router)
    per size (model width D, expert hidden F, experts E, tokens T), in one process: its experts run by each strategy
    in turn, on the same layer and tokens."""

    sizes: tuple[tuple[int, int, int, int], ...] = ((64, 128, 8, 512), (64, 64, 64, 256), (128, 256, 16, 1024))
    top_k: int = 2
    steps: int = 8
    warmup: int = 1
    repeats: int = 4
    seed: int = 0
    threads: int = 2


def _strategy(name: str) -> Any:
    from fivefold.models.moe import GroupedExperts, LoopedExperts, PaddedBatchedExperts

    return {"grouped": GroupedExperts, "padded": PaddedBatchedExperts, "loop": LoopedExperts}[name]()


def _time_layer(spec: ExpertsSpec, dim: int, hidden: int, experts: int, tokens: int) -> dict:
    import statistics
    import time

    from fivefold.models.moe import MoEConfig, MoEFeedForward

    torch.manual_seed(spec.seed)
    layer = MoEFeedForward(dim, hidden, MoEConfig(experts=experts, top_k=spec.top_k))
    with torch.no_grad():
        layer.router.weight.mul_(4.0)  # uneven loads, as a trained router gives
    x = torch.randn(tokens, dim, requires_grad=True)
    upstream = torch.randn(tokens, dim)
    strategies = {name: _strategy(name) for name in EXPERT_STRATEGIES}

    def step(name: str) -> tuple[float, torch.Tensor]:
        layer.strategy = strategies[name]
        t0 = time.perf_counter()
        out = layer(x)
        out.backward(upstream)
        elapsed = time.perf_counter() - t0
        grads = torch.cat([p.grad.reshape(-1) for p in layer.experts.parameters()])
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return elapsed, torch.cat([out.detach().reshape(-1), grads])

    values = {name: step(name)[1] for name in EXPERT_STRATEGIES}
    for name in EXPERT_STRATEGIES:
        for _ in range(spec.warmup):
            step(name)
    times: dict[str, list[tuple[int, float]]] = {name: [] for name in EXPERT_STRATEGIES}
    sizes = blocks(spec.steps, spec.repeats)
    for rnd, size in enumerate(sizes):
        for name in EXPERT_STRATEGIES:
            times[name] += [(rnd, step(name)[0]) for _ in range(size)]
    per_round = {name: [statistics.median(t for r, t in times[name] if r == rnd) for rnd in range(len(sizes))]
                 for name in EXPERT_STRATEGIES}
    loads = layer.stats.tokens_per_expert.tolist()
    return dict(dim=dim, hidden=hidden, experts=experts, tokens=tokens, loads=(min(loads), max(loads)),
                impls={name: dict(median_s=statistics.median(t for _, t in times[name]),
                                  min_s=min(t for _, t in times[name]),
                                  ratio_paired=statistics.median(a / b for a, b in zip(per_round[name],
                                                                                         per_round["loop"])),
                                  max_abs_diff=float((values[name] - values["loop"]).abs().max()))
                       for name in EXPERT_STRATEGIES})


def bench_experts(spec: ExpertsSpec | None = None, **overrides: Any) -> dict:
    """One MoE layer's forward + backward with its experts as one grouped matmul (`GroupedExperts`), one bmm over
    padded groups (`PaddedBatchedExperts`) and the loop over experts (`LoopedExperts`), at each of ``spec.sizes``:
    median step time and the paired ratio against the loop."""
    spec = replace(spec or ExpertsSpec(), **overrides)
    before = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        rows = [_time_layer(spec, *size) for size in spec.sizes]
    finally:
        torch.set_num_threads(before)
    return dict(spec=spec.__dict__, sizes=rows)


def format_experts_table(results: dict) -> str:
    spec = results["spec"]
    rows = [("D × F, E experts, T tokens (rows per expert min-max)",
             *(f"{name} ms median (min)" for name in EXPERT_STRATEGIES), "grouped / loop paired (min)",
             "padded / loop paired (min)", "max |Δ| vs loop (grouped, padded)")]
    for r in results["sizes"]:
        impls, loop = r["impls"], r["impls"]["loop"]
        rows.append((f"{r['dim']} × {r['hidden']}, E={r['experts']}, T={r['tokens']} ({r['loads'][0]}-{r['loads'][1]})",
                     *(f"{impls[n]['median_s'] * 1e3:.1f} ({impls[n]['min_s'] * 1e3:.1f})" for n in EXPERT_STRATEGIES),
                     *(f"{impls[n]['ratio_paired']:.3f} ({impls[n]['min_s'] / loop['min_s']:.3f})"
                       for n in ("grouped", "padded")),
                     f"{impls['grouped']['max_abs_diff']:.1e}, {impls['padded']['max_abs_diff']:.1e}"))
    out = markdown_table(rows)
    out.append(f"one MoEFeedForward, fp32, top-{spec['top_k']} dropless, forward + backward (outputs and the experts' "
               f"weight gradients compared), {spec['steps']} timed steps (+{spec['warmup']} warmup) per strategy in "
               f"{len(blocks(spec['steps'], spec['repeats']))} alternating blocks, {spec['threads']} thread(s), one "
               "process; ratio < 1: faster than the loop")
    return "\n".join(out)
