"""Session setup: `import bench` finds the checkout's `bench/`, and the fast tier's spawn guard.

The benchmarks live in the checkout's top-level `bench/` (not in the package). A test that starts
another process — gloo workers (`run_workers`, `launch_local`, the trainer), a subprocess, a process
pool (tests/tolerance.py's OTHER kernel path), directly or through a fixture — is marked
`multiprocess`. When a run deselects those (`-m "not multiprocess"`, or with FIVEFOLD_TEST_FAST=1
set), any attempt of an unmarked test (or of a module being collected) to start a process raises
`UnmarkedSpawn` naming the test, and a test that swallowed that error fails all the same: a missing
marker fails the fast tier loudly instead of slowing it. The guard is armed only while a collector
or a test (its setup, call, teardown) runs, so pytest and its plugins may start what they like
around them. No tests here."""

from __future__ import annotations

import concurrent.futures.process
import multiprocessing.process
import multiprocessing.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

MARK = "multiprocess"
FAST_ENV = "FIVEFOLD_TEST_FAST"


class UnmarkedSpawn(RuntimeError):
    """A test not marked `multiprocess` tried to start a process while the multiprocess tests are deselected."""


# Every way a test starts a process, as far as Python sees it: subprocess (run, check_output, os.popen, asyncio);
# multiprocessing's processes (Process, Pool, torch.multiprocessing.start_processes/spawn — all start through
# BaseProcess.start) and its helper processes (resource tracker, forkserver: spawnv_passfds); a process pool (refused
# when made, before a pool that a cache keeps exists); and os's own fork/spawn/system.
_ENTRY_POINTS = [
    (subprocess.Popen, "__init__", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),
    (multiprocessing.util, "spawnv_passfds", "multiprocessing helper process"),
    (concurrent.futures.process.ProcessPoolExecutor, "__init__", "ProcessPoolExecutor"),
    *((os, name, f"os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")
      if hasattr(os, name)),
]


class _Guard:
    def __init__(self) -> None:
        self.armed = False  # inside a collector or a test not marked multiprocess
        self.where = ""  # that collector's or test's node id
        self.tripped: dict[str, str] = {}  # node id -> the error it raised (kept in case the test swallowed it)
        self._saved: list[tuple[object, str, object]] = []

    def install(self) -> None:
        for owner, name, what in _ENTRY_POINTS:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._refusing(original, what))

    def uninstall(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def _refusing(self, original, what: str):
        guard = self

        def refuse(*args, **kwargs):
            if not guard.armed:
                return original(*args, **kwargs)
            message = (f"{guard.where} started a process ({what}) in a run that deselects the multiprocess tests "
                       f"(-m 'not multiprocess' / {FAST_ENV}=1): mark it @pytest.mark.{MARK} (every test of its "
                       f"module: pytestmark = pytest.mark.{MARK})")
            guard.tripped.setdefault(guard.where, message)
            raise UnmarkedSpawn(message)

        refuse.__wrapped__ = original
        return refuse


_GUARD = _Guard()
_ENABLED = False


def _deselects_multiprocess(markexpr: str) -> bool:
    """Does `-m markexpr` drop a test marked only `multiprocess` and keep an unmarked one ("not multiprocess",
    "not multiprocess and not other_kernels", ...)?"""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
        return not expr.evaluate(lambda name, **kw: name == MARK and not kw) and expr.evaluate(lambda name, **kw: False)
    except Exception:  # another pytest's expression API, or an expression pytest itself will reject
        return False


def pytest_configure(config: pytest.Config) -> None:
    global _ENABLED
    _ENABLED = os.environ.get(FAST_ENV, "") not in ("", "0") or _deselects_multiprocess(config.option.markexpr)
    if _ENABLED:
        _warm_font_cache()
        _GUARD.install()
        config.add_cleanup(_GUARD.uninstall)


def _warm_font_cache() -> None:
    """matplotlib builds its font cache on first use, asking fontconfig (`fc-list`, a subprocess): on
    a fresh machine the first test that draws would trip the guard for a process it did not start.
    Built here, before the guard is armed (once per machine; later sessions read the cache)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import font_manager

        font_manager.fontManager  # noqa: B018 (loads or builds the cache)
    except ImportError:
        pass


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    before = _GUARD.armed, _GUARD.where  # (collectors nest: a directory's collects its children)
    _GUARD.armed, _GUARD.where = _ENABLED, collector.nodeid or "collection"
    try:
        return (yield)
    finally:
        _GUARD.armed, _GUARD.where = before


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _GUARD.armed, _GUARD.where = _ENABLED and item.get_closest_marker(MARK) is None, item.nodeid
    try:
        return (yield)
    finally:
        _GUARD.armed = False
        _GUARD.tripped.pop(item.nodeid, None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    message = _GUARD.tripped.pop(item.nodeid, None)
    if message is not None and report.passed:  # the test caught UnmarkedSpawn and went on: it fails all the same
        report.outcome, report.longrepr = "failed", f"UnmarkedSpawn (caught by the test): {message}"
    return report
