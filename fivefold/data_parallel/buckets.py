"""Flat padded buffers and the bucketed gradient reducer: the one implementation behind DDP and
ZeRO.

DP (docs/design.md#one-training-step): gradients are bucketed in reverse registration order (the
order backward produces them); a post-accumulate-grad hook marks a parameter ready and the bucket's
collective launches asynchronously with its last gradient, overlapping the rest of backward. Buckets
launch in index order so every rank issues the same collectives in the same order; what a bucket
does (all-reduce for DDP, reduce-scatter for ZeRO) is the `BucketStrategy` passed in.
``max_inflight`` (ZeRO-2/3, whose full gradient buffers are temporary) completes the oldest buckets
beyond the bound during backward, so the peak holds a few full buffers, not all until backward ends
(as FSDP does). A staged handle (`StagedWork`: HSDP's reduce-scatter, then the all-reduce of its
shard) is waited there only up to its first stage — the full buffer goes, the result's collective
runs on — and finished at the end of backward, where its result is needed (docs/design.md#hsdp).

ZeRO-R's constant-size buffers C_B (docs/design.md#offload-and-constant-buffers): with a
`BufferPool` the temporary full gradient buffers of ZeRO-2/3 (and the reduce-scatter outputs that
need one) are fixed-size buffers allocated once and handed from bucket to bucket, so after warm-up a
step allocates none and the allocator does not fragment around them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

# in_backward: re-exported for the engines
from fivefold.ops import graph_task_id, in_backward  # noqa: F401

NamedParams = Sequence[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives inside a flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


class FlatLayout:
    """Offsets of several tensors packed contiguously, total padded to a multiple of `pad_to`.
    ``bounds``: shards of unequal sizes, rank r's [bounds[r], bounds[r + 1]) (whole-parameter
    owners, `ownership`; no padding then); None: N equal shards of the padded buffer."""

    def __init__(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        pad_to: int = 1,
        bounds: Sequence[int] | None = None,
    ) -> None:
        self.slots: list[Slot] = []
        offset = 0
        for name, t in named:
            self.slots.append(Slot(name, offset, t.numel(), t.shape))
            offset += t.numel()
        self.numel = offset
        self.pad_to = pad_to
        self.padded_numel = -(-offset // pad_to) * pad_to
        if bounds is not None and (bounds[0] != 0 or bounds[-1] != self.padded_numel):
            raise ValueError(
                f"shard bounds {list(bounds)} do not cover the {self.padded_numel}-element buffer"
            )
        self.bounds = list(bounds) if bounds is not None else None

    @property
    def shard_sizes(self) -> list[int] | None:
        """Each rank's shard size when they differ (``bounds``); None for equal shards."""
        if self.bounds is None:
            return None
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        s = self.slots[i]
        return flat[s.offset : s.offset + s.numel].view(s.shape)

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """[start, end) of `rank`'s contiguous shard: from ``bounds`` if given, else the equal
        1/`world` (requires pad_to % world == 0)."""
        if self.bounds is not None:
            if len(self.bounds) != world + 1:
                raise ValueError(f"shard bounds for {len(self.bounds) - 1} ranks, not {world}")
            return self.bounds[rank], self.bounds[rank + 1]
        if self.padded_numel % world:
            raise ValueError(
                f"flat buffer of {self.padded_numel} elements cannot be split evenly "
                f"over {world} ranks (pad_to={self.pad_to})"
            )
        size = self.padded_numel // world
        return rank * size, (rank + 1) * size


