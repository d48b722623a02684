"""Llama-style decoder-only transformer, written as plain single-process PyTorch.

This module owns the model definition (config, presets, layers), its deterministic
initialisation and parameter counting. It contains no parallel code on purpose: the
data/tensor/pipeline/context parallel wrappers elsewhere in ``fivefold`` address the
sub-modules by attribute name (``layers.3.attention.wq`` ...), so those names are part
of the public contract and must not change.

Architecture: token embedding -> ``n_layers`` x [pre-norm grouped-query attention with
rotary position embeddings, pre-norm SwiGLU feed-forward] -> RMSNorm -> output
projection. Biases are absent everywhere, as in Llama.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.ops import Linear

__all__ = [
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "PRESETS",
    "RMSNorm",
    "TransformerBlock",
    "apply_rotary",
    "build_model",
    "count_params",
    "get_config",
    "precompute_rope",
]


@dataclass
class LlamaConfig:
    """Shape of a Llama model. ``vocab_size`` defaults to 256 (byte-level tokens)."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 384
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def validate(self) -> LlamaConfig:
        """Raise ValueError naming the offending numbers; return self for chaining."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2 != 0:
            # Rotary embeddings rotate pairs of channels.
            raise ValueError(
                f"head_dim={self.head_dim} (dim={self.dim} / n_heads={self.n_heads}) must be even"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta={self.rope_theta} must be positive")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps} must be positive")
        return self


# Llama-3 shapes are the published ones (rope scaling of 3.1/3.2 long-context variants
# is not modelled; max_seq_len is the 8K pre-training context). They are meant for
# planning on the meta device, not for training here.
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384, max_seq_len=256
    ),  # ~0.85M
    "small": LlamaConfig(
        dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_hidden=1024, max_seq_len=512
    ),  # ~9.6M
    "medium": LlamaConfig(
        dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2048, max_seq_len=1024
    ),  # ~76M
    "llama3.2-1b": LlamaConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=True,
    ),  # 1.236B
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),  # 8.03B
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),  # 70.55B
    "llama3-405b": LlamaConfig(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden=53248,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),  # 405.85B
}


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
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape [max_seq_len, head_dim] (fp32) for the rotate-half form.

    Channel i and channel i + head_dim/2 form a rotated pair with frequency
    theta^(-2i/head_dim); each table holds the per-pair angle twice (once per half).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    # Computed in fp64 then rounded once, so the tables are identical on every device.
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, H, L, head_dim] by position; ``cos``/``sin`` are [L, head_dim].

    Rotate-half convention (as Hugging Face / GPT-NeoX), not Meta's interleaved pairs:
    loading Meta checkpoints requires the usual permutation of wq/wk rows.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query self-attention.

    Head counts are read from the projection outputs at forward time, never stored, so
    a tensor-parallel rank holding only some rows of wq/wk/wv (and the matching columns
    of wo) runs this same code on its local heads. Query heads are grouped onto kv
    heads contiguously (q head h uses kv head h // (n_heads / n_kv_heads)), so a
    contiguous column shard of wq lines up with a contiguous shard of wk/wv.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim if head_dim is not None else dim // n_heads
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.wq = Linear(dim, n_heads * self.head_dim, **kw)
        self.wk = Linear(dim, n_kv_heads * self.head_dim, **kw)
        self.wv = Linear(dim, n_kv_heads * self.head_dim, **kw)
        self.wo = Linear(n_heads * self.head_dim, dim, **kw)

    @property
    def n_heads(self) -> int:
        """Query heads held by this module (local heads when sharded)."""
        return self.wq.weight.shape[0] // self.head_dim

    @property
    def n_kv_heads(self) -> int:
        return self.wk.weight.shape[0] // self.head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, L, D]; cos, sin: the model's whole RoPE tables (the first L positions are used)."""
        batch, seq, _ = x.shape
        # [B, L, H*hd] -> [B, H, L, hd]; H comes from the tensor, see class docstring.
        q = self.wq(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        n_heads, n_kv_heads = q.shape[1], k.shape[1]
        if n_heads % n_kv_heads != 0:
            raise ValueError(f"local n_heads={n_heads} is not divisible by local n_kv_heads={n_kv_heads}")
        if seq > cos.shape[0]:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len={cos.shape[0]}")
        # Positions 0..seq-1 of the whole sequence: under sequence parallelism x was gathered already.
        cos, sin = cos[:seq], sin[:seq]
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        if n_kv_heads != n_heads:
            # Explicit expansion rather than SDPA's enable_gqa: same grouping on every
            # backend and torch version, and it makes the head grouping visible.
            k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
            v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))`` with w1 the gate, w3 the up, w2 the down projection."""

    def __init__(
        self, dim: int, hidden: int, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.w1 = Linear(dim, hidden, **kw)
        self.w3 = Linear(dim, hidden, **kw)
        self.w2 = Linear(hidden, dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(
        self, config: LlamaConfig, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        c = config
        self.attention_norm = RMSNorm(c.dim, c.norm_eps, device=device, dtype=dtype)
        self.attention = Attention(c.dim, c.n_heads, c.n_kv_heads, c.head_dim, device=device, dtype=dtype)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps, device=device, dtype=dtype)
        self.feed_forward = FeedForward(c.dim, c.ffn_hidden, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Blocks(nn.ModuleDict):
    """The transformer blocks keyed by their index ("0", "1", ...), so a pipeline stage holding some
    of them keeps their single-process names (``layers.5.attention.wq.weight``). ``blocks[5]`` works."""

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key))

    def __delitem__(self, key: int | str) -> None:
        super().__delitem__(str(key))


class Llama(nn.Module):
    """Llama decoder. ``forward(tokens [B, L]) -> logits [B, L, vocab]`` in the model dtype.

    Construction never touches the global RNG: modules are created on the meta device,
    storage is allocated on ``device`` and ``init_weights(seed)`` fills it from a local
    generator. With ``device="meta"`` (or ``seed=None``) no initialisation happens;
    call ``to_empty(device=...)`` then ``init_weights(seed)`` later.
    """

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
        self.layers = Blocks({str(i): TransformerBlock(c, device=meta, dtype=dtype) for i in range(c.n_layers)})
        self.norm = RMSNorm(c.dim, c.norm_eps, device=meta, dtype=dtype)
        self.output = Linear(c.dim, c.vocab_size, bias=False, device=meta, dtype=dtype)
        # One table for all layers. fp32 regardless of the model dtype (positions near
        # max_seq_len need the precision); non-persistent: derived from the config.
        table_shape = (c.max_seq_len, c.head_dim)
        self.register_buffer("rope_cos", torch.empty(table_shape, device=meta), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table_shape, device=meta), persistent=False)
        if device.type != "meta":
            self.to_empty(device=device)
        # Tie after allocation so both names end up on one Parameter object (and
        # named_parameters() / parameters() yield it once).
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        if device.type != "meta" and seed is not None:
            self.init_weights(seed)

    @property
    def fsdp_units(self) -> list[str]:
        """Modules besides the blocks whose weights are used only through their own forward, so that a
        sharded engine may gather them just around it (ZeRO-3 units); a tied pair is used twice."""
        if self.config.tie_embeddings:
            return []
        return [name for name in ("tok_embeddings", "output") if getattr(self, name) is not None]

    def parameters_in_init_order(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter in the fixed order ``init_weights`` draws them (tied ones
        once), from the config alone: a pipeline stage that holds only some modules draws, and
        discards, the values of the others, so every parameter gets its single-process value.
        Spelled out instead of relying on registration order."""
        c = self.config
        q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        order: list[tuple[str, tuple[int, ...]]] = [("tok_embeddings.weight", (c.vocab_size, c.dim))]
        for i in range(c.n_layers):
            p = f"layers.{i}."
            order += [
                (p + "attention_norm.weight", (c.dim,)),
                (p + "attention.wq.weight", (q, c.dim)),
                (p + "attention.wk.weight", (kv, c.dim)),
                (p + "attention.wv.weight", (kv, c.dim)),
                (p + "attention.wo.weight", (c.dim, q)),
                (p + "ffn_norm.weight", (c.dim,)),
                (p + "feed_forward.w1.weight", (c.ffn_hidden, c.dim)),
                (p + "feed_forward.w3.weight", (c.ffn_hidden, c.dim)),
                (p + "feed_forward.w2.weight", (c.dim, c.ffn_hidden)),
            ]
        order.append(("norm.weight", (c.dim,)))
        if not c.tie_embeddings:
            order.append(("output.weight", (c.vocab_size, c.dim)))
        return order

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministically (re)initialise all parameters and the RoPE tables.

        normal(0, 0.02) for embeddings and linears; residual-branch outputs (wo, w2)
        additionally scaled by 1/sqrt(2 * n_layers) so the residual stream's variance
        does not grow with depth (GPT-2); norm weights = 1. Values are drawn on CPU in
        fp32 from a private generator and copied in, so they are bitwise identical for
        any process, device and (before rounding) dtype.
        """
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        present = dict(self.named_parameters())
        for name, shape in self.parameters_in_init_order():
            param = present.get(name)
            if name.endswith("norm.weight"):
                if param is not None and param.device.type != "meta":
                    param.fill_(1.0)
                continue
            scale = residual_std if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) else std
            values = torch.empty(shape, dtype=torch.float32).normal_(0.0, scale, generator=gen)
            # Absent (another pipeline stage's) or meta parameters still draw their values, so every
            # materialised parameter gets exactly its single-process value.
            if param is not None and param.device.type != "meta":
                param.copy_(values)
        if self.rope_cos.device.type != "meta":
            cos, sin = precompute_rope(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens [B, L] -> logits [B, L, vocab]. A pipeline stage is this model with some modules
        removed (`pipeline.split.keep_only`): without ``tok_embeddings`` x is the hidden state
        [B, L, D] from the previous stage, and without ``norm``/``output`` the hidden state is
        returned."""
        if self.tok_embeddings is not None:
            if x.shape[1] > self.config.max_seq_len:
                raise ValueError(f"sequence length {x.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x


def build_model(
    config: LlamaConfig, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> Llama:
    """Build and initialise a Llama; on ``device="meta"`` nothing is allocated or initialised."""
    return Llama(config, seed=seed, device=device, dtype=dtype)


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of unique parameters (a tied weight counts once).

    ``exclude_embeddings`` drops the weights of ``nn.Embedding`` modules (the token
    lookup table). With tied embeddings that shared matrix is dropped too.
    """
    excluded: set[int] = set()
    if exclude_embeddings:
        excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    # parameters() already deduplicates by identity, which covers tying.
    return sum(p.numel() for p in model.parameters() if id(p) not in excluded)
