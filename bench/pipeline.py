"""Pipeline contestants: fivefold's schedules against ``torch.distributed.pipelining``, with measured bubbles.

fivefold `PipelineRuntime` on `build_schedule(name, P, M, V)` vs ``torch.distributed.pipelining``
schedules on `PipelineStage` s wrapping the very same stage modules (`stage_modules`: identical
split and weights): gpipe ↔ ScheduleGPipe, 1f1b ↔ Schedule1F1B, interleaved (V=2) ↔
ScheduleInterleaved1F1B, zb-h1 ↔ ScheduleInterleavedZeroBubble with one stage per rank (torch's
ZB1P; ScheduleZBVZeroBubble needs the V-shaped 2-stages-per-rank placement, a different schedule).
Every (schedule, M) pair is a contestant pair. Both sides compute loss/M per micro-batch (torch:
``scale_grads=False`` and a loss_fn divided by M, the same arithmetic as our runtime). Timed: the
pipeline step alone; the AdamW step and zero_grad run untimed after it, identically on both sides.

Measured bubble: the compute intervals of every rank (ours: `PipelineRuntime.records`; torch: the
stage's ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` wrapped with
timers) gathered into a `fivefold.pipeline.Timeline`: 1 - busy / (P · makespan), median over the
timed steps, next to `fivefold.formulas.bubble_formula`. (Ours counts the last stage's loss inside
its F; torch computes the loss outside ``forward_one_chunk``, so its busy time leaves out the - small -
loss computation.) Communication wait counts as idle on both.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from bench.harness import (
    CPU_LEGEND,
    RATIO_LEGEND,
    Contestant,
    Runner,
    blocks,
    lm_loss,
    log_bytes,
    markdown_table,
    ratio_line,
    run_contest,
    time_rows,
)
from fivefold.distributed.comm import Comm, CommLog
from fivefold.formulas import bubble_formula
from fivefold.models import get_config

__all__ = ["PP_PAIRS", "PPSpec", "bench_pp", "format_pp_table", "pp_contestants", "stage_modules"]


@dataclass(frozen=True)
class PPSpec:
    """A PP contest: P ranks, every (schedule pair, M) a contestant; ``micro_batch`` sequences each."""

    preset: str = "tiny"
    pp: int = 2
    microbatches: tuple[int, ...] = (4, 8)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")
    virtual: int = 2  # stages per rank of the interleaved schedules
    steps: int = 16
    warmup: int = 2
    repeats: int = 8
    micro_batch: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 1

    shard_batch: ClassVar[bool] = False  # the first stage reads the inputs, the last the targets

    @property
    def world(self) -> int:
        return self.pp

    def rows(self, info: dict[str, Any]) -> int:
        return info["M"] * self.micro_batch


# fivefold schedule -> the torch.distributed.pipelining schedule class it is timed against
PP_PAIRS: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",  # one stage per rank: torch's ZB1P
    "dualpipev": "ScheduleDualPipeV",  # V-shaped: rank r holds stages r and 2P-1-r
}


def _virtual(name: str, spec: PPSpec) -> int:
    return spec.virtual if name == "interleaved" else 2 if name == "dualpipev" else 1


def _adamw_after(params: list[torch.nn.Parameter], spec: PPSpec) -> Callable[[], None]:
    """The untimed part of a pipeline step: AdamW step, then zero_grad."""
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)

    def after() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return after


# -- contestants --------------------------------------------------------------------------------------

def stage_modules(config: Any, stage_ids: list[int], n_stages: int, seed: int) -> dict[int, torch.nn.Module]:
    """This rank's stages (id -> module, single-process weights), cut as fivefold's pipeline cuts the
    model: both sides of every pair run the very same modules (the one place the bench builds stages)."""
    from fivefold.models.parallelize import build_stages

    return build_stages(config, stage_ids, n_stages, seed=seed)


def build_fivefold_pp(config: Any, spec: PPSpec, world: Comm, name: str, M: int) -> Runner:
    from fivefold.pipeline import build_schedule
    from fivefold.pipeline.runtime import PipelineRuntime

    log = CommLog()
    comm = Comm(None, "pp", log)
    V = _virtual(name, spec)
    schedule = build_schedule(name, comm.size, M, V)
    stages = stage_modules(config, schedule.stages_of(comm.rank), schedule.n_stages, spec.seed)
    runtime = PipelineRuntime(schedule, stages, comm, lm_loss, lambda mb: (mb, spec.seq_len, config.dim),
                              torch.float32)

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor | None:
        return runtime.step(list(x.chunk(M)), list(y.chunk(M)))

    return Runner(step, after=_adamw_after([p for s in stages.values() for p in s.parameters()], spec),
                  reset_comm=log.reset, comm=log_bytes(log, comm.size), comm_source="measured (CommLog)",
                  notes=[f"fivefold {name}: PipelineRuntime(build_schedule({name!r}, P={comm.size}, M={M}, V={V}))"],
                  records=lambda: list(runtime.records),
                  info=dict(schedule=name, M=M, V=V, n_stages=schedule.n_stages, P=comm.size))


def build_torch_pp(config: Any, spec: PPSpec, world: Comm, name: str, M: int) -> Runner:
    from torch.distributed import pipelining

    rank, P = world.rank, world.size
    V = _virtual(name, spec)
    n_stages = P * V
    # torch's "loop" placement = our interleaved placement; DualPipeV's V: stages r and 2P-1-r
    stage_ids = [rank, n_stages - 1 - rank] if name == "dualpipev" else [v * P + rank for v in range(V)]
    modules = stage_modules(config, stage_ids, n_stages, spec.seed)
    mb, L, D = spec.micro_batch, spec.seq_len, config.dim
    records: list[tuple[str, int, int, float, float]] = []
    t0 = [0.0]

    def timed(fn: Callable, stage_id: int, kind: Callable[..., str]) -> Callable:
        @functools.wraps(fn)
        def wrapper(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter() - t0[0]
            out = fn(chunk_id, *args, **kwargs)
            records.append((kind(*args, **kwargs), chunk_id, stage_id, start, time.perf_counter() - t0[0]))
            return out
        return wrapper

    def backward_kind(*args: Any, full_backward: bool = True, **kwargs: Any) -> str:
        if len(args) >= 2:
            full_backward = args[1]
        return "B" if full_backward else "I"

    stages = []
    for s in stage_ids:
        # Static shapes; requires_grad marks what has a gradient (torch derives the grad buffers from it).
        example_in = (torch.zeros(mb, L, dtype=torch.long) if s == 0
                      else torch.empty(mb, L, D, requires_grad=True))
        example_out = torch.empty(mb, L, config.vocab_size if s == n_stages - 1 else D, requires_grad=True)
        stage = pipelining.PipelineStage(modules[s], s, n_stages, torch.device("cpu"),
                                         input_args=(example_in,), output_args=(example_out,))
        stage.forward_one_chunk = timed(stage.forward_one_chunk, s, lambda *a, **k: "F")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, s, backward_kind)
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, s, lambda *a, **k: "W")
        stages.append(stage)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, target) / M  # as our runtime: gradients of the mean loss, no rescaling pass

    cls = getattr(pipelining, PP_PAIRS[name])
    schedule = (cls(stages[0], M, loss_fn=loss_fn, scale_grads=False) if V == 1 and name != "zb-h1"
                else cls(stages, M, loss_fn=loss_fn, scale_grads=False))
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> float | None:
        records.clear()
        t0[0] = time.perf_counter()
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        schedule.step(*args, target=y if has_last else None, losses=losses if has_last else None,
                      return_outputs=False)
        return float(sum(v.item() for v in losses)) if has_last else None

    return Runner(step, after=_adamw_after([p for m in modules.values() for p in m.parameters()], spec),
                  comm_source="not measured",
                  notes=[f"torch {PP_PAIRS[name]}: {len(stages)} PipelineStage(s) per rank (static shapes) "
                         f"on fivefold's build_stages modules, M={M}, loss/M with scale_grads=False"],
                  records=lambda: list(records),
                  info=dict(schedule=name, M=M, V=V, n_stages=n_stages, P=P))


def pp_contestants(spec: PPSpec) -> tuple[Contestant, ...]:
    out: list[Contestant] = []
    for M in spec.microbatches:
        for name in spec.schedules:
            torch_name = f"torch-{PP_PAIRS[name]}-M{M}"
            out += [Contestant(f"fivefold-{name}-M{M}", functools.partial(build_fivefold_pp, name=name, M=M),
                               baseline=torch_name),
                    Contestant(torch_name, functools.partial(build_torch_pp, name=name, M=M))]
    return tuple(out)


def bench_pp(spec: PPSpec | None = None, **overrides: Any) -> dict:
    """fivefold pipeline schedules vs torch.distributed.pipelining on ``spec.pp`` gloo ranks, one launch.

    Per contestant adds to `bench.tensor_parallel.bench_tp`'s: ``bubble_measured`` (median over timed
    steps of the measured timeline's idle share), ``bubble_min``, ``bubble_formula`` and the last
    step's compute records (``records_last_step``: rank -> intervals)."""
    from fivefold.pipeline import Timeline

    spec = replace(spec or PPSpec(), **overrides)
    config = get_config(spec.preset)
    unknown = [s for s in spec.schedules if s not in PP_PAIRS]
    if unknown:
        raise ValueError(f"unknown schedule(s) {unknown}; choose from {sorted(PP_PAIRS)}")
    if "interleaved" in spec.schedules and config.n_layers < spec.pp * spec.virtual:
        raise ValueError(f"interleaved needs n_layers >= P·V = {spec.pp * spec.virtual}, preset {spec.preset!r} "
                         f"has {config.n_layers}")
    results = run_contest("pp", spec, pp_contestants(spec), min_warmup=1)
    for impl in results["impls"]:
        info, records = impl["info"], impl.pop("records")
        bubbles = [Timeline(per_rank).bubble_fraction for per_rank in records[spec.warmup:]]
        impl.update(bubble_measured=statistics.median(bubbles), bubble_min=min(bubbles),
                    bubble_formula=_formula_or_simulated(info), records_last_step=records[-1])
    return results


