"""The pipeline runtime against single-process training: every schedule, P = 2 and 4, M = 4 and 8.

One spawn per pipeline size (every test `multiprocess`) runs all schedules, both p2p semantics and
DualPipeV's units side by side; loss and gradients equal, bit for bit, single-process training on
the same micro-batches accumulated in the schedule's order. p2p volume per boundary equals the
formula (docs/design.md#pipeline-schedules). pp 2 × dp 2 (ZeRO 0-3, offload, constant buffers), a
stage without parameters and pp 2 × dp 2 × tp 2 + SP are held to tests/tolerance.py's bounds."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from dist_utils import coalescing_p2p, run_workers
from tolerance import ALL_KERNELS, KERNELS, assert_within, reference

from fivefold.config import Config
from fivefold.distributed.comm import Comm, CommLog
from fivefold.models import build_model, get_config
from fivefold.models.parallelize import build_stages
from fivefold.pipeline.builders import build_schedule
from fivefold.pipeline.runtime import PipelineRuntime
from fivefold.pipeline.simulator import Timeline

pytestmark = pytest.mark.multiprocess  # every test here starts processes

CFG = get_config("tiny", n_layers=8, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=8, vocab_size=17)
SEQ = 6
P2P = ("buffered", "rendezvous")
RUNS = [(name, M, V) for M in (4, 8)
        for name, V in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("dualpipev", 2))]


def _unsupported(name: str, P: int, M: int) -> bool:
    return name == "dualpipev" and M < 2 * P  # DualPipeV needs M >= 2P


def _batch(M: int, mb: int = 2):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, CFG.vocab_size, (M * mb, SEQ), generator=g)
    y = torch.randint(0, CFG.vocab_size, (M * mb, SEQ), generator=g)
    return x, y


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def _pipeline_worker() -> dict:
    """Every schedule under both p2p semantics: "buffered" on plain gloo (a work per message, look-ahead receives)
    and "rendezvous" with `batch_isend_irecv` returning one work per batch, as NCCL does."""
    comm = Comm(None, "pp", CommLog())
    P, out = comm.size, {}
    for name, M, V in RUNS:
        if _unsupported(name, P, M):
            continue
        for p2p in P2P:
            schedule = build_schedule(name, P, M, V)
            stages = build_stages(CFG, schedule.stages_of(comm.rank), schedule.n_stages, seed=0)
            runtime = PipelineRuntime(schedule, stages, comm, _loss, lambda mb: (mb, SEQ, CFG.dim), torch.float32,
                                      p2p=p2p)
            x, y = _batch(M)
            comm.log.reset()
            with coalescing_p2p() if p2p == "rendezvous" else contextlib.nullcontext([]) as batch_sizes:
                loss = runtime.step(list(x.chunk(M)), list(y.chunk(M)))
            grads = {n: p.grad.clone() for s in stages.values() for n, p in s.named_parameters()}
            p2p_log = [(r.op, r.numel) for r in comm.log.records]
            out[(name, M, V, p2p)] = dict(loss=None if loss is None else loss.item(), grads=grads, p2p=p2p_log,
                                          records=runtime.records, batch_sizes=batch_sizes)
        if schedule.side_by_side:  # the overlapped units side by side (the forward in a second thread)
            stages = build_stages(CFG, schedule.stages_of(comm.rank), schedule.n_stages, seed=0)
            runtime = PipelineRuntime(schedule, stages, comm, _loss, lambda mb: (mb, SEQ, CFG.dim), torch.float32,
                                      overlap=True)
            loss = runtime.step(list(x.chunk(M)), list(y.chunk(M)))
            grads = {n: p.grad.clone() for s in stages.values() for n, p in s.named_parameters()}
            out[(name, M, V, "overlap")] = dict(loss=None if loss is None else loss.item(), grads=grads,
                                                records=runtime.records, side_jobs=runtime._side.jobs_run,
                                                units=len(schedule.side_by_side[comm.rank]))
    # a coalescing backend cannot serve look-ahead receives: a clear error, not a hang or a KeyError
    schedule = build_schedule("1f1b", P, 4, 1)
    stages = build_stages(CFG, schedule.stages_of(comm.rank), schedule.n_stages, seed=0)
    runtime = PipelineRuntime(schedule, stages, comm, _loss, lambda mb: (mb, SEQ, CFG.dim), torch.float32,
                              p2p="buffered")
    x, y = _batch(4)
    try:
        with coalescing_p2p():
            runtime.step(list(x.chunk(4)), list(y.chunk(4)))
        out["buffered_on_coalescing"] = None
    except RuntimeError as e:
        out["buffered_on_coalescing"] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"pp{p}")
def pipeline_results(request):
    return request.param, run_workers(_pipeline_worker, request.param)


def _gradient_order(schedule) -> list[int]:
    """The order in which the schedule accumulates weight gradients (its B or W passes), the same on every stage
    (checked): the reference accumulates its micro-batches in that order, so the sums are the same sums."""
    orders = {tuple(a.microbatch for a in schedule.actions[schedule.rank_of(s)]
                    if a.stage == s and a.kind in ("B", "W")) for s in range(schedule.n_stages)}
    assert len(orders) == 1, f"{schedule.name}: stages accumulate in different orders {orders}"
    return list(orders.pop())


def _reference(M: int, order: tuple[int, ...]) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process training on the same micro-batches: each micro-batch's loss/M backward, gradients accumulated
    in `order`; the loss summed in forward order. The ops and the sums are the pipeline's: bit-equal."""
    model = build_model(CFG, seed=0)
    x, y = _batch(M)
    losses = {}
    for m in order:
        losses[m] = _loss(model(x.chunk(M)[m]), y.chunk(M)[m]) / M
        losses[m].backward()
    total = losses[0].detach()
    for m in range(1, M):
        total = total + losses[m].detach()
    return total.item(), {n: p.grad for n, p in model.named_parameters()}


