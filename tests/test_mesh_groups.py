"""The derived process groups at world 8, against the layout computed here from the grid.

dp_cp (gradients and loss over dp × cp), ep carved from dp × cp and its complement ep_dp, HSDP's
dp_shard and dp_replicate: every rank's membership for six layouts against world = pp × dp × cp × tp
(tp innermost), computed independently of the mesh code; `ParallelDims.derived_rank` / `group_span`
(what `fivefold plan` uses) say the same without processes. The group tests spawn 8 gloo ranks
(`multiprocess`)."""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist
from dist_utils import run_workers

from fivefold.distributed.comm import CommLog
from fivefold.distributed.mesh import DERIVED_DIMS, MESH_DIMS, ParallelDims, ParallelMesh

LAYOUTS = {
    "dp2-cp2-tp2-ep2": ParallelDims(pp=1, dp=2, cp=2, tp=2, ep=2),
    "pp2-dp4-ep2": ParallelDims(pp=2, dp=4, ep=2),
    "dp2-cp2-pp2-ep4": ParallelDims(pp=2, dp=2, cp=2, ep=4),
    "pp2-dp2-tp2": ParallelDims(pp=2, dp=2, tp=2),  # cp = ep = 1: dp_cp and ep_dp are dp, ep is each rank alone
    # HSDP: shard groups of dp/2 × cp consecutive dp_cp ranks, replicas at the same place in each (with ep beside)
    "dp4-cp2-replicate2-ep2": ParallelDims(dp=4, cp=2, ep=2, dp_replicate=2),
    "pp2-dp2-cp2-replicate2": ParallelDims(pp=2, dp=2, cp=2, dp_replicate=2),
}


def _worker() -> dict:
    out = {}
    for name, dims in LAYOUTS.items():
        mesh = ParallelMesh(dims, "cpu", CommLog())
        ranks = {dim: mesh.rank(dim) for dim in DERIVED_DIMS}  # before anything asked for a group (ep = 1 is lazy)
        out[name] = {dim: sorted(dist.get_process_group_ranks(mesh.group(dim))) for dim in (*MESH_DIMS, *DERIVED_DIMS)}
        out[name]["sizes"] = {dim: (mesh.size(dim), mesh.comm(dim).size) for dim in (*MESH_DIMS, *DERIVED_DIMS)}
        out[name]["ranks"] = {dim: (ranks[dim], mesh.comm(dim).rank) for dim in DERIVED_DIMS}
        out[name]["coords"] = {dim: mesh.rank(dim) for dim in MESH_DIMS}
    return out


@pytest.fixture(scope="module")
def groups():
    return run_workers(_worker, 8)


def _expected(dims: ParallelDims, rank: int) -> dict[str, list[int]]:
    """Coordinates in row-major (pp, dp, cp, tp); groups vary the named coordinates, fix the rest."""
    shape = dims.shape()
    coords = _coords(dims, rank)

    def ranks(varying: tuple[str, ...]) -> list[int]:
        out = []
        for c in itertools.product(*(range(getattr(dims, d)) if d in varying else [coords[d]] for d in MESH_DIMS)):
            out.append(sum(v * _stride(shape, i) for i, v in enumerate(c)))
        return sorted(out)

    dp_cp = ranks(("dp", "cp"))  # in (dp, cp) order = sorted, since tp is innermost
    position = dp_cp.index(rank)
    block = position // dims.ep
    ep = dp_cp[block * dims.ep:(block + 1) * dims.ep]
    ep_dp = [r for i, r in enumerate(dp_cp) if i % dims.ep == position % dims.ep]
    # HSDP: a shard group is dp/dp_replicate dp coordinates with all their cp ranks; replicas differ in dp // that only
    per_shard = dims.dp // dims.dp_replicate
    dp_shard = [r for r in dp_cp if _coords(dims, r)["dp"] // per_shard == coords["dp"] // per_shard]
    dp_replicate = [r for r in dp_cp if _coords(dims, r)["dp"] % per_shard == coords["dp"] % per_shard
                    and _coords(dims, r)["cp"] == coords["cp"]]
    return dict(pp=ranks(("pp",)), dp=ranks(("dp",)), cp=ranks(("cp",)), tp=ranks(("tp",)), dp_cp=dp_cp, ep=ep,
                ep_dp=ep_dp, dp_shard=dp_shard, dp_replicate=dp_replicate)


def _coords(dims: ParallelDims, rank: int) -> dict[str, int]:
    shape = dims.shape()
    return dict(zip(MESH_DIMS, next(c for c in itertools.product(*map(range, shape))
                                    if sum(v * _stride(shape, i) for i, v in enumerate(c)) == rank)))


def _stride(shape: tuple[int, ...], i: int) -> int:
    out = 1
    for n in shape[i + 1:]:
        out *= n
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_rank_is_in_the_groups_of_its_coordinates(groups, layout):
    dims = LAYOUTS[layout].resolve(8)
    for rank, res in enumerate(groups):
        got = res[layout]
        want = _expected(dims, rank)
        for dim, members in want.items():
            assert got[dim] == members, f"{layout} rank {rank} {dim}"
        for dim, (size, comm_size) in got["sizes"].items():
            assert size == comm_size == len(want[dim]), f"{layout} rank {rank} {dim} size"
        for dim, (r, comm_rank) in got["ranks"].items():
            assert r == comm_rank == want[dim].index(rank), f"{layout} rank {rank} {dim} rank"


def test_ep_must_divide_dp_times_cp():
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide dp\(2\) × cp\(2\) = 4"):
        ParallelDims(dp=2, cp=2, ep=3).resolve(4)
    assert ParallelDims(dp=-1, cp=2, ep=4).resolve(8).dp == 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_layout_without_processes_matches_the_groups(groups, layout):
    """`ParallelDims.derived_rank` / `group_span` (what `fivefold plan` uses, no process group) against the real
    groups: every rank's place in each derived group, and each group's span of consecutive global ranks."""
    dims = LAYOUTS[layout].resolve(8)
    for rank, res in enumerate(groups):
        r = res[layout]
        for dim in DERIVED_DIMS:
            assert dims.derived_rank(dim, r["coords"]) == r["ranks"][dim][0], (rank, dim)
        for dim in (*MESH_DIMS, *DERIVED_DIMS):
            members = r[dim]
            assert dims.group_span(dim) == max(members) - min(members) + 1, (rank, dim, members)
