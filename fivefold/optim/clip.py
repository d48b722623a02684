"""The global gradient norm of a model spread over a mesh, and the optimizer step it gates. Each
group declares its `Placement`, the dimensions it is partitioned over; squared norms are summed over
exactly those (over a replicated one the same elements would count N times), innermost first
(`DIM_ORDER`). Every rank issues the same collectives — one small all-reduce per dimension taken
part in, whatever this rank holds (a pipeline stage without parameters adds zeros) — and gets the
same norm, so a non-finite one (fp16 overflow) skips all engines."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from fivefold.distributed.comm import Comm, Placement

__all__ = ["DIM_ORDER", "global_grad_sq_norm", "step_together"]

DIM_ORDER = (
    "tp",
    "cp",
    "ep",
    "dp_shard",
    "dp",
    "ep_dp",
    "dp_cp",
    "dp_replicate",
    "pp",
)  # innermost first


def _order(dim: str) -> tuple[int, str]:
    return (DIM_ORDER.index(dim) if dim in DIM_ORDER else len(DIM_ORDER), dim)


def global_grad_sq_norm(
    parts: Iterable[Mapping[Placement, torch.Tensor]],
    comms: Mapping[str, Comm],
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Σ‖g‖² over every rank's pieces: `parts` are local squared sums keyed by placement; `comms`
    the dimensions to sum over (all ranks must pass the same ones). Squares are kept in a vector
    indexed by the subset of those dimensions they are partitioned over, a fixed layout on every
    rank: reducing dimension d all-reduces the entries that contain d and folds them into the
    entries without it."""
    dims = sorted((d for d, c in comms.items() if c.size > 1), key=_order)
    vec = torch.zeros(2 ** len(dims), dtype=torch.float32, device=device)
    for part in parts:
        for placement, sq in part.items():
            missing = sorted(placement - set(comms))
            if missing:
                raise ValueError(
                    f"gradients are partitioned over {missing} but no Comm was given for them; "
                    f"pass comms={{{', '.join(repr(d) + ': ...' for d in missing)}}} (e.g. to "
                    "step_together)"
                )
            index = sum(1 << i for i, d in enumerate(dims) if d in placement)
            vec[index] += sq
    for i, d in enumerate(dims):
        bit = 1 << i  # entries with an earlier dimension's bit were folded already
        idx = torch.tensor(
            [m for m in range(bit, len(vec)) if m & bit and not m & (bit - 1)], device=device
        )
        reduced = vec.index_select(0, idx)
        comms[d].all_reduce(reduced, tag="grad_norm")
        vec.index_add_(0, idx - bit, reduced)
    return vec[0]


class Engine(Protocol):
    """What `step_together` needs of a data-parallel engine (`ZeroDataParallel`)."""

    comm: Comm
    zero_stage: int
    loss_scaler: Any
    optimizer: Any  # local_sq_norms() -> {placement: tensor}; apply_step(norm, max_norm)

    def check_step_allowed(self) -> None: ...

    def zero_grad(self) -> None: ...


class NonFiniteGradient(FloatingPointError):
    """The global gradient norm is not finite (and no loss scaler is there to skip the step): the
    step is not applied, so the weights (and the last checkpoint) stay as they were."""


def step_together(
    engines: Sequence[Engine],
    max_norm: float | None = None,
    comms: Mapping[str, Comm] | None = None,
    check_finite: bool = False,
    world: Comm | None = None,
) -> torch.Tensor | None:
    """One step of the engines forming one model (this rank's stages), clipped by their global norm;
    `comms` maps the other partitioned dimensions to groups (every rank passes the same: "tp", "pp";
    "dp" is the engines' own when they shard). Returns the norm (a 0-d tensor on the group's device)
    if one was needed.

    The norm and the clipping stay on the device: no host sync, so the next step's work can be
    queued while this one runs. A loss scaler (fp16) reads the norm on the host, to skip an
    overflowed step on every rank alike; so does ``check_finite``, to stop before a non-finite
    gradient reaches the weights: every rank raises `NonFiniteGradient` naming the first parameter
    whose gradient is not finite (found over ``world``)."""
    comms = dict(comms or {})
    for e in engines:
        e.check_step_allowed()
        if (
            e.zero_stage >= 1
        ):  # ZeRO shards are partitioned over the engine's group (DDP's are replicated there)
            comms.setdefault(e.comm.dim, e.comm)
    norm, found_inf = None, False
    scaled = any(e.loss_scaler is not None for e in engines)
    if max_norm is not None or scaled or check_finite:
        device = engines[0].comm.device if engines else "cpu"
        norm = global_grad_sq_norm(
            [e.optimizer.local_sq_norms() for e in engines], comms, device
        ).sqrt()
        if scaled or check_finite:
            found_inf = not math.isfinite(norm.item())  # the one host sync per step
        if found_inf and not scaled:
            raise NonFiniteGradient(_first_non_finite(engines, norm.item(), world))
    for e in engines:
        e.optimizer.apply_step(norm, max_norm, found_inf)
        e.zero_grad()
    return norm


def _first_non_finite(engines: Sequence[Engine], norm: float, world: Comm | None) -> str:
    """The message every rank raises: the norm and the first parameter (by rank, then order) with a
    non-finite gradient element in this rank's shard."""
    mine = None
    for e in engines:
        mine = mine or e.optimizer.first_non_finite_grad()
        if mine:
            break
    found = world.all_gather_object(mine) if world is not None else [mine]
    where = next(((rank, name) for rank, name in enumerate(found) if name), None)
    detail = (
        f"the first non-finite gradient is {where[1]!r} (rank {where[0]})"
        if where
        else "no single parameter's gradient is non-finite (the sum of squares overflowed)"
    )
    return (
        f"the global gradient norm is {norm}: {detail}; the step was not applied, the weights and "
        "the last checkpoint are as they were. Lower train.lr, check the data, or use fp16/bf16 "
        "loss scaling"
    )
