"""ZeRO-Offload and constant buffers (docs/design.md#offload-and-constant-buffers) equal plain ZeRO.

One spawn at N = 2 (every test `multiprocess`); test_zero.py holds the plain engine to one process:
1. every stage with ``offload_optimizer``, ``constant_buffers`` and both equals the plain engine bit
   for bit over five steps (fp32, bf16, accumulation, ``no_sync``, clipping, SGD, prefetch 0/2,
   units kept, recompute of whole units and inside them);
2. offload: the host holds the fp32 master, m, v and the gradient copy; the device the rest;
3. with the pool no factory op of a bucket / shard / gather-buffer size and no storage resize after
   warm-up (some without it), and the backward peak stays within the formula plus the pool;
4. a gather into a held slot is refused, a backward that raised leaves nothing behind, an offloaded
   checkpoint resumes exactly (into plain ZeRO-2 within tests/tolerance.py's bound)."""

from __future__ import annotations

import contextlib
import math

import pytest
import test_zero_promises as promises
import torch
from dist_utils import build_toy, initial_state, lm_loss, run_workers, toy_batch
from test_zero import TERMS, _accumulate, _Boom, _fail_half_way, _reference, _tiny_llama
from tolerance import KERNELS, assert_within, reference
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from fivefold.data_parallel import MixedPrecision, ZeroDataParallel
from fivefold.distributed.comm import Comm, CommLog
from fivefold.models.llama import TransformerBlock
from fivefold.observe.memory import PeakSampler, model_state_bytes, reachable_storage_bytes

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 5  # constant buffers: ZeRO-3 watches two steps, gathers into slots from the third
VARIANTS = {"plain": {}, "offload": dict(offload_optimizer=True), "cb": dict(constant_buffers=True),
            "offload+cb": dict(offload_optimizer=True, constant_buffers=True)}
SMALL_BUCKET_MB = 64 * 4 / 2**20


def _case(stage, *, model="toy", dtype="fp32", accum=1, defer=False, clip=0.5, opt="adamw", recompute=None, **zero):
    return dict(stage=stage, model=model, dtype=dtype, accum=accum, defer=defer, clip=clip, opt=opt,
                recompute=recompute, zero=zero)


CASES = {
    "z0-acc2": _case(0, accum=2),
    "z1-acc3": _case(1, accum=3),  # the reduced shard moves out of the kept buffer (into its own buffer)
    "z2-acc2-defer": _case(2, accum=2, defer=True),
    "z2-bf16-sgd": _case(2, dtype="bf16", opt="sgd", clip=None),
    "z3-acc2-defer": _case(3, model="llama", accum=2, defer=True),
    "z3-bf16": _case(3, model="llama", dtype="bf16"),
    "z3-keep": _case(3, model="llama", reshard_after_forward=False),
    "z3-prefetch0": _case(3, model="llama", prefetch=0),
    "z3-prefetch2-acc2": _case(3, model="llama", accum=2, prefetch=2),
    "z3-recompute-unit": _case(3, model="llama", recompute="unit"),
    "z3-recompute-inside": _case(3, model="llama", recompute="inside"),
}


class RecomputedTransformerBlock(TransformerBlock):
    """A block whose whole call (ZeRO-3 hooks included) is recomputed in backward."""

    def __call__(self, *args):
        return checkpoint(super().__call__, *args, use_reentrant=False)


def _recompute(model: nn.Module, how: str | None) -> None:
    for block in (m for m in model.modules() if isinstance(m, TransformerBlock)):
        if how == "unit":
            block.__class__ = RecomputedTransformerBlock
        elif how == "inside":
            inner = block.forward
            block.forward = lambda *args, inner=inner: checkpoint(inner, *args, use_reentrant=False)


def _engine(case: dict, comm: Comm, variant: dict) -> ZeroDataParallel:
    llama = case["model"] == "llama"
    model = _tiny_llama() if llama else build_toy()
    _recompute(model, case["recompute"])
    opt = (torch.optim.SGD, {"momentum": 0.9}) if case["opt"] == "sgd" else (torch.optim.AdamW, {"eps": 1e-4})
    return ZeroDataParallel(model, comm, zero_stage=case["stage"], bucket_mb=SMALL_BUCKET_MB,
                            units=None if llama else [nn.Linear], mixed_precision=MixedPrecision.from_names(
                                case["dtype"]), lr=1e-2, weight_decay=0.1, optimizer_class=opt[0],
                            **opt[1], **case["zero"], **variant)


