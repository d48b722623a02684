"""Ring attention's block kernels (fivefold/context_parallel/kernels.py), in-process, no spawn.

- On CPU, `FusedBlocks` (here on torch's CPU flash ops, the same class and merge the CUDA ops run
  in) equals `MathBlocks` block by block — forward out and log-sum-exp, backward from a final O and
  lse — and the whole ring on one rank (zig-zag: three blocks merged) equals single-process SDPA
  with either kernel, GQA and multi-head, causal or not.
- On `meta` standing in for CUDA (`kernels.FUSED["meta"]` = CUDA's), a cp 2 ring's forward and
  backward call the fused CUDA SDPA ops — flash for bf16 / fp16, memory-efficient attention for
  fp32 or a head dim flash cannot take — and never the math path (no matmul, no logsumexp, its
  methods replaced by ones that raise); GQA reaches flash with the kv heads as they are and
  efficient attention with them expanded. Does torch 2.13 have meta kernels for these ops? Yes:
  `_scaled_dot_product_flash_attention(_backward)` and `_scaled_dot_product_efficient_attention
  (_backward)` all run on meta.
- The choice: `choose_kernel` by device type, dtype and head dim, ``parallel.cp_kernel`` as a
  config choice, the rule refusing ``flash`` on a device without a fused kernel, and the choice
  reaching every ring core."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_values_close
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.context_parallel import kernels
from fivefold.context_parallel.kernels import KERNELS, MathBlocks, choose_kernel
from fivefold.context_parallel.layout import SequenceLayout
from fivefold.context_parallel.ring_attention import ring_attention

aten = torch.ops.aten


@dataclass
class _NoWire:
    """What `ring_attention` asks of its comm, with nothing on the wire: a received shard keeps what
    its buffer held (on meta: nothing), so only one rank's calls and shapes are real."""

    rank: int
    size: int

    def batch_p2p(self, ops, tag: str = ""):
        return SimpleNamespace(wait=lambda: None)


def _inputs(b, hq, hkv, length, d, dtype=torch.float32, device="cpu", seed=3):
    g = torch.Generator().manual_seed(seed)
    q, grad = (torch.randn(b, hq, length, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, hkv, length, d, generator=g) for _ in range(2))
    return [t.to(dtype=dtype, device=device) for t in (q, k, v, grad)]


# -- CPU: the fused class against the math reference -------------------------------------------------
BLOCK_CASES = list(itertools.product((True, False), ((4, 2), (2, 2))))


