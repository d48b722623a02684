"""The global gradient norm of a model spread over a mesh, and the optimizer step it gates. Each group declares its
`Placement`, the dimensions it is partitioned over; squared norms are summed over exactly those (over a replicated one
the same elements would count N times), innermost first (`DIM_ORDER`), merging entries that no longer differ: one
small all-reduce per dimension. Every rank gets the same norm, so a non-finite one (fp16 overflow) skips all engines."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from fivefold.comm import Comm, Placement

__all__ = ["DIM_ORDER", "global_grad_sq_norm", "step_together"]

DIM_ORDER = ("tp", "cp", "ep", "dp", "pp")  # innermost first


def _order(dim: str) -> tuple[int, str]:
    return (DIM_ORDER.index(dim) if dim in DIM_ORDER else len(DIM_ORDER), dim)


def global_grad_sq_norm(parts: Iterable[Mapping[Placement, torch.Tensor]], comms: Mapping[str, Comm],
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """Σ‖g‖² over every rank's pieces: `parts` are local squared sums keyed by placement."""
    entries: dict[Placement, torch.Tensor] = {}
    for part in parts:
        for placement, sq in part.items():
            entries[placement] = entries[placement] + sq if placement in entries else sq
    dims = sorted({d for placement in entries for d in placement}, key=_order)
    missing = [d for d in dims if d not in comms]
    if missing:
        raise ValueError(f"gradients are partitioned over {missing} but no Comm was given for them; pass "
                         f"comms={{{', '.join(repr(d) + ': ...' for d in missing)}}} (e.g. to step_together)")
    for d in dims:
        partitioned = [p for p in entries if d in p]
        comm = comms[d]
        if comm.size > 1:
            stacked = torch.stack([entries[p] for p in partitioned])
            comm.all_reduce(stacked, tag="grad_norm")
            for p, reduced in zip(partitioned, stacked.unbind()):
                entries[p] = reduced
        remaining: dict[Placement, torch.Tensor] = {}
        for p, sq in entries.items():  # d is done: entries that differed only in it become one
            key = p - {d}
            remaining[key] = remaining[key] + sq if key in remaining else sq
        entries = remaining
    if not entries:
        return torch.zeros((), dtype=torch.float32, device=device)
    return sum(entries.values())


class Engine(Protocol):
    """What `step_together` needs of a data-parallel engine (`ZeroDataParallel`)."""

    comm: Comm
    loss_scaler: Any
    optimizer: Any  # local_sq_norms() -> {placement: tensor}; apply_step(norm, max_norm)

    def check_step_allowed(self) -> None: ...

    def zero_grad(self) -> None: ...


def step_together(engines: Sequence[Engine], max_norm: float | None = None,
                  comms: Mapping[str, Comm] | None = None) -> float | None:
    """One step of the engines forming one model (this rank's stages), clipped by their global norm; `comms` maps
    partitioned dimensions to groups ("dp" defaults to the engines'). Returns the norm if one was needed."""
    comms = dict(comms or {})
    for e in engines:
        e.check_step_allowed()
        comms.setdefault("dp", e.comm)
    norm = None
    if max_norm is not None or any(e.loss_scaler is not None for e in engines):
        device = engines[0].comm.device if engines else "cpu"
        sq = global_grad_sq_norm([e.optimizer.local_sq_norms() for e in engines], comms, device).item()
        norm = math.sqrt(sq) if math.isfinite(sq) else math.inf
    for e in engines:
        e.optimizer.apply_step(norm, max_norm)
        e.zero_grad()
    return norm
