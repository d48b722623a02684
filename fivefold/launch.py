"""Starting processes: from a torchrun environment (`init_distributed`) or as N local CPU workers joined by gloo
(`launch_local`), and the device each computes on."""

from __future__ import annotations

import datetime
import gc
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["backend_for", "default_device", "init_distributed", "is_torchrun_env", "launch_local"]


def default_device() -> torch.device:
    """The local accelerator if torch sees one (chosen by LOCAL_RANK), else the CPU."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None:
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.accelerator.device_count(), 1)
    torch.accelerator.set_device_index(index)
    return torch.device(acc.type, index)


def backend_for(device: torch.device) -> str:
    return "gloo" if device.type == "cpu" else dist.Backend.default_device_backend_map.get(device.type, "gloo")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group from a torchrun-style environment; return the device."""
    device = default_device()
    if not dist.is_initialized():
        dist.init_process_group(backend or backend_for(device), timeout=datetime.timedelta(seconds=timeout_s))
    return device


def is_torchrun_env() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _local_worker(rank: int, fn: Callable[..., Any], world_size: int, port: int, threads: int,
                  timeout_s: float, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        del result
    finally:
        # Engines sit in reference cycles (parameter -> gradient hook -> reducer -> parameter) that hold process
        # groups and work handles; collected after destroy_process_group, their teardown can abort the worker
        # (seen: an intermittent SIGABRT in the test suite without this). Collect them while the group exists.
        gc.collect()
        dist.destroy_process_group()


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, threads: int = 1,
                 timeout_s: float = 300.0, start_method: str = "spawn") -> list[Any]:
    """Run ``fn(*args)`` (module-level, result saved by torch.save) in `nproc` gloo CPU processes; return the results.
    The store listens on a port the OS chose, never a fixed one; a worker's exception re-raises with its traceback."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc}: need at least one process")
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    with tempfile.TemporaryDirectory(prefix="fivefold-") as out_dir:
        mp.start_processes(_local_worker, args=(fn, nproc, store.port, threads, timeout_s, out_dir, args),
                           nprocs=nproc, join=True, start_method=start_method)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(nproc)]
    del store
    return results
