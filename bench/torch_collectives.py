"""Counting the collectives of torch's own implementations (fivefold's are in its `CommLog`).

Three techniques, each used only around the contestant's own work:

- torch DDP: `counting_allreduce_hook`, a comm hook that counts each bucket's ``buffer()`` and then
  runs torch's default ``allreduce_hook`` (divide by N, all-reduce — the built-in arithmetic);
- ZeroRedundancyOptimizer, FSDP2: `counting_dist_calls` replaces ``torch.distributed.<op>`` by a
  counting wrapper while a block runs (ZeroRedundancyOptimizer broadcasts every parameter from the
  rank owning it; FSDP2's default collectives call ``all_gather_single`` / ``reduce_scatter_single``,
  older torch ``all_gather_into_tensor`` / ``reduce_scatter_tensor``);
- DTensor TP: `byte_counting_mode`, a ``CommDebugMode`` that also sums the payload of each
  functional collective (all-reduce: the buffer, all-gather: the gathered output, reduce-scatter:
  the full input).

Payload is counted per rank; the ring-wire bytes follow from `fivefold.formulas.ring_wire_bytes`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from bench.harness import CommBytes

__all__ = ["OpCounter", "byte_counting_mode", "counting_allreduce_hook", "counting_dist_calls"]


class OpCounter:
    """Per-op collective counts (calls, payload bytes) of a torch contestant."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.ops: dict[str, list[int]] = {}

    def reset(self) -> None:
        self.ops = {}

    def add(self, op: str, tensor: torch.Tensor) -> None:
        c = self.ops.setdefault(op, [0, 0])
        c[0] += 1
        c[1] += tensor.numel() * tensor.element_size()

    def totals(self) -> CommBytes:
        return CommBytes.from_ops({op: (c, b) for op, (c, b) in self.ops.items()}, self.world)


def counting_allreduce_hook(state, bucket):  # unannotated: torch checks hook annotations literally
    """Count ``bucket``'s bytes (a `dist.GradBucket`) in ``state`` (an `OpCounter`), then run torch's
    default all-reduce hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state.add("all_reduce", bucket.buffer())
    return default_hooks.allreduce_hook(None, bucket)


# torch.distributed attribute -> (op, index and keyword of the tensor that is the payload)
_PATCHABLE = {
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),  # torch >= 2.13
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),  # torch >= 2.13
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
}


def _counting_wrapper(fn: Callable, counter: OpCounter, op: str, arg: int, kwarg: str) -> Callable:
    """`fn` that first counts the tensor passed as positional ``arg`` or keyword ``kwarg``."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counter.add(op, kwargs[kwarg] if kwarg in kwargs else args[arg])
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def counting_dist_calls(counter: OpCounter, *attrs: str) -> Iterator[None]:
    """Count calls of ``torch.distributed.<attr>`` (those present; keys of ``_PATCHABLE``) while the block runs.

    Only the package attributes are replaced: torch's own code that calls them as ``dist.<attr>``
    (FSDP2's collectives, ZeroRedundancyOptimizer) is counted; fivefold's `Comm` bound its
    functions at import and is not. The deprecated names call the new ones inside c10d, not
    through the package, so nothing is counted twice.
    """
    saved = {a: getattr(dist, a) for a in attrs if hasattr(dist, a)}
    for a, fn in saved.items():
        setattr(dist, a, _counting_wrapper(fn, counter, *_PATCHABLE[a]))
    try:
        yield
    finally:
        for a, fn in saved.items():
            setattr(dist, a, fn)


def _funcol_payloads() -> dict[Any, tuple[str, Callable[..., int]]]:
    """Functional collective -> (op, payload bytes from its arguments)."""
    ops = torch.ops._c10d_functional

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def tensors(x: Any) -> list[torch.Tensor]:
        return list(x) if isinstance(x, list | tuple) else [x]

    return {
        ops.all_reduce: ("all_reduce", lambda a: nbytes(a[0])),
        ops.all_reduce_coalesced: ("all_reduce", lambda a: sum(map(nbytes, tensors(a[0])))),
        ops.all_gather_into_tensor: ("all_gather", lambda a: nbytes(a[0]) * a[1]),
        ops.all_gather_into_tensor_coalesced: ("all_gather", lambda a: sum(map(nbytes, tensors(a[0]))) * a[1]),
        ops.reduce_scatter_tensor: ("reduce_scatter", lambda a: nbytes(a[0])),
        ops.reduce_scatter_tensor_coalesced: ("reduce_scatter", lambda a: sum(map(nbytes, tensors(a[0])))),
        ops.all_to_all_single: ("all_to_all", lambda a: nbytes(a[0])),
        ops.broadcast: ("broadcast", lambda a: nbytes(a[0])),
    }


def byte_counting_mode() -> Any:
    """A `CommDebugMode` that also sums, in ``by_op`` (op -> [calls, payload bytes]), the payload of every
    functional collective dispatched while it is active."""
    from torch.distributed.tensor.debug import CommDebugMode

    payloads = _funcol_payloads()

    class ByteCountingCommMode(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.by_op: dict[str, list[int]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented:
                entry = payloads.get(getattr(func, "_overloadpacket", None))
                if entry is not None:
                    c = self.by_op.setdefault(entry[0], [0, 0])
                    c[0] += 1
                    c[1] += entry[1](args)
            return out

    return ByteCountingCommMode()
