"""Watching a slow or hanging job: `run.profile` (torch.profiler traces per rank), `run.memory_snapshot`
(CUDA's allocator history: the calls, with torch.cuda.memory replaced, so no CUDA here; the real one is
tests/gpu/run.sh's) and `run.flight_recorder` (torch's recorder of collectives, dumped on a stall).

torch 2.13 records gloo's collectives in its flight recorder too, so the stall path runs for real here: a
2-rank gloo job where rank 0 waits in a collective rank 1 never joins; the launcher's watchdog has both dump
before it kills them, and rank 0's dump holds the stuck all-reduce. NCCL's dump is tests/gpu/run.sh's."""

from __future__ import annotations

import json
import os
import pickle
import signal
import time
from pathlib import Path

import pytest

from fivefold.config import Config, ConfigError
from fivefold.distributed.flight_recorder import FlightRecorder


def _stalling_worker() -> None:
    import torch
    import torch.distributed as dist

    from fivefold.distributed.watchdog import report_step

    dist.all_reduce(torch.ones(4))
    report_step(1)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3))  # rank 1 never joins: rank 0 waits here
    else:
        time.sleep(600)  # stuck in Python, outside any collective


@pytest.mark.multiprocess
def test_a_stall_has_every_rank_dump_its_flight_recorder_before_the_kill(tmp_path):
    from fivefold.distributed.launch import launch_local
    from fivefold.distributed.watchdog import Stalled

    recorder = FlightRecorder(str(tmp_path / "flight_recorder"), entries=50, grace_s=20)
    t0 = time.time()
    with pytest.raises(Stalled) as stalled:
        launch_local(_stalling_worker, 2, threads=1, timeout_s=120, watch=(60, 3),
                     flight_recorder=recorder)
    assert time.time() - t0 < 60  # the stall limit and the dumps, not the collective timeout
    message = str(stalled.value)
    assert "no rank finished a step" in message
    assert f"flight recorder: rank(s) 0, 1 dumped to {recorder.directory}" in message, message
    dumps = {r: pickle.loads((tmp_path / "flight_recorder" / f"rank{r}").read_bytes()) for r in (0, 1)}
    calls = {r: [(e["profiling_name"], e["collective_seq_id"], e["input_sizes"]) for e in d["entries"]]
             for r, d in dumps.items()}
    assert calls[0] == [("gloo:all_reduce", 1, [[4]]), ("gloo:all_reduce", 2, [[3]])], calls
    assert calls[1] == [("gloo:all_reduce", 1, [[4]])], calls  # rank 0 is one collective ahead


def test_the_flight_recorder_sets_torchs_variables_and_dumps_on_sigusr1(tmp_path, monkeypatch):
    """The worker's side in this process: its variables, and SIGUSR1 -> the thread -> a dump, with torch's dump
    function replaced by a stub (the real one needs a process group: the stall test above)."""
    recorder = FlightRecorder(str(tmp_path / "fr"), entries=7)
    for key in recorder.env():
        monkeypatch.delenv(key, raising=False)
    recorder.arm()
    assert {k: os.environ[k] for k in recorder.env()} == {
        "TORCH_FR_BUFFER_SIZE": "7",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "7",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "fr" / "rank"),
    }
    assert (tmp_path / "fr").is_dir()
    previous = signal.getsignal(signal.SIGUSR1)
    old_fd = signal.set_wakeup_fd(-1)
    try:
        recorder.install(3, "cpu", dump=lambda: b"stub dump")  # a stub: no process group here
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 10
        while not (tmp_path / "fr" / "rank3").exists() and time.time() < deadline:
            time.sleep(0.01)
        assert (tmp_path / "fr" / "rank3").read_bytes() == b"stub dump"
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGUSR1, previous)


def test_the_dump_function_is_nccls_on_cuda_and_the_generic_one_elsewhere(monkeypatch):
    import torch._C._distributed_c10d as c10d

    from fivefold.distributed.flight_recorder import dump_function
    assert dump_function("cpu") is c10d._dump_fr_trace
    monkeypatch.setattr(c10d, "_dump_nccl_trace", lambda: b"nccl", raising=False)
    assert dump_function("cuda")() == b"nccl"
