"""Documents in attention (Llama 3's recipe for packed rows): this module owns where documents
start in a row of tokens, the in-document positions RoPE reads, and the masks and block plan the
attention cores use so that a token attends only to earlier tokens of its own document.

A row holds several documents separated by an end-of-document token (EOS). A document ends *with*
its EOS: the token after an EOS starts a new one, and the row's first token always starts one (even
when the row was cut mid-document). `find_documents` computes everything once per micro-batch from
the whole rows, which are on the CPU before the step (the data loader's token ids), so nothing in
the forward or backward has to read device values on the host:

- ``positions`` [B, L_local]: each local token's position inside its document (RoPE's row);
- ``doc_ids`` [B, L]: the document index of every token of the *whole* row, so ring attention knows
  the documents of the keys held by other ranks (their tokens: ``layout.positions(src, L)``);
- single rank (``layout`` None): ``spans``, each row's documents as (start, end) host integers, for
  the sdpa core (causal SDPA on each document's slice: 3-6× faster than a dense mask on the CPU,
  bench/documents.py), and ``mask`` [B, 1, L, L], query i may read key j (same document, j <= i),
  for the eager core (built on first use);
- Ulysses and the hybrid (`UlyssesLayout`): ``gathered``, the documents of the tokens a rank holds
  after Ulysses' all-to-all (its ring rank's part): single-rank spans for pure Ulysses, the ring
  layout's block plan for the hybrid; ``positions`` stay this rank's own tokens' (RoPE is applied
  before the all-to-all, each token rotated by its own position: the same rotation);
- context parallel: ``chunk_kinds``, the host-side block plan — for every (query chunk, key chunk)
  pair of the layout, whether ring attention skips it (no row of the batch has an allowed pair),
  runs the unmasked kernel (every row's pairs lie inside one document: `FULL` below the diagonal,
  `CAUSAL` on it) or the masked kernel (`MASKED`, with ``block_masks[(q chunk, k chunk)]``
  [B, c, c] for this rank's query chunks). `pair_kind` is the rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # (not imported: ring attention imports this module)
    from fivefold.context_parallel.layout import SequenceLayout, UlyssesLayout

__all__ = [
    "BLOCK_KINDS",
    "CAUSAL",
    "FULL",
    "MASKED",
    "SKIP",
    "Documents",
    "document_mask",
    "find_documents",
    "pair_kind",
]

# How ring attention computes a (query chunk, key chunk) block under document masking
SKIP = "skip"  # no query of any row may read any key of the block
FULL = "full"  # every query may read every key (keys before the queries, all in one document)
CAUSAL = "causal"  # the diagonal block inside one document: the plain causal kernel
MASKED = "masked"  # some pairs allowed, some not: the masked kernel
BLOCK_KINDS = (SKIP, FULL, CAUSAL, MASKED)


@dataclass(frozen=True)
class Documents:
    """What every attention path needs to keep attention inside documents, for one micro-batch on
    one rank (`find_documents` makes it; every layer shares it)."""

    positions: torch.Tensor  # [B, L_local] int64: in-document position of each local token
    doc_ids: torch.Tensor  # [B, L] int64: document index (0, 1, ... per row) of the whole row
    # context parallel's layout (None: one rank)
    layout: SequenceLayout | UlyssesLayout | None = None
    cp_rank: int = 0
    # single rank only: each row's documents, (start, end) host integers
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    # context parallel only: kind of every (query chunk, key chunk) pair of the layout (host side)
    chunk_kinds: Mapping[tuple[int, int], str] = field(default_factory=dict)
    # context parallel only: [B, c, c] bool for this rank's MASKED pairs
    block_masks: Mapping[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # Ulysses / hybrid only: what the attention after the all-to-all reads (see the module)
    gathered: Documents | None = None

    @cached_property
    def mask(self) -> torch.Tensor | None:
        """[B, 1, L, L] bool, single rank only (else None): query i may read key j. Built on first
        use (the eager core's), on the documents' device."""
        if self.layout is not None:
            return None
        return document_mask(self.doc_ids, self.doc_ids).unsqueeze(1)

    @property
    def seq_len(self) -> int:
        """The whole row's length L (before any cp split)."""
        return self.doc_ids.shape[1]


def pair_kind(q_docs: torch.Tensor, k_docs: torch.Tensor, diagonal: bool) -> str:
    """The block rule: how query chunk q against key chunk k is computed, from the document index
    of the first and last token of each chunk, per row (``q_docs``, ``k_docs`` [B, 2], CPU), with
    k before q (or ``diagonal``: the same chunk). Document indices never decrease along a row, so
    a key chunk before the query chunk shares a document with it exactly when its last document is
    the query chunk's first, and all its pairs are allowed exactly when both chunks lie inside that
    one document."""
    q_first, q_last = q_docs[:, 0], q_docs[:, 1]
    k_first, k_last = k_docs[:, 0], k_docs[:, 1]
    if diagonal:  # a query always reads itself: never skipped
        return CAUSAL if bool((q_first == q_last).all()) else MASKED
    if not bool((k_last == q_first).any()):
        return SKIP
    return FULL if bool((k_first == q_last).all()) else MASKED


def document_mask(
    q_docs: torch.Tensor, k_docs: torch.Tensor, diagonal: bool = True
) -> torch.Tensor:
    """[B, Lq, Lk] bool: query i may read key j — the same document and, on a ``diagonal`` block
    (queries and keys the same tokens), j <= i."""
    same = q_docs.unsqueeze(-1) == k_docs.unsqueeze(-2)
    if diagonal:
        lq, lk = same.shape[-2:]
        same &= torch.ones(lq, lk, dtype=torch.bool, device=same.device).tril_()
    return same


def find_documents(
    tokens: torch.Tensor,
    eos_id: int,
    layout: SequenceLayout | UlyssesLayout | None = None,
    cp_rank: int = 0,
    device: torch.device | str | None = None,
) -> Documents:
    """The `Documents` of whole rows ``tokens`` [B, L] (int64, on the CPU, before any cp split)
    whose documents end with ``eos_id``, for rank ``cp_rank`` of ``layout`` (None: one rank); the
    tensors the step reads are put on ``device`` (default: the CPU)."""
    if tokens.dim() != 2:
        raise ValueError(f"find_documents takes whole rows [B, L]; got shape {tuple(tokens.shape)}")
    if tokens.device.type != "cpu":
        raise ValueError(
            "find_documents reads the rows on the host: pass the CPU tokens of the data loader, "
            f"not a {tokens.device.type} tensor (reading it would sync the device)"
        )
    from fivefold.distributed.launch import to_device  # pinned, copied without a host wait

    device = torch.device(device) if device is not None else torch.device("cpu")
    batch, seq = tokens.shape
    # on the host, as the rows are: what is read here never waits for a device
    starts = torch.zeros(batch, seq, dtype=torch.bool, device="cpu")
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eos_id  # the token after an EOS starts a document
    doc_ids = starts.long().cumsum(dim=1) - 1
    index = torch.arange(seq, device="cpu").expand(batch, seq)
    start_of_mine = torch.where(starts, index, 0).cummax(dim=1).values
    positions = index - start_of_mine
    if layout is None:
        spans = []
        for row in starts:
            begin = row.nonzero().flatten().tolist()  # (host tensors: no device read)
            spans.append(tuple(zip(begin, [*begin[1:], seq])))
        return Documents(
            positions=to_device(positions, device),
            doc_ids=to_device(doc_ids, device),
            spans=tuple(spans),
        )
    layout.check(seq)
    if hasattr(layout, "ulysses"):  # a UlyssesLayout (not imported: its package imports this one)
        ring = layout.ring
        gathered = find_documents(
            tokens, eos_id, ring if ring.cp > 1 else None, cp_rank // layout.ulysses, device
        )
        return Documents(
            positions=to_device(positions[:, layout.positions(cp_rank, seq)].contiguous(), device),
            doc_ids=gathered.doc_ids,
            layout=layout,
            cp_rank=cp_rank,
            gathered=gathered,
        )
    chunk = seq // layout.n_chunks
    bounds = [doc_ids[:, [c * chunk, (c + 1) * chunk - 1]] for c in range(layout.n_chunks)]
    kinds = {
        (qc, kc): pair_kind(bounds[qc], bounds[kc], diagonal=qc == kc)
        for qc in range(layout.n_chunks)
        for kc in range(qc + 1)
    }
    ids = to_device(doc_ids, device)
    chunk_ids = [ids[:, c * chunk : (c + 1) * chunk] for c in range(layout.n_chunks)]
    block_masks = {
        (qc, kc): document_mask(chunk_ids[qc], chunk_ids[kc], diagonal=qc == kc)
        for (qc, kc), kind in kinds.items()
        if kind == MASKED and qc in layout.chunks_of(cp_rank)
    }
    local = layout.positions(cp_rank, seq)
    return Documents(
        positions=to_device(positions[:, local].contiguous(), device),
        doc_ids=ids,
        layout=layout,
        cp_rank=cp_rank,
        chunk_kinds=kinds,
        block_masks=block_masks,
    )
