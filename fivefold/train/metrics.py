"""What a run shows and leaves behind: the progress bar, and `RunRecord`, sole owner of the run
directory (written on rank 0): ``metrics.jsonl``, then the loss curve, for pipelines the measured
timeline and, with ``run.trace``, the step trace and its hidden-communication figure (via
`fivefold.observe.report`).

The trainer tells what happens through `TrainObserver`, the interface of everything that watches a
run: its hooks, called at fixed points of `train.trainer.Trainer`, receive typed results (`RunInfo`,
`StepResult`, `EvalResult`, `TrainResult`). Here are the observers that write the run record
(`RunRecordLog`), sum the run up (`RunSummary`), write the step trace (`StepTraceLog`) and the
measured pipeline timeline (`PipelineTimelineLog`)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fivefold.distributed.comm import Comm, CommTotals
from fivefold.observe.report import (
    plot_loss,
    plot_moe_load,
    plot_step_trace,
    plot_timeline,
    to_chrome_trace,
    write_step_trace,
)
from fivefold.observe.trace import StepTracer, hidden_summary
from fivefold.optim.clip import NonFiniteGradient
from fivefold.paths import atomic_write_bytes
from fivefold.pipeline.simulator import Timeline

if TYPE_CHECKING:
    from fivefold.config import Config
    from fivefold.models.llama import LlamaConfig
    from fivefold.models.parallel_model import ParallelModel

__all__ = [
    "EvalResult",
    "MoELoad",
    "PipelineTimelineLog",
    "Progress",
    "RunInfo",
    "RunRecord",
    "RunRecordLog",
    "RunSummary",
    "StepResult",
    "StepTraceLog",
    "Throughput",
    "TrainObserver",
    "TrainResult",
    "TrainingClock",
    "moe_imbalance",
    "read_metrics",
]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _read_lenient(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file a killed run may have cut mid-line (that line is dropped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Progress:
    """tqdm bar on rank 0 (disabled elsewhere or when asked)."""

    def __init__(self, total: int, enabled: bool, desc: str = "train") -> None:
        self.bar = None
        self.done = 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.done += n
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None  # what is said after it is printed


class RunRecord:
    """Rank 0 writes; other ranks hold a silent record (every method is a no-op for them)."""

    def __init__(
        self,
        run_dir: Path | None,
        steps: int,
        progress: bool,
        name: str,
        resume_at: int | None = None,
    ) -> None:
        """``resume_at``: the run continues after that many steps: the records of later steps
        (written after the checkpoint, by the attempt that stopped) and its summary are dropped, the
        rest kept, new ones appended. Every record's ``step`` counts steps done (1-based)."""
        self.run_dir, self.steps = run_dir, steps
        self.path = run_dir / "metrics.jsonl" if run_dir is not None else None
        self._f = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_at is not None and self.path.exists():
                kept = [
                    r
                    for r in _read_lenient(self.path)
                    if r.get("kind") != "summary" and r.get("step", -1) <= resume_at
                ]
                text = "".join(json.dumps(r) + "\n" for r in kept)
                atomic_write_bytes(self.path, text.encode())
            self._f = open(self.path, "a" if resume_at is not None else "w", buffering=1)
        self.progress = Progress(steps, enabled=run_dir is not None and progress, desc=name)
        if resume_at:
            self.progress.update(resume_at)

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:  # strict JSON: a NaN or infinite value is written as null
            self._f.write(json.dumps(_finite(record), allow_nan=False) + "\n")

    def abort(self) -> None:
        """The run fails: close the file (what was written stays valid JSON lines) and the progress
        bar."""
        self.progress.close()
        if self._f is not None:
            self._f.close()
            self._f = None

    def say(self, msg: str) -> None:
        """A line for the user on rank 0: above the progress bar, or printed when there is none."""
        if self.progress.bar is not None:
            self.progress.write(msg)
        elif self.run_dir is not None:
            print(msg, flush=True)

    def pipeline(
        self, timeline: Timeline, formula: float | None, title: str, chrome_trace: bool = True
    ) -> None:
        """The last step's measured timeline: PNG + Chrome trace (unless the step trace, which holds
        the same actions, is written instead), and its bubble next to the formula (if any)."""
        if self.run_dir is None:
            return
        versus = f"formula {formula:.1%}" if formula is not None else "no textbook formula"
        plot_timeline(
            timeline, self.run_dir / "timeline.png", title=f"{title}, measured ({versus})"
        )
        if chrome_trace:
            to_chrome_trace(timeline, self.run_dir / "trace.json", us_per_unit=1e6)
        self.write(
            {
                "kind": "pipeline",
                "measured_bubble": timeline.bubble_fraction,
                "formula_bubble": formula,
            }
        )
        also = f" and {self.run_dir / 'trace.json'}" if chrome_trace else ""
        self.say(
            "fivefold: last step's pipeline timeline: measured bubble "
            f"{timeline.bubble_fraction:.1%} ({versus}); wrote "
            f"{self.run_dir / 'timeline.png'}{also}"
        )

    def trace(self, ranks: list[dict[str, Any]] | None, title: str) -> dict[str, Any] | None:
        """Every rank's traced steps (`trace.StepTracer.result`, gathered on rank 0): ``trace.json``
        (Chrome / Perfetto), ``step_trace.png`` (the last traced step), a "trace" record and the
        hidden-communication line. Returns the run's figures (None elsewhere than rank 0, or when
        nothing was traced)."""
        if self.run_dir is None or not ranks:
            return None
        if not any(r["steps"] for r in ranks):
            self.say(
                "fivefold: run.trace: no step of the trace window ran (the run stopped before its "
                "last steps)"
            )
            return None
        summary = hidden_summary(ranks)
        write_step_trace(ranks, self.run_dir / "trace.json", other=summary)
        step = plot_step_trace(
            ranks,
            self.run_dir / "step_trace.png",
            title=title
            + (f", communication hidden {summary['comm_hidden_fraction']:.0%}" if summary else ""),
        )
        self.write(
            {
                "kind": "trace",
                **(
                    summary
                    or {"traced_steps": sorted({s["step"] for r in ranks for s in r["steps"]})}
                ),
            }
        )
        if summary is None:
            self.say(
                "fivefold: no communication in the traced steps; wrote "
                f"{self.run_dir / 'trace.json'} and {self.run_dir / 'step_trace.png'} (step {step} "
                "as numbered in metrics.jsonl)"
            )
        else:
            self.say(
                "fivefold: communication hidden behind compute: "
                f"{summary['comm_hidden_fraction']:.0%} (ranks "
                f"{summary['comm_hidden_min']:.0%}-{summary['comm_hidden_max']:.0%}; exposed "
                f"{summary['exposed_comm_ms_per_step']:.1f} of {summary['comm_ms_per_step']:.1f} "
                f"ms communication per step) over the last {len(summary['traced_steps'])} steps; "
                f"wrote {self.run_dir / 'trace.json'} and {self.run_dir / 'step_trace.png'} (step "
                f"{step} as numbered in metrics.jsonl)"
            )
        return summary

    def close(self, summary: dict[str, Any], plot_title: str | None) -> None:
        """Write the summary; draw the loss curve (unless `plot_title` is None)."""
        self.progress.close()
        if self._f is None:
            return
        self.write({"kind": "summary", **summary})
        self._f.close()
        self._f = None
        if plot_title is not None:
            records = read_metrics(self.path)
            png = plot_loss(records, self.run_dir / "loss.png", title=plot_title)
            if any(
                r.get("kind") == "moe" for r in records
            ):  # the loss plot's companion: how the experts were used
                self.say(
                    "fivefold: expert load in "
                    f"{plot_moe_load(records, self.run_dir / 'moe_load.png')}"
                )
            val = summary.get("final_val_loss")
            self.say(
                f"fivefold: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
                + (f" (val {val:.3f})" if val is not None else "")
                + f", {summary['tokens_per_s']:,.0f} tokens/s; wrote {self.path} and {png}"
            )