@pytest.mark.parametrize("diag,heads", BLOCK_CASES, ids=lambda x: str(x))
def test_fused_blocks_equal_math_blocks_on_cpu(diag, heads):
    hq, hkv = heads
    q, k, v, dout = _inputs(2, hq, hkv, 16, 8)
    scale = 8**-0.5
    fused, math = KERNELS["cpu_flash"], MathBlocks()
    (out_f, lse_f), (out_m, lse_m) = fused.forward(q, k, v, diag, scale), math.forward(q, k, v, diag, scale)
    assert out_f.dtype == lse_f.dtype == torch.float32 and lse_f.shape == (2, hq, 16)
    assert_values_close(out_f, out_m, 16, "block out")
    assert_values_close(lse_f, lse_m, 16, "block lse")
    # backward from a "final" O and lse that are not this block's own (as in the ring)
    out_final, lse_final = 0.5 * out_m, lse_m + 0.25
    grads_f = fused.backward(dout, q, k, v, out_final, lse_final, diag, scale)
    grads_m = math.backward(dout, q, k, v, out_final, lse_final, diag, scale)
    scale_g = max(float(g.abs().max()) for g in grads_m)
    for name, got, want in zip(("dq", "dk", "dv"), grads_f, grads_m):
        assert got.shape == want.shape and got.dtype == torch.float32, name
        assert_values_close(got, want, 16 * hq // hkv, f"block {name}", scale=scale_g)


@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
@pytest.mark.parametrize("causal,heads", BLOCK_CASES, ids=lambda x: str(x))
def test_one_rank_ring_equals_sdpa_on_cpu(kernel, causal, heads):
    """cp 1, zig-zag: chunks 0 and 1 of one rank, three blocks (two diagonal) merged by the ring."""
    hq, hkv = heads
    q, k, v, grad = (t.requires_grad_(i < 3) for i, t in enumerate(_inputs(2, hq, hkv, 32, 8)))
    out = ring_attention(q, k, v, _NoWire(0, 1), SequenceLayout("zigzag", 1), causal, kernel)
    out.backward(grad)
    got = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    g = hq // hkv
    ref = F.scaled_dot_product_attention(q2, k2.repeat_interleave(g, 1), v2.repeat_interleave(g, 1),
                                         is_causal=causal)
    ref.backward(grad)
    want = dict(out=ref.detach(), dq=q2.grad, dk=k2.grad, dv=v2.grad)
    scale_g = max(float(want[n].abs().max()) for n in ("dq", "dk", "dv"))
    for name in want:
        assert_values_close(got[name], want[name], 32 * g, f"{kernel} {name}",
                            scale=None if name == "out" else scale_g)


# -- meta standing in for CUDA: which ops run ---------------------------------------------------------
class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


MATH_OPS = {aten.bmm, aten.mm, aten.matmul, aten.logsumexp, aten.triu, aten.masked_fill}


@pytest.fixture
def meta_as_cuda(monkeypatch):
    monkeypatch.setitem(kernels.FUSED, "meta", kernels.FUSED["cuda"])

    def refuse(*args, **kwargs):
        raise AssertionError("the math block kernel ran")

    monkeypatch.setattr(MathBlocks, "forward", refuse)
    monkeypatch.setattr(MathBlocks, "backward", refuse)


def _ring_ops(dtype, heads=(4, 2), d=64, rank=0):
    q, k, v, grad = (t.requires_grad_(i < 3)
                     for i, t in enumerate(_inputs(1, *heads, 16, d, dtype=dtype, device="meta")))
    with _Ops() as fwd:
        out = ring_attention(q, k, v, _NoWire(rank, 2), SequenceLayout("zigzag", 2))
    with _Ops() as bwd:
        out.backward(grad)
    assert out.shape == q.shape and out.dtype == dtype
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert k.grad.dtype == dtype
    return fwd.seen, bwd.seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_the_ring_calls_flash_attention(meta_as_cuda, dtype):
    fwd, bwd = _ring_ops(dtype)
    # rank 0 of zig-zag cp 2 holds chunks 0 and 3: 3 blocks against its own shard, 2 against rank 1's
    assert fwd.count(aten._scaled_dot_product_flash_attention) == 5
    assert bwd.count(aten._scaled_dot_product_flash_attention_backward) == 5
    assert not MATH_OPS & set(fwd + bwd)
    assert aten._scaled_dot_product_efficient_attention not in fwd
    # GQA: flash takes the 2 kv heads as they are (no expanded copy is made for it)
    assert aten.expand not in fwd + bwd


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.bfloat16, 12)])
def test_where_flash_cannot_run_the_ring_calls_efficient_attention(meta_as_cuda, dtype, d):
    fwd, bwd = _ring_ops(dtype, d=d)
    assert fwd.count(aten._scaled_dot_product_efficient_attention) == 5
    assert bwd.count(aten._scaled_dot_product_efficient_attention_backward) == 5
    assert aten._scaled_dot_product_flash_attention not in fwd
    assert not MATH_OPS & set(fwd + bwd)
    assert aten.expand in fwd  # GQA: kv heads expanded for the op (its heads must match q's)


def test_the_fused_ring_makes_no_host_sync(meta_as_cuda):
    host_syncs = pytest.importorskip("host_syncs")
    q, k, v, grad = (t.requires_grad_(i < 3)
                     for i, t in enumerate(_inputs(1, 4, 2, 16, 64, torch.bfloat16, "meta")))
    for dtype_q in (q, q.float().detach().requires_grad_()):  # flash, then efficient attention
        kk, vv = (t.to(dtype_q.dtype).detach().requires_grad_() for t in (k, v))
        with host_syncs.HostSyncs(devices=("meta",)) as syncs:
            out = ring_attention(dtype_q, kk, vv, _NoWire(1, 2), SequenceLayout("zigzag", 2))
            out.backward(grad.to(dtype_q.dtype))
        assert syncs.count == 0, syncs.where


