"""How close a layout must come to its single-process reference: the kernels and the bound.

Every training-equality test compares what the workers computed with a single-process reference
built in the same test. Two things decide whether that comparison means the same on every processor:

**The kernels.** The workers run one thread each. A reference computed in the pytest process would
run on as many threads as the machine has and could pick other GEMM blockings, so the two sides
would round differently for a reason that has nothing to do with the layout. `reference(fn, *args)`
runs every reference the way the workers run: one thread, `torch.use_deterministic_algorithms`,
restored afterwards. Then the two sides differ only where the layout itself changes the order of a
sum (micro-batches, ranks, shards), and where it changes nothing the test can assert bit-equality.
`reference(fn, *args, kernels=OTHER)` computes the same reference in a process forced onto another
kernel path (`MKL_CBWR=COMPATIBLE`: MKL's processor-independent GEMM; 2 threads; on an AVX-512
processor `ATEN_CPU_CAPABILITY=avx2`), as another processor would: the tests marked `other_kernels`
check that the bound below holds there too, so the suite does not depend on the processor it runs
on.

**The bound.** Derived, not read off a run (docs/testing.md). u is the dtype's unit roundoff.

1. *One sum in another order.* Two orders of the same n-term sum differ by at most 2·γ_n·Σ|x_i| (γ_n
   ≈ n·u, Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2), and — rounding errors
   taken as independent and zero-mean — by at most 2·λ·√n·u·Σ|x_i| except with probability
   2·exp(−λ²/2) (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019, Thm 3.1). λ = 4 is used. n
   (`terms`) is the longest sum whose order the layout changes: the tokens summed into a weight
   gradient (split into micro-batches and ranks), or an inner dimension split into tensor-parallel
   shards. Σ|x_i| is bounded by a scale of the same quantity that does not cancel: for a gradient,
   the largest gradient entry of the whole model (an error travels back through every layer, and a
   tensor whose entries all cancel — an attention query weight at initialisation — is no guide to
   its terms); for an activation or a loss, the largest magnitude of the compared tensor.
   → `value_bound(terms, scale)` / `assert_values_close` for a loss, a gradient or an activation.
2. *Parameters after k optimizer steps.* A gradient error moves the update, and through the moved
   parameters every later gradient: Adam divides by √v̂+ε, so an entry whose gradient is ~ε
   amplifies an error by up to 1/ε while one whose gradient is large barely moves; clipping rescales
   everything; a moved parameter changes the next step's gradients through the loss's curvature.
   Rather than bound each of these by hand (their worst cases compound into a bound of no use), the
   reference is trained again, SHADOW_RUNS times, with every gradient entry of every step moved by
   rule 1's full bound, ±reordered_sum(n)·G with random signs (G the step's largest gradient entry)
   — as if every sum had erred by the most it can, all at once — and the bound of each compared
   tensor is the largest deviation from the plain reference any re-run shows (plus rule 1's relative
   term for the value itself). The dynamics are the reference's own; only the size of the error is
   assumed.
   → `reference(fn, ..., terms=n)` returns (value, bounds): a `Bound` for every floating leaf of
   fn's result.

What a bound of that size still catches (`tests/test_tolerance.py` shows it): a dropped micro-batch,
a parameter whose gradient is lost for a step, weight decay on the wrong group, clipping skipped —
each lands tens to hundreds of bounds away. A uniform rescaling of every gradient, to which AdamW
and clipping are blind, is caught by the gradient and SGD comparisons.

No tests here (tests/test_tolerance.py tests it). `reference(..., kernels=OTHER)` starts a process
pool, so every test that calls it is marked `multiprocess`."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import pickle
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

LAMBDA = 4.0  # the probabilistic bound's confidence parameter (rule 1)
SHADOW_RUNS = 2  # rule 2: perturbed re-runs of a training reference (independent sign patterns)
WORKERS, TWO_THREADS, OTHER = "workers", "two-threads", "other"  # the kernel paths a reference can run on
# Parametrise a training-equality test with this: its reference on the workers' kernels, and (marked) on another.
# OTHER's reference runs in a process of its own: `multiprocess` too.
_OTHER_PARAM = pytest.param(OTHER, marks=[pytest.mark.other_kernels, pytest.mark.multiprocess])
KERNELS = [WORKERS, _OTHER_PARAM]
ALL_KERNELS = [WORKERS, pytest.param(TWO_THREADS, marks=pytest.mark.other_kernels), _OTHER_PARAM]
# The other path: MKL's processor-independent GEMM (another blocking, other summation orders), two threads, and on an
# AVX-512 processor ATen's AVX2 kernels (other vector widths in every reduction). Not ATen's scalar kernels: those
# also change what torch's random number generators draw, and a reference should differ in its sums, not its inputs.
_NATIVE = torch.backends.cpu.get_cpu_capability()
OTHER_KERNELS_ENV = {**({"ATEN_CPU_CAPABILITY": "avx2"} if _NATIVE.startswith("AVX512") else {}),
                     "MKL_CBWR": "COMPATIBLE", "FIVEFOLD_REFERENCE_THREADS": "2"}


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def reordered_sum(terms: int, dtype: torch.dtype = torch.float32) -> float:
    """Rule 1: how far two orders of an n-term sum can differ, relative to Σ|x_i|."""
    return 2 * LAMBDA * math.sqrt(max(terms, 1)) * unit_roundoff(dtype)


@dataclass(frozen=True)
class Bound:
    """|got − want| ≤ atol + rtol·|want|, element by element (atol may be a tensor of want's shape)."""

    rtol: float
    atol: float | torch.Tensor

    def holds(self, got: torch.Tensor | float, want: torch.Tensor | float) -> bool:
        got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
        return bool(((got - want).abs() <= self.atol + self.rtol * want.abs()).all())

    def assert_holds(self, got: torch.Tensor | float, want: torch.Tensor | float, msg: str = "") -> None:
        got, want = torch.as_tensor(got), torch.as_tensor(want)
        assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        if self.holds(got, want):
            return
        diff = (got.double() - want.double()).abs()
        allowed = self.atol + self.rtol * want.double().abs()
        worst = int((diff - allowed).argmax())
        atol = self.atol.reshape(-1)[worst].item() if isinstance(self.atol, torch.Tensor) else self.atol
        raise AssertionError(f"{msg}: {int((diff > allowed).sum())} of {diff.numel()} entries outside the derived "
                             f"bound; worst |got-want| = {diff.reshape(-1)[worst].item():.3e} where the bound allows "
                             f"{allowed.reshape(-1)[worst].item():.3e} (atol {atol:.3e}, rtol {self.rtol:.3e})")


def value_bound(terms: int, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32) -> Bound:
    """Rule 1 for a loss, gradient or activation: the same sums, n terms long, in another order."""
    rho = reordered_sum(terms, dtype)
    scale = float(scale.detach().abs().max()) if isinstance(scale, torch.Tensor) else abs(scale)
    return Bound(rtol=rho, atol=rho * scale)


def assert_values_close(got: torch.Tensor | float, want: torch.Tensor | float, terms: int, msg: str = "",
                        scale: float | torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:
    """Rule 1, with the reference's own scale unless told (e.g. the largest gradient of the whole model) and the
    reference's dtype unless told (the dtype the compared side computes in, when it is the lower one)."""
    want = torch.as_tensor(want)
    dtype = dtype or (want.dtype if want.is_floating_point() else torch.float32)
    value_bound(terms, want if scale is None else scale, dtype).assert_holds(got, want, msg)


def assert_within(got: dict, want: dict, bounds: dict, msg: str = "") -> None:
    """Every entry of `got` within the bound `reference(..., terms=n)` derived for it."""
    for name, value in got.items():
        bounds[name].assert_holds(torch.as_tensor(value).float(), torch.as_tensor(want[name]).float(),
                                  f"{msg} {name}".strip())


# ---------------------------------------------------------------------------------------------
# Rule 2: the reference trained again with every gradient moved by rule 1's bound.
@contextlib.contextmanager
def perturbed_gradients(terms: int, seed: int, dtype: torch.dtype = torch.float32,
                        relative: float = 0.0) -> Iterator[None]:
    """Before every torch optimizer step, move each gradient entry by ±reordered_sum(terms)·G (random signs,
    seeded), G the largest gradient entry the step sees: the most a reordered sum can move it (rule 1).
    ``relative``: each entry moves by ±max(reordered_sum(terms), relative)·G instead — where the sums feed FP8
    casts, one of which may round a term (at most G, as rule 1 takes it) the other way by up to its format's unit
    roundoff."""
    rho, generator = reordered_sum(terms, dtype), torch.Generator().manual_seed(seed)

    def perturb(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        scale = max(rho, relative) * max(float(g.detach().abs().max()) for g in grads)
        with torch.no_grad():
            for g in grads:
                signs = torch.randint(0, 2, g.shape, generator=generator).to(g.dtype) * 2 - 1
                g.add_(signs, alpha=scale)

    handle = register_optimizer_step_pre_hook(perturb)
    try:
        yield
    finally:
        handle.remove()


def _deviation(a: Any, b: Any) -> Any:
    """The same structure as a; each floating leaf replaced by max|a - b| (other leaves must be equal)."""
    if isinstance(a, dict):
        return {k: _deviation(v, b[k]) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return [_deviation(x, y) for x, y in zip(a, b, strict=True)]
    if isinstance(a, torch.Tensor) and a.is_floating_point():
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    if isinstance(a, float):
        return abs(a - b)
    return None


def _max_deviation(*devs: Any) -> Any:
    first = devs[0]
    if isinstance(first, dict):
        return {k: _max_deviation(*(d[k] for d in devs)) for k in first}
    if isinstance(first, list):
        return [_max_deviation(*parts) for parts in zip(*devs, strict=True)]
    return None if first is None else max(devs)


def _bounds(dev: Any, rtol: float) -> Any:
    if isinstance(dev, dict):
        return {k: _bounds(v, rtol) for k, v in dev.items()}
    if isinstance(dev, list):
        return [_bounds(v, rtol) for v in dev]
    return None if dev is None else Bound(rtol=rtol, atol=dev)


def _trained_with_bounds(fn: Callable, args: tuple, kwargs: dict, terms: int, dtype: torch.dtype,
                         shadow_runs: int = SHADOW_RUNS, relative: float = 0.0) -> tuple:
    value = fn(*args, **kwargs)
    shadows = []
    for seed in range(shadow_runs):
        with perturbed_gradients(terms, seed, dtype, relative):
            shadows.append(_deviation(fn(*args, **kwargs), value))
    return value, _bounds(_max_deviation(*shadows), reordered_sum(terms, dtype))


# ---------------------------------------------------------------------------------------------
# Rule 0: the reference runs on the workers' kernels (or, asked, on another kernel path).
@contextlib.contextmanager
def reference_kernels(threads: int | None = None) -> Iterator[None]:
    """One thread (as every worker) unless told, deterministic algorithms; both restored afterwards."""
    threads = threads or int(os.environ.get("FIVEFOLD_REFERENCE_THREADS", "1"))
    before_threads = torch.get_num_threads()
    before_det, before_warn = (torch.are_deterministic_algorithms_enabled(),
                               torch.is_deterministic_algorithms_warn_only_enabled())
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before_det, warn_only=before_warn)
        torch.set_num_threads(before_threads)


def _run_on_reference_kernels(fn: Callable, args: tuple, kwargs: dict, threads: int | None,
                              terms: int | None, dtype: torch.dtype, shadow_runs: int = SHADOW_RUNS,
                              relative: float = 0.0) -> Any:
    with reference_kernels(threads):
        if terms is None:
            return fn(*args, **kwargs)
        return _trained_with_bounds(fn, args, kwargs, terms, dtype, shadow_runs, relative)


_OTHER_POOL: ProcessPoolExecutor | None = None
_CACHE: dict[tuple, Any] = {}


def _other_kernels_pool() -> ProcessPoolExecutor:
    """One process for the session, started with the other kernel path's environment (read when torch loads)."""
    global _OTHER_POOL
    if _OTHER_POOL is None:
        saved = {k: os.environ.get(k) for k in OTHER_KERNELS_ENV}
        os.environ.update(OTHER_KERNELS_ENV)
        try:
            _OTHER_POOL = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            _OTHER_POOL.submit(int).result()  # start it now, while the environment is set
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return _OTHER_POOL


def other_kernels_capability() -> str:
    """What the other kernel path reports, e.g. "AVX2 threads=2 cbwr=COMPATIBLE" (the environment did reach it)."""
    return _other_kernels_pool().submit(_capability).result()


def _capability() -> str:
    return (f"{torch.backends.cpu.get_cpu_capability()} threads={int(os.environ['FIVEFOLD_REFERENCE_THREADS'])} "
            f"cbwr={os.environ.get('MKL_CBWR')}")


def reference(fn: Callable, *args: Any, kernels: str = WORKERS, terms: int | None = None,
              dtype: torch.dtype = torch.float32, shadow_runs: int = SHADOW_RUNS, relative: float = 0.0,
              **kwargs: Any) -> Any:
    """fn(*args, **kwargs) as a single-process reference: on the workers' kernels (this process, one thread), on two
    threads (TWO_THREADS, this process) or on the OTHER kernel path (a process of its own).

    With `terms` (rule 1's n for the gradients) fn is a training reference: the result is (value, bounds), bounds
    of value's structure with a `Bound` for each floating leaf (rule 2). fn must be a module-level function;
    results are cached for the session by (fn, arguments, kernels), so a reference that many parametrised tests
    share is computed once. ``shadow_runs``: rule 2's perturbed re-runs, more of them where an optimizer's response to
    a rounding difference is no smaller for a smaller difference (Muon's bf16 Newton-Schulz iteration: a flipped bf16
    rounding of its input is amplified by the iteration's slope at small singular values, whatever moved it), so
    the bound is the largest of more samples of that noise. ``relative``: the re-runs move every gradient
    entry by that fraction of the step's largest (`perturbed_gradients`) where it exceeds rule 1's: the noise an FP8
    cast fed by a reordered sum may round into a gradient."""
    key = (fn.__module__, fn.__qualname__, pickle.dumps((args, sorted(kwargs.items()))), kernels, terms, dtype,
           shadow_runs, relative)
    if key not in _CACHE:
        job = (fn, args, kwargs, 2 if kernels == TWO_THREADS else None, terms, dtype, shadow_runs, relative)
        if kernels in (WORKERS, TWO_THREADS):
            _CACHE[key] = _run_on_reference_kernels(*job)
        elif kernels == OTHER:
            _CACHE[key] = _other_kernels_pool().submit(_run_on_reference_kernels, *job).result()
        else:
            raise ValueError(f"kernels must be one of {(WORKERS, TWO_THREADS, OTHER)}, not {kernels!r}")
    return _CACHE[key]