# --------------------------------------------------------------------------------------------------
# What the trainer tells its observers


@dataclass
class TrainResult:
    """The run's summary (`train.trainer.train` returns it; the run record's last line)."""

    steps: int
    first_loss: float
    final_loss: float
    final_val_loss: float | None
    params: int
    tokens_per_s: float
    run_dir: str | None
    model_state_mb: float
    # run.trace: mean over ranks of the communication hidden behind compute
    comm_hidden_fraction: float | None = None
    mfu: float | None = None  # model FLOPs per second at the median step over the devices' peak
    # why the run stopped before train.steps with a checkpoint (SIGTERM, exit_after...)
    stopped: str | None = None


@dataclass(frozen=True)
class RunInfo:
    """What a run is, told once before its first step: the config (its batch resolved), the model,
    where it starts."""

    cfg: Config
    model_config: LlamaConfig
    params: int
    world: int
    dp: int
    start_step: int  # steps done before this run (a resume's), 0 for a new run
    resumed_from: Path | None
    notes: tuple[str, ...]  # what validation changed of the config, to say at start-up
    layout: str  # `ParallelModel.describe_layout`
    data: str  # the data set, described


@dataclass(frozen=True)
class StepResult:
    """One training step, as every observer sees it. Loss and norm stay on the device (no host sync)
    except on log steps (``logged``: every ``run.log_every`` and the last), where the trainer has
    fetched them."""

    step: int  # 0-based
    lr: float
    tokens: int  # in the global batch
    loss: torch.Tensor  # the mean over the data-parallel ranks, 0-d on the device
    grad_norm: torch.Tensor | None  # the global norm before clipping (None: none computed)
    traffic: CommTotals  # the step's data-parallel traffic (`ParallelModel.step_traffic_dims`)
    model_state_mb: (
        float  # model states held by this rank, measured once the optimizer state exists
    )
    logged: bool
    loss_value: float | None = None  # on log steps: `loss` on the host
    # on log steps: seconds per step since the previous log (`TrainingClock`)
    step_time_s: float | None = None
    grad_norm_value: float | None = None  # on log steps: `grad_norm` on the host
    # every mesh dim's traffic in the step (`CommLog.by_dim`), before the metrics' collectives
    traffic_by_dim: Mapping[str, CommTotals] = dataclasses.field(default_factory=dict)
    # on an accelerator's log steps: the device's peak allocated memory so far (MiB); None on CPU
    peak_memory_mb: float | None = None
    # ft: the replica groups in the step's quorum (None: ft off)
    replicas: int | None = None

    @property
    def steps_done(self) -> int:
        """The step's number as every record, line and picture shows it (1-based)."""
        return self.step + 1


