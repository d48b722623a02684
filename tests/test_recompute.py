"""Activation recompute (`train.recompute`): training unchanged, activations as predicted.

In process: each block's activation bytes (`memory.block_activation_bytes`) equal
`formulas.activation_bytes_per_block` (docs/design.md#activation-memory) byte for byte for none /
full / selective / selective-op (each `train.recompute_save` choice), both attention cores, fp32
and bf16, and gradients bit-equal to no recompute; the plan prices selective-op with the same
formula; a bad save set is one line. One spawn of 4 ranks (`multiprocess`): ZeRO-3 × tp 2 + SP,
pp 2 zero-bubble × ZeRO-3, cp 2 and MoE ep 2 under full, selective and selective-op, and plain DDP
under selective-op, equal none bit for bit (none is held to single-process training in each
dimension's own tests); tp traffic and per-rank activations under tp 2 (± SP) follow the formulas
exactly.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_workers

from fivefold.config import Config, ConfigError
from fivefold.distributed.comm import CommLog
from fivefold.formulas import (
    MicroBatch,
    activation_bytes_per_block,
    korthikanti_block_bytes,
    tp_comm_formula,
)
from fivefold.models.llama import RECOMPUTE_MODES, Llama, LlamaConfig, get_config
from fivefold.models.recompute_policy import OP_GROUPS, SAVE_CHOICES, save_plan
from fivefold.observe.memory import block_activation_bytes
from fivefold.run_plan import validate_layout

B, L, D, H, H_KV, F = 2, 64, 64, 4, 2, 96
SHAPE = LlamaConfig(dim=D, n_layers=3, n_heads=H, n_kv_heads=H_KV, ffn_hidden=F, max_seq_len=L)
DTYPES = {"fp32": (torch.float32, 4), "bf16": (torch.bfloat16, 2)}
# (mode, train.recompute_save): every mode, selective-op with each preset and two custom lists
SETTINGS = [(m, "matmuls-every-other") for m in RECOMPUTE_MODES] + [
    ("selective-op", save) for save in ["all-but-attention", "mm,sdpa", "bmm,softmax"]
]
SETTING_IDS = [m if m != "selective-op" else f"{m}:{save}" for m, save in SETTINGS]
PRESETS = len(RECOMPUTE_MODES) + 1  # the settings without the custom lists (fp32 runs those)


def _tokens(seed: int, batch: int = B, seq: int = L, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _formula(mb: MicroBatch, core: str, mode: str, save: str, **shape) -> int:
    heads, kv_heads, ffn = shape.get("heads", H), shape.get("kv_heads", H_KV), shape.get("ffn", F)
    plan = save_plan(save) if mode == "selective-op" else None
    return activation_bytes_per_block(
        mb, heads, kv_heads, ffn, attention=core, recompute=mode, save=plan
    )


@pytest.mark.parametrize("core", ["sdpa", "eager"])
@pytest.mark.parametrize(("mode", "save"), SETTINGS, ids=SETTING_IDS)
def test_block_activations_match_the_formula(mode, save, core):
    """Inside each block's forward (fp32: a block's output is what the next block keeps of its
    input), byte for byte."""
    model = Llama(SHAPE).set_attention(core).set_recompute(mode, save)
    x = _tokens(0)
    measured = block_activation_bytes(model.layers, lambda: model(x))
    want = _formula(MicroBatch(B, L, D), core, mode, save)
    for i, got in enumerate(measured):
        assert got == want, f"block {i}: measured {got} bytes, formula {want}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("core", ["sdpa", "eager"])
@pytest.mark.parametrize(("mode", "save"), SETTINGS[:PRESETS], ids=SETTING_IDS[:PRESETS])
def test_one_more_block_costs_the_formula(mode, save, core, dtype):
    """The whole forward of n + 1 blocks minus that of n: what one more block keeps in steady
    state, whatever it frees after it returns (in bf16 a block's output is freed once the next
    block saved its fp32 copy), byte for byte."""
    torch_dtype, nbytes = DTYPES[dtype]
    x = _tokens(0)
    totals = []
    for n in (2, 3):
        model = Llama(LlamaConfig(**{**SHAPE.__dict__, "n_layers": n}), dtype=torch_dtype)
        model.set_attention(core).set_recompute(mode, save)
        totals.append(block_activation_bytes([model], lambda m=model: m(x))[0])
    assert totals[1] - totals[0] == _formula(MicroBatch(B, L, D, dtype_bytes=nbytes), core, mode, save)


def test_selective_op_saves_what_its_choice_names():
    """Every other matmul (wq, wv, w1, w2) and the sdpa core's output and log-sum-exp, or every
    matmul; the formula's terms against the shapes, so a term dropped in both places shows."""
    s, bl, d = 4, B * L, D // H
    linears = {"wq": H * d, "wk": H_KV * d, "wv": H_KV * d, "wo": D, "w1": F, "w3": F, "w2": D}
    out = bl * D * s
    every_other = sum(bl * linears[n] * s for n in ("wq", "wv", "w1", "w2"))
    sdpa = bl * H * d * s + B * H * L * 4
    assert _formula(MicroBatch(B, L, D), "sdpa", "selective-op", "matmuls-every-other") == (
        every_other + sdpa + out
    )
    assert _formula(MicroBatch(B, L, D), "eager", "selective-op", "matmuls-every-other") == (
        every_other + out
    )
    all_mm = sum(bl * n * s for n in linears.values())
    assert _formula(MicroBatch(B, L, D), "sdpa", "selective-op", "all-but-attention") == all_mm + out
    assert set(SAVE_CHOICES["all-but-attention"].always) <= set(OP_GROUPS)


