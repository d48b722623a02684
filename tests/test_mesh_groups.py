"""The derived process groups at world 8, against the layout computed here from the grid.

dp_cp (gradients and loss over dp × cp), ep carved from dp × cp and its complement ep_dp, HSDP's
dp_shard and dp_replicate: every rank's membership for six layouts against world = pp × dp × cp × tp
(tp innermost), computed independently of the mesh code; `ParallelDims.derived_rank` / `group_span`
(what `fivefold plan` uses) say the same without processes. The group tests spawn 8 gloo ranks
(`multiprocess`). And every rank makes the same groups in the same order, the mesh and the model
built for each rank of a layout in turn on torch's fake process group in this process (NCCL splits
a new group from the world's communicator, which every rank must join; gloo never hangs)."""

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
    # Ulysses × ring: each cp group cut into blocks of cp_ulysses consecutive ranks and the columns across them
    "dp2-cp4-ulysses2": ParallelDims(dp=2, cp=4, cp_ulysses=2),
    "cp4-tp2-ulysses2": ParallelDims(dp=1, cp=4, tp=2, cp_ulysses=2),
    "dp4-cp2-ulysses2": ParallelDims(dp=4, cp=2, cp_ulysses=2),  # pure Ulysses: the cp group, the ring each alone
}


def _worker() -> dict:
    out = {}
    for name, dims in LAYOUTS.items():
        mesh = ParallelMesh(dims, "cpu", CommLog())
        ranks = {dim: mesh.rank(dim) for dim in DERIVED_DIMS}  # before any comm was asked for
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
    cp, u, c = ranks(("cp",)), dims.cp_ulysses, coords["cp"]  # Ulysses: consecutive cp ranks; the ring across
    cp_ulysses = cp[c // u * u:(c // u + 1) * u]
    cp_ring = [r for i, r in enumerate(cp) if i % u == c % u]
    return dict(pp=ranks(("pp",)), dp=ranks(("dp",)), cp=cp, tp=ranks(("tp",)), dp_cp=dp_cp, ep=ep,
                ep_dp=ep_dp, dp_shard=dp_shard, dp_replicate=dp_replicate, cp_ulysses=cp_ulysses, cp_ring=cp_ring)


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


# ---------------------------------------------------------------------------------------------
# Every rank makes the same groups in the same order (in-process: the fake process group).
# Under NCCL with a bound device_id, torch makes a group by splitting the world's communicator
# (ncclCommSplit), which every rank must join: a group made on some ranks only (a lazily made one,
# or one with use_local_synchronization) hangs them. gloo never shows it, so the calls are recorded.
def _model_config(moe: dict | None = None, n_layers: int = 2):
    from fivefold.models import get_config
    from fivefold.models.moe import MoEConfig

    return get_config("tiny", n_layers=n_layers, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=8,
                      vocab_size=16, moe=MoEConfig(experts=4, top_k=1, **moe) if moe is not None else None)


BUILDS = {  # name: (world, mesh dims, config overrides, MoE (None: dense), device)
    "dp4-zero2": (4, dict(dp=4), dict(zero=2), None, "meta"),
    "dp2-tp2-sp": (4, dict(dp=2, tp=2), dict(zero=1, tp=2, sp=True), None, "meta"),
    "pp2-dp2-1f1b": (4, dict(pp=2, dp=2), dict(zero=1, pp=2), None, "meta"),
    "dp2-cp2-zero3": (4, dict(dp=2, cp=2), dict(zero=3, cp=2), None, "meta"),
    "dp4-ep2-moe": (4, dict(dp=4, ep=2), dict(zero=1, ep=2), {}, "meta"),
    "hsdp-dp4-replicate2": (4, dict(dp=4, dp_replicate=2), dict(zero=2, dp_replicate=2), None, "meta"),
    "zeropp-hpz2": (4, dict(dp=4), dict(zero=3, qwz=True, hpz=2), None, "meta"),
    # no degree-1 mesh dim: the ranks alone (ep 1, dp_replicate 1) are made by every rank
    "pp2-dp2-cp2-tp2": (16, dict(pp=2, dp=2, cp=2, tp=2), dict(zero=1, pp=2, cp=2, tp=2), None, "meta"),
    # the hang of issue 28: ep 1, pp 2, the first stage without an MoE block (every second one is)
    "pp2-ep1-moe-dense-stage": (2, dict(pp=2, dp=1), dict(zero=1, pp=2), dict(every=2), "meta"),
    # debug mode's gloo side groups (made by their members alone: gloo splits nothing) in one order everywhere
    "pp2-ep1-moe-dense-stage-debug": (2, dict(pp=2, dp=1), dict(zero=1, pp=2, debug=True), dict(every=2), "meta"),
    "pp2-dp2-ep2-moe-dense-stage": (4, dict(pp=2, dp=2, ep=2), dict(zero=1, pp=2, ep=2), dict(every=2), "meta"),
    # DualPipeV's overlapped units (CPU only): the backward's twin of ep, on every rank (4 blocks, the last MoE:
    # rank 1's two stages have none)
    "pp2-dp2-ep2-dualpipev-overlap": (4, dict(pp=2, dp=2, ep=2), dict(zero=1, pp=2, ep=2, schedule="dualpipev",
                                                                       overlap="on", layers=4), dict(every=4), "cpu"),
}
_CREATORS = ("new_group", "new_subgroups_by_enumeration", "split_group")


def _build_and_record(name: str, rank: int, monkeypatch) -> tuple[list[tuple], list[tuple]]:
    """Rank `rank` of the layout on the fake group: the mesh and the model built as the trainer does, every
    group-creating call recorded (its ranks and flags); then those made when every group and comm is asked for."""
    import torch.distributed.device_mesh as device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fivefold.config import Config
    from fivefold.models.parallelize import parallelize

    world, dims, o, moe, device = BUILDS[name]
    calls: list[tuple] = []

    def recording(fn_name, fn):
        def wrapper(*args, **kwargs):
            ranks = kwargs.get("ranks", kwargs.get("split_ranks", kwargs.get("ranks_per_subgroup_list",
                                                                              args[0] if args else None)))
            if fn_name == "split_group":
                ranks = kwargs.get("split_ranks", args[1] if len(args) > 1 else None)
            flags = {k: str(v) for k, v in kwargs.items() if k in ("use_local_synchronization", "backend")}
            calls.append((fn_name, None if ranks is None else repr(ranks), tuple(sorted(flags.items()))))
            if kwargs.get("backend") == "gloo":  # (debug mode's side groups: the fake group stands in for gloo)
                kwargs["backend"] = None
            return fn(*args, **kwargs)
        return wrapper

    c10d = dist.distributed_c10d
    for fn_name in _CREATORS:
        fn = getattr(c10d, fn_name)
        for module in (dist, c10d, device_mesh):
            if hasattr(module, fn_name):
                monkeypatch.setattr(module, fn_name, recording(fn_name, fn))
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        cfg = Config()
        cfg.zero.stage, cfg.zero.bucket_mb = o["zero"], 0.01
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sp = o.get("tp", 1), o.get("pp", 1), o.get("sp", False)
        cfg.parallel.cp, cfg.parallel.ep = o.get("cp", 1), o.get("ep", 1)
        cfg.parallel.dp_replicate = o.get("dp_replicate", 1)
        cfg.zero.qwz, cfg.zero.hpz = o.get("qwz", False), o.get("hpz", 0)
        cfg.pipeline.schedule, cfg.pipeline.overlap = o.get("schedule", "1f1b"), o.get("overlap", "off")
        cfg.train.grad_accum, cfg.train.seq_len = 4, 8
        mesh = ParallelMesh(ParallelDims(**dims), device, CommLog(), debug_collectives=o.get("debug", False))
        parallelize(cfg, _model_config(moe, o.get("layers", 2)), mesh, device)
        made = len(calls)
        for dim in (*MESH_DIMS, *DERIVED_DIMS):
            mesh.group(dim)
            mesh.comm(dim)
        return calls[:made], calls[made:]
    finally:
        dist.destroy_process_group()
        monkeypatch.undo()


def _members_only(call: tuple) -> bool:
    return ("use_local_synchronization", "True") in call[2]


@pytest.mark.parametrize("name", list(BUILDS))
def test_every_rank_makes_the_same_groups_in_the_same_order(name, monkeypatch):
    """The same calls on every rank, in one order; a group made by its members alone only for debug mode's gloo side
    groups (gloo splits no communicator), each made by all its members at the same index (torch names such a group
    from its ranks and the count of groups made before)."""
    world = BUILDS[name][0]
    built = [_build_and_record(name, rank, monkeypatch) for rank in range(world)]
    sequences = [[(fn, "members only" if _members_only(c) else ranks, flags) for c in calls
                  for fn, ranks, flags in [c]] for calls, _ in built]
    assert sequences[0], "no group recorded: the recorder missed the calls"
    for rank, calls in enumerate(sequences):
        assert calls == sequences[0], f"{name}: rank {rank} makes other groups than rank 0 (first difference at " \
            f"{next(i for i, (a, b) in enumerate(zip(calls + [None], sequences[0] + [None])) if a != b)})"
    for rank, (calls, later) in enumerate(built):
        for i, call in enumerate(calls):
            if _members_only(call):
                assert ("backend", "gloo") in call[2], f"{name} rank {rank}: made by its members alone: {call}"
                members = eval(call[1])  # (the recorded repr of a list of ints)
                assert all(built[m][0][i] == call for m in members), f"{name}: {call} at {i} not on all members"
        assert not later, f"{name} rank {rank}: groups made on demand: {later}"  # asking for one makes none
