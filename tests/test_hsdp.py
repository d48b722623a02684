"""HSDP (docs/design.md#hsdp): ZeRO-1/2/3 in shard groups, reduced shards all-reduced over replicas.

One spawn of 4 processes (dp_replicate 2 × dp_shard 2; its tests `multiprocess`); the parent builds
the single-process references. The engine on the toy model (padding, a tied pair, a frozen layer)
and a tiny Llama is held to single-process AdamW / SGD, its CommLog per sub-dimension and
model-state bytes to `formulas.hsdp_expected` (N = N_shard); the Llama through `parallelize` (ZeRO-2
with accumulation, ZeRO-3, cp 2 inside the shard group, MoE with ep 2) equals single-process
training; an HSDP checkpoint resumes bitwise and under plain ZeRO. "Equals" is within the bound
tests/tolerance.py derives. In-process, on torch's fake process group: each replica all-reduce is
waited only at the end of backward, after the last reduce-scatter was issued, and no buffer a
collective still reads or writes is reused or read before that collective is waited."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import build_toy, lm_loss, run_workers, toy_batch
from tolerance import KERNELS, WORKERS, reference
from torch import nn

from fivefold.distributed.comm import CommLog
from fivefold.formulas import hsdp_expected

STEPS, LR, WD, CLIP = 4, 1e-2, 0.1, 0.5
ROWS = 16  # splits into 4 dp ranks × 2 micro-batches
SMALL_BUCKET_MB = 64 * 4 / 2**20  # a few parameters per bucket: several reduce-scatters and all-reduces per step
HSDP = dict(dp=4, dp_replicate=2)


def _tiny_llama() -> nn.Module:
    from fivefold.models import build_model, get_config
    return build_model(get_config("tiny", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                                  max_seq_len=16, vocab_size=13), seed=0)


MODELS = {"toy": build_toy, "llama": _tiny_llama}
EPS = {"toy": 1e-8, "llama": 1e-4}  # as tests/test_zero.py
OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def _cfg(stage, *, opt="adamw", accum=1, defer=False, model="toy", clip=CLIP, inflight=1):
    return dict(stage=stage, opt=opt, accum=accum, defer=defer, model=model, clip=clip, inflight=inflight)


ENGINE_CONFIGS = {
    "z1": _cfg(1), "z2": _cfg(2), "z3": _cfg(3),
    "z1-sgd-acc2": _cfg(1, opt="sgd", accum=2, clip=None),
    "z2-sgd-acc2": _cfg(2, opt="sgd", accum=2, clip=None),
    "z3-sgd-acc2-defer": _cfg(3, opt="sgd", accum=2, defer=True, clip=None),
    "z2-inflight3": _cfg(2, inflight=3),  # several all-reduces waiting on their reduce-scatters at once
    "z3-llama-acc2": _cfg(3, model="llama", accum=2),
}


def _opt_kwargs(cfg) -> dict:
    return {"eps": EPS[cfg["model"]], "weight_decay": WD} if cfg["opt"] == "adamw" else {"momentum": 0.9}


def _engine(cfg, mesh):
    from fivefold.data_parallel import ZeroDataParallel
    return ZeroDataParallel(MODELS[cfg["model"]](), mesh.comm("dp_shard"), replicate=mesh.comm("dp_replicate"),
                            zero_stage=cfg["stage"], bucket_mb=SMALL_BUCKET_MB, inflight_buckets=cfg["inflight"],
                            units=[nn.Linear] if cfg["model"] == "toy" else None, lr=LR,
                            optimizer_class=OPTIMIZERS[cfg["opt"]], **_opt_kwargs(cfg))


def _engine_run(cfg, mesh) -> dict:
    model = _engine(cfg, mesh)
    dp, accum, log = mesh.comm("dp"), cfg["accum"], mesh.comm_log
    losses, history, records = [], [], []
    for step in range(STEPS):
        x, y = (t.chunk(dp.size)[dp.rank] for t in toy_batch(step, batch=ROWS))
        log.reset()
        total = 0.0
        for micro, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
            with model.no_sync() if cfg["defer"] and micro < accum - 1 else contextlib.nullcontext():
                loss = lm_loss(model(xm), ym) / accum
                model.backward(loss)
            total += loss.item()
        model.step(cfg["clip"])
        records.append([(r.seq, r.op, r.dim, r.numel, r.wire_bytes, r.tag) for r in log.records])
        losses.append(total)
        history.append(model.full_state_dict())
    return dict(losses=losses, history=history, records=records,
                flats=[(f.layout.numel, f.layout.padded_numel) for f in model.flats])


def _engine_memory(mesh) -> dict:
    """Model-state bytes after the backward of step 2 (optimizer state exists, gradients present), stages 1-3."""
    from fivefold.observe.memory import model_state_bytes

    out = {}
    for stage in (1, 2, 3):
        model = _engine(_cfg(stage), mesh)
        dp = mesh.comm("dp")
        for step in range(2):
            x, y = (t.chunk(dp.size)[dp.rank] for t in toy_batch(step, batch=ROWS))
            model.backward(lm_loss(model(x), y))
            if step == 1:
                measured = model_state_bytes(model)
            model.step()
        out[stage] = dict(measured=measured, flats=[f.layout.numel for f in model.flats],
                          n_master=sum(len(f.master_params) for f in model.flats), shard_rank=model.comm.rank)
    return out


# Rule 1's n (tests/tolerance.py): the global batch's tokens summed into a weight gradient (split over the shard
# group, the replicas and micro-batches), longer than every inner dimension of either model.
ENGINE_TERMS = toy_batch(0, batch=ROWS)[0].numel()
FROZEN = {n for n, p in build_toy().named_parameters() if not p.requires_grad}  # the toy's frozen layer


def _reference(cfg) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = MODELS[cfg["model"]]()
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2
             and not any(isinstance(m, nn.Embedding) and m.weight is p for m in model.modules())]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not d for d in decay)]
    groups = [{"params": decay}, {"params": rest, "weight_decay": 0.0}] if cfg["opt"] == "adamw" else \
        [{"params": decay + rest}]
    opt = OPTIMIZERS[cfg["opt"]](groups, lr=LR, **_opt_kwargs(cfg))
    losses, history = [], []
    for step in range(STEPS):
        x, y = toy_batch(step, batch=ROWS)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(cfg["accum"]), y.chunk(cfg["accum"])):
            loss = lm_loss(model(xm), ym) / cfg["accum"]
            loss.backward()
            total += loss.item()
        if cfg["clip"] is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg["clip"])
        opt.step()
        losses.append(total)
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, history


# ---------------------------------------------------------------------------------------------
# The whole model through `parallelize` (what the trainer runs).
MODEL = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16, vocab_size=32)
SEQ, EPS_MODEL = 8, 1e-4
MODEL_TERMS = ROWS * SEQ  # rule 1's n: the global batch's tokens (longer than the sequence cp splits, ffn_hidden)
PARALLEL_RUNS = {  # name: (mesh dims, ZeRO stage, micro-batches)
    "z2-acc2": (HSDP, 2, 2),
    "z3": (HSDP, 3, 1),
    "z3-cp2": (dict(dp=2, cp=2, dp_replicate=2), 3, 2),  # the shard group is the cp group: cp sharded with dp_shard
}
K = 2  # the checkpoint's step


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return (torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=g),
            torch.randint(0, MODEL["vocab_size"], (ROWS, SEQ), generator=g))


def _parts(dims: dict, zero: int, micro: int, model=None, lr: float = LR, eps: float = EPS_MODEL, beta2: float = 0.999):
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize

    cfg = Config()
    cfg.zero.stage, cfg.parallel.cp, cfg.parallel.ep = zero, dims.get("cp", 1), dims.get("ep", 1)
    cfg.parallel.dp_replicate = dims.get("dp_replicate", 1)
    cfg.train.lr, cfg.train.weight_decay, cfg.train.beta2, cfg.train.eps = lr, WD, beta2, eps
    cfg.train.grad_accum, cfg.train.seq_len, cfg.train.seed, cfg.train.warmup_steps = micro, SEQ, 0, 0
    mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
    return parallelize(cfg, model or get_config("tiny", **MODEL), mesh, "cpu"), mesh


def _parallel_train(parts, mesh, micro: int, steps: range, batch=_batch, clip: float = CLIP,
                    save: Path | None = None) -> dict:
    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer

    dp = mesh.comm("dp")
    losses, history = [], []
    for step in steps:
        x, y = (t.chunk(dp.size)[dp.rank] for t in batch(step))
        loss = parts.forward_backward(list(zip(x.chunk(micro), y.chunk(micro))))
        parts.step(clip)
        losses.append(parts.global_loss(loss).item())
        history.append(parts.full_state_dict())
        if save is not None and step + 1 == K:
            state = training_state(parts.engines.values(), mesh.comm("tp")).state_dict
            Checkpointer(save, keep=0).save(step + 1, state, {"steps_done": step + 1})
    return dict(losses=losses, history=history)


def _load(parts, mesh, path: Path) -> None:
    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer

    elementwise, scalars = Checkpointer.saved_optimizer_keys(path)
    ts = training_state(parts.engines.values(), mesh.comm("tp"), scalars, elementwise)
    Checkpointer.load(path, ts.state_dict)
    ts.after_load(parts.engines.values())


def _moe_run() -> dict:
    """An MoE Llama with experts over ep 2 under HSDP: the dense engine shards over dp_shard and all-reduces across
    dp_replicate, the experts' engine stays over ep_dp (as without HSDP). Settings of tests/test_expert_parallel.py."""
    import test_expert_parallel as moe

    parts, mesh = _parts(dict(HSDP, ep=2), 2, moe.M, model=moe._moe_model_config(), lr=moe.LR, eps=moe.EPS)
    dims = {e.comm.dim for e in parts.engines.values()}
    return dict(_parallel_train(parts, mesh, moe.M, range(moe.STEPS), batch=moe._moe_batch, clip=moe.CLIP),
                dims=dims)