def _train(case: dict, comm: Comm, variant: dict) -> dict:
    model = _engine(case, comm, variant)
    history, losses = [], []
    for step in range(STEPS):
        x, y = toy_batch(step)
        xs, ys = x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]
        for micro, (xm, ym) in enumerate(zip(xs.chunk(case["accum"]), ys.chunk(case["accum"]))):
            with model.no_sync() if case["defer"] and micro < case["accum"] - 1 else contextlib.nullcontext():
                loss = lm_loss(model(xm).float(), ym) / case["accum"]
                model.backward(loss)
            losses.append(loss.item())
        model.step(case["clip"])
        history.append(model.full_state_dict())
    slots = model.fsdp.slots if model.fsdp is not None else None
    return dict(history=history, losses=losses,
                slots=None if slots is None else dict(n=len(slots.slots), dedicated=list(slots.dedicated),
                                                       watching=slots.watching))


# ---------------------------------------------------------------------------------------------
def _offload_memory(comm: Comm) -> dict:
    """Model-state bytes after the second backward (optimizer state exists), plain and offloaded."""
    out = {}
    for stage in range(4):
        for dtype in ("fp32", "bf16"):
            for name in ("plain", "offload"):
                model = ZeroDataParallel(build_toy(), comm, zero_stage=stage, bucket_mb=SMALL_BUCKET_MB,
                                         units=[nn.Linear], mixed_precision=MixedPrecision.from_names(dtype), lr=1e-2,
                                         **VARIANTS[name])
                x, y = toy_batch(0)
                for step in range(2):
                    model.backward(lm_loss(model(x.chunk(comm.size)[comm.rank]).float(),
                                           y.chunk(comm.size)[comm.rank]))
                    if step == 1:
                        measured = model_state_bytes(model)
                        walked = reachable_storage_bytes([model])
                    model.step()
                masters_apart = all(mp.untyped_storage().data_ptr() == f.master.untyped_storage().data_ptr()
                                    != f.local.untyped_storage().data_ptr()
                                    for f in model.flats for mp in f.master_params)
                state_on_masters = all(v.untyped_storage().data_ptr() not in
                                       {f.local.untyped_storage().data_ptr() for f in model.flats}
                                       for s in model.optimizer.state.values() for v in s.values())
                out[(stage, dtype, name)] = dict(
                    measured=measured, walked=walked, flats=[f.layout.numel for f in model.flats],
                    n_master=sum(len(f.master_params) for f in model.flats),
                    masters_apart=masters_apart, state_on_masters=state_on_masters)
    return out


# ---------------------------------------------------------------------------------------------
FACTORIES = {"empty", "empty_strided", "zeros", "ones", "full", "new_empty", "new_empty_strided", "new_zeros",
             "new_ones", "new_full", "empty_like", "zeros_like", "ones_like", "full_like", "clone"}


class CountAllocations(TorchDispatchMode):
    """Factory operators whose result has one of `sizes` elements (a bucket, a shard, a gather buffer)."""

    def __init__(self, sizes: set[int]) -> None:
        super().__init__()
        self.sizes = sizes
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in FACTORIES and isinstance(out, torch.Tensor) and out.numel() in self.sizes:
            self.found.append(f"{func}({out.numel()})")
        return out


ALLOC_CASES = {  # (stage, accumulation, no_sync on all but the last micro-step, engine options)
    "z1-acc3": (1, 3, False, {}),
    "z2-acc2": (2, 2, False, {}),
    "z2-defer": (2, 2, True, {}),
    "z3-acc2": (3, 2, False, {}),
    "z3-defer": (3, 2, True, {}),
    "z3-keep": (3, 1, False, dict(reshard_after_forward=False)),
    "z3-inflight2-prefetch2": (3, 1, False, dict(inflight_buckets=2, prefetch=2)),
}


