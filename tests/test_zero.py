"""ZeRO stages 0-3 against single-process training; their memory and traffic against the formulas.

One spawn per world size (every test `multiprocess`): 2 and 3 for correctness (3 forces padding),
AdamW and SGD, clipping, accumulation, tied and frozen weights, ZeRO-3 prefetch, bf16; 2 and 4 for
the model-state bytes (docs/design.md#model-state-memory) and collectives per step
(docs/design.md#data-parallel-traffic). References run on the workers' kernels; comparisons use the
bounds tests/tolerance.py derives. Also: ZeRO-3 materialises only current and prefetched units,
ZeRO-2 keeps only its gradient shard, an fp16 overflow on one rank skips the step everywhere."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from dist_utils import build_toy, initial_state, lm_loss, run_workers, toy_batch
from tolerance import KERNELS, WORKERS, assert_values_close, assert_within, reference
from torch import nn

from fivefold.data_parallel import DDP, MixedPrecision, ShardedOptimizer, ZeroDataParallel
from fivefold.distributed.comm import Comm, CommLog
from fivefold.models import build_model, get_config
from fivefold.observe.memory import model_state_bytes

pytestmark = pytest.mark.multiprocess  # every test here starts processes

STEPS = 5
LR, WD, CLIP = 1e-2, 0.1, 0.5  # CLIP is below the toy model's gradient norm (≈1.4): clipping is active
SMALL_BUCKET_MB = 64 * 4 / 2**20  # a few parameters per bucket


def _tiny_llama() -> nn.Module:
    return build_model(get_config("tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                                  max_seq_len=16, vocab_size=13), seed=0)


MODELS = {"toy": build_toy, "llama": _tiny_llama}
# Adam's first steps divide by |g| + eps, which amplifies a gradient difference δg by up to 1/eps: the tiny Llama has
# gradient entries of ~1e-6, whose reduction-order difference (sums in another order) eps = 1e-8 would turn into a
# visible update difference. eps = 1e-4 bounds the amplification by lr·δg/eps while still running AdamW, so the bound
# tests/tolerance.py derives (rule 2) stays tight. The toy model's gradients are all large: it keeps torch's default.
EPS = {"toy": 1e-8, "llama": 1e-4}
# tests/tolerance.py rule 1's n: the longest sum a layout (or another kernel path) reorders — the global batch's tokens
# (12 x 5) summed into a weight gradient in rank slices and micro-batches, or the tiny Llama's widest inner dimension
# (ffn_hidden 96). Clipping's squared norm is longer but strictly positive, and it scales every gradient alike (which
# AdamW normalises away), so its reordering moves an update far less than the per-entry bound assumed for the tokens.
TERMS = {"toy": 12 * 5, "llama": 96}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _config(stage, *, accum=1, defer=False, model="toy", dtype="fp32", reduce=None, clip=CLIP, prefetch=1, raf=True,
            opt="adamw"):
    return dict(stage=stage, accum=accum, defer=defer, model=model, dtype=dtype, reduce=reduce or dtype, clip=clip,
                prefetch=prefetch, raf=raf, opt=opt)


# AdamW normalises away a wrong gradient scale (a missing 1/N would pass); SGD does not.
OPTIMIZERS = {"adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9})}


CONFIGS = [
    *[_config(s) for s in range(4)],
    *[_config(s, opt="sgd", clip=None) for s in range(4)],
    _config(2, opt="sgd", accum=2),
    *[_config(s, accum=2) for s in (1, 2, 3)],  # reduce-scatter every micro-step into the shard
    *[_config(s, accum=3) for s in (0, 1)],  # a third micro-step must not count the second's gradients again
    *[_config(s, accum=2, defer=True) for s in (0, 1, 2, 3)],  # no_sync: one reduction per step
    _config(3, model="llama"),  # default units: each TransformerBlock + the root
    _config(3, model="llama", prefetch=0, clip=None),
    _config(3, model="llama", raf=False),  # units stay gathered from forward until their backward
    *[_config(s, dtype="bf16") for s in range(4)],
    _config(2, dtype="bf16", reduce="fp32"),  # 16-bit compute, fp32 gradient buckets and reduce-scatter
    _config(3, dtype="bf16", model="llama"),
]


def _engine(cfg, comm):
    mp = MixedPrecision.from_names(cfg["dtype"], cfg["reduce"])
    units = [nn.Linear] if cfg["model"] == "toy" else None
    return ZeroDataParallel(MODELS[cfg["model"]](), comm, zero_stage=cfg["stage"], mixed_precision=mp,
                            bucket_mb=SMALL_BUCKET_MB, units=units, prefetch=cfg["prefetch"],
                            reshard_after_forward=cfg["raf"], lr=LR, weight_decay=WD,
                            optimizer_class=OPTIMIZERS[cfg["opt"]][0], **_opt_kwargs(cfg["model"], cfg["opt"]))


def _opt_kwargs(model_name: str, opt_name: str) -> dict:
    return {"eps": EPS[model_name]} if opt_name == "adamw" else dict(OPTIMIZERS[opt_name][1])


def _train(cfg) -> dict:
    comm = Comm(None, "dp", CommLog())
    model = _engine(cfg, comm)
    rank, world, accum = comm.rank, comm.size, cfg["accum"]
    losses, history, records = [], [], []
    for step in range(STEPS):
        x, y = toy_batch(step)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        comm.log.reset()
        total = 0.0
        for micro, (xm, ym) in enumerate(zip(xs.chunk(accum), ys.chunk(accum))):
            defer = cfg["defer"] and micro < accum - 1
            with model.no_sync() if defer else contextlib.nullcontext():
                loss = lm_loss(model(xm).float(), ym) / accum
                model.backward(loss)
            total += loss.item()
        model.step(cfg["clip"])
        records.append(list(comm.log.records))
        losses.append(total)
        history.append({k: v.clone() for k, v in model.full_state_dict().items()})
    return dict(losses=losses, history=history, records=records,
                flats=[(f.layout.numel, f.layout.padded_numel) for f in model.flats])


def _reference(model_name: str, opt_name: str, accum: int, clip: float | None, init: dict[str, torch.Tensor],
               steps: int = STEPS, weight_decay: float = WD) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Single-process training on the global batch from the workers' initial state `init`: the losses and the state
    after every step."""
    model = MODELS[model_name]()
    model.load_state_dict(init)
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2
             and not any(isinstance(m, nn.Embedding) and m.weight is p for m in model.modules())]
    no_decay = [p for p in model.parameters() if p.requires_grad and all(p is not d for d in decay)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = OPTIMIZERS[opt_name][0](groups, lr=LR, **_opt_kwargs(model_name, opt_name))
    losses, history = [], []
    for step in range(steps):
        x, y = toy_batch(step)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            loss = lm_loss(model(xm), ym) / accum
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        losses.append(total)
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, history


def _trained_reference(cfg: dict, kernels: str) -> tuple:
    """((losses, history), (loss bounds, history bounds)) of cfg's training, for cfg's compute dtype."""
    init = initial_state(MODELS[cfg["model"]]())
    return reference(_reference, cfg["model"], cfg["opt"], cfg["accum"], cfg["clip"], init, kernels=kernels,
                     terms=TERMS[cfg["model"]], dtype=DTYPES[cfg["dtype"]])


# ---------------------------------------------------------------------------------------------
def _zero2_holds_only_its_shard() -> dict:
    comm = Comm(None, "dp", CommLog())
    model = _engine(_config(2), comm)
    x, y = toy_batch(0)
    model.backward(lm_loss(model(x.chunk(comm.size)[comm.rank]), y.chunk(comm.size)[comm.rank]))
    return dict(bucket_buffers=[b.grad is None for b in model.buckets],
                param_grads=[p.grad is None for p in model.module.parameters()],
                shard_sizes=[(f.grad_shard.numel(), f.shard_numel) for f in model.flats])


def _zero3_materialised_units() -> dict:
    comm = Comm(None, "dp", CommLog())
    out = {}
    for prefetch in (0, 1):
        model = _engine(_config(3, model="llama", prefetch=prefetch), comm)
        for step in range(2):  # the second step prefetches along the recorded order
            model.fsdp.trace = []
            x, y = toy_batch(step)
            model.backward(lm_loss(model(x), y))
            model.step()
        out[prefetch] = dict(trace=model.fsdp.trace, n_units=len(model.flats),
                             after=sum(f.is_unsharded for f in model.flats))
    return out


def _memory(world_label) -> dict:
    """Model-state bytes after backward of step 2 (optimizer state exists, gradients present)."""
    comm = Comm(None, "dp", CommLog())
    out = {}
    for stage in range(4):
        for dtype in ("fp32", "bf16"):
            model = _engine(_config(stage, dtype=dtype), comm)
            x, y = toy_batch(0)
            for step in range(2):
                model.backward(lm_loss(model(x.chunk(comm.size)[comm.rank]).float(), y.chunk(comm.size)[comm.rank]))
                if step == 1:
                    measured = model_state_bytes(model)
                model.step()
            out[(stage, dtype)] = dict(measured=measured, flats=[f.layout.numel for f in model.flats],
                                       n_master=sum(len(f.master_params) for f in model.flats))
    return out


def _sharded_optimizer() -> dict:
    comm = Comm(None, "dp", CommLog())
    model = DDP(build_toy(), comm, bucket_mb=SMALL_BUCKET_MB)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = ShardedOptimizer(params, torch.optim.AdamW, comm, lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = toy_batch(step)
        lm_loss(model(x.chunk(comm.size)[comm.rank]), y.chunk(comm.size)[comm.rank]).backward()
        opt.step()
        model.zero_grad()
    state_sizes = [(s["exp_avg"].numel(), s["exp_avg_sq"].numel()) for s in opt.state.values()]
    error = None
    try:
        ShardedOptimizer([nn.Parameter(torch.zeros(3))], torch.optim.LBFGS, comm)
    except ValueError as e:
        error = str(e)
    return dict(params={n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()},
                state_sizes=state_sizes, shard=sum(f.shard_numel for f in opt.flats),
                shard_without_padding=sum(max(0, min(f.end, f.layout.numel) - f.start) for f in opt.flats), error=error)


def _fp16_loss_scaling() -> dict:
    from fivefold.data_parallel import DynamicLossScaler

    comm = Comm(None, "dp", CommLog())
    model = ZeroDataParallel(build_toy(), comm, zero_stage=2, mixed_precision=MixedPrecision(torch.float16),
                             loss_scaler=DynamicLossScaler(init_scale=2.0**10), lr=LR)
    scales, changed = [], []
    for step in range(3):
        x, y = toy_batch(step)
        before = {k: v.clone() for k, v in model.full_state_dict().items()}
        model.backward(lm_loss(model(x.chunk(comm.size)[comm.rank]).float(), y.chunk(comm.size)[comm.rank]))
        if step == 1 and comm.rank == comm.size - 1:  # overflow on one rank only
            model.flats[0].grad_shard[0] = float("inf")
        model.step(1.0)
        after = model.full_state_dict()
        scales.append(model.loss_scaler.scale)
        changed.append(any(not torch.equal(before[k], after[k]) for k in before))
    return dict(scales=scales, changed=changed, skipped=model.loss_scaler.skipped_steps)


# ---------------------------------------------------------------------------------------------
# Accumulation edge cases and misuse (found in review): one SGD(lr=1) step, every stage.
ACCUM_MODES = ("two_losses_one_forward", "sync_nosync_sync")
EDGE_BATCH = 18  # 3 micro-batches per rank at world 2 and 3


class _Boom(torch.autograd.Function):
    """Raises in backward after the layers above it already produced gradients (like an OOM)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


def _sgd_engine(stage, comm):
    return ZeroDataParallel(build_toy(), comm, zero_stage=stage, bucket_mb=SMALL_BUCKET_MB, units=[nn.Linear],
                            optimizer_class=torch.optim.SGD, lr=1.0)


def _accumulate(model, xs, ys, mode):
    if mode == "two_losses_one_forward":  # two synchronising backwards, no forward between them
        out = model(xs)
        lm_loss(out, ys).mul(0.5).backward(retain_graph=True)
        lm_loss(out * 2, ys).mul(0.5).backward()
    else:  # reduce, accumulate unreduced, reduce again
        for i, (xm, ym) in enumerate(zip(xs.chunk(3), ys.chunk(3))):
            with model.no_sync() if i == 1 else contextlib.nullcontext():
                (lm_loss(model(xm), ym) / 3).backward()


def _edge_cases() -> dict:
    comm = Comm(None, "dp", CommLog())
    out: dict = {"accum": {}, "idle_step_changes": {}}
    x, y = toy_batch(0, batch=EDGE_BATCH)
    xs, ys = x.chunk(comm.size)[comm.rank], y.chunk(comm.size)[comm.rank]
    for stage in range(4):
        for mode in ACCUM_MODES:
            model = _sgd_engine(stage, comm)
            _accumulate(model, xs, ys, mode)
            model.step()
            out["accum"][(stage, mode)] = model.full_state_dict()
        before = model.full_state_dict()
        model.step()  # no backward since the last step: nothing may change
        after = model.full_state_dict()
        out["idle_step_changes"][stage] = max((before[k] - after[k]).abs().max().item() for k in before)
    model = _sgd_engine(2, comm)
    with model.no_sync():
        lm_loss(model(xs), ys).backward()
    try:
        model.step()
        out["unsynced_error"] = None
    except RuntimeError as e:
        out["unsynced_error"] = str(e)
    model = _sgd_engine(2, comm)
    _fail_half_way(model, xs, ys)  # then a normal step
    model.zero_grad()
    _accumulate(model, xs, ys, "sync_nosync_sync")
    model.step()
    out["after_failure"] = model.full_state_dict()
    out["retry_errors"] = []
    for retry in ("backward", "step"):  # without zero_grad(): neither may use half-reduced gradients
        model = _sgd_engine(2, comm)
        _fail_half_way(model, xs, ys)
        try:
            _accumulate(model, xs, ys, "sync_nosync_sync") if retry == "backward" else model.step()
            out["retry_errors"].append(None)
        except RuntimeError as e:
            out["retry_errors"].append(str(e))
        model.zero_grad()
    out["tied_units_error"] = _tied_across_units_error(comm)
    return out


def _fail_half_way(model, xs, ys) -> None:
    """A backward that raises after fc2's and fc1's gradients arrived (some buckets already launched)."""
    m = model.module
    try:
        lm_loss(m.head(m.fc2(torch.tanh(m.fc1(_Boom.apply(m.emb(xs)))))), ys).backward()
    except RuntimeError:
        return
    raise AssertionError("the backward was meant to fail")


def _tied_across_units_error(comm) -> str | None:
    model = build_toy()
    shared = nn.Linear(6, 6)
    model.frozen = shared
    model.fc_extra = nn.Linear(6, 6)
    model.fc_extra.weight = shared.weight  # one parameter used by two Linear units
    try:
        ZeroDataParallel(model, comm, zero_stage=3, units=[nn.Linear], lr=LR)
    except ValueError as e:
        return str(e)
    return None


def _edge_reference(mode: str, world: int, init: dict[str, torch.Tensor]) -> dict:
    """One SGD(lr=1) step on the global batch, every rank's slice accumulated as the mode does: the state after it,
    and the largest gradient entry of the whole model (rule 1's scale: the state moved by exactly the gradient)."""
    model = build_toy()
    model.load_state_dict(init)
    x, y = toy_batch(0, batch=EDGE_BATCH)
    for xs, ys in zip(x.chunk(world), y.chunk(world)):
        if mode == "two_losses_one_forward":
            out = model(xs)
            ((lm_loss(out, ys) * 0.5 + lm_loss(out * 2, ys) * 0.5) / world).backward()
        else:
            for xm, ym in zip(xs.chunk(3), ys.chunk(3)):
                (lm_loss(model(xm), ym) / 3 / world).backward()
    scale = max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= p.grad
    return dict(state={k: v.detach() for k, v in model.state_dict().items()}, scale=scale)


# Rule 1's n for one step on EDGE_BATCH's tokens (18 x 5): two losses of one forward add twice as many terms.
EDGE_TERMS = {"two_losses_one_forward": 2 * EDGE_BATCH * 5, "sync_nosync_sync": EDGE_BATCH * 5}


def _assert_edge_state(got: dict, mode: str, world: int, kernels: str, msg: str) -> None:
    want = reference(_edge_reference, mode, world, initial_state(build_toy()), kernels=kernels)
    assert got.keys() == want["state"].keys()
    for name, value in want["state"].items():
        assert_values_close(got[name], value, EDGE_TERMS[mode], f"{msg} {name}", scale=want["scale"])


def _correctness_worker() -> dict:
    return dict(runs=[_train(cfg) for cfg in CONFIGS], zero2=_zero2_holds_only_its_shard(),
                zero3=_zero3_materialised_units(), sharded=_sharded_optimizer(), fp16=_fp16_loss_scaling(),
                edge=_edge_cases())


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def zero_results(request):
    return request.param, run_workers(_correctness_worker, request.param)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def memory_results(request):
    return request.param, run_workers(_memory, request.param, "mem")


def _skip_uneven(world: int, cfg: dict) -> None:
    if toy_batch(0)[0].shape[0] % (world * cfg["accum"]):
        pytest.skip(f"the toy batch does not split into {world} ranks x {cfg['accum']} equal micro-batches")


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("i", range(len(CONFIGS)),
                         ids=[f"z{c['stage']}-{c['opt']}-{c['model']}-{c['dtype']}-{c['reduce']}-acc{c['accum']}"
                              f"{'-defer' if c['defer'] else ''}{'-nopf' if not c['prefetch'] else ''}"
                              f"{'-keep' if not c['raf'] else ''}" for c in CONFIGS])
@pytest.mark.parametrize("kernels", KERNELS)
def test_zero_matches_single_process(zero_results, i, kernels):
    cfg = CONFIGS[i]
    world, results = zero_results
    _skip_uneven(world, cfg)
    # bf16 compute against the fp32 reference: the bounds use bf16's roundoff (tests/tolerance.py, rule 1)
    (ref_losses, ref_hist), (loss_bounds, hist_bounds) = _trained_reference(cfg, kernels)
    runs = [res["runs"][i] for res in results]
    for rank, res in enumerate(runs):
        assert len(res["losses"]) == len(res["history"]) == STEPS
        for step, (got, want) in enumerate(zip(res["history"], ref_hist)):
            assert got.keys() == want.keys()
            assert_within(got, want, hist_bounds[step], f"rank {rank} step {step}")
    # Loss: the mean over ranks of each rank's local mean is the global-batch loss.
    for step in range(STEPS):
        mean_loss = sum(r["losses"][step] for r in runs) / len(runs)
        loss_bounds[step].assert_holds(mean_loss, ref_losses[step], f"step {step} loss")


@pytest.mark.parametrize("i", [i for i, c in enumerate(CONFIGS) if c["dtype"] == "fp32"])
def test_zero_comm_per_step_matches_formula(zero_results, i):
    cfg = CONFIGS[i]
    world, results = zero_results
    _skip_uneven(world, cfg)
    elt = 4
    for res in (r["runs"][i] for r in results):
        n_flats = len(res["flats"])
        psi = sum(n for n, _ in res["flats"])
        psi_padded = sum(p for _, p in res["flats"])
        assert all(p % (world if cfg["stage"] else 1) == 0 for _, p in res["flats"])
        reductions = 1 if cfg["defer"] else cfg["accum"]
        for records in res["records"]:
            grads = [r for r in records if r.tag != "grad_norm"]
            by_op = {op: [r for r in grads if r.op == op] for op in ("all_reduce", "reduce_scatter", "all_gather")}
            if cfg["stage"] == 0:
                assert len(by_op["all_reduce"]) == n_flats * reductions
                assert sum(r.numel for r in by_op["all_reduce"]) == psi * reductions
                assert sum(r.wire_bytes for r in by_op["all_reduce"]) == pytest.approx(
                    2 * (world - 1) / world * psi * elt * reductions)
                assert not by_op["reduce_scatter"] and not by_op["all_gather"]
            else:
                assert not by_op["all_reduce"]
                rs, ag = by_op["reduce_scatter"], by_op["all_gather"]
                assert len(rs) == n_flats * reductions and sum(r.numel for r in rs) == psi_padded * reductions
                ring = (world - 1) / world
                assert sum(r.wire_bytes for r in rs) == pytest.approx(ring * psi_padded * elt * reductions)
                # ZeRO-3: forward + backward per micro-step (forward only when units stay gathered)
                gathers = 1 if cfg["stage"] < 3 else (2 if cfg["raf"] else 1) * cfg["accum"]
                assert len(ag) == n_flats * gathers and sum(r.numel for r in ag) == psi_padded * gathers
                assert sum(r.wire_bytes for r in ag) == pytest.approx((world - 1) / world * psi_padded * elt * gathers)
            norm_calls = [r for r in records if r.tag == "grad_norm"]
            expected_norm_calls = 1 if cfg["clip"] is not None and cfg["stage"] > 0 else 0
            assert len(norm_calls) == expected_norm_calls and all(r.numel == 1 for r in norm_calls)


def test_zero2_keeps_only_the_owned_gradient_shard(zero_results):
    _, results = zero_results
    for res in results:
        z = res["zero2"]
        assert all(z["bucket_buffers"]) and all(z["param_grads"])
        assert all(have == want for have, want in z["shard_sizes"])


def test_zero3_only_current_and_prefetched_units_are_materialised(zero_results):
    _, results = zero_results
    for res in results:
        for prefetch, z in res["zero3"].items():
            forward = [n for event, unit, n in z["trace"] if event == "forward"]
            assert len(forward) == z["n_units"]
            # The root unit (embedding, final norm, head) wraps the whole forward, so it stays
            # gathered throughout; besides it only the current block and `prefetch` next ones.
            assert max(forward) <= 1 + 1 + prefetch
            if prefetch:
                assert max(forward) == 3  # the prefetch really happened
            backward = [n for event, unit, n in z["trace"] if event == "backward"]
            assert len(backward) == z["n_units"] and max(backward) <= 1 + 1 + prefetch
            assert z["after"] == 0  # nothing stays gathered after the step


def _sharded_reference(init: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ShardedOptimizer's training in one process: AdamW (weight decay on every tensor), no clipping."""
    ref = build_toy()
    ref.load_state_dict(init)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = toy_batch(step)
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("kernels", KERNELS)
def test_sharded_optimizer_state_lives_on_the_owner_only(zero_results, kernels):
    world, results = zero_results
    want, bounds = reference(_sharded_reference, initial_state(build_toy()), kernels=kernels, terms=TERMS["toy"])
    total = sum(p.numel() for p in build_toy().parameters() if p.requires_grad)
    for rank, res in enumerate(results):
        s = res["sharded"]
        # Adam's m and v cover exactly this rank's shard (its padding excluded), nothing more.
        assert sum(a for a, _ in s["state_sizes"]) == sum(b for _, b in s["state_sizes"]) == s["shard_without_padding"]
        assert s["shard"] == math.ceil(total / world)
        assert s["params"].keys() == want.keys()
        assert_within(s["params"], want, bounds, f"rank {rank}")
        assert "LBFGS is not known to step each parameter on its own" in s["error"]


def test_fp16_overflow_skips_the_step_everywhere_and_halves_the_scale(zero_results):
    _, results = zero_results
    for res in results:
        f = res["fp16"]
        assert f["scales"] == [2.0**10, 2.0**9, 2.0**9]
        assert f["changed"] == [True, False, True]
        assert f["skipped"] == 1


@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_state_bytes_match_formula(memory_results, stage, dtype):
    n, results = memory_results
    p_bytes = 4 if dtype == "fp32" else 2  # parameters and gradients (reduce dtype = compute dtype)
    frozen = 6 * 6 + 6  # the toy model's frozen layer stays replicated in the compute dtype
    for rank, res in enumerate(results):
        r = res[(stage, dtype)]
        shards = n if stage else 1
        padded = [math.ceil(k / shards) * shards for k in r["flats"]]  # each flat padded to a multiple of N
        psi_padded = sum(padded)
        # Adam's m and v cover the real elements of this rank's shard, not its padding.
        shard_rank = rank if stage else 0
        owned = sum(min(max(k - shard_rank * (p // shards), 0), p // shards) for k, p in zip(r["flats"], padded))
        master = 0 if dtype == "fp32" else 4  # a separate fp32 master shard only when params are 16-bit
        params = psi_padded * p_bytes / (n if stage == 3 else 1)
        grads = psi_padded * p_bytes / (n if stage >= 2 else 1)
        optim = psi_padded * master / shards + 8 * owned + 4 * r["n_master"]  # + a 4-byte `step` per tensor
        m = r["measured"]
        assert (m.params, m.grads, m.optimizer) == (params + frozen * p_bytes, grads, optim)
        if dtype == "bf16":  # docs/design.md#model-state-memory (K = 12) with Ψ = padded count, up to unowned padding
            formula = {0: 16 * psi_padded, 1: 4 * psi_padded + 12 * psi_padded / n,
                       2: 2 * psi_padded + 14 * psi_padded / n, 3: 16 * psi_padded / n}[stage]
            padding_state = 8 * (psi_padded / shards - owned)
            # ZeRO-R's constant buffers (ZeRO-2/3 pools, ZeRO-3 gather slots) are residual memory, not model
            # states: reported apart (m.buffers, in m.total) and checked in test_zero_offload_buffers.py
            assert m.total - m.buffers - frozen * 2 - 4 * r["n_master"] == formula - padding_state


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("stage", range(4))
@pytest.mark.parametrize("mode", ACCUM_MODES)
def test_accumulation_over_several_synchronising_backwards(zero_results, stage, mode, kernels):
    world, results = zero_results
    for rank, res in enumerate(results):
        _assert_edge_state(res["edge"]["accum"][(stage, mode)], mode, world, kernels, f"rank {rank}")


def test_misuse_is_caught_or_harmless(zero_results):
    world, results = zero_results
    for rank, res in enumerate(results):
        e = res["edge"]
        assert all(change == 0.0 for change in e["idle_step_changes"].values())  # step() without backward
        assert "never reduced" in e["unsynced_error"]  # step() after only no_sync backwards
        # a backward that raised half-way leaves no stale state behind
        _assert_edge_state(e["after_failure"], "sync_nosync_sync", world, WORKERS, f"rank {rank} after failure")
        assert "shared by units" in e["tied_units_error"]
        backward_error, step_error = e["retry_errors"]
        assert "previous one never finished" in backward_error and "zero_grad()" in backward_error
        assert "did not finish" in step_error and "zero_grad()" in step_error


def _all_padding_worker() -> list[float]:
    """World 3, one parameter of 2 elements: rank 2's shard of the flat buffer is all padding (no optimizer segment),
    yet ZeRO-1/2's all-gather after the step needs it: it must step (and gather) like the others, not hang them."""
    out = []
    for stage in (1, 2):
        torch.manual_seed(0)
        model = nn.Linear(2, 1, bias=False)
        engine = ZeroDataParallel(model, Comm(), zero_stage=stage, lr=0.1)
        for _ in range(2):
            engine.backward(model(torch.ones(1, 2)).sum())
            engine.step(1.0)
        out.append(model.weight.detach().clone())
    return out


def _all_padding_reference() -> torch.Tensor:
    torch.manual_seed(0)
    ref = nn.Linear(2, 1, bias=False)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.0)
    for _ in range(2):
        opt.zero_grad()
        ref(torch.ones(1, 2)).sum().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    return ref.weight.detach().clone()


def test_a_rank_whose_shard_is_all_padding_still_steps_with_the_others():
    results = run_workers(_all_padding_worker, 3)
    # rule 1's n: the gradient is the average of the 3 ranks' (every rank sees the same one-row batch)
    want, bound = reference(_all_padding_reference, terms=3)
    for rank, weights in enumerate(results):
        for stage, w in zip((1, 2), weights):
            bound.assert_holds(w, want, f"rank {rank} ZeRO-{stage}")