# -- the choice ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("choice,device,dtype,d,want", [
    ("auto", "cpu", torch.float32, 64, "cpu_flash"),
    ("auto", "cuda", torch.bfloat16, 128, "cuda_flash"),
    ("auto", "cuda", torch.float16, 256, "cuda_flash"),
    ("auto", "cuda", torch.float32, 128, "cuda_efficient"),
    ("auto", "cuda", torch.bfloat16, 12, "cuda_efficient"),
    ("auto", "cuda", torch.bfloat16, 512, "cuda_efficient"),
    ("flash", "cuda", torch.bfloat16, 64, "cuda_flash"),
    ("auto", "mps", torch.bfloat16, 64, "math"),
    ("math", "cuda", torch.bfloat16, 64, "math"),
    ("math", "cpu", torch.float32, 64, "math"),
    ("cpu_flash", "cpu", torch.float32, 64, "cpu_flash"),
])
def test_the_kernel_is_chosen_by_device_dtype_and_head_dim(choice, device, dtype, d, want):
    assert choose_kernel(choice, device, dtype, d) == want


def test_flash_on_a_device_without_a_fused_kernel_is_refused():
    with pytest.raises(ValueError, match="no fused block kernel on mps"):
        choose_kernel("flash", "mps", torch.bfloat16, 64)
    with pytest.raises(ValueError, match="kernel 'fast': choose auto, math, flash"):
        choose_kernel("fast", "cpu", torch.float32, 64)


def test_cp_kernel_is_a_config_choice_with_a_rule():
    from fivefold import rules
    from fivefold.config import ConfigError, load_config

    assert load_config(overrides=["--parallel.cp_kernel", "math"]).parallel.cp_kernel == "math"
    with pytest.raises(ConfigError, match="parallel.cp_kernel='fast': choose auto, math or flash"):
        load_config(overrides=["--parallel.cp_kernel", "fast"])
    cfg = load_config(overrides=["--parallel.cp_kernel", "flash"])
    cp2 = lambda dim: 2 if dim == "cp" else 1  # noqa: E731
    assert rules.first_error(rules.Layout(cfg, cp2, device="mps")) == (
        "parallel.cp_kernel=flash: ring attention has no fused block kernel on mps (only on cpu and cuda); use "
        "auto or math")
    assert rules.first_error(rules.Layout(cfg, cp2, device="cuda")) is None
    assert rules.first_error(rules.Layout(cfg, lambda dim: 1, device="mps")) is None  # no ring, nothing refused


def test_the_config_choice_reaches_every_ring_core():
    from fivefold.context_parallel import apply_context_parallel
    from fivefold.models import build_model, get_config
    from fivefold.models.plans import LLAMA_CP_PLAN

    model = build_model(get_config("tiny", n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                   max_seq_len=32, vocab_size=32), seed=0)
    apply_context_parallel(model, _NoWire(0, 2), SequenceLayout("zigzag", 2), 16, LLAMA_CP_PLAN, kernel="math")
    assert [layer.attention.core.kernel for layer in model.layers] == ["math", "math"]


# -- the benchmark's emulation (bench/context_parallel.py: bench_cp_kernels) ----------------------------
@pytest.mark.parametrize("rank", [0, 2])
def test_one_rank_emulated_by_blocks_computes_its_rows_of_full_attention(rank):
    """`_LocalRing` hands rank r the K/V shards the ring would: its output and dQ are full attention's rows at
    its positions (its dK/dV are not: the other ranks' parts never arrive)."""
    from bench.context_parallel import _LocalRing

    layout, hq, hkv = SequenceLayout("zigzag", 3), 4, 2
    q, k, v, grad = _inputs(1, hq, hkv, 48, 8)
    shards = [torch.stack([layout.shard(t, r, dim=2) for t in (k, v)]) for r in range(3)]
    q_r = layout.shard(q, rank, dim=2).requires_grad_()
    out = ring_attention(q_r, shards[rank][0], shards[rank][1], _LocalRing(rank, 3, shards), layout, True, "math")
    out.backward(layout.shard(grad, rank, dim=2))
    q2 = q.clone().requires_grad_()
    ref = F.scaled_dot_product_attention(q2, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    ref.backward(grad)
    assert_values_close(out.detach(), layout.shard(ref.detach(), rank, dim=2), 48, "emulated rank out")
    assert_values_close(q_r.grad, layout.shard(q2.grad, rank, dim=2), 48 * 2, "emulated rank dq")


def test_the_kernel_bench_runs_at_a_small_size(capsys):
    from bench import run as bench_run

    assert bench_run.main(["cp-kernel", "--dry-run", "--seq-len", "64", "--heads", "2", "--kv-heads", "1",
                           "--head-dim", "8", "--cp", "2", "--steps", "1", "--warmup", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| flash     | cpu_flash" in out and "| math      | math" in out and "64 tokens on cpu" in out