def _allocations(comm: Comm) -> dict:
    """Allocations of a bucket's / shard's / gather buffer's size in step 4 (after three warm-up steps)."""
    resizes = [0]
    original = torch.UntypedStorage.resize_

    def counting_resize(storage, nbytes):  # noqa: ANN001
        resizes[0] += 1
        return original(storage, nbytes)

    torch.UntypedStorage.resize_ = counting_resize
    out = {}
    try:
        for name, (stage, accum, defer, options) in ALLOC_CASES.items():
            for cb in (False, True):
                model = promises._model()
                engine = ZeroDataParallel(model, comm, zero_stage=stage, bucket_mb=promises.SMALL_BUCKET_MB,
                                          lr=1e-3, constant_buffers=cb, **options)
                sizes = {f.layout.padded_numel for f in engine.flats} | {f.shard_numel for f in engine.flats}
                pools = []
                for step in range(4):
                    x, y = promises._batch(step, comm.rank)
                    counter = CountAllocations(sizes) if step == 3 else contextlib.nullcontext()
                    before = resizes[0]
                    with counter:
                        for micro in range(accum):
                            with engine.no_sync() if defer and micro < accum - 1 else contextlib.nullcontext():
                                engine.backward(promises._loss(engine(x), y) / accum)
                        engine.step(1.0)
                    pools.append(model_state_bytes(engine).buffers)
                slots = engine.fsdp.slots if engine.fsdp is not None and engine.fsdp.slots is not None else None
                out[(name, cb)] = dict(found=counter.found, resizes=resizes[0] - before, pools=pools,
                                       slots=None if slots is None else len(slots.slots),
                                       dedicated=None if slots is None else list(slots.dedicated),
                                       n_units=len(engine.flats))
    finally:
        torch.UntypedStorage.resize_ = original
    return out


# ---------------------------------------------------------------------------------------------
def _peak(comm: Comm) -> dict:
    """Backward peak of the tiny Llama at step 3 (slots in use), walked after every operator (slow: a small model)."""
    out = {}
    for stage in (2, 3):
        model = _tiny_llama()
        buffers = list(model.buffers())
        largest_param = max(p.numel() for p in model.parameters())
        engine = ZeroDataParallel(model, comm, zero_stage=stage, bucket_mb=SMALL_BUCKET_MB * 16, lr=1e-3,
                                  constant_buffers=True)
        sampler = PeakSampler([engine], exclude=buffers)
        for step in range(4):
            x, y = toy_batch(step)
            loss = lm_loss(engine(x.chunk(comm.size)[comm.rank]), y.chunk(comm.size)[comm.rank])
            with sampler if step == 3 else contextlib.nullcontext():
                engine.backward(loss)
            if step == 3:
                reported = model_state_bytes(engine)
                walked = reachable_storage_bytes([engine], exclude=buffers)
            engine.step()
        flats = engine.flats
        out[stage] = dict(peak=sampler.peak, reported=reported, walked=walked,
                          padded=[f.layout.padded_numel for f in flats], numel=[f.layout.numel for f in flats],
                          owned=sum(max(0, min(f.end, f.layout.numel) - f.start) for f in flats),
                          step_counters=4 * sum(1 for s in engine.optimizer.state.values() if "step" in s),
                          largest_param=largest_param,
                          slots=[t.numel() for t in engine.fsdp.slots.slots] if stage == 3 else [])
    return out


def _collision(comm: Comm) -> str | None:
    """After the slots were assigned, gather two units that share one: refused, nothing overwritten."""
    engine = ZeroDataParallel(_tiny_llama(), comm, zero_stage=3, lr=1e-3, constant_buffers=True)
    for step in range(3):
        x, y = toy_batch(step)
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    slots = engine.fsdp.slots
    a, b = next((i, j) for i in slots.slot_of for j in slots.slot_of if i < j and slots.slot_of[i] == slots.slot_of[j])
    engine.fsdp._unshard(a)
    try:
        engine.fsdp._unshard(b)
    except RuntimeError as e:
        return str(e)
    finally:
        engine.fsdp.backward_done()
    return None


def _after_failure(comm: Comm) -> dict:
    """Three steps (slots assigned), a backward that raises half-way (ZeRO-2: the toy's, as in test_zero.py; ZeRO-3:
    the tiny Llama's at the head's input, after the head's reduce-scatter was launched and block 1 prefetched: a
    stale gathered block 1 would hold the slot the embedding needs first in the next forward), zero_grad(), two more
    steps. (Buffers of a reduce-scatter still in flight are never reused — a race gloo on the CPU does not show.)"""
    out = {}
    for stage in (2, 3):
        for name in ("plain", "cb", "offload+cb"):
            model = build_toy() if stage == 2 else _tiny_llama()
            boom = [False]
            if stage == 3:
                model.output.register_forward_pre_hook(
                    lambda m, args, boom=boom: (_Boom.apply(args[0]),) if boom[0] else None)
            engine = ZeroDataParallel(model, comm, zero_stage=stage, bucket_mb=SMALL_BUCKET_MB,
                                      units=[nn.Linear] if stage == 2 else None, optimizer_class=torch.optim.SGD,
                                      lr=0.5, **VARIANTS[name])
            for step in range(5):
                x, y = toy_batch(step, batch=18)
                xs, ys = x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]
                if step == 3 and stage == 2:
                    _fail_half_way(engine, xs, ys)
                elif step == 3:
                    boom[0] = True
                    with pytest.raises(RuntimeError, match="boom"):
                        lm_loss(engine(xs), ys).backward()
                    boom[0] = False
                if step == 3:
                    engine.zero_grad()
                _accumulate(engine, xs, ys, "sync_nosync_sync")
                engine.step()
            out[(stage, name)] = engine.full_state_dict()
    return out


