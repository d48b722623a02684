"""ZeRO-Offload (docs/design.md#offload-and-constant-buffers): the fp32 master shard and the
optimizer state live in host memory and the optimizer step runs there; each step the gradient shard
travels to the host and the updated shard back to the device.

This module owns the two master policies a `FlatParam` is built with (`MasterOnDevice`, and
ZeRO-Offload's `MasterOnHost`) and the host side's buffers and copies, device-agnostic: on an
accelerator the host buffers are pinned and the copies asynchronous, each flat's gradient copy
followed by an event of its own (`copy_to_host`) that the host waits for (`wait_for`) only before
stepping that flat; on the CPU the same code runs against host buffers of their own (never aliasing
the compute shard), so CI exercises the whole path. The norm, clipping and every collective stay on
the device (`ShardedOptimizer`); only the elementwise update moves. It also owns how many threads
the host step uses (`host_step_threads`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

HOST = torch.device("cpu")


def is_accelerator(device: torch.device) -> bool:
    """True where the host buffer should be pinned and copies asynchronous (a real accelerator, not
    the CPU or meta)."""
    return device.type not in ("cpu", "meta")


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer for a shard whose compute copy lives on `device` (pinned when that is an
    accelerator; on the meta device, where `fivefold.plan` lays a rank out, a meta tensor: nothing
    is allocated)."""
    if torch.device(device).type == "meta":
        return torch.zeros(numel, dtype=dtype, device="meta")
    return torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=is_accelerator(device))


def device_event(device: torch.device) -> Any:
    """An event recorded now on `device`'s current stream (`torch.Event`)."""
    event = torch.Event(device=device)
    event.record()
    return event


def copy_to_host(host: torch.Tensor, src: torch.Tensor) -> Any:
    """Start copying `src` (device) into `host`; returns what `wait_for` waits on before the host
    reads it: on an accelerator an event recorded after the copy (None on the CPU: it is there)."""
    if not is_accelerator(src.device):
        host.copy_(src)
        return None
    host.copy_(src, non_blocking=True)
    return device_event(src.device)


def wait_for(arrival: Any) -> None:
    """Block the host until the copy `arrival` (from `copy_to_host`) is done; only that copy and
    what its stream ran before it, not the copies queued after it."""
    if arrival is not None:
        arrival.synchronize()


def host_step_threads_for(environ: Mapping[str, str], cpus: int) -> int | None:
    """The intra-op threads for the host step of one rank (None: torch's setting as it is). The
    rank's share of the cores it may run on, `cpus` // LOCAL_WORLD_SIZE, unless the user chose:
    an OMP_NUM_THREADS in the environment is kept — except the 1 torchrun sets for its workers when
    the user set none (under torchrun, TORCHELASTIC_RUN_ID, with more than one local rank), which
    would leave the host AdamW on one core."""
    local = max(1, int(environ.get("LOCAL_WORLD_SIZE") or 1))
    omp = environ.get("OMP_NUM_THREADS")
    torchrun_default = omp == "1" and "TORCHELASTIC_RUN_ID" in environ and local > 1
    if omp is not None and not torchrun_default:
        return None
    return max(1, cpus // local)


def _local_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        return os.cpu_count() or 1


@contextmanager
def host_step_threads() -> Iterator[None]:
    """Run the host step with `host_step_threads_for` this process's environment and cores, never
    fewer threads than torch has now; torch's setting is restored after (the device path keeps its
    own)."""
    wanted = host_step_threads_for(os.environ, _local_cpus())
    before = torch.get_num_threads()
    if wanted is None or wanted <= before:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def copy_to_device(
    dst: torch.Tensor, host: torch.Tensor, staging: torch.Tensor | None = None
) -> None:
    """Copy the host tensor `host` into `dst` on the device, cast to ``dst``'s dtype. On an
    accelerator the cast happens on the host into `staging` (pinned, ``dst``'s dtype) so that only
    compute-dtype bytes cross the bus and the copy is asynchronous; `staging` must not be rewritten
    before the device used it (the next step's `wait_for` of this flat's gradient copy, queued on
    the same stream after this one, guarantees it)."""
    if staging is not None and is_accelerator(dst.device) and host.dtype != dst.dtype:
        staging.copy_(host)
        host = staging
    dst.copy_(host, non_blocking=is_accelerator(dst.device))


# -- where a flat buffer's fp32 master shard lives: the policies `FlatParam` is built with ---------


class MasterOnDevice:
    """The fp32 master shard beside the compute shard (the default): the shard itself for an fp32
    model, an fp32 copy otherwise; gradients are used where they are and the update is copied into
    the compute shard on the device."""

    on_host = False
    grad: torch.Tensor | None = None  # (no host gradient buffer)
    staging: torch.Tensor | None = None  # (no host staging buffer)

    def make_master(
        self, local: torch.Tensor, param_dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        if param_dtype == torch.float32:
            return local
        return torch.zeros(local.numel(), dtype=torch.float32, device=device)

    def grad_buffer(self, numel: int, device: torch.device) -> torch.Tensor | None:
        """Where the optimizer reads the master's gradient (None: the device gradient itself)."""
        return None

    def write_back(self, local: torch.Tensor, master: torch.Tensor) -> None:
        local.copy_(master)


class MasterOnHost:
    """ZeRO-Offload: the fp32 master shard (and so the optimizer state) in host memory. The
    gradient shard is copied into a host buffer of its own for the step; the update travels back,
    cast on the host first on an accelerator (a staging buffer in the compute dtype), so only
    compute-dtype bytes cross the bus. One instance per flat buffer: it owns that flat's host
    buffers, each allocated once."""

    on_host = True

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None  # the fp32 gradient shard on the host
        self.staging: torch.Tensor | None = None  # the cast shard before its copy (accelerator)

    def make_master(
        self, local: torch.Tensor, param_dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        # a host buffer of its own whatever the dtype (never aliasing the compute shard)
        return host_zeros(local.numel(), torch.float32, device)

    def grad_buffer(self, numel: int, device: torch.device) -> torch.Tensor:
        if self.grad is None:
            self.grad = host_zeros(numel, torch.float32, device)
        return self.grad

    def write_back(self, local: torch.Tensor, master: torch.Tensor) -> None:
        if self.staging is None and local.dtype != torch.float32 and is_accelerator(local.device):
            self.staging = host_zeros(local.numel(), local.dtype, local.device)
        copy_to_device(local, master, self.staging)


MasterHome = MasterOnDevice | MasterOnHost