class BufferPool:
    """Constant-size flat buffers of one dtype and device (ZeRO-R C_B): `acquire(numel)` hands out a
    view of the first ``numel`` elements of a free buffer of ``capacity`` elements, `release` takes
    it back. A buffer is allocated only when none is free — while warming up: with ``max_inflight``
    buckets in flight the pool settles at ``max_inflight + 1`` buffers; under ``no_sync`` every
    bucket holds one until the reduction, so it grows to the number of buckets, once — and is kept
    for the run (its bytes are reported apart: `memory.ModelStateBytes.buffers`).
    """

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        self.buffers: list[torch.Tensor] = []
        self._free: list[torch.Tensor] = []
        self._by_storage: dict[int, torch.Tensor] = {}

    def acquire(self, numel: int) -> torch.Tensor:
        if numel > self.capacity:
            raise ValueError(
                f"a buffer of {numel} elements was asked of a pool of {self.capacity}-element "
                "buffers"
            )
        if self._free:
            buffer = self._free.pop()
        else:
            buffer = torch.empty(self.capacity, dtype=self.dtype, device=self.device)
            self.buffers.append(buffer)
            self._by_storage[buffer.untyped_storage().data_ptr()] = buffer
        return buffer[:numel]

    def release(self, view: torch.Tensor) -> None:
        buffer = self._by_storage.get(view.untyped_storage().data_ptr())
        if buffer is None or any(b is buffer for b in self._free):
            raise RuntimeError(
                "released a tensor that is not a buffer of this pool in use (released twice?)"
            )
        self._free.append(buffer)

    def forget(self, view: torch.Tensor) -> None:
        """Drop a buffer in use from the pool for good (a collective that never finished may still
        write it); the pool allocates another when it needs one."""
        buffer = self._by_storage.pop(view.untyped_storage().data_ptr(), None)
        if buffer is not None:
            self.buffers = [b for b in self.buffers if b is not buffer]


def assign_buckets(
    named_params: NamedParams,
    bucket_bytes: float,
    kind: Callable[[str, nn.Parameter], Hashable | None] | None = None,
) -> list[list[tuple[str, nn.Parameter]]]:
    """Split trainable parameters into buckets of at least `bucket_bytes` in reverse registration
    order; a change of dtype or device starts a new bucket (one flat buffer has one dtype), and so
    does a change of ``kind(name, p)`` (whole-parameter owners or equal shards: one layout per
    buffer) — a parameter whose kind is None (a norm's weight) joins the bucket it comes to."""
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    current_kind: Hashable | None = None
    size = 0
    for name, p in reversed(list(named_params)):
        if not p.requires_grad:
            continue
        this_kind = kind(name, p) if kind is not None else None
        if current and (
            p.dtype != current[0][1].dtype
            or p.device != current[0][1].device
            or None not in (this_kind, current_kind)
            and this_kind != current_kind
        ):
            buckets.append(current)
            current, size, current_kind = [], 0, None
        if this_kind is not None:
            current_kind = this_kind
        current.append((name, p))
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size, current_kind = [], 0, None
    if current:
        buckets.append(current)
    return buckets


@runtime_checkable
class StagedWork(Protocol):
    """A bucket's handle in two stages: `wait_input` returns once no collective still in flight
    reads or writes the bucket's full gradient buffer (it may be freed), `wait` once the result is
    there (HSDP: the reduce-scatter, then the all-reduce of its shard, `hsdp.StagedThenAllReduce`).
    """

    def wait_input(self) -> None: ...

    def wait(self) -> None: ...


