"""The trainer's observers of `run.profile` and `run.memory_snapshot` (the mechanisms are
`fivefold.observe.profile`'s), and the flight recorder a config asks for (`run.flight_recorder`,
`fivefold.distributed.flight_recorder`). Every rank writes its own files; rank 0 says where, once,
at the run's start."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fivefold.config import Config
from fivefold.distributed.flight_recorder import FlightRecorder
from fivefold.observe.profile import (
    PROFILE_DIR,
    SNAPSHOT_DIR,
    MemoryHistory,
    StepProfiler,
    describe_steps,
    profile_window,
)
from fivefold.paths import one_component
from fivefold.train.metrics import RunInfo, RunRecord, StepResult, TrainObserver, TrainResult

__all__ = ["FLIGHT_RECORDER_DIR", "MemorySnapshotLog", "ProfileLog", "flight_recorder_for"]

FLIGHT_RECORDER_DIR = "flight_recorder"


def flight_recorder_for(cfg: Config) -> FlightRecorder | None:
    """``run.flight_recorder`` > 0: the recorder of ``<run dir>/flight_recorder`` (absolute; the
    run's name one directory name, `paths.one_component`, even before the run is validated)."""
    if cfg.run.flight_recorder <= 0:
        return None
    one_component(cfg.run.name, "run.name")
    directory = os.path.abspath(Path(cfg.run.out_dir) / cfg.run.name / FLIGHT_RECORDER_DIR)
    return FlightRecorder(directory, cfg.run.flight_recorder)


class ProfileLog(TrainObserver):
    """``run.profile``: this rank's `StepProfiler` over ``window``, from its first step's start to
    its last step's end (an evaluation or save between two of its steps is in the trace, outside
    the steps' spans); the trace written when the window ends, or when the run ends or aborts
    inside it."""

    def __init__(
        self, window: range, run_dir: Path, rank: int, device: torch.device, record: RunRecord
    ) -> None:
        self.directory = run_dir / PROFILE_DIR
        self.profiler = StepProfiler(window, self.directory / f"rank{rank}.json", device)
        self.record = record

    @classmethod
    def for_run(
        cls, cfg: Config, start: int, rank: int, device: torch.device, record: RunRecord
    ) -> ProfileLog | None:
        r = cfg.run
        window = profile_window(start, cfg.train.steps, r.profile, r.exit_after)
        if not window:
            return None
        return cls(window, Path(r.out_dir) / r.name, rank, device, record)

    def on_run_start(self, info: RunInfo) -> None:
        steps = describe_steps(self.profiler.window)
        self.record.say(
            f"fivefold: profile: {steps} -> {self.directory}/rank<R>.json (one per rank; "
            "chrome://tracing or ui.perfetto.dev)"
        )

    def on_step_start(self, step: int) -> None:
        self.profiler.begin_step(step)

    def on_step_end(self, result: StepResult) -> None:
        self.profiler.end_step(result.step)

    def on_run_end(self, result: TrainResult) -> None:
        self.profiler.close()

    def on_run_abort(self, step: int, error: BaseException) -> None:
        self.profiler.close()


class MemorySnapshotLog(TrainObserver):
    """``run.memory_snapshot`` (CUDA): this rank's `MemoryHistory`, recording from the run's start
    to its end (or abort), or over the profiled ``window`` when there is one."""

    def __init__(
        self, run_dir: Path, rank: int, record: RunRecord, window: range | None = None
    ) -> None:
        self.directory = run_dir / SNAPSHOT_DIR
        self.history = MemoryHistory(self.directory / f"rank{rank}.pickle")
        self.window, self.record = window or None, record

    def on_run_start(self, info: RunInfo) -> None:
        when = (
            f"over {describe_steps(self.window)}"
            if self.window
            else "from the run's start to its end"
        )
        self.record.say(
            f"fivefold: memory snapshot {when} -> {self.directory}/rank<R>.pickle (one per rank; "
            "open it at pytorch.org/memory_viz)"
        )
        if self.window is None:
            self.history.start()

    def on_step_start(self, step: int) -> None:
        if self.window and step == self.window.start:
            self.history.start()

    def on_step_end(self, result: StepResult) -> None:
        if self.window and result.step == self.window[-1]:
            self.history.dump()

    def on_run_end(self, result: TrainResult) -> None:
        self.history.dump()

    def on_run_abort(self, step: int, error: BaseException) -> None:
        self.history.dump()
