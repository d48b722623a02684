"""The key/value cache decoding reads (`fivefold.use.generate`): each block's keys and values
(after the q/k norms and RoPE) kept as tokens come, so a new token's forward computes its own
projections only and attends over the kept ones. `Llama.forward(x, cache=...)` hands every block
its `LayerCache`; the attention offsets its RoPE rows by the tokens already cached and lets the
cache attend (`LayerCache.attend`). Single process, no gradient: the training path never builds
one, and its forward is unchanged (no cache: the code path of before, bit for bit)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["KVCache", "LayerCache", "cached_attention"]


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int | None = None,
) -> torch.Tensor:
    """q [B, H, S, d] at positions start .. start + S - 1 over the keys and values [B, H_kv, T, d]
    at positions 0 .. T - 1 (T = start + S): query i reads key j when j ≤ i and, with ``window``,
    i − j < window (`llama.window_mask`'s rule, Mistral's). One new token (S = 1) reads every
    key in its window: no mask."""
    seq, keys = q.shape[2], k.shape[2]
    first = 0 if window is None else max(0, start + 1 - window)  # the first query's oldest key
    k, v = k[:, :, first:], v[:, :, first:]
    gqa = k.shape[1] != q.shape[1]
    if seq == 1:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    i = torch.arange(start, start + seq, device=q.device)[:, None]
    j = torch.arange(first, keys, device=q.device)[None, :]
    visible = j <= i
    if window is not None:
        visible &= i - j < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=gqa)


class LayerCache:
    """One block's keys and values, in buffers of ``capacity`` positions allocated at the first
    append (the batch, heads, width and dtype of the first keys)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0  # positions cached
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep k, v [B, H_kv, S, d]; return every cached position's [B, H_kv, length, d]."""
        seq = k.shape[2]
        if self.length + seq > self.capacity:
            raise ValueError(
                f"the cache holds {self.capacity} positions (max_seq_len): "
                f"{self.length} + {seq} do not fit"
            )
        if self._k is None:
            shape = (*k.shape[:2], self.capacity, k.shape[3])
            self._k = k.new_empty(shape)
            self._v = v.new_empty((*v.shape[:2], self.capacity, v.shape[3]))
        end = self.length + seq
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self.length = end
        return self._k[:, :, :end], self._v[:, :, :end]

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        core: Callable[..., torch.Tensor],
        window: int | None,
    ) -> torch.Tensor:
        """Cache this step's k, v and attend q over everything cached. The prefill (nothing cached
        yet) runs the attention's own ``core`` (the training path's causal kernel, window bound
        in), so its outputs are the full forward's; later steps `cached_attention`."""
        start = self.length
        keys, values = self.append(k, v)
        if start == 0:
            return core(q, k, v)
        return cached_attention(q, keys, values, start, window)


class KVCache:
    """Every block's `LayerCache`, by block name ("0", "1", ...), made on first use."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> LayerCache:
        if name not in self.layers:
            self.layers[name] = LayerCache(self.capacity)
        return self.layers[name]

    @property
    def length(self) -> int:
        """Positions cached (every block caches the same ones)."""
        return next(iter(self.layers.values())).length if self.layers else 0
