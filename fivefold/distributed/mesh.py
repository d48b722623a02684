"""The process grid of this rank (docs/design.md#the-mesh): the process groups
`fivefold.distributed.topology.ParallelDims.groups` lists — pp, dp, cp, tp as a torch `DeviceMesh`
(checked against the list), the derived dp_cp, ep, ep_dp, dp_shard, dp_replicate and ZeRO++ hpZ's
dp_hpz made by `new_group` in the list's order on every rank — and a `Comm` per dimension.
Gradients reduce over ``dp_cp`` (a cp rank holds a slice of the same sequences); ``ep`` blocks of
consecutive dp_cp ranks hold different experts, reduced over ``ep_dp``; HSDP (docs/design.md#hsdp)
shards over ``dp_shard`` blocks and replicates over ``dp_replicate``. `ParallelMesh` is a
`fivefold.distributed.topology.MeshLike`.

Every group is made by every rank, in the same order, when the mesh is built: under NCCL with a
bound ``device_id`` torch makes a group by splitting the world's communicator (``ncclCommSplit``),
which every rank must join, members or not — a group made on some ranks alone hangs them (gloo
never shows it). So nothing is made on demand: a group of this rank alone (``ep`` at ep 1,
``dp_replicate`` without HSDP) is a degree-1 mesh dimension's group when there is one, else one
per rank made by all; debug mode's gloo side groups are made up front too, one per group in the
same order on every rank. The two kinds a layout may add later, hpZ's groups and a backward twin
(`hpz_comm`, `backward_comm`), make every group of their kind on every rank, and
`fivefold.models.parallelize` asks for them on every rank before any stage is built.
"""

from __future__ import annotations

import datetime
from dataclasses import replace

import torch
import torch.distributed as dist

from fivefold.distributed.comm import Comm, CommLog
from fivefold.distributed.topology import DERIVED_DIMS, MESH_DIMS, ParallelDims

__all__ = ["DERIVED_DIMS", "MESH_DIMS", "ParallelDims", "ParallelMesh"]


