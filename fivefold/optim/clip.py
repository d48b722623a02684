"""The global gradient norm of a model spread over a mesh, and the optimizer step it gates.

Clipping needs ‖g‖ over the *whole* model while each rank holds pieces: ZeRO shards (over dp),
tensor-parallel slices (over tp), pipeline stages (over pp), and later context / expert pieces.
Every parameter group declares its `Placement` — the mesh dimensions its elements are partitioned
over; over the others it is replicated. Squared norms are summed over exactly those dimensions:
summing over a replicated dimension would count the same elements N times.

`global_grad_sq_norm` takes each engine's local squared sums by placement (device tensors), and for
each dimension, innermost first (tp, cp, ep, dp, pp), merges the entries that no longer differ and
all-reduces the ones partitioned over it — one small all-reduce per dimension in use (a scalar when
one placement remains). The result decides the step for every rank alike: non-finite means some
rank overflowed (fp16), and every engine skips.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from fivefold.comm import Comm, Placement

if TYPE_CHECKING:
    from fivefold.data_parallel.zero import ZeroDataParallel

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


def step_together(engines: Sequence[ZeroDataParallel], max_norm: float | None = None,
                  comms: Mapping[str, Comm] | None = None) -> float | None:
    """One optimizer step for engines that form one model (this rank's pipeline stages, or one engine),
    clipping by the norm over all of them and over every mesh dimension their groups are partitioned
    over; `comms` maps those dimensions to groups ("tp", "pp", ...; "dp" defaults to the engines').
    Returns the norm when one was needed (clipping or fp16 loss scaling)."""
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
