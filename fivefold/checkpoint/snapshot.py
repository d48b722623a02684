"""The host copy a background save writes from (`Checkpointer(async_save=True)`): the state is
copied to host memory before `save` returns, so training may change it while DCP writes the copy.

Two strategies, picked by the device the state lives on (`snapshot_for`):

- `HostCopy` (the CPU path): each save copies every tensor into fresh host memory
  (``.to("cpu", copy=True)``); nothing touches an accelerator.
- `PinnedSnapshot` (an accelerator): pinned host buffers, one per tensor (per rectangle of a
  `Pieces`), allocated at the first save and reused by the next ones while the state keeps its
  shapes; every device-to-host copy is queued with ``non_blocking=True`` and the host waits once,
  on the device's current stream, before `take` returns. Reuse is safe because a `Checkpointer`
  has at most one save in flight: the next `take` comes after the previous write finished.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol

import torch

from fivefold.checkpoint.pieces import Pieces
from fivefold.data_parallel.offload import device_event, is_accelerator, wait_for

__all__ = ["HostCopy", "PinnedSnapshot", "Snapshot", "snapshot_for"]


def wait_for_device(device: torch.device) -> None:
    """Block the host until every copy queued so far on `device`'s current stream has arrived (an
    event recorded after them)."""
    wait_for(device_event(device))


class Snapshot(Protocol):
    def take(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with its tensors (and `Pieces`' rectangles) copied to host memory that
        training no longer changes; other values as they are."""
        ...


def _copied(state_dict: dict[str, Any], copy: Any) -> dict[str, Any]:
    """``state_dict`` with every tensor ``t`` at path ``key`` replaced by ``copy(key, t)``."""
    out: dict[str, Any] = {}
    for k, v in state_dict.items():
        if isinstance(v, Pieces):
            boxes = {at: copy((k, at), t) for at, t in v.boxes.items()}
            out[k] = Pieces(v.size, v.dtype, boxes)
        elif isinstance(v, torch.Tensor):
            out[k] = copy((k,), v)
        else:
            out[k] = v
    return out


class HostCopy:
    """Fresh host memory for every save (the CPU path)."""

    def take(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _copied(state_dict, lambda _, t: t.detach().to("cpu", copy=True))


def _pinned_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)


class PinnedSnapshot:
    """Pinned host buffers kept across saves; asynchronous copies, one wait per save."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.buffers: dict[Hashable, torch.Tensor] = {}  # path in the state -> its pinned buffer
        self.allocated = 0  # buffers allocated so far (a later save with the same shapes: none)

    def _copy(self, key: Hashable, t: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.buffers[key] = _pinned_empty(t.shape, t.dtype)
            self.allocated += 1
        buf.copy_(t.detach(), non_blocking=True)
        return buf

    def take(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = _copied(state_dict, self._copy)
        wait_for_device(self.device)  # the one wait: every copy above has arrived
        return out


def snapshot_for(device: torch.device | str) -> Snapshot:
    """`PinnedSnapshot` where the state lives on an accelerator, else `HostCopy`."""
    device = torch.device(device)
    return PinnedSnapshot(device) if is_accelerator(device) else HostCopy()