def test_buffered_p2p_on_a_coalescing_backend_is_refused(pipeline_results):
    _, results = pipeline_results
    for r in results:
        msg = r["buffered_on_coalescing"]
        assert msg is not None and "rendezvous" in msg and "one work per message" in msg


@pytest.mark.parametrize("p2p", P2P)
@pytest.mark.parametrize("run", RUNS, ids=[f"{n}-M{m}-V{v}" for n, m, v in RUNS])
def test_pipeline_matches_single_process(pipeline_results, run, p2p):
    P, results = pipeline_results
    if _unsupported(run[0], P, run[1]):
        pytest.skip(f"{run[0]} needs M >= 2P")
    order = tuple(_gradient_order(build_schedule(run[0], P, run[1], run[2])))
    ref_loss, ref_grads = reference(_reference, run[1], order)
    run = (*run, p2p)
    if p2p == "rendezvous":  # the wrapper was in place: batches of several messages came back as one work
        assert any(n > 1 for n in results[0][run]["batch_sizes"])
    losses = [r[run]["loss"] for r in results]
    last = build_schedule(run[0], P, run[1], run[2]).stage_to_rank[-1]  # the rank of the last stage owns the loss
    assert losses[last] == ref_loss
    assert all(loss is None for rank, loss in enumerate(losses) if rank != last)
    seen = set()
    for r in results:
        for name, g in r[run]["grads"].items():
            assert torch.equal(g, ref_grads[name]), name
            seen.add(name)
    assert seen == set(ref_grads)  # every parameter lives on exactly one rank


@pytest.mark.parametrize("M", [4, 8])
def test_dualpipev_units_side_by_side_match_single_process(pipeline_results, M):
    """With ``overlap`` each (F, B) unit's forward runs on the side thread beside the backward: the same loss and
    gradients, every unit's forward was a side-thread job, and the passes that overlap on the measured clock are
    units' (F, B) pairs; none overlap without ``overlap``. (Whether a unit's passes do overlap in time is the
    machine's timing — on 2 cores shared by 4 ranks a tiny forward may finish before the backward is scheduled — so
    it is not asserted here; the MoE test and `fivefold bench ep` show it where the all-to-alls make passes wait.)"""
    P, results = pipeline_results
    if _unsupported("dualpipev", P, M):
        pytest.skip("dualpipev needs M >= 2P")
    ref_loss, ref_grads = reference(_reference, M, tuple(_gradient_order(build_schedule("dualpipev", P, M, 2))))
    run = ("dualpipev", M, 2, "overlap")
    assert results[0][run]["loss"] == ref_loss  # the loss stage is on rank 0
    for rank, r in enumerate(results):
        for name, g in r[run]["grads"].items():
            assert torch.equal(g, ref_grads[name]), name
        assert r[run]["side_jobs"] == r[run]["units"] > 0
        pairs = Timeline([r[run]["records"]]).overlapped(0)
        assert len(pairs) <= r[run]["units"], (rank, [f"{a} | {b}" for a, b in pairs])
        assert all({a.kind, b.kind} == {"F", "B"} and a.microbatch != b.microbatch for a, b in pairs)
        sequential = Timeline([r[("dualpipev", M, 2, "buffered")]["records"]])
        assert not sequential.overlapped(0)


