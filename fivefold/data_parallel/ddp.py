"""DDP: replicated parameters, gradients averaged by bucketed all-reduce overlapped with backward.

DDP (docs/design.md#data-parallel-traffic): 16Ψ bytes per rank, one all-reduce of Ψ per step
(ring wire 2(N-1)/N · Ψ · bytes). Buckets and hooks live in `buckets.py`; here only what a full
bucket does (`AllReduceEachBucket`).
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fivefold.data_parallel.buckets import (
    BucketedGradReducer,
    BucketStrategy,
    GradBucket,
    make_grad_buckets,
)
from fivefold.distributed.comm import Comm


def broadcast_module_state(
    module: nn.Module,
    comm: Comm,
    src_group_rank: int = 0,
    skip: Collection[str] = (),
    message_bytes: int = 32 * 2**20,
) -> None:
    """Make every rank's parameters and buffers equal to the source rank's, in place. Small tensors
    of one dtype and device travel together in messages of at most `message_bytes`, a larger one
    alone: never a second copy of the model. Meta tensors, the parameters named in `skip`
    (materialised later, the same on every rank) and the buffers a module lists in
    ``rank_local_buffers`` (context parallel's RoPE rows, each rank its own positions) are left."""
    rank_local = {
        f"{prefix}.{b}" if prefix else b
        for prefix, m in module.named_modules()
        for b in getattr(m, "rank_local_buffers", ())
    }
    named = [
        *module.named_parameters(),
        *((n, b) for n, b in module.named_buffers() if n not in rank_local),
    ]
    tensors = [t.detach() for n, t in named if n not in skip and t.device.type != "meta"]
    messages: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = messages[-1][0] if messages else None
        if (
            last is None
            or (last.dtype, last.device) != (t.dtype, t.device)
            or size + nbytes > message_bytes
        ):
            messages.append([])
            size = 0
        messages[-1].append(t)
        size += nbytes
    with torch.no_grad():
        for message in messages:
            if len(message) == 1 and message[0].is_contiguous():
                comm.broadcast(message[0], src_group_rank, tag="init")
                continue
            flat = torch.cat([t.reshape(-1) for t in message])
            comm.broadcast(flat, src_group_rank, tag="init")
            offset = 0
            for t in message:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


class AllReduceEachBucket(BucketStrategy):
    """DDP's strategy: a full bucket is pre-divided by N and all-reduced (its ``.grad`` views see
    the mean)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def on_launch_bucket(self, bucket: GradBucket) -> Any:
        if self.comm.size == 1:
            return None
        # Pre-divide: the sum of g_i / N is the mean, and fp16 sums cannot overflow by N.
        bucket.grad.div_(self.comm.size)
        return self.comm.all_reduce(bucket.grad, async_op=True, tag=f"bucket{bucket.index}")


class DDP(nn.Module):
    """Data-parallel wrapper for any module, like `torch.nn.parallel.DistributedDataParallel`:
    parameters broadcast from group rank 0, ``.grad`` views into flat buckets all-reduced as they
    fill, tied parameters counted once, frozen ones ignored; a parameter without a gradient is an
    error unless ``find_unused=True``."""

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        *,
        bucket_mb: float = 25.0,
        find_unused: bool = False,
        broadcast_init: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        self.comm = comm
        if broadcast_init and comm.size > 1:
            broadcast_module_state(module, comm)
        buckets = make_grad_buckets(list(module.named_parameters()), bucket_mb * 2**20)
        self.reducer = BucketedGradReducer(
            buckets, AllReduceEachBucket(comm), find_unused=find_unused
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate gradients locally; the first backward outside the context syncs them all."""
        return self.reducer.no_sync()

    def zero_grad(self, set_to_none: bool = False) -> None:  # noqa: D102 - nn.Module semantics
        if set_to_none:
            super().zero_grad(set_to_none=True)
        else:
            self.reducer.zero_grad()

    @property
    def buckets(self) -> list[GradBucket]:
        return self.reducer.buckets
