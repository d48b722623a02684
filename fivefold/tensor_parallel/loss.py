"""Vocabulary-parallel cross-entropy (seed 003 §7): the full logits never exist on one rank. Three all-reduces of one
value per token (max, sum of exponentials, the target's logit from its owner); backward is local."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.comm import Comm


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, comm: Comm):  # type: ignore[override]
        logits = logits.float()
        vocab_local = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        comm.all_reduce(row_max, op=dist.ReduceOp.MAX, tag="vocab_ce")
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        comm.all_reduce(sum_exp, tag="vocab_ce")
        local_target = target - vocab_start
        owned = (local_target >= 0) & (local_target < vocab_local)
        index = local_target.clamp(0, vocab_local - 1)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * owned
        comm.all_reduce(target_logit, tag="vocab_ce")
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), index, owned)
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        softmax, index, owned = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, index.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, comm: Comm,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of targets (global ids) except `ignore_index`; logits [..., V/T]: rows from `vocab_start`."""
    logits = logits.reshape(-1, logits.shape[-1])
    target = target.reshape(-1)
    keep = target != ignore_index
    losses = _VocabParallelCE.apply(logits, target.masked_fill(~keep, 0), vocab_start, comm)
    return (losses * keep).sum() / keep.sum().clamp(min=1)


@dataclass
class VocabParallelLoss:
    """Mean next-token cross-entropy on vocab-parallel logits [B, L, V/T] (this rank's rows from `vocab_start`)."""

    comm: Comm
    vocab_start: int

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, self.vocab_start, self.comm)
