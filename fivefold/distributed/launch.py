"""Starting processes: from a torchrun environment (`init_distributed`) or as N local CPU workers
joined by gloo (`launch_local`), and the device each computes on."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import shutil
import signal
import socket
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from fivefold.distributed.flight_recorder import FlightRecorder

__all__ = [
    "backend_for",
    "distributed",
    "init_distributed",
    "is_torchrun_env",
    "launch_local",
    "loopback_interface",
    "lost_worker_reason",
    "oom_kills",
    "resolve_device",
    "teardown",
    "to_device",
]


def resolve_device(requested: str = "auto") -> torch.device:
    """The one rule for where this process computes. ``cpu``: the CPU. ``auto``: the local
    accelerator if torch sees one, else the CPU. ``cuda`` (any accelerator type): that accelerator,
    which must exist. The device index is ``LOCAL_RANK`` (one process per device) unless given
    (``cuda:1``); a local rank without its own device is an error, never a silently shared one. Sets
    the current device."""
    requested = (requested or "auto").strip().lower()
    if requested == "cpu":
        return torch.device("cpu")
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if requested == "auto":
        if accelerator is None:
            return torch.device("cpu")
        wanted = torch.device(accelerator.type)
    else:
        try:
            wanted = torch.device(requested)
        except RuntimeError:
            raise ValueError(
                f"run.device={requested!r} is not a device; use auto, cpu or an accelerator such "
                "as cuda"
            ) from None
        if accelerator is None or accelerator.type != wanted.type:
            have = accelerator.type if accelerator is not None else "no accelerator"
            raise ValueError(
                f"run.device={requested!r} but torch sees {have} here; use run.device=auto or cpu"
            )
    count = torch.accelerator.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = wanted.index if wanted.index is not None else local_rank
    if index >= count:
        raise ValueError(
            f"local rank {local_rank} needs {wanted.type} device {index}, but this node has "
            f"{count}: start at most {count} processes per node (torchrun --nproc-per-node "
            f"{count}), one per device, or set run.device=cpu"
        )
    torch.accelerator.set_device_index(index)
    return torch.device(wanted.type, index)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch onto `device` without making the host wait: pinned, then copied asynchronously
    (an accelerator runs the copy in order before the kernels that read it). On the CPU it is
    returned as is."""
    if t.device == device:
        return t
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if t.device.type == "cpu" and accelerator is not None and device.type == accelerator.type:
        t = t.pin_memory()
    return t.to(device, non_blocking=t.device.type == "cpu" and device.type != "cpu")


def backend_for(device: torch.device) -> str:
    return (
        "gloo"
        if device.type == "cpu"
        else dist.Backend.default_device_backend_map.get(device.type, "gloo")
    )


def init_distributed(
    device: torch.device | str | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
    flight_recorder: FlightRecorder | None = None,
) -> torch.device:
    """Initialise the default process group from a torchrun-style environment for `device` (default:
    `resolve_device`) with its backend (gloo for the CPU, NCCL for CUDA). An accelerator is bound as
    ``device_id``: communicators are created at once (errors surface here, not at the first
    collective) and sub-groups split from them. ``flight_recorder``: armed first (torch reads its
    variables when the group is made), its SIGUSR1 dump installed."""
    device = resolve_device() if device is None else torch.device(device)
    if flight_recorder is not None and not dist.is_initialized():
        flight_recorder.arm()
        flight_recorder.install(int(os.environ.get("RANK", "0")), device.type)
    if not dist.is_initialized():
        dist.init_process_group(
            backend or backend_for(device),
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type != "cpu" else None,
        )
    return device


@contextlib.contextmanager
def distributed(
    device: torch.device | str | None = None,
    timeout_s: float = 600.0,
    flight_recorder: FlightRecorder | None = None,
) -> Iterator[torch.device]:
    """`init_distributed` for the body, then the group torn down (the engines' reference cycles
    collected first)."""
    device = init_distributed(device, timeout_s=timeout_s, flight_recorder=flight_recorder)
    try:
        yield device
    finally:
        teardown()


def teardown() -> None:
    """Destroy the default process group. Engines sit in reference cycles (parameter -> gradient
    hook -> reducer -> parameter) that hold process groups and work handles; collected after the
    group is gone, their teardown can abort the process (seen: an intermittent SIGABRT in the test
    suite). Collect them while the group exists."""
    gc.collect()
    dist.destroy_process_group()


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def is_torchrun_env() -> bool:
    """True under torchrun (or any launcher that sets what it sets); raises if only some of its
    variables are set, e.g. left over in the shell, which would otherwise make a local run wait for
    ranks that never come."""
    present = [k for k in TORCHRUN_VARS if k in os.environ]
    if present and len(present) < len(TORCHRUN_VARS):
        missing = [k for k in TORCHRUN_VARS if k not in os.environ]
        raise ValueError(
            f"{', '.join(f'{k}={os.environ[k]}' for k in present)} set but not "
            f"{', '.join(missing)}: these look left over from another launch. To run locally, "
            f"unset them (env -u {' -u '.join(present)} fivefold train ...); under torchrun all of "
            "them are set"
        )
    return bool(present)


SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS): what
    a local run's gloo binds to (``GLOO_SOCKET_IFNAME``)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return "lo"
    if sys.platform.startswith("linux"):
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for name in names:
                try:
                    # struct ifreq: the name (16 bytes), then a sockaddr_in whose address is at
                    # bytes 20-24
                    ifreq = fcntl.ioctl(
                        probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                    )
                except OSError:  # no IPv4 address
                    continue
                if socket.inet_ntoa(ifreq[20:24]) == "127.0.0.1":
                    return name
    return next((name for name in names if name in ("lo", "lo0")), "lo")


def _loopback_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The launcher's rendezvous store, listening on 127.0.0.1 only at a port the OS chose. Given a
    host and port alone, TCPStore's master listens on every interface (IPv4 and IPv6) and its keys
    are readable by anyone who connects; handed a socket already bound to loopback
    (``master_listen_fd``, either backend), it listens there and owns the socket (closes it with the
    store)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(max(128, world_size))
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    # the store closes the descriptor: the Python socket must not close it again (by then maybe
    # another file's)
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
    )


def _local_worker(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    threads: int,
    timeout_s: float,
    out_dir: str,
    args: tuple,
    device: str = "cpu",
    heartbeat_dir: str = "",
    flight_recorder: FlightRecorder | None = None,
) -> None:
    torch.set_num_threads(threads)
    if heartbeat_dir:  # the launcher watches for stalls
        from fivefold.distributed.watchdog import Heartbeat

        Heartbeat(heartbeat_dir, rank)
    # gloo's listening sockets (one per worker, for its pair connections) otherwise bind the address
    # the hostname resolves to, or an interface left set for a multi-node run: every peer is on this
    # host, so loopback
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=loopback_interface(),
    )
    timeout = datetime.timedelta(seconds=timeout_s)
    where = resolve_device(device)
    if flight_recorder is not None:  # before the process group: torch reads its variables then
        flight_recorder.arm()
        flight_recorder.install(rank, where.type)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(
        backend_for(where),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=where if where.type != "cpu" else None,
    )
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        del result
    finally:
        teardown()


class Terminated(RuntimeError):
    """The launcher was sent SIGTERM or SIGINT and its workers did not all finish cleanly (e.g.
    stopped during start-up)."""


@contextlib.contextmanager
def _forwarding_stop_signals(processes: list, received: list[bool]) -> Iterator[None]:
    """A SIGTERM (a job's time limit) or SIGINT (Ctrl-C) to the launcher goes on to its workers:
    they finish the step, save a checkpoint and stop (`fivefold.train.checkpointing`); the launcher
    waits for them as usual and cleans up. A second SIGINT kills them at once. ``received[0]``
    records that a stop was asked."""

    def forward(signum: int, frame: Any) -> None:
        again = received[0] and signum == signal.SIGINT
        received[0] = True
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL if again else signum)
        if not again and signum == signal.SIGINT:
            print(
                "fivefold: stopping at the end of this step (Ctrl-C again to kill the workers)",
                flush=True,
            )

    try:
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    except ValueError:  # not the main thread: nothing to forward from here
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# a launch's directory in the temporary directory: fivefold-<launcher pid>-<random>


TEMP_PREFIX = "fivefold-"
_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-")
_LOCK = ".launcher.lock"


