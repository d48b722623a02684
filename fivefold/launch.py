"""Starting processes: from a torchrun environment (`init_distributed`) or as N local CPU workers joined by gloo
(`launch_local`), and the device each computes on."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["backend_for", "distributed", "init_distributed", "is_torchrun_env", "launch_local", "resolve_device",
           "teardown", "to_device"]


def resolve_device(requested: str = "auto") -> torch.device:
    """The one rule for where this process computes. ``cpu``: the CPU. ``auto``: the local accelerator if torch sees
    one, else the CPU. ``cuda`` (any accelerator type): that accelerator, which must exist. The device index is
    ``LOCAL_RANK`` (one process per device) unless given (``cuda:1``); a local rank without its own device is an
    error, never a silently shared one. Sets the current device."""
    requested = (requested or "auto").strip().lower()
    if requested == "cpu":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if requested == "auto":
        if accelerator is None:
            return torch.device("cpu")
        wanted = torch.device(accelerator.type)
    else:
        try:
            wanted = torch.device(requested)
        except RuntimeError:
            raise ValueError(f"run.device={requested!r} is not a device; use auto, cpu or an accelerator such as "
                             "cuda") from None
        if accelerator is None or accelerator.type != wanted.type:
            have = accelerator.type if accelerator is not None else "no accelerator"
            raise ValueError(f"run.device={requested!r} but torch sees {have} here; use run.device=auto or cpu")
    count = torch.accelerator.device_count()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    index = wanted.index if wanted.index is not None else local_rank
    if index >= count:
        raise ValueError(f"local rank {local_rank} needs {wanted.type} device {index}, but this node has {count}: "
                         f"start at most {count} processes per node (torchrun --nproc-per-node {count}), one per "
                         "device, or set run.device=cpu")
    torch.accelerator.set_device_index(index)
    return torch.device(wanted.type, index)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch onto `device` without making the host wait: pinned, then copied asynchronously (an accelerator
    runs the copy in order before the kernels that read it). On the CPU it is returned as is."""
    if t.device == device:
        return t
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if t.device.type == "cpu" and accelerator is not None and device.type == accelerator.type:
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def backend_for(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else dist.Backend.default_device_backend_map.get(device.type, "gloo")


def init_distributed(device: torch.device | str | None = None, backend: str | None = None,
                     timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group from a torchrun-style environment for `device` (default: `resolve_device`)
    with its backend (gloo for the CPU, NCCL for CUDA). An accelerator is bound as ``device_id``: communicators
    are created at once (errors surface here, not at the first collective) and sub-groups split from them."""
    device = resolve_device() if device is None else torch.device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend or backend_for(device), timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type != "cpu" else None)
    return device


@contextlib.contextmanager
def distributed(device: torch.device | str | None = None, timeout_s: float = 600.0) -> Iterator[torch.device]:
    """`init_distributed` for the body, then the group torn down (the engines' reference cycles collected first)."""
    device = init_distributed(device, timeout_s=timeout_s)
    try:
        yield device
    finally:
        teardown()


def teardown() -> None:
    """Destroy the default process group. Engines sit in reference cycles (parameter -> gradient hook -> reducer ->
    parameter) that hold process groups and work handles; collected after the group is gone, their teardown can abort
    the process (seen: an intermittent SIGABRT in the test suite). Collect them while the group exists."""
    gc.collect()
    dist.destroy_process_group()


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def is_torchrun_env() -> bool:
    """True under torchrun (or any launcher that sets what it sets); raises if only some of its variables are set,
    e.g. left over in the shell, which would otherwise make a local run wait for ranks that never come."""
    present = [k for k in TORCHRUN_VARS if k in os.environ]
    if present and len(present) < len(TORCHRUN_VARS):
        missing = [k for k in TORCHRUN_VARS if k not in os.environ]
        raise ValueError(f"{', '.join(f'{k}={os.environ[k]}' for k in present)} set but not {', '.join(missing)}: "
                         "these look left over from another launch. To run locally, unset them (env -u "
                         f"{' -u '.join(present)} fivefold train ...); under torchrun all of them are set")
    return bool(present)


def _local_worker(rank: int, fn: Callable[..., Any], world_size: int, port: int, threads: int,
                  timeout_s: float, out_dir: str, args: tuple, device: str = "cpu", heartbeat_dir: str = "") -> None:
    torch.set_num_threads(threads)
    if heartbeat_dir:  # the launcher watches for stalls
        from fivefold.watchdog import Heartbeat
        Heartbeat(heartbeat_dir, rank)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=timeout_s)
    where = resolve_device(device)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend_for(where), store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=where if where.type != "cpu" else None)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        del result
    finally:
        teardown()


class Terminated(RuntimeError):
    """The launcher was sent SIGTERM or SIGINT and its workers did not all finish cleanly (e.g. stopped during
    start-up)."""


@contextlib.contextmanager
def _forwarding_stop_signals(processes: list, received: list[bool]) -> Iterator[None]:
    """A SIGTERM (a job's time limit) or SIGINT (Ctrl-C) to the launcher goes on to its workers: they
    finish the step, save a checkpoint and stop (`fivefold.train.checkpointing`); the launcher waits for them as
    usual and cleans up. A second SIGINT kills them at once. ``received[0]`` records that a stop was asked."""
    def forward(signum: int, frame: Any) -> None:
        again = received[0] and signum == signal.SIGINT
        received[0] = True
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL if again else signum)
        if not again and signum == signal.SIGINT:
            print("fivefold: stopping at the end of this step (Ctrl-C again to kill the workers)", flush=True)

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


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, threads: int = 1,
                 timeout_s: float = 300.0, start_method: str = "spawn", device: str = "cpu",
                 watch: tuple[float, float] | None = None) -> list[Any]:
    """Run ``fn(*args)`` (module-level, result saved by torch.save) in `nproc` local processes; return the results.
    ``device="cpu"``: gloo CPU workers; an accelerator type (``"cuda"``): one device per worker, its backend (the GPU
    smoke test). The store listens on a port the OS chose, never a fixed one; a worker's exception re-raises with its
    traceback. ``watch`` = (heartbeat_s, stall_s): watch the workers' heartbeats and, on a stall, kill them and raise
    `fivefold.watchdog.Stalled` (`fivefold.watchdog`)."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: need at least one process")
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    with tempfile.TemporaryDirectory(prefix="fivefold-") as out_dir:
        heartbeat_dir = os.path.join(out_dir, "heartbeats") if watch is not None else ""
        if heartbeat_dir:
            os.mkdir(heartbeat_dir)
        context = mp.start_processes(_local_worker, args=(fn, nproc, store.port, threads, timeout_s, out_dir, args,
                                                          device, heartbeat_dir),
                                     nprocs=nproc, join=False, start_method=start_method)
        terminated = [False]
        watchdog = None
        if watch is not None:
            from fivefold.watchdog import Watchdog
            watchdog = Watchdog(heartbeat_dir, nproc, heartbeat_s=watch[0], stall_s=watch[1])
        with _forwarding_stop_signals(context.processes, terminated):
            try:
                while not context.join(timeout=1.0 if watchdog is not None else None):
                    problem = watchdog.check() if watchdog is not None else None
                    if problem is not None:
                        from fivefold.watchdog import Stalled
                        for p in context.processes:
                            if p.is_alive():
                                p.kill()
                        raise Stalled(f"the job stalled and was stopped: {problem}")
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
                if terminated[0]:  # the job was stopped: not a failure to restart from
                    raise Terminated(f"stopped by a signal ({e})") from e
                raise
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(nproc)]
    del store
    return results
