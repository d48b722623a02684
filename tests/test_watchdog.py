"""Stall detection: a frozen worker (SIGSTOP) stops the job within the heartbeat timeout, named.

The launcher reads every worker's heartbeat; the message names its rank, pid, step and last
collective; ranks that all beat without finishing a step are reported as a hang after the stall
limit (scaled to the slowest step) — unit-tested on written heartbeats. The real launches (a stopped
worker, one collective timeout for every group of the run) are `multiprocess`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fivefold.distributed.watchdog import Limits, Watchdog


def _beat(d: Path, rank: int, **fields) -> None:
    beat = {"rank": rank, "pid": 100 + rank, "time": time.time(), "step": 3, "step_at": time.time(),
            "max_step_s": 0.5, "collective": {"op": "all_reduce", "dim": "dp", "numel": 10, "dtype": "float32",
                                              "tag": "bucket0"}}
    beat.update(fields)
    (d / f"rank{rank}.json").write_text(json.dumps(beat))


def test_watchdog_tells_a_frozen_rank_from_a_hang(tmp_path):
    wd = Watchdog(tmp_path, 2, Limits(heartbeat_s=5, stall_s=0, startup_s=60))
    _beat(tmp_path, 0)
    assert wd.check() is None  # rank 1 not started yet: start-up allowance
    _beat(tmp_path, 1)
    assert wd.check() is None
    _beat(tmp_path, 1, time=time.time() - 30)
    problem = wd.check()
    assert "rank 1 (pid 101) has not answered for 30 s" in problem and "all_reduce over dp of 10 float32" in problem
    old = time.time() - 200  # both beat, neither finished a step for 200 s > max(180, 20 × 0.5)
    _beat(tmp_path, 0, step_at=old)
    _beat(tmp_path, 1, step_at=old)
    problem = wd.check()
    assert problem.startswith("no rank finished a step for 200 s (limit 180 s)")
    assert "rank 1 in step 4 (3 finished)" in problem
    _beat(tmp_path, 0, step_at=old, max_step_s=20.0)  # slow steps: the limit grows to 20 of them
    _beat(tmp_path, 1, step_at=old, max_step_s=20.0)
    assert wd.check() is None and wd.stall_limit(wd._beats()) == 400.0


def _workers(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(c) for c in (task / "children").read_text().split()]
    return [k for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


@pytest.mark.multiprocess
def test_a_stopped_worker_stops_the_job_naming_it(tmp_path):
    cli = [sys.executable, "-c", "from fivefold.cli import main; raise SystemExit(main())", "train", "--preset",
           "tiny", "--steps", "500", "--nproc", "2", "--run.out_dir", str(tmp_path), "--run.progress", "false",
           "--run.plot", "false", "--train.eval_every", "0", "--train.global_batch", "8", "--train.seq_len", "64",
           "--run.heartbeat_timeout_s", "4"]
    proc = subprocess.Popen(cli, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    metrics = tmp_path / "default" / "metrics.jsonl"
    frozen = None
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and frozen is None:
        time.sleep(0.05)
        if metrics.exists() and metrics.read_text().count('"train"') >= 2:
            workers = _workers(proc.pid)
            if len(workers) == 2:
                frozen = workers[1]
                os.kill(frozen, signal.SIGSTOP)
                stopped_at = time.time()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert frozen is not None, "the run ended before a worker could be stopped"
    assert proc.returncode == 1, err
    assert f"(pid {frozen}) has not answered" in err and "stopped or frozen" in err, err
    assert time.time() - stopped_at < 40  # the heartbeat timeout (4 s), not the collective timeout (30 min)


def _timeouts_worker() -> list[str]:
    import torch
    import torch.distributed as dist

    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    mesh = ParallelMesh(ParallelDims(dp=2), "cpu", CommLog(), debug_collectives=True, collective_timeout_s=7)
    groups = [mesh.comm("dp").group, mesh.comm("dp")._side, mesh.group("dp_cp"), mesh.world.group,
              mesh.own(dist.new_group(backend="gloo"))]
    return [str(g._get_backend(torch.device("cpu")).options._timeout) for g in groups]


@pytest.mark.multiprocess
def test_one_collective_timeout_for_every_group_of_the_run():
    from dist_utils import run_workers
    for timeouts in run_workers(_timeouts_worker, 2):
        assert timeouts == ["0:00:07"] * 5
