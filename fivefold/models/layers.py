"""Layers shared by the dense and the mixture-of-experts models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.ops import Linear

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))`` with w1 the gate, w3 the up, w2 the down projection."""

    def __init__(
        self,
        dim: int,
        hidden: int,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.w1 = Linear(dim, hidden, **kw)
        self.w3 = Linear(dim, hidden, **kw)
        self.w2 = Linear(hidden, dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
