"""`ParallelDims.groups` without processes: every dim's groups partition the world, each group the
size of its dim, and `derived_rank` / `group_span` read from them; the real mesh and comm and the
planner's stand-ins satisfy `MeshLike` / `CommLike`. (tests/test_mesh_groups.py holds the groups
against the process groups `ParallelMesh` makes.)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from fivefold.distributed.comm import Comm
from fivefold.distributed.mesh import ParallelMesh
from fivefold.distributed.topology import DERIVED_DIMS, MESH_DIMS, CommLike, MeshLike, ParallelDims
from fivefold.plan.assembly import PlanningMesh

SHAPES = [
    ParallelDims(dp=8),
    ParallelDims(pp=2, dp=2, cp=2, tp=2, ep=2),
    ParallelDims(pp=3, dp=4, tp=2, ep=4, dp_replicate=2),
    ParallelDims(pp=2, dp=6, cp=2, ep=3, dp_replicate=3),
    ParallelDims(dp=4, cp=2, tp=4, ep=8, dp_replicate=4),
]


def _resolved(dims: ParallelDims) -> ParallelDims:
    return dims.resolve(dims.world_size)


@pytest.mark.parametrize("dims", SHAPES, ids=str)
@pytest.mark.parametrize("dim", [*MESH_DIMS, *DERIVED_DIMS])
def test_the_groups_of_every_dim_partition_the_world(dims, dim):
    dims = _resolved(dims)
    groups = dims.groups(dim)
    members = sorted(r for g in groups for r in g)
    assert members == list(range(dims.world_size))
    assert all(len(g) == dims.size(dim) for g in groups)
    for g in groups:
        assert all(dims.group_of(dim, rank) == g for rank in g)
    assert dims.group_span(dim) == max(max(g) - min(g) + 1 for g in groups)


def _coords(dims: ParallelDims, rank: int) -> dict[str, int]:
    out = {}
    for d in reversed(MESH_DIMS):  # row-major (pp, dp, cp, tp), tp innermost
        rank, out[d] = divmod(rank, getattr(dims, d))
    return out


@pytest.mark.parametrize("dims", SHAPES, ids=str)
def test_groups_follow_the_grid(dims):
    """A mesh dim's group varies its coordinate alone, in order; a dp_cp row varies (dp, cp) in that
    order; ep / dp_shard / dp_hpz are blocks of consecutive row ranks, ep_dp / dp_replicate the
    columns across a row's blocks."""
    dims = _resolved(dims)
    for dim in MESH_DIMS:
        for g in dims.groups(dim):
            cs = [_coords(dims, r) for r in g]
            assert [c[dim] for c in cs] == list(range(dims.size(dim)))
            assert all(
                {k: v for k, v in c.items() if k != dim}
                == {k: v for k, v in cs[0].items() if k != dim}
                for c in cs
            )
    rows = dims.groups("dp_cp")
    for row in rows:
        cs = [_coords(dims, r) for r in row]
        assert [(c["dp"], c["cp"]) for c in cs] == [
            (d, c) for d in range(dims.dp) for c in range(dims.cp)
        ]
        assert len({(c["pp"], c["tp"]) for c in cs}) == 1

    def cut(size: int, columns: bool) -> list[list[int]]:
        out = []
        for row in rows:
            blocks = [row[i : i + size] for i in range(0, len(row), size)]
            out += [list(c) for c in zip(*blocks)] if columns else blocks
        return out

    shard = dims.size("dp_shard")
    assert dims.groups("ep") == cut(dims.ep, False) and dims.groups("ep_dp") == cut(dims.ep, True)
    assert dims.groups("dp_shard") == cut(shard, False)
    assert dims.groups("dp_replicate") == cut(shard, True)
    assert dims.groups("dp_hpz", 2) == cut(2, False)
    assert dims.group_span("dp_hpz", 2) == (2 - 1) * dims.tp + 1
    with pytest.raises(ValueError, match="hpZ group of 5 ranks"):
        dims.groups("dp_hpz", 5)


@pytest.mark.parametrize("dims", SHAPES, ids=str)
def test_a_ranks_place_is_its_index_in_its_group(dims):
    dims = _resolved(dims)
    for rank in range(dims.world_size):
        coords = {d: dims.group_of(d, rank).index(rank) for d in MESH_DIMS}
        assert dims.global_rank(coords) == rank
        for dim in (*MESH_DIMS, *DERIVED_DIMS):
            assert dims.derived_rank(dim, coords) == dims.group_of(dim, rank).index(rank)


def test_unresolved_degrees_have_no_groups():
    with pytest.raises(ValueError, match="not resolved"):
        ParallelDims(dp=-1).groups("dp")


def test_the_planning_stand_ins_are_mesh_and_comm_like():
    mesh = PlanningMesh(_resolved(SHAPES[1]), {"dp": 1, "cp": 1})
    assert isinstance(mesh, MeshLike)
    for comm in (mesh.comm("dp_cp"), mesh.backward_comm("ep"), mesh.hpz_comm(2), mesh.world):
        assert isinstance(comm, CommLike)


def test_the_real_mesh_and_comm_are_mesh_and_comm_like():
    """One in-process gloo rank (no other process): a world of 1."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = ParallelMesh(ParallelDims(), "cpu")
        assert isinstance(mesh, MeshLike)
        assert isinstance(mesh.comm("dp"), CommLike) and isinstance(Comm(), CommLike)
    finally:
        dist.destroy_process_group()
