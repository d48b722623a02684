"""Corpus sources -> uint16 token arrays (`load_tokens`, `load_splits`), the byte tokenizer, and
`check_source` (the same source checked from file sizes and names, before any process starts). No
downloads.
"""

from __future__ import annotations

import errno
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (not imported: `fivefold prepare` walks folders with this module, torch-free)
    import torch

__all__ = [
    "DEFAULT_CORPUS_MAX_BYTES",
    "SEPARATOR",
    "ByteTokenizer",
    "check_source",
    "default_corpus_bytes",
    "load_splits",
    "load_tokens",
]

#: Cap applied to the embedded default corpus when ``max_bytes`` is not given.
DEFAULT_CORPUS_MAX_BYTES = 8 * 1024 * 1024
#: Bytes placed between concatenated text files.
SEPARATOR = b"\n\n"

_SKIP_STDLIB_DIRS = frozenset(
    {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)
_BINARY_EXTENSIONS = frozenset({".bin", ".npy", ".npz", ".pt", ".pth", ".ckpt", ".safetensors",
                                ".pkl", ".pickle", ".pyc", ".pyo", ".so", ".dll", ".dylib", ".exe",
                                ".o", ".a", ".lib", ".class", ".jar", ".zip", ".gz", ".tgz", ".bz2",
                                ".xz", ".zst", ".7z", ".tar", ".rar", ".png", ".jpg", ".jpeg",
                                ".gif", ".bmp", ".ico", ".webp", ".tif", ".tiff", ".mp3", ".wav",
                                ".flac", ".ogg", ".mp4", ".avi", ".mov", ".mkv", ".webm", ".pdf",
                                ".doc", ".docx", ".xls", ".xlsx", ".ppt", ".pptx", ".ttf", ".otf",
                                ".woff", ".woff2", ".db", ".sqlite", ".parquet",
                                ".arrow"})  # fmt: skip
_SNIFF_BYTES = 1024


class ByteTokenizer:
    """UTF-8 byte tokenizer: token id == byte value, ``vocab_size == 256``."""

    vocab_size: int = 256

    def encode(self, text: str) -> np.ndarray:
        """Encode ``text`` as its UTF-8 bytes, returned as a uint16 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Decode token ids to text; invalid UTF-8 (a window cut inside a character) becomes U+FFFD,
        not an error."""
        if hasattr(ids, "detach"):  # a torch.Tensor
            arr = ids.detach().cpu().numpy()
        elif isinstance(ids, np.ndarray):
            arr = ids
        else:
            arr = np.fromiter((int(i) for i in ids), dtype=np.int64)
        arr = np.asarray(arr).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.vocab_size}); got [{arr.min()}, {arr.max()}]"
            )
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


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
    """The embedded default corpus: this interpreter's stdlib ``.py`` sources in sorted order
    (site-packages, tests, idlelib, lib2to3 skipped), cut at ``max_bytes``. Deterministic per Python
    version, offline, ~10 MB of code."""

    def chunks() -> Iterable[bytes]:
        for f in _stdlib_files():
            try:
                yield f.read_bytes()
            except OSError:  # unreadable file in an odd install: skip it, stay deterministic
                continue

    data = _concat_capped(chunks(), max_bytes)
    if not data:
        raise ValueError(
            f"default corpus is empty: no .py files under {sysconfig.get_paths()['stdlib']!r}"
        )
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
    """All text-like files under ``folder``, recursively, in sorted order; hidden entries
    skipped."""
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
    _checked_tokens(path, max_bytes)
    arr = np.memmap(path, dtype=np.uint16, mode="r")
    if max_bytes is not None:
        arr = arr[: max_bytes // 2]
    return arr


def _is_nanogpt_folder(path: Path) -> bool:
    return path.is_dir() and (path / "train.bin").is_file() and (path / "val.bin").is_file()


def _load_one(path: Path, max_bytes: int | None) -> np.ndarray:
    """A single existing source (file or folder) -> tokens (no nanoGPT split handling)."""
    if path.suffix == ".bin" and not path.is_dir():
        return _load_bin(path, max_bytes)
    _checked_tokens(path, max_bytes)  # empty files and folders are named here
    if path.is_dir():
        return _bytes_to_tokens(
            _concat_capped((f.read_bytes() for f in _folder_text_files(path)), max_bytes)
        )
    with path.open("rb") as fh:
        return _bytes_to_tokens(fh.read() if max_bytes is None else fh.read(max_bytes))


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


def load_splits(
    path: str | None, max_bytes: int | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Load a corpus source as ``(tokens, None)``, or as memory-mapped ``(train, val)`` for a
    nanoGPT folder (``train.bin`` + ``val.bin``, ``max_bytes`` capping each); other sources as in
    `load_tokens`."""
    if path is not None and _is_nanogpt_folder(Path(path)):
        folder = Path(path)
        return _load_bin(folder / "train.bin", max_bytes), _load_bin(folder / "val.bin", max_bytes)
    return load_tokens(path, max_bytes), None


def load_tokens(path: str | None, max_bytes: int | None = None) -> np.ndarray:
    """Load a corpus source as one uint16 token array (byte tokens, or nanoGPT ids for ``.bin``):
    ``None`` (the embedded default corpus, capped at ``max_bytes`` or `DEFAULT_CORPUS_MAX_BYTES`), a
    text file, a folder (text files below it in sorted order; binaries and hidden entries skipped),
    a nanoGPT ``.bin`` (memory-mapped) or folder (train then val, a copy; `load_splits` keeps the
    split), or a comma-separated list of non-nanoGPT sources."""
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


def check_source(path: str | None, max_bytes: int | None = None) -> tuple[int, int | None]:
    """Raise what `load_tokens` would (missing path, empty file or folder, a ``.bin`` that is not
    whole uint16 tokens, a non-positive cap) from file sizes and names alone, without reading
    tokens. Returns (tokens, val tokens if the source holds its own split, else None) as
    `load_splits` would load them (the default corpus: its cap)."""
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"data.max_bytes={max_bytes} must be positive (or none for no cap)")
    if path is None:
        return (DEFAULT_CORPUS_MAX_BYTES if max_bytes is None else max_bytes), None
    sources = _split_sources(path)
    if len(sources) == 1 and _is_nanogpt_folder(sources[0]):
        train, val = (
            _checked_tokens(sources[0] / name, max_bytes) for name in ("train.bin", "val.bin")
        )
        return train, val
    return sum(_checked_tokens(p, max_bytes) for p in sources), None


def binary_share(path: str | None, sample_bytes: int = 1 << 16) -> tuple[float, str] | None:
    """For a text source: the share of bytes in the first ``sample_bytes`` of its first file that
    are neither printable ASCII, common whitespace nor part of valid UTF-8 — high for random or
    binary data fed as text — and that file's name. None for the default corpus and ``.bin`` token
    files."""
    if path is None:
        return None
    for src in _split_sources(path):
        if _is_nanogpt_folder(src):
            continue
        files = [f for f in _folder_text_files(src) if f.stat().st_size] if src.is_dir() else [src]
        for f in files:
            if f.suffix == ".bin":
                continue
            data = f.read_bytes()[:sample_bytes]
            if not data:
                continue
            text = data.decode("utf-8", errors="replace")
            bad = text.count("\ufffd") + sum(1 for c in text if ord(c) < 32 and c not in "\n\r\t\f")
            return bad / max(len(text), 1), str(f)
    return None


def _readable(files: list[Path]) -> None:
    """Every file the workers will read can be read (else a `PermissionError` naming it, before they
    start)."""
    for f in files:
        if not os.access(f, os.R_OK):
            raise PermissionError(errno.EACCES, "not readable (permission denied)", str(f))


def _checked_tokens(p: Path, max_bytes: int | None) -> int:
    cap = max_bytes if max_bytes is not None else float("inf")
    if p.is_dir():
        files = [f for f in _folder_text_files(p) if f.stat().st_size]
        if not files:
            raise ValueError(f"empty corpus: folder {str(p)!r} contains no non-empty text files")
        _readable(files)
        return int(
            min(sum(f.stat().st_size for f in files) + len(SEPARATOR) * (len(files) - 1), cap)
        )
    _readable([p])
    size = p.stat().st_size
    if size == 0:
        raise ValueError(f"empty corpus: file {str(p)!r} is empty")
    if p.suffix == ".bin":
        if size % 2:
            raise ValueError(f"{str(p)!r} has {size} bytes, not a whole number of uint16 tokens")
        return int(min(size, cap) // 2)
    return int(min(size, cap))
