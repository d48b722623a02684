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
from fivefold.comm import Comm, CommLog
from fivefold.memory import ModelStateBytes

__all__ = ["EPSpec", "bench_ep", "format_ep_table"]


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
    from fivefold.memory import model_state_bytes
    from fivefold.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

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