@dataclass(frozen=True)
class EvalResult:
    """An evaluation on the held-out batches after ``step`` (0-based)."""

    step: int
    val_loss: float

    @property
    def steps_done(self) -> int:
        return self.step + 1


class TrainObserver:
    """Something that watches a run, at the trainer's fixed points; every hook is a no-op here, so
    an observer defines only those it needs. On every rank, in the trainer's order; a hook may call
    collectives, then every rank's observer must. Run-end and abort hooks run in reverse order
    (teardown: the last built, the first closed).

    - ``on_run_start(info)``: once, before the first step;
    - ``on_step_start(step)``: before the step's first forward (the `CommLog` just reset);
    - ``on_step_end(result)``: after the optimizer step and the loss's all-reduce;
    - ``on_eval(result)``: after an evaluation (inside the evaluator's ``on_step_end``);
    - ``on_run_end(result)``: once after the last step (``result`` may be completed, e.g. by the
      step trace);
    - ``on_run_abort(step, error)``: the run fails in ``step`` (0-based; any exception raised in
      it, a non-finite gradient among them) and ``error`` is raised."""

    def on_run_start(self, info: RunInfo) -> None:
        pass

    def on_step_start(self, step: int) -> None:
        pass

    def on_step_end(self, result: StepResult) -> None:
        pass

    def on_eval(self, result: EvalResult) -> None:
        pass

    def on_run_end(self, result: TrainResult) -> None:
        pass

    def on_run_abort(self, step: int, error: BaseException) -> None:
        pass


class TrainingClock:
    """Wall time spent training, for the step time of log steps: evaluations (`restart`) and
    checkpoint saves (`exclude`) are left out."""

    def __init__(self, steps_done: int = 0) -> None:
        self.restart(steps_done)

    def restart(self, steps_done: int) -> None:
        """Count from now, ``steps_done`` steps finished."""
        self.since, self.since_step = time.perf_counter(), steps_done

    def exclude(self, seconds: float) -> None:
        """``seconds`` just spent were not training."""
        self.since += seconds

    def lap(self, step: int) -> float:
        """Seconds per step since the last lap or restart, ``step`` (0-based) just finished."""
        now = time.perf_counter()
        dt = (now - self.since) / (step + 1 - self.since_step)
        self.since, self.since_step = now, step + 1
        return dt


@dataclass(frozen=True)
class Throughput:
    """Tokens and model FLOPs per second, and MFU (docs/design.md#flops-and-mfu): model FLOPs per
    token (6·N + 6·n_layers·L·D: causal attention's half) × tokens per step / step time, against
    every rank's device peak."""

    tokens_per_step: int
    flops_per_token: float
    peak_flops: float | None  # the devices' peak summed over the world (None: unknown)
    world: int

    def tokens_per_s(self, step_s: float) -> float:
        return self.tokens_per_step / step_s

    def tflops_per_device(self, step_s: float) -> float:
        return self.tokens_per_step * self.flops_per_token / step_s / self.world / 1e12

    def mfu(self, step_s: float) -> float | None:
        """None where a device's peak is unknown (`observe.peak.device_peak_flops`)."""
        if self.peak_flops is None:
            return None
        return self.tokens_per_step * self.flops_per_token / step_s / self.peak_flops


