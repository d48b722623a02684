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
import torch

from fivefold.config import ConfigError, load_config
from fivefold.distributed.flight_recorder import FlightRecorder

MODEL = ["--preset", "tiny", "--model.n_layers", "2", "--model.dim", "64", "--model.ffn_hidden", "128"]


def _args(out_dir, *more: str) -> list[str]:
    return [*MODEL, "--nproc", "2", "--run.out_dir", str(out_dir), "--run.progress", "false", "--run.plot", "false",
            "--train.seq_len", "16", "--train.eval_every", "0", "--data.max_bytes", "200000", "--run.device", "cpu",
            *more]


# ----------------------------------------------------------------------------------------------------------------
# run.profile


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One 2-rank run of 5 steps, the last 2 profiled; the run's printed lines; every rank's trace."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("profile")
    cli = [sys.executable, "-m", "fivefold.cli", "train", *_args(out, "--steps", "5", "--run.profile", "2",
                                                                 "--run.flight_recorder", "20")]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = out / "default"
    traces = {r: json.loads((run_dir / "profile" / f"rank{r}.json").read_text()) for r in (0, 1)}
    return run_dir, done.stdout, traces


def _step_marks(trace: dict) -> list[str]:
    return sorted({e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("fivefold step")})


@pytest.mark.multiprocess
def test_every_rank_profiles_the_last_steps_and_only_those(profiled):
    run_dir, stdout, traces = profiled
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["rank0.json", "rank1.json"]
    for rank, trace in traces.items():
        assert _step_marks(trace) == ["fivefold step 4", "fivefold step 5"], rank
        marks = [e for e in trace["traceEvents"] if e.get("name", "").startswith("fivefold step")
                 and e.get("ph") == "X"]
        assert len(marks) == 2, rank  # one span per profiled step
        memory = [e for e in trace["traceEvents"] if e.get("name") == "[memory]"]
        assert memory and all("Bytes" in e["args"] for e in memory), rank
        shapes = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("args", {}).get("Input Dims")]
        assert shapes, rank  # record_shapes
        ops = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert "aten::mm" in ops or "aten::addmm" in ops, rank
    # said once, by rank 0
    assert stdout.count("fivefold: profile: steps 4-5 -> ") == 1, stdout
    # the flight recorder armed, nothing dumped (no stall)
    assert (run_dir / "flight_recorder").is_dir() and not list((run_dir / "flight_recorder").iterdir())


def test_the_profile_window_is_the_last_steps_of_this_invocation():
    from fivefold.observe.profile import profile_window
    assert profile_window(0, 10, 2) == range(8, 10)
    assert profile_window(0, 10, 2, exit_after=4) == range(2, 4)
    assert profile_window(6, 10, 3) == range(7, 10)  # a resumed run: its own last steps
    assert profile_window(8, 10, 3) == range(9, 10)  # ... never its first
    assert profile_window(9, 10, 1) == range(10, 10)
    assert profile_window(0, 10, 0) == range(0)


def test_the_profiler_marks_each_step_and_writes_at_the_windows_end(tmp_path):
    """In this process, no run: the profiler starts at the window, marks each step, stops and writes after its
    last; a step outside the window leaves no mark."""
    from fivefold.observe.profile import StepProfiler

    profiler = StepProfiler(range(1, 3), tmp_path / "p" / "rank0.json", torch.device("cpu"))
    assert profiler.activities() == [torch.profiler.ProfilerActivity.CPU]
    for step in range(4):
        profiler.begin_step(step)
        torch.ones(64, 64) @ torch.ones(64, 64)
        profiler.end_step(step)
        assert profiler.written == (step >= 2)
    profiler.close()  # the run's end: written already, nothing more
    assert _step_marks(json.loads((tmp_path / "p" / "rank0.json").read_text())) == [
        "fivefold step 2", "fivefold step 3"]
    cuda = StepProfiler(range(1, 2), tmp_path / "x.json", torch.device("cuda", 0))  # builds no CUDA state
    assert cuda.activities() == [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]


def test_a_run_that_stops_inside_the_window_writes_what_it_profiled(tmp_path):
    from fivefold.observe.profile import StepProfiler

    profiler = StepProfiler(range(0, 3), tmp_path / "rank1.json", torch.device("cpu"))
    profiler.begin_step(0)
    profiler.end_step(0)
    profiler.begin_step(1)  # stopped here (the run's end, an abort)
    profiler.close()
    assert _step_marks(json.loads((tmp_path / "rank1.json").read_text())) == ["fivefold step 1", "fivefold step 2"]


# ----------------------------------------------------------------------------------------------------------------
# refusals before spawning