def _worker(root: str) -> dict:
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh

    mesh = ParallelMesh(ParallelDims(**HSDP), "cpu", CommLog())
    out = dict(groups={d: sorted(torch.distributed.get_process_group_ranks(mesh.group(d)))
                       for d in ("dp_shard", "dp_replicate")},
               engine={name: _engine_run(cfg, mesh) for name, cfg in ENGINE_CONFIGS.items()},
               memory=_engine_memory(mesh))
    try:
        _engine(_cfg(0), mesh)
    except ValueError as e:
        out["stage0_error"] = str(e)
    out["parallel"] = {}
    for name, (dims, zero, micro) in PARALLEL_RUNS.items():
        parts, mesh = _parts(dims, zero, micro)
        save = Path(root) / "hsdp" if name == "z3" else None
        out["parallel"][name] = _parallel_train(parts, mesh, micro, range(STEPS), save=save)
    out["moe"] = _moe_run()
    ckpt = Path(root) / "hsdp" / f"step-{K:08d}"
    for name, dims, zero in (("same", HSDP, 3), ("dp4-zero2", dict(dp=4), 2)):
        parts, mesh = _parts(dims, zero, 1)
        _load(parts, mesh, ckpt)
        out[f"resumed-{name}"] = _parallel_train(parts, mesh, 1, range(K, STEPS))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_workers(_worker, 4, str(tmp_path_factory.mktemp("hsdp")))


