"""``train.compile``: the same layout with torch.compile'd blocks against eager blocks — step time, paired ratio, and
what the first step (the compilation) costs.

One contest per layout (DDP, ZeRO-3, tp 2, pp 2 with 1F1B), each on ``world`` gloo ranks running fivefold's
`parallelize` twice from the same seed with the same batches: ``compiled`` (``train.compile true``) against ``eager``.
The warmup steps include the compilation (inductor's C++ backend on the CPU; its on-disk cache serves later runs);
the timed steps alternate between the two.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from bench.harness import (
    CPU_LEGEND,
    RATIO_LEGEND,
    Contestant,
    Runner,
    blocks,
    markdown_table,
    ratio_line,
    run_contest,
    time_rows,
)
from fivefold.distributed.comm import Comm, CommLog

__all__ = ["LAYOUTS", "CompileSpec", "bench_compile", "format_compile_table"]

LAYOUTS = {  # name: (mesh dims over the world, ZeRO stage)
    "ddp": (lambda world: dict(dp=world), 0),
    "zero3": (lambda world: dict(dp=world), 3),
    "tp2": (lambda world: dict(tp=2, dp=world // 2), 0),
    "pp2": (lambda world: dict(pp=2, dp=world // 2), 0),
}


@dataclass(frozen=True)
class CompileSpec:
    preset: str = "small"
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    world: int = 2
    steps: int = 8
    warmup: int = 2  # the first compiles (and the second may recompile: the optimizer step changed nothing shaped)
    repeats: int = 4
    batch: int = 8  # sequences per step (the whole batch; dp ranks take their share)
    grad_accum: int = 2  # micro-batches per step (pp: the pipeline's)
    seq_len: int = 256
    seed: int = 0
    threads: int = 1
    layout: str = "ddp"  # the layout of the current contest (one per entry of ``layouts``)

    shard_batch: ClassVar[bool] = False  # every rank gets the whole batch and takes its dp share

    def rows(self, info: dict[str, Any]) -> int:
        return self.batch


def build_layout(config: Any, spec: CompileSpec, world: Comm, compiled: bool) -> Runner:
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    dims_of, stage = LAYOUTS[spec.layout]
    cfg = Config()
    cfg.zero.stage, cfg.train.compile, cfg.pipeline.schedule = stage, compiled, "1f1b"
    cfg.train.seq_len, cfg.train.seed, cfg.train.grad_accum = spec.seq_len, spec.seed, spec.grad_accum
    mesh = ParallelMesh(ParallelDims(**dims_of(world.size)), "cpu", CommLog(enabled=False))
    parts = parallelize(cfg, config, mesh, "cpu")
    dp = mesh.comm("dp")
    info: dict[str, Any] = dict(layout=spec.layout, compiled=compiled)

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        x, y = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
        with during_backward:
            loss = parts.forward_backward(list(zip(x.chunk(spec.grad_accum), y.chunk(spec.grad_accum))))
        info.setdefault("first_step_s", time.perf_counter() - t0)  # the compilation, for the compiled contestant
        return parts.global_loss(loss)

    what = "each block's computation torch.compile'd (inductor)" if compiled else "eager blocks"
    return Runner(step, update=lambda: parts.step(1.0),
                  notes=[f"{spec.layout}: fivefold parallelize, {dims_of(world.size)}, ZeRO-{stage}, {what}"],
                  info=info)


def bench_compile(spec: CompileSpec | None = None, **overrides: Any) -> dict:
    """Compiled against eager blocks, one contest per layout of ``spec.layouts``."""
    spec = replace(spec or CompileSpec(), **overrides)
    unknown = sorted(set(spec.layouts) - set(LAYOUTS))
    if unknown:
        raise ValueError(f"unknown layouts {unknown}: choose from {', '.join(LAYOUTS)}")
    contests = {}
    for layout in spec.layouts:
        contestants = (Contestant("compiled", functools.partial(build_layout, compiled=True), baseline="eager"),
                       Contestant("eager", functools.partial(build_layout, compiled=False)))
        contests[layout] = run_contest("compile", replace(spec, layout=layout), contestants, min_warmup=1)
    return {"kind": "compile", "spec": {**contests[spec.layouts[0]]["spec"], "layout": None},
            "params": contests[spec.layouts[0]]["params"], "layouts": contests}


def format_compile_table(results: dict) -> str:
    spec = results["spec"]
    rows = [("layout", "eager step ms", "compiled step ms", "compiled / eager (paired)",
             "first step s eager / compiled", "max |Δloss|")]
    for layout, r in results["layouts"].items():
        by = {i["name"]: i for i in r["impls"]}
        c, e = by["compiled"], by["eager"]
        rows.append((layout, f"{e['median_s'] * 1e3:.0f}", f"{c['median_s'] * 1e3:.0f}", f"{c['ratio_paired']:.3f}",
                     f"{e['info'].get('first_step_s', float('nan')):.1f} / {c['info'].get('first_step_s', 0):.1f}",
                     f"{c['max_abs_loss_diff']:.1e}"))
    out = markdown_table(rows) + [""]
    for layout, r in results["layouts"].items():
        out += [f"### {layout}", *markdown_table(time_rows(r, cpu=True)), *[ratio_line(p, cpu=True)
                                                                             for p in r["pairs"]], ""]
    out += [f"{RATIO_LEGEND}; {CPU_LEGEND}",
            f"preset {spec['preset']} (Ψ={results['params']:,}, fp32), {spec['world']} gloo ranks "
            f"({spec['threads']} thread(s)/rank), {spec['batch']} × {spec['seq_len']} tokens per step in "
            f"{spec['grad_accum']} micro-batches, {spec['steps']} timed steps (+{spec['warmup']} warmup, the first "
            f"compiling) in {len(blocks(spec['steps'], spec['repeats']))} alternating blocks; step = forward + "
            "backward + AdamW step, slowest rank. The first step's time includes the compilation (inductor's cache "
            "on disk shortens it on later runs)."]
    return "\n".join(out)
