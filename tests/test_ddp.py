"""DDP against single-process training, plus its communication counts and overlap.

One spawn per world size (2 and 3; every test `multiprocess`) runs every configuration: SGD and
AdamW, one parameter per bucket up to one bucket, accumulation, tied, frozen and unused weights.
Parameters after every step are held to the bound tests/tolerance.py derives from single-process
training on the workers' kernels; all-reduce count, payload and ring-wire bytes equal the formulas
(docs/design.md#data-parallel-traffic); the first bucket's all-reduce is issued before backward
ends."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import (
    build_toy,
    initial_state,
    lm_loss,
    make_optimizer,
    reference_training,
    run_workers,
    toy_batch,
)
from tolerance import KERNELS, assert_values_close, assert_within, reference

from fivefold.data_parallel import DDP
from fivefold.distributed.comm import Comm, CommLog

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 5
TINY_BUCKET_MB = 1e-9  # every parameter is its own bucket
HUGE_BUCKET_MB = 1e3  # one bucket
# tests/tolerance.py rule 1's n: the global batch's tokens (12 x 5), summed into a weight gradient in rank slices and
# micro-batches (the toy's widest inner dimension, 13, is shorter)
TERMS = 12 * 5

CONFIGS = [
    # (optimizer, bucket_mb, grad_accum)
    ("sgd", TINY_BUCKET_MB, 1),
    ("adamw", TINY_BUCKET_MB, 1),
    ("adamw", 64 * 4 / 2**20, 1),  # a few parameters per bucket
    ("adamw", HUGE_BUCKET_MB, 1),
    ("sgd", HUGE_BUCKET_MB, 2),
    ("adamw", 64 * 4 / 2**20, 2),
]


def _train_ddp(opt_kind: str, bucket_mb: float, grad_accum: int) -> dict:
    comm = Comm(None, "dp", CommLog())
    rank, world = comm.rank, comm.size
    # Different init per rank on purpose: DDP must broadcast rank 0's parameters.
    model = DDP(build_toy(seed=0 if rank == 0 else 99), comm, bucket_mb=bucket_mb)
    opt = make_optimizer(opt_kind, [p for p in model.parameters() if p.requires_grad])
    history, comm_per_step, micro_step_calls = [], [], []
    for step in range(STEPS):
        x, y = toy_batch(step)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]  # this rank's disjoint slice
        model.zero_grad()
        for micro, (xm, ym) in enumerate(zip(xs.chunk(grad_accum), ys.chunk(grad_accum))):
            comm.log.reset()
            last = micro == grad_accum - 1
            if last:
                (lm_loss(model(xm), ym) / grad_accum).backward()
            else:
                with model.no_sync():
                    (lm_loss(model(xm), ym) / grad_accum).backward()
                micro_step_calls.append(len(comm.log.records))
        comm_per_step.append(list(comm.log.records))
        opt.step()
        history.append({n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()})
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return dict(history=history, comm=comm_per_step, micro_calls=micro_step_calls,
                n_buckets=len(model.buckets), trainable=trainable,
                bucket_sizes=[b.layout.numel for b in model.buckets])


def _overlap_probe() -> dict:
    """With >= 2 buckets, the first bucket's all-reduce must be issued before backward ends."""
    log = CommLog()
    comm = Comm(None, "dp", log)
    model = DDP(build_toy(), comm, bucket_mb=TINY_BUCKET_MB)
    model.reducer.trace, model.reducer.trace_clock = [], log.next_seq
    x, y = toy_batch(0)
    log.reset()
    lm_loss(model(x), y).backward()
    ready = [seq for seq, event, _ in model.reducer.trace if event == "grad_ready"]
    launches = [r.seq for r in log.records if r.op == "all_reduce"]
    return dict(first_launch=min(launches), last_ready=max(ready), n_buckets=len(model.buckets))


