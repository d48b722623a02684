"""Measured model-state memory of one rank (parameters 2Ψ, gradients 2Ψ, optimizer KΨ, K = 12),
counting each *unique storage* once (a gradient viewing a bucket counts it, padding included) to
check the formulas of docs/design.md#model-state-memory:
`model_state_bytes` asks an engine at one moment; `PeakSampler` trusts no self-report and walks what
is reachable; `block_activation_bytes` follows what blocks allocate in a forward and keep
(docs/design.md#activation-memory). Besides the three model states an engine may report ``buffers``
(ZeRO-R's constant communication buffers: pools and gather slots, counted there whoever borrows
them) and which of its storages live on the host (``host``: ZeRO-Offload's masters, optimizer state
and host gradient copies), so ``device`` = what the accelerator holds."""

from __future__ import annotations

import gc
import os
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int
    # constant communication buffers (pools, gather slots), not model states but held for the run
    buffers: int = 0
    host: int = 0  # bytes of all the above that live in host memory (offloaded)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers

    @property
    def device(self) -> int:
        """What the compute device holds (everything when nothing is offloaded)."""
        return self.total - self.host


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


def model_state_bytes(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra_params: Iterable[torch.Tensor] = (),
) -> ModelStateBytes:
    """Unique storage bytes of parameters (+ `extra_params` the model does not expose), gradients,
    optimizer state."""
    seen: set[tuple[str, int]] = set()
    if hasattr(model, "model_state_tensors"):  # ZeRO engines know what they hold (shards, buffers)
        held = model.model_state_tensors()
        # pooled buffers first: a gradient bucket borrowing one counts there, not as a gradient, so
        # the split does not depend on the moment
        buffers = _storage_bytes(held.get("buffers", ()), seen)
        host = _storage_bytes(held.get("host", ()), set())
        return ModelStateBytes(
            _storage_bytes(held["params"], seen),
            _storage_bytes(held["grads"], seen),
            _storage_bytes(held["optimizer"], seen),
            buffers,
            host,
        )
    params = list(model.parameters())
    p_bytes = _storage_bytes([*params, *extra_params], seen)
    g_bytes = _storage_bytes((p.grad for p in params), seen)
    o_bytes = 0
    if optimizer is not None:
        state_tensors = [
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        o_bytes = _storage_bytes(
            [*owned, *state_tensors], seen
        )  # its own params (fp32 masters) count here
    return ModelStateBytes(p_bytes, g_bytes, o_bytes)


class _NewStorages(TorchDispatchMode):
    """Every storage an operator on this thread allocates while a block is open (an output sharing
    no input's storage), attributed to that block, held by a weak reference: alive later means
    something kept it."""

    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.current: int | None = None
        self.made: list[list[tuple[int, int]]] = [
            [] for _ in range(n_blocks)
        ]  # per block: (weak ref, bytes)
        self._handles: dict[int, int] = {}  # data_ptr -> weak ref of the storage last seen there

    def _is_new(self, storage: torch.UntypedStorage) -> bool:
        ptr = storage.data_ptr()
        handle = self._handles.get(ptr)
        return ptr != 0 and (handle is None or torch.UntypedStorage._expired(handle))

    # torch's protocol: its arguments stay untyped
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.current is not None:
            inputs = {
                t.untyped_storage().data_ptr()
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and _has_data(t)
            }
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and _has_data(t):
                    storage = t.untyped_storage()
                    if storage.data_ptr() not in inputs and self._is_new(storage):
                        handle = storage._weak_ref()
                        self._handles[storage.data_ptr()] = handle
                        self.made[self.current].append((handle, storage.nbytes()))
        return out

    def alive_bytes(self) -> list[int]:
        return [
            sum(n for h, n in made if not torch.UntypedStorage._expired(h)) for made in self.made
        ]

    def release(self) -> None:
        for handle in {h for made in self.made for h, _ in made}:
            torch.UntypedStorage._free_weak_ref(handle)


def block_activation_bytes(modules: Iterable[nn.Module], run: Callable[[], Any]) -> list[int]:
    """Bytes of the storages each of `modules` (transformer blocks) allocated during ``run()`` — a
    forward — that are still alive when it returns (keep its result alive in it: return it): what
    each block keeps for backward, its output included where the next block keeps it. Seen by a
    dispatch mode, through weak references to the storages: nothing is trusted from the model; other
    threads' allocations (gloo's) and storages that the block frees, or that die after it (a 16-bit
    block's output, once the next block kept its fp32 copy), do not count. For tests and benchmarks:
    `formulas.activation_bytes_per_block` predicts it."""
    modules = list(modules)
    tracker = _NewStorages(len(modules))
    handles = []
    for i, m in enumerate(modules):

        def enter(module: nn.Module, args: Any, i: int = i) -> None:
            tracker.current = i

        def leave(module: nn.Module, args: Any, out: Any) -> None:
            tracker.current = None

        # after the module's other pre-hooks (a ZeRO-3 gather is not the block's), before its other
        # post-hooks (a ZeRO-3 free is not either)
        handles += [
            m.register_forward_pre_hook(enter),
            m.register_forward_hook(leave, prepend=True),
        ]
    try:
        with tracker:
            result = run()
        # a backend's worker thread may hold a collective's tensor a moment after the call returned
        # (gloo): wait until three readings 50 ms apart agree
        readings = [tracker.alive_bytes()]
        while len(readings) < 40 and not (
            len(readings) >= 3 and readings[-1] == readings[-2] == readings[-3]
        ):
            time.sleep(0.05)
            readings.append(tracker.alive_bytes())
        alive = readings[-1]
        del result
    finally:
        tracker.release()
        for h in handles:
            h.remove()
    return alive


def peak_activation_bytes(modules: Iterable[nn.Module], run: Callable[[], Any]) -> int:
    """The most bytes alive at once, read each time one of `modules` (pipeline stages) finishes a
    forward during ``run()`` (a pipeline step: forwards and backwards interleaved), of the storages
    those forwards allocated: the activations the micro-batches in flight keep. Seen as
    `block_activation_bytes` sees them; what a backward allocates (gradient buffers, activation
    gradients) is not counted."""
    modules = list(modules)
    tracker = _NewStorages(1)
    peak = [0]
    handles = []
    for m in modules:

        def enter(module: nn.Module, args: Any) -> None:
            tracker.current = 0

        def leave(module: nn.Module, args: Any, out: Any) -> None:
            tracker.current = None
            peak[0] = max(peak[0], tracker.alive_bytes()[0])

        handles += [
            m.register_forward_pre_hook(enter),
            m.register_forward_hook(leave, prepend=True),
        ]
    try:
        with tracker:
            run()
    finally:
        tracker.release()
        for h in handles:
            h.remove()
    return peak[0]


# Not followed by the walk: classes and modules (their globals are the whole process), code.
_OPAQUE = (type, types.ModuleType, types.CodeType, types.FrameType)


def _reachable_tensors(roots: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Tensors reachable from `roots` (containers, closures, ``.grad``, ``._base``, DTensor shards,
    not globals)."""
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
            stack += [
                obj.grad if obj.is_leaf else None,
                obj._base,
                getattr(obj, "_local_tensor", None),
            ]
        if isinstance(obj, types.FunctionType):
            # a cell's referent is its contents (none when empty)
            stack += [
                *gc.get_referents(*(obj.__closure__ or ())),
                *(obj.__defaults__ or ()),
                *(obj.__kwdefaults__ or {}).values(),
            ]
        elif isinstance(obj, types.MethodType):
            stack += [obj.__self__, obj.__func__]
        else:
            stack += gc.get_referents(obj)


def _has_data(t: torch.Tensor) -> bool:
    """False for wrapper subclasses without storage of their own (a DTensor: its local shard
    counts)."""
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def reachable_storage_bytes(roots: Iterable[Any], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the unique storages reachable from `roots`, except `exclude`'s (e.g. the model's
    constant buffers)."""
    seen: set[tuple[str, int]] = {(str(t.device), t.untyped_storage().data_ptr()) for t in exclude}
    return _storage_bytes(_reachable_tensors(roots), seen)


# torch wraps __torch_dispatch__ (dynamo-disabled); those frames hold the operator's arguments.
_DISPATCH_WRAPPERS = (
    os.path.join("torch", "_compile.py"),
    os.path.join("torch", "_dynamo", "eval_frame.py"),
)


class PeakSampler(TorchDispatchMode):
    """Peak `reachable_storage_bytes` over a region, sampled after each dispatched operator and on
    exit; slow, for tests and one benchmark step.
    ``with PeakSampler([engine, optimizer], exclude=model.buffers()) as s: ...``. ``frames=True``
    adds the region's frame locals as roots: a buffer held only in a local while being filled (a
    reduce-scatter input) counts, and so, a small overcount, does an activation gradient handed to a
    hook."""

    def __init__(
        self,
        roots: Iterable[Any],
        exclude: Iterable[torch.Tensor] = (),
        frames: bool = True,
        allocations: bool = False,
    ) -> None:
        super().__init__()
        self.roots = list(roots)
        self.exclude = list(exclude)
        self.frames = frames
        # ``allocations``: also every storage an operator of the region allocated on this thread
        # while it is alive, reachable or not (autograd's saved tensors are not reachable from
        # Python): the whole of what the region holds
        self._made: dict[int, tuple[int, int]] | None = (
            {} if allocations else None
        )  # data_ptr -> (weak ref, bytes)
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
        seen: set[tuple[str, int]] = {
            (str(t.device), t.untyped_storage().data_ptr()) for t in self.exclude
        }
        value = _storage_bytes(_reachable_tensors(roots), seen)
        if self._made is not None:
            reached = {ptr for _, ptr in seen}
            for ptr, (handle, nbytes) in list(self._made.items()):
                if torch.UntypedStorage._expired(handle):
                    torch.UntypedStorage._free_weak_ref(handle)
                    del self._made[ptr]
                elif ptr not in reached:
                    value += nbytes
        self.peak = max(self.peak, value)
        self.samples += 1
        return value

    def mark(self, label: str) -> None:
        """A labelled sample of the roots alone (called from a hook: its arguments are
        activations)."""
        self.marks.append((label, self.sample()))

    # torch's protocol: its arguments stay untyped
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._made is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and _has_data(t):
                    storage = t.untyped_storage()
                    ptr = storage.data_ptr()
                    known = self._made.get(ptr)
                    if ptr and (known is None or torch.UntypedStorage._expired(known[0])):
                        if known is not None:
                            torch.UntypedStorage._free_weak_ref(known[0])
                        self._made[ptr] = (storage._weak_ref(), storage.nbytes())
        caller = sys._getframe(1)
        while caller is not None and caller.f_code.co_filename.endswith(_DISPATCH_WRAPPERS):
            caller = caller.f_back
        self.sample(caller)
        return out

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        # what the region left behind (e.g. a gradient autograd assigned without an operator)
        self.sample()
        for handle, _ in (self._made or {}).values():
            torch.UntypedStorage._free_weak_ref(handle)
        self._made = {} if self._made is not None else None
