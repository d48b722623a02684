"""The conjugate communication operators of TP and SP (Megatron,
docs/design.md#tensor-and-sequence-parallelism), each backward its partner's forward. Per block TP
costs 4 all-reduces of B·L·D (2 g forward, 2 f backward); SP replaces each with an all-gather and a
reduce-scatter of the same volume."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fivefold.distributed.comm import Comm, eager_region

SEQ_DIM = 1  # activations are [batch, sequence, hidden]


def _gather_seq(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    # all_gather_into_tensor concatenates along dim 0: put the sequence first.
    local = x.transpose(0, SEQ_DIM).contiguous()
    out = torch.empty(
        (local.shape[0] * comm.size, *local.shape[1:]), dtype=x.dtype, device=x.device
    )
    comm.all_gather(out, local, tag=tag)
    # Contiguous: the column-parallel layers that share this input then save one copy for backward.
    return out.transpose(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, comm: Comm, tag: str) -> torch.Tensor:
    full = x.transpose(0, SEQ_DIM).contiguous()
    if full.shape[0] % comm.size:
        raise ValueError(
            f"sequence parallel: sequence length {full.shape[0]} is not divisible by "
            f"tp={comm.size}; use a sequence length that is a multiple of {comm.size}"
        )
    out = torch.empty((full.shape[0] // comm.size, *full.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, full, tag=tag)
    return out.transpose(0, SEQ_DIM)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        ctx.comm.all_reduce(grad, tag="tp_f")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous()
        comm.all_reduce(x, tag="tp_g")
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


# `_gather_seq` or `_reduce_scatter_seq`
_SequenceOp = Callable[[torch.Tensor, Comm, str], torch.Tensor]


class _SequenceConjugate(torch.autograd.Function):
    """SP's conjugate pair: ``forward_op`` (all-gather or reduce-scatter along the sequence, tagged
    ``tag``) forward, the other one (tagged ``tag``_bwd) on the gradient backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        comm: Comm,
        forward_op: _SequenceOp,
        backward_op: _SequenceOp,
        tag: str,
    ) -> torch.Tensor:
        ctx.comm, ctx.backward_op, ctx.tag = comm, backward_op, tag
        return forward_op(x, comm, tag)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.backward_op(grad, ctx.comm, f"{ctx.tag}_bwd"), None, None, None, None


def all_reduce_grad_hook(comm: Comm, tag: str):
    """A tensor hook summing a replicated parameter's gradient over TP: under SP each rank's is a
    partial sum."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        comm.all_reduce(grad, tag=tag)
        return grad

    return hook


@eager_region
def copy_to_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward (entry of a column-parallel
    region)."""
    return _CopyToTP.apply(x, comm)


@eager_region
def reduce_from_tp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """g: all-reduce forward, identity backward (exit of a row-parallel region)."""
    return _ReduceFromTP.apply(x, comm)


@eager_region
def gather_from_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """SP entry: [B, L/T, D] -> [B, L, D] by all-gather; backward reduce-scatters."""
    return _SequenceConjugate.apply(x, comm, _gather_seq, _reduce_scatter_seq, "sp_gather")


@eager_region
def scatter_to_sp(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """SP exit: partial sums [B, L, D] -> this rank's reduced [B, L/T, D]; backward all-gathers."""
    return _SequenceConjugate.apply(x, comm, _reduce_scatter_seq, _gather_seq, "sp_scatter")
