"""The token dataset: a deterministic train/validation split and the batch layout over ranks.

Determinism contract: a step's global batch depends only on the tokens, ``seq_len``, ``seed``,
``step`` and ``global_batch_size`` (not on the number of ranks, which rank asks or the call order),
and the micro-batches in layout order are exactly it, so tests compare distributed with
single-process training. No ``torch.distributed``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fivefold.train.corpus import ByteTokenizer, load_splits, load_tokens

__all__ = ["IGNORE", "ByteTokenizer", "TokenDataset", "load_splits", "load_tokens"]

IGNORE = -100  # a target the loss skips (`tensor_parallel.loss.row_mean_cross_entropy`)


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if int(v) != v or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


class TokenDataset:
    """Contiguous train/val split of a token array (the last ``val_fraction`` is validation) with
    deterministic, rank-independent batches of ``seq_len + 1``-token windows inside one split;
    ``np.memmap`` arrays are fine."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        val_fraction: float = 0.05,
        seed: int = 0,
        *,
        source: str = "<tokens>",
    ) -> None:
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        _check_positive(seq_len=seq_len)
        n = len(tokens)
        n_val = int(n * val_fraction)
        if val_fraction > 0 and n_val < seq_len + 1:
            raise ValueError(
                f"corpus {source} too small for seq_len={seq_len}: {n} tokens x "
                f"val_fraction={val_fraction} = {n_val} validation tokens, need at least seq_len + "
                f"1 = {seq_len + 1}"
            )
        self._init(tokens[: n - n_val], tokens[n - n_val :], seq_len, seed, source)

    @classmethod
    def from_splits(
        cls,
        train: np.ndarray,
        val: np.ndarray | None,
        seq_len: int,
        seed: int = 0,
        *,
        source: str = "<tokens>",
    ) -> TokenDataset:
        """Build from explicit train and val arrays (``val`` may be ``None`` or empty: no
        validation)."""
        _check_positive(seq_len=seq_len)
        if val is None:
            val = np.zeros(0, dtype=np.uint16)
        if 0 < len(val) < seq_len + 1:
            raise ValueError(
                f"validation split of {source} too small for seq_len={seq_len}: "
                f"{len(val)} tokens, need at least {seq_len + 1}"
            )
        self = cls.__new__(cls)
        self._init(train, val, seq_len, seed, source)
        return self

    @classmethod
    def from_path(
        cls,
        path: str | None,
        seq_len: int,
        val_fraction: float = 0.05,
        seed: int = 0,
        max_bytes: int | None = None,
    ) -> TokenDataset:
        """Load a corpus source (see :func:`load_tokens`); a nanoGPT folder keeps its own train/val
        split."""
        source = repr(path) if path is not None else "<default: Python stdlib sources>"
        train, val = load_splits(path, max_bytes)
        if val is not None:
            return cls.from_splits(train, val, seq_len, seed, source=source)
        return cls(train, seq_len, val_fraction, seed, source=source)

    @classmethod
    def from_prepared(cls, directory: str | Path, seq_len: int, seed: int = 0) -> TokenDataset:
        """The train and val splits of a ``fivefold prepare`` directory, each one
        `ShardedTokens` (memory-mapped shards, read as one array); no val shards: no validation."""
        from fivefold.train.shards import ShardedTokens, read_index

        index = read_index(directory)
        val = ShardedTokens(index, "val")
        return cls.from_splits(
            ShardedTokens(index, "train"),
            val if len(val) else None,
            seq_len,
            seed,
            source=repr(str(directory)),
        )

    def _init(
        self, train: np.ndarray, val: np.ndarray, seq_len: int, seed: int, source: str
    ) -> None:
        if len(train) < seq_len + 1:
            raise ValueError(
                f"corpus {source} too small for seq_len={seq_len}: training split has {len(train)} "
                f"tokens, need at least seq_len + 1 = {seq_len + 1}"
            )
        self.train_tokens = train
        self.val_tokens = val
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.source = source
        self.boundary_id: int | None = None  # `ignore_targets_after`
        self._ends: dict[int, np.ndarray] = {}  # per split: where boundary_id sits, sorted

    def ignore_targets_after(self, eos_id: int) -> TokenDataset:
        """No loss on the token after `eos_id` (``data.loss_across_documents`` false): its target
        becomes -100 (`IGNORE`), the end-of-document token itself stays a target. `loss_weight`
        then says how to weigh a step's loss so it is the mean over the targets kept."""
        self.boundary_id = int(eos_id)
        self._ends.clear()
        return self

    def _boundaries(self, data: np.ndarray) -> np.ndarray:
        """Sorted positions of `boundary_id` in ``data``: a prepared split's document ends (its
        index says each document ends with one and no other holds it), else one scan."""
        key = id(data)
        if key not in self._ends:
            ends = data.document_ends() if hasattr(data, "document_ends") else None
            if ends is None:
                ends = np.concatenate(
                    [
                        np.flatnonzero(np.asarray(data[lo : lo + (1 << 24)]) == self.boundary_id)
                        + lo
                        for lo in range(0, len(data), 1 << 24)
                    ]
                    or [np.zeros(0, np.int64)]
                )
            self._ends[key] = np.asarray(ends, dtype=np.int64)
        return self._ends[key]

    def _kept_targets(self, data: np.ndarray, starts: np.ndarray) -> int:
        """Targets of the windows at `starts` that count: all but those after a boundary token
        (the boundary tokens among each window's inputs, counted from their positions)."""
        ends = self._boundaries(data)
        lo = np.searchsorted(ends, starts, side="left")
        hi = np.searchsorted(ends, starts + self.seq_len, side="left")
        return int(len(starts) * self.seq_len - (hi - lo).sum())

    def loss_weight(self, step: int, global_batch_size: int) -> float:
        """The step's loss weight: rows / targets kept over the global batch (1.0 unless
        `ignore_targets_after`), the same number on every rank (from the batch's starts alone)."""
        if self.boundary_id is None:
            return 1.0
        starts = self._train_starts(step, global_batch_size)
        kept = self._kept_targets(self.train_tokens, starts)
        return len(starts) * self.seq_len / max(kept, 1)

    def val_loss_weight(self, n_batches: int, batch_size: int) -> float:
        """`loss_weight` for the validation set of `val_batches`."""
        if self.boundary_id is None:
            return 1.0
        starts = self.val_starts(n_batches, batch_size)
        kept = self._kept_targets(self.val_tokens, starts)
        return len(starts) * self.seq_len / max(kept, 1)

    def _windows(self, data: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather ``data[s : s + seq_len + 1]`` for each start; split into (x, y) int64 tensors
        (a target after a boundary token -100 with `ignore_targets_after`)."""
        idx = starts.astype(np.int64)[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)
        w = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        if self.boundary_id is not None:
            y.masked_fill_(x == self.boundary_id, IGNORE)
        return x, y

    def _train_starts(self, step: int, global_batch_size: int) -> np.ndarray:
        if int(step) != step or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        _check_positive(global_batch_size=global_batch_size)
        rng = np.random.default_rng([self.seed, int(step)])
        # largest valid start is len - seq_len - 1 (the window needs seq_len + 1 tokens); high is
        # exclusive
        return rng.integers(0, len(self.train_tokens) - self.seq_len, size=int(global_batch_size))

    def global_batch(self, step: int, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``step``, ``(x, y)`` int64 [global_batch_size, seq_len], from rng
        ``[seed, step]``."""
        return self._windows(self.train_tokens, self._train_starts(step, global_batch_size))

    def micro_batch(
        self,
        step: int,
        global_batch_size: int,
        micro_step: int = 0,
        grad_accum: int = 1,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows ``[(micro_step * dp_size + dp_rank) * mb, ... + mb)`` of
        ``global_batch(step, ...)``, with ``mb = global_batch_size // (grad_accum * dp_size)``; only
        these rows are gathered."""
        _check_positive(global_batch_size=global_batch_size, grad_accum=grad_accum, dp_size=dp_size)
        per_step = grad_accum * dp_size
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by "
                f"grad_accum({grad_accum}) x dp_size({dp_size}) = {per_step}"
            )
        if not 0 <= micro_step < grad_accum:
            raise ValueError(f"micro_step={micro_step} out of range for grad_accum={grad_accum}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
        mb = global_batch_size // per_step
        lo = (micro_step * dp_size + dp_rank) * mb
        starts = self._train_starts(step, global_batch_size)[lo : lo + mb]
        return self._windows(self.train_tokens, starts)

    def val_starts(self, n_batches: int, batch_size: int) -> np.ndarray:
        """Start offsets into ``val_tokens`` of the ``n_batches * batch_size`` validation windows,
        evenly spaced."""
        _check_positive(n_batches=n_batches, batch_size=batch_size)
        if len(self.val_tokens) < self.seq_len + 1:
            raise ValueError(
                f"no validation split in {self.source}: {len(self.val_tokens)} val tokens "
                f"(seq_len={self.seq_len}); use val_fraction > 0 or a val.bin"
            )
        last = len(self.val_tokens) - self.seq_len - 1
        return np.linspace(0, last, n_batches * batch_size).round().astype(np.int64)

    def val_batches(
        self, n_batches: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches ``dp_rank::dp_size`` of a fixed validation set;
        ``n_batches % dp_size == 0`` makes the mean of the per-rank means the global mean."""
        _check_positive(dp_size=dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
        if n_batches % dp_size:
            raise ValueError(
                f"n_batches={n_batches} is not divisible by dp_size={dp_size}: "
                "ranks would average different numbers of batches"
            )
        starts = self.val_starts(n_batches, batch_size).reshape(n_batches, batch_size)
        return [
            self._windows(self.val_tokens, starts[b]) for b in range(dp_rank, n_batches, dp_size)
        ]

    def __len__(self) -> int:
        """Number of distinct training windows (valid start offsets)."""
        return len(self.train_tokens) - self.seq_len

    def __repr__(self) -> str:
        return (
            f"TokenDataset(source={self.source}, train_tokens={len(self.train_tokens):,}, "
            f"val_tokens={len(self.val_tokens):,}, seq_len={self.seq_len}, seed={self.seed})"
        )