@pytest.mark.parametrize(
    "bad", ["everything", "mm,flash", "", "matmuls_every_other"], ids=["name", "op", "empty", "typo"]
)
def test_a_bad_save_set_is_one_line(bad):
    cfg = Config()
    cfg.train.recompute, cfg.train.recompute_save = "selective-op", bad
    with pytest.raises(ConfigError) as e:
        validate_layout(cfg, 1)
    message = str(e.value)
    assert "\n" not in message and message.startswith("train.recompute_save=")
    assert "matmuls-every-other or all-but-attention" in message and "mm, sdpa" in message
    cfg.train.recompute = "full"  # only selective-op reads it
    validate_layout(cfg, 1)


def test_plan_prices_selective_op_with_the_formula():
    """`fivefold plan`'s block bytes (`plan_layout(...).block_bytes`, and `kind_bytes`, what the
    rank's activations sum) for selective-op are the formula's, with the config's save set, at
    tp 1 and tp 2 + SP; the recomputed block's part is what the block drops."""
    from fivefold.plan.layout import plan_layout
    from fivefold.plan.memory import RECOMPUTED, activation_bytes, kind_bytes

    for save, tp in (("matmuls-every-other", 1), ("all-but-attention", 1), ("mm", 2)):
        cfg = Config()
        cfg.model.preset, cfg.train.seq_len, cfg.parallel.tp = "tiny", 32, tp
        cfg.parallel.sp = tp > 1
        cfg.train.recompute, cfg.train.recompute_save = "selective-op", save
        plan = plan_layout(cfg, tp)
        m, mb = plan.model, MicroBatch(plan.micro_batch, 32, plan.model.dim, tp=tp, sp=tp > 1)
        want = activation_bytes_per_block(
            mb, m.n_heads, m.n_kv_heads, m.ffn_hidden, recompute="selective-op", save=save_plan(save)
        )
        assert plan.block_bytes == want, save
        run = validate_layout(cfg, tp)
        assert kind_bytes(cfg, run, False, "selective-op") == want
        parts = activation_bytes(cfg, run, [0], 1, [(False, m.n_layers)], 1, 0)
        assert parts["blocks"] == m.n_layers * want
        assert parts[RECOMPUTED] == kind_bytes(cfg, run, False, "none") - want


