"""`fivefold plan` knows FP8 and Muon (docs/design.md#fp8-training, docs/design.md#muon-under-zero) — in
process, planning only.

FP8 linears: their three GEMMs at the FP8 peak with 1-byte operands, their casts priced as elementwise bytes
(`plan.efficiency.float8_cast_bytes`), nothing else changed; refused on a GPU without FP8 tensor cores. ZeRO-3's FP8
gather: the all-gather bytes per step are `formulas.float8_gather_bytes` of every unit holding an FP8 weight (the
rest in the compute dtype), and the gathered units' memory too. Muon: the optimizer state per rank is the owners'
formula (momentum 4 bytes per owned matrix element, AdamW's 8 + 4 per tensor for the rest, the fp32 master), the
traffic carries no padding, and the Newton-Schulz time is its GEMMs' on the busiest rank."""

from __future__ import annotations

import pytest

from fivefold import formulas
from fivefold.config import load_config
from fivefold.models.plans import is_float8_weight
from fivefold.plan import HARDWARE, plan_layout
from fivefold.plan.assembly import engines_of, rank_parts, resolved
from fivefold.plan.efficiency import float8_cast_bytes, gemm_seconds
from fivefold.run_plan import validate_layout

H100 = HARDWARE["h100"]


def _cfg(*overrides: str):
    return load_config(None, ["--preset", "llama3-8b", "--precision.param", "bf16", "--train.micro_batch", "1",
                              "--train.grad_accum", "4", "--train.seq_len", "4096", *overrides])


def _dp_bytes(plan, op: str) -> int:
    return plan.traffic["dp"]["ops"].get(op, 0)


def test_fp8_linears_run_at_the_fp8_peak_and_pay_their_casts():
    bf16 = plan_layout(_cfg("--zero.stage", "1"), 8, H100)
    fp8 = plan_layout(_cfg("--zero.stage", "1", "--precision.fp8", "tensorwise"), 8, H100)
    rowwise = plan_layout(_cfg("--zero.stage", "1", "--precision.fp8", "rowwise"), 8, H100)
    matmuls = [p.time["compute: matmuls"] for p in (bf16, fp8, rowwise)]
    # the blocks' linears are most of the matmuls (the head stays bf16): between half and the whole
    assert 0.5 * matmuls[0] < matmuls[1] < 0.75 * matmuls[0]
    assert matmuls[2] == pytest.approx(matmuls[1])
    casts = fp8.time["compute: elementwise"] - bf16.time["compute: elementwise"]
    assert casts > 0 and rowwise.time["compute: elementwise"] > fp8.time["compute: elementwise"]
    assert fp8.time["step"] < bf16.time["step"]
    # one GEMM, exactly: an FP8 GEMM of a big square shape takes the bf16 one's time at the FP8 peak
    assert gemm_seconds(8192, 8192, 8192, H100, 2, fp8=True) == pytest.approx(
        gemm_seconds(8192, 8192, 8192, H100, 2) * H100.peak_tflops / H100.fp8_peak_tflops)
    assert float8_cast_bytes(10, 3, 4, 2, "tensorwise") == ((10 * 4 + 3 * 4) * 5, 10 * 3 * 5)


def test_fp8_is_refused_on_a_gpu_without_fp8_tensor_cores():
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        plan_layout(_cfg("--precision.fp8", "tensorwise"), 8, HARDWARE["a100"])


def test_the_fp8_gather_moves_the_formulas_bytes():
    plain = plan_layout(_cfg("--zero.stage", "3"), 8, H100)
    cfg = _cfg("--zero.stage", "3", "--precision.fp8", "tensorwise", "--zero.fp8_gather", "true")
    fp8 = plan_layout(cfg, 8, H100)
    run = validate_layout(cfg, 8, device_type="cuda")
    parts = rank_parts(resolved(cfg, run), run, 0)
    (_, engine), = engines_of(parts)
    per_gather = 0
    for flat in engine.flats:
        params = [(s.numel, is_float8_weight(s.name)) for s in flat.layout.slots]
        fp8_unit = any(f for _, f in params)
        per_gather += formulas.float8_gather_bytes(params, 2) if fp8_unit else flat.layout.padded_numel * 2
        assert flat.whole_params == fp8_unit  # an FP8 unit's weights are cast whole by their owners
    micro = run.grad_accum
    assert _dp_bytes(fp8, "all_gather") == 2 * micro * per_gather
    # about half of bf16's for the blocks; the root unit (embedding, head) still in bf16
    blocks = sum(f.layout.padded_numel for f in engine.flats if f.whole_params)
    assert _dp_bytes(fp8, "all_gather") < _dp_bytes(plain, "all_gather") - 2 * micro * blocks * 2 * 0.45
    # a block gathered in FP8 holds about half its bf16 bytes (llama3-8b's largest gathered units are the
    # embedding's and the head's, in bf16: the peak's "gathered units" line does not move)
    for flat in engine.flats:
        if flat.whole_params:
            assert flat.gathered_nbytes(2) < 0.51 * flat.layout.padded_numel * 2


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_state_traffic_and_time_per_rank(stage):
    adamw = plan_layout(_cfg("--zero.stage", str(stage)), 8, H100)
    cfg = _cfg("--zero.stage", str(stage), "--optim.name", "muon")
    muon = plan_layout(cfg, 8, H100)
    run = validate_layout(cfg, 8, device_type="cuda")
    parts = rank_parts(resolved(cfg, run), run, 0)
    (_, engine), = engines_of(parts)
    want = 0
    for flat in engine.flats:
        parts_ = []
        for gid, a, b in flat.segments:
            inner = engine.optimizer.choice.optimizers[engine.optimizer.group_optimizers[gid]]
            per_element, per_tensor = inner.state_bytes
            parts_.append((b - a, per_element, 1, per_tensor))
        want += flat.shard_numel * 4 + formulas.optimizer_state_bytes(parts_)  # master + state
    assert muon.ranks[0].model_states["optimizer"] == want
    assert muon.ranks[0].model_states["optimizer"] < adamw.ranks[0].model_states["optimizer"]
    # whole-parameter flats carry no padding: the gradient reduction moves Ψ exactly
    assert _dp_bytes(muon, "reduce_scatter") <= _dp_bytes(adamw, "reduce_scatter")
    # Newton-Schulz on the owned matrices: the optimizer's time grows by their GEMMs
    assert muon.time["optimizer"] > adamw.time["optimizer"]
    assert formulas.muon_step_flops(4096, 14336) == 5 * (4 * 4096**2 * 14336 + 2 * 4096**3)
