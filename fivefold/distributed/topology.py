"""Where the ranks of every process group lie, without processes (docs/design.md#the-mesh), and the
interface a mesh and its comms offer the code they are handed to.

`ParallelDims.groups` is the one source of topology: ``world = pp × dp × cp × tp`` in row-major
order (tp innermost, so TP peers share a node; pp outermost), every group of a mesh dimension, and
the derived groups cut from the dp × cp rows (one per (pp, tp) coordinate, its ranks in (dp, cp)
order): ``dp_cp`` the rows themselves, ``ep`` / ``dp_shard`` / ``dp_hpz`` blocks of consecutive
ranks of a row, ``ep_dp`` / ``dp_replicate`` the columns across a row's blocks (the same place in
every block); and two cut from each cp group for Ulysses (``parallel.cp_mode``): ``cp_ulysses``
blocks of U consecutive cp ranks (the all-to-all), ``cp_ring`` the columns across them (the
ring). `fivefold.distributed.mesh.ParallelMesh` creates exactly these groups;
`fivefold.plan.assembly.PlanningMesh` and `fivefold.plan.hardware.link` read them (`derived_rank`,
`group_span`).

`MeshLike` / `CommLike` are the members the package uses of a mesh and of a `Comm` while assembling
a model: `ParallelMesh` / `fivefold.distributed.comm.Comm` and the planner's stand-ins both provide
them. Pure Python (torch only for the protocols' types): no process group, no
`torch.distributed`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from fivefold.distributed.comm import CommLog

__all__ = ["DERIVED_DIMS", "MESH_DIMS", "CommLike", "MeshLike", "ParallelDims"]

MESH_DIMS = ("pp", "dp", "cp", "tp")
DERIVED_DIMS = ("dp_cp", "ep", "ep_dp", "dp_shard", "dp_replicate", "cp_ulysses", "cp_ring")
# A derived group cut from the dp × cp rows: the block size it cuts them into, and whether it is the
# columns across the blocks ("dp_hpz"'s block is the caller's)
_CUTS = {
    "ep": ("ep", False),
    "ep_dp": ("ep", True),
    "dp_shard": ("dp_shard", False),
    "dp_replicate": ("dp_shard", True),
}
# Cut from each cp group instead: Ulysses' blocks of consecutive ranks and the ring across them
_CP_CUTS = {"cp_ulysses": False, "cp_ring": True}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension. ``dp=-1`` means "whatever is left of the world"."""

    pp: int = 1
    dp: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # carved from dp × cp (not a factor of the world)
    # HSDP: copies of the sharded model, a factor of dp (shards span dp/dp_replicate × cp)
    dp_replicate: int = 1
    # Ulysses: the inner degree U of cp (1: ring attention only, cp: Ulysses only, else the hybrid)
    cp_ulysses: int = 1

    @classmethod
    def of(cls, parallel: Any) -> ParallelDims:
        """The degrees a ``[parallel]`` section (`fivefold.config.ParallelSection`) asks for, not
        resolved: its Ulysses degree from ``cp_mode`` (`ParallelSection.ulysses_degree`)."""
        p = parallel
        return cls(
            pp=p.pp,
            dp=p.dp,
            cp=p.cp,
            tp=p.tp,
            ep=p.ep,
            dp_replicate=p.dp_replicate,
            cp_ulysses=p.ulysses_degree(p.cp),
        )

    def resolve(self, world_size: int) -> ParallelDims:
        """Fill in dp and check that the product of the degrees is the world size."""
        for f in fields(self):
            v = getattr(self, f.name)
            if v == 0 or v < -1 or (v == -1 and f.name != "dp"):
                raise ValueError(
                    f"parallel.{f.name}={v} is invalid: use a positive degree"
                    + (" (or -1 to take the rest of the world)" if f.name == "dp" else "")
                )
        others = self.pp * self.cp * self.tp
        if self.dp == -1:
            if world_size % others:
                raise ValueError(
                    f"world size {world_size} is not divisible by pp({self.pp}) × cp({self.cp}) × "
                    f"tp({self.tp}) = {others}; change the degrees or the number of processes"
                )
            return replace(self, dp=world_size // others).resolve(world_size)
        if others * self.dp != world_size:
            raise ValueError(
                f"pp({self.pp}) × dp({self.dp}) × cp({self.cp}) × tp({self.tp}) = "
                f"{others * self.dp} but the world size is {world_size}; make the product equal "
                f"the number of processes (or set dp=-1 to derive it)"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must divide dp({self.dp}) × cp({self.cp}) = "
                f"{self.dp * self.cp}: expert-parallel ranks are carved from the data (and "
                "context) parallel ones"
            )
        if self.dp % self.dp_replicate:
            raise ValueError(
                f"parallel.dp_replicate={self.dp_replicate} must divide dp({self.dp}): HSDP splits "
                "dp into dp_replicate copies of dp/dp_replicate shard ranks (× cp); choose a "
                "divisor of dp"
            )
        if self.cp % self.cp_ulysses:
            raise ValueError(
                f"parallel.cp_ulysses={self.cp_ulysses} must divide cp({self.cp}): cp = Ulysses × "
                "ring degree; choose a divisor of cp"
            )
        return self

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, d) for d in MESH_DIMS)

    def size(self, dim: str) -> int:
        """Degree of a mesh or derived dimension."""
        if dim == "dp_cp":
            return self.dp * self.cp
        if dim == "ep_dp":
            return self.dp * self.cp // self.ep
        if dim == "dp_shard":
            return self.dp * self.cp // self.dp_replicate
        if dim == "cp_ring":
            return self.cp // self.cp_ulysses
        return getattr(self, dim)

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    def groups(self, dim: str, block: int = 1) -> list[list[int]]:
        """The global ranks of every group of `dim` (a mesh dim, a derived one, or "dp_hpz" with
        groups of ``block`` consecutive dp × cp ranks), each group in its own rank order: together
        they partition the world. The order is the one `ParallelMesh` creates them in, the same on
        every rank. Needs resolved degrees."""
        return [list(g) for g in _groups(self, dim, block)]

    def group_of(self, dim: str, rank: int, block: int = 1) -> list[int]:
        """The global ranks of the group of `dim` that global rank `rank` is in."""
        index, _ = _places(self, dim, block)[rank]
        return list(_groups(self, dim, block)[index])

    def global_rank(self, coords: dict[str, int]) -> int:
        """The global rank at mesh coordinates (pp, dp, cp, tp; missing ones 0)."""
        rank = 0
        for d in MESH_DIMS:
            rank = rank * getattr(self, d) + coords.get(d, 0)
        return rank

    # What `fivefold.plan` asks of the groups, read from `groups` (tests/test_mesh_groups.py holds
    # both against the groups `ParallelMesh` makes).
    def derived_rank(self, dim: str, coords: dict[str, int], block: int = 1) -> int:
        """This rank's place in `dim`'s group, from its mesh coordinates (pp, dp, cp, tp; missing
        ones 0); ``block``: the size of "dp_hpz"'s groups."""
        _, place = _places(self, dim, block)[self.global_rank(coords)]
        return place

    def group_span(self, dim: str, block: int = 1) -> int:
        """From the first to the last global rank of one group of `dim`, how many ranks (the widest
        group's): the group lies within one node of G GPUs when this is at most G. ``block``: the
        size of "dp_hpz"'s blocks of a row."""
        return max(max(g) - min(g) + 1 for g in _groups(self, dim, block))


