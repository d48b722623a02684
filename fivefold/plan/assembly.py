"""A rank's parts without the rank: the trainer's own assembly (`parallelize`) on the meta device
over stand-in process groups, so the planner reads the flat buffers, their padding, ZeRO-3 units,
stage cuts, TP slices and expert shards a run would hold — nothing allocated, no collective
issued."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fivefold.config import Config
from fivefold.data_parallel.mixed_precision import MixedPrecision
from fivefold.distributed.comm import CommLog
from fivefold.distributed.topology import ParallelDims
from fivefold.models.parallelize import PipelinedModel, WholeModel, parallelize
from fivefold.run_plan import RunPlan

__all__ = [
    "Parts",
    "PlanningMesh",
    "engines_of",
    "local_numels",
    "local_shapes",
    "precision_bytes",
    "rank_parts",
    "resolved",
    "stages_of",
]

Parts = WholeModel | PipelinedModel


class _StandIn:
    """A process group that is not there (a `fivefold.distributed.topology.CommLike`): its size and
    this rank's place in it, on the meta device. The assembly only reads these while building;
    nothing is ever
    issued through it."""

    def __init__(self, dim: str, size: int, rank: int = 0) -> None:
        self.dim, self.size, self.rank = dim, size, rank
        self.device = torch.device("meta")
        self.log = CommLog(enabled=False)

    def p2p_semantics(self) -> str:
        return "rendezvous"

    def scalar(self, value: float, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.tensor(value, dtype=dtype or torch.float32, device="meta")


class PlanningMesh:
    """`fivefold.distributed.mesh.ParallelMesh`'s sizes and ranks without processes (a
    `fivefold.distributed.topology.MeshLike`): ``coords`` places this rank on the mesh (pp, dp, cp,
    tp; 0 where missing), its place in every group read from the groups the real mesh makes
    (`ParallelDims.groups`, via `derived_rank`)."""

    def __init__(self, dims: ParallelDims, coords: dict[str, int] | None = None) -> None:
        self.dims, self.coords = dims, dict(coords or {})

    def size(self, dim: str) -> int:
        return self.dims.size(dim)

    def rank(self, dim: str) -> int:
        return self.dims.derived_rank(dim, self.coords)

    def comm(self, dim: str) -> _StandIn:
        return _StandIn(dim, self.size(dim), self.rank(dim))

    def backward_comm(self, dim: str) -> _StandIn:
        return self.comm(dim)

    def hpz_comm(self, size: int) -> _StandIn:
        return _StandIn("dp_hpz", size, self.dims.derived_rank("dp_hpz", self.coords, size))

    @property
    def world(self) -> _StandIn:
        return _StandIn("world", self.dims.world_size)


def resolved(cfg: Config, run: RunPlan) -> Config:
    """`cfg` with the batch `validate_layout` resolved (the trainer does the same before
    `parallelize`)."""
    cfg = dataclasses.replace(cfg)
    cfg.train = dataclasses.replace(
        cfg.train,
        global_batch=run.global_batch,
        micro_batch=run.micro_batch,
        grad_accum=run.grad_accum,
    )
    return cfg


def rank_parts(
    cfg: Config, run: RunPlan, pp_rank: int = 0, coords: dict[str, int] | None = None
) -> Parts:
    """What `parallelize` builds on pipeline rank `pp_rank` (rank 0 of every other dimension unless
    `coords` says: dp rank 0 holds the most of a padded shard), on the meta device."""
    return parallelize(
        resolved(cfg, run),
        run.model,
        PlanningMesh(run.dims, {**(coords or {}), "pp": pp_rank}),
        "meta",
    )


def stages_of(parts: Parts) -> dict[int, nn.Module]:
    """This rank's (virtual) stages by index; without pp the whole model as stage 0."""
    return parts.stages if isinstance(parts, PipelinedModel) else {0: parts.module}


def engines_of(parts: Parts) -> list[tuple[int, Any]]:
    """(stage, engine) for every ZeRO engine of this rank (a stage's dense engine, and its experts'
    under MoE)."""
    if isinstance(parts, PipelinedModel):
        return [(stage, engine) for (stage, _), engine in parts.engines.items()]
    return [(0, engine) for engine in parts.engines.values()]


def local_numels(parts: Parts) -> dict[int, dict[str, int]]:
    """Per stage, this rank's parameters and their element counts (its TP slice, its experts), from
    the engines' flat layouts (under ZeRO-3 the modules' parameters are empty stand-ins)."""
    out: dict[int, dict[str, int]] = {sid: {} for sid in stages_of(parts)}
    for sid, engine in engines_of(parts):
        for f in engine.flats:
            out[sid].update({slot.name: slot.numel for slot in f.layout.slots})
    return out


def local_shapes(parts: Parts) -> dict[int, dict[str, tuple[int, ...]]]:
    """Per stage, this rank's parameters and their local shapes (as `local_numels`)."""
    out: dict[int, dict[str, tuple[int, ...]]] = {sid: {} for sid in stages_of(parts)}
    for sid, engine in engines_of(parts):
        for f in engine.flats:
            out[sid].update({slot.name: tuple(slot.shape) for slot in f.layout.slots})
    return out


def precision_bytes(cfg: Config) -> tuple[int, int]:
    """(parameter / compute, gradient-reduction) bytes per element of `cfg`'s precision policy."""
    mp = MixedPrecision.from_names(cfg.precision.param, cfg.precision.reduce)
    return mp.param_dtype.itemsize, mp.grad_dtype.itemsize
