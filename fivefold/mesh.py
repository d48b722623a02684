"""The process grid: `ParallelDims` -> torch `DeviceMesh`, per-dimension `Comm`s, and launching.

Layout (DESIGN.md): ``world = pp × dp × cp × tp`` with tp innermost, so tensor-parallel
peers are adjacent ranks (the same node on a GPU cluster). The grid is an explicit object
passed to whoever needs it; nothing here is a module-level singleton.

Also owns process start-up: `init_distributed` for torchrun-style environments and
`launch_local` to spawn N local CPU workers (gloo on 127.0.0.1, a store on a free port).
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.comm import Comm, CommLog

MESH_DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension. ``dp=-1`` means "whatever is left of the world"."""

    pp: int = 1
    dp: int = -1
    cp: int = 1
    tp: int = 1

    def resolve(self, world_size: int) -> ParallelDims:
        """Fill in dp and check that the product of the degrees is the world size."""
        for f in fields(self):
            v = getattr(self, f.name)
            if v == 0 or v < -1 or (v == -1 and f.name != "dp"):
                raise ValueError(f"parallel.{f.name}={v} is invalid: use a positive degree"
                                 + (" (or -1 to take the rest of the world)" if f.name == "dp" else ""))
        others = self.pp * self.cp * self.tp
        if self.dp == -1:
            if world_size % others:
                raise ValueError(
                    f"world size {world_size} is not divisible by pp({self.pp}) × cp({self.cp}) × "
                    f"tp({self.tp}) = {others}; change the degrees or the number of processes")
            return replace(self, dp=world_size // others)
        if others * self.dp != world_size:
            raise ValueError(
                f"pp({self.pp}) × dp({self.dp}) × cp({self.cp}) × tp({self.tp}) = {others * self.dp} "
                f"but the world size is {world_size}; make the product equal the number of processes "
                f"(or set dp=-1 to derive it)")
        return self

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d) for d in MESH_DIMS)

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)


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


class ParallelMesh:
    """The resolved grid of this process: degrees, DeviceMesh, per-dim Comms, one CommLog."""

    def __init__(self, dims: ParallelDims, device: torch.device | str = "cpu",
                 comm_log: CommLog | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_distributed() first "
                               "or run under `fivefold train` / torchrun")
        self.device = torch.device(device)
        self.dims = dims.resolve(dist.get_world_size())
        self.comm_log = comm_log if comm_log is not None else CommLog(enabled=False)
        self.device_mesh = dist.device_mesh.init_device_mesh(
            self.device.type, self.dims.shape(), mesh_dim_names=MESH_DIMS)
        self._comms: dict[str, Comm] = {}

    def size(self, dim: str) -> int:
        return getattr(self.dims, dim)

    def rank(self, dim: str) -> int:
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.device_mesh.get_group(dim)

    def comm(self, dim: str) -> Comm:
        if dim not in self._comms:
            self._comms[dim] = Comm(self.group(dim), dim, self.comm_log, device=self.device)
        return self._comms[dim]

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    def __repr__(self) -> str:
        coords = ", ".join(f"{d}={self.rank(d)}/{self.size(d)}" for d in MESH_DIMS)
        return f"ParallelMesh(rank {self.global_rank}: {coords}, device={self.device})"


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group from a torchrun-style environment; return the device."""
    device = default_device()
    if not dist.is_initialized():
        dist.init_process_group(backend or backend_for(device),
                                timeout=datetime.timedelta(seconds=timeout_s))
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
        # Wrappers sit in reference cycles (param -> grad hook -> reducer -> param); free them while
        # the process group still exists, or their destructors may abort the process at exit.
        gc.collect()
        dist.destroy_process_group()


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, threads: int = 1,
                 timeout_s: float = 300.0, start_method: str = "spawn") -> list[Any]:
    """Run ``fn(*args)`` in `nproc` local CPU processes joined by gloo; return each rank's result.

    The rendezvous store is created here on a free port chosen by the OS (never a fixed port)
    and kept alive until the workers finish. A worker's exception is re-raised with its traceback.
    `fn` must be importable (a module-level function) and its result picklable by torch.save.
    """
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
