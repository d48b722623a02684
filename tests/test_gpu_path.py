"""The GPU path, checked on a machine without one (docs/gpus.md).

1. A dry run of one rank "on an accelerator": torch's `fake` process group (collectives complete at
   once, nothing is sent) and the `meta` device standing in for CUDA — tensors with shapes and
   dtypes but no storage, on a device that is not the CPU. Each layout (DDP, ZeRO-3, tp 2 + SP, pp
   2, pp × ZeRO-3 zero-bubble, a pipeline stage without blocks under tp, dp 2 × cp 2 ring attention
   with ZeRO-3, HSDP, ZeRO++ on dp 4; traced runs with the clocks on device events) runs three
   steps of the trainer's own `train_step` at the defaults (clipping, ``check_finite``), logging
   the first and the last. What fails here fails on CUDA + NCCL too: a CPU tensor handed to a collective
   (`Comm` refuses it) or mixed into a device op (torch refuses it). Every call that makes the host
   wait for the device is counted (`tests/host_syncs.py`: `.item()`, `bool(t)`, a device-to-host
   copy, a data-dependent shape, `torch.tensor(..., device=)`, a blocking host-to-device copy, a
   synchronize): an unlogged step makes none, a log step one (the loss, the norm and the count of
   skipped non-finite steps, `NonFiniteWatch`, in one copy), a traced step one more (its events), the first step also
   the global norm's index vectors. The optimizer is torch's fused AdamW, which skips a non-finite
   step on the device; ring attention runs CUDA's fused flash blocks (both have meta kernels). (`FakeTensorMode` with ``device="cuda"`` was the first choice; on a CPU-only torch
   build it cannot copy into a fake CUDA tensor — "PyTorch is not linked with support for cuda
   devices" — so `meta` stands in.)
2. Device rules (`launch.resolve_device`) with the accelerator API faked: one device per local rank,
   a clear error when local ranks exceed devices or the requested accelerator is absent.

Part 1 runs each rank in a fresh process (`multiprocess`); part 2 and the checks of host batches and
chunked fp32 cross-entropy run in-process."""

from __future__ import annotations

import concurrent.futures
import multiprocessing

import pytest
import torch
from tolerance import Bound, assert_values_close, unit_roundoff, value_bound

from bench import host_syncs
from fivefold.distributed import launch

LAYOUTS = {  # name: (world, dims, config overrides): bench/host_syncs.py's, and traced runs
    **host_syncs.LAYOUTS,
    # run.trace with its accelerator clock (device events; a host stand-in for torch.Event): no host sync either
    "zero3-recompute-traced": (2, dict(dp=2), dict(zero=3, recompute="full", trace=True)),
    "pp2-zb-traced": (2, dict(pp=2, dp=1), dict(zero=1, pp=2, schedule="zb-h1", trace=True)),
}
STEPS, LOG_EVERY = 3, 2  # steps 0 and 2 are logged (the first, the last); step 1 is the steady state


