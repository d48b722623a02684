"""Buffer policies of the ZeRO engine: where a bucket's reduced shard lands and whether the
communication buffers are allocated per use (`FreshBuffers`) or once for the run (`ConstantBuffers`,
ZeRO-R's C_B, docs/design.md#offload-and-constant-buffers).

A stage asks its policy for the places it does not own: `shard_output` (where a reduce-scatter of
ZeRO-2/3 lands), `keep_local` (a one-rank reduction's result, which must outlive its bucket's
buffer), `moved_shard` (ZeRO-1's reduced shard moved out of the kept buffer). With constant buffers
the temporary full gradient buffers of ZeRO-2/3 and the reduce-scatter outputs that add to a shard
already there come from two `BufferPool`s (`start_pools`, called by the stages that free full
gradients), the first output of a step lands in the flat's gradient-shard buffer kept for the run,
and ZeRO-3 units gather into shared slots (`fsdp.GatherSlots`, switched on by ``constant``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fivefold.data_parallel.buckets import BufferPool, GradBucket
from fivefold.data_parallel.flat_param import FlatParam

__all__ = ["BufferPolicy", "ConstantBuffers", "FreshBuffers"]


class FreshBuffers:
    """Temporary buffers allocated when needed and dropped after (the default)."""

    constant = False  # ZeRO-3: units gather into storage of their own
    grad_pool: BufferPool | None = None  # (GradBucket's pool for its temporary full buffer)
    shard_pool: BufferPool | None = None

    def start_pools(
        self, flats: Sequence[FlatParam], dtype: torch.dtype, device: torch.device
    ) -> None:
        """A stage that frees its full gradient buffers is being built (nothing to pool here)."""

    def shard_output(self, flat: FlatParam, dtype: torch.dtype) -> torch.Tensor:
        """Where a ZeRO-2/3 reduce-scatter of `flat`'s bucket lands."""
        return torch.empty(flat.shard_numel, dtype=dtype, device=flat.full.device)

    def keep_local(self, flat: FlatParam, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A one-rank reduction's result `out` (a view of the bucket's buffer), kept past the
        buffer's life."""
        return out

    def give_back(self, flat: FlatParam, out: torch.Tensor) -> None:
        """`out` was added to the flat's gradient shard: a pooled temporary returns to its pool."""

    def forget_unfinished(self, buckets: Sequence[GradBucket], flats: Sequence[FlatParam]) -> None:
        """A backward raised with reduce-scatters in flight (their outputs are never used again)."""

    def moved_shard(self, flat: FlatParam, shard: torch.Tensor) -> torch.Tensor:
        """ZeRO-1: a copy of the reduced `shard` that does not live in the bucket's kept buffer."""
        return shard.clone()

    def tensors(self) -> list[torch.Tensor]:
        """The buffers this policy holds for the run (`ZeroDataParallel.model_state_tensors`'
        ``buffers``)."""
        return []


class ConstantBuffers(FreshBuffers):
    """ZeRO-R's constant buffers: after warm-up a step allocates none of the communication
    buffers."""

    constant = True

    def start_pools(
        self, flats: Sequence[FlatParam], dtype: torch.dtype, device: torch.device
    ) -> None:
        """Full gradient buffers (the largest bucket's size) and gradient shards for the
        reduce-scatters of a micro-step that adds to a shard already there (the largest shard's
        size)."""
        device = flats[0].full.device if flats else device
        full = max((f.layout.padded_numel for f in flats), default=0)
        shard = max((f.shard_numel for f in flats), default=0)
        self.grad_pool = BufferPool(full, dtype, device)
        self.shard_pool = BufferPool(shard, dtype, device)

    def shard_output(self, flat: FlatParam, dtype: torch.dtype) -> torch.Tensor:
        """The flat's gradient shard itself when none is there yet (its buffer kept for the run),
        else a pooled temporary added to it when the reduce-scatter is done (`give_back`).
        """
        if self.shard_pool is None:
            return super().shard_output(flat, dtype)
        if flat.grad_shard is None:
            return flat.persistent_grad_shard(dtype)
        return self.shard_pool.acquire(flat.shard_numel)

    def keep_local(self, flat: FlatParam, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.shard_pool is None:
            return out
        return self.shard_output(flat, dtype).copy_(
            out
        )  # the bucket's buffer goes back to the pool

    def give_back(self, flat: FlatParam, out: torch.Tensor) -> None:
        if self.shard_pool is not None and out is not flat.grad_shard:
            self.shard_pool.release(out)

    def forget_unfinished(self, buckets: Sequence[GradBucket], flats: Sequence[FlatParam]) -> None:
        """Outputs (pooled, or a flat's own gradient-shard buffer) of reduce-scatters still in
        flight may still be written, so they are never used again (their input buffers:
        `GradBucket.release`)."""
        if self.shard_pool is None:
            return
        for bucket in buckets:
            if bucket.work is None or bucket.out is None:
                continue
            flat = flats[bucket.index]
            if bucket.out is flat.grad_shard_buffer:
                flat.grad_shard_buffer = None
            else:
                self.shard_pool.forget(bucket.out)
            bucket.out = None

    def moved_shard(self, flat: FlatParam, shard: torch.Tensor) -> torch.Tensor:
        return flat.persistent_grad_shard(shard.dtype).copy_(
            shard
        )  # the shard's buffer, allocated once

    def tensors(self) -> list[torch.Tensor]:
        if self.grad_pool is None:
            return []
        return [*self.grad_pool.buffers, *self.shard_pool.buffers]


BufferPolicy = FreshBuffers  # the interface: ConstantBuffers overrides what differs
