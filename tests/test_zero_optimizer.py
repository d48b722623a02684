"""The optimizer on shards (docs/design.md#mechanisms, docs/design.md#offload-and-constant-buffers), in-process.

1. The segmentation of a master shard is chosen by where it lives: cache-sized segments stepped one tensor at a
   time on the CPU, whole shards with fused (else multi-tensor) kernels elsewhere; both step alike (bit-equal
   without clipping: AdamW is elementwise), and a checkpoint saved under one loads under the other (the state is
   saved per parameter in global coordinates, whatever the cut).
2. On the accelerator path (fake process group, `meta` standing in for CUDA, fused kernels admitted on meta as on
   CUDA) an optimizer step (norm, clip, AdamW, write-back) dispatches at most 5 operations per flat buffer.
3. Offload: every flat's gradient copy to the host starts before the host steps any, and the host waits for each
   flat's own arrival event just before stepping it (stand-in events on meta); the host step's threads follow the
   local share of the cores unless the user set OMP_NUM_THREADS. Bit-equality of the overlapped host step with
   the plain engine: tests/test_zero_offload_buffers.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fivefold.data_parallel import flat_param, offload
from fivefold.data_parallel.flat_param import (
    CacheSizedSegments,
    FlatParam,
    WholeShards,
    segmentation_for,
)
from fivefold.data_parallel.offload import MasterOnHost, host_step_threads, host_step_threads_for
from fivefold.data_parallel.sharded_optimizer import ShardedOptimizer


class _OneRank:
    """A group of one rank: the attributes the optimizer reads; nothing is issued."""

    size, rank, dim = 1, 0, "dp"

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)


def _params(device: str = "cpu", seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"w1": (40, 70), "b1": (70,), "w2": (70, 30), "norm": (30,), "w3": (30, 55)}
    return [(n, nn.Parameter(torch.randn(*s, generator=gen).to(device))) for n, s in shapes.items()]


def _flats(segmentation, device: str = "cpu", master_home=None, buckets: int = 2) -> list[FlatParam]:
    named = _params(device)
    per = -(-len(named) // buckets)
    cut = [named[i * per:(i + 1) * per] for i in range(buckets)]
    return [FlatParam(i, part, _OneRank(device), group_of=lambda n, p: int(p.ndim < 2), param_dtype=torch.float32,
                      sharded=False, segmentation=segmentation,
                      master_home=master_home() if master_home else None)
            for i, part in enumerate(cut)]


def _adamw(flats, device: str = "cpu") -> ShardedOptimizer:
    return ShardedOptimizer.for_flat_params(flats, torch.optim.AdamW, [{"weight_decay": 0.1}, {"weight_decay": 0.0}],
                                            _OneRank(device), lr=1e-2)


def _train(segmentation, max_norm: float | None, steps: int = 3) -> tuple[list[torch.Tensor], ShardedOptimizer]:
    flats = _flats(segmentation)
    opt = _adamw(flats)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for f in flats:
            f.grad_shard = torch.randn(f.shard_numel, generator=gen)
        opt.step(max_norm)
    return [f.master.clone() for f in flats], opt


def test_the_segmentation_follows_the_masters_device():
    assert isinstance(segmentation_for("cpu"), CacheSizedSegments)
    assert isinstance(segmentation_for("meta"), WholeShards) and isinstance(segmentation_for("cuda"), WholeShards)
    assert CacheSizedSegments(chunk=4).cut(2, 13) == [(2, 6), (6, 10), (10, 13)]
    assert WholeShards().cut(2, 13) == [(2, 13)]
    whole = WholeShards()
    assert whole.kernel_options(torch.optim.AdamW, torch.device("cuda")) == {"fused": True}
    assert whole.kernel_options(torch.optim.AdamW, torch.device("meta")) == {"foreach": True}  # no fused on meta
    assert whole.kernel_options(torch.optim.AdamW, torch.device("cpu")) == {}  # the reference's per-tensor loop
    assert CacheSizedSegments().kernel_options(torch.optim.AdamW, torch.device("cpu")) == {}
    # one optimizer tensor per group per flat buffer, or pieces of `chunk`; a user's kernel option wins
    assert [len(f.master_params) for f in _flats(WholeShards())] == [2, 2]  # (w1, b1, w2), (norm, w3)
    assert sum(len(f.master_params) for f in _flats(CacheSizedSegments(chunk=500))) > 8
    flats = _flats(WholeShards(), device="meta")
    opt = ShardedOptimizer.for_flat_params(flats, torch.optim.AdamW, [{}, {}], _OneRank("meta"), foreach=False)
    assert opt.param_groups[0]["foreach"] is False and not opt.param_groups[0]["fused"]
    assert _adamw(flats, "meta").param_groups[0]["foreach"] is True


def test_whole_shards_step_like_cache_sized_segments():
    segments, _ = _train(CacheSizedSegments(chunk=500), max_norm=None)
    whole, _ = _train(WholeShards(), max_norm=None)
    for a, b in zip(segments, whole):
        assert torch.equal(a, b)  # elementwise AdamW: the cut changes nothing
    # clipped: the norm's sums run over other pieces (one multi-tensor norm over the segments or the shards)
    segments, _ = _train(CacheSizedSegments(chunk=500), max_norm=1.0)
    whole, _ = _train(WholeShards(), max_norm=1.0)
    for a, b in zip(segments, whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_saved_under_segments_loads_under_whole_shards(tmp_path, monkeypatch):
    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer, find_checkpoint
    from fivefold.data_parallel import ZeroDataParallel
    from fivefold.distributed.comm import Comm
    from fivefold.models import build_model, get_config

    def engine(segmentation) -> ZeroDataParallel:
        monkeypatch.setattr(flat_param, "segmentation_for", lambda device: segmentation)
        model = build_model(get_config("tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                                       max_seq_len=16, vocab_size=13), seed=0)
        return ZeroDataParallel(model, Comm(), zero_stage=1, lr=1e-2, bucket_mb=0.02)

    def step(e: ZeroDataParallel, i: int) -> None:
        x = torch.randint(0, 13, (2, 16), generator=torch.Generator().manual_seed(i))
        e.backward(nn.functional.cross_entropy(e(x).flatten(0, 1), x.flatten()))
        e.step()

    def state(e: ZeroDataParallel) -> dict[str, torch.Tensor]:
        sd = e.full_state_dict()
        for f in e.flats:  # the optimizer state laid out as the shard, whatever the cut
            for k in ("exp_avg", "exp_avg_sq"):
                flat = torch.zeros(f.shard_numel)
                for (_, a, b), mp in zip(f.segments, f.master_params):
                    flat[a:b] = e.optimizer.state[mp][k]
                sd[f"{k}.{f.index}"] = flat
        return sd

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        saved = engine(CacheSizedSegments(chunk=300))
        assert any(len(f.master_params) > len(set(f.group_ids)) for f in saved.flats)  # really cut
        for i in range(2):
            step(saved, i)
        Checkpointer(tmp_path, keep=0).save(2, training_state([saved], None).state_dict, {"steps_done": 2})
        loaded = engine(WholeShards())
        assert all(len(f.master_params) == len(set(f.group_ids)) for f in loaded.flats)
        path = find_checkpoint(tmp_path)
        elementwise, scalars = Checkpointer.saved_optimizer_keys(path)
        ts = training_state([loaded], None, scalars, elementwise)
        Checkpointer.load(path, ts.state_dict)
        ts.after_load([loaded])
        for key, value in state(saved).items():
            assert torch.equal(state(loaded)[key], value), key
        step(saved, 2)
        step(loaded, 2)
        for key, value in state(saved).items():
            assert torch.equal(state(loaded)[key], value), key
    finally:
        dist.destroy_process_group()


def test_an_optimizer_step_dispatches_at_most_five_operations_per_flat_buffer():
    from bench.data_parallel import optimizer_step_ops

    assert not dist.is_initialized()
    for stage, bucket_mb in ((0, 0.05), (3, 25.0)):
        r = optimizer_step_ops("tiny", stage=stage, world=8, bucket_mb=bucket_mb, n_layers=8)
        assert r["kernels"] == ["fused"], r
        assert r["flats"] >= 10 and r["optimizer_tensors"] <= 2 * r["flats"], r
        assert r["total"] <= 5 * r["flats"], f"ZeRO-{stage}: {r['total']} ops for {r['flats']} flat buffers: {r['ops']}"
        assert r["ops"]["_fused_adamw_"] <= 2, r["ops"]  # one per optimizer group, whatever the buffers
        assert "_local_scalar_dense" not in r["ops"], r["ops"]  # no host read on the way


def test_an_optimizer_step_on_the_accelerator_path_makes_no_host_sync():
    host_syncs = pytest.importorskip("host_syncs")  # (tests/host_syncs.py, from main)
    from bench.data_parallel import optimizer_step_ops

    for stage in (0, 3):
        r = optimizer_step_ops("tiny", stage=stage, world=8, bucket_mb=0.05, n_layers=2,
                               watch=lambda: host_syncs.HostSyncs(devices=("meta",)))
        for syncs in r["watched"]:
            assert syncs.count == 0, f"ZeRO-{stage}: " + "\n".join(syncs.where[:3])


class _StandInEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name
        log.append(("record", name))

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))


def test_offload_waits_for_each_flats_copy_only_before_stepping_it(monkeypatch):
    log: list = []
    monkeypatch.setattr(offload, "is_accelerator", lambda device: True)  # meta plays the accelerator
    flats = _flats(WholeShards(), device="meta", master_home=MasterOnHost, buckets=3)
    opt = _adamw(flats, "meta")
    names = {id(mp): f.index for f in flats for mp in f.master_params}
    copies = iter(range(len(flats)))
    monkeypatch.setattr(offload, "device_event", lambda device: _StandInEvent(log, next(copies)))
    inner_step = opt.optimizer.step

    def step() -> None:
        with_grad = {names[id(p)] for g in opt.param_groups for p in g["params"] if p.grad is not None}
        log.append(("step", *sorted(with_grad)))
        inner_step()

    monkeypatch.setattr(opt.optimizer, "step", step)
    for f in flats:
        plain = f.write_back
        monkeypatch.setattr(f, "write_back", lambda plain=plain, i=f.index: (log.append(("back", i)), plain()))
        f.grad_shard = torch.zeros(f.shard_numel, device="meta")
    opt.step(max_norm=1.0)
    want = [("record", i) for i in range(3)]
    for i in range(3):
        want += [("wait", i), ("step", i), ("back", i)]
    assert log == want


def test_host_step_threads_are_the_local_share_unless_the_user_chose():
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4"}
    assert host_step_threads_for({}, 16) == 16
    assert host_step_threads_for({"LOCAL_WORLD_SIZE": "4"}, 16) == 4
    assert host_step_threads_for({**torchrun, "OMP_NUM_THREADS": "1"}, 16) == 4  # torchrun's own default
    assert host_step_threads_for({**torchrun, "OMP_NUM_THREADS": "2"}, 16) is None  # the user's: kept
    assert host_step_threads_for({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "4"}, 16) is None  # not torchrun
    assert host_step_threads_for({"LOCAL_WORLD_SIZE": "8"}, 4) == 1
    before = torch.get_num_threads()
    with host_step_threads():
        assert torch.get_num_threads() >= before
    assert torch.get_num_threads() == before


def test_the_cpu_optimizer_bench_runs_every_contestant():
    from bench.data_parallel import bench_optimizer, format_optimizer_table

    before = torch.get_num_threads()
    try:
        r = bench_optimizer("tiny", steps=2, warmup=1, repeats=2, bucket_mb=1.0)
    finally:
        torch.set_num_threads(before)
    rows = {x["name"]: x for x in r["impls"]}
    assert len(rows) == 4 and all(x["ms"] > 0 for x in rows.values())
    assert rows["whole shards, fused"]["tensors"] < rows["segments (1 MiB), fused"]["tensors"]
    assert "bench-120m" not in format_optimizer_table(r) and "tiny" in format_optimizer_table(r)
