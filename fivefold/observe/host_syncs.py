"""A host-sync detector (docs/gpus.md#no-host-sync-in-a-step): counts the calls that make the host
wait for an accelerator, on a machine without one — for the tests and `bench/host_syncs.py`.

On CUDA these block the host until the device has caught up: `Tensor.item/tolist/cpu/numpy`,
`bool(t)`, `int(t)`/`float(t)`, a device-to-host copy, `torch.tensor(data, device=cuda)` and
`torch.as_tensor` (a blocking host-to-device copy that no dispatch mode sees: the copy happens
inside the factory), `.to(cuda)` of host memory without ``non_blocking``, the data-dependent
shapes (`nonzero`, `bincount`, `repeat_interleave` of a tensor without ``output_size``), and
`torch.cuda.synchronize` / `torch.accelerator.synchronize`. `HostSyncs` patches the Python entry
points for the time of a ``with`` block and adds a dispatch mode for what reaches aten another way
(`int(t)`, a copy into host memory); a call is counted once, where it was made.

``devices`` names the device types that play the accelerator. On ``meta`` (the usual stand-in:
shapes, no storage) a counted call answers with a placeholder so the run goes on: 0 for a scalar
and a list's entries, `False` for a truth value (nothing found, nothing to skip). With
``devices=("cpu",)`` it counts on the CPU path with real values, for code that cannot run on meta
(an MoE layer's split sizes): there a `torch.tensor` made with an explicit ``device="cpu"`` counts
too, as the detector cannot tell a host tensor from one standing in for the device's."""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncs"]

_aten = torch.ops.aten
_active: list[HostSyncs] = []
_local = threading.local()  # depth of counted calls on this thread: what they call inside is theirs


def _inside() -> int:
    return getattr(_local, "depth", 0)


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    """The target device of a ``.to(...)`` call, if it names one."""
    for a in (kwargs.get("device"), *args):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (torch.device, str)) and not isinstance(a, torch.dtype):
            try:
                return torch.device(a)
            except (RuntimeError, TypeError):
                continue
        if isinstance(a, int) and not isinstance(a, bool):
            return torch.device("cuda", a)
    return None


def _scalar(t: torch.Tensor) -> Any:
    return 0.0 if t.dtype.is_floating_point else (False if t.dtype == torch.bool else 0)


def _zeros_like_list(t: torch.Tensor) -> Any:
    out: Any = _scalar(t)
    for n in reversed(t.shape):
        out = [out] * n if not isinstance(out, list) else [list(out) for _ in range(n)]
    return out


