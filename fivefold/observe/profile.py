"""What a run's steps cost inside torch, per rank: torch.profiler over a window of steady-state
steps (`run.profile`: `StepProfiler`, one Chrome trace per rank) and the CUDA caching allocator's
history (`run.memory_snapshot`: `MemoryHistory`, one snapshot per rank, for
pytorch.org/memory_viz).

Each rank writes its own files into the run directory (under torchrun on several nodes, each node
its ranks'); neither issues a collective. The window is this invocation's last steps, never its
first (`profile_window`: the first step compiles, allocates the optimizer state and records
ZeRO-3's orders). The trainer's observers (`fivefold.train.profiling`) drive both; nothing here
touches torch.cuda unless the device is CUDA.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fivefold.observe.trace import trace_window
from fivefold.paths import atomic_path

__all__ = [
    "MAX_ENTRIES",
    "PROFILE_DIR",
    "SNAPSHOT_DIR",
    "MemoryHistory",
    "StepProfiler",
    "describe_steps",
    "profile_window",
    "step_label",
]

PROFILE_DIR = "profile"  # <run dir>/profile/rank<R>.json
SNAPSHOT_DIR = "memory_snapshot"  # <run dir>/memory_snapshot/rank<R>.pickle
MAX_ENTRIES = 100_000  # allocator events kept (torch's own default)


def profile_window(start: int, steps: int, profile_steps: int, exit_after: int = 0) -> range:
    """The steps `run.profile` profiles (0-based): this invocation's last ``profile_steps``, where
    it stops (``run.exit_after``, as `trace_window`), less its first, ``start`` (`validate` refuses
    a new run whose window would hold it; a resumed one profiles fewer)."""
    if profile_steps <= 0:
        return range(0)
    window = trace_window(start, steps, profile_steps, exit_after)
    return range(max(window.start, start + 1), window.stop)


def describe_steps(window: range) -> str:
    """``window``'s steps as the progress bar counts them: "step 4", "steps 4-5", "no step"."""
    if not window:
        return "no step"
    first, last = window.start + 1, window.stop
    return f"step {first}" if first == last else f"steps {first}-{last}"


def step_label(step: int) -> str:
    """The profiler's mark of 0-based ``step``, numbered as the progress bar counts (steps done)."""
    return f"fivefold step {step + 1}"


class StepProfiler:
    """torch.profiler from the start of ``window``'s first step to the end of its last, each step
    inside a `record_function` named `step_label`; CPU activity, and CUDA's on a CUDA device;
    memory and shapes recorded. `close` (the window's end, or the run's if it stopped first) writes
    ``path`` as a Chrome trace."""

    def __init__(self, window: range, path: Path, device: torch.device) -> None:
        self.window, self.path, self.device = window, path, device
        self._profiler: torch.profiler.profile | None = None
        self._mark: torch.profiler.record_function | None = None
        self.written = False

    def activities(self) -> list[torch.profiler.ProfilerActivity]:
        cuda = [torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else []
        return [torch.profiler.ProfilerActivity.CPU, *cuda]

    def begin_step(self, step: int) -> None:
        if step not in self.window:
            return
        if self._profiler is None:
            self._profiler = torch.profiler.profile(
                activities=self.activities(), profile_memory=True, record_shapes=True
            )
            self._profiler.__enter__()
        self._mark = torch.profiler.record_function(step_label(step))
        self._mark.__enter__()

    def end_step(self, step: int) -> None:
        if step not in self.window:
            return
        self._end_mark()
        if step == self.window[-1]:
            self.close()

    def _end_mark(self) -> None:
        if self._mark is not None:
            self._mark.__exit__(None, None, None)
            self._mark = None

    def close(self) -> None:
        """Stop profiling and write the trace (once; nothing if no step was profiled)."""
        if self._profiler is None:
            return
        self._end_mark()
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        with atomic_path(self.path, suffix=".json") as tmp:  # whole or not at all
            profiler.export_chrome_trace(str(tmp))
        self.written = True


class MemoryHistory:
    """CUDA's caching allocator recording every allocation and free with its stack
    (``torch.cuda.memory._record_memory_history``), from `start` to `dump`, which writes the
    snapshot (the blocks and segments alive then, the recorded events) to ``path`` and stops the
    recording. An out-of-memory error while recording writes the snapshot at once (torch's
    allocator observer: the run then fails before any observer hears of it). Only for a CUDA
    device (`validate` refuses it elsewhere)."""

    def __init__(self, path: Path, max_entries: int = MAX_ENTRIES) -> None:
        self.path, self.max_entries = path, max_entries
        self.recording = False
        self._observing = False

    def start(self) -> None:
        if self.recording:
            return
        torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        self.recording = True
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None and not self._observing:  # once: torch keeps observers for good
            attach(self._on_out_of_memory)
            self._observing = True

    def _write(self) -> None:
        with atomic_path(self.path, suffix=".pickle") as tmp:  # whole or not at all
            torch.cuda.memory._dump_snapshot(str(tmp))

    def _on_out_of_memory(self, device: int, size: int, allocated: int, free: int) -> None:
        # the allocator calls this with its lock released (torch's own recipe dumps here)
        if self.recording:
            self._write()

    def dump(self) -> None:
        """Write the snapshot and stop recording (a no-op when not recording)."""
        if not self.recording:
            return
        self._write()
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording = False
