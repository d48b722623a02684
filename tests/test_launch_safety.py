"""What a local launch exposes and leaves behind, and how a lost worker is reported.

Every listening socket of the launcher and its workers is on loopback; a launch removes the
temporary directories of dead launchers only; a worker lost to SIGKILL is reported with the
out-of-memory evidence there is (cgroup counters, the kernel log), faked in-process for each source.
The real launches are marked `multiprocess`; the readers of that evidence run in-process."""

from __future__ import annotations

import fcntl
import ipaddress
import os
import signal
import socket
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.distributed import launch
from fivefold.distributed.launch import launch_local, lost_worker_reason, oom_kills

TCP_LISTEN = "0A"


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A /proc/net/tcp{,6} address: 32-bit words in host (little-endian) byte order."""
    raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8))
    return ipaddress.ip_address(raw)


def _listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes `pids` hold."""
    owner = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:  # closed since listed
                continue
            if target.startswith("socket:["):
                owner[target[len("socket:["):-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == TCP_LISTEN and inode in owner:
                    address, port = local.split(":")
                    found.append((owner[inode], str(_address(address)), int(port, 16)))
    return found


def _listeners_after_init() -> dict[str, list[tuple[int, str, int]]]:
    """A worker, its process group up (gloo's pair connections made): the listening sockets it and the launcher
    hold."""
    dist.barrier()
    found = {"worker": _listening([os.getpid()]), "launcher": _listening([os.getppid()])}
    dist.barrier()  # the launcher's store stays up until every worker has looked
    return found


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip) in ("127.0.0.1", "::1")


def _other_interface() -> str | None:
    """A network interface with an IPv4 address off loopback, if this machine has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                ifreq = fcntl.ioctl(probe.fileno(), launch.SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if not socket.inet_ntoa(ifreq[20:24]).startswith("127."):
                return name
    return None


@pytest.mark.multiprocess
@pytest.mark.parametrize("inherited", ["none", "other-interface"])
def test_launcher_and_workers_listen_on_loopback_only(inherited, monkeypatch):
    """The launcher's store and every worker's gloo listen on loopback; also when the shell left GLOO_SOCKET_IFNAME
    naming a real interface (as for a multi-node run), which gloo would otherwise bind."""
    if inherited == "other-interface":
        other = _other_interface()
        if other is None:
            pytest.skip("no network interface off loopback here")
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", other)
    else:
        monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    results = launch_local(_listeners_after_init, 2, timeout_s=60.0)
    launcher = {s for r in results for s in r["launcher"]}
    workers = [s for r in results for s in r["worker"]]
    assert launcher, "the launcher's rendezvous store should be listening while the workers run"
    assert workers, "gloo should be listening in the workers for its pair connections"
    exposed = [s for s in sorted(launcher) + workers if not _loopback(s[1])]
    assert not exposed, f"listening beyond loopback (pid, address, port): {exposed}"


def test_loopback_interface_holds_127_0_0_1():
    name = launch.loopback_interface()
    assert name in [n for _, n in socket.if_nameindex()]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        ifreq = fcntl.ioctl(probe.fileno(), launch.SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
    assert socket.inet_ntoa(ifreq[20:24]) == "127.0.0.1"


def _entries(root: str) -> list[str]:
    return sorted(os.listdir(root))


def _dead_pid() -> int:
    child = subprocess.Popen(["sleep", "0"])
    child.wait()
    return child.pid


@pytest.mark.multiprocess
def test_a_launch_removes_the_directories_of_dead_launchers_only(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = _dead_pid()
    gone = tmp_path / f"fivefold-{dead}-k1ll3d"
    (gone / "heartbeats").mkdir(parents=True)
    (gone / "rank0.pt").write_bytes(b"left over")
    live = tmp_path / f"fivefold-{os.getpid()}-running"
    live.mkdir()
    # a dead pid whose lock is held: a launcher in another pid namespace sharing the directory
    locked = tmp_path / f"fivefold-{dead}-elsewhere"
    locked.mkdir()
    held = os.open(locked / ".launcher.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    target = tmp_path / "not-ours"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / f"fivefold-{dead}-link"
    link.symlink_to(target, target_is_directory=True)
    unrelated = tmp_path / "fivefold-notapid"
    unrelated.mkdir()
    try:
        during = launch_local(_entries, 1, str(tmp_path), timeout_s=60.0)[0]
    finally:
        os.close(held)
    assert not gone.exists()
    assert live.is_dir() and locked.is_dir() and link.is_symlink() and (target / "keep").exists()
    assert unrelated.is_dir()
    # while it ran, the launch's own directory carried its pid; it is gone after
    own = [n for n in during if n.startswith(f"fivefold-{os.getpid()}-") and n != live.name]
    assert len(own) == 1 and not (tmp_path / own[0]).exists()


EXITED = mp.ProcessExitedException


def _sigkill(index: int = 1, pid: int = 1234) -> mp.ProcessExitedException:
    return EXITED(f"process {index} terminated with signal SIGKILL", error_index=index, error_pid=pid,
                  exit_code=-9, signal_name="SIGKILL")


def _fake_cgroup(tmp_path: Path, monkeypatch, version: int, count: int = 0) -> Path:
    """This process's cgroup, faked: /proc/self/cgroup naming /job, and its OOM-kill counter file."""
    proc = tmp_path / "proc-self-cgroup"
    root = tmp_path / "sys-fs-cgroup"
    if version == 2:
        proc.write_text("0::/job\n")
        counter = root / "job" / "memory.events"
    else:
        proc.write_text("5:cpu,cpuacct:/job\n4:memory:/job\n0::/\n")
        counter = root / "memory" / "job" / "memory.oom_control"
    counter.parent.mkdir(parents=True)
    monkeypatch.setattr(launch, "PROC_CGROUP", str(proc))
    monkeypatch.setattr(launch, "CGROUP_ROOT", str(root))
    monkeypatch.setattr(launch, "KMSG", str(tmp_path / "no-kmsg"))
    _set_count(counter, count)
    return counter


def _set_count(counter: Path, count: int) -> None:
    if counter.name == "memory.events":
        counter.write_text(f"low 0\nhigh 0\nmax 3\noom {count}\noom_kill {count}\noom_group_kill 0\n")
    else:
        counter.write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {count}\n")


@pytest.mark.parametrize("version", [2, 1])
def test_a_sigkill_with_the_cgroup_oom_count_risen_reads_as_out_of_memory(tmp_path, monkeypatch, version):
    counter = _fake_cgroup(tmp_path, monkeypatch, version)
    assert oom_kills() == 0
    launch._record_launch_start()
    assert lost_worker_reason(_sigkill()) == ("worker 1 (pid 1234) was killed by SIGKILL (by another process, or "
                                             "out of memory: no OOM record readable here)")
    _set_count(counter, 1)
    reason = lost_worker_reason(_sigkill())
    assert reason == ("worker 1 (pid 1234) was killed by the kernel's out-of-memory killer (SIGKILL; cgroup "
                      f"{counter.name} oom_kill 0 -> 1): {launch.OOM_HINT}")
    assert "\n" not in reason and "--train.micro_batch" in reason and "--zero 3" in reason


def test_the_cgroup_mount_root_when_the_cgroup_path_is_not_there(tmp_path, monkeypatch):
    counter = _fake_cgroup(tmp_path, monkeypatch, 2, count=4)
    counter.rename(counter.parent.parent / "memory.events")  # a container's own cgroup at the mount's root
    assert oom_kills() == 4


def test_no_readable_counter_no_oom_claim(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "PROC_CGROUP", str(tmp_path / "absent"))
    monkeypatch.setattr(launch, "KMSG", str(tmp_path / "no-kmsg"))
    launch._record_launch_start()
    assert oom_kills() is None
    assert "no OOM record readable here" in lost_worker_reason(_sigkill())


def _kmsg(*records: tuple[int, str]) -> bytes:
    return b"".join(f"3,{seq},{seq * 1000},-;{text}\n SUBSYSTEM=memory\n".encode() for seq, text in records)


def test_the_kernel_log_record_of_the_kill_since_the_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "PROC_CGROUP", str(tmp_path / "absent"))
    kmsg = tmp_path / "kmsg"
    monkeypatch.setattr(launch, "KMSG", str(kmsg))
    # before the launch: pid 1234 was another process, killed then
    kmsg.write_bytes(_kmsg((7, "Out of memory: Killed process 1234 (old) total-vm:10kB, anon-rss:5kB"),
                           (8, "eth0: link up")))
    launch._record_launch_start()
    assert "no OOM record readable here" in lost_worker_reason(_sigkill())
    with open(kmsg, "ab") as f:
        f.write(_kmsg((9, "python invoked oom-killer: gfp_mask=0x140cca, order=0"),
                      (10, "Memory cgroup out of memory: Killed process 999 (python) total-vm:10kB"),
                      (11, "Memory cgroup out of memory: Killed process 1234 (python) total-vm:99kB, anon-rss:90kB")))
    assert lost_worker_reason(_sigkill()) == (
        "worker 1 (pid 1234) was killed by the kernel's out-of-memory killer (SIGKILL; kernel log: Memory cgroup out "
        f"of memory: Killed process 1234 (python) total-vm:99kB): {launch.OOM_HINT}")


