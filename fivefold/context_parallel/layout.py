"""How a sequence is split over the cp group (docs/design.md#context-parallelism). The sequence is
cut into equal chunks; a rank holds some of them, in order. Causal attention makes later chunks
costlier (a query attends to every key before it), so `zigzag` gives rank i chunks i and 2C-1-i of
2C: every rank then does the same work (Llama 3's CP, Megatron-LM). `contiguous` (rank i holds chunk
i of C) is the textbook layout, kept for tests and non-causal attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "SequenceLayout"]

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class SequenceLayout:
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