class _StandInEvent:
    """`torch.Event` as the tracer's clock uses it on an accelerator (record, elapsed_time), timed by the host."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        import time
        self.at = time.perf_counter()

    def elapsed_time(self, other: _StandInEvent) -> float:
        return (other.at - self.at) * 1e3


def _dry_run(name: str, rank: int) -> dict:
    """In a fresh process: one rank of `name` on the fake group and the meta device, stepped by the
    trainer at the defaults (clipping, ``check_finite``); host syncs on each step, logged or not."""
    import torch.distributed as dist
    from host_syncs import HostSyncs
    from torch.testing._internal.distributed.fake_pg import FakeStore

    host_syncs.meta_as_cuda()
    world, dims, o = LAYOUTS[name]
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        if o.get("trace"):  # every clock (the tracer's, the pipeline's) on device events, as on an accelerator
            from fivefold import clock
            plain_init = clock.DeviceClock.__init__

            def events_on_meta(self, device) -> None:
                plain_init(self, device)
                self.device_events = torch.device(device).type == "meta"
            clock.DeviceClock.__init__ = events_on_meta
            torch.Event, torch.accelerator.synchronize = _StandInEvent, lambda *a: None
        cfg, mesh, parts = host_syncs.build_rank(dims, o, LOG_EVERY)
        assert cfg.train.check_finite and cfg.train.grad_clip > 0  # the defaults, as a run has them
        on_meta = all(p.device.type == "meta" for e in parts.engines.values() for p in e.parameters())
        fused = all(e.optimizer.skips_on_device for e in parts.engines.values())
        refused = None
        try:  # the stand-in really is strict: a CPU tensor handed to a collective is refused
            mesh.comm("dp").all_reduce(torch.zeros(1))
        except RuntimeError as e:
            refused = str(e)
        trainer = host_syncs.stepping_trainer(cfg, parts, mesh, STEPS)
        tracer = None
        if o.get("trace"):  # (on an accelerator the step's end reads the events: one sync per traced step, by design)
            from fivefold.observe.trace import StepTracer
            tracer = StepTracer(parts.traced_modules(), mesh.comm_log, mesh.device)
            assert tracer.clock.device_events
        syncs, traced, results = [], [], []
        for step in range(STEPS):
            with HostSyncs(devices=("meta",)) as counter:
                if tracer is not None:
                    tracer.begin_step(step)
                results.append(trainer.train_step(step))
                if tracer is not None:
                    tracer.end_step(parts.action_marks())
            syncs.append(counter.where)
        if tracer is not None:
            traced = [dict(__import__("collections").Counter(e["cat"] for e in s["events"]),
                           clock=tracer.result()["clock"]) for s in tracer.steps]
        last = results[-1]
        return dict(syncs=syncs, logged=[r.logged for r in results], on_meta=on_meta, fused=fused,
                    refused=refused, loss_device=str(last.loss.device), norm_device=str(last.grad_norm.device),
                    traced=traced)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dry_runs():
    """Every layout's first and last rank, one fresh process each (the fake group is process-global)."""
    ctx = multiprocessing.get_context("spawn")
    jobs = {(name, rank): (name, rank) for name, (world, _, _) in LAYOUTS.items() for rank in sorted({0, world - 1})}
    with concurrent.futures.ProcessPoolExecutor(max_workers=2, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = {key: pool.submit(_dry_run, *args) for key, args in jobs.items()}
        return {key: f.result(timeout=300) for key, f in futures.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_training_step_runs_on_an_accelerator_without_host_syncs(dry_runs, name):
    for (layout, rank), r in dry_runs.items():
        if layout != name:
            continue
        assert r["on_meta"], f"rank {rank}: parameters left the device"
        assert r["refused"] is not None and "is on cpu" in r["refused"], r["refused"]
        assert r["loss_device"] == r["norm_device"] == "meta"
        assert r["fused"], f"rank {rank}: the optimizer cannot skip a step on the device"
        assert r["logged"] == [True, False, True]
        traced = 1 if LAYOUTS[name][2].get("trace") else 0  # the step's end reads the events
        for step, where in enumerate(r["syncs"]):
            if step == 0:  # once: the global norm's fold indices are made on the device
                where = [w for w in where if "_fold_index" not in w]
            # a log step reads the loss, the norm and the count of skipped non-finite steps in one
            # copy; no other step waits for the device
            declared = (1 if r["logged"][step] else 0) + traced
            assert len(where) == declared, \
                f"{name} rank {rank} step {step}: {len(where)} host syncs (declared: {declared})\n" + "\n".join(where[:4])
        if LAYOUTS[name][2].get("trace"):  # spans and timed collectives on the event clock, every step
            assert len(r["traced"]) == STEPS
            for cats in r["traced"]:
                assert cats["clock"] == "device events"
                assert cats.get("forward", 0) >= 4 and cats.get("backward", 0) >= 4 and cats.get("collective"), cats
                if "recompute" in name:
                    assert cats["recompute"] == 2 * 4, cats  # 2 blocks × 4 micro-batches
                if "pp2" in name:
                    assert cats["pipeline"] == 3 * 4, cats  # F, I, W × 4 micro-batches


# ---------------------------------------------------------------------------------------------
# Device rules, with torch.accelerator faked: this machine has none.
class _FakeAccelerator:
    def __init__(self, kind: str | None, count: int) -> None:
        self.kind, self.count, self.current = kind, count, None

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.accelerator, "is_available", lambda: self.kind is not None)
        monkeypatch.setattr(torch.accelerator, "current_accelerator",
                            lambda *a, **k: torch.device(self.kind) if self.kind else None)
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: self.count)
        monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: setattr(self, "current", i))


