"""``precision.fp8`` in every layout (docs/design.md#fp8-training): FP8 training equals the
single-process FP8 training of the same micro-batches.

An FP8 scale is computed over what one rank's micro-batch holds of whole sequences: the max over tp
where a rank holds a slice of an operand, over cp where it holds part of each sequence, never over
dp (each rank's micro-batch keeps its own activation scales, as torchao's). So the reference is one
process running the same model with each linear's FP8 matmul applied per dp rank's rows of the
global micro-batch (`_PerRank`), which is what the layouts compute, summed in another order.

Two spawns (world 2 and 4, `multiprocess`) train three steps, fp32 parameters (the FP8 GEMMs and
nothing else round coarsely), tensorwise and rowwise: DDP, ZeRO-1/2/3, ZeRO-3 with the FP8 gather
(+ full recompute, + compiled blocks), tp 2 (+ SP), pp 2 (1F1B; ZB-H1, whose W runs the FP8 weight-gradient
GEMM later), cp 2, MoE ep 2 (the attention in FP8, the experts not), selective-op recompute; at world 4
dp × tp with ZeRO-3's FP8 gather (a weight's amax the max over its tp slices), dp × cp,
pp × tp + SP and HSDP with the FP8 gather. The first forward of tp / cp layouts is checked operand by operand: every FP8 GEMM
of the first block gets bit-exact slices of the reference's FP8 operands and scales."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_workers
from tolerance import KERNELS, WORKERS, reference

from fivefold import float8, formulas
from fivefold.config import Config
from fivefold.distributed.comm import CommLog

SEQ, ROWS, MICRO, STEPS = 32, 8, 2, 3
EPS = 1e-4  # as tests/test_compile.py: Adam's division by |g| + eps kept from amplifying reordered sums
TERMS = 384  # rule 1's n: the longest reordered sum (w2's inner dimension under tp; the batch's tokens)
LAYOUTS = {  # name: (world, mesh dims, preset, options)
    "ddp": (2, dict(dp=2), "tiny", dict(zero=0)),
    "zero1": (2, dict(dp=2), "tiny", dict(zero=1)),
    "zero2-rowwise": (2, dict(dp=2), "tiny", dict(zero=2, fp8="rowwise")),
    "zero3": (2, dict(dp=2), "tiny", dict(zero=3)),
    "zero3-fp8-gather": (2, dict(dp=2), "tiny", dict(zero=3, gather=True)),
    "zero3-fp8-gather-full-recompute": (2, dict(dp=2), "tiny", dict(zero=3, gather=True, recompute="full")),
    "zero1-selective-op": (2, dict(dp=2), "tiny", dict(zero=1, recompute="selective-op")),
    "zero3-fp8-gather-compile": (2, dict(dp=2), "tiny", dict(zero=3, gather=True, compile=True)),
    "tp2": (2, dict(tp=2), "tiny", dict(zero=0, sp=False)),
    "tp2-sp-rowwise": (2, dict(tp=2), "tiny", dict(zero=1, fp8="rowwise")),
    "pp2-1f1b": (2, dict(pp=2), "tiny", dict(zero=0)),
    "pp2-zb-h1-rowwise": (2, dict(pp=2), "tiny", dict(zero=1, schedule="zb-h1", fp8="rowwise")),
    "cp2": (2, dict(cp=2), "tiny", dict(zero=0)),
    "cp2-rowwise": (2, dict(cp=2), "tiny", dict(zero=1, fp8="rowwise")),
    "cp2-ulysses": (2, dict(cp=2, cp_ulysses=2), "tiny", dict(zero=1, cp_mode="ulysses")),
    "moe-ep2": (2, dict(dp=2, ep=2), "tiny-moe", dict(zero=1)),
    "dp2-tp2-zero3-fp8-gather": (4, dict(dp=2, tp=2), "tiny", dict(zero=3, gather=True)),
    "dp2-cp2-zero2": (4, dict(dp=2, cp=2), "tiny", dict(zero=2)),
    "hsdp-dp4-replicate2-zero3-fp8-gather": (4, dict(dp=4, dp_replicate=2), "tiny", dict(zero=3, gather=True)),
    "pp2-tp2-sp-rowwise": (4, dict(pp=2, tp=2), "tiny", dict(zero=1, fp8="rowwise")),
}
# rule 2's re-runs at the FP8 noise floor (`_rounding`), where deviations saturate as Muon's do (tests/test_muon.py):
# the bound is the largest of more samples. A wrong scope, a lost amax reduction or a wrong cast is caught operand
# by operand below, bit for bit; a lost gradient or micro-batch by the tight bound of the first step.
SHADOW_RUNS = 6
# the first forward checked operand by operand: the first block's GEMMs whose inputs no reordered sum has touched yet
# (tp: wq, wk, wv and wo, each head's attention computed whole on its rank; cp: wq, wk, wv, before ring attention)
OPERANDS = {"tp2": 4, "tp2-sp-rowwise": 4, "cp2": 3, "cp2-rowwise": 3}


def _model(preset: str):
    from fivefold.models import get_config

    return get_config(preset)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    tokens = torch.randint(0, 256, (ROWS, SEQ + 1), generator=g)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone()


class _PerRank:
    """The reference's matmul: the layout's FP8 matmul applied to each dp rank's rows of the global
    micro-batch on its own (each rank's activation scales), the results side by side."""

    def __init__(self, inner: float8.Float8Matmul, ranks: int) -> None:
        self.inner, self.ranks = inner, ranks

    def __call__(self, x, weight, bias=None):
        return torch.cat([self.inner(part, weight, bias) for part in x.chunk(self.ranks)])


def _reference_model(preset: str, recipe: str, dp: int):
    from fivefold.models.llama import Llama
    from fivefold.models.plans import is_float8_linear

    net = Llama(_model(preset), seed=Config().train.seed)
    for name, layer in net.named_modules():
        if is_float8_linear(name):
            layer.matmul = _PerRank(float8.Float8Matmul(float8.RECIPES[recipe]), dp)
    return net


def _reference(preset: str, recipe: str, dp: int) -> dict:
    """Single-process FP8 training as every layout trains (tests/dist_utils.trainer_reference's
    optimizer and micro-batches), each linear's FP8 matmul per dp rank's rows."""
    from fivefold.models.loss import lm_cross_entropy
    from fivefold.models.parallelize import set_aux_grad_scale

    t = Config().train
    net = _reference_model(preset, recipe, dp)
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in net.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=EPS)
    set_aux_grad_scale([net], 1.0 / MICRO)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        total = 0.0
        for i in range(MICRO):
            xi = torch.cat([xr.chunk(MICRO)[i] for xr in x.chunk(dp)])
            yi = torch.cat([yr.chunk(MICRO)[i] for yr in y.chunk(dp)])
            loss = lm_cross_entropy(net(xi), yi) / MICRO  # (the trainer's loss: the same gradient bits)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(total)
        if step == 0:
            first = {n: p.detach().clone() for n, p in net.named_parameters()}
    return dict(losses=losses, first=first, state={n: p.detach().clone() for n, p in net.named_parameters()})


