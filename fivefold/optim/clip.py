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

__all__ = [
    "DIM_ORDER",
    "NonFiniteGradient",
    "NonFiniteWatch",
    "global_grad_sq_norm",
    "step_together",
]

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
        idx = _fold_index(bit, len(vec), vec.device)
        reduced = vec.index_select(0, idx)
        comms[d].all_reduce(reduced, tag="grad_norm")
        vec.index_add_(0, idx - bit, reduced)
    return vec[0]


_FOLD_INDEX: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _fold_index(bit: int, n: int, device: torch.device) -> torch.Tensor:
    """The entries of an n-vector that fold over dimension `bit`, made once per device: a
    `torch.tensor` on an accelerator is a blocking host-to-device copy, every step."""
    key = (bit, n, device)
    if key not in _FOLD_INDEX:
        _FOLD_INDEX[key] = torch.tensor(
            [m for m in range(bit, n) if m & bit and not m & (bit - 1)], device=device
        )
    return _FOLD_INDEX[key]


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


class NonFiniteWatch:
    """``train.check_finite`` without a host sync in the step (docs/gpus.md#no-host-sync-in-a-step):
    each step's flag (the global norm is not finite) stays on the device, the optimizers skip that
    step there (a fused kernel's ``found_inf``: torch's GradScaler contract, so weights and
    optimizer state are as they were), and the skipped steps are counted on the device. `confirm`
    reads the count — the trainer calls it on log steps — and raises `NonFiniteGradient` if a step
    since the last read was skipped. Used only when every engine can skip on the device
    (``optimizer.skips_on_device``); otherwise `step_together` reads the norm at once (one host
    sync: free on the CPU)."""

    def __init__(self) -> None:
        self.skipped: torch.Tensor | None = None
        self.steps = 0  # steps recorded since the last read

    def record(self, norm: torch.Tensor) -> torch.Tensor:
        """This step's flag (0-d fp32, 1 where the norm is not finite), counted on the device."""
        flag = (~torch.isfinite(norm)).float()
        self.skipped = flag.clone() if self.skipped is None else self.skipped.add_(flag)
        self.steps += 1
        return flag

    def confirm(self, skipped: int | None = None) -> None:
        """Raise `NonFiniteGradient` if a recorded step was skipped: ``skipped`` is the count the
        caller fetched with its own read of the device, else it is read here (a host sync)."""
        if self.skipped is None:
            return
        skipped = int(self.skipped.item()) if skipped is None else skipped
        steps = self.steps
        self.skipped, self.steps = None, 0
        if skipped:
            raise NonFiniteGradient(
                f"{skipped} of the last {steps} steps had a non-finite global gradient norm; each "
                "was skipped on the device (weights and optimizer state as they were before it), "
                "and the run stops here. Lower train.lr or check the data; run.log_every 1 stops "
                "at the step itself and names the first non-finite parameter"
            )


def step_together(
    engines: Sequence[Engine],
    max_norm: float | None = None,
    comms: Mapping[str, Comm] | None = None,
    check_finite: bool = False,
    world: Comm | None = None,
    watch: NonFiniteWatch | None = None,
) -> torch.Tensor | None:
    """One step of the engines forming one model (this rank's stages), clipped by their global norm;
    `comms` maps the other partitioned dimensions to groups (every rank passes the same: "tp", "pp";
    "dp" is the engines' own when they shard). Returns the norm (a 0-d tensor on the group's device)
    if one was needed.

    The norm and the clipping stay on the device: no host sync, so the next step's work can be
    queued while this one runs. A loss scaler (fp16) reads the norm on the host, to skip an
    overflowed step on every rank alike; so does ``check_finite``, to stop before a non-finite
    gradient reaches the weights: every rank raises `NonFiniteGradient` naming the first parameter
    whose gradient is not finite (found over ``world``). With a `NonFiniteWatch` and engines that
    can skip a step on the device, ``check_finite`` reads nothing: the watch keeps the flag."""
    comms = dict(comms or {})
    for e in engines:
        e.check_step_allowed()
        if (
            e.zero_stage >= 1
        ):  # ZeRO shards are partitioned over the engine's group (DDP's are replicated there)
            comms.setdefault(e.comm.dim, e.comm)
    norm: torch.Tensor | None = None
    found_inf: bool | torch.Tensor = False
    scaled = any(e.loss_scaler is not None for e in engines)
    if max_norm is not None or scaled or check_finite:
        device = engines[0].comm.device if engines else "cpu"
        norm = global_grad_sq_norm(
            [e.optimizer.local_sq_norms() for e in engines], comms, device
        ).sqrt()
        on_device = watch is not None and all(e.optimizer.skips_on_device for e in engines)
        if check_finite and on_device and not scaled:
            found_inf = watch.record(norm)  # a device flag: the optimizers skip on the device
        elif scaled or check_finite:
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
