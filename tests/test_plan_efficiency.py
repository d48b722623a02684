"""`fivefold plan`'s efficiency model (docs/design.md#step-time-model), its FLOP convention and the memory a GPU
spends besides tensors — in process, planning only.

The GEMM table reproduces its points and interpolates between them; wave quantization and the memory roofline
act where they should; the presets' efficiencies are their sources' ratios; a stage's matmul FLOPs are exactly 6 ×
its tokens × its local 2-D weights; causal attention is counted once, the same way, in MFU and in the time (with
every kernel at one efficiency and nothing else costing, MFU equals that efficiency, at 8K and at 256K tokens);
the runtime lines are the preset's constants, overridable, none on the CPU."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fivefold import formulas
from fivefold.cli import main as cli
from fivefold.config import load_config
from fivefold.plan import HARDWARE, plan_layout
from fivefold.plan.assembly import local_shapes, rank_parts, resolved, stages_of
from fivefold.plan.efficiency import gemm_efficiency, gemm_seconds, operator_counts, stage_work
from fivefold.plan.hardware import GB, Hardware
from fivefold.plan.memory import communicators
from fivefold.run_plan import validate_layout

TABLE = ((16, 0.1), (64, 0.4), (256, 0.8))
FLAT = Hardware(name="flat", gemm_efficiency=TABLE, sms=0, hbm_gbps=1e12)


def test_the_gemm_table_is_reproduced_and_interpolated_in_log_size():
    for size, e in TABLE:
        assert gemm_efficiency(size, 4 * size, 8 * size, FLAT) == pytest.approx(e, abs=1e-12)  # the smallest dim
    assert gemm_efficiency(32, 4096, 4096, FLAT) == pytest.approx(0.25)  # halfway in log2 between 16 and 64
    assert gemm_efficiency(2, 4096, 4096, FLAT) == 0.1 and gemm_efficiency(8192, 8192, 8192, FLAT) == 0.8


def test_wave_quantization_and_the_memory_roofline():
    hw = dataclasses.replace(HARDWARE["h100"], gemm_efficiency=((1, 0.8),))
    tile_m, tile_n = hw.gemm_tile
    full = gemm_efficiency(tile_m * 12, tile_n * 11, 4096, hw)  # 132 tiles: one full wave
    assert full == pytest.approx(0.8)
    # 133 × 1 tiles of 128 × 256: a second wave with one tile; laid the other way 67 × 2 = 134 tiles, the better
    one_more = gemm_efficiency(tile_m * 133, tile_n, 4096, hw)
    assert one_more == pytest.approx(0.8 * max(133, 134) / 264)
    narrow = gemm_efficiency(8192, 128, 4096, hw)  # 64 × 1 tiles of 128 × 256, or 32 × 1 of 256 × 128
    assert narrow == pytest.approx(0.8 * 64 / 132)
    with pytest.raises(ValueError, match="gemm_tile"):
        dataclasses.replace(hw, gemm_tile=(0, 128)).check()
    # a skinny GEMM (one token row) streams its weight: memory-bound
    m, n, k = 1, 4096, 4096
    memory = (m * k + k * n + m * n) * 2 / (hw.hbm_gbps * GB * hw.memory_efficiency)
    assert gemm_seconds(m, n, k, hw, 2) == pytest.approx(memory)
    assert memory > 2 * m * n * k / (hw.peak_tflops * 1e12 * gemm_efficiency(m, n, k, hw))


def test_presets_are_their_sources_ratios():
    """MAMF over the peak (ml-engineering): H100 SXM 794.5 / 989, A100 SXM 271.2 / 312; FlashAttention-2's
    efficiencies in the plan's convention (backward 2 × forward, the papers' 2.5 ×): 35 % both ways on an H100
    (FlashAttention-3's figure), 73 % / 63 % on an A100; A100 STREAM triad 1794 / 2039 GB/s."""
    assert HARDWARE["h100"].compute_efficiency == pytest.approx(794.5 / 989, abs=5e-4)
    assert HARDWARE["h200"].compute_efficiency == HARDWARE["h100"].compute_efficiency
    assert HARDWARE["a100"].compute_efficiency == pytest.approx(271.2 / 312, abs=5e-4)
    def converted(forward: float, backward: float) -> float:
        return 3 / (1 / forward + 2.5 / backward)

    assert HARDWARE["h100"].attention_efficiency == pytest.approx(converted(0.35, 0.35), abs=5e-3)
    assert HARDWARE["a100"].attention_efficiency == pytest.approx(converted(0.73, 0.63), abs=5e-3)
    assert HARDWARE["a100"].memory_efficiency == pytest.approx(1794 / 2039, abs=5e-3)
    assert (HARDWARE["h100"].sms, HARDWARE["a100"].sms) == (132, 108)
    for hw in HARDWARE.values():
        hw.check()


def _cfg(*overrides: str, world: int = 1):
    return load_config(None, ["--preset", "llama3-8b", "--precision.param", "bf16", "--train.micro_batch", "1",
                              "--train.seq_len", "8192", *overrides, "--run.nproc", str(world)])


def test_a_stage_runs_six_flops_per_weight_and_token_plus_causal_attention():
    cfg = _cfg("--parallel.tp", "2", "--parallel.sp", "true", world=2)
    run = validate_layout(cfg, 2)
    parts = rank_parts(resolved(cfg, run), run)
    stage = stages_of(parts)[0]
    shapes = local_shapes(parts)[0]
    work = stage_work(resolved(cfg, run), run, stage, shapes, HARDWARE["h100"])
    tokens = 8192
    weights = sum(math.prod(s) for n, s in shapes.items() if len(s) == 2 and not n.startswith("tok_embeddings"))
    attention = formulas.attention_flops_per_token(32, 8192, 4096) // 2 * tokens  # over tp 2
    assert work.flops == 6 * weights * tokens + attention
    assert set(work.parts) == {"matmuls", "attention", "elementwise"}


@pytest.mark.parametrize("seq", [8192, 262144])
def test_mfu_is_the_efficiency_when_only_kernels_cost(seq):
    """Causal attention counted once: every kernel at 50 % of the peak and nothing else costing (no traffic at
    world 1, no elementwise or optimizer time on an infinitely fast memory, no host time), the plan's MFU is 50 %
    — at 256K tokens too, where counting the whole square for MFU and the half for the time gave 81.9 % at 60 %."""
    hw = dataclasses.replace(HARDWARE["h100"], gemm_efficiency=((1, 0.5),), sms=0, attention_efficiency=0.5,
                             hbm_gbps=1e15, op_overhead_us=0.0, memory_gb=1e6)
    cfg = _cfg("--train.seq_len", str(seq))
    plan = plan_layout(cfg, 1, hw)
    # the norms' weights are in N (6 per weight and token) but are no matmul: 3.5e-5 of 8B
    assert plan.time["MFU"] == pytest.approx(0.5, rel=4e-5)


def test_the_runtime_lines_are_the_presets_constants():
    hw = HARDWARE["h100"]
    cfg = _cfg("--parallel.tp", "2", "--parallel.sp", "true", "--zero.stage", "3", world=8)
    plan = plan_layout(cfg, 8, hw)
    rank = plan.ranks[0]
    groups = communicators(validate_layout(cfg, 8), cfg)
    assert groups == ["tp", "dp", "world"]
    assert rank.runtime == {
        "CUDA context": int(hw.context_gb * 1e9),
        f"communicator buffers ×{len(groups)}": int(len(groups) * hw.comm_buffer_mb * 1e6),
        "allocator reserve 5%": int(rank.tensors * hw.allocator_reserve),
    }
    assert rank.total == rank.tensors + sum(rank.runtime.values())
    none = dataclasses.replace(hw, context_gb=0, comm_buffer_mb=0, allocator_reserve=0)
    bare = plan_layout(cfg, 8, none).ranks[0]
    assert bare.runtime == {} and bare.total == rank.tensors


def test_the_cli_overrides_the_runtime_constants(capsys):
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "8", "--zero", "3", "--context-gb", "2",
                "--comm-buffer-mb", "0", "--allocator-reserve", "0.1", "--json"]) == 0
    import json

    rank = json.loads(capsys.readouterr().out)["ranks"][0]
    assert rank["runtime"]["CUDA context"] == 2e9
    assert not any(k.startswith("communicator") for k in rank["runtime"])
    assert rank["runtime"]["allocator reserve 10%"] == int(0.1 * (rank["total"] - 2e9) / 1.1)