@contextlib.contextmanager
def _held_while_alive(directory: str) -> Iterator[None]:
    """Hold an exclusive lock on a file in a launch's `directory` for the launch. The kernel
    releases it when the launcher dies, however it dies: a lock still held marks the directory as in
    use where its pid cannot say (a launcher in another pid namespace sharing this temporary
    directory)."""
    try:
        import fcntl
    except ImportError:  # no flock here: the pid alone decides
        yield
        return
    fd = os.open(os.path.join(directory, _LOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while another launch's clean-up probes it
        yield
    finally:
        os.close(fd)


def _locked_elsewhere(directory: str) -> bool:
    try:
        import fcntl

        fd = os.open(os.path.join(directory, _LOCK), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except (
        ImportError,
        OSError,
    ):  # no lock file: the launcher died before taking it, or predates it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (
        PermissionError,
        OverflowError,
    ):  # another user's process; not a pid: leave its directory alone
        return True
    return True


def _remove_dead_launchers_dirs() -> None:
    """Remove the directories that launchers which died without cleaning up (SIGKILL, the OOM
    killer) left in the temporary directory: this user's ``fivefold-<pid>-*`` directories whose pid
    is not a live process and whose lock nobody holds. Those of live processes and of other users
    stay; anything else (a link, a file) is left."""
    root = tempfile.gettempdir()
    try:
        entries = os.listdir(root)
    except OSError:
        return
    for name in entries:
        match = _TEMP_NAME.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        path = os.path.join(root, name)
        try:
            info = os.lstat(path)
        except OSError:  # removed meanwhile
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or _locked_elsewhere(path):
            continue
        shutil.rmtree(path, ignore_errors=True)


def launch_local(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    threads: int = 1,
    timeout_s: float = 300.0,
    start_method: str = "spawn",
    device: str = "cpu",
    watch: tuple[float, float] | None = None,
    flight_recorder: FlightRecorder | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` (module-level, result saved by torch.save) in `nproc` local processes;
    return the results. ``device="cpu"``: gloo CPU workers; an accelerator type (``"cuda"``): one
    device per worker, its backend (the GPU smoke test). The store listens on 127.0.0.1 at a port
    the OS chose, never a fixed one, and the workers' gloo on loopback: nothing of the job is
    reachable from another host. A worker's exception re-raises with its traceback;
    `lost_worker_reason` says why a worker that exited was lost. The results pass through a
    directory ``fivefold-<pid>-*`` in the temporary directory, removed at the end; those of
    launchers that died first are removed at the next launch's start. ``watch`` = (heartbeat_s,
    stall_s): watch the workers' heartbeats and, on a stall, kill them and raise
    `fivefold.distributed.watchdog.Stalled` (`fivefold.distributed.watchdog`). ``flight_recorder``:
    every worker records its collectives (`fivefold.distributed.flight_recorder`), and a stall has
    them dump their records (a bounded wait) before they are killed."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: need at least one process")
    _record_launch_start()
    _remove_dead_launchers_dirs()
    store = _loopback_store(nproc, timeout_s)
    with (
        tempfile.TemporaryDirectory(prefix=f"{TEMP_PREFIX}{os.getpid()}-") as out_dir,
        _held_while_alive(out_dir),
    ):
        heartbeat_dir = os.path.join(out_dir, "heartbeats") if watch is not None else ""
        if heartbeat_dir:
            os.mkdir(heartbeat_dir)
        context = mp.start_processes(
            _local_worker,
            args=(
                fn,
                nproc,
                store.port,
                threads,
                timeout_s,
                out_dir,
                args,
                device,
                heartbeat_dir,
                flight_recorder,
            ),
            nprocs=nproc,
            join=False,
            start_method=start_method,
        )
        terminated = [False]
        watchdog = None
        if watch is not None:
            from fivefold.distributed.watchdog import Limits, Watchdog

            limits = Limits(heartbeat_s=watch[0], stall_s=watch[1])
            watchdog = Watchdog(heartbeat_dir, nproc, limits)
        with _forwarding_stop_signals(context.processes, terminated):
            try:
                while not context.join(timeout=1.0 if watchdog is not None else None):
                    problem = watchdog.check() if watchdog is not None else None
                    if problem is not None:
                        from fivefold.distributed.watchdog import Stalled

                        if flight_recorder is not None:  # their records first, then the kill
                            alive = {
                                r: p.pid for r, p in enumerate(context.processes) if p.is_alive()
                            }
                            problem += "; " + flight_recorder.request_dumps(alive)
                        for p in context.processes:
                            if p.is_alive():
                                p.kill()
                        raise Stalled(f"the job stalled and was stopped: {problem}")
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
                if terminated[0]:  # the job was stopped: not a failure to restart from
                    raise Terminated(f"stopped by a signal ({e})") from e
                raise
        results = [
            torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(nproc)
        ]
    del store
    return results


# Where the kernel records out-of-memory kills (module attributes: the tests point them at fake
# files)
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"
KMSG = "/dev/kmsg"
KMSG_MAX_BYTES = (
    16 << 20
)  # read no more of the kernel log than this (its ring buffer is usually 1 MiB or less)
OOM_HINT = (
    "lower --train.micro_batch, use --zero 3 or --train.recompute full (local workers share this "
    "machine's memory: more of them do not help)"
)
_KILLED = re.compile(rb"Killed process (\d+) \(")


def _oom_counter_files() -> list[str]:
    """The files that may hold this process's memory cgroup's OOM-kill count, most specific first:
    cgroup v2 ``memory.events``, cgroup v1 ``memory.oom_control``; each under the cgroup's path,
    then under the mount's root (a container that sees its own cgroup there while /proc/self/cgroup
    names the host's path)."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        parts = line.split(":", 2)  # "hierarchy:controllers:path"
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: the one unified hierarchy
            base, name = CGROUP_ROOT, "memory.events"
        elif "memory" in controllers.split(","):
            base, name = os.path.join(CGROUP_ROOT, "memory"), "memory.oom_control"
        else:
            continue
        for candidate in (os.path.join(base, path.lstrip("/"), name), os.path.join(base, name)):
            if candidate not in files:
                files.append(candidate)
    return files


def _oom_counter() -> tuple[str, int] | None:
    for path in _oom_counter_files():
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return path, int(value)
        except (OSError, ValueError):
            continue
    return None


def oom_kills() -> int | None:
    """How many processes of this process's memory cgroup (and those under it) the kernel's
    out-of-memory killer has killed so far (cgroup v2 ``memory.events`` oom_kill; v1
    ``memory.oom_control``); None where unreadable. `launch_local` records it at its start for
    `lost_worker_reason`."""
    counter = _oom_counter()
    return None if counter is None else counter[1]


def _kernel_log() -> list[tuple[int, bytes]]:
    """(sequence number, message) of the kernel log's records still in its ring buffer; [] where
    /dev/kmsg is not readable (reading it needs CAP_SYSLOG where dmesg is restricted). Never blocks:
    non-blocking reads to the end."""
    try:
        fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    chunks, size = [], 0
    try:
        while size < KMSG_MAX_BYTES:
            try:
                chunk = os.read(fd, 8192)  # /dev/kmsg: one record a read; a regular file: any slice
            except BrokenPipeError:  # the record was overwritten while read: go on with the next
                continue
            except BlockingIOError:  # the end of the log
                break
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    records = []
    for line in b"".join(chunks).split(b"\n"):
        head, sep, message = line.partition(
            b";"
        )  # "priority,sequence,microseconds,flags[,...];message"
        fields = head.split(b",")
        if (
            sep and len(fields) >= 3 and fields[1].isdigit()
        ):  # continuation lines (" KEY=value") have no header
            records.append((int(fields[1]), message))
    return records


def _last_kernel_log_sequence() -> int | None:
    records = _kernel_log()
    return records[-1][0] if records else None


_launch_start: dict[str, int | None] = {"oom_kills": None, "kmsg_sequence": None}


def _record_launch_start() -> None:
    """What `lost_worker_reason` compares with: the OOM-kill count and the kernel log's last record
    at the start."""
    _launch_start["oom_kills"] = oom_kills()
    _launch_start["kmsg_sequence"] = _last_kernel_log_sequence()


def _oom_evidence(pid: int) -> list[str]:
    """What says the kernel's out-of-memory killer ended `pid` since the last launch started: the
    cgroup's OOM-kill count having risen, a kernel log record killing `pid` (records after the start
    only: pids are reused; none if the log was not readable then)."""
    evidence = []
    before, counter = _launch_start["oom_kills"], _oom_counter()
    if before is not None and counter is not None and counter[1] > before:
        evidence.append(f"cgroup {os.path.basename(counter[0])} oom_kill {before} -> {counter[1]}")
    since = _launch_start["kmsg_sequence"]
    for sequence, message in _kernel_log():
        killed = _KILLED.search(message)
        if (
            since is not None
            and sequence > since
            and killed is not None
            and int(killed.group(1)) == pid
        ):
            evidence.append("kernel log: " + message.decode(errors="replace").split(",")[0].strip())
            break
    return evidence


def lost_worker_reason(exc: BaseException) -> str:
    """One line saying why a worker of `launch_local` was lost, from the `torch.multiprocessing.
    ProcessExitedException` its join raised. For SIGKILL, the out-of-memory evidence readable here
    (the memory cgroup's OOM-kill count against the one at the launch's start; the kernel log's
    record of the kill) and what to lower; else that nothing here tells an OOM kill from another
    process's SIGKILL. Another signal or an exit code: said plainly. A worker's exception: its last
    line (the error itself). Any other exception: its first line."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if isinstance(exc, mp.ProcessRaisedException):
        return (
            f"worker {exc.error_index} (pid {exc.error_pid}) raised "
            f"{lines[-1].strip() if lines else 'an error'}"
        )
    if not isinstance(exc, mp.ProcessExitedException):
        return lines[0].strip() if lines else type(exc).__name__
    who = f"worker {exc.error_index} (pid {exc.error_pid})"
    if exc.signal_name == "SIGKILL":
        evidence = _oom_evidence(exc.error_pid)
        if evidence:
            return (
                f"{who} was killed by the kernel's out-of-memory killer (SIGKILL; "
                f"{'; '.join(evidence)}): {OOM_HINT}"
            )
        return (
            f"{who} was killed by SIGKILL (by another process, or out of memory: no OOM record "
            "readable here)"
        )
    if exc.signal_name is not None:
        return f"{who} was killed by {exc.signal_name}"
    return f"{who} exited with code {exc.exit_code} before finishing"
