"""Flat padded buffers and the bucketed gradient reducer: the one implementation behind DDP and ZeRO.

Seed 000 (DP): instead of one all-reduce per parameter after backward, gradients are grouped
into buckets; a post-accumulate-grad hook marks a parameter ready and the bucket's collective is
launched asynchronously the moment its last gradient arrives, overlapping the rest of backward.

- `FlatLayout` places tensors back to back in one 1-D buffer padded to a multiple of ``pad_to``
  (ZeRO pads to the DP degree so every rank owns an equal contiguous shard).
- `assign_buckets` groups parameters into buckets of at most ``bucket_bytes`` (one parameter may
  exceed it alone) in *reverse registration order*, the order in which backward produces them.
- `BucketedGradReducer` points each ``param.grad`` at a view of its bucket's flat buffer (no second
  copy of the gradients), tracks readiness per step, launches buckets in index order (every rank
  issues the same collectives in the same order), and at backward's end flushes what is left and
  waits. *What* a bucket's collective is — all-reduce (DDP) or reduce-scatter (ZeRO-1/2) — is a
  strategy passed in, so the bookkeeping exists once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

NamedParams = Sequence[tuple[str, nn.Parameter]]


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives inside a flat buffer."""

    name: str
    offset: int
    numel: int
    shape: torch.Size


class FlatLayout:
    """Offsets of several tensors packed contiguously, total padded to a multiple of `pad_to`."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], pad_to: int = 1) -> None:
        self.slots: list[Slot] = []
        offset = 0
        for name, t in named:
            self.slots.append(Slot(name, offset, t.numel(), t.shape))
            offset += t.numel()
        self.numel = offset
        self.pad_to = pad_to
        self.padded_numel = -(-offset // pad_to) * pad_to

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        s = self.slots[i]
        return flat[s.offset:s.offset + s.numel].view(s.shape)

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """[start, end) of `rank`'s equal contiguous shard (requires pad_to % world == 0)."""
        if self.padded_numel % world:
            raise ValueError(f"flat buffer of {self.padded_numel} elements cannot be split evenly "
                             f"over {world} ranks (pad_to={self.pad_to})")
        size = self.padded_numel // world
        return rank * size, (rank + 1) * size


def assign_buckets(named_params: NamedParams, bucket_bytes: float) -> list[list[tuple[str, nn.Parameter]]]:
    """Split trainable parameters into buckets in reverse registration order.

    A bucket is closed once it holds at least `bucket_bytes`; parameters of a different dtype or
    device start a new bucket (one flat buffer has one dtype).
    """
    buckets: list[list[tuple[str, nn.Parameter]]] = []
    current: list[tuple[str, nn.Parameter]] = []
    size = 0
    for name, p in reversed(list(named_params)):
        if not p.requires_grad:
            continue
        if current and (p.dtype != current[0][1].dtype or p.device != current[0][1].device):
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class GradBucket:
    """One bucket: its parameters, the flat gradient buffer they view into, and readiness."""

    def __init__(self, index: int, named_params: NamedParams, pad_to: int, grad_dtype: torch.dtype | None) -> None:
        self.index = index
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.layout = FlatLayout(named_params, pad_to)
        first = self.params[0]
        self.grad = torch.zeros(self.layout.padded_numel, dtype=grad_dtype or first.dtype, device=first.device)
        self.pending = len(self.params)
        self.launched = False
        self.work = None  # async handle of this step's collective

    def grad_view(self, i: int) -> torch.Tensor:
        return self.layout.view(self.grad, i)

    def bind_grad(self, i: int) -> None:
        """Make params[i].grad the bucket view, keeping whatever gradient it currently holds."""
        p, view = self.params[i], self.grad_view(i)
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def reset(self) -> None:
        self.pending = len(self.params)
        self.launched = False
        self.work = None


# launch(bucket) -> async work handle (or None); finish(bucket) runs after the handle completed.
LaunchFn = Callable[[GradBucket], object]
FinishFn = Callable[[GradBucket], None]


class BucketedGradReducer:
    """Hooks gradients into buckets and launches each bucket's collective as soon as it is full."""

    def __init__(self, named_params: NamedParams, bucket_bytes: float, launch: LaunchFn,
                 finish: FinishFn | None = None, pad_to: int = 1, find_unused: bool = False,
                 grad_dtype: torch.dtype | None = None) -> None:
        self.launch_fn = launch
        self.finish_fn = finish
        self.find_unused = find_unused
        self.require_sync = True
        self.trace: list[tuple[int, str, str]] | None = None  # (seq, event, name) for overlap tests
        self.trace_clock: Callable[[], int] | None = None
        self.buckets = [GradBucket(i, group, pad_to, grad_dtype)
                        for i, group in enumerate(assign_buckets(named_params, bucket_bytes))]
        self._next_to_launch = 0
        self._callback_queued = False
        self._ready: dict[int, bool] = {}  # id(param) -> ready in this backward
        self._where: dict[int, tuple[GradBucket, int]] = {}
        self._hooks = []
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, i)
                bucket.bind_grad(i)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # -- hooks -------------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket, i = self._where[id(p)]
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        bucket.bind_grad(i)
        if self.trace is not None:
            self.trace.append((self.trace_clock(), "grad_ready", bucket.names[i]))
        if not self.require_sync:
            return
        if self._ready.get(id(p)):
            if bucket.launched:
                raise RuntimeError(
                    f"gradient of '{bucket.names[i]}' was accumulated again after its bucket's "
                    "collective was launched in this backward (reentrant checkpointing or a second "
                    "backward through the same graph); use non-reentrant checkpointing or no_sync()")
            return
        self._ready[id(p)] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        # Index order on every rank: collectives must be issued in the same order everywhere.
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].pending == 0:
            bucket = self.buckets[self._next_to_launch]
            bucket.launched = True
            bucket.work = self.launch_fn(bucket)
            self._next_to_launch += 1

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        if not self.require_sync:
            return
        self.flush()

    # -- public ------------------------------------------------------------------------------
    def unready_names(self) -> list[str]:
        return [b.names[i] for b in self.buckets for i, p in enumerate(b.params) if not self._ready.get(id(p))]

    def flush(self) -> None:
        """Launch what is left (unused parameters), wait for every bucket, then finish them."""
        missing = self.unready_names()
        if missing:
            if not self.find_unused:
                raise RuntimeError(
                    f"{len(missing)} parameter(s) received no gradient in this backward: "
                    f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}. Every rank must "
                    "all-reduce every bucket; freeze them (requires_grad=False), make them "
                    "part of the loss, or pass find_unused=True to reduce a zero gradient for them")
            for bucket in self.buckets[self._next_to_launch:]:
                for i, p in enumerate(bucket.params):
                    if not self._ready.get(id(p)):
                        bucket.bind_grad(i)  # zero if it never had a gradient
                bucket.pending = 0
            self._launch_ready_buckets()
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            if self.finish_fn is not None:
                self.finish_fn(bucket)
            bucket.reset()
        self._next_to_launch = 0
        self._ready.clear()

    def zero_grad(self) -> None:
        """Zero every bucket in place and re-point `.grad` at the views (cheaper than set_to_none)."""
        for bucket in self.buckets:
            bucket.grad.zero_()
            for i, p in enumerate(bucket.params):
                p.grad = bucket.grad_view(i)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
