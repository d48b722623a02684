"""Next-token cross-entropy over the full vocabulary, without an fp32 copy of the logits: the
vocabulary-parallel loss with the whole vocabulary on one rank (`tensor_parallel.loss`, one
implementation). Logits of any dtype are read in row chunks upcast to fp32, so the extra memory is
one chunk, not ``N × V × 4`` bytes (≈ 4 GB per micro-batch for a 128k vocabulary at 8k tokens); only
a log-sum-exp per row is saved for backward."""

from __future__ import annotations

import torch

from fivefold.tensor_parallel.loss import row_mean_cross_entropy

__all__ = ["lm_cross_entropy"]


def lm_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, chunk_rows: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy of logits [..., V] against target ids [...], computed in fp32; a target
    -100 is not predicted and counts 0 in the mean over all rows (`row_mean_cross_entropy`)."""
    return row_mean_cross_entropy(logits, target, chunk_rows=chunk_rows)
