"""The prepared-token format (``fivefold prepare``'s output) and its reader: `read_index` checks a
prepared directory's ``index.json`` against the files it names, `ShardedTokens` reads one split's
shards as one read-only virtual token array (each shard memory-mapped), which `TokenDataset` takes
where it takes a numpy array.

A prepared directory holds, per split (``train``, ``val``) and per unit of work that gave the
split documents, two raw little-endian files: ``{split}-{unit:06d}.tokens`` (the token ids, dtype
``uint16`` when the tokenizer's vocabulary has at most 65,536 ids, else ``uint32``; an end-of-
document id after every document) and ``{split}-{unit:06d}.offsets`` (``int64``, each document's
start offset inside that shard). ``index.json`` names them with their token and document counts
and largest id, and records the tokenizer (spec, file name, sha256 fingerprint, vocabulary, EOS and
BOS ids), the dtype, the totals, the inputs and the settings they were prepared with. It is written
last: a directory without it is not (yet) prepared. Nothing here runs code from the files read;
every file name the index gives stays inside its directory (`fivefold.paths.inside`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fivefold.paths import PathOutside, inside

__all__ = [
    "FORMAT",
    "INDEX",
    "SPLITS",
    "VERSION",
    "Index",
    "IndexError_",
    "ShardInfo",
    "ShardedTokens",
    "SplitInfo",
    "dtype_for",
    "read_index",
]

FORMAT = "fivefold-tokens"
VERSION = 1
INDEX = "index.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
OFFSET_DTYPE = np.dtype("<i8")


class IndexError_(ValueError):  # noqa: N801 - not the builtin IndexError
    """A prepared directory that cannot be read: the message names the file and what is wrong."""


def dtype_for(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits in 16 bits, else
    ``"uint32"``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class ShardInfo:
    file: str  # the tokens file, relative to the directory
    offsets: str  # the document offsets file (int64, relative to this shard)
    tokens: int
    documents: int
    max_token_id: int


@dataclass(frozen=True)
class SplitInfo:
    tokens: int
    documents: int
    max_token_id: int  # -1 for an empty split
    shards: tuple[ShardInfo, ...]


@dataclass(frozen=True)
class Index:
    """A checked ``index.json``: the files it names exist, inside ``directory``, with the sizes it
    says."""

    directory: Path
    format: str
    version: int
    tokenizer: dict[str, Any]
    dtype: str
    splits: dict[str, SplitInfo]
    max_token_id: int
    val_fraction: float
    seed: int
    inputs: tuple[str, ...]
    text_field: str
    skipped_documents: int
    raw: dict[str, Any]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.splits.values())

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.splits.values())

    @property
    def shards(self) -> int:
        return sum(len(s.shards) for s in self.splits.values())


def _int(value: Any, what: str, where: Path, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise IndexError_(f"{where}: {what} is {value!r}, not an integer >= {low}")
    return value


def read_index(directory: str | Path) -> Index:
    """Read and check ``directory/index.json``: its format and version, the dtype, every file name
    (inside ``directory``), every file's size (token count × item size, document count × 8) and the
    totals. Any mismatch is one `IndexError_` line naming the file."""
    directory = Path(directory)
    path = directory / INDEX
    if not path.is_file():
        what = "is not a directory" if not directory.is_dir() else f"holds no {INDEX}"
        raise IndexError_(
            f"{directory} {what}: name a directory written by `fivefold prepare` (an unfinished "
            "one is completed by running the same prepare command again)"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise IndexError_(f"{path} is not JSON ({e}): prepare the directory again") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise IndexError_(f"{path}: format {got!r}, not {FORMAT!r}: not a prepared directory")
    if raw.get("version") != VERSION:
        raise IndexError_(
            f"{path}: format version {raw.get('version')!r}; this fivefold reads version "
            f"{VERSION}: prepare the inputs again with this fivefold"
        )
    dtype = raw.get("dtype")
    if dtype not in DTYPES:
        raise IndexError_(f"{path}: dtype {dtype!r}, not one of {sorted(DTYPES)}")
    tok = raw.get("tokenizer")
    if not isinstance(tok, dict):
        raise IndexError_(f"{path}: no tokenizer record")
    vocab = _int(tok.get("vocab_size"), "tokenizer.vocab_size", path, 1)
    if dtype == "uint16" and vocab > 1 << 16:
        raise IndexError_(f"{path}: vocab_size {vocab} does not fit dtype {dtype}")
    itemsize = DTYPES[dtype].itemsize
    splits_raw = raw.get("splits")
    if not isinstance(splits_raw, dict) or set(splits_raw) != set(SPLITS):
        raise IndexError_(f"{path}: splits must be exactly {list(SPLITS)}")
    splits: dict[str, SplitInfo] = {}
    for name in SPLITS:
        s = splits_raw[name]
        if not isinstance(s, dict) or not isinstance(s.get("shards"), list):
            raise IndexError_(f"{path}: split {name!r} has no shard list")
        shards = []
        for i, sh in enumerate(s["shards"]):
            where = f"{name} shard {i}"
            if not isinstance(sh, dict):
                raise IndexError_(f"{path}: {where} is not an object")
            info = ShardInfo(
                file=sh.get("file"),
                offsets=sh.get("offsets"),
                tokens=_int(sh.get("tokens"), f"{where}'s tokens", path, 1),
                documents=_int(sh.get("documents"), f"{where}'s documents", path, 1),
                max_token_id=_int(sh.get("max_token_id"), f"{where}'s max_token_id", path),
            )
            for key, count, size in (
                ("file", info.tokens, itemsize),
                ("offsets", info.documents, OFFSET_DTYPE.itemsize),
            ):
                try:
                    f = inside(directory, getattr(info, key), f"{path}'s {where} {key}")
                except PathOutside as e:
                    raise IndexError_(str(e)) from None
                if not f.is_file():
                    raise IndexError_(f"{path}: {where}'s {key} {f.name} is missing")
                if f.stat().st_size != count * size:
                    raise IndexError_(
                        f"{f}: {f.stat().st_size} bytes, but {INDEX} says {count} x {size} = "
                        f"{count * size}: the file is truncated or changed; prepare again"
                    )
            if info.max_token_id >= vocab:
                raise IndexError_(f"{path}: {where}'s max_token_id is outside the vocabulary")
            shards.append(info)
        totals = (
            sum(x.tokens for x in shards),
            sum(x.documents for x in shards),
            max((x.max_token_id for x in shards), default=-1),
        )
        if (s.get("tokens"), s.get("documents"), s.get("max_token_id")) != totals:
            raise IndexError_(
                f"{path}: split {name!r}'s totals (tokens, documents, max_token_id) are not its "
                f"shards' {totals}"
            )
        splits[name] = SplitInfo(*totals, tuple(shards))
    max_id = max(s.max_token_id for s in splits.values())
    if raw.get("max_token_id") != max_id:
        raise IndexError_(f"{path}: max_token_id is not its splits' largest, {max_id}")
    inputs = raw.get("inputs", [])
    return Index(
        directory=directory,
        format=FORMAT,
        version=VERSION,
        tokenizer=tok,
        dtype=dtype,
        splits=splits,
        max_token_id=max_id,
        val_fraction=float(raw.get("val_fraction", 0.0)),
        seed=int(raw.get("seed", 0)),
        inputs=tuple(str(i) for i in inputs) if isinstance(inputs, list) else (),
        text_field=str(raw.get("text_field", "text")),
        skipped_documents=int(raw.get("skipped_documents", 0)),
        raw=raw,
    )


class ShardedTokens:
    """One split of a prepared directory as ONE read-only token array: ``len``, an integer,
    a slice ``a[i:j]``, or an int64 index array of any shape (windows may straddle shards: each
    global index goes to its shard by `np.searchsorted` over the shards' starts), ``.dtype``,
    ``.max()`` (from the index, no scan) and `document_offsets` (each document's global start).
    Each shard is an ``np.memmap`` opened read-only when first read."""

    def __init__(self, source: str | Path | Index, split: str = "train") -> None:
        index = source if isinstance(source, Index) else read_index(source)
        if split not in index.splits:
            raise ValueError(f"split {split!r}: a prepared directory holds {list(SPLITS)}")
        self.index, self.split = index, split
        self.info = index.splits[split]
        self.dtype = DTYPES[index.dtype]
        sizes = np.array([s.tokens for s in self.info.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._maps: list[np.memmap | None] = [None] * len(self.info.shards)
        self.shape = (int(self.starts[-1]),)
        self.ndim = 1

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _shard(self, i: int) -> np.memmap:
        m = self._maps[i]
        if m is None:
            path = self.index.directory / self.info.shards[i].file
            m = self._maps[i] = np.memmap(path, dtype=self.dtype, mode="r")
        return m

    def max(self) -> int:
        """The largest token id of the split (recorded in the index); ``ValueError`` when empty."""
        if not len(self):
            raise ValueError(f"the {self.split} split of {self.index.directory} is empty")
        return self.info.max_token_id

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[0 : len(self)]
        return out if dtype is None else out.astype(dtype)

    def _gather(self, flat: np.ndarray) -> np.ndarray:
        n = len(self)
        flat = np.where(flat < 0, flat + n, flat)
        if flat.size and (flat.min() < 0 or flat.max() >= n):
            raise IndexError(f"index out of range for {n} tokens of the {self.split} split")
        out = np.empty(flat.shape, dtype=self.dtype)
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        for s in np.unique(shard):
            sel = shard == s
            out[sel] = self._shard(int(s))[flat[sel] - self.starts[s]]
        return out

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            lo, hi, step = key.indices(len(self))
            if step != 1:
                return self._gather(np.arange(lo, hi, step, dtype=np.int64))
            if hi <= lo:
                return np.zeros(0, dtype=self.dtype)
            first = int(np.searchsorted(self.starts, lo, side="right")) - 1
            last = int(np.searchsorted(self.starts, hi - 1, side="right")) - 1
            parts = [
                self._shard(s)[max(lo - self.starts[s], 0) : min(hi, self.starts[s + 1])
                               - self.starts[s]]
                for s in range(first, last + 1)
            ]  # fmt: skip
            return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])
        if isinstance(key, (int, np.integer)):
            return self._gather(np.array([int(key)], dtype=np.int64))[0]
        idx = np.asarray(key)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"index ShardedTokens with integers or a slice, not {idx.dtype}")
        return self._gather(idx.astype(np.int64).reshape(-1)).reshape(idx.shape)

    def document_offsets(self) -> np.ndarray:
        """Every document's start offset in this split (int64, increasing, the first 0)."""
        parts = []
        for i, sh in enumerate(self.info.shards):
            local = np.fromfile(self.index.directory / sh.offsets, dtype=OFFSET_DTYPE)
            bad = len(local) != sh.documents or (
                len(local)
                and (local[0] != 0 or np.any(np.diff(local) <= 0) or local[-1] >= sh.tokens)
            )
            if bad:
                raise IndexError_(
                    f"{self.index.directory / sh.offsets}: document offsets are not increasing "
                    f"from 0 inside {sh.tokens} tokens: prepare again"
                )
            parts.append(local.astype(np.int64) + self.starts[i])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def document_ends(self) -> np.ndarray:
        """Where each document's end-of-document token sits (int64, increasing): the token before
        the next document's start, and the split's last token (every document ends with one, and
        prepare encodes text as text, so no other token is the end-of-document id)."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        return np.append(self.document_offsets()[1:], len(self)) - 1

    def __repr__(self) -> str:
        return (
            f"ShardedTokens({self.index.directory}, {self.split}: {len(self):,} tokens in "
            f"{len(self.info.shards)} shards, {self.index.dtype})"
        )