def _rounding(name: str, kernels: str) -> dict:
    """How a layout's sums round: rule 1's ``dtype`` — rowwise's per-slice GEMMs write bf16 (torchao's), so a sum
    split over ranks rounds its parts in bf16 — whether a sum in another order feeds an FP8 cast in the first step
    (``split``: tp's and cp's partial sums in backward, a compiled block's fused kernels, or a reference computed on
    another kernel path), and the FP8 ``noise`` of a gradient entry: the unit roundoff of the gradients' format
    (tensorwise e5m2, 2⁻³; rowwise e4m3, 2⁻⁴)."""
    _, dims, _, o = LAYOUTS[name]
    rowwise = o.get("fp8", "tensorwise") == "rowwise"
    reordered = dims.get("tp", 1) > 1 or dims.get("cp", 1) > 1 or o.get("compile", False)
    return {
        "dtype": torch.bfloat16 if rowwise else torch.float32,
        "split": reordered or kernels != WORKERS,
        "noise": 2.0**-4 if rowwise else 2.0**-3,
    }


def _config(name: str) -> Config:
    _, dims, _, o = LAYOUTS[name]
    cfg = Config()
    cfg.zero.stage, cfg.zero.fp8_gather = o["zero"], o.get("gather", False)
    cfg.precision.fp8 = o.get("fp8", "tensorwise")
    cfg.train.recompute, cfg.train.compile = o.get("recompute", "none"), o.get("compile", False)
    cfg.train.grad_accum, cfg.train.seq_len, cfg.train.warmup_steps, cfg.train.eps = MICRO, SEQ, 0, EPS
    cfg.parallel.cp, cfg.parallel.ep = dims.get("cp", 1), dims.get("ep", 1)
    cfg.parallel.cp_mode = o.get("cp_mode", "ring")
    cfg.parallel.tp, cfg.parallel.pp = dims.get("tp", 1), dims.get("pp", 1)
    cfg.parallel.sp = o.get("sp", dims.get("tp", 1) > 1)
    cfg.parallel.dp_replicate = dims.get("dp_replicate", 1)
    cfg.pipeline.schedule = o.get("schedule", "1f1b")
    return cfg


