"""Ring attention (Liu et al. 2024; docs/design.md#context-parallelism): attention over a sequence
split across the cp group.

Each rank keeps its queries; the keys and values travel around the ring (rank r sends to r+1,
receives from r-1), the next transfer in flight while the current block is computed, C-1 transfers
in all. Blocks of (query chunk, key chunk) are merged with the online-softmax rule — running output
and log-sum-exp — so no L×L score matrix exists, only one chunk×chunk block at a time. Causal: a key
chunk after the query chunk is skipped, the diagonal block masked. GQA: keys and values travel with
their own (fewer) heads, never the expanded copies. Each block is computed by a block kernel
(`fivefold.context_parallel.kernels`: torch's fused SDPA ops with their log-sum-exp on CPU and
CUDA, portable fp32 math elsewhere or when asked; `choose_kernel`) — the same merge and the same
ring whichever runs.

Packed documents (`fivefold.models.documents.Documents`): the host-side block plan the documents
carry (``chunk_kinds``, decided on the CPU before the step) replaces the causal rule — a block with
no shared document is skipped, one inside a single document for every row runs the kernel above
(unmasked, or causal on the diagonal), and the rest run `kernels.MASKED` with the documents' block
mask. The ring and its messages are the same; the keys' documents come from the whole-row document
index, never from a message. A query row no key of a block may read has lse = -inf there, and the
merge takes -inf with -inf to zero weight (no nan).

Backward is blockwise from the saved output and log-sum-exp (FlashAttention's rule, no forward
recomputation beyond each block's scores): keys and values go around the ring again, and each kv
shard's gradient accumulator travels with it, every rank adding its part; after C steps it arrives
back at the owner (C transfers). Per rank and step a transfer is 2·B·(L/C)·H_kv·d elements: ≈
2·L·D/C·(C-1) per direction over a forward, the textbook volume scaled by H_kv/H for GQA
(`formulas.ring_attention_p2p_elements`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fivefold.context_parallel import kernels
from fivefold.context_parallel.kernels import KERNELS, choose_kernel
from fivefold.context_parallel.layout import SequenceLayout
from fivefold.distributed.comm import Comm, eager_region
from fivefold.models.documents import CAUSAL, FULL, MASKED, SKIP, Documents

__all__ = ["KERNELS", "RingAttention", "choose_kernel", "ring_attention"]


def _mode(q_chunk: int, k_chunk: int, causal: bool) -> str | None:
    """How query chunk `q_chunk` attends to key chunk `k_chunk`: all of it, causally (same chunk),
    or not at all."""
    if not causal or k_chunk < q_chunk:
        return "full"
    return "diag" if k_chunk == q_chunk else None


def _blocks(
    rank: int,
    src: int,
    layout: SequenceLayout,
    chunk: int,
    causal: bool,
    documents: Documents | None = None,
) -> Iterator[tuple[slice, slice, bool, torch.Tensor | None]]:
    """(query slice, key slice, diagonal?, mask) of every block rank `rank` computes against the kv
    shard of `src`: mask None for the block kernel, else the [B, c, c] mask of `kernels.MASKED`
    (with `documents`, whose plan says which blocks are skipped, whole or masked)."""
    for i, qc in enumerate(layout.chunks_of(rank)):
        for j, kc in enumerate(layout.chunks_of(src)):
            if documents is None:
                mode = _mode(qc, kc, causal)
                kind = {"full": FULL, "diag": CAUSAL, None: SKIP}[mode]
            else:
                kind = documents.chunk_kinds.get((qc, kc), SKIP)  # (a key chunk after: SKIP)
            if kind != SKIP:
                mask = documents.block_masks[(qc, kc)] if kind == MASKED else None
                qs, ks = slice(i * chunk, (i + 1) * chunk), slice(j * chunk, (j + 1) * chunk)
                yield qs, ks, kind == CAUSAL, mask


def _merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> None:
    """Online softmax: rescale the running (out, lse) and the block's to the new total, in place. A
    row where both are -inf (no key read yet) stays out = 0, lse = -inf: its weights are taken
    against 0 instead of -inf, exp(-inf) = 0, where -inf - -inf would give nan (finite totals, the
    only ones without documents, are unchanged)."""
    merged = torch.logaddexp(lse, block_lse)
    against = torch.where(merged.isinf(), 0.0, merged)
    out.mul_((lse - against).exp_().unsqueeze(-1))
    # block_out is not written: under selective-op recompute it may be the kernel's saved output
    out.add_(block_out * (block_lse - against).exp_().unsqueeze(-1))
    lse.copy_(merged)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        comm: Comm,  # type: ignore[override]
        layout: SequenceLayout,
        causal: bool,
        kernel: str,
        documents: Documents | None,
    ) -> torch.Tensor:
        blocks = KERNELS[kernel]
        rank, world = comm.rank, comm.size
        chunk = q.shape[2] // len(layout.chunks_of(rank))
        scale = q.shape[-1] ** -0.5
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one message per step, in the inputs' dtype
        for step in range(world):
            batch, incoming = None, None
            if step < world - 1:  # the next shard travels while this one is used
                incoming = torch.empty_like(kv)
                batch = comm.batch_p2p(
                    [("send", kv, (rank + 1) % world), ("recv", incoming, (rank - 1) % world)],
                    tag="cp_kv",
                )
            src = (rank - step) % world
            for qs, ks, diag, mask in _blocks(rank, src, layout, chunk, causal, documents):
                qb, kb, vb = q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks]
                if mask is None:
                    block_out, block_lse = blocks.forward(qb, kb, vb, diag, scale)
                else:
                    block_out, block_lse = kernels.MASKED.forward(qb, kb, vb, mask, scale)
                _merge(out[:, :, qs], lse[:, :, qs], block_out, block_lse)
            if batch is not None:
                batch.wait()
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.causal, ctx.kernel = comm, layout, causal, kernel
        ctx.documents = documents
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout, causal, blocks = ctx.comm, ctx.layout, ctx.causal, KERNELS[ctx.kernel]
        documents = ctx.documents
        rank, world = comm.rank, comm.size
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        chunk = q.shape[2] // len(layout.chunks_of(rank))
        scale = q.shape[-1] ** -0.5
        grad_out = grad_out.to(q.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv_batch, dkv_incoming = None, None
        for step in range(world):
            kv_batch, kv_next = None, None
            if step < world - 1:
                kv_next = torch.empty_like(kv)
                kv_batch = comm.batch_p2p([("send", kv, nxt), ("recv", kv_next, prv)], tag="cp_kv")
            dkv = torch.zeros(
                kv.shape, dtype=torch.float32, device=kv.device
            )  # this step's part for the shard
            src = (rank - step) % world
            for qs, ks, diag, mask in _blocks(rank, src, layout, chunk, causal, documents):
                args = (
                    grad_out[:, :, qs],
                    q[:, :, qs],
                    kv[0][:, :, ks],
                    kv[1][:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs],
                )
                if mask is None:
                    dq_b, dk_b, dv_b = blocks.backward(*args, diag, scale)
                else:
                    dq_b, dk_b, dv_b = kernels.MASKED.backward(*args, mask, scale)
                dq[:, :, qs] += dq_b
                dkv[0][:, :, ks] += dk_b
                dkv[1][:, :, ks] += dv_b
            if (
                world > 1
            ):  # the shard's accumulator travels with it: add what earlier ranks gave, pass it on
                if dkv_batch is not None:
                    dkv_batch.wait()
                    dkv += dkv_incoming
                dkv_incoming = torch.empty_like(dkv)
                dkv_batch = comm.batch_p2p(
                    [("send", dkv, nxt), ("recv", dkv_incoming, prv)], tag="cp_dkv"
                )
            if kv_batch is not None:
                kv_batch.wait()
                kv = kv_next
        if dkv_batch is not None:  # after C steps this rank's own shard's gradient has come home
            dkv_batch.wait()
            dkv = dkv_incoming
        grads = dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return *grads, None, None, None, None, None


@eager_region
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm: Comm,
    layout: SequenceLayout,
    causal: bool = True,
    kernel: str = "auto",
    documents: Documents | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries q [B, H, L/C, d] over the whole sequence, whose keys and
    values k, v [B, H_kv, L/C, d] are spread over `comm` as `layout` says (rank order = ring order).
    `kernel` computes each block: a ``parallel.cp_kernel`` choice (auto, math, flash) resolved by
    `choose_kernel` for q's device type, dtype and head dim, or a `KERNELS` name. ``documents``
    (`find_documents` with this layout and rank): attention inside each document (causal)."""
    kernel = choose_kernel(kernel, q.device.type, q.dtype, q.shape[-1])
    chunks = len(layout.chunks_of(comm.rank))
    if layout.cp != comm.size:
        raise ValueError(f"the layout is for cp={layout.cp}, but the group has {comm.size} ranks")
    if q.shape[2] % chunks or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(
            "ring attention needs q [B, H, L, d] and k, v [B, H_kv, L, d] with H divisible by "
            f"H_kv and L by {chunks} (chunks per rank); got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if documents is not None:
        if not causal:
            raise ValueError("ring attention with documents is causal: causal=False was asked")
        if documents.layout != layout or documents.cp_rank != comm.rank:
            raise ValueError(
                f"documents made for layout {documents.layout} rank {documents.cp_rank}, used by "
                f"ring attention with layout {layout} on rank {comm.rank}"
            )
        if documents.seq_len != q.shape[2] * comm.size:
            raise ValueError(
                f"documents of rows of {documents.seq_len} tokens, but this rank holds "
                f"{q.shape[2]} of a {q.shape[2] * comm.size}-token sequence"
            )
    return _RingAttention.apply(q, k, v, comm, layout, causal, kernel, documents)


@dataclass
class RingAttention:
    """An attention core (q, k, v -> out) for `Attention.core`: ring attention over `comm` with
    `layout`, for sequences of `seq_len` tokens (the positions the model's RoPE tables were cut
    to). ``kernel``: the block kernel choice (``parallel.cp_kernel``; `ring_attention`)."""

    comm: Comm
    layout: SequenceLayout
    seq_len: int
    causal: bool = True
    kernel: str = "auto"

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        documents: Documents | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None and window < self.seq_len:
            raise ValueError(
                f"ring attention attends to the whole prefix: a sliding window of {window} keys "
                f"is shorter than the {self.seq_len}-token sequence (use cp_mode ulysses or cp 1)"
            )
        # (a window as long as the sequence is the whole prefix: plain causal attention)
        if q.shape[2] * self.comm.size != self.seq_len:
            raise ValueError(
                f"context parallel was set up for sequences of {self.seq_len} tokens (each rank's "
                f"RoPE positions); this rank got {q.shape[2]} of a "
                f"{q.shape[2] * self.comm.size}-token sequence: use the configured train.seq_len"
            )
        return ring_attention(q, k, v, self.comm, self.layout, self.causal, self.kernel, documents)
