"""The process grid ``world = pp × dp × cp × tp`` (docs/design.md#the-mesh; tp innermost, so TP peers share a node) as a
torch `DeviceMesh`, derived groups and per-dimension `Comm`s. Gradients reduce over ``dp_cp`` (a cp rank holds a slice
of the same sequences); ``ep`` blocks of consecutive dp_cp ranks hold different experts, reduced over ``ep_dp``. HSDP
(docs/design.md#hsdp) splits dp_cp the same way: ``dp_shard`` blocks of consecutive dp_cp ranks (dp/dp_replicate dp rows
with all their cp ranks, torchtitan's dp_shard_cp) shard the model, ``dp_replicate`` (the same place in every block)
holds identical shards."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from fivefold.comm import Comm, CommLog

MESH_DIMS = ("pp", "dp", "cp", "tp")
DERIVED_DIMS = ("dp_cp", "ep", "ep_dp", "dp_shard", "dp_replicate")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension. ``dp=-1`` means "whatever is left of the world"."""

    pp: int = 1
    dp: int = -1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # carved from dp × cp (not a factor of the world)
    dp_replicate: int = (
        1  # HSDP: copies of the sharded model, a factor of dp (shards span dp/dp_replicate × cp)
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
                f"pp({self.pp}) × dp({self.dp}) × cp({self.cp}) × tp({self.tp}) = {others * self.dp} "
                f"but the world size is {world_size}; make the product equal the number of processes "
                f"(or set dp=-1 to derive it)"
            )
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"parallel.ep={self.ep} must divide dp({self.dp}) × cp({self.cp}) = {self.dp * self.cp}: "
                "expert-parallel ranks are carved from the data (and context) parallel ones"
            )
        if self.dp % self.dp_replicate:
            raise ValueError(
                f"parallel.dp_replicate={self.dp_replicate} must divide dp({self.dp}): HSDP splits dp "
                "into dp_replicate copies of dp/dp_replicate shard ranks (× cp); choose a divisor of dp"
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
        return getattr(self, dim)

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    # Where the groups `ParallelMesh` makes lie, without processes (`fivefold.plan`); tests/test_mesh_groups.py holds
    # both against the real groups. A dp × cp row lists its ranks in (dp, cp) order; ep / dp_shard cut it into blocks
    # of consecutive ranks (ep_dp / dp_replicate: the columns across the blocks).
    def derived_rank(self, dim: str, coords: dict[str, int]) -> int:
        """This rank's place in `dim`'s group, from its mesh coordinates (pp, dp, cp, tp; missing ones 0)."""
        if dim in MESH_DIMS:
            return coords.get(dim, 0)
        i = coords.get("dp", 0) * self.cp + coords.get("cp", 0)  # place in the dp × cp row
        shard = self.size("dp_shard")
        return {
            "dp_cp": i,
            "ep": i % self.ep,
            "ep_dp": i // self.ep,
            "dp_shard": i % shard,
            "dp_replicate": i // shard,
        }[dim]

    def group_span(self, dim: str, block: int = 1) -> int:
        """From the first to the last global rank of one group of `dim`, how many ranks (world = pp × dp × cp × tp,
        tp innermost): the group lies within one node of G GPUs when this is at most G. ``block``: the size of
        "dp_hpz"'s blocks of a row."""
        tp, shard = self.tp, self.size("dp_shard")
        size_and_stride = {
            "tp": (tp, 1),
            "cp": (self.cp, tp),
            "dp": (self.dp, tp * self.cp),
            "pp": (self.pp, tp * self.cp * self.dp),
            "dp_cp": (self.dp * self.cp, tp),
            "ep": (self.ep, tp),
            "ep_dp": (self.size("ep_dp"), tp * self.ep),
            "dp_shard": (shard, tp),
            "dp_replicate": (self.dp_replicate, tp * shard),
            "dp_hpz": (block, tp),
        }
        size, stride = size_and_stride[dim]
        return (size - 1) * stride + 1


def _blocks_and_columns(
    rows: list[list[int]], size: int
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Each row cut into blocks of `size` consecutive ranks, and the columns across a row's blocks (the same place in
    every block): this rank's block group and column group. Every rank creates every group, in the same order."""
    me = dist.get_rank()
    block_group = column_group = None
    for row in rows:
        blocks = [row[i : i + size] for i in range(0, len(row), size)]
        for block in blocks:
            g = dist.new_group(block)
            if me in block:
                block_group = g
        for column in zip(*blocks):
            g = dist.new_group(list(column))
            if me in column:
                column_group = g
    return block_group, column_group


class ParallelMesh:
    """The resolved grid of this process: degrees, DeviceMesh, derived groups, per-dim Comms, one CommLog."""

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
                "torch.distributed is not initialised: call fivefold.launch.init_distributed() first "
                "or run under `fivefold train` / torchrun"
            )
        self.device = torch.device(device)
        self.dims = dims.resolve(dist.get_world_size())
        self.comm_log = comm_log if comm_log is not None else CommLog(enabled=False)
        self.device_mesh = dist.device_mesh.init_device_mesh(
            self.device.type, self.dims.shape(), mesh_dim_names=MESH_DIMS
        )
        self._derived = self._derived_groups()
        self._comms: dict[str, Comm] = {}
        self.debug_collectives = (
            debug_collectives  # every Comm compares fingerprints first (`Comm._agree`)
        )
        # One timeout for every group of the run (torch gives new groups its own default, not the world's)
        self.collective_timeout_s = collective_timeout_s
        self._timed: set[int] = set()
        for dim in MESH_DIMS:
            self.own(self.device_mesh.get_group(dim))
        for group in self._derived.values():
            self.own(group)

    def _derived_groups(self) -> dict[str, dist.ProcessGroup]:
        """dp_cp, ep, ep_dp, dp_shard, dp_replicate; every rank creates every group in the same order (a collective),
        reusing equal ones."""
        d = self.dims
        me = dist.get_rank()
        rows = self._dp_cp_rows()
        groups: dict[str, dist.ProcessGroup] = {}
        if d.cp == 1:
            groups["dp_cp"] = self.group("dp")
        else:
            for row in rows:
                g = dist.new_group(row)
                if me in row:
                    groups["dp_cp"] = g
        if (
            d.ep == 1
        ):  # no expert parallelism: every rank holds all experts ("ep" of one rank, made on demand)
            groups["ep_dp"] = groups["dp_cp"]
        else:  # blocks of ep consecutive ranks hold different experts; a column (same place) the same ones
            groups["ep"], groups["ep_dp"] = _blocks_and_columns(rows, d.ep)
        if (
            d.dp_replicate == 1
        ):  # no HSDP: shards span dp × cp ("dp_replicate" of one rank, made on demand)
            groups["dp_shard"] = groups["dp_cp"]
        else:  # blocks of consecutive ranks shard the model; a column (same place) holds the same shard
            groups["dp_shard"], groups["dp_replicate"] = _blocks_and_columns(
                rows, d.size("dp_shard")
            )
        return groups

    def _dp_cp_rows(self) -> list[list[int]]:
        """One dp×cp group per (pp, tp) coordinate, its global ranks in (dp, cp) order."""
        d = self.dims
        return self.device_mesh.mesh.permute(0, 3, 1, 2).reshape(d.pp * d.tp, d.dp * d.cp).tolist()

    def hpz_comm(self, size: int) -> Comm:
        """ZeRO++ hpZ's secondary group: `size` consecutive ranks of this rank's dp × cp group (with tp innermost,
        consecutive dp ranks share a node first), logged as "dp_hpz". Collective: every rank makes every group in
        the same order, so call it on all ranks."""
        key = f"dp_hpz/{size}"
        if key not in self._comms:
            if size < 1 or (self.dims.dp * self.dims.cp) % size:
                raise ValueError(
                    f"hpZ group of {size} ranks: it must divide dp × cp = {self.dims.dp * self.dims.cp}"
                )
            mine = None
            for row in self._dp_cp_rows():
                for i in range(0, len(row), size):
                    group = dist.new_group(row[i : i + size])
                    if dist.get_rank() in row[i : i + size]:
                        mine = group
            mine = self.own(mine)
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
        if dim in ("ep", "dp_replicate") and dim not in self._derived:
            # ep = 1 / dp_replicate = 1: a group of this rank alone, no collective needed
            self._derived[dim] = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        if dim in DERIVED_DIMS:
            return self._derived[dim]
        return self.device_mesh.get_group(dim)

    def own(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """Give ``group`` (made here or by a caller, e.g. the checkpointer's) the run's collective timeout."""
        if self.collective_timeout_s and id(group) not in self._timed:
            self._timed.add(id(group))
            set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
            if set_timeout is not None:  # torch >= 2.3
                set_timeout(datetime.timedelta(seconds=self.collective_timeout_s), group)
        return group

    def _fingerprints(self, group: dist.ProcessGroup) -> dist.ProcessGroup | None:
        """Debug mode: a gloo group over ``group``'s ranks for fingerprints (made by its members alone)."""
        if not self.debug_collectives:
            return None
        return self.own(
            dist.new_group(
                dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True
            )
        )

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
        """A second `Comm` over the ranks of `dim`, on its own process group and logged as `dim`: for the collectives
        of a backward that runs beside a forward (DualPipeV's overlapped units), so the two never share a group's
        order of calls. Made on first use by the members of the group alone (they all reach it together)."""
        key = f"{dim}@backward"
        if key not in self._comms:
            ranks = dist.get_process_group_ranks(self.group(dim))
            # torch names a locally synchronised group from its ranks and the count of groups this process has
            # registered: equal on every member as long as they all made the same groups before (the only groups made
            # on some ranks alone, the singletons of ep and dp_replicate, exist only at degree 1: parallelize asks for
            # them only where every rank does)
            twin = self.own(dist.new_group(ranks, use_local_synchronization=True))
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