def test_other_ends_said_plainly():
    segv = EXITED("process 0 terminated with signal SIGSEGV", error_index=0, error_pid=77, exit_code=-11,
                  signal_name="SIGSEGV")
    assert lost_worker_reason(segv) == "worker 0 (pid 77) was killed by SIGSEGV"
    code = EXITED("process 2 terminated with exit code 3", error_index=2, error_pid=78, exit_code=3)
    assert lost_worker_reason(code) == "worker 2 (pid 78) exited with code 3 before finishing"
    raised = mp.ProcessRaisedException("\n\n-- Process 1 terminated with the following error:\nTraceback ...\n"
                                       "ValueError: bad shape\n", error_index=1, error_pid=79)
    assert lost_worker_reason(raised) == "worker 1 (pid 79) raised ValueError: bad shape"
    assert lost_worker_reason(RuntimeError("first\nsecond")) == "first"


def test_oom_kills_reads_this_machine_or_says_none():
    count = oom_kills()
    assert count is None or (isinstance(count, int) and count >= 0)


def _die_counted_as_oom(counter: str, pid_file: str) -> None:
    """A worker that ends as an OOM kill looks from the launcher: the cgroup's count up by one, then SIGKILL."""
    Path(pid_file).write_text(str(os.getpid()))
    if counter:
        _set_count(Path(counter), 1)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.multiprocess
@pytest.mark.parametrize("counted", [True, False])
def test_a_worker_killed_in_a_real_launch(tmp_path, monkeypatch, counted):
    counter = _fake_cgroup(tmp_path, monkeypatch, 2)
    pid_file = tmp_path / "pid"
    with pytest.raises(mp.ProcessExitedException) as caught:
        launch_local(_die_counted_as_oom, 1, str(counter) if counted else "", str(pid_file), timeout_s=60.0)
    reason = lost_worker_reason(caught.value)
    who = f"worker 0 (pid {int(pid_file.read_text())})"
    if counted:
        assert reason == (f"{who} was killed by the kernel's out-of-memory killer (SIGKILL; cgroup memory.events "
                          f"oom_kill 0 -> 1): {launch.OOM_HINT}")
    else:
        assert reason == (f"{who} was killed by SIGKILL (by another process, or out of memory: no OOM record readable "
                          "here)")
