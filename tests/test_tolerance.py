"""The bounds of tests/tolerance.py hold where only the order of sums differs, and still fail.

They hold at 2 threads and on the other kernel path too, rule 1 holds for sums in 64 random blocked
orders (within 100× of what one-signed sums show), and the widest parameter bound stays below a
tenth of how far training moves the parameters; and they fail a training that is wrong (a dropped
micro-batch, a lost gradient, weight decay on the wrong group, clipping skipped) at the step it
happens, 10 bounds away or more — a bound nothing can fail would be no test. The other-kernel-path
cases start a process pool (`multiprocess`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tolerance import (
    OTHER,
    TWO_THREADS,
    WORKERS,
    assert_values_close,
    other_kernels_capability,
    reference,
    reference_kernels,
    reordered_sum,
    unit_roundoff,
    value_bound,
)

from fivefold.models import build_model, get_config

CFG = get_config("tiny", n_layers=4, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=8, vocab_size=17)
ROWS, SEQ, M, STEPS, LR, WD, EPS, CLIP = 16, 6, 4, 5, 1e-2, 0.1, 1e-4, 0.5
TERMS = ROWS * SEQ  # the tokens summed into a weight gradient


def _train(bug: str | None = None) -> dict:
    """AdamW on a tiny Llama, clipped, M micro-batches per step; `bug` plants one defect a layout could have."""
    model = build_model(CFG, seed=0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": WD if bug == "decay-everything" else 0.0}],
                            lr=LR, eps=EPS)
    losses, history = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=g)
        y = torch.randint(0, CFG.vocab_size, (ROWS, SEQ), generator=g)
        opt.zero_grad()
        total = 0.0
        for m, (xm, ym) in enumerate(zip(x.chunk(M), y.chunk(M))):
            if bug == "drop-microbatch" and step == 1 and m == M - 1:
                continue
            loss = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / M
            loss.backward()
            total += loss.item()
        if bug == "lose-a-gradient" and step == 1:
            model.layers[2].ffn_norm.weight.grad.zero_()
        if bug != "skip-clipping":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(total)
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return dict(losses=losses, history=history)


def _violations(got: dict, want: dict, bounds: dict) -> list[str]:
    """(step, name) of every compared tensor outside its bound."""
    bad = [f"loss {s}" for s, (a, b) in enumerate(zip(got["losses"], want["losses"]))
           if not bounds["losses"][s].holds(a, b)]
    for step, (g, w) in enumerate(zip(got["history"], want["history"])):
        bad += [f"step {step} {n}" for n in w if not bounds["history"][step][n].holds(g[n], w[n])]
    return bad


@pytest.mark.parametrize("kernels", [WORKERS, TWO_THREADS, pytest.param(OTHER, marks=pytest.mark.multiprocess)])
def test_the_reference_on_any_kernel_path_is_within_its_bounds(kernels):
    """The same training on other threads or kernels reorders sums and nothing else: inside the bounds."""
    want, bounds = reference(_train, terms=TERMS)
    got, _ = reference(_train, kernels=kernels, terms=TERMS)
    assert not _violations(got, want, bounds)


@pytest.mark.parametrize("bug", ["drop-microbatch", "lose-a-gradient", "decay-everything", "skip-clipping"])
def test_a_wrong_training_falls_outside_the_bounds(bug):
    want, bounds = reference(_train, terms=TERMS)
    got = reference(_train, bug)
    bad = _violations(got, want, bounds)
    first = {"drop-microbatch": 1, "lose-a-gradient": 1, "decay-everything": 0, "skip-clipping": 0}[bug]
    assert f"step {first}" in " ".join(bad), bad[:5]  # caught at the step it happens
    # and by a wide margin: the worst entry of that step lies 10 bounds or more away
    worst = 0.0
    for n, w in want["history"][first].items():
        b, g = bounds["history"][first][n], got["history"][first][n]
        worst = max(worst, float(((g - w).abs() / (b.atol + b.rtol * w.abs())).max()))
    assert worst >= 10, worst


def test_bounds_grow_with_the_steps_and_stay_far_below_the_updates():
    """Rule 2's bound is not a blanket: it starts at the first step's perturbation and stays a small fraction of
    how far training moves the parameters (lr per step for AdamW)."""
    want, bounds = reference(_train, terms=TERMS)
    widest = [max(float(torch.as_tensor(b.atol).max()) for b in step.values()) for step in bounds["history"]]
    assert widest == sorted(widest) and widest[0] > 0
    assert widest[-1] < 0.1 * LR * STEPS


def test_rule_one_holds_for_sums_in_other_orders_and_is_not_vacuous():
    """n float32 terms summed in many orders against the exact (float64) sum: within reordered_sum(n)·Σ|x| / 2 for
    one order (two orders: the full bound) — and for terms of one sign, where nothing cancels and rounding errors
    are as large as they get, within two orders of magnitude of the bound (a bound of 1 would pass anything)."""
    g = torch.Generator().manual_seed(0)
    for n in (16, 96, 1024, 8192):
        for x in (torch.randn(n, generator=g, dtype=torch.float64).float(), torch.rand(n, generator=g).float()):
            exact, scale = float(x.double().sum()), float(x.abs().double().sum())
            worst = 0.0
            for _ in range(64):
                acc = torch.zeros((), dtype=torch.float32)
                for v in x[torch.randperm(n, generator=g)].view(-1, 8).sum(1):  # blocked, as a SIMD kernel sums
                    acc += v
                worst = max(worst, abs(float(acc) - exact))
            assert worst <= reordered_sum(n) / 2 * scale, n
        assert worst >= reordered_sum(n) * scale / 100, n  # the one-signed terms


def test_value_bound_is_rule_one_scaled():
    b = value_bound(96, torch.tensor([0.5, -0.25]))
    assert b.rtol == pytest.approx(2 * 4.0 * math.sqrt(96) * unit_roundoff()) and b.atol == pytest.approx(b.rtol / 2)
    assert b.holds(torch.tensor([1.0]), torch.tensor([1.0 + 1e-6]))
    assert not b.holds(torch.tensor([1.0]), torch.tensor([1.0 + 1e-3]))
    assert_values_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 4e-6]), terms=96)
    with pytest.raises(AssertionError, match="outside the derived bound"):
        assert_values_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001]), terms=96)


def test_reference_kernels_are_the_workers_and_are_restored():
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    with reference_kernels():
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before


@pytest.mark.multiprocess
def test_the_other_kernel_path_really_is_another():
    """Its process runs MKL's compatible GEMM on two threads and, on an AVX-512 processor, ATen's AVX2 kernels."""
    native = torch.backends.cpu.get_cpu_capability()
    capability, threads, cbwr = other_kernels_capability().split()
    assert threads == "threads=2" and cbwr == "cbwr=COMPATIBLE"
    assert capability == ("AVX2" if native.startswith("AVX512") else native)
