"""Heartbeats and stall detection for locally launched workers.

Each worker runs a daemon thread (`Heartbeat`) that rewrites ``<dir>/rank<r>.json`` every second
with the time, its step (`report_step`, from the training loop) and the last collective it issued
(from its `CommLog`). The thread keeps beating while its rank waits inside a collective (the wait
releases the GIL), so:

- a rank whose heartbeat stops is frozen (stopped, swapped out, stuck holding the GIL): after
  ``heartbeat_s``;
- ranks that all beat but none of which finishes a step are hung on each other (a mismatched or
  missing collective): after ``stall_s`` (default: a few minutes, and at least 20 of the slowest
  steps seen).

The launcher's `Watchdog` reads the files between joins, and on a stall kills the workers and raises
`Stalled` naming the rank(s), their step and their last collective, instead of waiting for the
collective timeout.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ENV", "Heartbeat", "Stalled", "Watchdog", "report_step", "watch_comm_log"]

ENV = "FIVEFOLD_HEARTBEAT_DIR"  # set by the launcher for its workers
_PROGRESS: dict[str, Any] = {"step": None, "step_times": [], "log": None}


def report_step(step: int) -> None:
    """The training loop finished ``step`` steps (called by the trainer; cheap)."""
    now = time.time()
    last = _PROGRESS.get("step_at")
    if last is not None:
        _PROGRESS["step_times"] = (_PROGRESS["step_times"] + [now - last])[-50:]
    _PROGRESS.update(step=step, step_at=now)


def watch_comm_log(log: Any) -> None:
    """Report the last collective of this `CommLog` in the heartbeat."""
    _PROGRESS["log"] = log


def _last_collective() -> dict[str, Any] | None:
    log = _PROGRESS.get("log")
    records = getattr(log, "records", None)
    if not records:
        return None
    r = records[-1]
    return {
        "op": r.op,
        "dim": r.dim,
        "numel": r.numel,
        "dtype": str(r.dtype).removeprefix("torch."),
        "tag": r.tag,
    }


class Heartbeat:
    """The worker side: a daemon thread beating into ``directory`` every ``every`` seconds."""

    def __init__(self, directory: str | Path, rank: int, every: float = 1.0) -> None:
        self.path = Path(directory) / f"rank{rank}.json"
        self.rank, self.every = rank, every
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="fivefold-heartbeat", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            beat = {
                "rank": self.rank,
                "pid": os.getpid(),
                "time": time.time(),
                "step": _PROGRESS["step"],
                "step_at": _PROGRESS.get("step_at"),
                "max_step_s": max(_PROGRESS["step_times"], default=None),
                "collective": _last_collective(),
            }
            tmp = self.path.with_suffix(".tmp")
            try:
                tmp.write_text(json.dumps(beat))
                os.replace(tmp, self.path)
            except OSError:  # the launcher's directory is gone: the run is over
                return
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()


class Stalled(RuntimeError):
    """Workers stopped making progress; the message names which and where."""


@dataclass(frozen=True)
class Limits:
    """How long the launcher waits, in seconds: for a silent worker (``heartbeat_s``), for a
    finished step (``stall_s``; 0: judged from the step times, `Watchdog.stall_limit`) and for the
    first beat and step (``startup_s``)."""

    heartbeat_s: float = 60.0
    stall_s: float = 0.0
    startup_s: float = 600.0


class Watchdog:
    """The launcher side: reads the heartbeats of ``nproc`` workers in ``directory``."""

    def __init__(self, directory: str | Path, nproc: int, limits: Limits | None = None) -> None:
        self.directory, self.nproc = Path(directory), nproc
        self.limits = limits or Limits()
        self.started = time.time()

    def _beats(self) -> dict[int, dict[str, Any]]:
        beats = {}
        for r in range(self.nproc):
            try:
                beats[r] = json.loads((self.directory / f"rank{r}.json").read_text())
            except (OSError, ValueError):
                continue
        return beats

    def stall_limit(self, beats: dict[int, dict[str, Any]]) -> float:
        """Seconds without a finished step that count as a hang: ``stall_s`` if given, else the
        larger of 3 minutes and 20 of the slowest steps any rank has seen."""
        if self.limits.stall_s > 0:
            return self.limits.stall_s
        slowest = max((b.get("max_step_s") or 0.0 for b in beats.values()), default=0.0)
        return max(180.0, 20 * slowest)

    def check(self) -> str | None:
        """A description of the stall, or None while every worker makes progress."""
        now = time.time()
        beats = self._beats()
        frozen = [r for r, b in beats.items() if now - b["time"] > self.limits.heartbeat_s]
        if frozen:
            return "; ".join(
                f"rank {r} (pid {beats[r]['pid']}) has not answered for "
                f"{now - beats[r]['time']:.0f} s (stopped or frozen) {_in_step(beats[r])}, last "
                f"collective {_describe(beats[r]['collective'])}"
                for r in frozen
            )
        if len(beats) < self.nproc:
            missing = sorted(set(range(self.nproc)) - set(beats))
            if now - self.started > self.limits.startup_s:
                return (
                    f"rank(s) {missing} never started beating within {self.limits.startup_s:.0f} s"
                )
            return None
        progress = [b.get("step_at") for b in beats.values()]
        if any(p is None for p in progress):  # before the first step: start-up may be long
            if now - self.started > self.limits.startup_s:
                return (
                    f"no rank finished a first step within {self.limits.startup_s:.0f} s: "
                    + _where(beats)
                )
            return None
        latest = max(progress)
        limit = self.stall_limit(beats)
        if now - latest > limit:
            return (
                f"no rank finished a step for {now - latest:.0f} s (limit {limit:.0f} s): "
                + _where(beats)
            )
        return None


def _in_step(beat: dict[str, Any]) -> str:
    """Where a rank is, 1-based as the progress bar counts: the heartbeat carries the steps it has
    finished."""
    done = beat.get("step")
    return "before its first step" if done is None else f"in step {done + 1} ({done} finished)"


def _describe(c: dict[str, Any] | None) -> str:
    if not c:
        return "none yet"
    return f"{c['op']} over {c['dim']} of {c['numel']} {c['dtype']}" + (
        f" ({c['tag']})" if c["tag"] else ""
    )


def _where(beats: dict[int, dict[str, Any]]) -> str:
    return "; ".join(
        f"rank {r} {_in_step(b)}, last collective {_describe(b['collective'])}"
        for r, b in sorted(beats.items())
    )