def test_plan_recompute_flops_of_selective_op():
    """The linears not saved run again, but the last (w2: torch's checkpoint stops before it): every
    other matmul leaves wk, wo and w3, all-but-attention only the core."""
    from fivefold.formulas import selective_op_recompute_flops

    tokens, d = 10, D // H
    every = selective_op_recompute_flops(SHAPE, tokens, save_plan("matmuls-every-other"), core_flops=7.0)
    assert every == 2 * tokens * (D * H_KV * d + H * d * D + D * F)  # the core's outputs are saved
    assert selective_op_recompute_flops(SHAPE, tokens, save_plan("all-but-attention"), core_flops=7.0) == 7.0
    eager = selective_op_recompute_flops(SHAPE, tokens, save_plan("mm,bmm"), attention="eager", core_flops=7.0)
    assert eager == 0.0  # every linear and the eager core's matmuls kept
    assert selective_op_recompute_flops(SHAPE, tokens, save_plan("softmax"), tp=2) == (
        2 * tokens * (2 * D * H * d + 2 * D * H_KV * d + 2 * D * F) / 2  # every linear but w2
    )


def test_selective_op_issues_a_regions_collectives_once():
    """`ops.collective_outputs` inside `recompute(selective=)`: the forward issues the collective
    (a stand-in writing its buffer), the recomputation gets the buffer back without issuing it;
    full recompute issues it again. Gradients equal no recompute's either way."""
    import functools

    from fivefold.models.recompute_policy import selective_contexts
    from fivefold.ops import collective_outputs, recompute

    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    issued = []

    def region(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        buf = torch.empty_like(h)

        def issue() -> None:  # a collective: writes its output buffer in place
            issued.append(1)
            with torch.no_grad():
                buf.copy_(h * 2 + 1)

        collective_outputs([buf], issue)
        return (h.sin() * buf).sum()

    grads = {}
    for name, selective in (
        ("none", None),
        ("full", None),
        ("selective-op", functools.partial(selective_contexts, save_plan("matmuls-every-other"))),
    ):
        issued.clear()
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = region(x) if name == "none" else recompute(region, x, selective=selective)
        loss.backward()
        grads[name] = (x.grad, len(issued))
    assert grads["none"][1] == 1 and grads["full"][1] == 2 and grads["selective-op"][1] == 1
    for name in ("full", "selective-op"):
        assert torch.equal(grads[name][0], grads["none"][0]), name


@pytest.mark.parametrize("core", ["sdpa", "eager"])
def test_recompute_gradients_bit_equal_to_none(core):
    grads = {}
    x, y = _tokens(1), _tokens(2)
    for mode, save in SETTINGS:
        model = Llama(SHAPE, seed=0).set_attention(core).set_recompute(mode, save)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grads[(mode, save)] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    reference = grads.pop(("none", "matmuls-every-other"))
    for setting, (loss, got) in grads.items():
        assert torch.equal(loss, reference[0])
        for name, g in got.items():
            assert torch.equal(g, reference[1][name]), f"{setting}: {name}"


def test_recompute_drops_activations_as_seed_003_says():
    """Full keeps 1 of the ~15 B·L·D a block holds; selective drops the core's L×L term — the 5·B·L²·H of the seed's
    GPT formula, one fp32 L×L matrix here (no dropout) — and gains most where that term dominates (L ≫ D)."""
    def kept(mode: str, core: str, seq: int = L) -> int:
        return activation_bytes_per_block(MicroBatch(B, seq, D), H, H_KV, F, attention=core, recompute=mode)
    bld = B * L * D * 4
    assert kept("full", "eager") == bld
    # 10 B·L·D of tensors + 4 B·L·F; GQA's k and v with H_kv = H/2 heads keep one B·L·D less
    assert kept("none", "sdpa") == pytest.approx(15.1 * bld, rel=0.01)
    assert kept("none", "eager") - kept("selective", "eager") > kept("none", "sdpa") - kept("selective", "sdpa")
    long = 8 * D  # L ≫ D: the quadratic term dominates and selective recompute removes most of the block's memory
    assert kept("selective", "eager", long) < 0.5 * kept("none", "eager", long)
    assert korthikanti_block_bytes(B, L, D, H) == 34 * B * L * D + 5 * B * L * L * H


# -- layouts whose collectives run again in a recomputation -------------------------------------------------------
SEQ, GLOBAL, M, STEPS = 16, 8, 2, 2
LAYOUTS = {
    "zero3-dp2-tp2-sp": dict(dims=dict(dp=2, tp=2), zero=3, sp=True),
    "zb-h1-pp2-dp2-zero3": dict(dims=dict(pp=2, dp=2), zero=3, schedule="zb-h1"),
    "cp2-dp2-zero2": dict(dims=dict(dp=2, cp=2), zero=2),
    "moe-dp4-ep2": dict(dims=dict(dp=4, ep=2), zero=1, moe=True),
    # DDP × tp 2 without SP, every matmul saved: the exits' all-reduces write into saved matmul
    # outputs in place (replayed, not run again); selective-op only (the others run above)
    "ddp-dp2-tp2": dict(dims=dict(dp=2, tp=2), zero=0, modes=("none", "selective-op"), save="all-but-attention"),
}


def _model_config(moe: bool) -> LlamaConfig:
    shape = dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    return get_config("tiny-moe", ffn_hidden=64, **shape) if moe else get_config("tiny", ffn_hidden=96, **shape)


def _layout_worker() -> dict:
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    out = {}
    for name, layout in LAYOUTS.items():
        for mode in layout.get("modes", RECOMPUTE_MODES):
            cfg = Config()
            for k, v in layout["dims"].items():
                setattr(cfg.parallel, k, v)
            cfg.parallel.sp = layout.get("sp", False)
            cfg.zero.stage = layout["zero"]
            cfg.pipeline.schedule = layout.get("schedule", "1f1b")
            cfg.train.recompute, cfg.train.grad_accum, cfg.train.seq_len = mode, M, SEQ
            cfg.train.recompute_save = layout.get("save", cfg.train.recompute_save)
            cfg.train.lr, cfg.train.eps = 1e-2, 1e-4
            log = CommLog()
            mesh = ParallelMesh(ParallelDims(**layout["dims"]), "cpu", log)
            parts = parallelize(cfg, _model_config(layout.get("moe", False)), mesh, "cpu")
            dp = mesh.comm("dp")
            losses, history, tp_bytes = [], [], None
            for step in range(STEPS):
                x, y = (t.chunk(dp.size)[dp.rank] for t in (_tokens(10 + step, GLOBAL, SEQ),
                                                           _tokens(20 + step, GLOBAL, SEQ)))
                log.reset()
                loss = parts.forward_backward(list(zip(x.chunk(M), y.chunk(M))))
                if step == 0:
                    tp_bytes = {op: t.payload_bytes for (op, dim), t in log.summary().items() if dim == "tp"}
                parts.step(1.0)
                losses.append(parts.global_loss(loss).item())
                history.append(parts.full_state_dict())
            out[(name, mode)] = dict(losses=losses, history=history, tp_bytes=tp_bytes, micro=x.shape[0] // M)
    for sp in (True, False):  # a rank's activations under tp 2 (+ SP), in a forward after a warm-up one; traffic
        for mode in RECOMPUTE_MODES:
            cfg = Config()
            cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.sp = 2, 2, sp
            cfg.train.recompute, cfg.train.seq_len = mode, SEQ
            log = CommLog()
            mesh = ParallelMesh(ParallelDims(dp=2, tp=2), "cpu", log)
            parts = parallelize(cfg, _model_config(False), mesh, "cpu")
            x, y = (_tokens(seed, GLOBAL // 2, SEQ) for seed in (30, 31))
            parts.module(parts.local(x))
            block_bytes = block_activation_bytes(parts.module.layers, lambda p=parts, x=x: p.module(p.local(x)))
            log.reset()
            parts.forward_backward([(x, y)])
            tp_bytes = {op: t.payload_bytes for (op, dim), t in log.summary().items() if dim == "tp"}
            out[("tp2" + "-sp" * sp, mode)] = dict(micro=x.shape[0], block_bytes=block_bytes, tp_bytes=tp_bytes)
    return out


@pytest.fixture(scope="module")
def layout_results():
    return run_workers(_layout_worker, 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("layout", "mode"),
    [(n, m) for n, lay in LAYOUTS.items() for m in lay.get("modes", RECOMPUTE_MODES) if m != "none"],
)
def test_recompute_trains_exactly_like_none(layout_results, layout, mode):
    """Losses and every parameter after each step equal no recompute's bit for bit (selective-op:
    matmuls-every-other, the default save set)."""
    for rank, res in enumerate(layout_results):
        got, want = res[(layout, mode)], res[(layout, "none")]
        assert got["losses"] == want["losses"], f"rank {rank}"
        for step, (g, w) in enumerate(zip(got["history"], want["history"])):
            assert g.keys() == w.keys()
            for pname in g:
                assert torch.equal(g[pname], w[pname]), f"rank {rank} step {step} {pname}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
@pytest.mark.parametrize("run_name", ["zero3-dp2-tp2-sp", "tp2-sp", "tp2"])
def test_tp_traffic_with_recompute_matches_the_formula(layout_results, run_name, mode):
    """Full recompute runs a block's attention exit (and under SP both entries) once more in backward; selective adds
    nothing, nor does selective-op (its collectives are issued once, in the forward, and replayed)."""
    config = _model_config(False)
    for rank, res in enumerate(layout_results):
        run = res[(run_name, mode)]
        backwards = M if run_name.startswith("zero3") else 1
        per_backward = tp_comm_formula(config, run["micro"], SEQ, run_name.endswith("sp"), recompute=mode)
        want = {op: backwards * nbytes for op, nbytes in per_backward.items()}
        assert run["tp_bytes"] == want, f"rank {rank}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
@pytest.mark.parametrize("run_name", ["tp2-sp", "tp2"])
def test_tp_rank_activations_match_the_formula(layout_results, run_name, mode):
    c = _model_config(False)
    for rank, res in enumerate(layout_results):
        run = res[(run_name, mode)]
        mb = MicroBatch(run["micro"], SEQ, c.dim, tp=2, sp=run_name.endswith("sp"))
        save = save_plan(Config().train.recompute_save) if mode == "selective-op" else None
        want = activation_bytes_per_block(mb, c.n_heads, c.n_kv_heads, c.ffn_hidden, recompute=mode, save=save)
        for i, got in enumerate(run["block_bytes"]):
            assert got == want, f"rank {rank} block {i}: measured {got}, formula {want}"


def _backward_matmul_flops(mode: str, save: str = "matmuls-every-other") -> int:
    """2·m·n·k summed over every mm / addmm / bmm the backward dispatches (a recomputation's included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    flops = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("mm", "addmm", "bmm"):
                a, b = args[-2], args[-1]
                batch = a.shape[0] if a.dim() == 3 else 1
                flops[0] += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
            return out

    model = Llama(SHAPE, seed=0).set_attention("sdpa")
    model.set_recompute(mode) if mode != "selective-op" else model.set_recompute(mode, save)
    loss = torch.nn.functional.cross_entropy(model(_tokens(1)).flatten(0, 1), _tokens(2).flatten())
    with Count():
        loss.backward()
    return flops[0]


@pytest.mark.parametrize("mode, save", [("full", ""), ("selective-op", "matmuls-every-other"),
                                        ("selective-op", "softmax"), ("selective-op", "all-but-attention")])
def test_the_recomputed_matmuls_are_what_the_formula_charges(mode, save):
    """Counted in the backward: a recomputation runs every block linear its save set does not keep but the last,
    w2 (torch's checkpoint stops once backward has what it saved) — what `selective_op_recompute_flops` and the
    plan's time charge (`SavePlan()`: full recompute's). sdpa's core is no matmul here."""
    from fivefold.formulas import SavePlan, selective_op_recompute_flops

    extra = _backward_matmul_flops(mode, save) - _backward_matmul_flops("none")
    plan = save_plan(save) if mode == "selective-op" else SavePlan()
    assert extra == SHAPE.n_layers * selective_op_recompute_flops(SHAPE, B * L, plan)
