"""Next-token cross-entropy over the full vocabulary without a full-size fp32 copy of the logits.

Low-precision logits [N, V] (bf16/fp16) are read in row chunks: each chunk is upcast to fp32 for its log-sum-exp
and, in backward, for its softmax, so the extra memory is one chunk (``chunk_rows × V × 4`` bytes) instead of
``N × V × 4`` (≈ 4 GB per micro-batch for a 128k vocabulary at 8k tokens). Only the per-row log-sum-exp is saved.
fp32 logits go straight to `F.cross_entropy` (nothing to copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_ROWS", "lm_cross_entropy"]

CHUNK_ROWS = 2048


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, chunk_rows: int):  # type: ignore[override]
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        picked = logits.gather(1, target.unsqueeze(1)).squeeze(1).float()
        for start in range(0, logits.shape[0], chunk_rows):
            lse[start:start + chunk_rows] = torch.logsumexp(logits[start:start + chunk_rows].float(), dim=1)
        ctx.save_for_backward(logits, target, lse)
        ctx.chunk_rows = chunk_rows
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        logits, target, lse = ctx.saved_tensors
        scale = grad_loss.float() / logits.shape[0]
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            rows = slice(start, start + ctx.chunk_rows)
            g = (logits[rows].float() - lse[rows].unsqueeze(1)).exp_()  # softmax of the chunk, in fp32
            g.scatter_add_(1, target[rows].unsqueeze(1), torch.full_like(lse[rows], -1.0).unsqueeze(1))
            grad[rows] = g.mul_(scale)
        return grad, None, None


def lm_cross_entropy(logits: torch.Tensor, target: torch.Tensor, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """Mean cross-entropy of logits [..., V] against target ids [...], computed in fp32."""
    logits, target = logits.flatten(0, -2), target.flatten()
    if logits.dtype == torch.float32:
        return F.cross_entropy(logits, target)
    return _ChunkedCrossEntropy.apply(logits, target, chunk_rows)