def test_operator_counts_see_recompute():
    none, full = operator_counts(None, "sdpa", "none"), operator_counts(None, "sdpa", "full")
    assert none["block"][0] > 10 and none["ends"][0] > 0
    assert full["block"][1] >= none["block"][1] + none["block"][0] - 5  # the forward again, in the backward
    every = operator_counts(None, "sdpa", "selective-op", "matmuls-every-other")
    assert none["block"][1] < every["block"][1] < full["block"][1]  # fewer operators run again
    few, many = operator_counts((8, 2, 0), "sdpa", "none"), operator_counts((64, 2, 0), "sdpa", "none")
    assert many["block"][0] > few["block"][0]  # an expert's operators run for each expert that gets rows


@pytest.mark.parametrize("save", ["matmuls-every-other", "all-but-attention", "softmax"])
def test_selective_op_recomputes_what_its_formula_says(save):
    """The time model's recomputed matmul FLOPs under selective-op are `formulas.selective_op_recompute_flops`'s
    linears, block by block (the attention core's time follows the same save set)."""
    from fivefold.models.recompute_policy import save_plan

    common = ("--parallel.tp", "2", "--parallel.sp", "true")
    base = _cfg(*common, world=2)
    op = _cfg(*common, "--train.recompute", "selective-op", "--train.recompute_save", save, world=2)
    works = []
    for cfg in (base, op):
        run = validate_layout(cfg, 2)
        parts = rank_parts(resolved(cfg, run), run)
        works.append(stage_work(resolved(cfg, run), run, stages_of(parts)[0], local_shapes(parts)[0],
                                HARDWARE["h100"]))
    run = validate_layout(op, 2)
    tokens = 8192
    attention_fwd = formulas.attention_flops_per_token(1, 8192, 4096) / 2 / 3 * tokens  # one block, over tp 2
    per_block = formulas.selective_op_recompute_flops(run.model, tokens, save_plan(save), tp=2,
                                                      core_flops=attention_fwd)
    assert works[1].flops - works[0].flops == pytest.approx(32 * per_block, rel=1e-12)