CKPT_STEPS, CKPT_CLIP = 4, 0.5  # AdamW lr 1e-2, eps 1e-4, no weight decay: test_zero.py's reference for the Llama


def _checkpoint_round_trip(comm: Comm, root: str) -> dict:
    """ZeRO-3 + offload + constant buffers: save after step 2 of 4, resume into a fresh offloaded engine (and into a
    plain ZeRO-2 one); the resumed runs continue like the uninterrupted one."""
    from pathlib import Path

    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer

    def run(engine, first, last, save_at=None):
        for step in range(first, last):
            x, y = toy_batch(step)
            engine.backward(lm_loss(engine(x.chunk(comm.size)[comm.rank]), y.chunk(comm.size)[comm.rank]))
            engine.step(CKPT_CLIP)
            if step + 1 == save_at:
                state = training_state([engine], None).state_dict
                Checkpointer(Path(root), keep=0).save(step + 1, state, {"steps_done": step + 1})
        return engine.full_state_dict()

    def build(stage, **variant):
        return ZeroDataParallel(_tiny_llama(), comm, zero_stage=stage, lr=1e-2, eps=1e-4, **variant)

    def load(engine):
        path = Path(root) / "step-00000002"
        elementwise, scalars = Checkpointer.saved_optimizer_keys(path)
        ts = training_state([engine], None, scalars, elementwise)
        Checkpointer.load(path, ts.state_dict)
        ts.after_load([engine])
        return engine

    full = run(build(3, **VARIANTS["offload+cb"]), 0, CKPT_STEPS, save_at=2)
    resumed = run(load(build(3, **VARIANTS["offload+cb"])), 2, CKPT_STEPS)
    into_plain = run(load(build(2)), 2, CKPT_STEPS)
    return dict(full=full, resumed=resumed, into_plain=into_plain)


