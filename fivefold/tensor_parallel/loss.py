"""Cross-entropy over a vocabulary split across the tp group
(docs/design.md#tensor-and-sequence-parallelism), and the single-process loss as its T = 1 case
(`models.loss`): one implementation.

The full logits never exist on one rank, and no fp32 copy of this rank's [N, V/T] logits is made
either: rows are read in chunks of about `CHUNK_ELEMENTS`, each upcast to fp32 for its max, sum of
exponentials and (in backward) its softmax. Saved for backward: the logits as given (alive anyway)
and one log-sum-exp per row. Three all-reduces of one value per token (the max, the sum of
exponentials, the target's logit from the rank that owns it); backward is local.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.distributed.comm import Comm

__all__ = [
    "CHUNK_ELEMENTS",
    "VocabParallelLoss",
    "cross_entropy_per_row",
    "row_mean_cross_entropy",
    "vocab_parallel_cross_entropy",
]

CHUNK_ELEMENTS = 2**24  # fp32 elements per chunk: 64 MiB, about 130 rows of a 128k vocabulary


def _chunks(n_rows: int, chunk_rows: int):
    return (slice(start, start + chunk_rows) for start in range(0, n_rows, chunk_rows))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start: int,  # type: ignore[override]
        comm: Comm | None,
        chunk_rows: int,
    ) -> torch.Tensor:
        n, vocab_local = logits.shape
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < vocab_local)
        index = local_target.clamp(0, vocab_local - 1).unsqueeze(1)
        row_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        for rows in _chunks(n, chunk_rows):  # the max is exact in any dtype
            row_max[rows] = logits[rows].amax(dim=1).float()
        if comm is not None:
            comm.all_reduce(row_max, op=dist.ReduceOp.MAX, tag="vocab_ce")
        sum_exp = torch.empty_like(row_max)
        for rows in _chunks(n, chunk_rows):
            sum_exp[rows] = (logits[rows].float() - row_max[rows].unsqueeze(1)).exp_().sum(dim=1)
        if comm is not None:
            comm.all_reduce(sum_exp, tag="vocab_ce")
        picked = logits.gather(1, index).squeeze(1).float() * owned
        if comm is not None:
            comm.all_reduce(picked, tag="vocab_ce")
        lse = sum_exp.log_().add_(row_max)
        ctx.save_for_backward(logits, index, owned, lse)
        ctx.chunk_rows = chunk_rows
        return lse - picked

    @staticmethod
    def backward(ctx, grad_rows: torch.Tensor):  # type: ignore[override]
        logits, index, owned, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        minus_one = -owned.to(torch.float32).unsqueeze(1)
        for rows in _chunks(logits.shape[0], ctx.chunk_rows):
            g = (
                logits[rows].float() - lse[rows].unsqueeze(1)
            ).exp_()  # this chunk's softmax, in fp32
            g.scatter_add_(1, index[rows], minus_one[rows])
            grad[rows] = g.mul_(grad_rows[rows].unsqueeze(1))
        return grad, None, None, None, None


def cross_entropy_per_row(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int = 0,
    comm: Comm | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """fp32 cross-entropy of each row of logits [N, V_local] (vocabulary ids [vocab_start,
    vocab_start + V_local) of the whole, the rest on the other ranks of `comm`; None: all of it
    here) against global target ids [N]."""
    chunk_rows = chunk_rows or max(1, CHUNK_ELEMENTS // logits.shape[1])
    return _ChunkedCrossEntropy.apply(logits, target, vocab_start, comm, chunk_rows)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int,
    comm: Comm,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of targets (global ids) except `ignore_index`; logits [..., V/T]: rows
    from `vocab_start`."""
    logits = logits.reshape(-1, logits.shape[-1])
    target = target.reshape(-1)
    keep = target != ignore_index
    losses = cross_entropy_per_row(
        logits, target.masked_fill(~keep, 0), vocab_start, comm, chunk_rows
    )
    return (losses * keep).sum() / keep.sum().clamp(min=1)


def row_mean_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start: int = 0,
    comm: Comm | None = None,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """The training loss: the sum of cross-entropies over the targets but `ignore_index`, divided
    by ALL rows (an ignored target counts 0). Every micro-batch and rank then divides by the same
    number, so the trainer's one weight per step (rows / targets counted, over the global batch)
    makes it the global mean over counted targets in every layout
    (docs/data.md#the-loss-across-documents)."""
    logits = logits.reshape(-1, logits.shape[-1])
    target = target.reshape(-1)
    keep = target != ignore_index
    losses = cross_entropy_per_row(
        logits, target.masked_fill(~keep, 0), vocab_start, comm, chunk_rows
    )
    return (losses * keep).sum() / target.numel()


@dataclass
class VocabParallelLoss:
    """Next-token cross-entropy on vocab-parallel logits [B, L, V/T] (this rank's rows from
    `vocab_start`), as `row_mean_cross_entropy`."""

    comm: Comm
    vocab_start: int

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return row_mean_cross_entropy(logits, target, self.vocab_start, self.comm)