# ---------------------------------------------------------------------------------------------
@pytest.mark.multiprocess  # (the spawn of `results`)
def test_shard_groups_are_consecutive_ranks_and_replicas_the_same_place_in_each(results):
    for rank, res in enumerate(results):
        assert res["groups"]["dp_shard"] == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert res["groups"]["dp_replicate"] == [rank % 2, rank % 2 + 2]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
@pytest.mark.multiprocess  # (the spawn of `results`)
def test_hsdp_engine_equals_single_process(results, name, kernels):
    cfg = ENGINE_CONFIGS[name]
    (want_losses, want_history), (loss_bounds, history_bounds) = reference(_reference, cfg, kernels=kernels,
                                                                           terms=ENGINE_TERMS)
    runs = [res["engine"][name] for res in results]
    for rank, run in enumerate(runs):
        for step, (got, want) in enumerate(zip(run["history"], want_history)):
            assert got.keys() == want.keys()
            for pname in want:
                msg = f"rank {rank} step {step} {pname}"
                if pname in FROZEN:  # never trained: the initial values, bitwise
                    assert torch.equal(got[pname], want[pname]), msg
                else:
                    history_bounds[step][pname].assert_holds(got[pname], want[pname], msg)
    mean_losses = [sum(r["losses"][s] for r in runs) / len(runs) for s in range(STEPS)]
    for step, (got, want) in enumerate(zip(mean_losses, want_losses)):
        loss_bounds[step].assert_holds(got, want, f"step {step} loss (mean over ranks)")