def _formula_or_simulated(info: dict[str, Any]) -> float:
    """The textbook bubble; for a schedule without one (dualpipev), the simulator's with F = I = W = 1, B = 2."""
    from fivefold.pipeline import build_schedule, simulate

    try:
        return bubble_formula(info["schedule"], info["P"], info["M"], info["V"])
    except ValueError:
        schedule = build_schedule(info["schedule"], info["P"], info["M"], info["V"])
        return simulate(schedule, costs={"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}).bubble_fraction


# -- output -----------------------------------------------------------------------------------------

def format_pp_table(results: dict) -> str:
    """Markdown table of a `bench_pp` result (time, measured and textbook bubble) with the settings below."""
    spec = results["spec"]
    rows = time_rows(results, cpu=True)
    rows[0] = (*rows[0], "bubble measured", "bubble formula")
    for k, r in enumerate(results["impls"], start=1):
        rows[k] = (*rows[k], f"{r['bubble_measured']:.3f}", f"{r['bubble_formula']:.3f}")
    out = markdown_table(rows)
    out += [f"{RATIO_LEGEND}; {CPU_LEGEND}; bubble measured = median over "
            "timed steps of 1 - Σ compute time / (P · makespan) from every rank's F/B/I/W intervals; formula: "
            "gpipe, 1f1b (P-1)/(M+P-1), interleaved (P-1)/(V·M+P-1), zb-h1 (P-1)/(3M+P-1); dualpipev (no textbook "
            "formula): fivefold's simulator with F = I = W = 1, B = 2"]
    out.append("")
    out += [ratio_line(p, what="", cpu=True) for p in results["pairs"]]
    c = get_config(spec["preset"])
    out += [f"preset {spec['preset']} (n={c.n_layers} layers, D={c.dim}, Ψ={results['params']:,}), P={spec['pp']} "
            f"(gloo, {spec['threads']} thread(s)/rank), micro-batch {spec['micro_batch']} × L={spec['seq_len']}, "
            f"V={spec['virtual']} for interleaved, {spec['steps']} timed steps (+{spec['warmup']} warmup) per impl "
            f"in {len(blocks(spec['steps'], spec['repeats']))} alternating blocks; timed = the pipeline step "
            "(all micro-batches forward + backward + p2p), AdamW step and zero_grad untimed after it on both sides"]
    seen = set()
    for r in results["impls"]:
        for note in r["notes"]:
            if note not in seen:
                seen.add(note)
                out.append(f"- {note}")
    return "\n".join(out)
