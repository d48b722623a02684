"""Replica fault tolerance with torchft (`fivefold.fault_tolerance`): the refusals before anything
starts, the replica all-reduce's rescaling over the live groups, the weights-only checkpoint
transport; then whole jobs — two groups equal plain HSDP when nothing fails; a group SIGKILLed or
SIGSTOPped mid-run is dropped from the quorum while the other trains on, and restarted by its own
launcher (the stall named by its watchdog) heals from the live group and ends bitwise equal to it;
a stalled lighthouse stops every group with one line and a checkpoint of each committed step,
from which the groups resume to the uninterrupted job's parameters."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_launch_safety import _listening, _loopback

from fivefold.config import Config, ConfigError, apply_overrides
from fivefold.distributed.comm import CommLog
from fivefold.fault_tolerance.launch import check_ft, group_config, lighthouse_reachable
from fivefold.fault_tolerance.replicas import ReplicaAllReduceComm, _weights_only_transport

pytest.importorskip("torchft")

CLI = [sys.executable, "-c", "from fivefold.cli import main; raise SystemExit(main())", "train"]
BASE = ["--model.preset", "tiny", "--run.log_every", "1", "--checkpoint.every_minutes", "0",
        "--train.eval_every", "0", "--run.plot", "false", "--run.progress", "false"]


def _cfg(*args: str) -> Config:
    return apply_overrides(Config(), list(args))


@pytest.mark.parametrize("args, says", [
    (["--ft.replica_groups", "3"], "does not divide the world of 4"),
    (["--ft.replica_groups", "2", "--zero.stage", "0"], "use zero.stage 1"),
    (["--ft.replica_groups", "2", "--parallel.dp_replicate", "2"], "give parallel.dp_replicate 1"),
    (["--ft.replica_groups", "2", "--zero.qgz", "true"], "drop zero.qgz"),
    (["--ft.replica_groups", "2", "--ft.min_replicas", "3"], "give 1 to 2"),
    (["--ft.replica_groups", "2", "--train.global_batch", "9"], "a multiple of the groups"),
    (["--ft.replica_groups", "2", "--precision.param", "fp16"], "use bf16 or fp32"),
    (["--ft.replica_groups", "2", "--ft.timeout_s", "5", "--run.stall_timeout_s", "10"],
     "give run.stall_timeout_s above 10"),
    (["--ft.replica_groups", "2", "--ft.timeout_s", "90"], "run.stall_timeout_s=180 with"),
    (["--ft.replica_groups", "2", "--ft.join_timeout_s", "0"], "give a positive number"),
    (["--ft.replica_groups", "2", "--ft.lighthouse", "http://127.0.0.1:9"], "is not reachable"),
])
def test_what_ft_cannot_serve_is_one_line_before_anything_starts(args, says):
    with pytest.raises(ConfigError, match=says):
        check_ft(_cfg("--zero.stage", "1", *args), 4)


@pytest.mark.parametrize("args, says", [
    (["--ft.group", "0"], "give each --ft.group 0..1 and --ft.lighthouse"),
    (["--ft.group", "2", "--ft.lighthouse", "http://127.0.0.1:9"], "give each --ft.group 0..1"),
    (["--ft.group", "1", "--ft.lighthouse", "http://127.0.0.1:9"], "is not reachable"),
])
def test_one_group_s_own_job_is_checked_before_anything_starts(tmp_path, args, says):
    """One group per job (the local launcher on one of several machines; torchrun alike): its
    world and batch are the group's own (3 rows need not divide by 2 groups), the rest is ft's."""
    from fivefold.train.trainer import run

    cfg = _cfg("--model.preset", "tiny", "--zero.stage", "1", "--ft.replica_groups", "2",
               "--run.nproc", "1", "--train.global_batch", "3", "--run.out_dir", str(tmp_path),
               *args)
    with pytest.raises(ConfigError, match=says):
        run(cfg)
    assert not list(tmp_path.iterdir())  # nothing made


def test_an_moe_model_is_refused_before_spawning(tmp_path):
    from fivefold.fault_tolerance.launch import run_groups

    cfg = _cfg("--model.preset", "tiny-moe", "--zero.stage", "1", "--ft.replica_groups", "2",
               "--run.nproc", "2", "--run.out_dir", str(tmp_path))
    with pytest.raises(ConfigError, match="MoE model"):
        run_groups(cfg)
    assert not list(tmp_path.iterdir())  # nothing made


def test_a_group_is_its_own_job_with_its_part_of_the_world_and_batch(tmp_path):
    cfg = _cfg("--run.nproc", "4", "--parallel.dp", "4", "--train.global_batch", "16",
               "--ft.replica_groups", "2", "--run.out_dir", str(tmp_path), "--run.name", "job")
    g = group_config(cfg, 1, "http://127.0.0.1:1")
    assert (g.run.nproc, g.parallel.dp, g.train.global_batch) == (2, 2, 8)
    assert Path(g.run.out_dir) / g.run.name == tmp_path / "job" / "replica1"
    assert (g.ft.group, g.ft.lighthouse) == (1, "http://127.0.0.1:1")


class _Manager:
    """A torchft Manager's allreduce as seen by one group: the live groups' sum is given."""

    def __init__(self, live: int, others: torch.Tensor) -> None:
        self.live, self.others = live, others

    def num_participants(self) -> int:
        return self.live

    def allreduce(self, tensor, reduce_op=None):
        tensor.add_(self.others)
        return self

    def wait(self):
        return True


@pytest.mark.parametrize("live", [1, 2, 4])
def test_the_replica_sum_is_the_mean_over_the_live_groups(live):
    """Gradients arrive pre-divided by N_s·R; the sum over P live groups is scaled by R/P (exactly
    nothing when all R are live, so a job without failures is plain HSDP's arithmetic)."""
    groups = 4
    mine, others = torch.full((3,), 1.0 / groups), torch.full((3,), (live - 1) / groups)
    comm = ReplicaAllReduceComm(_Manager(live, others), groups, 0, torch.device("cpu"),
                                CommLog(enabled=True))
    work = comm.all_reduce(mine, async_op=True, tag="t")
    work.wait()
    assert torch.equal(mine, torch.ones(3)) if live < groups else torch.equal(
        mine, torch.full((3,), 1.0))
    record = comm.log.by_dim()["dp_replicate"]
    assert record.calls == 1 and record.payload_bytes == 12


class _Runs:
    def __reduce__(self):
        return (print, ("a peer ran code",))


def test_a_healing_peer_s_state_is_loaded_weights_only(tmp_path):
    """What a peer sends is loaded with weights_only: tensors pass, a pickle that would run code is
    refused."""
    import datetime

    transport = _weights_only_transport(datetime.timedelta(seconds=5))
    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    from torchft.checkpointing._serialization import _streaming_save  # what a peer sends

    with good.open("wb") as f:
        _streaming_save({"0.0.0": {"master": torch.arange(3.0), "step": torch.tensor(2.0)}}, f)
    with bad.open("wb") as f:
        _streaming_save({"x": _Runs()}, f)
    loaded = transport._load_from_address(good.as_uri(), datetime.timedelta(seconds=5))
    assert torch.equal(loaded["0.0.0"]["master"], torch.arange(3.0))
    with pytest.raises(Exception, match="[Ww]eights only|weights_only|Unsupported"):
        transport._load_from_address(bad.as_uri(), datetime.timedelta(seconds=5))
    transport.shutdown()


def test_lighthouse_reachable_says_no_for_a_closed_port():
    assert not lighthouse_reachable("http://127.0.0.1:9", timeout_s=0.5)
    assert not lighthouse_reachable("nonsense")


def _train_rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("kind") == "train"]