@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
@pytest.mark.multiprocess  # (the spawn of `results`)
def test_comm_per_sub_dimension_equals_the_formula(results, name):
    cfg = ENGINE_CONFIGS[name]
    shard = replicas = 2
    for res in results:
        run = res["engine"][name]
        psi = sum(padded for _, padded in run["flats"])
        n_flats = len(run["flats"])
        assert all(padded % shard == 0 for _, padded in run["flats"])
        want = hsdp_expected(cfg["stage"], psi, shard, replicas)
        reductions = 1 if cfg["defer"] else cfg["accum"]
        gathers = 1 if cfg["stage"] < 3 else 2 * cfg["accum"]  # ZeRO-3: forward + backward of every micro-step
        for records in run["records"]:
            got = {}
            for _, op, dim, numel, wire, tag in records:
                if tag != "grad_norm":
                    calls, payload, wire_bytes = got.get((dim, op), (0, 0, 0.0))
                    got[(dim, op)] = (calls + 1, payload + 4 * numel, wire_bytes + wire)  # fp32
            # per step: a reduce-scatter (over dp_shard) and an all-reduce of the shard (over dp_replicate) per
            # reduction, an all-gather of Ψ per gather
            per_step = {("dp_shard", "reduce_scatter"): (reductions, 4 * psi, (shard - 1) / shard),
                        ("dp_shard", "all_gather"): (gathers, 4 * psi, (shard - 1) / shard),
                        ("dp_replicate", "all_reduce"): (reductions, 4 * psi // shard, 2 * (replicas - 1) / replicas)}
            assert set(got) == set(per_step)
            for key, (times, payload, ring) in per_step.items():
                assert got[key][0] == n_flats * times, key
                assert got[key][1] == payload * times, key
                assert got[key][2] == pytest.approx(payload * times * ring), key
            if cfg["accum"] == 1:  # one micro-batch per step: the formula's figures themselves
                for dim, ops in want["by_dim"].items():
                    assert {op: got[(dim, op)][1] for op in ops} == ops
                    assert sum(w for (d, _), (_, _, w) in got.items() if d == dim) == pytest.approx(
                        want["wire_bytes"][dim])
            # the norm sums over the shard group only (replicas hold the same shards)
            assert {r[2] for r in records if r[5] == "grad_norm"} <= {"dp_shard"}


@pytest.mark.multiprocess  # (the spawn of `results`)
def test_replica_all_reduces_start_during_backward_not_after_it(results):
    """Each bucket's all-reduce starts at the next bucket's launch (the same point on every rank, whatever the
    timing): interleaved with later buckets' reduce-scatters, not all at the end of backward."""
    for res in results:
        for name in ("z2", "z3-llama-acc2"):
            records = res["engine"][name]["records"][0]
            rs = [seq for seq, op, dim, *_ in records if op == "reduce_scatter"]
            ar = [seq for seq, op, dim, *_ in records if op == "all_reduce" and dim == "dp_replicate"]
            assert len(rs) >= 3 and min(ar) < max(rs), name


@pytest.mark.parametrize("stage", (1, 2, 3))
@pytest.mark.multiprocess  # (the spawn of `results`)
def test_model_state_bytes_follow_the_stage_formula_with_n_shard(results, stage):
    shard = 2
    frozen = 6 * 6 + 6  # the toy model's frozen layer stays replicated (fp32)
    for res in results:
        r = res["memory"][stage]
        padded = [math.ceil(k / shard) * shard for k in r["flats"]]
        psi = sum(padded)
        owned = sum(min(max(k - r["shard_rank"] * (p // shard), 0), p // shard) for k, p in zip(r["flats"], padded))
        want = hsdp_expected(stage, psi, shard, 2)["memory"]
        m = r["measured"]
        # Adam's m and v cover this rank's real elements (not its padding), plus a 4-byte `step` per master tensor
        padding_state = 8 * (psi // shard - owned)
        assert m.params - frozen * 4 == want["params"]
        assert m.grads == want["grads"]
        assert m.optimizer - 4 * r["n_master"] + padding_state == want["optimizer"]
        # and not the plain ZeRO figure over all 4 data-parallel ranks
        assert m.total - frozen * 4 - 4 * r["n_master"] + padding_state == want["total"] > \
            hsdp_expected(stage, psi, 4, 1)["memory"]["total"]


@pytest.mark.multiprocess  # (the spawn of `results`)
def test_hsdp_refuses_stage_0_in_the_engine(results):
    assert "zero_stage 1, 2 or 3" in results[0]["stage0_error"]


def _model_reference(micro: int, model=None, batch=_batch, steps: int = STEPS, lr: float = LR,
                     eps: float = EPS_MODEL, clip: float = CLIP, dp: int = 4, aux_scale: bool = False):
    from fivefold.models import get_config
    from fivefold.models.llama import Llama
    from fivefold.models.parallelize import set_aux_grad_scale

    model = Llama(model or get_config("tiny", **MODEL), seed=0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=eps)
    if aux_scale:
        set_aux_grad_scale([model], 1.0 / micro)
    losses, history = [], []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        total = 0.0
        for i in range(micro):  # the global micro-batch i: every dp rank's i-th micro-batch
            xi = torch.cat([xr.chunk(micro)[i] for xr in x.chunk(dp)])
            yi = torch.cat([yr.chunk(micro)[i] for yr in y.chunk(dp)])
            loss = torch.nn.functional.cross_entropy(model(xi).flatten(0, 1), yi.flatten()) / micro
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, history


def _model_training_reference(micro: int, dp: int, kernels: str = WORKERS):
    """`_model_reference` through `tolerance.reference`: ((losses, history), (their bounds)), cached."""
    return reference(_model_reference, micro, dp=dp, kernels=kernels, terms=MODEL_TERMS)


def _assert_equal_training(runs: list[dict], want, bounds, first_step: int = 0) -> None:
    (want_losses, want_history), (loss_bounds, history_bounds) = want, bounds
    for rank, run in enumerate(runs):
        assert len(run["losses"]) == len(want_losses) - first_step, f"rank {rank}"
        for step, got in enumerate(run["losses"], first_step):
            loss_bounds[step].assert_holds(got, want_losses[step], f"rank {rank} step {step} loss")
        for step, got in enumerate(run["history"], first_step):
            want = want_history[step]
            assert got.keys() == want.keys()
            for pname, value in got.items():
                history_bounds[step][pname].assert_holds(value, want[pname], f"rank {rank} step {step} {pname}")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(PARALLEL_RUNS))
@pytest.mark.multiprocess  # (the spawn of `results`)
def test_parallelized_llama_under_hsdp_equals_single_process(results, name, kernels):
    dims, _, micro = PARALLEL_RUNS[name]
    _assert_equal_training([res["parallel"][name] for res in results],
                           *_model_training_reference(micro, dims["dp"], kernels))


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.multiprocess  # (the spawn of `results`)
def test_moe_under_hsdp_equals_single_process(results, kernels):
    import test_expert_parallel as moe

    (want_losses, want_history), (loss_bounds, history_bounds) = moe.moe_training_reference(4, kernels=kernels)
    for rank, res in enumerate(results):
        run = res["moe"]
        assert run["dims"] == {"dp_shard", "ep_dp"}
        assert len(run["losses"]) == len(want_losses), f"rank {rank}"
        for step, (got, want) in enumerate(zip(run["losses"], want_losses)):
            loss_bounds[step].assert_holds(got, want, f"rank {rank} step {step} loss")
        for step, got in enumerate(run["history"]):
            for pname, value in got.items():
                history_bounds[step][pname].assert_holds(value, want_history[step][pname],
                                                         f"rank {rank} step {step} {pname}")


@pytest.mark.multiprocess  # (the spawn of `results`)
def test_checkpoint_saved_under_hsdp_resumes_exactly_and_under_plain_zero(results):
    micro = PARALLEL_RUNS["z3"][2]
    for res in results:
        saved = res["parallel"]["z3"]
        same = res["resumed-same"]
        assert same["losses"] == saved["losses"][K:]  # bitwise: the same layout, the same reduction order
        for got, want in zip(same["history"], saved["history"][K:]):
            for pname, value in want.items():
                assert torch.equal(got[pname], value), pname
        # Another layout from step K: the single-process training the saved run follows, within its bound (the
        # bound covers every step's sums in another order, those before the checkpoint and those after).
        _assert_equal_training([res["resumed-dp4-zero2"]], *_model_training_reference(micro, HSDP["dp"]),
                               first_step=K)


# ---------------------------------------------------------------------------------------------
# When the replica all-reduces are waited, in-process: rank 0 of dp_shard 2 × dp_replicate 2 on torch's fake
# process group (collectives complete at once and send nothing: the order of calls and the buffers' lives are what
# is checked here; the values, by the spawned tests above). CPU tensors, so storages can be told apart.
WAIT_CONFIGS = {  # name: (stage, micro-batches, constant buffers)
    "z2": (2, 1, False), "z3": (3, 1, False),
    "z2-acc2": (2, 2, False),  # the second micro-step's shards land in temporaries
    "z2-acc2-constant": (2, 2, True), "z3-acc2-constant": (3, 2, True),  # pooled full buffers and shards
    "z1-acc2": (1, 2, False),
}


def _record_waits(stage: int, micro: int, constant: bool, monkeypatch) -> tuple[list[list[tuple]], list[str], list]:
    """Every collective's issue and wait, per backward; every misuse seen: a pooled buffer handed out, or a reduced
    shard added to the gradient, while a collective on its storage was not waited yet; and the bytes of the shard
    outputs alive when a later micro-step's are first added, beside the stage's `transient_bytes` for them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fivefold.data_parallel import ZeroDataParallel
    from fivefold.data_parallel.buckets import BufferPool
    from fivefold.data_parallel.flat_param import FlatParam
    from fivefold.distributed.comm import Comm
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh

    events: list[tuple] = []
    unwaited: dict[int, set[int]] = {}  # id(work) -> storages its collective reads or writes
    misuse: list[str] = []

    def storages(*tensors: torch.Tensor) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in tensors}

    def watched(op: str, tensors_of):
        plain = getattr(Comm, op)

        def call(self, *args, **kwargs):
            work = plain(self, *args, **kwargs)
            tag = kwargs.get("tag", "")
            events.append(("issue", op, self.dim, tag))
            return None if work is None else _Watched(work, (op, self.dim, tag), storages(*tensors_of(*args)))
        monkeypatch.setattr(Comm, op, call)

    class _Watched:
        """A work handle whose first wait is recorded (and which stops counting its storages as in flight)."""

        def __init__(self, work, what: tuple, held: set[int]) -> None:
            self.work, self.what = work, what
            unwaited[id(self)] = held

        def wait(self, *args, **kwargs):
            out = self.work.wait(*args, **kwargs)
            if unwaited.pop(id(self), None) is not None:
                events.append(("wait", *self.what))
            return out

        def __getattr__(self, name: str):
            return getattr(self.work, name)

    def in_flight(t: torch.Tensor) -> bool:
        return any(t.untyped_storage().data_ptr() in s for s in unwaited.values())

    watched("reduce_scatter", lambda out, inp, *a: (out, inp))
    watched("all_reduce", lambda t, *a: (t,))
    acquire, accumulate = BufferPool.acquire, FlatParam.accumulate_grad

    def checked_acquire(self, numel):
        view = acquire(self, numel)
        if in_flight(view):
            misuse.append(f"a pooled buffer handed out while a collective on it runs: {events[-3:]}")
        return view

    held: list[tuple[int, int]] = []  # (shard outputs alive, the formula's) when a later micro-step's are added

    def checked_accumulate(self, shard):
        if in_flight(shard) or (self.grad_shard is not None and in_flight(self.grad_shard)):
            misuse.append(f"flat {self.index}: a shard read before its collective was waited")
        strategy = model.strategy
        if stage >= 2 and not events_seen_accumulate and all(f.grad_shard is not None for f in strategy.flats):
            events_seen_accumulate.append(True)  # the first addition of a later micro-step: every output alive
            alive = {id(b.out): b.out.numel() * b.out.element_size() for b in strategy.buckets if b.out is not None}
            want = strategy.transient_bytes(param_bytes=4, grad_bytes=4, accumulating=False, reductions=micro)
            held.append((sum(alive.values()), want["reduce-scatter outputs"]))
        return accumulate(self, shard)
    monkeypatch.setattr(BufferPool, "acquire", checked_acquire)
    monkeypatch.setattr(FlatParam, "accumulate_grad", checked_accumulate)

    dist.init_process_group("cpu:fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = ParallelMesh(ParallelDims(**HSDP), "cpu", CommLog())
        model = ZeroDataParallel(build_toy(), mesh.comm("dp_shard"), replicate=mesh.comm("dp_replicate"),
                                 zero_stage=stage, bucket_mb=SMALL_BUCKET_MB, units=[nn.Linear], lr=LR,
                                 constant_buffers=constant)
        backwards, events_seen_accumulate = [], []
        for step in range(2):  # the second: the optimizer state exists, pools are warm
            x, y = toy_batch(step, batch=4)
            for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
                events.clear()
                events_seen_accumulate.clear()
                model.backward(lm_loss(model(xm), ym) / micro)
                backwards.append(list(events))
            model.step()
        return backwards, misuse, held
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(WAIT_CONFIGS))
def test_replica_all_reduces_are_waited_at_the_end_of_backward(name, monkeypatch):
    """FSDP2's order: every bucket's reduce-scatter issued, and its all-reduce started, before any replica
    all-reduce is waited (none waited when the next bucket is issued, nor by the in-flight bound); every one
    waited before backward returns; no buffer reused or read while its collective runs."""
    backwards, misuse, held = _record_waits(*WAIT_CONFIGS[name], monkeypatch)
    assert not misuse, misuse[:3]
    stage, micro, _ = WAIT_CONFIGS[name]
    if stage >= 2 and micro > 1:  # every bucket's shard output alive at the end of backward: the formula exactly
        assert len(held) == 2 and all(got == want > 0 for got, want in held), held
    for events in backwards:
        issued_rs = [i for i, e in enumerate(events) if e[:3] == ("issue", "reduce_scatter", "dp_shard")]
        issued_ar = [i for i, e in enumerate(events) if e[:3] == ("issue", "all_reduce", "dp_replicate")]
        waited_ar = [i for i, e in enumerate(events) if e[:3] == ("wait", "all_reduce", "dp_replicate")]
        assert len(issued_rs) >= 3 and len(issued_ar) == len(waited_ar) == len(issued_rs), events
        assert min(waited_ar) > max(issued_rs), f"{name}: a replica all-reduce waited before the last " \
            f"reduce-scatter was issued: {events}"
        assert min(issued_ar) < max(issued_rs)  # started during backward, interleaved with the reduce-scatters
        tags = [e[3] for e in events if e[:3] == ("issue", "all_reduce", "dp_replicate")]
        assert tags == [e[3] for e in events if e[:3] == ("wait", "all_reduce", "dp_replicate")]  # bucket order
