"""Training data: a byte tokenizer, corpus loading and a deterministic token dataset.

This module owns everything between "a path on disk" and "a LongTensor batch on
the host":

- :class:`ByteTokenizer` -- UTF-8 bytes as tokens (vocab 256), no downloads.
- :func:`load_tokens` / :func:`load_splits` -- turn a corpus source into uint16
  token arrays. Sources: ``None`` (the embedded default corpus: this Python's own
  standard-library sources), a text file, a folder of text files, a
  comma-separated list of files, a nanoGPT ``.bin`` file (pre-tokenized uint16,
  memory-mapped) or a nanoGPT folder holding ``train.bin`` and ``val.bin``.
- :class:`TokenDataset` -- contiguous train/validation split; random training
  windows drawn from a generator seeded by ``(seed, step)``; the
  :meth:`~TokenDataset.micro_batch` layout that shards one global batch over
  gradient-accumulation micro-steps and data-parallel ranks; fixed validation
  batches sharded across data-parallel ranks.

Determinism contract: the global batch of a step depends only on the tokens,
``seq_len``, ``seed``, ``step`` and ``global_batch_size`` -- not on the number of
ranks, on which rank asks, or on the order of calls. The union of all micro
batches (in layout order) is exactly the global batch, which is what lets tests
compare distributed training with single-process training on the same data.

Nothing here calls ``torch.distributed``: callers pass ``dp_rank``/``dp_size``.
Tensors are returned on the CPU; the caller moves them to its device.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "DEFAULT_CORPUS_MAX_BYTES",
    "SEPARATOR",
    "ByteTokenizer",
    "TokenDataset",
    "default_corpus_bytes",
    "load_splits",
    "load_tokens",
]

#: Cap applied to the embedded default corpus when ``max_bytes`` is not given.
DEFAULT_CORPUS_MAX_BYTES = 8 * 1024 * 1024
#: Bytes placed between concatenated text files.
SEPARATOR = b"\n\n"

_SKIP_STDLIB_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"})
_BINARY_EXTENSIONS = frozenset(
    {
        ".bin", ".npy", ".npz", ".pt", ".pth", ".ckpt", ".safetensors", ".pkl", ".pickle",
        ".pyc", ".pyo", ".so", ".dll", ".dylib", ".exe", ".o", ".a", ".lib", ".class", ".jar",
        ".zip", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".tar", ".rar",
        ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".webp", ".tif", ".tiff",
        ".mp3", ".wav", ".flac", ".ogg", ".mp4", ".avi", ".mov", ".mkv", ".webm",
        ".pdf", ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx",
        ".ttf", ".otf", ".woff", ".woff2", ".db", ".sqlite", ".parquet", ".arrow",
    }
)  # fmt: skip
_SNIFF_BYTES = 1024


class ByteTokenizer:
    """UTF-8 byte tokenizer: token id == byte value, ``vocab_size == 256``."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """Encode ``text`` as its UTF-8 bytes, returned as a uint16 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Decode token ids (array, tensor or iterable of ints) back to text.

        Invalid UTF-8 sequences (e.g. a window cut in the middle of a multi-byte
        character) are replaced with U+FFFD instead of raising.
        """
        if isinstance(ids, torch.Tensor):
            arr = ids.detach().cpu().numpy()
        elif isinstance(ids, np.ndarray):
            arr = ids
        else:
            arr = np.fromiter((int(i) for i in ids), dtype=np.int64)
        arr = np.asarray(arr).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}); got [{arr.min()}, {arr.max()}]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


# --------------------------------------------------------------------------- corpus sources


def _bytes_to_tokens(data: bytes | bytearray | memoryview) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)


def _concat_capped(chunks: Iterable[bytes], max_bytes: int | None) -> bytes:
    """Join ``chunks`` with :data:`SEPARATOR`, stopping once ``max_bytes`` are collected."""
    out = bytearray()
    for chunk in chunks:
        if not chunk:
            continue
        if out:
            out += SEPARATOR
        out += chunk
        if max_bytes is not None and len(out) >= max_bytes:
            break
    if max_bytes is not None:
        del out[max_bytes:]
    return bytes(out)


def _stdlib_files() -> list[Path]:
    root = sysconfig.get_paths()["stdlib"]
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_STDLIB_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return files


def default_corpus_bytes(max_bytes: int | None = DEFAULT_CORPUS_MAX_BYTES) -> bytes:
    """The embedded default corpus: this interpreter's standard-library ``.py`` sources.

    Files are walked in sorted order (``site-packages``, ``test``/``tests``,
    ``idlelib`` and ``lib2to3`` skipped), joined with :data:`SEPARATOR` and cut
    at ``max_bytes``. The content therefore depends on the Python version:
    another Python gives a different, but equally deterministic, corpus. It is
    offline, license-friendly, about 10 MB of real code, and loads in tens of ms.
    """

    def chunks() -> Iterable[bytes]:
        for f in _stdlib_files():
            try:
                yield f.read_bytes()
            except OSError:  # unreadable file in an odd install: skip it, stay deterministic
                continue

    data = _concat_capped(chunks(), max_bytes)
    if not data:
        raise ValueError(f"default corpus is empty: no .py files under {sysconfig.get_paths()['stdlib']!r}")
    return data


def _is_text_file(path: Path) -> bool:
    if path.suffix.lower() in _BINARY_EXTENSIONS:
        return False
    try:
        with path.open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
    except OSError:
        return False
    return b"\x00" not in head


def _folder_text_files(folder: Path) -> list[Path]:
    """All text-like files under ``folder``, recursively, in sorted order; hidden entries skipped."""
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if not name.startswith(".") and p.is_file() and _is_text_file(p):
                files.append(p)
    return files


def _load_bin(path: Path, max_bytes: int | None) -> np.ndarray:
    """Memory-map a nanoGPT ``.bin`` file (raw little-endian uint16 token ids)."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"empty corpus: {str(path)!r} has no tokens")
    if size % 2:
        raise ValueError(f"{str(path)!r} has {size} bytes, not a whole number of uint16 tokens")
    arr = np.memmap(path, dtype=np.uint16, mode="r")
    if max_bytes is not None:
        arr = arr[: max_bytes // 2]
    return arr


def _is_nanogpt_folder(path: Path) -> bool:
    return path.is_dir() and (path / "train.bin").is_file() and (path / "val.bin").is_file()


def _load_one(path: Path, max_bytes: int | None) -> np.ndarray:
    """A single existing source (file or folder) -> tokens (no nanoGPT split handling)."""
    if path.is_dir():
        files = _folder_text_files(path)
        data = _concat_capped((f.read_bytes() for f in files), max_bytes)
        if not data:
            raise ValueError(f"empty corpus: folder {str(path)!r} contains no non-empty text files")
        return _bytes_to_tokens(data)
    if path.suffix == ".bin":
        return _load_bin(path, max_bytes)
    with path.open("rb") as fh:
        data = fh.read() if max_bytes is None else fh.read(max_bytes)
    if not data:
        raise ValueError(f"empty corpus: file {str(path)!r} is empty")
    return _bytes_to_tokens(data)


def _split_sources(path: str) -> list[Path]:
    """``path`` as one existing source, or as a comma-separated list of existing sources."""
    if os.path.exists(path) or "," not in path:
        parts = [path]
    else:
        parts = [p.strip() for p in path.split(",") if p.strip()]
        if not parts:
            raise ValueError(f"no paths in corpus source {path!r}")
    for p in parts:
        if not os.path.exists(p):
            where = "" if p == path else f" (in corpus list {path!r})"
            raise FileNotFoundError(f"corpus path not found: {p!r}{where}")
    return [Path(p) for p in parts]


def load_splits(path: str | None, max_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Load a corpus source as ``(tokens, None)``, or ``(train, val)`` when the source defines the split.

    Only a nanoGPT folder (one holding ``train.bin`` and ``val.bin``) defines its
    own split; both arrays are then memory-mapped and ``max_bytes`` caps each of
    them. For every other source see :func:`load_tokens`.
    """
    if path is not None and _is_nanogpt_folder(Path(path)):
        folder = Path(path)
        return _load_bin(folder / "train.bin", max_bytes), _load_bin(folder / "val.bin", max_bytes)
    return load_tokens(path, max_bytes), None


def load_tokens(path: str | None, max_bytes: int | None = None) -> np.ndarray:
    """Load a corpus source as one uint16 token array (byte tokens, or nanoGPT ids for ``.bin``).

    ``path`` may be:

    - ``None``: the embedded default corpus (:func:`default_corpus_bytes`),
      capped at ``max_bytes`` or :data:`DEFAULT_CORPUS_MAX_BYTES`;
    - a text file (its bytes);
    - a folder: all text-like files below it, recursively, in sorted order,
      joined with :data:`SEPARATOR` (files with a NUL byte in their first KiB,
      known binary extensions and hidden entries are skipped);
    - a ``.bin`` file: pre-tokenized uint16 ids in nanoGPT format, memory-mapped
      (``max_bytes`` then caps the file bytes read, i.e. ``max_bytes // 2`` tokens);
    - a nanoGPT folder with ``train.bin`` and ``val.bin``: returned here as
      train followed by val (a copy); use :func:`load_splits` or
      :meth:`TokenDataset.from_path` to keep the split and the memory maps;
    - a comma-separated list of the above (non-nanoGPT) sources, concatenated
      in the given order (``max_bytes`` caps each element).

    Raises ``FileNotFoundError`` naming the path when it does not exist and
    ``ValueError`` naming it when the corpus is empty.
    """
    if path is None:
        cap = DEFAULT_CORPUS_MAX_BYTES if max_bytes is None else max_bytes
        return _bytes_to_tokens(default_corpus_bytes(cap))
    sources = _split_sources(path)
    if len(sources) == 1 and _is_nanogpt_folder(sources[0]):
        train, val = load_splits(path, max_bytes)
        assert val is not None
        return np.concatenate([np.asarray(train), np.asarray(val)])
    arrays = [_load_one(p, max_bytes) for p in sources]
    tokens = arrays[0] if len(arrays) == 1 else np.concatenate([np.asarray(a) for a in arrays])
    if len(tokens) == 0:
        raise ValueError(f"empty corpus: {path!r}")
    return tokens


# --------------------------------------------------------------------------- dataset


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if int(v) != v or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


class TokenDataset:
    """Contiguous train/val split of a token array with deterministic, rank-independent batches.

    ``TokenDataset(tokens, seq_len, val_fraction=0.05, seed=0)`` holds out the
    last ``val_fraction`` of ``tokens`` (contiguous) as the validation split;
    :meth:`from_splits` takes explicit train/val arrays and :meth:`from_path`
    loads a corpus source (honouring a nanoGPT folder's own split).

    A window is ``seq_len + 1`` consecutive tokens lying entirely inside one
    split; ``x`` is its first ``seq_len`` tokens, ``y`` the last ``seq_len`` (``x``
    shifted by one). Training windows never read validation tokens and vice
    versa. Arrays may be ``np.memmap``: only the requested rows are gathered.

    Attributes: ``train_tokens``, ``val_tokens`` (the split arrays; ``val_tokens``
    is empty when ``val_fraction == 0``), ``seq_len``, ``seed``, ``source``.
    """

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
                f"corpus {source} too small for seq_len={seq_len}: {n} tokens x val_fraction={val_fraction} "
                f"= {n_val} validation tokens, need at least seq_len + 1 = {seq_len + 1}"
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
        """Build from explicit train and val arrays (``val`` may be ``None`` or empty: no validation)."""
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
        """Load a corpus source (see :func:`load_tokens`); a nanoGPT folder keeps its own train/val split."""
        source = repr(path) if path is not None else "<default: Python stdlib sources>"
        train, val = load_splits(path, max_bytes)
        if val is not None:
            return cls.from_splits(train, val, seq_len, seed, source=source)
        return cls(train, seq_len, val_fraction, seed, source=source)

    def _init(self, train: np.ndarray, val: np.ndarray, seq_len: int, seed: int, source: str) -> None:
        if len(train) < seq_len + 1:
            raise ValueError(
                f"corpus {source} too small for seq_len={seq_len}: training split has {len(train)} tokens, "
                f"need at least seq_len + 1 = {seq_len + 1}"
            )
        self.train_tokens = train
        self.val_tokens = val
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.source = source

    # ------------------------------------------------------------------ helpers

    def _windows(self, data: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather ``data[s : s + seq_len + 1]`` for each start; split into (x, y) int64 tensors."""
        idx = starts.astype(np.int64)[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)
        w = torch.from_numpy(np.asarray(data[idx], dtype=np.int64))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def _train_starts(self, step: int, global_batch_size: int) -> np.ndarray:
        if int(step) != step or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        _check_positive(global_batch_size=global_batch_size)
        rng = np.random.default_rng([self.seed, int(step)])
        # largest valid start is len - seq_len - 1 (the window needs seq_len + 1 tokens); high is exclusive
        return rng.integers(0, len(self.train_tokens) - self.seq_len, size=int(global_batch_size))

    # ------------------------------------------------------------------ public API

    def global_batch(self, step: int, global_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch of ``step``: ``(x, y)`` int64 tensors of shape [global_batch_size, seq_len].

        Window starts come from ``numpy.random.default_rng([seed, step])``, so the
        batch depends only on (tokens, seq_len, seed, step, global_batch_size).
        """
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
        """The rows of ``global_batch(step, global_batch_size)`` for one micro-step on one DP rank.

        Layout: the global batch is cut into ``grad_accum`` micro-steps, each cut
        into ``dp_size`` contiguous slices of ``mb = global_batch_size // (grad_accum
        * dp_size)`` rows; this returns rows ``[(micro_step * dp_size + dp_rank) * mb,
        ... + mb)``. Concatenating all (micro_step, dp_rank) slices in that order
        reproduces the global batch exactly. Only these ``mb`` rows are gathered.
        """
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
        """Start offsets (into ``val_tokens``) of the ``n_batches * batch_size`` validation windows.

        Evenly spaced from the first to the last valid start, in batch order.
        """
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
        """This rank's share of a fixed set of ``n_batches`` validation batches of ``batch_size`` rows.

        The ``n_batches * batch_size`` windows are evenly spaced over the
        validation split (same every call). Rank ``r`` takes batches ``r, r +
        dp_size, r + 2 * dp_size, ...``: the shards are disjoint and cover all
        batches. ``n_batches`` must be divisible by ``dp_size``, so every rank gets
        the same number of equal-sized batches and the mean over ranks of the
        per-rank mean loss equals the global mean loss.
        """
        _check_positive(dp_size=dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} out of range for dp_size={dp_size}")
        if n_batches % dp_size:
            raise ValueError(
                f"n_batches={n_batches} is not divisible by dp_size={dp_size}: "
                "ranks would average different numbers of batches"
            )
        starts = self.val_starts(n_batches, batch_size).reshape(n_batches, batch_size)
        return [self._windows(self.val_tokens, starts[b]) for b in range(dp_rank, n_batches, dp_size)]

    def __len__(self) -> int:
        """Number of distinct training windows (valid start offsets)."""
        return len(self.train_tokens) - self.seq_len

    def __repr__(self) -> str:
        return (
            f"TokenDataset(source={self.source}, train_tokens={len(self.train_tokens):,}, "
            f"val_tokens={len(self.val_tokens):,}, seq_len={self.seq_len}, seed={self.seed})"
        )
