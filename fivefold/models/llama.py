"""Llama-style decoder (GQA + RoPE, SwiGLU, RMSNorm) as plain single-process PyTorch: config,
presets, deterministic init, parameter count. The model families are options of this one model
(docs/design.md#model-families): attention biases (Qwen2), per-head q/k norms (Qwen3), a sliding
window (Mistral), partial rotary (GLM-4.5), and `MoEConfig`'s routers (Mixtral, Qwen-MoE,
DeepSeek-V3). No parallel code: the parallel wrappers address sub-modules by name
(``layers.3.attention.wq``), so the names are a public contract."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import AttentionBias, AttentionCore, ConfigError, Recompute, check_choice
from fivefold.materialize import materialize
from fivefold.models.layers import FeedForward
from fivefold.models.moe import MoEConfig, MoEFeedForward, share_aux_pool
from fivefold.models.recompute_policy import SavePlan, save_plan, selective_contexts
from fivefold.ops import Linear, recompute

if TYPE_CHECKING:
    from fivefold.models.documents import Documents
    from fivefold.models.kv_cache import KVCache, LayerCache

__all__ = [
    "ATTENTION_CORES",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "PRESETS",
    "RECOMPUTE_MODES",
    "MAX_PARAMS",
    "MODEL_LIMITS",
    "RMSNorm",
    "RopeScaling",
    "TransformerBlock",
    "WEIGHT_SIZES",
    "apply_rotary",
    "build_model",
    "causal_attention",
    "check_model_bounds",
    "count_params",
    "eager_attention",
    "get_config",
    "param_counts",
    "precompute_rope",
]


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3's RoPE frequency scaling (Hugging Face ``rope_scaling`` with ``rope_type`` "llama3"):
    wavelengths longer than original_max_position / low_freq_factor are stretched by ``factor``,
    shorter than original_max_position / high_freq_factor kept, those between interpolated."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        low_wavelen = self.original_max_position / self.low_freq_factor
        high_wavelen = self.original_max_position / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)


# The sizes the weights' shapes are made of (`param_counts`; with tie_embeddings and
# attention_head_dim, what a checkpoint must agree on: `train.checkpointing.SHAPE_FIELDS`)
WEIGHT_SIZES = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")


@dataclass
class LlamaConfig:
    """Shape of a Llama model. ``vocab_size`` defaults to 256 (byte-level tokens)."""

    vocab_size: int = 256  # rows of the embedding, outputs of the head
    dim: int = 128  # the model's width D
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads H
    n_kv_heads: int = 2  # key/value heads (GQA: n_heads / n_kv_heads query heads share one)
    ffn_hidden: int = 384  # the SwiGLU's hidden width F
    max_seq_len: int = 256  # the longest sequence: the RoPE tables' length
    rope_theta: float = 10000.0  # RoPE's base frequency
    norm_eps: float = 1e-5  # added to the mean square in RMSNorm
    tie_embeddings: bool = False  # the head uses the embedding's weight
    moe: MoEConfig | None = None  # mixture-of-experts feed-forward blocks (None: dense)
    # a head's width when it is not dim / n_heads (HF ``head_dim``)
    attention_head_dim: int | None = None
    rope_scaling: RopeScaling | None = None  # Llama-3 long-context RoPE scaling (None: plain RoPE)
    # Options the model families need (docs/design.md#model-families), all off for Llama:
    # biases on the attention's projections: off | qkv (Qwen2) | all (q, k, v and o: HF Llama's
    # attention_bias)
    attention_bias: AttentionBias = "off"
    qk_norm: bool = False  # RMSNorm over each head's queries and keys before RoPE (Qwen3)
    # each query reads at most this many keys, itself included (Mistral); None: the whole prefix
    sliding_window: int | None = None
    # channels of each head RoPE rotates (the first ones; GLM-4.5 rotates half); None: all
    rotary_dim: int | None = None

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The channels of a head RoPE rotates (the tables' width)."""
        return self.rotary_dim or self.head_dim

    def validate(self) -> LlamaConfig:
        """Raise ValueError naming the offending numbers; return self for chaining."""
        for name in (*WEIGHT_SIZES, "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.attention_head_dim is None and self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.attention_head_dim is not None and self.attention_head_dim <= 0:
            raise ValueError(f"attention_head_dim={self.attention_head_dim} must be positive")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:  # rotary embeddings rotate pairs of channels
            raise ValueError(
                f"head_dim={self.head_dim} (dim={self.dim} / n_heads={self.n_heads}) must be even"
            )
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0
        ):
            raise ValueError(
                f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]"
            )
        check_choice("attention_bias", self.attention_bias, AttentionBias)
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window={self.sliding_window!r} must be a positive number of keys "
                "(or unset: the whole prefix)"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be positive")
        if self.moe is not None:
            self.moe.validate()
        return self

    def is_moe_block(self, index: int) -> bool:
        """Block `index` has an MoE feed-forward (every `moe.every`-th block, the first at every -
        1, none of the first `moe.first_dense`)."""
        m = self.moe
        return m is not None and index >= m.first_dense and index % m.every == m.every - 1


