"""Tokenizers a run can name (issue 29's ``data.tokenizer``): the bytes, a Hugging Face
``tokenizer.json`` (the `tokenizers` library) or a directory holding one (what ``save_pretrained``
writes: a model directory works), or a tiktoken BPE file. `load_tokenizer` reads one from local
files only (no download); every tokenizer says its vocabulary size, its end- and beginning-of-
document ids and a fingerprint of its files, so token shards and checkpoints can name the
tokenizer they were made with. A name that is none of these, or a library that is not installed,
is one line saying what to change.

`TokenizerInfo` is what a run, an index and a checkpoint record of one (no file is reopened to
compare two). Text is encoded as text: a special token's spelling inside a document (say
``<|endoftext|>``) is not the special token, so an end-of-document id only ever ends a document."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:  # imported when "bytes" is asked for: corpus imports torch, prepare's workers not
    from fivefold.train.corpus import ByteTokenizer

__all__ = [
    "HFTokenizer",
    "TiktokenBPE",
    "Tokenizer",
    "TokenizerError",
    "TokenizerInfo",
    "load_tokenizer",
    "tokenizer_info",
]

# the names tokenizers give their end-of-document token, most specific first
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "<|eos|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>")
# cl100k's split pattern: the default for a bare tiktoken BPE file
TIKTOKEN_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)


class TokenizerError(ValueError):
    """A tokenizer that cannot be read: the message says which file and what to change."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    fingerprint: str  # sha256 of the files it was read from ("bytes" for the byte tokenizer)

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


def _sha256(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def _id_of(names: Iterable[str], vocab: dict[str, int]) -> int | None:
    return next((vocab[n] for n in names if n in vocab), None)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json``; its end/beginning-of-document tokens are those a
    ``tokenizer_config.json`` beside it names (``eos_token``, ``bos_token``), else the usual names
    among its special tokens."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise TokenizerError(
                "data.tokenizer: a Hugging Face tokenizer needs the tokenizers library: "
                "pip install tokenizers"
            ) from None
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as e:  # the library's own message says what is wrong in the file
            raise TokenizerError(f"data.tokenizer: {path} is not a tokenizer.json ({e})") from None
        self._tok.encode_special_tokens = True  # "<|endoftext|>" in a document is text
        self.name, self.path = str(path), path
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        config = _tokenizer_config(path.parent)
        self.eos_id = _id_of([*_token_names(config.get("eos_token")), *EOS_NAMES], vocab)
        self.bos_id = _id_of([*_token_names(config.get("bos_token")), *BOS_NAMES], vocab)
        self.fingerprint = _sha256(path)

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode` of each text, in one call into the library."""
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        out = batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in out]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return {}
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise TokenizerError(f"data.tokenizer: {config} is not JSON ({e})") from None


def _token_names(value: Any) -> list[str]:
    """``eos_token`` as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return [value["content"]]
    return []


class TiktokenBPE:
    """A tiktoken BPE file (lines of base64 token and rank), split by cl100k's pattern; the
    end-of-document token is added after the ranks as ``<|endoftext|>``."""

    def __init__(self, path: Path) -> None:
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError(
                "data.tokenizer: a tiktoken BPE file needs the tiktoken library: "
                "pip install tiktoken"
            ) from None
        ranks = _read_bpe(path)
        eos = "<|endoftext|>"
        self._enc = tiktoken.Encoding(
            name=path.stem,
            pat_str=TIKTOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={eos: len(ranks)},
        )
        self.name, self.path = str(path), path
        self.vocab_size = self._enc.n_vocab
        self.eos_id, self.bos_id = len(ranks), None
        self.fingerprint = _sha256(path)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """`encode` of each text, in one call into the library."""
        out = self._enc.encode_ordinary_batch(texts, num_threads=1)
        return [np.asarray(ids, dtype=np.int64) for ids in out]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def __repr__(self) -> str:
        return f"TiktokenBPE({self.name}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def _read_bpe(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file's ranks, read here (tiktoken's own loader caches files by their path in
    a temporary directory, which the fingerprint would not cover): one base64 token and its rank
    per line, the ranks 0 .. n-1 (the end-of-document id is n)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise TokenizerError(
                f"data.tokenizer: {path} is not a tiktoken BPE file (lines of base64 token and "
                f"rank): line {number}"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(
            f"data.tokenizer: {path}'s ranks are not 0 .. {len(ranks) - 1} (gaps or repeats): the "
            "end-of-document id after them would collide with a token"
        )
    return ranks


@dataclass(frozen=True)
class TokenizerInfo:
    """What identifies a tokenizer: the spec it was named by, its file's name, sha256, vocabulary
    and special ids."""

    spec: str
    name: str
    fingerprint: str
    vocab_size: int
    eos_id: int | None
    bos_id: int | None

    def same_as(self, other: TokenizerInfo) -> bool:
        """The same file and the same special ids (the end-of-document id comes from a
        tokenizer_config.json the fingerprint does not cover)."""
        mine = (self.fingerprint, self.vocab_size, self.eos_id, self.bos_id)
        return mine == (other.fingerprint, other.vocab_size, other.eos_id, other.bos_id)

    def describe(self) -> str:
        short = "" if self.fingerprint == "bytes" else f", sha256 {self.fingerprint[:12]}"
        eos = "" if self.eos_id is None else f", end-of-document id {self.eos_id}"
        return f"{self.name} (vocabulary {self.vocab_size:,}{short}{eos})"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenizerInfo:
        """From a checkpoint's or an index's record (``dataclasses.asdict`` of one)."""
        return cls(
            str(d.get("spec", d.get("name", "?"))),
            str(d.get("name", "?")),
            str(d.get("fingerprint", d.get("sha256", "?"))),
            int(d["vocab_size"]),
            None if d.get("eos_id") is None else int(d["eos_id"]),
            None if d.get("bos_id") is None else int(d["bos_id"]),
        )


def tokenizer_info(tok: Tokenizer | ByteTokenizer, spec: str) -> TokenizerInfo:
    """The record of a loaded tokenizer (the bytes: fingerprint "bytes", no special ids)."""
    if not hasattr(tok, "fingerprint"):  # the bytes (`corpus.ByteTokenizer`)
        return TokenizerInfo("bytes", "bytes", "bytes", tok.vocab_size, None, None)
    return TokenizerInfo(
        spec, Path(tok.name).name, tok.fingerprint, tok.vocab_size, tok.eos_id, tok.bos_id
    )


def load_tokenizer(spec: str) -> Tokenizer | ByteTokenizer:
    """``"bytes"``, a ``tokenizer.json``, a directory holding one, or a tiktoken BPE file."""
    if spec == "bytes":
        from fivefold.train.corpus import ByteTokenizer

        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return HFTokenizer(path / "tokenizer.json")
        raise TokenizerError(
            f"data.tokenizer: {path} holds no tokenizer.json; name a tokenizer.json, a directory "
            "holding one (save_pretrained's), a tiktoken BPE file, or bytes"
        )
    if not path.is_file():
        raise TokenizerError(
            f"data.tokenizer: {spec} is neither a file nor a directory; name a tokenizer.json, a "
            "directory holding one, a tiktoken BPE file, or bytes"
        )
    head = path.read_bytes()[:1]
    return HFTokenizer(path) if head == b"{" else TiktokenBPE(path)