def _final_params(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt, out)
    return {k: v for k, v in torch.load(out).items() if k.startswith(("model.", "optim."))}


@pytest.mark.multiprocess
def test_two_replica_groups_train_equal_to_plain_hsdp(tmp_path):
    """2 groups × 2 ranks (ZeRO-2 inside, the replica reduce through torchft) against HSDP with
    dp_replicate 2 over the same 4 ranks: the gradients take the same reduction order (a 2-way
    sum of the same shards), so the final parameters and optimizer state are bitwise equal; the
    logged loss is a mean of means here (over the group, then over the live groups) against one
    4-way mean, so it agrees to fp32 rounding (1e-6 relative)."""
    common = [*BASE, "--train.steps", "4", "--zero.stage", "2", "--nproc", "4",
              "--run.out_dir", str(tmp_path)]
    subprocess.run([*CLI, *common, "--run.name", "hsdp", "--parallel.dp_replicate", "2"],
                   check=True, capture_output=True, timeout=300)
    ft = subprocess.run([*CLI, *common, "--run.name", "ft", "--ft.replica_groups", "2"],
                        capture_output=True, text=True, timeout=300)
    assert ft.returncode == 0, ft.stdout + ft.stderr
    hsdp = [(r["step"], r["loss"]) for r in _train_rows(tmp_path / "hsdp" / "metrics.jsonl")]
    for g in (0, 1):
        rows = _train_rows(tmp_path / "ft" / f"replica{g}" / "metrics.jsonl")
        assert [r["step"] for r in rows] == [s for s, _ in hsdp]
        assert [r["loss"] for r in rows] == pytest.approx([v for _, v in hsdp], rel=1e-6)
        assert all(r["replicas"] == 2 for r in rows)
    a = _final_params(tmp_path / "hsdp" / "checkpoints" / "step-00000004")
    for g in (0, 1):
        b = _final_params(tmp_path / "ft" / f"replica{g}" / "checkpoints" / "step-00000004")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(_children(p))
    return found


