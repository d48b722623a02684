"""FP8 linears and Muon (docs/design.md#fp8-training, docs/design.md#muon-under-zero) on the CPU: step time beside
the same layout without them, and the bytes they move.

``fp8``: per layout (DDP; ZeRO-3, where ``fp8-gather`` adds the FP8 unit gathers), bf16 parameters, fivefold's
`parallelize` once per contestant from the same seed and batches: ``bf16`` (the baseline) against ``fp8-tensorwise``
and ``fp8-rowwise``. On this CPU an FP8 GEMM is no faster than a bf16 one (``torch._scaled_mm`` has no FP8 matrix
units to use here) and every cast is one more pass over its operand, so FP8 is expected to be slower: what it buys
comes from a GPU's FP8 tensor cores (tests/gpu/run.sh's FP8 step on a GPU gives that number). The bytes per step
(``CommLog``) show the FP8 gather's saving, which does not depend on the device.

``muon``: ZeRO-1 over ``world`` ranks, ``adamw`` (the baseline) against ``muon`` (Muon for the blocks' matrices,
owned whole; AdamW for the rest): step time, and the optimizer state per rank.
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
    log_bytes,
    markdown_table,
    ratio_line,
    run_contest,
    time_rows,
)
from fivefold.distributed.comm import Comm, CommLog

__all__ = ["FP8_LAYOUTS", "NumericsSpec", "bench_fp8", "bench_muon", "format_fp8_table", "format_muon_table"]

FP8_LAYOUTS = {  # name: (mesh dims over the world, ZeRO stage)
    "ddp": (lambda world: dict(dp=world), 0),
    "zero3": (lambda world: dict(dp=world), 3),
}


@dataclass(frozen=True)
class NumericsSpec:
    preset: str = "small"
    layouts: tuple[str, ...] = tuple(FP8_LAYOUTS)
    world: int = 2
    steps: int = 8
    warmup: int = 2
    repeats: int = 4
    batch: int = 8  # sequences per step (the whole batch; dp ranks take their share)
    grad_accum: int = 2
    seq_len: int = 256
    seed: int = 0
    threads: int = 1
    param: str = "bf16"
    layout: str = "ddp"  # the current contest's layout

    shard_batch: ClassVar[bool] = False  # every rank gets the whole batch and takes its dp share

    def rows(self, info: dict[str, Any]) -> int:
        return self.batch


def _runner(config: Any, spec: NumericsSpec, world: Comm, *, stage: int, dims: dict[str, int], fp8: str = "off",
            gather: bool = False, optim: str = "adamw") -> Runner:
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize
    from fivefold.observe.memory import model_state_bytes

    cfg = Config()
    cfg.zero.stage, cfg.zero.fp8_gather, cfg.precision.fp8, cfg.optim.name = stage, gather, fp8, optim
    cfg.precision.param = spec.param
    cfg.train.seq_len, cfg.train.seed, cfg.train.grad_accum = spec.seq_len, spec.seed, spec.grad_accum
    log = CommLog()
    mesh = ParallelMesh(ParallelDims(**dims), "cpu", log)
    parts = parallelize(cfg, config, mesh, "cpu")
    dp = mesh.comm("dp")
    info: dict[str, Any] = dict(fp8=fp8, gather=gather, optim=optim)

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        x, y = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
        with during_backward:
            loss = parts.forward_backward(list(zip(x.chunk(spec.grad_accum), y.chunk(spec.grad_accum))))
        return parts.global_loss(loss)

    def update() -> None:
        t0 = time.perf_counter()
        parts.step(1.0)
        info.setdefault("optimizer_s", []).append(time.perf_counter() - t0)
        # (the optimizer's state exists from its first step on)
        info.setdefault("optimizer_state_bytes", model_state_bytes(parts.engines[0]).optimizer)

    what = ", ".join(w for w in (f"FP8 {fp8}" if fp8 != "off" else "", "FP8 gathers" if gather else "",
                                 "Muon on the matrices" if optim == "muon" else "") if w) or "as is"
    return Runner(step, update=update, reset_comm=log.reset, comm=log_bytes(log, world.size),
                  comm_source="measured (CommLog)",
                  notes=[f"fivefold parallelize, {dims}, ZeRO-{stage}, {spec.param} params, {what}"], info=info)


def bench_fp8(spec: NumericsSpec | None = None, **overrides: Any) -> dict:
    """FP8 linears (tensorwise, rowwise; ZeRO-3: + the FP8 gather) against bf16, one contest per layout."""
    spec = replace(spec or NumericsSpec(), **overrides)
    unknown = sorted(set(spec.layouts) - set(FP8_LAYOUTS))
    if unknown:
        raise ValueError(f"unknown layouts {unknown}: choose from {', '.join(FP8_LAYOUTS)}")
    contests = {}
    for layout in spec.layouts:
        dims_of, stage = FP8_LAYOUTS[layout]
        build = functools.partial(_runner, stage=stage, dims=dims_of(spec.world))
        contestants = [Contestant("fp8-tensorwise", functools.partial(build, fp8="tensorwise"), baseline="bf16"),
                       Contestant("fp8-rowwise", functools.partial(build, fp8="rowwise"), baseline="bf16")]
        if stage == 3:
            contestants.append(Contestant("fp8-gather", functools.partial(build, fp8="tensorwise", gather=True),
                                          baseline="bf16"))
        contestants.append(Contestant("bf16", build))
        contests[layout] = run_contest("fp8", replace(spec, layout=layout), contestants)
    return {"kind": "fp8", "spec": {**contests[spec.layouts[0]]["spec"], "layout": None},
            "params": contests[spec.layouts[0]]["params"], "layouts": contests}


def bench_muon(spec: NumericsSpec | None = None, **overrides: Any) -> dict:
    """Muon (whole matrices, owned) against AdamW under ZeRO-1."""
    spec = replace(spec or NumericsSpec(param="fp32"), **overrides)
    build = functools.partial(_runner, stage=1, dims=dict(dp=spec.world))
    contestants = (Contestant("muon", functools.partial(build, optim="muon"), baseline="adamw"),
                   Contestant("adamw", build))
    return run_contest("muon", spec, contestants)


def _gathers(impl: dict) -> str:
    calls, nbytes = impl.get("comm_by_op", {}).get("all_gather", (0, 0))
    return f"{nbytes / 2**20:.1f}" if calls else "-"


def format_fp8_table(results: dict) -> str:
    spec = results["spec"]
    rows = [("layout", "contestant", "step ms", "/ bf16 (paired)", "all-gather MiB per step", "max |Δloss|")]
    for layout, r in results["layouts"].items():
        for impl in r["impls"]:
            paired = f"{impl['ratio_paired']:.3f}" if "ratio_paired" in impl else "1"
            loss = f"{impl['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in impl else "-"
            rows.append((layout, impl["name"], f"{impl['median_s'] * 1e3:.0f}", paired, _gathers(impl), loss))
    out = markdown_table(rows) + [""]
    for layout, r in results["layouts"].items():
        out += [f"### {layout}", *markdown_table(time_rows(r, cpu=True)),
                *[ratio_line(p, cpu=True) for p in r["pairs"]], ""]
    out += [f"{RATIO_LEGEND}; {CPU_LEGEND}",
            f"preset {spec['preset']} (Ψ={results['params']:,}, {spec['param']} parameters), {spec['world']} gloo "
            f"ranks ({spec['threads']} thread(s)/rank), {spec['batch']} × {spec['seq_len']} tokens per step in "
            f"{spec['grad_accum']} micro-batches, {spec['steps']} timed steps (+{spec['warmup']} warmup) in "
            f"{len(blocks(spec['steps'], spec['repeats']))} alternating blocks, slowest rank. On the CPU an FP8 "
            "GEMM has no faster units to run on and every cast is an extra pass: slower here is expected; the "
            "speed FP8 buys is a GPU's (tests/gpu/run.sh). The all-gather bytes do not depend on the device."]
    return "\n".join(out)


def format_muon_table(results: dict) -> str:
    spec = results["spec"]
    rows = [("contestant", "step ms", "/ adamw (paired)", "optimizer step ms (median)", "optimizer state MiB / rank",
             "max |Δloss|")]
    for impl in results["impls"]:
        opt = sorted(impl["info"].get("optimizer_s", [0.0]))
        paired = f"{impl['ratio_paired']:.3f}" if "ratio_paired" in impl else "1"
        loss = f"{impl['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in impl else "-"
        rows.append((impl["name"], f"{impl['median_s'] * 1e3:.0f}", paired, f"{opt[len(opt) // 2] * 1e3:.0f}",
                     f"{impl['info']['optimizer_state_bytes'] / 2**20:.1f}", loss))
    out = markdown_table(rows) + [""]
    out += [*markdown_table(time_rows(results, cpu=True)), *[ratio_line(p, cpu=True) for p in results["pairs"]], ""]
    out += [f"{RATIO_LEGEND}; {CPU_LEGEND}",
            f"preset {spec['preset']} (Ψ={results['params']:,}, {spec['param']} parameters), ZeRO-1 over "
            f"{spec['world']} gloo ranks ({spec['threads']} thread(s)/rank), {spec['batch']} × {spec['seq_len']} "
            f"tokens per step in {spec['grad_accum']} micro-batches, {spec['steps']} timed steps "
            f"(+{spec['warmup']} warmup); the optimizer step (clip, step, all-gather) timed on rank 0. Muon's "
            "Newton-Schulz iterations run in bf16 matmuls on the matrices each rank owns; the loss difference is "
            "two optimizers', not a bound."]
    return "\n".join(out)
