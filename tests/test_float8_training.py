"""FP8 against the high precision it replaces (docs/design.md#fp8-training), in-process: a transformer
block's output and gradients within a bound derived from the FP8 formats' mantissas, and 30 training
steps whose losses stay within FP8's precision of bf16's.

**The block's bound.** A cast to FP8 rounds each element to the nearest representable value: a
relative error δ with |δ| ≤ u (u = 2⁻⁴ for e4m3's 3 mantissa bits, 2⁻³ for e5m2's 2), spread evenly,
so of RMS u/√3. A GEMM's output is a sum of many such products: its relative RMS error is that of its
operands' (independent roundings add in quadrature, and a K-term sum of independent terms keeps the
terms' relative RMS). Along a chain of k casts the errors add in quadrature again: the relative RMS
error of a quantity is at most √(Σ_c u_c² / 3) over the casts c on the longest path that feeds it,
times λ = 2 for what independence does not cover (correlated terms, a softmax's slope). The casts
counted (`CASTS`): forward, each GEMM casts its input and its weight in e4m3 — the attention's (q, k or
v, then wo) and the feed-forward's (w1 or w3, then w2) after it: 8; a weight's gradient adds its
output gradient's casts in the backward GEMMs between it and the block's output (4 at most, e5m2 in
tensorwise) and its own (1). A wrong scale — the weight's dequantised by twice its scale — lands far
outside (`test_a_wrong_scale_breaks_the_block_bound`).

**The curve.** The tiny model trains 30 steps (bf16 parameters, AdamW, learnable sequences) with
and without FP8 linears; every step's loss within u(e4m3) = 2⁻⁴ relative of bf16's — the precision
the FP8 GEMMs' operands carry — while both fall by half. Dropping a scale leaves that band."""

from __future__ import annotations

import math

import pytest
import torch

from fivefold import float8
from fivefold.models import get_config
from fivefold.models.llama import Llama
from fivefold.models.loss import lm_cross_entropy
from fivefold.models.plans import is_float8_linear

U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3
LAMBDA = 2.0
# casts on the longest path to each compared quantity: (e4m3 casts, e5m2 casts), per recipe
CASTS = {
    "tensorwise": {"output": (8, 0), "gradient": (8 + 4, 5)},
    "rowwise": {"output": (8, 0), "gradient": (8 + 4 + 5, 0)},
}


def _bound(recipe: str, quantity: str) -> float:
    e4m3, e5m2 = CASTS[recipe][quantity]
    return LAMBDA * math.sqrt((e4m3 * U_E4M3**2 + e5m2 * U_E5M2**2) / 3)


def _model(recipe: str | None, dtype: torch.dtype) -> Llama:
    model = Llama(get_config("tiny"), seed=0, dtype=dtype)
    if recipe is not None:
        for name, layer in model.named_modules():
            if is_float8_linear(name):
                layer.matmul = float8.Float8Matmul(float8.RECIPES[recipe])
    return model


def _block_run(recipe: str | None) -> dict[str, torch.Tensor]:
    """One block of the tiny model (fp32 parameters: only the FP8 GEMMs round coarsely) on random
    activations: the attention + feed-forward part of its output, its input's gradient and every
    parameter's gradient for a random output gradient."""
    model = _model(recipe, torch.float32)
    block, seq = model.layers["0"], 64
    x = torch.randn(4, seq, model.config.dim, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    out = block(x, model.rope_cos[:seq], model.rope_sin[:seq])
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    grads = {f"grad {n}": p.grad for n, p in block.named_parameters()}
    return {"output": (out - x).detach(), "grad input": x.grad, **grads}


def _relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_block_in_fp8_is_within_the_derived_bound_of_high_precision(recipe):
    want, got = _block_run(None), _block_run(recipe)
    for name in want:
        quantity = "output" if name == "output" else "gradient"
        error, bound = _relative_rms(got[name], want[name]), _bound(recipe, quantity)
        assert error <= bound, f"{recipe} {name}: relative RMS error {error:.4f} > {bound:.4f}"
        if name == "output":  # FP8 does round: the comparison measures something
            assert error > U_E4M3 / 20, f"{recipe} {name}: {error:.2e}, as if not in FP8"


def test_a_wrong_scale_breaks_the_block_bound(monkeypatch):
    """The weight dequantised by twice its scale (every output GEMM off by 2×): far outside."""
    mm = float8._mm

    def wrong(a, b, out_dtype, fast_accum):
        if isinstance(b, float8.Float8):
            b = float8.Float8(b.data, b.scale / 2)
        return mm(a, b, out_dtype, fast_accum)

    want = _block_run(None)["output"]
    monkeypatch.setattr(float8, "_mm", wrong)
    got = _block_run("tensorwise")["output"]
    assert _relative_rms(got, want) > 2 * _bound("tensorwise", "output")


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic sequences mod 256 (a start and a stride per row): learnable, so the loss falls."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 256, (8, 1), generator=g)
    stride = torch.randint(1, 8, (8, 1), generator=g)
    seq = (start + stride * torch.arange(65)) % 256
    return seq[:, :-1], seq[:, 1:]


def _curve(recipe: str | None, steps: int = 30) -> list[float]:
    model = _model(recipe, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        loss = lm_cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def bf16_curve() -> list[float]:
    return _curve(None)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_training_follows_bf16_for_30_steps(bf16_curve, recipe):
    fp8 = _curve(recipe)
    assert bf16_curve[-1] < 0.6 * bf16_curve[0]  # it learns
    for step, (got, want) in enumerate(zip(fp8, bf16_curve, strict=True)):
        assert abs(got - want) <= U_E4M3 * want, f"{recipe} step {step}: loss {got:.4f} against bf16's {want:.4f}"


def test_a_dropped_scale_does_not_follow_bf16(bf16_curve, monkeypatch):
    """The GEMMs dequantised without the weight's scale: the curve leaves bf16's (at first every
    prediction is near-uniform whatever the blocks compute; the norms hide the scale for a while)."""
    mm = float8._mm

    def unscaled(a, b, out_dtype, fast_accum):
        if isinstance(b, float8.Float8):
            b = float8.Float8(b.data, torch.ones_like(b.scale))
        return mm(a, b, out_dtype, fast_accum)

    monkeypatch.setattr(float8, "_mm", unscaled)
    fp8 = _curve("tensorwise")
    assert any(abs(got - want) > U_E4M3 * want for got, want in zip(fp8, bf16_curve))