@pytest.mark.parametrize("local_rank, requested, want", [
    (0, "auto", "cuda:0"), (3, "auto", "cuda:3"), (3, "cuda", "cuda:3"), (1, "cuda:0", "cuda:0"), (5, "cpu", "cpu")])
def test_each_local_rank_gets_its_own_device(monkeypatch, local_rank, requested, want):
    fake = _FakeAccelerator("cuda", 4)
    fake.install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert launch.resolve_device(requested) == torch.device(want)
    assert fake.current == (None if want == "cpu" else torch.device(want).index)


def test_more_local_ranks_than_devices_is_an_error(monkeypatch):
    _FakeAccelerator("cuda", 4).install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match=r"local rank 4 needs cuda device 4, but this node has 4: start at most 4 "
                                         r"processes per node \(torchrun --nproc-per-node 4\)"):
        launch.resolve_device("auto")


def test_a_missing_accelerator_is_named(monkeypatch):
    _FakeAccelerator(None, 0).install(monkeypatch)
    assert launch.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="run.device='cuda' but torch sees no accelerator here"):
        launch.resolve_device("cuda")
    with pytest.raises(ValueError, match="is not a device"):
        launch.resolve_device("gpu")


def test_init_binds_the_device_and_picks_its_backend(monkeypatch):
    """Under torchrun: the backend follows the resolved device (CPU -> gloo even on a GPU node) and an accelerator
    is passed as device_id (eager communicators, sub-groups split from them)."""
    calls = []
    monkeypatch.setattr(launch.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(launch.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    launch.init_distributed(torch.device("cpu"))
    launch.init_distributed(torch.device("cuda", 2))
    assert calls[0][0] == "gloo" and calls[0][1]["device_id"] is None
    assert calls[1][0] == "nccl" and calls[1][1]["device_id"] == torch.device("cuda", 2)


def test_host_batches_stay_put_on_the_cpu():
    x = torch.arange(6)
    assert launch.to_device(x, torch.device("cpu")) is x


# ---------------------------------------------------------------------------------------------
# The loss on low-precision logits: fp32 math, no full-vocabulary fp32 copy.
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_is_fp32_math_in_chunks(dtype):
    """No fp32 tensor larger than one chunk of rows besides, for fp32 logits, their gradient (F.cross_entropy would
    keep an [N, V] fp32 log-softmax)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.models.loss import lm_cross_entropy

    class FP32Sizes(TorchDispatchMode):
        sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            inputs = {a.untyped_storage().data_ptr() for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)}
            out = func(*args, **kwargs)
            for t in out if isinstance(out, tuple | list) else [out]:  # new storage only: a view is no copy
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 \
                        and t.untyped_storage().data_ptr() not in inputs:
                    self.sizes.append(t.numel())
            return out

    g = torch.Generator().manual_seed(0)
    N, V, chunk = 37, 50, 8
    logits = (torch.randn(N, V, generator=g) * 3).to(dtype).requires_grad_()
    target = torch.randint(0, V, (N,), generator=g)
    ref_logits = logits.detach().float().requires_grad_()
    ref = torch.nn.functional.cross_entropy(ref_logits, target)
    ref.backward()
    with FP32Sizes() as seen:
        loss = lm_cross_entropy(logits.view(1, N, V), target.view(1, N), chunk_rows=chunk)
        loss.backward()
    assert loss.dtype == torch.float32
    # The same fp32 math on the same (rounded) logits, its sums in another order: the longest is a row's logsumexp
    # over V (the mean over N rows is shorter) (rule 1 of tests/tolerance.py). The gradient is then rounded once to
    # the logits' dtype: u(dtype) relative on top.
    assert_values_close(loss, ref.detach(), V, "loss")
    sums = value_bound(V, ref_logits.grad)
    Bound(sums.rtol + unit_roundoff(dtype), sums.atol).assert_holds(logits.grad.float(), ref_logits.grad, "gradient")
    large = [n for n in seen.sizes if n > chunk * V]
    allowed = [N * V] if dtype == torch.float32 else []  # the gradient itself
    assert large == allowed, f"fp32 tensors of {large} elements (a chunk is {chunk * V})"
