"""How a sequence is split over the cp group (docs/design.md#context-parallelism). The sequence is
cut into equal chunks; a rank holds some of them, in order. Causal attention makes later chunks
costlier (a query attends to every key before it), so `zigzag` gives rank i chunks i and 2C-1-i of
2C: every rank then does the same work (Llama 3's CP, Megatron-LM). `contiguous` (rank i holds chunk
i of C) is the textbook layout, kept for tests and non-causal attention."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fivefold.config import ParallelSection

__all__ = ["LAYOUTS", "SequenceLayout", "UlyssesLayout", "layout_for"]

LAYOUTS = ("zigzag", "contiguous")


class _TokenSplit:
    """Slicing whole sequences by a layout's `positions` (both layouts)."""

    cp: int

    def positions(
        self, rank: int, seq_len: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        raise NotImplementedError

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """`rank`'s part of `x` (the whole sequence along `dim`)."""
        return x.index_select(dim, self.positions(rank, x.shape[dim], x.device))

    def unshard(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's part (inverse of `shard`; for tests and gathering
        outputs)."""
        seq_len = sum(p.shape[dim] for p in parts)
        order = torch.cat([self.positions(r, seq_len, parts[0].device) for r in range(self.cp)])
        whole = torch.cat(parts, dim=dim)
        return whole.index_select(dim, torch.argsort(order))


@dataclass(frozen=True)
class SequenceLayout(_TokenSplit):
    kind: str  # "zigzag" | "contiguous"
    cp: int

    def __post_init__(self) -> None:
        if self.kind not in LAYOUTS:
            raise ValueError(
                f"context-parallel layout {self.kind!r}: choose {' or '.join(LAYOUTS)}"
            )

    @property
    def n_chunks(self) -> int:
        return 2 * self.cp if self.kind == "zigzag" else self.cp

    def describe(self) -> str:
        """A few words for a layout line: the ring's layout kind."""
        return self.kind

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The global chunk indices `rank` holds, in the order they sit in its local sequence."""
        return (rank, 2 * self.cp - 1 - rank) if self.kind == "zigzag" else (rank,)

    def check(self, seq_len: int) -> None:
        if seq_len % self.n_chunks:
            raise ValueError(
                f"context parallel ({self.kind}, cp={self.cp}) cuts the sequence into "
                f"{self.n_chunks} equal chunks: seq_len={seq_len} is not divisible by "
                f"{self.n_chunks}; use a multiple of {self.n_chunks}"
            )

    def positions(
        self, rank: int, seq_len: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Global token positions of `rank`'s local sequence (for RoPE and for slicing batches)."""
        self.check(seq_len)
        chunk = seq_len // self.n_chunks
        return torch.cat(
            [torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in self.chunks_of(rank)]
        )


@dataclass(frozen=True)
class UlyssesLayout(_TokenSplit):
    """Ulysses × ring: cp = R × U ranks, cp rank r is Ulysses rank r % U of ring rank r // U; the
    ring layout (``kind`` over R ranks) splits the sequence, each ring rank's part is cut into U
    consecutive slices (module docstring)."""

    kind: str  # the ring's layout: "zigzag" | "contiguous"
    cp: int
    ulysses: int  # U: the inner (Ulysses) degree, a divisor of cp

    def __post_init__(self) -> None:
        if self.ulysses < 1 or self.cp % self.ulysses:
            raise ValueError(
                f"Ulysses degree {self.ulysses} must divide cp={self.cp} (cp = ring × Ulysses)"
            )
        self.ring  # noqa: B018 (checks the kind)

    @property
    def ring(self) -> SequenceLayout:
        """The ring's layout over the R = cp / U ring ranks (each holding what its Ulysses group
        holds after the all-to-all); pure Ulysses (R = 1): the whole sequence in order."""
        ring = self.cp // self.ulysses
        return SequenceLayout(self.kind if ring > 1 else "contiguous", ring)

    def describe(self) -> str:
        """A few words for a layout line: ``ulysses``, or ``ulysses U × ring R <kind>``."""
        ring = self.ring
        return "ulysses" if ring.cp == 1 else f"ulysses {self.ulysses} × ring {ring.cp} {self.kind}"

    def check(self, seq_len: int) -> None:
        ring = self.ring
        # the ring's chunks whole, and each ring rank's part in U equal slices
        multiple = math.lcm(ring.n_chunks, ring.cp * self.ulysses)
        if seq_len % multiple:
            parts = f"Ulysses {self.ulysses}" + (
                f" × ring {ring.cp} {ring.kind} ({ring.n_chunks} chunks)" if ring.cp > 1 else ""
            )
            raise ValueError(
                f"context parallel (cp={self.cp}: {parts}) cuts the sequence into {self.cp} equal "
                f"parts: seq_len={seq_len} is not divisible by {multiple}; use a multiple of "
                f"{multiple}"
            )

    def positions(
        self, rank: int, seq_len: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Global token positions of cp rank `rank`'s local sequence: its slice of its ring rank's
        part."""
        self.check(seq_len)
        part = self.ring.positions(rank // self.ulysses, seq_len, device)
        size = part.shape[0] // self.ulysses
        u = rank % self.ulysses
        return part[u * size : (u + 1) * size]


def layout_for(parallel: ParallelSection, cp: int) -> SequenceLayout | UlyssesLayout:
    """How ``parallel.cp_mode`` lays a sequence out over `cp` ranks: the ring's `SequenceLayout`
    (``cp_layout``), or a `UlyssesLayout` (ulysses, hybrid) whose ring uses ``cp_layout``."""
    if parallel.cp_mode == "ring":
        return SequenceLayout(parallel.cp_layout, cp)
    return UlyssesLayout(parallel.cp_layout, cp, parallel.ulysses_degree(cp))
