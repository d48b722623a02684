"""Ulysses context parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses) and the ring × Ulysses
hybrid (Fang & Zhao 2024, USP): docs/design.md#context-parallelism, "Ulysses and the hybrid".

A rank holds L/C tokens of every head. Before attention one all-to-all over the Ulysses group of U
ranks turns q, k and v from [B, H, L/C, d] (all heads, this rank's tokens) into
[B, H/U, U·L/C, d] (H/U heads, the group's tokens); attention runs on those heads with any core —
the model's own (document spans and sliding windows included) when U = C, ring
attention over the R = C/U ring ranks in the hybrid; a second all-to-all turns the output back.
The pair is two autograd functions, each the other's backward (`to_heads`, `to_sequence`). q, k and
v travel in one message per peer (one all-to-all, not three).

Heads: U must divide this rank's query heads (after tp, H/T). Its kv heads (H_kv/T) are split the
same way when U divides them; when there are fewer kv heads than U and they divide U, each is
repeated U·T/H_kv times before the all-to-all (every rank receives the one kv head its query heads
read) and the copies' gradients are summed back by autograd; any other count is refused before a
worker starts (`fivefold.rules`).

Per rank and layer, with S = L/C local tokens, h = H/T and h_kv' = H_kv/T (or U when repeated),
each all-to-all keeps 1/U of its message and sends the rest: forward (h + 2·h_kv')·B·S·d for q, k, v
and h·B·S·d for the output; backward the same two (`formulas.ulysses_all_to_all_elements`). With
selective recompute only the inner attention runs again (`UlyssesAttention.recompute_inside`): the
all-to-alls are not repeated.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fivefold.distributed.comm import Comm, eager_region
from fivefold.ops import recompute

__all__ = ["UlyssesAttention", "kv_repeats", "to_heads", "to_sequence"]


def kv_repeats(n_heads: int, n_kv_heads: int, ulysses: int) -> int:
    """How many times each of this rank's ``n_kv_heads`` goes into the all-to-all over ``ulysses``
    ranks: 1 when U divides them, U / H_kv when they divide U (each rank gets the one its query
    heads read). Raises ValueError for any other count (and for query heads U does not divide)."""
    if n_heads % ulysses:
        raise ValueError(
            f"Ulysses over {ulysses} ranks splits the query heads: {n_heads} (per tp rank) is not "
            f"divisible by {ulysses}"
        )
    if n_kv_heads % ulysses == 0:
        return 1
    if ulysses % n_kv_heads == 0:
        return ulysses // n_kv_heads
    raise ValueError(
        f"Ulysses over {ulysses} ranks: {n_kv_heads} kv heads (per tp rank) neither divide into "
        f"{ulysses} groups nor divide {ulysses} (to be repeated)"
    )


def _exchange(comm: Comm, pieces: Sequence[torch.Tensor], tag: str) -> list[torch.Tensor]:
    """One all-to-all of several tensors [U, ...] (row u for rank u), packed along dim 2 (their
    head dim) into one message per peer; the received rows (row u from rank u), unpacked."""
    sizes = [p.shape[2] for p in pieces]
    send = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0].contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, tag=tag)
    return list(recv.split(sizes, dim=2))


def _heads(comm: Comm, tensors: Sequence[torch.Tensor], tag: str) -> list[torch.Tensor]:
    """[B, h, S, d] each (all heads, this rank's S tokens) -> [B, h/U, U·S, d] (head group u of
    every rank's tokens, in rank order)."""
    u = comm.size
    pieces = []
    for x in tensors:
        b, h, s, d = x.shape
        pieces.append(x.reshape(b, u, h // u, s, d).transpose(0, 1))
    out = []
    for y in _exchange(comm, pieces, tag):
        _, b, h, s, d = y.shape
        out.append(y.permute(1, 2, 0, 3, 4).reshape(b, h, u * s, d))
    return out


def _sequence(comm: Comm, tensors: Sequence[torch.Tensor], tag: str) -> list[torch.Tensor]:
    """The inverse of `_heads`: [B, h, U·S, d] -> [B, U·h, S, d]."""
    u = comm.size
    pieces = []
    for x in tensors:
        b, h, us, d = x.shape
        pieces.append(x.reshape(b, h, u, us // u, d).permute(2, 0, 1, 3, 4))
    out = []
    for y in _exchange(comm, pieces, tag):
        _, b, h, s, d = y.shape
        out.append(y.transpose(0, 1).reshape(b, u * h, s, d))
    return out


_DIRECTIONS = {"heads": (_heads, _sequence), "sequence": (_sequence, _heads)}


class _AllToAll(torch.autograd.Function):
    """One of the pair (``direction``: "heads" or "sequence"); its backward is the other's forward
    on the gradients (tag + "_grad")."""

    @staticmethod
    def forward(ctx, comm: Comm, tag: str, direction: str, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.comm, ctx.tag, ctx.direction = comm, tag, direction
        return tuple(_DIRECTIONS[direction][0](comm, tensors, tag))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        back = _DIRECTIONS[ctx.direction][1]
        return None, None, None, *back(ctx.comm, grads, ctx.tag + "_grad")


@eager_region
def to_heads(comm: Comm, *tensors: torch.Tensor, tag: str = "cp_heads") -> tuple[torch.Tensor, ...]:
    """Sequence-split [B, h, S, d] tensors -> head-split [B, h/U, U·S, d] over `comm` (U ranks),
    in one all-to-all; its backward is `to_sequence`'s forward."""
    return _AllToAll.apply(comm, tag, "heads", *tensors)


@eager_region
def to_sequence(
    comm: Comm, *tensors: torch.Tensor, tag: str = "cp_sequence"
) -> tuple[torch.Tensor, ...]:
    """Head-split [B, h, U·S, d] tensors -> sequence-split [B, U·h, S, d] over `comm`: the inverse
    of `to_heads` (and its backward)."""
    return _AllToAll.apply(comm, tag, "sequence", *tensors)


@dataclass
class UlyssesAttention:
    """An attention core (q, k, v -> out) for `Attention.core`: the all-to-all over `comm` (the
    Ulysses group), then ``inner`` on the group's whole tokens for this rank's heads, then the
    all-to-all back. ``inner``: the model's core (pure Ulysses) or a `RingAttention` over the ring
    group (the hybrid); with documents it gets ``documents.gathered`` (`find_documents`)."""

    comm: Comm
    inner: Any  # core(q, k, v[, documents][, window=]) on the gathered tokens
    seq_len: int  # the whole sequence (RoPE tables were cut for it)
    local_len: int  # this rank's tokens (seq_len / cp)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: Any = None,
        window: int | None = None,
    ) -> torch.Tensor:
        return self._attend(q, k, v, documents, window, again=False)

    def recompute_inside(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: Any = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """The same, with only the inner attention recomputed in backward (selective recompute):
        the all-to-alls run once."""
        return self._attend(q, k, v, documents, window, again=True)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: Any,
        window: int | None,
        again: bool,
    ) -> torch.Tensor:
        if q.shape[2] != self.local_len:
            raise ValueError(
                f"context parallel was set up for sequences of {self.seq_len} tokens ("
                f"{self.local_len} per rank, each rank's RoPE positions); this rank got "
                f"{q.shape[2]}: use the configured train.seq_len"
            )
        repeats = kv_repeats(q.shape[1], k.shape[1], self.comm.size)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        qh, kh, vh = to_heads(self.comm, q, k, v)
        args: tuple[Any, ...] = (qh, kh, vh)
        if documents is not None:
            args = (*args, documents.gathered)
        inner = self.inner if window is None else functools.partial(self.inner, window=window)
        out = recompute(inner, *args) if again else inner(*args)
        (out,) = to_sequence(self.comm, out)
        return out