@pytest.mark.parametrize("run", RUNS, ids=[f"{n}-M{m}-V{v}" for n, m, v in RUNS])
def test_pipeline_p2p_volume(pipeline_results, run):
    """Each stage boundary moves one activation forward and one gradient back per micro-batch."""
    P, results = pipeline_results
    name, M, V = run
    if _unsupported(name, P, M):
        pytest.skip(f"{name} needs M >= 2P")
    run = (*run, "rendezvous")
    mb_elems = 2 * SEQ * CFG.dim
    rank_of = build_schedule(name, P, M, V).stage_to_rank  # boundaries between stages on different ranks
    boundaries = sum(1 for s in range(P * V - 1) if rank_of[s] != rank_of[s + 1])
    sends = sum(sum(n for op, n in r[run]["p2p"] if op == "send") for r in results)
    recvs = sum(sum(n for op, n in r[run]["p2p"] if op == "recv") for r in results)
    assert sends == recvs == 2 * boundaries * M * mb_elems


# ---------------------------------------------------------------------------------------------
# pp 2 × dp 2: pipeline stages wrapped in ZeRO over the dp group, trained for several steps.
PPDP_STEPS, LR, WD, CLIP = 5, 1e-2, 0.1, 0.5
PPDP_RUNS = [("1f1b", 0), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("gpipe", 0),  # (schedule, zero stage)
             ("gpipe", 3), ("1f1b", 3), ("interleaved", 3), ("zb-h1", 3),  # pp x ZeRO-3: every schedule
             ("dualpipev", 1), ("dualpipev", 3),
             # ZeRO-R constant buffers (gather slots learned over the first two steps) and ZeRO-Offload
             ("1f1b", 3, "constant_buffers"), ("zb-h1", 3, "constant_buffers", "offload_optimizer"),
             ("interleaved", 2, "constant_buffers", "offload_optimizer")]
PPDP_EPS = 1e-4  # see EPS in test_zero.py: bounds Adam's 1/eps amplification of reduction-order noise


def _parts_config(name: str, zero: int, M: int, V: int, pp: int, dp: int, tp: int = 1, sp: bool = False) -> Config:
    """The trainer's config for a layout: the test builds its parts with the one assembly."""
    cfg = Config()
    cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.sp = pp, dp, tp, sp
    cfg.zero.stage = zero
    cfg.pipeline.schedule, cfg.pipeline.virtual = name, V
    cfg.train.lr, cfg.train.weight_decay, cfg.train.beta2, cfg.train.eps = LR, WD, 0.999, PPDP_EPS
    cfg.train.grad_accum, cfg.train.seq_len, cfg.train.seed = M, SEQ, 0
    return cfg


def _ppdp_worker() -> dict:
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    mesh = ParallelMesh(ParallelDims(pp=2, dp=2), "cpu", CommLog())
    dp = mesh.comm("dp")
    out = {}
    for run in PPDP_RUNS:
        (name, zero), options = run[:2], run[2:]
        M = 4
        V = 2 if name == "interleaved" else 1
        cfg = _parts_config(name, zero, M, V, pp=2, dp=2)
        for option in options:
            setattr(cfg.zero, option, True)
        parts = parallelize(cfg, CFG, mesh, "cpu")
        history = []
        for step in range(PPDP_STEPS):
            x, y = _step_batch(step)
            xs, ys = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
            parts.forward_backward(list(zip(xs.chunk(M), ys.chunk(M))))
            parts.step(CLIP)
            history.append(parts.full_state_dict())
        out[run] = history
    return out


def _step_batch(step: int, vocab: int = CFG.vocab_size):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, vocab, (16, SEQ), generator=g)
    return x, torch.randint(0, vocab, (16, SEQ), generator=g)


def _ppdp_reference(steps: int = PPDP_STEPS, cfg=CFG) -> list[dict[str, torch.Tensor]]:
    model = build_model(cfg, seed=0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, eps=PPDP_EPS)
    history = []
    for step in range(steps):
        x, y = _step_batch(step, cfg.vocab_size)
        opt.zero_grad()
        _loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