class GradBucket:
    """One bucket: its parameters, the flat gradient buffer laid out by `layout`, and readiness.

    Views (DDP, matching dtypes): ``param.grad`` is a view of the buffer, which lives for the run.
    Copy (ZeRO, or a reduce dtype unlike the parameter's): the hook adds ``param.grad`` into the
    buffer and drops it; ZeRO-1 keeps the buffer, ZeRO-2/3 hold it only until the collective
    finished (`release`). ZeRO-3 (``defer_copy``) copies all gradients in (`copy_in`) just before
    the launch, after the unit's gathered parameters were freed (as FSDP2), so the buffer never
    coexists with the unit's parameters; under ``no_sync`` it copies as usual (reduce dtype). With a
    ``pool`` a temporary buffer is borrowed from it and given back (constant buffers) instead of
    allocated."""

    def __init__(
        self,
        index: int,
        named_params: NamedParams,
        layout: FlatLayout,
        grad_dtype: torch.dtype,
        keep_buffer: bool = True,
        views: bool | None = None,
        defer_copy: bool = False,
        pool: BufferPool | None = None,
    ) -> None:
        self.index = index
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.layout = layout
        self.grad_dtype = grad_dtype
        self.device = self.params[0].device
        self.keep_buffer = keep_buffer
        can_view = keep_buffer and all(p.dtype == grad_dtype for p in self.params)
        self.views = can_view if views is None else views and can_view
        self.defer_copy = defer_copy and not self.views and not keep_buffer
        self.pool = pool if not keep_buffer else None  # (a kept buffer lives for the run anyway)
        self.grad: torch.Tensor | None = None
        if self.views:
            self.copy_in()  # every .grad becomes its view of the buffer, for the whole run
        self.out: torch.Tensor | None = None  # where the collective leaves this rank's result
        self.reset()

    def _allocate(self) -> torch.Tensor:
        if self.grad is None:
            if self.pool is not None:
                self.grad = self.pool.acquire(self.layout.padded_numel).zero_()
            else:
                self.grad = torch.zeros(
                    self.layout.padded_numel, dtype=self.grad_dtype, device=self.device
                )
        return self.grad

    def grad_view(self, i: int) -> torch.Tensor:
        return self.layout.view(self._allocate(), i)

    def bind_grad(self, i: int) -> None:
        """Bring params[i]'s current gradient into the buffer (views: make .grad the view)."""
        p, view = self.params[i], self.grad_view(i)
        if self.views:
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        elif p.grad is not None:
            view.add_(p.grad)
            p.grad = None

    def copy_in(self) -> None:
        """Bring every parameter's gradient into the buffer (zeros where there is none)."""
        for i in range(len(self.params)):
            self.bind_grad(i)

    def release(self) -> None:
        """Free a copy-mode buffer (give it back to the pool) once no collective uses it: its
        collective is done, or only a later stage of a `StagedWork` runs (``input_done``)."""
        if not self.keep_buffer and self.grad is not None:
            if (
                self.pool is not None and self.work is not None and not self.input_done
            ):  # never finished (a backward raised): not reused
                self.pool.forget(self.grad)
            elif self.pool is not None:
                self.pool.release(self.grad)
            self.grad = None

    def reset(self) -> None:
        self.pending = len(self.params)  # gradients still missing in this backward
        self.launched = False
        self.work = None  # async handle of this step's collective
        self.input_done = False  # a StagedWork's first stage was waited: the full buffer is free
        self.touched = False  # a gradient arrived in the current backward


def make_grad_buckets(
    named_params: NamedParams,
    bucket_bytes: float,
    pad_to: int = 1,
    grad_dtype: torch.dtype | None = None,
    keep_buffer: bool = True,
) -> list[GradBucket]:
    """Buckets of `bucket_bytes` in reverse registration order, each with its own flat layout."""
    return [
        GradBucket(
            i, group, FlatLayout(group, pad_to), grad_dtype or group[0][1].dtype, keep_buffer
        )
        for i, group in enumerate(assign_buckets(named_params, bucket_bytes))
    ]


class BucketStrategy:
    """What a bucket's gradients go through, the one interface `BucketedGradReducer` calls (the ZeRO
    stages of `strategies`, DDP's all-reduce): each ``on_*`` method is an event of the reducer, a
    no-op unless the strategy needs it. ``max_inflight`` bounds the buckets launched and not yet
    finished (None: no bound)."""

    max_inflight: int | None = None

    def on_first_grad(self, bucket: GradBucket) -> None:
        """Before the bucket takes its first gradient of a backward (ZeRO-1 moves its reduced shard
        out)."""

    def on_all_grads(self, bucket: GradBucket) -> None:
        """Every gradient of the bucket exists, in any launch order (ZeRO-3 frees the unit's
        parameters)."""

    def on_launch_bucket(self, bucket: GradBucket) -> object:
        """Start the bucket's collective; returns its async work handle (or None)."""
        raise NotImplementedError

    def on_bucket_done(self, bucket: GradBucket) -> None:
        """The handle completed: keep the result (before the reducer releases the bucket's
        buffer)."""

    def on_backward_end(self) -> None:
        """A backward ended (after its buckets completed, or under no_sync)."""