class HostSyncs:
    """``with HostSyncs(devices=("meta",)) as syncs:`` — ``syncs.count``, ``syncs.where`` (each
    call's op and the few frames that made it)."""

    def __init__(self, devices: Iterable[str] = ("meta",)) -> None:
        self.devices = frozenset(devices)
        self.where: list[str] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _DispatchCounter | None = None

    @property
    def count(self) -> int:
        return len(self.where)

    def counted(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type in self.devices

    @property
    def placeholders(self) -> bool:
        return "meta" in self.devices

    def note(self, what: str) -> None:
        stack = [f for f in traceback.extract_stack() if f.filename != __file__]
        self.where.append(f"{what}:\n" + "".join(traceback.format_list(stack[-4:])))

    # -- patching ----------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def _counting(
        self, name: str, synced: Callable[..., bool], placeholder: Callable[..., Any] | None = None
    ) -> Callable[[Any], Any]:
        """A wrapper of ``name`` that counts a call for which ``synced(*args, **kwargs)`` holds; on
        meta it answers ``placeholder(*args, **kwargs)`` instead of calling through."""

        def make(original: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if _inside() or not synced(*args, **kwargs):
                    return original(*args, **kwargs)
                self.note(name)
                _local.depth = _inside() + 1
                try:
                    if self.placeholders and placeholder is not None:
                        return placeholder(*args, **kwargs)
                    return original(*args, **kwargs)
                finally:
                    _local.depth -= 1

            return wrapper

        return make

    def __enter__(self) -> HostSyncs:
        T, c = torch.Tensor, self.counted

        def on_device(t: Any, *a: Any, **k: Any) -> bool:
            return c(t)

        for name, placeholder in (
            ("item", _scalar),
            ("tolist", _zeros_like_list),
            ("__bool__", lambda t: False),
            ("cpu", lambda t, *a, **k: torch.zeros(t.shape, dtype=t.dtype)),
            ("numpy", lambda t, *a, **k: torch.zeros(t.shape, dtype=t.dtype).numpy()),
        ):
            self._patch(T, name, self._counting(f"Tensor.{name}", on_device, placeholder))

        def data_dependent(t: Any, *a: Any, **k: Any) -> bool:
            return c(t)

        def repeats_unsized(t: Any, repeats: Any = None, *a: Any, **k: Any) -> bool:
            sized = k.get("output_size") is not None or (len(a) >= 2 and a[1] is not None)
            return c(t) and isinstance(repeats, torch.Tensor) and repeats.dim() > 0 and not sized

        def repeat_each_once(t: torch.Tensor, repeats: torch.Tensor, *a: Any, **k: Any) -> Any:
            k["output_size"] = repeats.shape[0]  # (on meta the repeats have no values)
            return torch.repeat_interleave(t, repeats, *a[:1], **k)

        for owner, prefix in ((T, "Tensor"), (torch, "torch")):
            self._patch(owner, "nonzero", self._counting(f"{prefix}.nonzero", data_dependent))
            self._patch(owner, "bincount", self._counting(f"{prefix}.bincount", data_dependent))
            self._patch(
                owner,
                "repeat_interleave",
                self._counting(f"{prefix}.repeat_interleave", repeats_unsized, repeat_each_once),
            )

        def to_device(t: Any, *a: Any, **k: Any) -> bool:
            target = _device_of(a, k)
            return (
                isinstance(t, torch.Tensor)
                and t.device.type == "cpu"
                and target is not None
                and target.type != "cpu"
                and target.type in self.devices
                and not k.get("non_blocking", False)
            )

        self._patch(T, "to", self._counting("Tensor.to(host -> device)", to_device))

        def factory_on_device(data: Any, *a: Any, **k: Any) -> bool:
            device = k.get("device")
            if device is None or (isinstance(data, torch.Tensor) and data.device.type != "cpu"):
                return False
            return torch.device(device).type in self.devices

        for name in ("tensor", "as_tensor"):
            self._patch(
                torch, name, self._counting(f"torch.{name}(..., device=)", factory_on_device)
            )
        for owner in (torch.cuda, torch.accelerator):
            self._patch(
                owner,
                "synchronize",
                self._counting(
                    f"{owner.__name__}.synchronize", lambda *a, **k: True, lambda *a, **k: None
                ),
            )
        self._mode = _DispatchCounter(self)
        self._mode.__enter__()
        _active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        _active.remove(self)
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


class _DispatchCounter(TorchDispatchMode):
    """What reaches aten without a patched Python call: a scalar read (`int(t)`, `float(t)`), a
    data-dependent shape, a copy from the device into host memory."""

    def __init__(self, owner: HostSyncs) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.owner.counted
        on_device = any(c(a) for a in args)
        to_host = (
            func is _aten._to_copy.default
            and c(args[0])
            and args[0].device.type != "cpu"
            and torch.device(kwargs.get("device") or args[0].device).type == "cpu"
        ) or (
            func is _aten.copy_.default
            and args[0].device.type == "cpu"
            and c(args[1])
            and args[0].device.type not in self.owner.devices
        )
        scalar = func is _aten._local_scalar_dense.default
        if not _inside() and ((scalar or func is _aten.nonzero.default) and on_device or to_host):
            self.owner.note(str(func))
            if scalar and self.owner.placeholders:
                return _scalar(args[0])
        return func(*args, **kwargs)