# The sums the layouts reorder: a weight gradient's 16 × SEQ tokens, split into micro-batches and ranks (and, in
# the 3-D mesh, a row-parallel inner dimension of at most ffn_hidden = 64 < 96 into two shards).
PPDP_TERMS = 16 * SEQ


@pytest.fixture(scope="module")
def ppdp_results():
    return run_workers(_ppdp_worker, 4)


@pytest.mark.parametrize("kernels", ALL_KERNELS)
@pytest.mark.parametrize("run", PPDP_RUNS, ids=["-".join([r[0], f"zero{r[1]}", *r[2:]]) for r in PPDP_RUNS])
def test_pp2_dp2_training_matches_single_process(ppdp_results, run, kernels):
    ref, bounds = reference(_ppdp_reference, kernels=kernels, terms=PPDP_TERMS)
    for rank, res in enumerate(ppdp_results):
        for step, got in enumerate(res[run]):
            assert got, "each rank holds some parameters"
            assert_within(got, ref[step], bounds[step], f"rank {rank} step {step}")


def _empty_stage_worker() -> list:
    """pp 3 with a middle stage holding no block (no parameters at all): its rank still takes part in the
    global norm's collectives, so every rank clips alike and nothing hangs."""
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    mesh = ParallelMesh(ParallelDims(pp=3, dp=1), "cpu", CommLog())
    cfg = _parts_config("1f1b", 1, 4, 1, pp=3, dp=1)
    cfg.pipeline.layers_per_stage = "3,0,5"
    parts = parallelize(cfg, CFG, mesh, "cpu")
    history = []
    for step in range(PPDP_STEPS):
        x, y = _step_batch(step)
        parts.forward_backward(list(zip(x.chunk(4), y.chunk(4))))
        parts.step(CLIP)
        history.append(parts.full_state_dict())
    return history


@pytest.fixture(scope="module")
def empty_stage_results():
    return run_workers(_empty_stage_worker, 3)


@pytest.mark.parametrize("kernels", KERNELS)
def test_pipeline_stage_without_parameters_trains_like_single_process(empty_stage_results, kernels):
    ref, bounds = reference(_ppdp_reference, kernels=kernels, terms=PPDP_TERMS)
    results = empty_stage_results
    assert not results[1][0], "the middle stage holds no parameters"
    for rank, history in enumerate(results):
        for step, got in enumerate(history):
            assert_within(got, ref[step], bounds[step], f"rank {rank} step {step}")


# ---------------------------------------------------------------------------------------------
# The 3-D mesh: pp 2 × dp 2 × tp 2 (+ SP), ZeRO-1 over dp, 1F1B — 8 processes, a few steps.
def _mesh3d_worker() -> dict:
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    mesh = ParallelMesh(ParallelDims(pp=2, dp=2, tp=2), "cpu", CommLog())
    dp, tp = mesh.comm("dp"), mesh.comm("tp")
    M = 2
    parts = parallelize(_parts_config("1f1b", 1, M, 1, pp=2, dp=2, tp=2, sp=True), CFG_3D, mesh, "cpu")
    history = []
    for step in range(3):
        x, y = _step_batch(step, CFG_3D.vocab_size)
        xs, ys = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
        parts.forward_backward(list(zip(xs.chunk(M), ys.chunk(M))))
        parts.step(CLIP)
        history.append(parts.full_state_dict())
    # where each parameter's TP slice comes from, as the plan declares it (what checkpoint resharding relies on)
    tp_dims = {n: pl.tp_dim for e in parts.engines.values() for n, pl in e.module.tp_placements.items()}
    return dict(history=history, tp_rank=tp.rank, tp_dims=tp_dims)


CFG_3D = get_config("tiny", n_layers=4, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=8, vocab_size=16)


@pytest.fixture(scope="module")
def mesh3d_results():
    return run_workers(_mesh3d_worker, 8)


@pytest.mark.parametrize("kernels", KERNELS)
def test_pp2_dp2_tp2_sp_training_matches_single_process(mesh3d_results, kernels):
    results = mesh3d_results
    ref, bounds = reference(_ppdp_reference, 3, CFG_3D, kernels=kernels, terms=PPDP_TERMS)
    for step in range(3):
        for rank, res in enumerate(results):
            for name, got in res["history"][step].items():
                dim, want = res["tp_dims"][name], ref[step][name]
                want = want if dim is None else want.chunk(2, dim)[res["tp_rank"]]  # this rank's slice
                bounds[step][name].assert_holds(got, want, f"rank {rank} step {step} {name}")