class BucketedGradReducer:
    """Hooks gradients into buckets and launches each bucket's collective as soon as it is full;
    what a bucket does is the `strategy`'s."""

    def __init__(
        self,
        buckets: list[GradBucket],
        strategy: BucketStrategy,
        find_unused: bool = False,
    ) -> None:
        max_inflight = strategy.max_inflight
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(
                f"max_inflight={max_inflight}: at least one bucket must be allowed in flight "
                "(or None for no bound)"
            )
        self.strategy = strategy
        self.max_inflight = max_inflight
        self.find_unused = find_unused
        self.require_sync = True
        # (seq, event, name): grad_ready, completed
        self.trace: list[tuple[int, str, str]] | None = None
        self.trace_clock: Callable[[], int] | None = None
        self.unsynced = False  # gradients arrived under no_sync and have not been reduced yet
        self.buckets = buckets
        self._next_to_launch = 0
        self._next_to_complete = 0
        # launched buckets of this backward whose StagedWork's result is still to be waited
        self._awaiting: list[GradBucket] = []
        self._callback_queued = False
        self._task = -1  # autograd graph task of the backward whose end callback is queued
        self._ready: dict[int, bool] = {}  # id(param) -> ready in this backward
        self._arrived: dict[
            int, set[int]
        ] = {}  # no_sync: bucket index -> ids of params with a gradient this backward
        self._where: dict[int, tuple[GradBucket, int]] = {}
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, i)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket, i = self._where[id(p)]
        task = graph_task_id()
        if self._callback_queued and task != self._task:
            raise RuntimeError(
                f"gradient of '{bucket.names[i]}' arrived in a new backward, but the previous one "
                "never finished (it raised): some of its buckets were already reduced. Call "
                "zero_grad() before running backward again"
            )
        if not self._callback_queued:
            self._callback_queued = True
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if not bucket.touched:
            bucket.touched = True
            self.strategy.on_first_grad(bucket)
        if not (bucket.defer_copy and self.require_sync):
            bucket.bind_grad(i)  # else it waits in p.grad for the bucket's copy_in at launch
        if self.trace is not None:
            self.trace.append((self.trace_clock(), "grad_ready", bucket.names[i]))
        if not self.require_sync:
            self.unsynced = True
            self._arrived_unsynced(bucket, p)
            return
        if self._ready.get(id(p)):
            if bucket.launched:
                raise RuntimeError(
                    f"gradient of '{bucket.names[i]}' was accumulated again after its bucket's "
                    "collective was launched in this backward (reentrant checkpointing or a second "
                    "backward through the same graph); use non-reentrant checkpointing or no_sync()"
                )
            return
        self._ready[id(p)] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self.strategy.on_all_grads(bucket)
            self._launch_ready_buckets()

    def _arrived_unsynced(self, bucket: GradBucket, p: torch.Tensor) -> None:
        """Under no_sync nothing launches, but the owner still learns when every gradient of a
        bucket arrived in this backward (ZeRO-3 frees the unit's gathered parameters then, instead
        of holding every unit until it ends)."""
        arrived = self._arrived.setdefault(bucket.index, set())
        if id(p) not in arrived:
            arrived.add(id(p))
            if len(arrived) == len(bucket.params):
                self.strategy.on_all_grads(bucket)

    def _launch_ready_buckets(self) -> None:
        # Index order on every rank: collectives must be issued in the same order everywhere.
        while (
            self._next_to_launch < len(self.buckets)
            and self.buckets[self._next_to_launch].pending == 0
        ):
            bucket = self.buckets[self._next_to_launch]
            bucket.launched = True
            if bucket.defer_copy:
                bucket.copy_in()
            bucket.work = self.strategy.on_launch_bucket(bucket)
            self._next_to_launch += 1
            if self.max_inflight is not None:
                self._complete_through(self._next_to_launch - self.max_inflight)

    def _complete_through(self, end: int, final: bool = False) -> None:
        """Wait for, finish and release launched buckets with index < `end`, oldest first. A
        `StagedWork` is waited only through its first stage here and its buffer released; its
        bucket is finished when ``final`` (the end of backward): every staged bucket's first stage
        first, in bucket order, then each result in bucket order."""
        while self._next_to_complete < min(end, self._next_to_launch):
            bucket = self.buckets[self._next_to_complete]
            self._next_to_complete += 1
            if isinstance(bucket.work, StagedWork):
                bucket.work.wait_input()
                bucket.input_done = True
                bucket.release()  # the full buffer goes; the result's collective runs on
                self._awaiting.append(bucket)
            else:
                self._finish(bucket)
        if final:
            while self._awaiting:
                self._finish(self._awaiting.pop(0))

    def _finish(self, bucket: GradBucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        self.strategy.on_bucket_done(bucket)
        bucket.release()  # ZeRO-2/3: the full-size gradient buffer goes here, during backward
        if self.trace is not None:
            self.trace.append((self.trace_clock(), "completed", f"bucket{bucket.index}"))

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        self._arrived.clear()
        for bucket in self.buckets:
            bucket.touched = False
        if self.require_sync:
            self.flush()
        self.strategy.on_backward_end()

    @property
    def interrupted(self) -> bool:
        """A synchronising backward started and never finished (it raised): its gradients are partly
        reduced."""
        return bool(self._ready) or self._callback_queued

    def no_more_grads(self, bucket: GradBucket) -> None:
        """The owner knows the bucket's gradients of this backward are all in (ZeRO-3: unit done);
        with ``find_unused`` missing ones count as zero and the bucket launches now instead of
        holding later buckets back."""
        if not (self.require_sync and self.find_unused) or bucket.pending == 0:
            return
        for i, p in enumerate(bucket.params):
            if not self._ready.get(id(p)):
                self._ready[id(p)] = True
                if not bucket.defer_copy:
                    bucket.bind_grad(i)  # a zero gradient (deferred buckets take zeros at copy_in)
        bucket.pending = 0
        self.strategy.on_all_grads(bucket)
        self._launch_ready_buckets()

    def unready_names(self) -> list[str]:
        return [
            b.names[i]
            for b in self.buckets
            for i, p in enumerate(b.params)
            if not self._ready.get(id(p))
        ]

    def flush(self) -> None:
        """End of a synchronising backward: a missing gradient is an error (zero with find_unused);
        complete buckets."""
        missing = self.unready_names()
        if missing and not self.find_unused:
            raise RuntimeError(
                f"{len(missing)} parameter(s) received no gradient in this backward: "
                f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Every rank must "
                "reduce every bucket; freeze them (requires_grad=False), make them part of the "
                "loss, or pass find_unused=True to reduce a zero gradient for them"
            )
        self.sync_now()

    def sync_now(self) -> None:
        """Reduce what every parameter holds now, ready or not (after a pipeline's backwards ran
        under no_sync)."""
        for bucket in self.buckets[self._next_to_launch :]:
            if bucket.pending:
                self.strategy.on_all_grads(bucket)  # nothing more will arrive
            if (
                not bucket.defer_copy
            ):  # (deferred buckets take everything, zeros included, at copy_in)
                for i, p in enumerate(bucket.params):
                    if not self._ready.get(id(p)):
                        bucket.bind_grad(i)  # zero if it never had a gradient
            bucket.pending = 0
        self._launch_ready_buckets()
        self._complete_through(len(self.buckets), final=True)
        for bucket in self.buckets:
            bucket.reset()
        self._next_to_launch = 0
        self._next_to_complete = 0
        self._ready.clear()
        self.unsynced = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Hooks still fill the buckets; nothing is reduced until the next synchronising backward
        (or `sync_now`)."""
        previous = self.require_sync
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = previous

    def zero_grad(self) -> None:
        """Zero every bucket (in place where kept; views survive) and forget a half-done backward
        that raised."""
        for bucket in self.buckets:
            if bucket.keep_buffer and bucket.grad is not None:
                bucket.grad.zero_()
            else:
                bucket.release()
            for i, p in enumerate(bucket.params):
                if bucket.views:
                    bucket.bind_grad(i)
                else:
                    p.grad = None
            bucket.reset()
        self._ready.clear()
        self._arrived.clear()
        self._next_to_launch = 0
        self._next_to_complete = 0
        self._awaiting.clear()
        self._callback_queued = False
        self.unsynced = False
