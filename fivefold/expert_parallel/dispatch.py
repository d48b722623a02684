"""Expert parallelism's token exchange (docs/design.md#expert-parallelism): the experts of an MoE
layer are split over the ep group (rank r holds experts [r·E/ep, (r+1)·E/ep)); each rank routes its
own tokens, sends every (token, expert) row to the rank holding the expert, and gets the outputs
back in the order it sent them.

Per layer and forward: one all-to-all of the E per-expert row counts (so every rank knows what it
will receive), the dispatch all-to-all of the rows (uneven splits), the experts on what arrived
(grouped by expert across the sources), and the combine all-to-all back. Backward is the mirror:
each all-to-all's gradient travels the reverse way (`_AllToAll`). Payload per rank: dispatch = its
k·T rows (including the ones for its own experts: the whole input buffer is counted), combine = the
rows it received; summed over the group both equal k·T·D. The split sizes and the received group
sizes are read on the host in one `.tolist()` of one small tensor (this rank's E counts and the E it
receives): one sync per layer and forward, none more in backward or a full recompute
(`ops.host_values`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fivefold import ops
from fivefold.distributed.comm import Comm, eager_region

__all__ = ["AllToAllExperts", "GlobalBalance", "all_to_all"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        comm: Comm,
        out_splits: list[int],
        in_splits: list[int],  # type: ignore[override]
        tag: str,
        backward_comm: Comm,
    ) -> torch.Tensor:
        ctx.comm, ctx.out_splits, ctx.in_splits, ctx.tag = backward_comm, out_splits, in_splits, tag
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), out_splits, in_splits, tag=tag)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        ctx.comm.all_to_all(
            back, grad.contiguous(), ctx.in_splits, ctx.out_splits, tag=ctx.tag + "_bwd"
        )
        return back, None, None, None, None, None


def all_to_all(
    x: torch.Tensor,
    comm: Comm,
    out_splits: list[int],
    in_splits: list[int],
    tag: str,
    backward_comm: Comm | None = None,
) -> torch.Tensor:
    """Rows of `x` split as `in_splits` go to each rank; `out_splits` rows arrive from each.
    Differentiable: the gradient goes back over ``backward_comm`` (default `comm`; the same ranks on
    another process group)."""
    return _AllToAll.apply(x, comm, out_splits, in_splits, tag, backward_comm or comm)


class AllToAllExperts:
    """The `MoEFeedForward.exchange` under expert parallelism over `comm` (the layer keeps only its
    experts). ``backward_comm``: the same ep ranks on a second process group, for the backward's
    all-to-alls, so a forward and a backward running side by side (DualPipeV's units) never
    interleave their calls on one group."""

    def __init__(self, comm: Comm, n_experts: int, backward_comm: Comm | None = None) -> None:
        if n_experts % comm.size:
            raise ValueError(f"moe.experts={n_experts} is not divisible by ep={comm.size}")
        self.comm = comm
        self.backward_comm = backward_comm or comm
        self.per_rank = n_experts // comm.size

    @eager_region
    def __call__(
        self,
        run: Callable[[torch.Tensor, list[int], torch.Tensor, int], torch.Tensor],
        tokens: torch.Tensor,
        counts: torch.Tensor,
    ) -> torch.Tensor:
        """`tokens` sorted by global expert id (rows past ``counts.sum()``: dropped, never sent),
        `counts` [E] rows per expert -> the experts' outputs for the sent rows, same order.
        ``run(grouped rows, group sizes, the same sizes on the device, first expert id)`` applies
        this rank's experts (the layer's)."""
        ep, per_rank, n = self.comm.size, self.per_rank, counts.numel()
        received = torch.empty_like(counts)
        self.comm.all_to_all(received, counts.contiguous(), tag="ep_counts")
        # The one host sync: what this rank sends per expert and receives per (source, expert).
        both = ops.host_values(torch.cat([counts, received]).tolist)
        sent_h, received_h = both[:n], both[n:]
        send_splits = [sum(sent_h[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
        recv_splits = [sum(received_h[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
        sizes = [sum(received_h[r * per_rank + e] for r in range(ep)) for e in range(per_rank)]
        arrived = all_to_all(
            tokens[: sum(send_splits)],
            self.comm,
            recv_splits,
            send_splits,
            "ep_dispatch",
            self.backward_comm,
        )
        # Arrived rows are source-major (each source's rows sorted by local expert): regroup
        # expert-major.
        segment = torch.repeat_interleave(
            torch.arange(ep * per_rank, device=tokens.device), received, output_size=sum(sizes)
        )
        order = ((segment % per_rank) * ep + segment // per_rank).argsort(stable=True)
        local = received.view(ep, per_rank).sum(dim=0)
        out = run(arrived[order], sizes, local, self.comm.rank * per_rank)
        return all_to_all(
            out[order.argsort()],
            self.comm,
            send_splits,
            recv_splits,
            "ep_combine",
            self.backward_comm,
        )


class GlobalBalance:
    """The `MoEFeedForward.balance` under data parallelism: routing counts and token totals summed
    over `comm` (dp × cp), so the load-balancing loss is the one of the global micro-batch, as in
    single-process training."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    @eager_region
    def __call__(
        self, counts: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        both = torch.cat([counts, tokens.reshape(1)])
        self.comm.all_reduce(both, tag="moe_balance")
        return both[:-1], both[-1], self.comm.size