class ParallelMesh:
    """The resolved grid of this process: degrees, DeviceMesh, derived groups, per-dim Comms, one
    CommLog."""

    def __init__(
        self,
        dims: ParallelDims,
        device: torch.device | str = "cpu",
        comm_log: CommLog | None = None,
        debug_collectives: bool = False,
        collective_timeout_s: float | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "fivefold.distributed.launch.init_distributed() first or run under `fivefold "
                "train` / torchrun"
            )
        self.device = torch.device(device)
        self.dims = dims.resolve(dist.get_world_size())
        self.comm_log = comm_log if comm_log is not None else CommLog(enabled=False)
        self.device_mesh = dist.device_mesh.init_device_mesh(
            self.device.type, self.dims.shape(), mesh_dim_names=MESH_DIMS
        )
        self._check_mesh_dims()
        self._alone: dist.ProcessGroup | None = None  # this rank's group of itself, made once
        self._derived = self._derived_groups()
        self._comms: dict[str, Comm] = {}
        # every Comm compares fingerprints first (`Comm._agree`)
        self.debug_collectives = debug_collectives
        self._sides: dict[int, dist.ProcessGroup] = {}  # debug mode: id(group) -> its gloo twin
        # One timeout for every group of the run (torch gives new groups its own default, not the
        # world's)
        self.collective_timeout_s = collective_timeout_s
        self._timed: set[int] = set()
        for group in self._every_group():
            self.own(group)
            self._make_side(group)
        self._make_side(dist.group.WORLD)

    def _check_mesh_dims(self) -> None:
        """The DeviceMesh made the pp, dp, cp, tp groups (torch's order, the same on every rank):
        they must be `ParallelDims.groups`'s (this rank's group of each, in its rank order)."""
        me = dist.get_rank()
        for dim in MESH_DIMS:
            made = dist.get_process_group_ranks(self.device_mesh.get_group(dim))
            if made != self.dims.group_of(dim, me):
                raise RuntimeError(
                    f"the DeviceMesh's {dim} group of rank {me} is {made}, but the topology says "
                    f"{self.dims.group_of(dim, me)} "
                    "(fivefold.distributed.topology.ParallelDims.groups)"
                )

    def _derived_groups(self) -> dict[str, dist.ProcessGroup]:
        """dp_cp, ep, ep_dp, dp_shard, dp_replicate, cp_ulysses, cp_ring as `ParallelDims.groups`
        lists them; every rank creates every group in the same order (a collective), reusing equal
        ones."""
        d = self.dims
        groups: dict[str, dist.ProcessGroup] = {}
        if d.cp == 1:
            groups["dp_cp"] = self.device_mesh.get_group("dp")
        else:
            groups.update(self._new_groups("dp_cp"))
        # no expert parallelism: every rank holds all experts ("ep" of one rank)
        if d.ep == 1:
            groups["ep"], groups["ep_dp"] = self._rank_alone(), groups["dp_cp"]
        else:
            # blocks of ep consecutive ranks hold different experts; a column (same place) the same
            # ones
            groups.update(self._new_groups("ep", "ep_dp"))
        # no HSDP: shards span dp × cp ("dp_replicate" of one rank)
        if d.dp_replicate == 1:
            groups["dp_shard"], groups["dp_replicate"] = groups["dp_cp"], self._rank_alone()
        else:
            # blocks of consecutive ranks shard the model; a column (same place) holds the same
            # shard
            groups.update(self._new_groups("dp_shard", "dp_replicate"))
        # Ulysses (cp_ulysses 1: none; cp: the whole cp group) and the ring across its groups
        cp = self.device_mesh.get_group("cp")
        if d.cp_ulysses == 1:
            groups["cp_ulysses"], groups["cp_ring"] = self._rank_alone(), cp
        elif d.cp_ulysses == d.cp:
            groups["cp_ulysses"], groups["cp_ring"] = cp, self._rank_alone()
        else:
            groups.update(self._new_groups("cp_ulysses"))
            groups.update(self._new_groups("cp_ring"))
        return groups

    def _rank_alone(self) -> dist.ProcessGroup:
        """The group of this rank alone: a degree-1 mesh dimension's group when there is one (the
        same choice on every rank: it depends on the degrees only), else every rank's singleton made
        by every rank in rank order (`ParallelDims.groups("ep")` at ep 1), never by this rank
        alone."""
        if self._alone is None:
            ones = [dim for dim in MESH_DIMS if self.dims.size(dim) == 1]
            if ones:
                self._alone = self.device_mesh.get_group(ones[0])
            else:
                alone = replace(self.dims, ep=1)  # ep 1: ep's groups are the ranks one by one
                self._alone = self._new_groups_of(alone, ("ep",))["ep"]
        return self._alone

    def _every_group(self) -> list[dist.ProcessGroup]:
        """This rank's groups, each once, in the same order on every rank: the mesh dims', then the
        derived ones'."""
        out: list[dist.ProcessGroup] = []
        for group in [
            *(self.device_mesh.get_group(dim) for dim in MESH_DIMS),
            *(self._derived[dim] for dim in DERIVED_DIMS),
        ]:
            if all(group is not g for g in out):
                out.append(group)
        return out

    def _new_groups(self, *dims: str, block: int = 1) -> dict[str, dist.ProcessGroup]:
        """A process group for every group `ParallelDims.groups` lists of `dims` (derived dims, cut
        from the dp × cp rows; or one mesh dim): this rank's, by dim. Made row by row, each dim's
        groups of the row in turn: the same order on every rank (a collective)."""
        return self._new_groups_of(self.dims, dims, block)

    def _new_groups_of(
        self, grid: ParallelDims, dims: tuple[str, ...], block: int = 1
    ) -> dict[str, dist.ProcessGroup]:
        me = dist.get_rank()
        n_rows = 1 if set(dims) & set(MESH_DIMS) else grid.pp * grid.tp  # (a mesh dim: in order)
        listed = {dim: grid.groups(dim, block) for dim in dims}
        mine: dict[str, dist.ProcessGroup] = {}
        for row in range(n_rows):
            for dim, groups in listed.items():
                per_row = len(groups) // n_rows
                for ranks in groups[row * per_row : (row + 1) * per_row]:
                    group = dist.new_group(ranks)
                    if me in ranks:
                        mine[dim] = group
        return mine

    def hpz_comm(self, size: int) -> Comm:
        """ZeRO++ hpZ's secondary group: `size` consecutive ranks of this rank's dp × cp group (with
        tp innermost, consecutive dp ranks share a node first), logged as "dp_hpz". Collective:
        every rank makes every group in the same order, so call it on all ranks at the same point
        (`parallelize` does, first)."""
        key = f"dp_hpz/{size}"
        if key not in self._comms:
            mine = self.own(self._new_groups("dp_hpz", block=size)["dp_hpz"])
            self._make_side(mine)
            self._comms[key] = Comm(
                mine,
                "dp_hpz",
                self.comm_log,
                device=self.device,
                fingerprints=self._fingerprints(mine),
            )
        return self._comms[key]

    def size(self, dim: str) -> int:
        return self.dims.size(dim)

    def rank(self, dim: str) -> int:
        if dim in DERIVED_DIMS:
            return dist.get_rank(self.group(dim))
        return self.device_mesh.get_local_rank(dim)

    def group(self, dim: str) -> dist.ProcessGroup:
        """This rank's group of `dim` (made with the mesh: asking makes none)."""
        if dim in DERIVED_DIMS:
            return self._derived[dim]
        return self.device_mesh.get_group(dim)

    def own(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """Give ``group`` (made here or by a caller, e.g. the checkpointer's) the run's collective
        timeout."""
        if self.collective_timeout_s and id(group) not in self._timed:
            self._timed.add(id(group))
            set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
            if set_timeout is not None:  # torch >= 2.3
                set_timeout(datetime.timedelta(seconds=self.collective_timeout_s), group)
        return group

    def _make_side(self, group: dist.ProcessGroup) -> None:
        """Debug mode: a gloo group over ``group``'s ranks for fingerprints, made by its members
        alone (gloo: no split of the world's communicator) at a point every rank reaches with the
        same groups made before — torch names a locally synchronised group from its ranks and the
        count of groups registered so far, which must agree on every member."""
        if self.debug_collectives and id(group) not in self._sides:
            ranks = dist.get_process_group_ranks(group)
            side = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
            self._sides[id(group)] = self.own(side)

    def _fingerprints(self, group: dist.ProcessGroup) -> dist.ProcessGroup | None:
        """Debug mode: ``group``'s gloo side group (`_make_side`); None: off."""
        if not self.debug_collectives:
            return None
        return self._sides[id(group)]

    def comm(self, dim: str) -> Comm:
        if dim not in self._comms:
            group = self.own(self.group(dim))
            self._comms[dim] = Comm(
                group,
                dim,
                self.comm_log,
                device=self.device,
                fingerprints=self._fingerprints(group),
            )
        return self._comms[dim]

    @property
    def world(self) -> Comm:
        """Every rank (for agreement on rare events: a non-finite gradient's name)."""
        if "world" not in self._comms:
            self._comms["world"] = Comm(
                dist.group.WORLD,
                "world",
                self.comm_log,
                device=self.device,
                fingerprints=self._fingerprints(dist.group.WORLD),
            )
        return self._comms["world"]

    def backward_comm(self, dim: str) -> Comm:
        """A second `Comm` over the ranks of `dim`, on its own process group and logged as `dim`:
        for the collectives of a backward that runs beside a forward (DualPipeV's overlapped units),
        so the two never share a group's order of calls. Collective: every rank makes a twin of
        every group of `dim` in the same order, so call it on all ranks at the same point
        (`parallelize` does, first)."""
        key = f"{dim}@backward"
        if key not in self._comms:
            twin = self.own(self._new_groups(dim)[dim])
            self._make_side(twin)
            self._comms[key] = Comm(
                twin, dim, self.comm_log, device=self.device, fingerprints=self._fingerprints(twin)
            )
        return self._comms[key]

    @property
    def global_rank(self) -> int:
        return dist.get_rank()

    def __repr__(self) -> str:
        coords = ", ".join(f"{d}={self.rank(d)}/{self.size(d)}" for d in MESH_DIMS)
        return f"ParallelMesh(rank {self.global_rank}: {coords}, device={self.device})"