def _groups(dims: ParallelDims, dim: str, block: int) -> tuple[tuple[int, ...], ...]:
    return _listed(dims, dim, block if dim == "dp_hpz" else 1)  # block only cuts dp_hpz


@functools.lru_cache(maxsize=256)
def _listed(dims: ParallelDims, dim: str, block: int) -> tuple[tuple[int, ...], ...]:
    if any(getattr(dims, f.name) < 1 for f in fields(dims)):
        raise ValueError(f"{dims} is not resolved: call ParallelDims.resolve(world_size) first")
    strides = {d: math.prod(dims.shape()[i + 1 :]) for i, d in enumerate(MESH_DIMS)}
    if dim in MESH_DIMS:  # ranks whose other coordinates agree, in order of those coordinates
        step, n = strides[dim], getattr(dims, dim)
        firsts = [r for r in range(dims.world_size) if (r // step) % n == 0]
        return tuple(tuple(first + k * step for k in range(n)) for first in firsts)
    if dim in _CP_CUTS:  # each cp group cut into blocks of U consecutive ranks (or their columns)
        out = []
        for group in _listed(dims, "cp", 1):
            u = dims.cp_ulysses
            blocks = [group[i : i + u] for i in range(0, len(group), u)]
            out += list(zip(*blocks)) if _CP_CUTS[dim] else blocks
        return tuple(tuple(g) for g in out)
    rows = [  # one per (pp, tp) coordinate, its ranks in (dp, cp) order
        tuple(p * strides["pp"] + i * dims.tp + t for i in range(dims.dp * dims.cp))
        for p in range(dims.pp)
        for t in range(dims.tp)
    ]
    if dim == "dp_cp":
        return tuple(rows)
    if dim == "dp_hpz":
        if block < 1 or (dims.dp * dims.cp) % block:
            raise ValueError(
                f"hpZ group of {block} ranks: it must divide dp × cp = {dims.dp * dims.cp}"
            )
        size, columns = block, False
    elif dim in _CUTS:
        name, columns = _CUTS[dim]
        size = dims.size(name)
    else:
        raise KeyError(dim)
    out: list[tuple[int, ...]] = []
    for row in rows:
        blocks = [row[i : i + size] for i in range(0, len(row), size)]
        out += list(zip(*blocks)) if columns else blocks
    return tuple(out)


def _places(dims: ParallelDims, dim: str, block: int) -> dict[int, tuple[int, int]]:
    """Global rank -> (its group's index in `_groups`, its place in that group)."""
    return _index(dims, dim, block if dim == "dp_hpz" else 1)


@functools.lru_cache(maxsize=256)
def _index(dims: ParallelDims, dim: str, block: int) -> dict[int, tuple[int, int]]:
    return {r: (i, j) for i, g in enumerate(_listed(dims, dim, block)) for j, r in enumerate(g)}


@runtime_checkable
class CommLike(Protocol):
    """What the package reads of a `fivefold.distributed.comm.Comm` it is handed while a model is
    assembled: the group's mesh dim, size, this rank's place, the device its tensors live on, the
    log, scalars and
    the p2p semantics."""

    dim: str
    size: int
    rank: int
    device: torch.device
    log: CommLog

    def scalar(self, value: float, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def p2p_semantics(self) -> str: ...


@runtime_checkable
class MeshLike(Protocol):
    """What the package asks of a mesh (`fivefold.distributed.mesh.ParallelMesh`, or the planner's
    `PlanningMesh`): sizes and this rank's places by dimension, and a comm per dimension (a backward
    twin, hpZ's, the world's)."""

    def size(self, dim: str) -> int: ...

    def rank(self, dim: str) -> int: ...

    def comm(self, dim: str) -> CommLike: ...

    def backward_comm(self, dim: str) -> CommLike: ...

    def hpz_comm(self, size: int) -> CommLike: ...

    @property
    def world(self) -> CommLike: ...