def test_torchtitans_op_sac_run_fits_where_it_ran():
    """torchtitan's Llama 3 8B on 8 H100s (96 GB), FSDP, local batch 2 × 8192, op-level SAC (bench/published_runs.py:
    82.4 GiB published): selective-op fits as it really ran; the attention-core-only selective does not."""
    from bench.published import _plan
    from bench.published_runs import RUNS

    run = next(r for r in RUNS if r.name == "torchtitan-8b-8xh100-fsdp-sac-op")
    plan = _plan(run)
    assert plan.fits and plan.peak_bytes / 2**30 < run.memory_gib
    coarse = dataclasses.replace(run, plan_args=tuple(a.replace("selective-op", "selective") for a in run.plan_args))
    assert not _plan(coarse).fits


@pytest.mark.parametrize("overrides, world, want", [
    (["--parallel.dp_replicate", "2", "--zero.stage", "3"], 8, ["dp_shard", "dp_replicate", "world"]),
    (["--parallel.cp", "2", "--zero.stage", "2"], 8, ["cp", "dp_cp", "world"]),
    (["--preset", "tiny-moe", "--parallel.ep", "2"], 8, ["ep", "dp", "ep_dp", "world"]),
    (["--zero.stage", "3", "--zero.hpz", "2"], 8, ["dp", "dp_hpz", "world"]),
    (["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.sp", "true", "--train.grad_accum", "2"], 4,
     ["tp", "pp", "world"]),
])
def test_communicators_of_each_layout(overrides, world, want):
    cfg = load_config(None, [*overrides, "--run.nproc", str(world)])
    assert communicators(validate_layout(cfg, world), cfg) == want


def test_each_weight_is_three_gemms_of_its_own_shapes():
    """Forward (tokens × in) · (in × out), the input gradient (tokens × out) · (out × in), the weight gradient
    (out × tokens) · (tokens × in): the time of the matmuls is these GEMMs' on the H100 (whose wave quantization
    tells m × n from n × m), weight by weight."""
    cfg = _cfg("--parallel.tp", "2", "--parallel.sp", "true", world=2)
    run = validate_layout(cfg, 2)
    parts = rank_parts(resolved(cfg, run), run)
    shapes = local_shapes(parts)[0]
    hw = HARDWARE["h100"]
    work = stage_work(resolved(cfg, run), run, stages_of(parts)[0], shapes, hw)
    t = 8192
    want = sum(gemm_seconds(t, out, inp, hw, 2) + gemm_seconds(t, inp, out, hw, 2) + gemm_seconds(out, inp, t, hw, 2)
               for name, (out, inp) in ((n, s) for n, s in shapes.items() if len(s) == 2)
               if not name.startswith("tok_embeddings"))
    assert work.parts["matmuls"] == pytest.approx(want, rel=1e-12)
    wk = shapes["layers.0.attention.wk.weight"]
    assert gemm_seconds(t, *wk, hw, 2) != gemm_seconds(wk[1], wk[0], t, hw, 2)  # the shapes matter
