"""torch's flight recorder (`run.flight_recorder`): each rank's ring buffer of its last collectives
(NCCL's and gloo's, with their state, sizes and call stacks), dumped per rank into one directory
when a job hangs.

- `FlightRecorder.arm`, in each worker before its process group exists: torch's variables
  (TORCH_FR_BUFFER_SIZE: the entries kept; TORCH_NCCL_DUMP_ON_TIMEOUT: NCCL's own watchdog dumps
  when a collective times out; TORCH_FR_DUMP_TEMP_FILE: the files' prefix, ``<dir>/rank``, torch
  appending the global rank; torch 2.13's names: the older TORCH_NCCL_TRACE_BUFFER_SIZE and
  TORCH_NCCL_DEBUG_INFO_TEMP_FILE still work but warn), and the directory made.
- `FlightRecorder.install`: SIGUSR1 makes the worker write its dump ``<dir>/rank<R>``. A Python
  signal handler runs only when the main thread is back in the interpreter, never while it is
  blocked inside a collective (the case that matters), so the signal only wakes a thread (the
  interpreter's wakeup fd, written by its C handler at once) and that thread dumps.
- `FlightRecorder.request_dumps`: the launcher's watchdog, on a stall, signals the live workers and
  waits up to ``grace_s`` for their dumps before it kills them.

The files are torch's pickles, as its own dump on a timeout writes them (``python -m
torch.distributed.flight_recorder.fr_trace <dir>`` analyses NCCL's; torch 2.13's analyser fails on
gloo's, whose entries and ``pg_status`` read as they are). Only torch and the standard library
here.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DUMP_SIGNAL", "FlightRecorder", "dump_function"]

DUMP_SIGNAL = signal.SIGUSR1
PREFIX = "rank"  # the files: <dir>/rank<R>, torch's dump on a timeout and ours alike


def dump_function(device_type: str) -> Callable[[], bytes]:
    """torch's dump of this process's recorder as a pickle: NCCL's on CUDA (its collectives are
    recorded apart), the generic recorder's (gloo) otherwise."""
    import torch._C._distributed_c10d as c10d

    nccl = getattr(c10d, "_dump_nccl_trace", None) if device_type == "cuda" else None
    return nccl if nccl is not None else c10d._dump_fr_trace


@dataclass(frozen=True)
class FlightRecorder:
    """``directory`` (absolute: workers may start elsewhere) receives ``rank<R>`` per rank;
    ``entries``: the collectives each rank keeps; ``grace_s``: how long the launcher waits for the
    dumps before killing stalled workers."""

    directory: str
    entries: int
    grace_s: float = 10.0

    def path(self, rank: int) -> Path:
        return Path(self.directory) / f"{PREFIX}{rank}"

    def env(self) -> dict[str, str]:
        """torch's variables for a worker (read when its first process group is made)."""
        prefix = os.path.join(self.directory, PREFIX)
        return {
            "TORCH_FR_BUFFER_SIZE": str(self.entries),
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": prefix,
        }

    def arm(self) -> None:
        """In a worker, before its process group is created: the variables set. The directory is
        made once the run is validated (`make_directory`): a refused run leaves none."""
        os.environ.update(self.env())

    def make_directory(self) -> None:
        """Where torch's own dump on a timeout writes (it does not make the directory)."""
        os.makedirs(self.directory, exist_ok=True)

    def dump(self, rank: int, device_type: str, dump: Callable[[], bytes] | None = None) -> Path:
        """Write this rank's recorder to ``<dir>/rank<R>`` (whole or not at all)."""
        data = (dump or dump_function(device_type))()
        path = self.path(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return path

    def install(
        self, rank: int, device_type: str, dump: Callable[[], bytes] | None = None
    ) -> threading.Thread:
        """In a worker's main thread: SIGUSR1 dumps this rank's recorder (see the module docstring),
        from a daemon thread that waits on the interpreter's wakeup fd. ``dump``: torch's function
        by default."""
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        signal.signal(DUMP_SIGNAL, lambda signum, frame: None)  # the thread does the work
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

        def serve() -> None:
            while True:
                signals = os.read(read_fd, 64)  # one byte per signal caught, any of them
                if not signals:
                    return
                if DUMP_SIGNAL in signals:
                    try:
                        self.dump(rank, device_type, dump)
                    except Exception as e:  # a dump that failed must not end the run
                        print(
                            f"fivefold: rank {rank}: flight recorder dump failed: {e}", flush=True
                        )

        thread = threading.Thread(target=serve, name="fivefold-flight-recorder", daemon=True)
        thread.start()
        return thread

    def request_dumps(self, pids: dict[int, int]) -> str:
        """The launcher, before killing stalled workers: SIGUSR1 to each live worker (rank -> pid),
        then wait up to ``grace_s`` for every one's dump to be (re)written; a line saying where they
        are and which ranks did not dump (a frozen process cannot)."""

        def stamp(rank: int) -> int | None:
            try:
                return self.path(rank).stat().st_mtime_ns
            except OSError:
                return None

        before = {rank: stamp(rank) for rank in pids}
        for pid in pids.values():
            try:
                os.kill(pid, DUMP_SIGNAL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.grace_s
        while True:
            done = [r for r in pids if stamp(r) is not None and stamp(r) != before[r]]
            if len(done) == len(pids) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        missing = sorted(set(pids) - set(done))
        line = (
            f"flight recorder: rank(s) {', '.join(map(str, sorted(done))) or 'none'} dumped to "
            f"{self.directory} (docs/reliability.md#the-flight-recorder)"
        )
        if missing:
            line += (
                f"; rank(s) {', '.join(map(str, missing))} did not within {self.grace_s:.0f} s "
                "(frozen?)"
            )
        return line