def _worker(root: str) -> dict:
    comm = Comm(None, "dp", CommLog())
    return dict(runs={(name, v): _train(case, comm, VARIANTS[v]) for name, case in CASES.items() for v in VARIANTS},
                memory=_offload_memory(comm), alloc=_allocations(comm), peak=_peak(comm), collision=_collision(comm),
                failure=_after_failure(comm),
                ckpt=_checkpoint_round_trip(comm, root))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers(_worker, 2, str(tmp_path_factory.mktemp("offload-ckpt")))


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "plain"])
@pytest.mark.parametrize("name", list(CASES))
def test_offload_and_constant_buffers_equal_the_plain_engine_bit_for_bit(results, name, variant):
    for rank, res in enumerate(results):
        plain, got = res["runs"][(name, "plain")], res["runs"][(name, variant)]
        assert got["losses"] == plain["losses"]
        for step, (want, have) in enumerate(zip(plain["history"], got["history"])):
            assert have.keys() == want.keys()
            for key in want:
                assert torch.equal(have[key], want[key]), f"rank {rank} step {step} {key}"
        if "cb" in variant and CASES[name]["stage"] == 3:  # the slots were really used, none left out
            assert not got["slots"]["watching"] and got["slots"]["n"] >= 2 and got["slots"]["dedicated"] == []


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_offload_keeps_master_and_optimizer_state_on_the_host_only(results, stage, dtype):
    n = len(results)
    p_bytes = 4 if dtype == "fp32" else 2  # (gradients are fp32: no reduce dtype given)
    frozen = 6 * 6 + 6  # the toy's frozen layer, replicated in the compute dtype
    for rank, res in enumerate(results):
        plain, off = res["memory"][(stage, dtype, "plain")], res["memory"][(stage, dtype, "offload")]
        shards = n if stage else 1
        padded = [math.ceil(k / shards) * shards for k in off["flats"]]
        psi_padded, shard = sum(padded), sum(padded) // shards
        shard_rank = rank if stage else 0
        owned = sum(min(max(k - shard_rank * (p // shards), 0), p // shards) for k, p in zip(off["flats"], padded))
        device_params = psi_padded * p_bytes / (n if stage == 3 else 1) + frozen * p_bytes
        device_grads = psi_padded * 4 / (n if stage >= 2 else 1)
        # host: fp32 master shard, Adam's m and v over the owned elements (+ a 4-byte step per tensor), and the
        # fp32 copy of the gradient shard the optimizer reads
        host = 4 * shard + 8 * owned + 4 * off["n_master"] + 4 * shard
        m = off["measured"]
        assert m.host == host and m.device == device_params + device_grads
        assert m.device == plain["measured"].params + plain["measured"].grads  # the device keeps only these
        assert off["masters_apart"] and off["state_on_masters"]  # own host buffers, even for fp32 on the CPU
        assert off["walked"] == m.total  # nothing held beyond what is reported
        # what the device drops: the optimizer state, and the fp32 master where it was a copy of its own
        assert plain["measured"].total - m.device == plain["measured"].optimizer


@pytest.mark.parametrize("name", list(ALLOC_CASES))
def test_no_bucket_or_gather_buffer_is_allocated_after_warm_up(results, name):
    for res in results:
        pooled, control = res["alloc"][(name, True)], res["alloc"][(name, False)]
        assert pooled["found"] == [] and pooled["resizes"] == 0, pooled
        assert len(set(pooled["pools"][2:])) == 1  # the pool did not grow after warm-up
        # the same count sees the allocations the pool saves: the test can fail
        assert len(control["found"]) + control["resizes"] > 0
        stage, _, _, options = ALLOC_CASES[name]
        if stage == 3:  # every unit in a slot: the root's, the current unit's and the prefetched ones' (when units
            # stay gathered from forward to backward, each its own)
            assert pooled["dedicated"] == []
            if options.get("reshard_after_forward", True):
                assert pooled["slots"] == 1 + 1 + options.get("prefetch", 1)
            else:
                assert pooled["slots"] == pooled["n_units"]


@pytest.mark.parametrize("stage", [2, 3])
def test_backward_peak_with_constant_buffers_is_formula_plus_pool(results, stage):
    n = len(results)
    for res in results:
        r = res["peak"][stage]
        formula = promises._formula_bytes(f"z{stage}", dict(r, psi=sum(r["numel"])), n)
        pool = r["reported"].buffers
        largest = max(r["padded"])
        # The pool: ZeRO-2 two buffers of the largest bucket (one in flight, one filling; reduce-scatters land in
        # the gradient shard itself); ZeRO-3 also the gather slots (the root, the current unit, the prefetched one)
        want_pool = 4 * 2 * largest + (4 * sum(r["slots"]) if stage == 3 else 0)
        assert pool == want_pool
        if stage == 3:
            assert len(r["slots"]) == 3 and sorted(r["slots"])[-2:] == [largest, largest]
        # Beyond formula + pool, only autograd's gradients before they are copied into a bucket: one parameter's
        # (ZeRO-2), one unit's (ZeRO-3, copied at launch); and the loss with its seed.
        transient = 4 * (r["largest_param"] if stage == 2 else largest) + promises.LOSS_AND_SEED
        assert r["peak"] <= formula + pool + transient, (r["peak"], formula, pool, transient)
        assert r["walked"] == r["reported"].total


def test_a_gather_into_a_held_slot_is_refused(results):
    for res in results:
        assert res["collision"] is not None and "constant_buffers=false" in res["collision"]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_backward_that_raised_leaves_no_stale_buffer_behind(results, stage):
    for res in results:
        plain = res["failure"][(stage, "plain")]  # (test_zero.py holds the plain engine to the reference)
        for name in ("cb", "offload+cb"):
            for key, value in plain.items():
                assert torch.equal(res["failure"][(stage, name)][key], value), (name, key)


@pytest.mark.parametrize("kernels", KERNELS)
def test_offloaded_checkpoint_resumes_exactly(results, kernels):
    # Resumed into ZeRO-2 the clipping norm sums other shards: not bit-equal, so it is held (as is the uninterrupted
    # run) to the single-process reference's derived bound.
    (_, history), (_, bounds) = reference(_reference, "llama", "adamw", 1, CKPT_CLIP, initial_state(_tiny_llama()),
                                          kernels=kernels, terms=TERMS["llama"], steps=CKPT_STEPS, weight_decay=0.0)
    for rank, res in enumerate(results):
        c = res["ckpt"]
        for key, value in c["full"].items():
            assert torch.equal(c["resumed"][key], value), key
        assert c["into_plain"].keys() == c["full"].keys() == history[-1].keys()
        assert_within(c["full"], history[-1], bounds[-1], f"rank {rank} uninterrupted")
        assert_within(c["into_plain"], history[-1], bounds[-1], f"rank {rank} resumed into ZeRO-2")
