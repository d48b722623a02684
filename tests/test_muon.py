"""Muon under ZeRO 0-3 (docs/design.md#muon-under-zero): whole-parameter owners against torch's own
`torch.optim.Muon` (+ AdamW for the rest) in one process; the owners' balance and the traffic
against the formulas.

One spawn per world size (2 and 3; every test here but the in-process ones `multiprocess`): a tiny
Llama trained 5 steps with Muon for its blocks' matrices and AdamW for the embedding, the head and
the norms, at ZeRO 0, 1, 2 (+ accumulation, + offload) and 3, in fp32. The reference is the
single-process model with the same two torch optimizers; the bounds are tests/tolerance.py's, whose
rule 2 re-runs the reference with every gradient moved by rule 1's bound, so Muon's bf16
Newton-Schulz iteration's sensitivity is the reference's own."""

from __future__ import annotations

import pytest
import torch
from dist_utils import initial_state, lm_loss, run_workers, toy_batch
from tolerance import KERNELS, Bound, assert_within, reference
from torch import nn

from fivefold import formulas
from fivefold.data_parallel import ZeroDataParallel
from fivefold.data_parallel.buckets import assign_buckets
from fivefold.data_parallel.optimizers import InnerOptimizer, MatricesApart, inner_optimizer
from fivefold.data_parallel.ownership import balance_owners
from fivefold.distributed.comm import Comm, CommLog
from fivefold.models import build_model, get_config
from fivefold.models.plans import is_block_matrix as block_matrix
from fivefold.observe.memory import model_state_bytes

