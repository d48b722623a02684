"""Measured model-state memory of one rank: parameters, gradients, optimizer state.

Seed 001 (ZeRO paper, memory accounting): model states are parameters (2Ψ in 16-bit),
gradients (2Ψ) and optimizer state (KΨ, K = 12 for mixed-precision Adam). This module
measures what a rank actually holds by counting each *unique storage* once (a gradient that
is a view of a flat bucket counts the bucket, padding included; a tied weight counts once),
so tests can compare measurement with the formulas of DESIGN.md.

Two ways to measure:
- `model_state_bytes`: what an engine says it holds (its ``model_state_tensors``), or a plain
  module's parameters, gradients and optimizer state — at one moment, e.g. after backward;
- `reachable_storage_bytes` + `PeakSampler`: every storage reachable through Python references
  from the training objects (wrapper, optimizer), not trusting any self-report, sampled after
  every operator while a region (a backward) runs — the peak that decides whether a model fits.
  Works on fivefold's engines and torch's (DDP, ZeroRedundancyOptimizer, FSDP2) alike.
"""

from __future__ import annotations

import gc
import os
import sys
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_mb(self) -> dict[str, float]:
        return {k: v / 2**20 for k, v in
                (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer), ("total", self.total))}


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                      extra_params: Iterable[torch.Tensor] = ()) -> ModelStateBytes:
    """Bytes of unique storages held for parameters, gradients and optimizer state.

    `extra_params` are parameter storages the model does not expose (e.g. fp32 master shards
    kept by a sharded optimizer count as optimizer state instead: pass them via the optimizer).
    """
    seen: set[tuple[str, int]] = set()
    if hasattr(model, "model_state_tensors"):  # ZeRO engines know what they hold (shards, buffers)
        held = model.model_state_tensors()
        return ModelStateBytes(_storage_bytes(held["params"], seen), _storage_bytes(held["grads"], seen),
                               _storage_bytes(held["optimizer"], seen))
    params = list(model.parameters())
    p_bytes = _storage_bytes([*params, *extra_params], seen)
    g_bytes = _storage_bytes((p.grad for p in params), seen)
    o_bytes = 0
    if optimizer is not None:
        state_tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        # Parameters owned by the optimizer but not by the model (fp32 masters) are optimizer state.
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        o_bytes = _storage_bytes([*owned, *state_tensors], seen)
        # A scalar `step` tensor per parameter is bookkeeping, not model state, but it is real
        # memory too: it is counted, and is negligible (4-8 bytes).
    return ModelStateBytes(p_bytes, g_bytes, o_bytes)


# Not followed by the walk: classes and modules (their globals are the whole process), code.
_OPAQUE = (type, types.ModuleType, types.CodeType, types.FrameType)


def _reachable_tensors(roots: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `roots` through Python references: attributes, containers,
    closures and bound methods (hooks), a tensor's ``.grad``, ``._base`` and a DTensor's local
    shard. Functions are followed through their closures and defaults, never their globals."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if _has_data(obj):
                yield obj
            stack += [obj.grad if obj.is_leaf else None, obj._base, getattr(obj, "_local_tensor", None)]
        if isinstance(obj, types.FunctionType):
            stack += [*(c.cell_contents for c in obj.__closure__ or () if _cell_full(c)),
                      *(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()]
        elif isinstance(obj, types.MethodType):
            stack += [obj.__self__, obj.__func__]
        else:
            stack += gc.get_referents(obj)


def _has_data(t: torch.Tensor) -> bool:
    """False for wrapper subclasses without storage of their own (a DTensor: its local shard counts)."""
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _cell_full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def reachable_storage_bytes(roots: Iterable[Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the unique non-empty storages of every tensor reachable from `roots` (see
    `_reachable_tensors`), except those of `exclude` (e.g. the model's constant buffers)."""
    seen: set[tuple[str, int]] = {(str(t.device), t.untyped_storage().data_ptr()) for t in exclude}
    return _storage_bytes(_reachable_tensors(roots), seen)


# torch wraps __torch_dispatch__ (dynamo-disabled); those frames hold the operator's arguments.
_DISPATCH_WRAPPERS = (os.path.join("torch", "_compile.py"), os.path.join("torch", "_dynamo", "eval_frame.py"))


class PeakSampler(TorchDispatchMode):
    """The peak of `reachable_storage_bytes` while a region (a backward) runs: sampled after every
    operator dispatched in it (backward ops, hooks' ops, collectives) and once on exit.

    ``with PeakSampler([engine, optimizer], exclude=model.buffers()) as s: loss.backward()``, then
    ``s.peak``. With ``frames=True`` the local variables of the Python frames running inside the
    region count as roots too, so a buffer that code holds only in a local while it works (e.g. a
    reduce-scatter input being filled) is seen; so is an activation gradient a hook was handed, a
    small overcount. `mark(label)` records a labelled sample of the roots in `marks`. Slow (one walk per
    operator): for tests and one benchmark step.
    """

    def __init__(self, roots: Iterable[Any], exclude: Iterable[torch.Tensor] = (), frames: bool = True) -> None:
        super().__init__()
        self.roots = list(roots)
        self.exclude = list(exclude)
        self.frames = frames
        self.peak = 0
        self.samples = 0
        self.marks: list[tuple[str, int]] = []
        self._outer: set[int] = set()

    def __enter__(self) -> PeakSampler:
        self._outer = set()  # the peak accumulates over regions; the frames are this region's
        frame = sys._getframe(1)
        while frame is not None:  # frames outside the region: their locals are not the engine's
            self._outer.add(id(frame))
            frame = frame.f_back
        return super().__enter__()

    def sample(self, caller: types.FrameType | None = None) -> int:
        roots = list(self.roots)
        frame = caller if self.frames else None
        while frame is not None and id(frame) not in self._outer:
            roots += frame.f_locals.values()
            frame = frame.f_back
        value = reachable_storage_bytes(roots, self.exclude)
        self.peak = max(self.peak, value)
        self.samples += 1
        return value

    def mark(self, label: str) -> None:
        """A labelled sample of the roots alone (called from a hook: its arguments are activations)."""
        self.marks.append((label, self.sample()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        out = func(*args, **(kwargs or {}))
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename.endswith(_DISPATCH_WRAPPERS):
            caller = caller.f_back
        self.sample(caller)
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.sample()  # what the region left behind (e.g. a gradient autograd assigned without an operator)