# The small shapes (byte-level vocabulary), for tests, examples and the benchmarks' scaling table
# (docs/benchmarks.md: "small" is its ~10M, bench-* its larger sizes), with their parameter counts
_SMALL_COLUMNS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len", "moe")
_SMALL_SHAPES = {
    "tiny": (128, 4, 4, 2, 384, 256, None),  # ~0.85M
    "small": (384, 6, 6, 2, 1024, 512, None),  # ~9.6M
    "medium": (768, 12, 12, 4, 2048, 1024, None),  # ~76M
    "bench-40m": (640, 9, 10, 2, 1792, 512, None),  # ~40M
    "bench-120m": (1024, 11, 16, 4, 2816, 512, None),  # ~125M
    # Llama-MoE: 8 experts of hidden 256, top-2, in every block (~3.4M parameters)
    "tiny-moe": (128, 4, 4, 2, 256, 256, MoEConfig(experts=8, top_k=2)),
    "small-moe": (384, 6, 6, 2, 512, 512, MoEConfig(experts=8, top_k=2, every=2)),
}

# Published Llama-3 shapes (8K pre-training context, no rope scaling), for planning on the meta
# device.
_L3 = dict(vocab_size=128256, n_kv_heads=8, max_seq_len=8192, rope_theta=500000.0)
PRESETS: dict[str, LlamaConfig] = {
    **{name: LlamaConfig(**dict(zip(_SMALL_COLUMNS, row))) for name, row in _SMALL_SHAPES.items()},
    "llama3.2-1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, ffn_hidden=8192, tie_embeddings=True, **_L3
    ),  # 1.2B
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_hidden=14336, **_L3),  # 8.03B
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, ffn_hidden=28672, **_L3),  # 70.55B
    "llama3-405b": LlamaConfig(
        dim=16384, n_layers=126, n_heads=128, ffn_hidden=53248, **_L3
    ),  # 405.85B
    # DeepSeek-V3 (arXiv 2412.19437) with this file's blocks: 61 blocks of width 7168, the first 3
    # dense (hidden 18432), then 256 routed experts of hidden 2048 (top 8 of sigmoid scores,
    # renormalised, × 2.5) + 1 shared, node-limited routing (8 groups, a token's experts from the
    # best 4), the aux-loss-free expert bias, a 1e-4 balance loss (V3's is per sequence, this one
    # per batch), vocabulary 129280. Not V3 itself: GQA (56 heads of 128, 8 kv heads) instead of
    # MLA, no MTP. 666.7B parameters, ~37B active per token: for planning (`fivefold plan`).
    "deepseek-v3": LlamaConfig(
        vocab_size=129280,
        dim=7168,
        n_layers=61,
        n_heads=56,
        n_kv_heads=8,
        ffn_hidden=18432,
        max_seq_len=4096,
        norm_eps=1e-6,
        moe=MoEConfig(
            experts=256,
            top_k=8,
            score="sigmoid",
            shared_experts=1,
            hidden=2048,
            aux_loss_coef=1e-4,
            first_dense=3,
            groups=8,
            group_limit=4,
            routed_scaling=2.5,
            expert_bias=True,
        ),
    ),
    # Published shapes of the other families (their config.json on the Hugging Face hub), for
    # planning; `fivefold export` writes each as its own family.
    "qwen2.5-7b": LlamaConfig(  # 7.62B: q/k/v biases
        vocab_size=152064,
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_hidden=18944,
        max_seq_len=32768,
        rope_theta=1e6,
        norm_eps=1e-6,
        attention_bias="qkv",
    ),
    "qwen3-30b-a3b": LlamaConfig(  # 30.5B, 3.3B active: q/k norms, 128 experts of 768, top 8
        vocab_size=151936,
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        attention_head_dim=128,
        ffn_hidden=6144,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        qk_norm=True,
        # its recipe's loss: HF's router_aux_loss_coef under HF's pooled convention
        moe=MoEConfig(experts=128, top_k=8, hidden=768, aux_loss_coef=0.001, aux_convention="hf"),
    ),
    "mixtral-8x7b": LlamaConfig(  # 46.7B, 12.9B active: 8 experts of 14336, top 2
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=32768,
        rope_theta=1e6,
        moe=MoEConfig(experts=8, top_k=2, aux_loss_coef=0.02, aux_convention="hf"),
    ),
}
# Small versions of each family (byte vocabulary), for tests and examples: tiny's shape with the
# family's options
_TINY = dict(zip(_SMALL_COLUMNS[:-1], _SMALL_SHAPES["tiny"][:-1]))
_TINY_MOE = dict(zip(_SMALL_COLUMNS[:-1], _SMALL_SHAPES["tiny-moe"][:-1]))
PRESETS.update(
    {
        "tiny-qwen2": LlamaConfig(**_TINY, attention_bias="qkv"),
        "tiny-qwen3": LlamaConfig(**_TINY, qk_norm=True),
        "tiny-mistral": LlamaConfig(**_TINY, sliding_window=64),
        "tiny-mixtral": LlamaConfig(**_TINY_MOE, moe=MoEConfig(experts=8, top_k=2)),
        "tiny-qwen2-moe": LlamaConfig(
            **_TINY_MOE,
            attention_bias="qkv",
            moe=MoEConfig(
                experts=8,
                top_k=2,
                norm_topk=False,
                shared_experts=1,
                shared_hidden=384,
                shared_gate=True,
            ),
        ),
        "tiny-qwen3-moe": LlamaConfig(**_TINY_MOE, qk_norm=True, moe=MoEConfig(experts=8, top_k=2)),
        "tiny-deepseek-v3": LlamaConfig(
            **_TINY_MOE,
            moe=MoEConfig(
                experts=8,
                top_k=2,
                score="sigmoid",
                shared_experts=1,
                first_dense=1,
                groups=4,
                group_limit=2,
                routed_scaling=2.5,
                expert_bias=True,
                aux_loss_coef=0.0,
            ),
        ),
    }
)