STEPS = 5
LR, WD, CLIP, EPS = 1e-2, 0.1, 0.5, 1e-4
MUON = dict(lr=LR, momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
# the tiny Llama's widest inner dimension (ffn_hidden 96) and the 12 × 5 tokens summed into a weight
# gradient: tests/tolerance.py rule 1's n
TERMS = 96
# rule 2's perturbed re-runs (tests/tolerance.py): Muon's bf16 iteration turns any flipped rounding
# into a deviation of about the same size, so the bound is the largest of several such samples
SHADOW_RUNS = 6
# The deviation a flipped rounding causes in Muon's output does not shrink with the flip's cause: it
# saturates at about a sixth of a step's update from the first step on (six seeds of rule 2 measured
# 0.7-1.3e-3 at step 0 and 2.3-3.3e-3 at step 4 on the attention's output matrix), so one more
# sample (the layout) may land above the largest of six, and through the forward it reaches every
# parameter; the bound is twice that largest one. What the margin could hide — a wrong update rule,
# weight decay, a lost gradient — the exact check (torch's optimizers on the engine's gradients)
# catches.
MUON_MARGIN = 2.0


def _tiny_llama() -> nn.Module:
    return build_model(get_config("tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                                  max_seq_len=16, vocab_size=13), seed=0)


def is_block_matrix(name: str, p: nn.Parameter) -> bool:
    return name.startswith("layers.") and p.ndim == 2


def _choice() -> MatricesApart:
    return MatricesApart(
        matrices=inner_optimizer(torch.optim.Muon, MUON),
        rest=InnerOptimizer(torch.optim.AdamW, dict(lr=LR, eps=EPS)),
        is_matrix=is_block_matrix,
    )


def _cfg(stage: int, accum: int = 1, offload: bool = False, bucket_mb: float = 0.01, clip: float | None = None) -> dict:
    return dict(stage=stage, accum=accum, offload=offload, bucket_mb=bucket_mb, clip=clip)


CONFIGS = [
    *[_cfg(s) for s in range(4)],  # the exact check: the same gradients, torch's optimizers
    _cfg(2, accum=2), _cfg(3, accum=2), _cfg(1, offload=True), _cfg(1, bucket_mb=25),
    *[_cfg(s, clip=CLIP) for s in range(4)],  # clipping on: against single-process training only
]
IDS = [f"z{c['stage']}-acc{c['accum']}{'-offload' if c['offload'] else ''}-b{c['bucket_mb']}"
       f"{'-clip' if c['clip'] else ''}" for c in CONFIGS]


def _engine(cfg: dict, comm: Comm) -> ZeroDataParallel:
    return ZeroDataParallel(_tiny_llama(), comm, zero_stage=cfg["stage"], bucket_mb=cfg["bucket_mb"],
                            weight_decay=WD, optimizers=_choice(), offload_optimizer=cfg["offload"])


def _reduced_grads(model: ZeroDataParallel, comm: Comm) -> dict[str, torch.Tensor]:
    """The averaged gradient of every parameter as the engine will step it, gathered whole from the
    owners' shards (what a single process would hand its optimizers)."""
    out = {}
    for f in model.flats:
        shard = f.grad_shard if f.grad_shard is not None else torch.zeros(f.shard_numel)
        full = torch.empty(f.layout.padded_numel)
        if f.sharded:
            comm.all_gather(full, shard.float().contiguous(), sizes=f.shard_sizes, tag="test")
        else:
            full.copy_(shard)
        for i, name in enumerate(f.names):
            out[name] = f.layout.view(full, i).clone()
    return out


def _torch_optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """torch.optim.Muon for the blocks' matrices, AdamW for the rest (decay off for the embedding and
    1-D parameters), as the engine groups them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if is_block_matrix(n, p)]
    embedding = model.tok_embeddings.weight
    rest = [p for n, p in named if not is_block_matrix(n, p)]
    decay = [p for p in rest if p.ndim >= 2 and p is not embedding]
    no_decay = [p for p in rest if all(p is not d for d in decay)]
    muon = torch.optim.Muon([{"params": matrices, "weight_decay": WD}], **MUON)
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=LR, eps=EPS)
    return muon, adamw


def _train(cfg: dict) -> dict:
    """Five steps; before each, the torch optimizers over a whole copy of the model are stepped with
    the engine's own reduced gradients (clipping off: it would clip the copy by another rounding of
    the same norm), and the difference of every parameter recorded."""
    comm = Comm(None, "dp", CommLog())
    model = _engine(cfg, comm)
    whole = _tiny_llama()
    torch_muon, torch_adamw = _torch_optimizers(whole)
    rank, world, accum = comm.rank, comm.size, cfg["accum"]
    history, records, same_grads = [], [], []
    for step in range(STEPS):
        x, y = toy_batch(step)
        comm.log.reset()
        for xm, ym in zip(x.chunk(world)[rank].chunk(accum), y.chunk(world)[rank].chunk(accum)):
            model.backward(lm_loss(model(xm).float(), ym) / accum)
        if step == 1:
            measured = model_state_bytes(model)
        clip = cfg["clip"]
        if clip is None:  # the exact check: torch's optimizers on the same gradients
            for name, g in _reduced_grads(model, comm).items():
                whole.get_parameter(name).grad = g
            torch_muon.step()
            torch_adamw.step()
        model.step(clip)
        records.append([(r.op, r.numel, r.payload_bytes, r.tag) for r in comm.log.records])
        state = {k: v.clone() for k, v in model.full_state_dict().items()}
        history.append(state)
        if clip is None:
            same_grads.append(max(float((state[n] - p.detach()).abs().max()) for n, p in whole.named_parameters()))
    owned = {s.name: f.start <= s.offset < f.end for f in model.flats for s in f.layout.slots}
    return dict(history=history, records=records, measured=measured, same_grads=same_grads,
                flats=[_flat_facts(f, model.optimizer) for f in model.flats],
                owned=owned,
                state=sorted(type(o).__name__ for o in getattr(model.optimizer.optimizer, "optimizers",
                                                                  [model.optimizer.optimizer])),
                momentum=sorted(tuple(v.shape) for s in model.optimizer.state.values()
                                for k, v in s.items() if k == "momentum_buffer"))


def _flat_facts(f, optimizer) -> dict:
    inner = [optimizer.group_optimizers[g] for g, _, _ in f.segments]  # 0: Muon, 1: AdamW
    sizes = [b - a for _, a, b in f.segments]
    return dict(numel=f.layout.numel, padded=f.layout.padded_numel, sizes=f.shard_sizes, whole=f.whole_params,
                shard=f.shard_numel, names=list(f.names), segments=len(f.segments),
                muon_elements=sum(n for n, k in zip(sizes, inner) if k == 0), muon_segments=inner.count(0),
                adamw_elements=sum(n for n, k in zip(sizes, inner) if k == 1), adamw_segments=inner.count(1))


def _worker() -> dict:
    return {"runs": [_train(cfg) for cfg in CONFIGS]}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def muon_results(request):
    return request.param, run_workers(_worker, request.param)


def _reference(accum: int, clip: float | None, init: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """torch.optim.Muon for the blocks' matrices, AdamW for the rest, on the global batch."""
    model = _tiny_llama()
    model.load_state_dict(init)
    muon, adamw = _torch_optimizers(model)
    history = []
    for step in range(STEPS):
        x, y = toy_batch(step)
        muon.zero_grad()
        adamw.zero_grad()
        for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
            (lm_loss(model(xm), ym) / accum).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        muon.step()
        adamw.step()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return history


@pytest.mark.multiprocess
@pytest.mark.parametrize("i", [i for i, c in enumerate(CONFIGS) if c["clip"] is None],
                         ids=[IDS[i] for i, c in enumerate(CONFIGS) if c["clip"] is None])
def test_muon_under_zero_steps_exactly_as_torch_muon_on_the_same_gradients(muon_results, i):
    """Given the gradients the engine reduced (gathered whole), torch.optim.Muon + AdamW over a whole
    copy of the model end every step where fivefold's owners put the parameters: no difference
    beyond fp32's rounding of the same operations (here: none)."""
    world, results = muon_results
    for rank, res in enumerate(results):
        worst = res["runs"][i]["same_grads"]
        assert len(worst) == STEPS
        assert max(worst) <= 1e-6, f"rank {rank}: {worst}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=IDS)
@pytest.mark.parametrize("kernels", KERNELS)
def test_muon_under_zero_equals_torch_muon_single_process(muon_results, i, kernels):
    world, results = muon_results
    cfg = CONFIGS[i]
    init = initial_state(_tiny_llama())
    want, bounds = reference(_reference, cfg["accum"], cfg["clip"], init, kernels=kernels, terms=TERMS,
                             shadow_runs=SHADOW_RUNS)
    for rank, res in enumerate(results):
        run = res["runs"][i]
        assert run["state"] == ["AdamW", "Muon"]
        for step, (got, ref) in enumerate(zip(run["history"], want)):
            assert got.keys() == ref.keys()
            step_bounds = {name: Bound(b.rtol, b.atol * MUON_MARGIN) for name, b in bounds[step].items()}
            assert_within(got, ref, step_bounds, f"rank {rank} step {step}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=IDS)
def test_every_matrix_is_owned_whole_and_the_owners_are_balanced(muon_results, i):
    world, results = muon_results
    cfg = CONFIGS[i]
    model = _tiny_llama()
    params = dict(model.named_parameters())
    runs = [res["runs"][i] for res in results]
    whole_flats = [k for k, f in enumerate(runs[0]["flats"]) if f["whole"]]
    assert whole_flats, "the block matrices live in whole-parameter flats"
    for flat in runs[0]["flats"]:
        if any(is_block_matrix(n, params[n]) for n in flat["names"]):
            assert flat["whole"]
    sharded = cfg["stage"] > 0
    if not sharded:
        assert all(f["sizes"] is None for f in runs[0]["flats"])
        return
    # each parameter of a whole flat lies in exactly one rank's shard (whole), no padding
    for k in whole_flats:
        flats = [run["flats"][k] for run in runs]
        assert flats[0]["padded"] == flats[0]["numel"] == sum(flats[0]["sizes"])
        assert [f["shard"] for f in flats] == flats[0]["sizes"]
        for name in flats[0]["names"]:
            assert sum(run["owned"][name] for run in runs) == 1
    # the owners are the greedy balance over all whole flats: O_r ≤ O/N + p_max
    whole_names = [n for k in whole_flats for n in runs[0]["flats"][k]["names"]]
    loads = [sum(params[n].numel() for n in whole_names if run["owned"][n]) for run in runs]
    sizes = [params[n].numel() for n in whole_names]
    assert sum(loads) == sum(sizes)
    assert max(loads) <= formulas.owner_bound(sizes, world)
    expected = balance_owners([(n, params[n].numel()) for n in whole_names], world)
    assert loads == [sum(params[n].numel() for n in whole_names if expected[n] == r) for r in range(world)]
    # Muon's momentum buffers are the owned matrices, whole
    mine = [sorted(tuple(params[n].shape) for n in whole_names if run["owned"][n] and is_block_matrix(n, params[n]))
            for run in runs]
    assert [run["momentum"] for run in runs] == mine


@pytest.mark.multiprocess
@pytest.mark.parametrize("i", range(len(CONFIGS)), ids=IDS)
def test_muon_traffic_per_step_equals_the_formula(muon_results, i):
    """Whole-parameter flats carry no padding: per step a reduce-scatter of every flat's Ψ_f
    elements per gradient reduction and an all-gather of Ψ_f (ZeRO-1/2: once; ZeRO-3: forward and
    backward of each micro-batch) — exactly, in elements and bytes (fp32)."""
    world, results = muon_results
    cfg = CONFIGS[i]
    for res in results:
        run = res["runs"][i]
        numels = [f["padded"] for f in run["flats"]]
        reductions = cfg["accum"]
        gathers = 1 if cfg["stage"] < 3 else 2 * cfg["accum"]
        for records in run["records"]:
            ops = [r for r in records if r[3] not in ("grad_norm", "test")]  # (the test's own gathers)
            rs = [r for r in ops if r[0] == "reduce_scatter"]
            ag = [r for r in ops if r[0] == "all_gather"]
            ar = [r for r in ops if r[0] == "all_reduce"]
            if cfg["stage"] == 0:
                assert sum(r[1] for r in ar) == sum(numels) * reductions and not rs and not ag
                continue
            assert sum(r[1] for r in rs) == sum(numels) * reductions
            assert sum(r[2] for r in rs) == 4 * sum(numels) * reductions
            assert sum(r[1] for r in ag) == sum(numels) * gathers
            assert sum(r[2] for r in ag) == 4 * sum(numels) * gathers


@pytest.mark.multiprocess
@pytest.mark.parametrize("i", [i for i, c in enumerate(CONFIGS) if not c["offload"]],
                         ids=[IDS[i] for i, c in enumerate(CONFIGS) if not c["offload"]])
def test_muon_model_state_bytes_equal_the_formula(muon_results, i):
    """Exact bytes per rank: fp32 params and grads as for AdamW; optimizer: Muon's momentum, 4 bytes
    per owned matrix element, AdamW's m and v, 8 bytes per owned element, and its 4-byte step per
    optimizer tensor (`formulas.flat_model_state_bytes`, `formulas.optimizer_state_bytes`)."""
    world, results = muon_results
    cfg = CONFIGS[i]
    for res in results:
        run = res["runs"][i]
        want = {"params": 0, "grads": 0, "optimizer": 0}
        for f in run["flats"]:
            state = formulas.optimizer_state_bytes([(f["muon_elements"], 4, f["muon_segments"], 0),
                                                    (f["adamw_elements"], 8, f["adamw_segments"], 4)])
            part = formulas.flat_model_state_bytes(
                f["padded"], f["shard"], f["muon_elements"] + f["adamw_elements"], f["segments"],
                stage=cfg["stage"], param_bytes=4, grad_bytes=4, separate_master=False, state=state)
            for k in want:
                want[k] += part[k]
        m = run["measured"]
        assert (m.params, m.grads, m.optimizer) == (want["params"], want["grads"], want["optimizer"])


# -- in process --------------------------------------------------------------------------------------


def test_the_greedy_owners_stay_within_one_parameter_of_the_mean():
    sizes = [("a", 100), ("b", 60), ("c", 60), ("d", 30), ("e", 10), ("f", 10)]
    owners = balance_owners(sizes, 3)
    loads = [sum(n for name, n in sizes if owners[name] == r) for r in range(3)]
    assert owners == {"a": 0, "b": 1, "c": 2, "d": 1, "e": 2, "f": 2}
    assert loads == [100, 90, 80]
    assert max(loads) <= formulas.owner_bound([n for _, n in sizes], 3) == 270 // 3 + 100
    assert balance_owners(sizes, 3) == owners  # the same on every rank


def test_buckets_do_not_mix_whole_and_sharded_parameters_but_norms_join_either():
    model = _tiny_llama()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def kind(name, p):
        return "whole" if is_block_matrix(name, p) else (None if p.ndim < 2 else "shards")

    buckets = assign_buckets(named, 2**30, kind)
    kinds = [{kind(n, p) for n, p in b} - {None} for b in buckets]
    assert all(len(k) <= 1 for k in kinds)
    assert len(buckets) == 3  # the head (+ final norm), the blocks, the embedding
    assert sum(len(b) for b in buckets) == len(named)


def test_an_optimizer_that_couples_parameters_is_refused_in_one_line():
    with pytest.raises(ValueError, match="LBFGS is not known to step each parameter on its own"):
        inner_optimizer(torch.optim.LBFGS)
    assert not inner_optimizer(torch.optim.Muon).elementwise
    assert inner_optimizer(torch.optim.AdamW).elementwise


def test_muon_is_refused_with_zeropp_collectives():
    class One(Comm):
        def __init__(self):
            self.size, self.rank, self.dim, self.device, self.log = 2, 0, "dp", torch.device("cpu"), CommLog()

    for flag in ("qwz", "qgz"):
        with pytest.raises(ValueError, match="ZeRO\\+\\+'s qwz / qgz / hpz_comm assume equal shards"):
            ZeroDataParallel(_tiny_llama(), One(), zero_stage=3, optimizers=_choice(), **{flag: True})



# -- Muon in the trainer's layouts ------------------------------------------------------------------

LAYOUT_SEQ, LAYOUT_ROWS, LAYOUT_MICRO, LAYOUT_STEPS = 32, 8, 2, 3
LAYOUTS = {  # name: (world, mesh dims, preset, ZeRO stage)
    "pp2-zero1": (2, dict(pp=2), "tiny", 1),
    "moe-ep2-zero2": (2, dict(dp=2, ep=2), "tiny-moe", 2),  # every expert's matrices owned whole over ep_dp
    "hsdp-dp4-replicate2-zero2": (4, dict(dp=4, dp_replicate=2), "tiny", 2),
    "dp2-cp2-zero3": (4, dict(dp=2, cp=2), "tiny", 3),
    # with FP8 linears and ZeRO-3's FP8 gather (the units owned whole for both): against the fp32 reference, the
    # losses within e4m3's precision (tests/test_float8_training.py's band)
    "dp2-zero3-fp8-gather": (2, dict(dp=2), "tiny", 3),
}


def _layout_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(800 + step)
    tokens = torch.randint(0, 256, (LAYOUT_ROWS, LAYOUT_SEQ + 1), generator=g)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


def _layout_reference(preset: str, dp: int) -> dict:
    """Single-process training as the trainer configures Muon (`parallelize.optimizer_choice`): torch's Muon for
    the blocks' matrices, AdamW for the rest, the trainer's decay groups and clipping, global micro-batch i = every
    dp rank's i-th."""
    from fivefold.config import Config
    from fivefold.models import get_config
    from fivefold.models.llama import Llama
    from fivefold.models.loss import lm_cross_entropy
    from fivefold.models.parallelize import set_aux_grad_scale
    from fivefold.models.plans import is_block_matrix as matrix

    t, o = Config().train, Config().optim
    net = Llama(get_config(preset), seed=t.seed)
    named = list(net.named_parameters())
    muon = torch.optim.Muon([{"params": [p for n, p in named if matrix(n, p)], "weight_decay": t.weight_decay}],
                            lr=t.lr, momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                            adjust_lr_fn=o.muon_adjust_lr)
    rest = [(n, p) for n, p in named if not matrix(n, p)]
    decay = [p for n, p in rest if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for _, p in rest if all(p is not d for d in decay)]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=EPS)
    set_aux_grad_scale([net], 1.0 / LAYOUT_MICRO)
    losses = []
    for step in range(LAYOUT_STEPS):
        x, y = _layout_batch(step)
        muon.zero_grad()
        adamw.zero_grad()
        total = 0.0
        for i in range(LAYOUT_MICRO):
            xi = torch.cat([xr.chunk(LAYOUT_MICRO)[i] for xr in x.chunk(dp)])
            yi = torch.cat([yr.chunk(LAYOUT_MICRO)[i] for yr in y.chunk(dp)])
            loss = lm_cross_entropy(net(xi), yi) / LAYOUT_MICRO
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        muon.step()
        adamw.step()
        losses.append(total)
    return dict(losses=losses, state={n: p.detach().clone() for n, p in net.named_parameters()})


def _layout_train(name: str) -> dict:
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize

    _, dims, preset, stage = LAYOUTS[name]
    cfg = Config()
    cfg.optim.name, cfg.zero.stage = "muon", stage
    if "fp8" in name:
        cfg.precision.fp8, cfg.zero.fp8_gather = "tensorwise", True
    cfg.train.grad_accum, cfg.train.seq_len, cfg.train.warmup_steps = LAYOUT_MICRO, LAYOUT_SEQ, 0
    cfg.train.eps = EPS
    cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.ep = dims.get("pp", 1), dims.get("cp", 1), dims.get("ep", 1)
    cfg.parallel.dp_replicate = dims.get("dp_replicate", 1)
    mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
    parts = parallelize(cfg, get_config(preset), mesh, "cpu")
    dp = mesh.comm("dp")
    losses = []
    for step in range(LAYOUT_STEPS):
        x, y = (t.chunk(dp.size)[dp.rank] for t in _layout_batch(step))
        loss = parts.forward_backward(list(zip(x.chunk(LAYOUT_MICRO), y.chunk(LAYOUT_MICRO))))
        parts.step(1.0)
        losses.append(parts.global_loss(loss).item())
    whole = [f.whole_params for e in parts.engines.values() for f in e.flats]
    momentum = sorted(n for e in parts.engines.values() for f in e.flats
                      for (_, a, b), mp in zip(f.segments, f.master_params)
                      if "momentum_buffer" in e.optimizer.state.get(mp, {})
                      for n in [f.names[i] for i, slot in enumerate(f.layout.slots)
                                if f.start + a <= slot.offset < f.start + b])
    return dict(losses=losses, state=parts.full_state_dict(), shard=mesh.rank("ep"), whole=whole,
                momentum=momentum)


def _layout_worker(world: int) -> dict:
    return {name: _layout_train(name) for name, (w, *_) in LAYOUTS.items() if w == world}


@pytest.fixture(scope="module")
def layout_results():
    by_world = {w: run_workers(_layout_worker, w, w) for w in sorted({w for w, *_ in LAYOUTS.values()})}
    return {name: [ranks[name] for ranks in by_world[w]] for name, (w, *_) in LAYOUTS.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_muon_trains_like_one_process_in_the_trainers_layouts(layout_results, name, kernels):
    """pp (a Muon optimizer per stage engine), MoE ep (each expert's matrices owned whole over ep_dp), HSDP (owners
    inside the shard group, the shards all-reduced across replicas) and dp × cp with ZeRO-3, against torch's Muon +
    AdamW in one process, with the bound of the end-to-end test above."""
    _, dims, preset, _ = LAYOUTS[name]
    want, bounds = reference(_layout_reference, preset, dims.get("dp", 1), kernels=kernels, terms=TERMS,
                             shadow_runs=SHADOW_RUNS)
    moe, fp8 = preset.endswith("moe"), "fp8" in name
    stepped = sorted(n for res in layout_results[name] for n in res["momentum"])
    matrices = sorted({n for res in layout_results[name] for n, p in res["state"].items() if block_matrix(n, p)})
    assert set(stepped) == set(matrices), f"{name}: Muon steps {set(stepped) ^ set(matrices)} wrongly"
    for rank, res in enumerate(layout_results[name]):
        assert any(res["whole"]), f"rank {rank} {name}: no whole-parameter flat"
        for step, got in enumerate(res["losses"]):
            b = bounds["losses"][step]
            if fp8:
                b = Bound(0.0, 2.0**-4 * abs(want["losses"][step]) / MUON_MARGIN)
            Bound(b.rtol, b.atol * MUON_MARGIN).assert_holds(got, want["losses"][step], f"rank {rank} {name} loss {step}")
        if moe or fp8:  # a routing decision flips with the smallest change; FP8 rounds: only the loss is compared
            continue
        for pname, got in res["state"].items():
            full = want["state"][pname]
            if got.shape != full.shape:  # an ep shard: its experts
                d = next(i for i, (a, b) in enumerate(zip(got.shape, full.shape)) if a != b)
                full = full.chunk(full.shape[d] // got.shape[d], dim=d)[res["shard"]]
            b = bounds["state"][pname]
            Bound(b.rtol, b.atol * MUON_MARGIN).assert_holds(got, full, f"rank {rank} {name} {pname}")


def test_fivefolds_muon_skips_a_step_on_the_device_flag_and_otherwise_is_torchs():
    """`optimizers.Muon` with ``found_inf`` 0 steps bit for bit as torch.optim.Muon (the same operations, out of
    place); with 1 it changes neither the parameters nor the momentum — no host read either way."""
    from fivefold.data_parallel.optimizers import Muon

    g = torch.Generator().manual_seed(3)
    start = [torch.randn(8, 12, generator=g), torch.randn(16, 4, generator=g)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]

    def run(cls, flags):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = cls(params, **MUON, weight_decay=WD)
        for step_grads, flag in zip(grads, flags):
            for p, gr in zip(params, step_grads):
                p.grad = gr.clone()
            if flag is not None:
                opt.found_inf = torch.tensor(float(flag))
            opt.step()
        return [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params]

    torch_params, torch_bufs = run(torch.optim.Muon, [None] * 3)
    ours, bufs = run(Muon, [0.0, 0.0, 0.0])
    assert all(torch.equal(a, b) for a, b in zip(ours, torch_params))
    assert all(torch.equal(a, b) for a, b in zip(bufs, torch_bufs))
    once, once_bufs = run(Muon, [0.0, 1.0, 1.0])  # the second and third steps skipped
    first, first_bufs = run(torch.optim.Muon, [None])
    assert all(torch.equal(a, b) for a, b in zip(once, first))
    assert all(torch.equal(a, b) for a, b in zip(once_bufs, first_bufs))
    assert not Muon([torch.nn.Parameter(torch.zeros(2, 2))]).takes_found_inf  # on the CPU: the host reads the norm
