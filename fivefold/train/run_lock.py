"""One run per run directory: `RunLock`, an OS file lock held for the run's life.

Two runs on one ``--run.name`` (or two ``--resume`` of one run) would write the same checkpoints and
append to the same ``metrics.jsonl``. The first takes ``<dir>/.lock`` with ``flock`` (exclusive,
non-blocking) and writes its pid, host and start time into it; a second finds the lock taken and is
refused, naming the holder. The kernel releases the lock when the holder exits in any way — a crash
or SIGKILL included — so a lock never outlives its run and needs no cleanup; the file left behind is
only a record. (Over NFS, ``flock`` is per host on old kernels and clients: there a lock guards
against a second run on the same host.)
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

__all__ = ["LOCK_FILE", "RunDirLocked", "RunLock"]

LOCK_FILE = ".lock"


class RunDirLocked(ValueError):
    """Another live process holds the run directory."""


class RunLock:
    """Exclusive locks on ``directories`` (created if missing) for a ``with`` block or until
    `release`."""

    def __init__(self, *directories: Path) -> None:
        self.directories = list(dict.fromkeys(Path(d) for d in directories))
        self._fds: list[int] = []

    def acquire(self) -> RunLock:
        try:
            for d in self.directories:
                self._fds.append(_take(d))
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._fds = []

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _take(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirLocked(
            f"run directory {str(directory)!r} is in use by {holder}: wait for that run to end or "
            "stop it, or choose another --run.name (or checkpoint.dir)"
        ) from None
    except OSError:
        os.close(fd)
        raise
    record = json.dumps(
        {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    ).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    return fd


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"pid {info['pid']} on host {info['host']} (since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (its pid is not written yet)"