class _Recorder:
    """Every FP8 GEMM's operands (data and scale) in call order, through `float8._mm`."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._mm = float8._mm

    def __enter__(self):
        def mm(a, b, out_dtype, fast_accum):
            if isinstance(a, float8.Float8):
                self.calls.append(tuple(t.detach().clone() for t in (a.data, a.scale, b.data, b.scale)))
            return self._mm(a, b, out_dtype, fast_accum)

        float8._mm = mm
        return self

    def __exit__(self, *exc):
        float8._mm = self._mm


def _first_block_operands(parts, x) -> list[tuple]:
    """The FP8 operands of the first block's forward on micro-batch `x` (no step follows)."""
    with _Recorder() as rec, torch.no_grad():
        parts.module(parts.local(x))
    return rec.calls[:7]  # wq, wk, wv, wo, w1, w3, w2: the first block's GEMMs come first


def _train(name: str) -> dict:
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    _, dims, preset, _ = LAYOUTS[name]
    cfg = _config(name)
    log = CommLog()
    mesh = ParallelMesh(ParallelDims(**dims), "cpu", log)
    parts = parallelize(cfg, _model(preset), mesh, "cpu")
    dp = mesh.comm("dp")
    out = {}
    if name in OPERANDS:
        x, _ = _batch(0)
        out["operands"] = _first_block_operands(parts, x.chunk(MICRO)[0])
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        x, y = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
        log.reset()
        loss = parts.forward_backward(list(zip(x.chunk(MICRO), y.chunk(MICRO))))
        parts.step(1.0)
        losses.append(parts.global_loss(loss).item())
        if step == 0:
            first = parts.full_state_dict()
    if cfg.zero.fp8_gather:  # the last step's unit gathers, and what the formula needs of each unit
        from fivefold.models.plans import is_float8_weight

        out["gathers"] = [r.payload_bytes for r in log.records if r.op == "all_gather" and r.tag.startswith("unit")]
        out["units"] = [[(s.numel, is_float8_weight(s.name)) for s in f.layout.slots]
                        for f in parts.engines[0].flats]
        out["unit_numels"] = [f.layout.padded_numel for f in parts.engines[0].flats]
    sliced_by = "tp" if dims.get("tp", 1) > 1 else "ep"
    return dict(out, losses=losses, first=first, state=parts.full_state_dict(), shard=mesh.rank(sliced_by),
                cp_rank=mesh.rank("cp"), cp=mesh.size("cp"), tp=mesh.size("tp"))


def _worker(world: int) -> dict:
    return {name: _train(name) for name, (w, *_) in LAYOUTS.items() if w == world}


@pytest.fixture(scope="module")
def results():
    """Every layout's result per rank: one spawn of world 2, one of world 4."""
    by_world = {w: run_workers(_worker, w, w) for w in sorted({w for w, *_ in LAYOUTS.values()})}
    return {name: [ranks[name] for ranks in by_world[w]] for name, (w, *_) in LAYOUTS.items()}