def _refusal(tmp_path, *overrides: str) -> str:
    from fivefold.train.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(load_config(None, _args(tmp_path, *overrides)), 2)
    return str(e.value)


def test_profile_refusals(tmp_path):
    assert _refusal(tmp_path, "--steps", "5", "--run.profile", "-1") == "run.profile=-1 must not be negative"
    assert _refusal(tmp_path, "--steps", "3", "--run.profile", "3") == (
        "run.profile=3 would profile steps 1-3, this run's steps 1-3 (its first among them: it compiles and "
        "allocates, not the steady state); lower run.profile to 2 or raise train.steps to 4")
    assert _refusal(tmp_path, "--steps", "10", "--run.exit_after", "2", "--run.profile", "2") == (
        "run.profile=2 would profile steps 1-2, this run's steps 1-2 (its first among them: it compiles and "
        "allocates, not the steady state); lower run.profile to 1 or raise run.exit_after to 3")
    assert _refusal(tmp_path, "--steps", "1", "--run.profile", "1").endswith(
        "not the steady state); raise train.steps to 2")
    assert _refusal(tmp_path, "--steps", "5", "--run.flight_recorder", "-5") == (
        "run.flight_recorder=-5 must not be negative")
    from fivefold.train.validate import validate
    validate(load_config(None, _args(tmp_path, "--steps", "3", "--run.profile", "2")), 2)  # steps 2-3: fits


def test_a_resumed_invocation_profiles_what_it_has_left_and_says_so():
    from fivefold.train.validate import _check_profile

    cfg = load_config(None, ["--steps", "10", "--run.profile", "3"])
    assert _check_profile(cfg, 0) == [] and _check_profile(cfg, 6) == []  # steps 8-10 after step 7
    assert _check_profile(cfg, 8) == [
        "run.profile=3: this invocation resumes after step 8, so it profiles step 10 (its first step left out)"]
    assert _check_profile(cfg, 9) == [
        "run.profile=3: this invocation resumes after step 9, so it profiles no step (its first step left out)"]


def test_a_memory_snapshot_on_the_cpu_is_refused(tmp_path):
    assert _refusal(tmp_path, "--steps", "3", "--run.memory_snapshot", "true") == (
        "run.memory_snapshot records CUDA's caching allocator: this run is on cpu")


# ----------------------------------------------------------------------------------------------------------------
# run.memory_snapshot, torch.cuda.memory replaced (no CUDA call)


class _FakeCudaMemory:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def record(self, enabled="all", max_entries=None, **kw) -> None:
        self.calls.append(("record", enabled, max_entries))

    def dump(self, filename) -> None:
        # written to a temporary beside the snapshot's name, which replaces it whole (paths.atomic_path)
        tmp = Path(filename)
        assert tmp.name.startswith(".") and ".tmp-" in tmp.name, tmp
        self.calls.append(("dump", str(tmp.with_name(tmp.name[1:].split(".tmp-")[0]))))
        tmp.write_bytes(b"snapshot")


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    fake = _FakeCudaMemory()
    fake.observers = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", fake.record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", fake.dump)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", fake.observers.append, raising=False)
    return fake


class _Record:
    def __init__(self) -> None:
        self.said: list[str] = []

    def say(self, msg: str) -> None:
        self.said.append(msg)


class _Step:
    def __init__(self, step: int) -> None:
        self.step = step


def test_memory_snapshot_from_the_runs_start_to_its_end(tmp_path, fake_cuda_memory):
    from fivefold.observe.profile import MAX_ENTRIES
    from fivefold.train.profiling import MemorySnapshotLog

    record = _Record()
    log = MemorySnapshotLog(tmp_path, 3, record)
    log.on_run_start(None)
    path = str(tmp_path / "memory_snapshot" / "rank3.pickle")
    assert fake_cuda_memory.calls == [("record", "all", MAX_ENTRIES)]
    for step in range(3):
        log.on_step_start(step)
        log.on_step_end(_Step(step))
    assert len(fake_cuda_memory.calls) == 1  # recording through the steps
    log.on_run_end(None)
    assert fake_cuda_memory.calls[1:] == [("dump", path), ("record", None, None)]
    log.on_run_end(None)  # once
    assert len(fake_cuda_memory.calls) == 3 and Path(path).read_bytes() == b"snapshot"
    assert record.said == [f"fivefold: memory snapshot from the run's start to its end -> {tmp_path}/memory_snapshot"
                           "/rank<R>.pickle (one per rank; open it at pytorch.org/memory_viz)"]