class MoELoad(TrainObserver):
    """`ParallelModel.moe_load` read once per step for every observer that shows it (it is a
    collective: every rank reads it, through the first observer asking, `RunRecordLog`)."""

    def __init__(self, model: ParallelModel) -> None:
        self.model, self._read, self._load = model, False, None

    def on_step_start(self, step: int) -> None:
        self._read, self._load = False, None

    def moe_load(self) -> dict[str, dict[str, Any]] | None:
        if not self._read:
            self._load, self._read = self.model.moe_load(), True
        return self._load


def moe_imbalance(layer: Mapping[str, Any]) -> float:
    """One MoE layer's load as a number: max / mean assignments per expert (1: balanced)."""
    counts = layer["tokens_per_expert"]
    return max(counts) / max(sum(counts) / len(counts), 1e-9)


class RunRecordLog(TrainObserver):
    """The run record's side of the run (rank 0 writes, `RunRecord`): the config record and the
    start-up lines, a train record (and an MoE record) with the progress bar, or without one a
    console line, per log step, a val record per evaluation, an error record when the run fails, the
    summary and the loss curve at the end. ``model``: what `moe_load` is read from (a `MoELoad`
    shares one read with other observers)."""

    def __init__(
        self,
        record: RunRecord,
        model: ParallelModel | MoELoad,
        throughput: Throughput,
        plot_title: str | None,
    ) -> None:
        self.record, self.model, self.throughput, self.plot_title = (
            record,
            model,
            throughput,
            plot_title,
        )

    def on_run_start(self, info: RunInfo) -> None:
        cfg, t = info.cfg, info.cfg.train
        self.record.write(
            {
                "kind": "config",
                **cfg.to_dict(),
                "model_config": dataclasses.asdict(info.model_config),
                "params": info.params,
                "world": info.world,
                "dp": info.dp,
                "resumed_from": str(info.resumed_from) if info.resumed_from else None,
                "start_step": info.start_step,
            }
        )
        for note in info.notes:
            self.record.say(f"fivefold: note: {note}")
        if info.resumed_from is not None:
            self.record.say(
                f"fivefold: resumed from {info.resumed_from} after {info.start_step} steps"
            )
        self.record.say(
            f"fivefold: {cfg.model.preset} model, {info.params / 1e6:.2f}M params, {info.layout}, "
            f"global batch {t.global_batch} × {t.seq_len} tokens (micro {t.micro_batch} × accum "
            f"{t.grad_accum}), {info.data}"
        )

    def on_step_end(self, result: StepResult) -> None:
        if not result.logged:
            return
        r, tp, dt = result, self.throughput, result.step_time_s
        mfu = tp.mfu(dt)
        self.record.write(
            {
                "kind": "train",
                "step": r.steps_done,
                "loss": r.loss_value,
                "lr": r.lr,
                "grad_norm": r.grad_norm_value,
                "step_time_s": dt,
                "tokens_per_s": tp.tokens_per_s(dt),
                "model_state_mb": r.model_state_mb or None,  # (null before it is measured)
                **({} if r.peak_memory_mb is None else {"peak_memory_mb": r.peak_memory_mb}),
                **({} if r.replicas is None else {"replicas": r.replicas}),
                "flops_per_token": tp.flops_per_token,
                "achieved_tflops_per_device": tp.tflops_per_device(dt),
                "mfu": tp.mfu(dt),
                "comm_calls": r.traffic.calls,
                "comm_payload_bytes": r.traffic.payload_bytes,
                "comm_wire_bytes": r.traffic.wire_bytes,
                # every mesh dim's traffic of the step (the figures above: the data-parallel dims')
                "comm_by_dim": {
                    dim: {
                        "calls": t.calls,
                        "payload_bytes": t.payload_bytes,
                        "wire_bytes": t.wire_bytes,
                    }
                    for dim, t in r.traffic_by_dim.items()
                },
            }
        )
        moe = self.model.moe_load()  # expert load of the step's last micro-batch (MoE models)
        if moe is not None:
            self.record.write({"kind": "moe", "step": r.steps_done, "layers": moe})
        progress = self.record.progress
        mfu_text = "n/a" if mfu is None else f"{mfu:.1%}"
        if progress.bar is None:  # no bar (run.progress false): a line per log step
            progress.done = r.steps_done
            loss = "n/a" if r.loss_value is None else f"{r.loss_value:.3f}"
            # (measured once the optimizer state exists: from the second step on)
            state = f", model state {r.model_state_mb:.1f} MB" if r.model_state_mb else ""
            self.record.say(
                f"step {r.steps_done}/{self.record.steps}: loss {loss}, "
                f"{tp.tokens_per_s(dt):,.0f} tokens/s, {dt * 1e3:.0f} ms/step, MFU {mfu_text}"
                + state
            )
            return
        progress.update(
            r.steps_done - progress.done,
            loss=f"{r.loss_value:.3f}",
            tok_s=f"{tp.tokens_per_s(dt):,.0f}",
            step_ms=f"{dt * 1e3:.0f}",
            mfu=mfu_text,
            state_MB=f"{r.model_state_mb:.1f}",
        )

    def on_eval(self, result: EvalResult) -> None:
        self.record.write({"kind": "val", "step": result.steps_done, "val_loss": result.val_loss})
        self.record.say(f"step {result.steps_done}: val loss {result.val_loss:.3f}")

    def on_run_end(self, result: TrainResult) -> None:
        self.record.close(dataclasses.asdict(result), self.plot_title)

    def on_run_abort(self, step: int, error: BaseException) -> None:
        what = (
            "non-finite gradient" if isinstance(error, NonFiniteGradient) else type(error).__name__
        )
        # the failing step's number (1-based): the steps done before it, plus one
        self.record.write({"kind": "error", "step": step + 1, "error": what, "message": str(error)})
        self.record.abort()