def _group_workers(run_dir: Path) -> list[int]:
    """A group launcher's training workers: the children of the pid its run lock names."""
    try:
        pid = json.loads((run_dir / ".lock").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return []
    return [k for k in _children(pid)
            if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_group_is_dropped_then_heals_and_ends_equal_to_the_live_one(tmp_path, how):
    """Every worker of group 1 SIGKILLed (lost) or SIGSTOPped (stalled: its launcher's watchdog
    names it and stops it) mid-run: group 0 trains on (every step once, the quorum 2 then 1 then
    2 again), group 1's launcher restarts it, it receives group 0's live state and both end with
    bitwise the same parameters and optimizer state."""
    steps = 160
    cmd = [*CLI, *BASE, "--train.steps", str(steps), "--zero.stage", "1", "--nproc", "2",
           "--ft.replica_groups", "2", "--run.max_restarts", "1", "--run.out_dir", str(tmp_path),
           "--run.name", "job", "--ft.heartbeat_timeout_s", "1", "--ft.timeout_s", "2",
           "--run.stall_timeout_s", "6"]
    proc = subprocess.Popen(cmd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    live, dead = tmp_path / "job" / "replica0", tmp_path / "job" / "replica1"
    killed, deadline, listening = None, time.time() + 240, []
    while proc.poll() is None and time.time() < deadline and killed is None:
        time.sleep(0.05)
        metrics = dead / "metrics.jsonl"
        rows = _train_rows(metrics) if metrics.exists() else []
        workers = _group_workers(dead)
        if rows and not listening:  # training: the lighthouse, managers, stores, gloo all up
            listening = _listening(_descendants(proc.pid))
        if rows and rows[-1]["step"] >= 10 and workers:
            killed_at = rows[-1]["step"]
            killed = workers
            for pid in workers:
                os.kill(pid, getattr(signal, how))
    out, _ = proc.communicate(timeout=300)
    assert killed is not None, "the run ended before a group could be killed:\n" + out
    # a local job listens on loopback only: torchft's own servers would bind every interface
    assert len({pid for pid, _, _ in listening}) >= 3, listening  # launcher and both workers
    assert all(_loopback(address) for _, address, _ in listening), [
        s for s in listening if not _loopback(s[1])]
    assert proc.returncode == 0, out
    rows = _train_rows(live / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # no step repeated or lost
    quorum = [r["replicas"] for r in rows]
    alone = [i for i, q in enumerate(quorum) if q == 1]
    assert alone, quorum
    assert all(q == 2 for q in quorum[: killed_at]), quorum  # the kill came after step killed_at
    assert quorum[alone[0]:alone[-1] + 1] == [1] * len(alone) and quorum[-1] == 2, quorum
    a = _final_params(live / "checkpoints" / f"step-{steps:08d}")
    b = _final_params(dead / "checkpoints" / f"step-{steps:08d}")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    named = "replica group 1: the job stalled" if how == "SIGSTOP" else "replica group 1: "
    assert named in out and "restart 1 of 1" in out, out
    assert "replica group 0: " not in out, out  # the live group never restarted


@pytest.mark.multiprocess
def test_a_stalled_lighthouse_stops_each_group_with_its_state_saved_and_resume_ends_equal(tmp_path):
    """One job per group (each its own launcher, as under torchrun) on a lighthouse that then
    stalls (SIGSTOP): each group ends within ft.timeout_s with one line naming the lighthouse and a
    checkpoint of every step it committed; resumed on a new lighthouse, both end bitwise equal to
    an uninterrupted job."""
    def lighthouse() -> tuple[subprocess.Popen, str]:
        """A lighthouse in its own process (its host can be lost): the process and its address."""
        code = ("from torchft._torchft import LighthouseServer as L; import time; l = L("
                "bind='127.0.0.1:0', min_replicas=1, join_timeout_ms=20000, "
                "heartbeat_timeout_ms=2000, quorum_tick_ms=10); print(l.address(), flush=True); "
                "time.sleep(600)")
        proc = subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE,
                                env=dict(os.environ, RUST_LOG="warn"))
        return proc, proc.stdout.readline().strip()

    steps = 12
    common = [*BASE, "--train.steps", str(steps), "--zero.stage", "1", "--run.out_dir",
              str(tmp_path), "--ft.replica_groups", "2", "--ft.timeout_s", "4"]
    reference = subprocess.run([*CLI, *common, "--nproc", "2", "--train.global_batch", "8",
                                "--run.name", "reference"], capture_output=True, text=True,
                               timeout=300)
    assert reference.returncode == 0, reference.stdout + reference.stderr

    def groups(address: str, *more: str) -> list[subprocess.Popen]:
        return [subprocess.Popen([*CLI, *common, "--nproc", "1", "--train.global_batch", "4",
                                  "--ft.group", str(g), "--ft.lighthouse", address,
                                  "--run.name", f"g{g}", *more],
                                 text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                for g in (0, 1)]

    first, address = lighthouse()
    procs, deadline = groups(address), time.time() + 240
    metrics = tmp_path / "g0" / "metrics.jsonl"
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if metrics.exists() and len(_train_rows(metrics)) >= 4:
            break
        time.sleep(0.05)
    first.send_signal(signal.SIGSTOP)  # stalled: connections open, nothing answers
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        first.kill()
    done = []
    for g, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode != 0, out
        lines = [ln for ln in out.splitlines() if "no quorum for step" in ln]
        assert len(lines) == 1 and f"replica group {g}" in lines[0], out
        assert "within 4 s" in lines[0] and address in lines[0], out
        saved = sorted((tmp_path / f"g{g}" / "checkpoints").glob("step-*"))
        assert saved, out
        done.append(int(saved[-1].name.split("-")[1]))
        assert done[-1] == _train_rows(tmp_path / f"g{g}" / "metrics.jsonl")[-1]["step"], out
    assert done[0] == done[1] and 4 <= done[0] < steps, done  # no committed step lost

    second, address = lighthouse()
    try:
        procs = groups(address, "--resume")
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        second.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(outs)
    a = _final_params(tmp_path / "reference" / "replica0" / "checkpoints" / f"step-{steps:08d}")
    for g in (0, 1):
        b = _final_params(tmp_path / f"g{g}" / "checkpoints" / f"step-{steps:08d}")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), g


@pytest.mark.parametrize("lighthouse, host", [
    ("http://127.0.0.1:29510", "127.0.0.1"), ("http://localhost:1", "127.0.0.1"),
    ("127.0.0.1:29510", "127.0.0.1"), ("http://[::1]:29510", "127.0.0.1"),
    ("http://10.0.0.5:29510", None), ("http://head-node:29510", None),
])
def test_a_group_binds_its_servers_to_loopback_only_when_the_lighthouse_is_there(lighthouse, host):
    from fivefold.fault_tolerance.replicas import loopback_host

    assert loopback_host(lighthouse) == host


def test_torchft_missing_is_one_line_naming_the_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'fivefold\[ft\]'"):
        check_ft(_cfg("--zero.stage", "1", "--ft.replica_groups", "2"), 4)


class _QuorumManager:
    """A torchft Manager's quorum as one group sees it: the participants of each quorum in turn
    and the step the quorum heals this group to."""

    def __init__(self, participants: list[int], step: int = 0, error: Exception | None = None):
        self.participants, self.step, self.error, self.calls = participants, step, error, []

    def start_quorum(self, timeout=None):
        self.calls.append(timeout)
        if self.error is not None:
            raise self.error
        self.now = self.participants[min(len(self.calls), len(self.participants)) - 1]

    def num_participants(self):
        return self.now

    def current_step(self):
        return self.step


def _replicas(manager: _QuorumManager, groups: int = 2):
    from fivefold.fault_tolerance.replicas import TorchftReplicas

    r = object.__new__(TorchftReplicas)
    r.manager, r.groups, r.group, r.live = manager, groups, 1, None
    r.ft = _cfg("--ft.replica_groups", str(groups), "--ft.join_timeout_s", "1").ft
    r._join_attempts = int(r.ft.join_timeout_s / r.JOIN_POLL_S)
    return r


def test_a_cold_start_waits_for_every_group_a_rejoining_group_does_not():
    import datetime

    cold = _replicas(_QuorumManager([1, 1, 2]))
    assert cold.start_step(0) == 0 and cold.live == 2 and len(cold.manager.calls) == 3
    assert cold.manager.calls == [datetime.timedelta(seconds=1)] * 3  # the join timeout
    assert cold.start_step(1) == 0 and cold.manager.calls[-1] is None  # then ft.timeout_s
    healed = _replicas(_QuorumManager([1], step=40), groups=3)  # one of 3 groups lost for good
    assert healed.start_step(0) == 40 and healed.live == 1 and len(healed.manager.calls) == 1


def test_more_groups_in_the_quorum_than_the_job_has_is_refused():
    with pytest.raises(RuntimeError, match="two jobs were given the same --ft.group"):
        _replicas(_QuorumManager([3])).start_step(0)


def test_a_lost_quorum_is_one_line_a_heal_that_does_not_fit_is_not_a_lost_quorum():
    from fivefold.fault_tolerance.replicas import HealFailed, QuorumLost

    with pytest.raises(QuorumLost, match="no quorum for step 5 within 1 s") as lost:
        _replicas(_QuorumManager([1], error=TimeoutError("deadline"))).start_step(4)
    assert lost.value.state_intact
    with pytest.raises(HealFailed) as failed:
        _replicas(_QuorumManager([1], error=HealFailed("another layout"))).start_step(4)
    assert not getattr(failed.value, "state_intact", False)  # nothing saved of half-loaded weights


@pytest.mark.parametrize("lighthouse, torchrun, master, says", [
    ("http://10.0.0.5:29510", False, None, "run each group under torchrun with --master-addr"),
    ("http://10.0.0.5:29510", True, "127.0.0.1", "give torchrun --master-addr"),
    ("http://10.0.0.5:29510", True, None, "MASTER_ADDR=(unset)"),
    ("http://10.0.0.5:29510", True, "10.0.0.7", None),
    ("http://127.0.0.1:29510", False, None, None),
    (f"http://{socket.gethostname()}:29510", False, None, None),  # this machine by its name
])
def test_a_group_on_another_machine_than_the_lighthouse_needs_a_reachable_store(
        monkeypatch, lighthouse, torchrun, master, says):
    from fivefold.fault_tolerance.launch import check_group_reachable

    if master is None:
        monkeypatch.delenv("MASTER_ADDR", raising=False)
    else:
        monkeypatch.setenv("MASTER_ADDR", master)
    cfg = _cfg("--ft.replica_groups", "2", "--ft.group", "0", "--ft.lighthouse", lighthouse)
    if says is None:
        check_group_reachable(cfg, torchrun)
    else:
        with pytest.raises(ConfigError, match=re.escape(says)):
            check_group_reachable(cfg, torchrun)