def test_memory_snapshot_over_the_profiled_steps_and_on_abort(tmp_path, fake_cuda_memory):
    from fivefold.train.profiling import MemorySnapshotLog

    log = MemorySnapshotLog(tmp_path, 0, _Record(), window=range(2, 4))
    log.on_run_start(None)
    log.on_step_start(0)
    log.on_step_end(_Step(0))
    log.on_step_start(1)
    assert fake_cuda_memory.calls == []
    log.on_step_end(_Step(1))
    log.on_step_start(2)
    assert [c[0] for c in fake_cuda_memory.calls] == ["record"]
    log.on_step_end(_Step(2))
    log.on_step_start(3)
    log.on_step_end(_Step(3))  # the window's end: dumped, stopped
    assert [c[:2] for c in fake_cuda_memory.calls] == [
        ("record", "all"), ("dump", str(tmp_path / "memory_snapshot" / "rank0.pickle")), ("record", None)]
    assert len(fake_cuda_memory.observers) == 1  # attached once
    fake_cuda_memory.observers[0](0, 2**30, 0, 0)  # an out-of-memory error after the window: nothing
    assert len(fake_cuda_memory.calls) == 3
    aborted = MemorySnapshotLog(tmp_path / "b", 1, _Record())
    aborted.on_run_start(None)
    aborted.on_run_abort(1, RuntimeError("non-finite"))
    assert fake_cuda_memory.calls[-2][0] == "dump" and (tmp_path / "b" / "memory_snapshot" / "rank1.pickle").exists()


def test_an_out_of_memory_error_writes_the_snapshot_at_once(tmp_path, fake_cuda_memory):
    from fivefold.train.profiling import MemorySnapshotLog

    log = MemorySnapshotLog(tmp_path, 2, _Record())
    log.on_run_start(None)
    path = str(tmp_path / "memory_snapshot" / "rank2.pickle")
    (on_oom,) = fake_cuda_memory.observers
    on_oom(0, 2**40, 2**30, 2**20)  # torch's allocator: device, size asked, allocated, free
    assert fake_cuda_memory.calls[-1] == ("dump", path) and Path(path).exists()


def test_torch_cuda_only_in_the_memory_history():
    """The profiler and the observers touch no torch.cuda (a CPU run's path); MemoryHistory, which runs only on
    CUDA, does."""
    import ast

    root = Path(__file__).resolve().parent.parent / "fivefold"
    where = []
    for name in ("observe/profile.py", "train/profiling.py", "distributed/flight_recorder.py"):
        tree = ast.parse((root / name).read_text())
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child.parent = node
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "cuda" and isinstance(node.value, ast.Name) \
                    and node.value.id == "torch":
                up = node
                while not isinstance(up, (ast.ClassDef, ast.Module)):
                    up = up.parent
                where.append((name, getattr(up, "name", "module")))
    assert set(where) == {("observe/profile.py", "MemoryHistory")}, where


# ----------------------------------------------------------------------------------------------------------------
# run.flight_recorder


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
    status = {r: d["pg_status"]["0"] for r, d in dumps.items()}  # the world group's
    assert (status[0]["last_enqueued_collective"], status[0]["last_completed_collective"]) == (2, 1), status
    assert (status[1]["last_enqueued_collective"], status[1]["last_completed_collective"]) == (1, 1), status


def test_the_flight_recorder_sets_torchs_variables_and_dumps_on_sigusr1(tmp_path, monkeypatch):
    """The worker's side in this process: its variables, and SIGUSR1 -> the thread -> a dump, with torch's dump
    function replaced by a stub (the real one needs a process group: the stall test above)."""
    recorder = FlightRecorder(str(tmp_path / "fr"), entries=7)
    for key in recorder.env():
        monkeypatch.delenv(key, raising=False)
    recorder.arm()
    assert {k: os.environ[k] for k in recorder.env()} == {
        "TORCH_FR_BUFFER_SIZE": "7",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank"),
    }
    assert not (tmp_path / "fr").exists()  # arming makes nothing: the trainer does once validated
    recorder.make_directory()
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


def test_the_flight_recorder_refuses_a_run_name_outside_out_dir_before_anything_is_made(tmp_path):
    """Under torchrun the recorder is armed before `validate`: a run.name leaving run.out_dir is refused there
    too, and arming makes no directory."""
    from fivefold.config import load_config
    from fivefold.paths import PathOutside
    from fivefold.train.profiling import flight_recorder_for

    bad = load_config(None, ["--run.out_dir", str(tmp_path / "runs"), "--run.name", "../escaped",
                             "--run.flight_recorder", "5"])
    with pytest.raises(PathOutside, match="run.name='../escaped' must be one directory name"):
        flight_recorder_for(bad)
    good = load_config(None, ["--run.out_dir", str(tmp_path / "runs"), "--run.flight_recorder", "5"])
    flight_recorder_for(good).env()
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escaped").exists()