def _held(res: dict, got: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's share of a reference parameter: its tp or ep shard, or all of it."""
    if got.shape != full.shape:
        d = next(i for i, (a, b) in enumerate(zip(got.shape, full.shape)) if a != b)
        full = full.chunk(full.shape[d] // got.shape[d], dim=d)[res["shard"]]
    return full


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_trains_like_one_process_fp8_in_every_layout(results, name, kernels):
    """Two bounds (tests/tolerance.py). Before FP8 rounding can amplify anything — the first loss, and
    the parameters after the first step where no split sum feeds a cast (dp, ZeRO, pp, ep: each rank's
    micro-batches are the reference's, bit for bit; only the gradient sums over ranks reorder) — rule
    1 / rule 2 as for any layout. After it, the FP8 noise floor: a reordered sum feeding an FP8 cast
    may round a term the other way, and from then on two runs differ as much as any two FP8 runs
    whose gradients differ in their last bit; rule 2's re-runs then move every gradient entry by the
    gradients' FP8 unit roundoff of the step's largest one (`_rounding`)."""
    _, dims, preset, o = LAYOUTS[name]
    args = (_reference, preset, o.get("fp8", "tensorwise"), dims.get("dp", 1))
    rounding = _rounding(name, kernels)
    want, tight = reference(*args, kernels=kernels, terms=TERMS, dtype=rounding["dtype"])
    _, noisy = reference(*args, kernels=kernels, terms=TERMS, dtype=rounding["dtype"], shadow_runs=SHADOW_RUNS,
                         relative=rounding["noise"])
    for rank, res in enumerate(results[name]):
        tight["losses"][0].assert_holds(res["losses"][0], want["losses"][0], f"rank {rank} {name} loss 0")
        for step, got in enumerate(res["losses"]):
            noisy["losses"][step].assert_holds(got, want["losses"][step], f"rank {rank} {name} loss {step}")
        assert res["state"], f"rank {rank} {name}: no parameters"
        first = noisy["first"] if rounding["split"] else tight["first"]
        for pname, got in res["first"].items():
            first[pname].assert_holds(got, _held(res, got, want["first"][pname]), f"rank {rank} {name} {pname} step 0")
        for pname, got in res["state"].items():
            noisy["state"][pname].assert_holds(got, _held(res, got, want["state"][pname]), f"rank {rank} {name} {pname}")


def _reference_operands(preset: str, recipe: str) -> list[tuple]:
    x, _ = _batch(0)
    net = _reference_model(preset, recipe, 1)
    with _Recorder() as rec, torch.no_grad():
        net(x.chunk(MICRO)[0])
    return rec.calls[:7]


def _rows(name: str, res: dict) -> torch.Tensor | None:
    """The reference's token rows a cp rank's operands hold (None: all of them)."""
    from fivefold.context_parallel import SequenceLayout

    if res["cp"] == 1:
        return None
    rows = ROWS // MICRO
    positions = SequenceLayout(_config(name).parallel.cp_layout, res["cp"]).shard(
        torch.arange(SEQ).expand(rows, SEQ), res["cp_rank"])
    return (positions + torch.arange(rows).unsqueeze(1) * SEQ).flatten()


def _part(ref: torch.Tensor, got: torch.Tensor, rank: int, rows: torch.Tensor | None, token_dim: int | None):
    """What of `ref` a rank holding `got` should hold: its token rows (cp), its tp slice (the dim
    whose size differs), or all of it."""
    if rows is not None and token_dim is not None and ref.dim() > token_dim and ref.shape[token_dim] != 1:
        ref = ref.index_select(token_dim, rows)
    if got.shape != ref.shape:
        d = next(i for i, (a, b) in enumerate(zip(got.shape, ref.shape)) if a != b)
        ref = ref.chunk(ref.shape[d] // got.shape[d], dim=d)[rank]
    return ref


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(OPERANDS))
def test_every_fp8_operand_is_a_slice_of_the_single_process_cast(results, name):
    """The scope's claim, bit for bit: in the first forward every FP8 GEMM of the first block gets
    exactly the reference's FP8 data and scales, or this rank's slice of them (its tp columns or
    rows, its cp tokens) — so each scale was the max over the ranks that share the tensor."""
    _, _, preset, o = LAYOUTS[name]
    want = reference(_reference_operands, preset, o.get("fp8", "tensorwise"))
    for rank, res in enumerate(results[name]):
        rows = _rows(name, res)
        tp_rank = res["shard"] if res["tp"] > 1 else 0
        assert len(res["operands"]) == len(want) == 7
        for k, (got, ref) in enumerate(zip(res["operands"][: OPERANDS[name]], want)):
            a, sa, b, sb = got
            a_ref, sa_ref, b_ref, sb_ref = ref
            for what, g, r, token_dim in (("A", a, a_ref, 0), ("A's scale", sa, sa_ref, 0),
                                          ("B", b, b_ref, None), ("B's scale", sb, sb_ref, None)):
                part = _part(r, g, tp_rank, rows, token_dim)
                assert g.shape == part.shape, f"rank {rank} {name} GEMM {k} {what}: shape"
                assert torch.equal(g.view(torch.uint8) if g.dtype.itemsize == 1 else g,
                                   part.view(torch.uint8) if part.dtype.itemsize == 1 else part), \
                    f"rank {rank} {name} GEMM {k} {what} differs from the single-process cast"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n, (_, _, _, o) in LAYOUTS.items() if o.get("gather")])
def test_fp8_gather_bytes_equal_the_formula(results, name):
    """ZeRO-3's FP8 gather, exactly: every unit gathered in each micro-batch's forward and backward,
    each gather `formulas.float8_gather_bytes` of its parameters (an FP8 weight's e4m3 bytes and its
    scale, the rest in the compute dtype, 16-byte aligned); a unit without an FP8 weight gathers its
    padded elements in the compute dtype. fp32 parameters here: the FP8 weights travel at ¼ of their
    gather without it (bf16: ½, docs/benchmarks.md#fp8-and-muon)."""
    for res in results[name]:
        per_micro = []
        for params, padded in zip(res["units"], res["unit_numels"]):
            if any(fp8 for _, fp8 in params):
                per_micro.append(formulas.float8_gather_bytes(params, 4))
            else:
                per_micro.append(padded * 4)
        assert sum(res["gathers"]) == 2 * MICRO * sum(per_micro)
        assert sorted(res["gathers"]) == sorted(per_micro * 2 * MICRO)
        # the FP8 units travel at about a quarter of their fp32 gather (their norms stay fp32)
        fp8_units = [(b, padded) for b, padded, params in zip(per_micro, res["unit_numels"], res["units"])
                     if any(f for _, f in params)]
        assert fp8_units and all(b < 0.27 * padded * 4 for b, padded in fp8_units)