class RunSummary(TrainObserver):
    """Collects what the run's `TrainResult` reports: the logged losses and step times, the last
    evaluation, the model-state memory."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.val_loss: float | None = None
        self.model_state_mb = 0.0

    def on_step_end(self, result: StepResult) -> None:
        self.model_state_mb = result.model_state_mb
        if result.logged:
            self.losses.append(result.loss_value)
            self.step_times.append(result.step_time_s)

    def on_eval(self, result: EvalResult) -> None:
        self.val_loss = result.val_loss

    def result(
        self,
        steps: int,
        params: int,
        throughput: Throughput,
        run_dir: Path | None,
        stopped: str | None,
    ) -> TrainResult:
        """Throughput at the median step time, the first logged interval (start-up) left out."""
        steady = sorted(self.step_times[1:] or self.step_times) or [
            float("nan")
        ]  # (a run stopped before its first log step)
        losses = self.losses or [float("nan")]
        median = steady[len(steady) // 2]
        return TrainResult(
            steps,
            losses[0],
            losses[-1],
            self.val_loss,
            params,
            throughput.tokens_per_s(median),
            str(run_dir) if run_dir else None,
            self.model_state_mb,
            mfu=throughput.mfu(median),
            stopped=stopped,
        )


class StepTraceLog(TrainObserver):
    """``run.trace``: the `StepTracer` traces the steps of ``window`` (`trace.trace_window`; before
    evaluation and checkpoints: the trace holds training steps); at the end every rank's steps are
    gathered on rank 0 over ``world``, whose record writes ``trace.json``, ``step_trace.png`` and
    the hidden-communication figure into the summary."""

    def __init__(
        self,
        tracer: StepTracer,
        window: range,
        model: ParallelModel,
        world: Comm,
        record: RunRecord,
        title: str,
    ) -> None:
        self.tracer, self.window, self.model = tracer, window, model
        self.world, self.record, self.title = world, record, title

    def on_step_start(self, step: int) -> None:
        if step in self.window:  # traced as numbered in metrics.jsonl (1-based)
            self.tracer.begin_step(step + 1)

    def on_step_end(self, result: StepResult) -> None:
        if result.step in self.window:
            self.tracer.end_step(self.model.action_marks())

    def on_run_end(self, result: TrainResult) -> None:
        self.tracer.close()
        traces = self.world.gather_object(self.tracer.result())
        figures = self.record.trace(traces, self.title)
        if figures is not None:
            result.comm_hidden_fraction = figures["comm_hidden_fraction"]


class PipelineTimelineLog(TrainObserver):
    """Under pp, at the end: the last step's measured timeline from every pp rank, its bubble next
    to the schedule's formula, ``timeline.png`` and (without a step trace, which holds the same
    actions) ``trace.json``."""

    def __init__(self, model: ParallelModel, record: RunRecord, chrome_trace: bool) -> None:
        self.model, self.record, self.chrome_trace = model, record, chrome_trace

    def on_run_end(self, result: TrainResult) -> None:
        measured = self.model.measured_pipeline()  # collective over pp, gathered once
        if measured is not None:
            self.record.pipeline(
                measured.timeline,
                measured.formula_bubble,
                measured.title,
                chrome_trace=self.chrome_trace,
            )
