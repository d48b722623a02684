"""Tests for fivefold.models.llama: shapes, parameter counts, determinism, causality, TP-readiness.

Against hand computations and the model itself: parameter counts from the shapes (and Llama 3 on
meta), seeded builds bit-equal, meta then materialise equal to a direct build, GQA equal to MHA with
repeated kv weights, attention head shards summing to full attention, a fresh loss uniform and a
tiny training overfitting. Single process: no process is started."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from tolerance import assert_values_close

from fivefold.models import PRESETS, LlamaConfig, build_model, count_params, get_config
from fivefold.models.llama import Attention, Llama, precompute_rope


def expected_params(c: LlamaConfig) -> int:
    """Parameter count from the shapes alone (independent of the module code)."""
    hd = c.head_dim
    attention = c.dim * hd * (2 * c.n_heads + 2 * c.n_kv_heads)  # wq, wo + wk, wv
    attention += {"off": 0, "qkv": hd * (c.n_heads + 2 * c.n_kv_heads)}.get(
        c.attention_bias, hd * (c.n_heads + 2 * c.n_kv_heads) + c.dim)  # biases (all: wo's too)
    attention += 2 * hd if c.qk_norm else 0  # q_norm, k_norm
    dense_ffn = 3 * c.dim * c.ffn_hidden
    ffn = [dense_ffn] * c.n_layers
    if c.moe is not None:  # MoE blocks: router + experts (+ shared experts), each a SwiGLU of the expert hidden size
        m = c.moe
        hidden = m.hidden or c.ffn_hidden
        shared = (m.shared_hidden or m.shared_experts * hidden) if m.shared_experts else 0
        moe_ffn = c.dim * m.experts + m.experts * 3 * c.dim * hidden + 3 * c.dim * shared
        moe_ffn += c.dim if m.shared_gate else 0
        ffn = [moe_ffn if i >= m.first_dense and i % m.every == m.every - 1 else dense_ffn
               for i in range(c.n_layers)]
    per_layer = attention + 2 * c.dim  # + two RMSNorm weights
    embeddings = c.vocab_size * c.dim * (1 if c.tie_embeddings else 2)
    return c.n_layers * per_layer + sum(ffn) + embeddings + c.dim  # + final norm


def tiny(**overrides: object) -> LlamaConfig:
    return get_config("tiny", **overrides)


@pytest.mark.parametrize("name", list(PRESETS))
def test_param_count_matches_shapes(name: str) -> None:
    model = build_model(PRESETS[name], device="meta")
    assert count_params(model) == expected_params(PRESETS[name])


@pytest.mark.parametrize(
    "name, low, high",
    [("tiny", 0.5e6, 2e6), ("small", 8e6, 20e6), ("medium", 50e6, 100e6)],
)
def test_small_presets_in_range(name: str, low: float, high: float) -> None:
    assert low <= expected_params(PRESETS[name]) <= high


@pytest.mark.parametrize(
    "name, exact, public",
    [
        ("llama3-8b", 8_030_261_248, 8.03e9),
        ("llama3-70b", 70_553_706_496, 70.55e9),
        ("llama3-405b", 405_853_388_800, 405.85e9),
        ("llama3.2-1b", 1_235_814_400, 1.24e9),
    ],
)
def test_llama3_param_counts_on_meta(name: str, exact: int, public: float) -> None:
    model = build_model(get_config(name), device="meta")
    assert all(p.is_meta for p in model.parameters())
    n = count_params(model)
    assert n == exact == expected_params(PRESETS[name])
    assert abs(n - public) / public < 0.01


def test_exclude_embeddings() -> None:
    c = tiny()
    model = build_model(c)
    assert count_params(model, exclude_embeddings=True) == count_params(model) - c.vocab_size * c.dim


def test_same_seed_bitwise_equal_and_independent_of_global_rng() -> None:
    torch.manual_seed(1)
    a = build_model(tiny(), seed=7)
    torch.manual_seed(2)
    state_before = torch.get_rng_state()
    b = build_model(tiny(), seed=7)
    assert torch.equal(torch.get_rng_state(), state_before), "construction must not consume the global RNG"
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k

    c = build_model(tiny(), seed=8)
    assert not torch.equal(sa["layers.0.attention.wq.weight"], c.state_dict()["layers.0.attention.wq.weight"])


def test_init_statistics() -> None:
    c = get_config("small")
    model = build_model(c)
    residual_std = 0.02 / math.sqrt(2 * c.n_layers)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.layers[0].feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.02)
    assert torch.equal(model.layers[0].attention_norm.weight, torch.ones(c.dim))
    assert "rope_cos" not in model.state_dict()  # derived from the config, not checkpointed


def test_meta_then_materialise_equals_direct_build() -> None:
    direct = build_model(tiny(), seed=3)
    lazy = build_model(tiny(), seed=3, device="meta")
    lazy.to_empty(device="cpu")
    lazy.init_weights(3)
    for (k, v), (k2, v2) in zip(direct.state_dict().items(), lazy.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2), k
    assert torch.equal(direct.rope_cos, lazy.rope_cos)


def test_forward_shape_and_dtype() -> None:
    c = tiny()
    model = build_model(c)
    tokens = torch.randint(0, c.vocab_size, (3, 17))
    logits = model(tokens)
    assert logits.shape == (3, 17, c.vocab_size) and logits.dtype == torch.float32

    bf16 = build_model(c, dtype=torch.bfloat16)
    out = bf16(tokens)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_causality_and_gqa(n_kv_heads: int) -> None:
    c = tiny(n_kv_heads=n_kv_heads)
    model = build_model(c, seed=1)
    assert model.layers[0].attention.n_kv_heads == n_kv_heads
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, c.vocab_size, (2, 32), generator=gen)
    t = 11
    changed = tokens.clone()
    changed[:, t + 1 :] = torch.randint(0, c.vocab_size, (2, 32 - t - 1), generator=gen)
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


def test_gqa_equals_mha_with_repeated_kv_weights() -> None:
    """A GQA model equals an MHA model whose kv heads are the GQA kv heads repeated per group."""
    gqa_cfg = tiny(n_kv_heads=2)
    gqa = build_model(gqa_cfg, seed=4)
    mha = build_model(dataclasses.replace(gqa_cfg, n_kv_heads=4), seed=0)
    sd = gqa.state_dict()
    hd = gqa_cfg.head_dim
    for k in list(sd):
        if k.endswith(("attention.wk.weight", "attention.wv.weight")):
            sd[k] = sd[k].view(2, hd, -1).repeat_interleave(2, dim=0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the same math; only the k/v projections are GEMMs of another width, which may block their 128-term sums
        # (dim) in another order (rule 1 of tests/tolerance.py)
        assert_values_close(gqa(tokens), mha(tokens), gqa_cfg.dim, "logits")


def test_tied_embeddings_share_storage_and_count_once() -> None:
    untied = build_model(tiny())
    tied = build_model(tiny(tie_embeddings=True))
    assert tied.output.weight is tied.tok_embeddings.weight
    assert tied.output.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1
    assert count_params(tied) == count_params(untied) - 256 * 128 == expected_params(tied.config)
    non_embedding = count_params(untied, exclude_embeddings=True) - 256 * 128
    assert count_params(tied, exclude_embeddings=True) == non_embedding
    out = tied(torch.randint(0, 256, (1, 8)))
    out.sum().backward()
    assert tied.tok_embeddings.weight.grad is not None


def test_too_long_sequence_raises() -> None:
    model = build_model(tiny(max_seq_len=16))
    model(torch.zeros(1, 16, dtype=torch.long))  # exactly max_seq_len is fine
    with pytest.raises(ValueError, match=r"17.*max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ({"n_heads": 6, "n_kv_heads": 4, "dim": 96}, r"n_heads=6 is not divisible by n_kv_heads=4"),
        ({"dim": 130}, r"dim=130 is not divisible by n_heads=4"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 1}, r"head_dim=3"),
        ({"n_layers": 0}, r"n_layers=0"),
        ({"rope_theta": -1.0}, r"rope_theta=-1.0"),
    ],
)
def test_invalid_configs_raise(overrides: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        get_config("tiny", **overrides)
    with pytest.raises(ValueError, match=pattern):
        Llama(dataclasses.replace(PRESETS["tiny"], **overrides))


def test_get_config_errors_and_overrides() -> None:
    with pytest.raises(ValueError, match=r"unknown model preset 'nope'.*tiny.*llama3-8b"):
        get_config("nope")
    with pytest.raises(ValueError, match=r"n_head"):
        get_config("tiny", n_head=4)
    c = get_config("small", max_seq_len=64)
    assert c.max_seq_len == 64 and PRESETS["small"].max_seq_len == 512  # presets are not mutated


def test_fresh_loss_is_uniform_and_training_overfits() -> None:
    c = tiny()
    model = build_model(c, seed=0)
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, c.vocab_size, (4, 65), generator=gen)
    inputs, targets = batch[:, :-1], batch[:, 1:]

    def loss_fn() -> torch.Tensor:
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, c.vocab_size), targets.reshape(-1))

    first = loss_fn()
    assert abs(first.item() - math.log(256)) < 0.1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert loss_fn().item() < first.item() - 0.5, losses


def test_attention_head_shards_sum_to_full_attention() -> None:
    """Slicing heads out of wq/wk/wv (rows) and wo (columns) needs no code change, and the
    per-shard outputs sum to the full output: exactly what column/row tensor parallelism does."""
    dim, n_heads, n_kv_heads, hd = 64, 4, 2, 16
    torch.manual_seed(0)
    full = Attention(dim, n_heads, n_kv_heads, hd)
    cos, sin = precompute_rope(hd, 32, 10000.0)
    x = torch.randn(2, 10, dim)
    cos, sin = cos[:10], sin[:10]
    with torch.no_grad():
        reference = full(x, cos, sin)
        total = torch.zeros_like(reference)
        shards = 2
        q_rows, kv_rows = n_heads * hd // shards, n_kv_heads * hd // shards
        for r in range(shards):
            part = Attention(dim, n_heads // shards, n_kv_heads // shards, hd)
            part.wq.weight.copy_(full.wq.weight[r * q_rows : (r + 1) * q_rows])
            part.wk.weight.copy_(full.wk.weight[r * kv_rows : (r + 1) * kv_rows])
            part.wv.weight.copy_(full.wv.weight[r * kv_rows : (r + 1) * kv_rows])
            part.wo.weight.copy_(full.wo.weight[:, r * q_rows : (r + 1) * q_rows])
            assert (part.n_heads, part.n_kv_heads) == (2, 1)
            total += part(x, cos, sin)
    assert_values_close(total, reference, n_heads * hd, "output")  # wo's 64-term inner sum, split in two shards

    # Head counts come from the projections' outputs, so swapping in a narrower Linear
    # (as a hand-written column-parallel layer would) also works without touching forward.
    with torch.no_grad():
        full.wq = torch.nn.Linear(dim, q_rows, bias=False)
        full.wk = torch.nn.Linear(dim, kv_rows, bias=False)
        full.wv = torch.nn.Linear(dim, kv_rows, bias=False)
        full.wo = torch.nn.Linear(q_rows, dim, bias=False)
        assert full(x, cos, sin).shape == reference.shape


def _saved_storages(run) -> dict[int, tuple[tuple[int, ...], int]]:
    """Every storage autograd saves while ``run()`` runs: data_ptr -> (a shape it was saved with, bytes)."""
    seen: dict[int, tuple[tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_sdpa_saves_kv_with_their_own_heads(dtype: torch.dtype) -> None:
    """The sdpa core hands GQA to the kernel (enable_gqa): what it saves for backward is q, k and v as
    given (k and v with H_kv heads, no H-head copies), its output and the log-sum-exp, byte for byte;
    its forward equals the repeated-K/V call bit for bit, its gradients to the rounding of dK/dV's
    group sum."""
    from fivefold.models.llama import causal_attention

    b, h, h_kv, seq, d = 2, 8, 2, 16, 8
    s = torch.finfo(dtype).bits // 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, seq, d, generator=g, dtype=dtype).requires_grad_() for n in (h, h_kv, h_kv))
    saved = _saved_storages(lambda: causal_attention(q, k, v))
    assert all(t.untyped_storage().data_ptr() in saved for t in (q, k, v))  # the inputs themselves
    assert sorted(shape for shape, _ in saved.values()) == sorted(
        [(b, h_kv, seq, d)] * 2 + [(b, h, seq, d)] * 2 + [(b, h, seq)])  # k, v; q, the output; the lse
    assert sum(n for _, n in saved.values()) == (2 * h + 2 * h_kv) * b * seq * d * s + b * h * seq * 4

    out = causal_attention(q, k, v)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    rep = (k.repeat_interleave(h // h_kv, 1), v.repeat_interleave(h // h_kv, 1))
    ref = F.scaled_dot_product_attention(q, *rep, is_causal=True)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    assert torch.equal(out, ref)
    for got, want, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert_values_close(got, want, h // h_kv * seq, name)  # dK/dV: the group's heads × positions summed


def test_gqa_block_keeps_what_the_activation_formula_says() -> None:
    """A GQA block's activations (fp32, sdpa, no recompute) equal `activation_bytes_per_block` exactly: q, k, v
    counted with their own heads."""
    from fivefold.formulas import MicroBatch, activation_bytes_per_block
    from fivefold.observe.memory import block_activation_bytes

    b, seq, dim, h, h_kv, ffn = 2, 32, 64, 4, 2, 96
    model = Llama(LlamaConfig(dim=dim, n_layers=2, n_heads=h, n_kv_heads=h_kv, ffn_hidden=ffn, max_seq_len=seq))
    x = torch.randint(0, 256, (b, seq), generator=torch.Generator().manual_seed(0))
    measured = block_activation_bytes(model.layers, lambda: model(x))
    assert measured == [activation_bytes_per_block(MicroBatch(b, seq, dim), h, h_kv, ffn)] * 2



def test_initial_values_on_the_cpu_are_the_seeded_cpu_stream() -> None:
    """On the CPU (the default device) `Llama.initial_value` is the stream of a CPU generator seeded by
    blake2b(seed:name), bit for bit: the values every layout and checkpoint reproduce. An accelerator draws with
    its own generator instead (not comparable here: no accelerator)."""
    import hashlib

    model = Llama(tiny(), device="meta")
    name, seed = "layers.1.attention.wo.weight", 5
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    scale = 0.02 / math.sqrt(2 * model.config.n_layers)
    want = torch.empty(model.full_shapes()[name]).normal_(0.0, scale, generator=gen)
    assert torch.equal(model.initial_value(name, seed), want)
    assert torch.equal(model.initial_value(name, seed, torch.device("cpu")), want)


def test_a_sliding_window_keeps_one_mask_for_all_layers():
    """SDPA keeps its mask for backward: with a window the saved tensors grow by one [L, L] mask in the compute
    dtype (`formulas.window_mask_bytes`), not one per layer, and a window covering the sequence costs nothing."""
    from fivefold.formulas import window_mask_bytes

    def saved_bytes(window):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        model = Llama(tiny(max_seq_len=512, sliding_window=window))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(torch.randint(0, 256, (1, 512))).sum()
        return sum(storages.values())

    plain = saved_bytes(None)
    assert saved_bytes(64) - plain == window_mask_bytes(512, 64, 4) == 512 * 512 * 4
    assert saved_bytes(512) == plain and window_mask_bytes(512, 512, 4) == 0