def get_config(name: str, **overrides: object) -> LlamaConfig:
    """Return a validated copy of preset ``name`` with dataclass fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid names: {', '.join(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LlamaConfig field(s) {unknown}; valid fields: {sorted(fields)}")
    return dataclasses.replace(PRESETS[name], **overrides).validate()


class RMSNorm(nn.Module):
    def __init__(
        self,
        dim: int,
        eps: float = 1e-5,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: the mean of squares loses too much precision in bf16.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def precompute_rope(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [max_seq_len, head_dim]; channels i and i + head_dim/2 rotate at frequency
    theta^(-2i/head_dim) (with ``scaling``: Llama-3's rescaled frequencies)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    # Computed in fp64 then rounded once, so the tables are identical on every device.
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, L, hd] by position, rotate-half as HF / NeoX (Meta checkpoints need wq/wk
    rows permuted); tables narrower than hd rotate the first channels only (HF's partial rotary)."""
    if cos.shape[-1] < x.shape[-1]:  # partial rotary: the first channels turn, the rest pass
        width = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :width], cos, sin), x[..., width:]], dim=-1)
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


def window_mask(seq: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[seq, seq] bool, True where query i reads key j: j ≤ i and i − j < ``window`` (a sliding
    window of ``window`` keys, the query's own included: Mistral's, HF's ``sliding_window``)."""
    i = torch.arange(seq, device=device)
    offset = i[:, None] - i[None, :]
    return (offset >= 0) & (offset < window)


@functools.lru_cache(maxsize=8)
def window_bias(seq: int, window: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`window_mask` as SDPA's additive mask (0 where read, -inf elsewhere) in the attention's
    dtype, made once per (length, window, device, dtype) and shared by every layer: SDPA keeps its
    mask for backward, so one [L, L] tensor is kept, not one per layer (a bool mask would be
    converted, and kept, in every call)."""
    keep = window_mask(seq, window, device)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(keep, zero, torch.tensor(float("-inf"), dtype=dtype, device=device))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Documents | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The single-process attention core: q [B, H, L, d], k and v [B, H_kv, L, d] -> [B, H, L, d],
    causal; with ``documents`` each query reads only its own document's keys: causal SDPA on each
    document's slice (host-side spans; measured 3-6x faster on the CPU than SDPA with a dense
    [B, 1, L, L] mask, and compiled flex attention has no CPU backward: bench/documents.py). GQA
    goes to SDPA as it is (``enable_gqa``: q head h reads kv head h // (H / H_kv), as
    `repeat_interleave` would group them), so a fused kernel keeps k and v with their own H_kv
    heads for backward, not H-head copies (docs/design.md#activation-memory); a backend without a
    GQA kernel repeats them inside torch (its math path). The forward equals the repeated-K/V call
    bit for bit on the CPU; dK and dV sum the group's heads in another order (last-bit
    differences). ``window``: each query reads at most that many keys (`window_mask`, an explicit
    mask to SDPA; a window as long as the sequence is the plain causal call)."""
    gqa = k.shape[1] != q.shape[1]
    if documents is not None:
        _check_single_rank(documents)
        rows = [
            torch.cat(
                [
                    causal_attention(*(t[b : b + 1, :, s:e] for t in (q, k, v)), window=window)
                    for s, e in row
                ],
                2,
            )
            for b, row in enumerate(documents.spans)
        ]
        return torch.cat(rows, dim=0)
    if window is not None and window < q.shape[2]:
        mask = window_bias(q.shape[2], window, q.device, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def _check_single_rank(documents: Documents) -> None:
    if documents.layout is not None:
        raise ValueError(
            "documents made for context parallel (find_documents with a layout) reached a "
            "single-rank attention core: make them with layout=None, or apply context parallel"
        )


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Documents | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """The same attention written out: softmax(q kᵀ / √d + causal mask) v (with ``documents``: the
    documents' mask, causal within each document). Its backward keeps the
    [B, H, L, L] probabilities, the quadratic term of the activation formula
    (docs/design.md#activation-memory) that a fused kernel avoids and selective recompute drops; for
    kernels without a fused path, and to measure that term. ``window``: as `causal_attention`'s."""
    n_heads, n_kv_heads, seq = q.shape[1], k.shape[1], q.shape[2]
    if n_kv_heads != n_heads:
        k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
        v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if documents is not None:
        _check_single_rank(documents)
        hidden = ~documents.mask
    else:
        hidden = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    if window is not None and window < seq:
        hidden = hidden | ~window_mask(seq, window, q.device)
    return scores.masked_fill(hidden, float("-inf")).softmax(dim=-1) @ v


# model.attention (`config.AttentionCore`): which core computes attention (context parallelism
# replaces either with ring attention)
ATTENTION_CORES = {"sdpa": causal_attention, "eager": eager_attention}
assert tuple(ATTENTION_CORES) == typing.get_args(AttentionCore)
# train.recompute (`config.Recompute`): none | full (each block keeps only its input) | selective
# (the attention core is recomputed) | selective-op (the block keeps the outputs of the ops its save
# set names, `recompute_policy`)
RECOMPUTE_MODES = typing.get_args(Recompute)


class Attention(nn.Module):
    """Causal GQA. Head counts come from the projections at forward time, so a TP rank holding some
    heads runs this code; q head h uses kv head h // (n_heads / n_kv_heads), so contiguous shards of
    wq and wk/wv line up. ``core`` (q, k, v -> out, k and v with their own heads) is
    `causal_attention`; context parallelism swaps in ring attention. With ``documents`` (packed
    rows, `fivefold.models.documents`) the core is called ``core(q, k, v, documents)`` and cos / sin
    are already each token's rows [B, 1, L, hd] (in-document positions). With ``cache``
    (decoding, `fivefold.models.kv_cache`) the tokens sit after those cached: their RoPE rows are
    offset by the cache's length, and the cache keeps k, v and attends."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        bias: AttentionBias = "off",
        qk_norm: bool = False,
        norm_eps: float = 1e-5,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim if head_dim is not None else dim // n_heads
        kw = {"device": device, "dtype": dtype}
        qkv_bias = bias != "off"
        self.wq = Linear(dim, n_heads * self.head_dim, bias=qkv_bias, **kw)
        self.wk = Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias, **kw)
        self.wv = Linear(dim, n_kv_heads * self.head_dim, bias=qkv_bias, **kw)
        self.wo = Linear(n_heads * self.head_dim, dim, bias=bias == "all", **kw)
        # Qwen3: one RMSNorm weight per channel of a head, shared by every head of q (and of k)
        self.q_norm = RMSNorm(self.head_dim, norm_eps, **kw) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps, **kw) if qk_norm else None
        self.window = window
        self.core = causal_attention
        # selective recompute: keep q, k, v only; the core runs again in backward
        self.recompute_core = False

    @property
    def n_heads(self) -> int:  # local heads when sharded
        return self.wq.weight.shape[0] // self.head_dim

    @property
    def n_kv_heads(self) -> int:
        return self.wk.weight.shape[0] // self.head_dim

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        n_heads, n_kv_heads = q.shape[1], k.shape[1]
        if n_heads % n_kv_heads != 0:
            raise ValueError(
                f"local n_heads={n_heads} is not divisible by local n_kv_heads={n_kv_heads}"
            )
        if documents is None:
            start = 0 if cache is None else cache.length  # positions before these tokens
            end = start + seq
            if end > cos.shape[0]:
                raise ValueError(f"sequence length {end} exceeds max_seq_len={cos.shape[0]}")
            # Row i of the tables is the position of token i (0..seq-1, after a cache's; under SP
            # x was gathered already; under CP the tables hold this rank's positions).
            cos, sin = cos[start:end], sin[start:end]
        elif cache is not None:
            raise ValueError("a KV cache decodes one sequence: no packed documents")
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        # A core with collectives of its own (Ulysses' all-to-alls) recomputes only its inside
        inside = getattr(self.core, "recompute_inside", None) if self.recompute_core else None
        core = inside or self.core
        core = core if self.window is None else functools.partial(core, window=self.window)
        if cache is not None:
            out = cache.attend(q, k, v, core, self.window)
        else:
            args = (q, k, v) if documents is None else (q, k, v, documents)
            again = self.recompute_core and inside is None
            out = recompute(core, *args) if again else core(*args)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, n_heads * self.head_dim))


class TransformerBlock(nn.Module):
    def __init__(
        self,
        config: LlamaConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        index: int = 0,
    ) -> None:
        super().__init__()
        c = config
        self.attention_norm = RMSNorm(c.dim, c.norm_eps, device=device, dtype=dtype)
        self.attention = Attention(
            c.dim,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            device=device,
            dtype=dtype,
            bias=c.attention_bias,
            qk_norm=c.qk_norm,
            norm_eps=c.norm_eps,
            window=c.sliding_window,
        )
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps, device=device, dtype=dtype)
        self.feed_forward = (
            MoEFeedForward(c.dim, c.ffn_hidden, c.moe, device=device, dtype=dtype)
            if c.is_moe_block(index)
            else FeedForward(c.dim, c.ffn_hidden, device=device, dtype=dtype)
        )
        # full recompute: keep only the block's input; all of it runs again in backward
        self.recompute_all = False
        # selective-op: the save set whose op outputs the block keeps (the rest runs again)
        self.recompute_saves: SavePlan | None = None
        self.compiled = False  # `compile_body`: run the torch.compile'd `_forward`

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """x [B, L, D] -> [B, L, D]; ``documents``: attention inside each document (`Attention`);
        ``cache``: decoding (eager, nothing recomputed: no backward follows)."""
        if cache is not None:
            return self._feed_forward_half(self._attention_half(x, cos, sin, cache=cache))
        if self.compiled and documents is not None:
            raise NotImplementedError(
                "train.compile with packed documents: the sdpa core slices each document by its "
                "host-side boundaries, which a compiled graph would specialise on (a recompile per "
                "micro-batch); run the blocks eagerly (train.compile false)"
            )
        body = self._compiled_forward if self.compiled else self._forward
        if (
            self.recompute_all
        ):  # inside the block's own forward: ZeRO-3's unit hooks stay outside the recomputation
            return recompute(body, x, cos, sin, documents)
        if self.recompute_saves is not None:
            contexts = functools.partial(selective_contexts, self.recompute_saves)
            return recompute(body, x, cos, sin, documents, selective=contexts)
        return body(x, cos, sin) if documents is None else body(x, cos, sin, documents)

    def compile_body(self) -> None:
        """Compile the block's computation (`_forward`), not the module call: ``nn.Module.compile``
        would trace `_call_impl` with the hooks others put on the block (ZeRO-3's gather/free, the
        step tracer), which stay eager here, as do `forward`'s recompute wrapper and whatever runs
        between blocks (pipeline sends, the head's loss). Lazy: the first call compiles (torch's
        inductor; C++ on the CPU), the blocks share the graph (their parameters are its inputs). An
        MoE block compiles its attention half only: routing sizes the experts' inputs by the data
        (dynamo cannot trace it), so the MoE feed-forward stays eager."""
        from fivefold.distributed.comm import eager_regions_on

        if not eager_regions_on():  # else dynamo would trace into the collectives and the CommLog
            raise RuntimeError(
                "compile_body: call fivefold.distributed.comm.compile_eager_regions() first "
                "(parallelize does): the collectives inside a block must run eagerly"
            )
        self.compiled = True

    def _compiled_forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        # The unbound methods, compiled once per process and given `self`: a copied block runs its
        # own parameters.
        if isinstance(self.feed_forward, MoEFeedForward):
            half = _compiled_method("_attention_half")(self, x, cos, sin, documents)
            return self._feed_forward_half(half)
        return _compiled_method("_forward")(self, x, cos, sin, documents)

    def _forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        return self._feed_forward_half(self._attention_half(x, cos, sin, documents))

    def _attention_half(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        h = self.attention_norm(x)
        if cache is not None:
            return x + self.attention(h, cos, sin, cache=cache)
        # (without documents the module call is the plain one: hooks that others put on attention,
        # such as torch's PrepareModuleInput, see the arguments they were written for)
        if documents is None:
            return x + self.attention(h, cos, sin)
        return x + self.attention(h, cos, sin, documents)

    def _feed_forward_half(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.feed_forward(self.ffn_norm(h))

    def set_recompute(self, mode: str, save: str = "matmuls-every-other") -> None:
        """`RECOMPUTE_MODES`: none, full (the whole block), selective (the attention core) or
        selective-op (the ops ``save`` names are kept: `recompute_policy.save_plan`)."""
        check_choice("recompute", mode, Recompute)  # (train.recompute: refused when read)
        self.recompute_all = mode == "full"
        self.attention.recompute_core = mode == "selective"
        self.recompute_saves = save_plan(save) if mode == "selective-op" else None


_COMPILED_METHODS: dict[str, Callable[..., torch.Tensor]] = {}


def _compiled_method(name: str) -> Callable[..., torch.Tensor]:
    """``torch.compile(TransformerBlock.<name>)``, made once per process (every block shares its
    graphs)."""
    if name not in _COMPILED_METHODS:
        _COMPILED_METHODS[name] = torch.compile(getattr(TransformerBlock, name))
    return _COMPILED_METHODS[name]


class Blocks(nn.ModuleDict):
    """Blocks keyed "0", "1", ... so a pipeline stage keeps single-process names
    (``layers.5.attention.wq.weight``)."""

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key))

    def __delitem__(self, key: int | str) -> None:
        super().__delitem__(str(key))

    def __iter__(self):  # noqa: ANN204 - the blocks, as a ModuleList would (keys(): their names)
        return iter(self.values())


class Llama(nn.Module):
    """Llama decoder. Never touches the global RNG: built on meta, allocated on ``device``, filled
    by ``init_weights(seed)``; with ``device="meta"`` or ``seed=None`` call `materialize` and
    ``init_weights`` later."""

    def __init__(
        self,
        config: LlamaConfig,
        seed: int | None = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config.validate()
        self.config = config
        device = torch.device(device) if device is not None else torch.get_default_device()
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        meta = torch.device("meta")
        c = config
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim, device=meta, dtype=dtype)
        self.layers = Blocks(
            {
                str(i): TransformerBlock(c, device=meta, dtype=dtype, index=i)
                for i in range(c.n_layers)
            }
        )
        self.norm = RMSNorm(c.dim, c.norm_eps, device=meta, dtype=dtype)
        self.output = Linear(c.dim, c.vocab_size, bias=False, device=meta, dtype=dtype)
        share_aux_pool(self)  # moe.aux_convention hf: one loss over all the MoE layers
        # One fp32 table for all layers whatever the dtype (far positions need it); derived, so not
        # persistent.
        table_shape = (c.max_seq_len, c.rope_dim)
        self.register_buffer("rope_cos", torch.empty(table_shape, device=meta), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape, device=meta), persistent=False)
        if device.type != "meta":
            materialize(self, device)
        # Tie after allocation so both names share one Parameter (yielded once by parameters()).
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # every parameter's whole-model shape, kept through stage cuts and TP sharding
        # (`full_shapes`)
        self._full_shapes = {n: tuple(p.shape) for n, p in self.named_parameters()}
        if device.type != "meta" and seed is not None:
            self.init_weights(seed)

    @property
    def fsdp_units(self) -> list[str]:
        """Non-block ZeRO-3 units (weights used only in their own forward); a tied pair is used
        twice, so none."""
        if self.config.tie_embeddings:
            return []
        return [name for name in ("tok_embeddings", "output") if getattr(self, name) is not None]

    def set_recompute(self, mode: str, save: str = "matmuls-every-other") -> Llama:
        """Activation recompute in every block (`RECOMPUTE_MODES`; ``save``: selective-op's save
        set, `train.recompute_save`); returns self."""
        for block in self.layers.values() if self.layers is not None else ():
            block.set_recompute(mode, save)
        return self

    def compile_blocks(self) -> Llama:
        """torch.compile each block's computation (`TransformerBlock.compile_body`); returns
        self."""
        for block in self.layers.values() if self.layers is not None else ():
            block.compile_body()
        return self

    def set_attention(self, core: str) -> Llama:
        """The attention core of every block (`ATTENTION_CORES`); returns self."""
        check_choice("attention", core, AttentionCore)  # (model.attention: refused when read)
        for block in self.layers.values() if self.layers is not None else ():
            block.attention.core = ATTENTION_CORES[core]
        return self

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter of the *whole* model with its full shape (this copy may be a stage or a
        TP slice)."""
        return (
            self._full_shapes
        )  # recorded when the whole model was built; stages and TP slices are copies

    def initial_value(
        self, name: str, seed: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The seeded initial value of parameter `name`, full shape, fp32, on ``device``: normal(0,
        0.02), residual outputs (wo, w2) × 1/sqrt(2·n_layers) (GPT-2), norms 1, biases 0. Each
        parameter draws from its own generator, seeded by (seed, name), so a rank draws only what it
        holds (its stages), in any order, which is what lets it materialise only its share
        (`ZeroDataParallel(init_value=)`). The generator is ``device``'s: on the CPU (the default)
        the values are bitwise identical on any process; on an accelerator they are that device
        type's generator's (CUDA: Philox), drawn in parallel there instead of on one CPU thread —
        the same on every rank and run on the same kind of device, not the CPU's values."""
        shape = self.full_shapes()[name]
        if name.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.float32, device=device)
        if name.endswith(".bias"):  # the attention's biases start at zero (as HF's init)
            return torch.zeros(shape, dtype=torch.float32, device=device)
        scale = 0.02
        if name.endswith(
            ("attention.wo.weight", "w2.weight")
        ):  # residual outputs (dense, expert, shared)
            scale /= math.sqrt(2 * self.config.n_layers)
        digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
        gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)
        return torch.empty(shape, dtype=torch.float32, device=device).normal_(
            0.0, scale, generator=gen
        )

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every materialised parameter gets its `initial_value` drawn on the parameter's device
        (rounded to its dtype), then the buffers theirs (`init_buffers`)."""
        for name, param in self.named_parameters():
            if param.device.type != "meta":
                param.copy_(self.initial_value(name, seed, param.device))
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The RoPE tables (derived from the config, not checkpointed), computed in fp32 on the
        CPU; the MoE layers' (their expert bias: zeros)."""
        for m in self.modules():
            if isinstance(m, MoEFeedForward):
                m.init_buffers()
        if self.rope_cos.device.type != "meta":
            cos, sin = precompute_rope(
                self.config.rope_dim,
                self.config.max_seq_len,
                self.config.rope_theta,
                scaling=self.config.rope_scaling,
            )
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(
        self,
        x: torch.Tensor,
        documents: Documents | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens [B, L] -> logits [B, L, vocab]. A pipeline stage (`keep_only`) without
        ``tok_embeddings`` takes the hidden state [B, L, D]; without ``norm``/``output`` it returns
        it. ``documents`` (`fivefold.models.documents.find_documents` of these rows): attention
        stays inside each document and RoPE positions restart at 0 at each document's start.
        ``cache`` (`fivefold.models.kv_cache.KVCache`, decoding): the tokens follow those it
        holds, and each block's keys and values are added to it."""
        if cache is not None and documents is not None:
            raise ValueError("a KV cache decodes one sequence: no packed documents")
        if self.tok_embeddings is not None:
            length = x.shape[1] + (cache.length if cache is not None else 0)
            if length > self.config.max_seq_len:
                raise ValueError(
                    f"sequence length {length} exceeds max_seq_len={self.config.max_seq_len}"
                )
            x = self.tok_embeddings(x)
        cos, sin = self.rope_cos, self.rope_sin
        if documents is not None:
            cos, sin = self._document_rope(documents)
        for name, layer in self.layers.items() if self.layers is not None else ():
            if cache is not None:
                x = layer(x, cos, sin, cache=cache.layer(name))
            else:
                x = layer(x, cos, sin) if documents is None else layer(x, cos, sin, documents)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x

    def _document_rope(self, documents: Documents) -> tuple[torch.Tensor, torch.Tensor]:
        """Each local token's RoPE rows [B, 1, L_local, hd], read at its in-document position from
        the whole tables (context parallel cuts ``rope_cos`` / ``rope_sin`` to this rank's rows and
        keeps the whole ones as ``rope_cos_whole`` / ``rope_sin_whole``)."""
        rows = documents.positions
        if documents.layout is not None and not hasattr(self, "rope_cos_whole"):
            raise ValueError(
                "packed documents under context parallel need the whole RoPE tables: apply "
                "context parallel with whole_tables=True (parallelize does for data.documents mask)"
            )
        tables = (getattr(self, f"{n}_whole", getattr(self, n)) for n in ("rope_cos", "rope_sin"))
        return tuple(t[rows].unsqueeze(1) for t in tables)


def build_model(
    config: LlamaConfig,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Llama:
    """Build and initialise a Llama; on ``device="meta"`` nothing is allocated or initialised."""
    return Llama(config, seed=seed, device=device, dtype=dtype)


def param_counts(config: LlamaConfig) -> tuple[int, int]:
    """(parameters, parameters one token goes through — embeddings excluded, they are a lookup;
    top_k of an MoE layer's experts): the N of `formulas.model_flops_per_token`'s 6·N. Counted from
    the shapes `Llama` gives its parameters (`full_shapes`), by arithmetic: no module is built, so a
    700B or a 10,000-block shape costs nothing (`tests/test_fits.py` holds it to the meta model's
    count)."""
    c = config
    d, hd = c.dim, c.head_dim
    attention = 2 * d * c.n_heads * hd + 2 * d * c.n_kv_heads * hd  # wq and wo; wk and wv
    if c.attention_bias != "off":
        attention += (c.n_heads + 2 * c.n_kv_heads) * hd + (d if c.attention_bias == "all" else 0)
    attention += 2 * hd if c.qk_norm else 0  # q_norm, k_norm
    block = attention + 2 * d  # + attention_norm, ffn_norm
    dense_ffn = 3 * d * c.ffn_hidden  # SwiGLU: w1, w3, w2
    n_moe = 0  # blocks every - 1, 2·every - 1, ... from first_dense on (is_moe_block)
    if c.moe is not None:
        first = max(c.moe.first_dense, c.moe.every - 1)
        first += (c.moe.every - 1 - first) % c.moe.every
        n_moe = max(0, (c.n_layers - 1 - first) // c.moe.every + 1) if first < c.n_layers else 0
    embedding = c.vocab_size * d
    total = (
        embedding + c.n_layers * block + (c.n_layers - n_moe) * dense_ffn + d
    )  # + the final norm
    total += (
        0 if c.tie_embeddings else embedding
    )  # the head (tied: the embedding's tensor, counted once)
    active = (
        total - embedding + (embedding if c.tie_embeddings else 0)
    )  # the head's matmul uses a tied tensor too
    if c.moe is not None:
        expert = 3 * d * (c.moe.hidden or c.ffn_hidden)  # one expert's SwiGLU
        router = d * c.moe.experts
        # one SwiGLU of shared_hidden (default shared_experts × hidden), every token through it,
        # and its gate (Qwen2-MoE)
        shared_hidden = getattr(c.moe, "shared_hidden", None)
        shared = (
            3 * d * shared_hidden
            if shared_hidden and c.moe.shared_experts
            else expert * c.moe.shared_experts
        ) + (d if getattr(c.moe, "shared_gate", False) else 0)
        total += n_moe * (router + c.moe.experts * expert + shared)
        # a token goes through top_k of the experts (E experts × top_k / E: an integer, no float sum
        # to round)
        active += n_moe * (router + c.moe.top_k * expert + shared)
    return total, active


# Limits on a model's shape, checked before anything is built (`check_model_bounds`). Each lies far
# above every published model (so none is refused) and far below what would make the model's
# construction or the memory check's arithmetic hang: a value beyond one is a typo or a damaged
# config.json, not a model to train.
MODEL_LIMITS: dict[str, tuple[int, str]] = {
    "vocab_size": (2**24, "64× the largest published vocabulary (Gemma 3's 262,144)"),
    "dim": (
        2**20,
        "40× the widest published model (Megatron-LM's 1T configuration: 25,600; Llama-3.1-405B: "
        "16,384)",
    ),
    "n_layers": (
        10_000,
        "10× the deepest trained transformer (DeepNet's 1,000 layers; Llama-3.1-405B: 126)",
    ),
    "n_heads": (
        2**16,
        "400× the most heads published (Megatron-LM's 1T configuration: 160; Llama-3.1-405B: 128)",
    ),
    "n_kv_heads": (2**16, "as n_heads"),
    "ffn_hidden": (2**22, "57× the widest published feed-forward (PaLM-540B's 73,728)"),
    "max_seq_len": (
        2**24,
        "4× the longest Llama-architecture context published (Llama-3-8B-Gradient-4194k's "
        "4,194,304; Llama-4-Scout: 10,485,760)",
    ),
    "attention_head_dim": (2**16, "256× the widest published head (Gemma's 256)"),
    "moe.experts": (
        2**14,
        "32× the most routed experts published (Qwen3-Next's 512; DeepSeek-V3: 256)",
    ),
    "moe.hidden": (2**22, "as ffn_hidden"),
    "moe.shared_experts": (2**14, "as moe.experts"),
}
MAX_PARAMS = 2**50  # 1.1e15: ~700× the largest published (Switch-C's 1.6T; Kimi-K2's 1.0T)


def check_model_bounds(config: LlamaConfig, names: dict[str, str] | None = None) -> None:
    """Raise `ConfigError` (one line) if a size of `config` exceeds `MODEL_LIMITS` or its parameters
    `MAX_PARAMS`: before any module is built, so a typo (``--model.n_layers 100000``) or an absurd
    config.json is refused at once instead of hanging in construction. ``names``: how the caller
    spells a field (config.json's keys), default ``model.<field>``. Only sizes:
    `LlamaConfig.validate` checks the rest."""
    names = names or {}
    values = {f: getattr(config, f) for f in MODEL_LIMITS if not f.startswith("moe.")}
    if config.moe is not None:
        values.update(
            {f"moe.{f}": getattr(config.moe, f) for f in ("experts", "hidden", "shared_experts")}
        )
    for field, value in values.items():
        limit, why = MODEL_LIMITS[field]
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            raise ConfigError(
                f"{names.get(field, 'model.' + field)}={value:,} exceeds {limit:,}, {why}: a typo? "
                "(this limit guards against sizes no machine could train)"
            )
    if all(isinstance(v, int) and v > 0 for v in (getattr(config, f) for f in WEIGHT_SIZES)):
        total = param_counts(config)[0]
        if total > MAX_PARAMS:
            raise ConfigError(
                f"the model has {total:.2e} parameters, more than {MAX_PARAMS:.1e} (~700× the "
                "largest published, Switch-C's 1.6e12): a typo in its sizes?"
            )


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Unique parameters (tied ones once); ``exclude_embeddings`` drops nn.Embedding weights (a tied
    head's too)."""
    excluded: set[int] = set()
    if exclude_embeddings:
        excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return sum(p.numel() for p in model.parameters() if id(p) not in excluded)