def _unused_param_checks() -> dict:
    comm = Comm(None, "dp", CommLog())
    out = {}
    model = DDP(build_toy(unused=True), comm, bucket_mb=TINY_BUCKET_MB)
    x, y = toy_batch(0)
    try:
        lm_loss(model(x), y).backward()
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    dist.barrier()
    model = DDP(build_toy(unused=True), comm, bucket_mb=TINY_BUCKET_MB, find_unused=True)
    x, y = toy_batch(1)
    xs, ys = x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]
    lm_loss(model(xs), ys).backward()
    out["grads"] = {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()
                    if p.grad is not None}
    return out


def _worker() -> dict:
    return dict(runs=[_train_ddp(*cfg) for cfg in CONFIGS], overlap=_overlap_probe(),
                unused=_unused_param_checks())


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def ddp_results(request):
    return request.param, run_workers(_worker, request.param)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("cfg_index", range(len(CONFIGS)))
def test_ddp_matches_single_process(ddp_results, cfg_index, kernels):
    world, results = ddp_results
    opt_kind, _, grad_accum = CONFIGS[cfg_index]
    ref, bounds = reference(reference_training, STEPS, opt_kind, grad_accum, initial_state(build_toy()),
                            kernels=kernels, terms=TERMS)
    for rank, res in enumerate(results):
        hist = res["runs"][cfg_index]["history"]
        assert len(hist) == len(ref)
        for step, (got, want) in enumerate(zip(hist, ref)):
            assert got.keys() == want.keys()
            assert_within(got, want, bounds[step], f"rank {rank} step {step}")


def test_ddp_bucket_sizes_span_one_param_to_one_bucket(ddp_results):
    _, results = ddp_results
    runs = results[0]["runs"]
    trainable_tensors = len([p for p in build_toy().parameters() if p.requires_grad])
    assert runs[0]["n_buckets"] == trainable_tensors  # tied weight counted once, frozen excluded
    assert runs[3]["n_buckets"] == 1
    assert 1 < runs[2]["n_buckets"] < trainable_tensors
    cap = 64  # elements, the bucket size of CONFIGS[2]: closed once it reaches the cap
    assert all(s >= cap for s in runs[2]["bucket_sizes"][:-1])


@pytest.mark.parametrize("cfg_index", range(len(CONFIGS)))
def test_ddp_comm_log_matches_formula(ddp_results, cfg_index):
    world, results = ddp_results
    for res in results:
        run = res["runs"][cfg_index]
        psi = run["trainable"]
        assert run["micro_calls"] == [0] * (STEPS * (CONFIGS[cfg_index][2] - 1))  # no_sync: silent
        for records in run["comm"]:
            assert [r.op for r in records] == ["all_reduce"] * run["n_buckets"]
            assert sum(r.numel for r in records) == psi
            grad_bytes = psi * 4
            assert sum(r.payload_bytes for r in records) == grad_bytes
            assert sum(r.wire_bytes for r in records) == pytest.approx(2 * (world - 1) / world * grad_bytes)
            assert [r.tag for r in records] == [f"bucket{i}" for i in range(run["n_buckets"])]


def test_ddp_all_reduce_overlaps_backward(ddp_results):
    _, results = ddp_results
    for res in results:
        probe = res["overlap"]
        assert probe["n_buckets"] >= 2
        assert probe["first_launch"] < probe["last_ready"]


def test_ddp_unused_parameter(ddp_results):
    world, results = ddp_results
    for res in results:
        err = res["unused"]["error"]
        assert err is not None and "unused.weight" in err and "find_unused=True" in err
    # find_unused: the unused layer gets a zero gradient, the rest equals the full-batch gradient.
    want = reference(_unused_reference)
    scale = max(g.abs().max().item() for g in want.values())  # the largest gradient entry of the whole model
    for rank, res in enumerate(results):
        grads = res["unused"]["grads"]
        assert torch.count_nonzero(grads["unused.weight"]) == 0
        assert grads.keys() - {"unused.weight", "unused.bias"} == want.keys()
        for name, g in want.items():
            assert_values_close(grads[name], g, TERMS, f"rank {rank} {name}", scale=scale)


def _unused_reference() -> dict[str, torch.Tensor]:
    """The full-batch gradient of step 1's batch (the unused layer gets none)."""
    model = build_toy(unused=True)
    x, y = toy_batch(1)
    lm_loss(model(x), y).backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
