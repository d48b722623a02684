"""The host-sync detector (`tests/host_syncs.py`) and the non-finite check without a host sync
(docs/gpus.md#no-host-sync-in-a-step), in-process.

1. Controls: every call the detector wraps is counted when it touches the device that plays the
   accelerator (``meta``), and the look-alikes that do not block are not (a non-blocking copy,
   `repeat_interleave` with ``output_size``, a host tensor); on the CPU path it counts with real
   values. A planted `.item()` in a step is caught.
2. ``train.check_finite`` on a fused optimizer (`NonFiniteWatch`): a non-finite gradient is skipped
   on the device, so the weights and the AdamW state equal those before it, bit for bit, and the
   step reads nothing on the host; the next `confirm` (a log step) raises `NonFiniteGradient`. A
   finite step equals a step without the watch, bit for bit. The CPU has fused AdamW kernels, so
   this runs the real kernels on one in-process gloo rank (a world of 1)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from host_syncs import HostSyncs
from torch import nn

from fivefold.data_parallel import ZeroDataParallel
from fivefold.distributed.comm import Comm, CommLog
from fivefold.optim.clip import NonFiniteGradient, NonFiniteWatch, _fold_index, step_together


def _first(syncs: HostSyncs) -> list[str]:
    return [w.splitlines()[0] for w in syncs.where]


def test_each_blocking_call_on_the_device_is_counted_once():
    t = torch.ones(4, device="meta")
    calls = {
        "Tensor.item:": lambda: t.sum().item(),
        "Tensor.tolist:": lambda: t.tolist(),
        "Tensor.__bool__:": lambda: bool(t.sum() > 0),
        "aten._local_scalar_dense.default:": lambda: int(t.sum()),
        "Tensor.cpu:": lambda: t.cpu(),
        "torch.tensor(..., device=):": lambda: torch.tensor([1.0, 2.0], device="meta"),
        "torch.as_tensor(..., device=):": lambda: torch.as_tensor([1.0], device="meta"),
        "Tensor.to(host -> device):": lambda: torch.ones(2).to("meta"),
        "torch.repeat_interleave:": lambda: torch.repeat_interleave(
            t, torch.ones(4, dtype=torch.long, device="meta")),
        "torch.accelerator.synchronize:": lambda: torch.accelerator.synchronize(),
    }
    for name, call in calls.items():
        with HostSyncs(devices=("meta",)) as syncs:
            call()
        assert _first(syncs) == [name], (name, _first(syncs))


def test_what_does_not_block_is_not_counted():
    t = torch.ones(4, device="meta")
    with HostSyncs(devices=("meta",)) as syncs:
        torch.ones(2).to("meta", non_blocking=True)  # a pinned batch's asynchronous copy
        torch.repeat_interleave(t, torch.ones(4, dtype=torch.long, device="meta"), output_size=4)
        torch.full((), 3.0, device="meta")  # a fill kernel: the value is its argument
        torch.ones(3).sum().item()  # a host tensor
        torch.tensor([1, 2])  # made on the host
        (t * 2).sum()
    assert syncs.count == 0, syncs.where


def test_on_the_cpu_path_it_counts_with_real_values():
    with HostSyncs(devices=("cpu",)) as syncs:
        counts = torch.bincount(torch.tensor([1, 2, 2]), minlength=4)
        assert counts.tolist() == [0, 1, 2, 0]
        assert torch.arange(3).nonzero().shape == (2, 1)
    assert _first(syncs) == ["torch.bincount:", "Tensor.tolist:", "Tensor.nonzero:"]


def test_the_fold_indices_of_the_global_norm_are_made_once_per_device():
    _fold_index(1, 4, torch.device("meta"))
    with HostSyncs(devices=("meta",)) as syncs:
        _fold_index(1, 4, torch.device("meta"))
        _fold_index(2, 8, torch.device("meta"))  # another vector: made now
    assert _first(syncs) == ["torch.tensor(..., device=):"]


# -- check_finite on the device ----------------------------------------------------------------
@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield Comm(None, "dp", CommLog())
    finally:
        dist.destroy_process_group()


def _engine(comm: Comm, stage: int) -> ZeroDataParallel:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return ZeroDataParallel(module, comm, zero_stage=stage, bucket_mb=0.001, lr=1e-2,
                            weight_decay=0.1, fused=True)


def _backward(engine: ZeroDataParallel, poison: bool) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    loss = engine(x).square().mean()
    (loss * float("inf") if poison else loss).backward()


def _snapshot(engine: ZeroDataParallel) -> list[torch.Tensor]:
    """The weights, then every AdamW state tensor (moments, step counts)."""
    state = [v.clone() for s in engine.optimizer.state.values() for v in s.values()]
    return [p.detach().clone() for p in engine.parameters()] + state


@pytest.mark.parametrize("stage", [0, 3])
def test_a_non_finite_step_is_skipped_on_the_device_and_stops_at_the_log_step(world_of_one, stage):
    engine, plain = _engine(world_of_one, stage), _engine(world_of_one, stage)
    watch = NonFiniteWatch()
    assert engine.optimizer.skips_on_device
    for e in (engine, plain):  # one finite step each: the AdamW state exists
        _backward(e, poison=False)
        step_together([e], 1.0, check_finite=True, watch=watch if e is engine else None)
    watch.confirm()
    assert all(torch.equal(a, b) for a, b in zip(_snapshot(engine), _snapshot(plain), strict=True))
    before = _snapshot(engine)
    _backward(engine, poison=True)
    with HostSyncs(devices=("cpu",)) as syncs:  # the CPU plays the device: nothing read
        step_together([engine], 1.0, check_finite=True, watch=watch)
    assert syncs.count == 0, syncs.where
    after = _snapshot(engine)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)  # weights, moments and step counts as they were
    _backward(engine, poison=False)  # the next finite step is applied (and counted: 1 of 2)
    step_together([engine], 1.0, check_finite=True, watch=watch)
    with pytest.raises(NonFiniteGradient, match="1 of the last 2 steps"):
        watch.confirm()
    watch.confirm()  # read: the count starts again


def test_without_a_fused_optimizer_the_norm_is_read_at_once(world_of_one):
    torch.manual_seed(0)
    engine = ZeroDataParallel(nn.Linear(4, 4), world_of_one, zero_stage=1, lr=1e-2)
    assert not engine.optimizer.skips_on_device
    x = torch.randn(2, 4)
    (engine(x).sum() * float("nan")).backward()
    with pytest.raises(NonFiniteGradient, match="first non-finite gradient"):
        step_together([engine], 1.0, check_finite=True, watch=NonFiniteWatch())


def test_a_planted_item_in_a_step_is_caught():
    """The control: the same step on meta, once clean and once with the `.item()` a log line
    would add."""
    model = nn.Linear(4, 4, device="meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    x = torch.ones(2, 4, device="meta")
    counts = []
    for planted in (False, True):
        with HostSyncs(devices=("meta",)) as syncs:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            if planted:
                print(f"loss {loss.item():.3f}")
        counts.append(_first(syncs))
    assert counts == [[], ["Tensor.item:"]]
