"""What a run reads, resolved before any worker starts (`resolve_data`) and opened in each worker
(`open_dataset`): the tokenizer, the model's vocabulary, the token source and how its documents
meet (docs/data.md).

The tokenizer is ``data.tokenizer`` when given, else the one a prepared directory's index names,
else ``model.init_from``'s own (a Hugging Face directory holding a ``tokenizer.json``), else the
bytes. The model's vocabulary is then the tokenizer's, padded to a multiple of 64 × tp (rows no id
uses, said at start-up); a Hugging Face model keeps its own and must hold the tokenizer's ids. Every
disagreement — a data id at or above the vocabulary, a prepared directory made with another
tokenizer, a checkpoint or a model directory trained with another — is one line naming both sides,
before spawning. A nanoGPT ``.bin`` with no tokenizer keeps the old rule (the vocabulary grows to
its largest id, rounded up to 64), now said and decided before spawning."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fivefold.config import Config, ConfigError
from fivefold.models import LlamaConfig
from fivefold.train.corpus import (
    DEFAULT_CORPUS_MAX_BYTES,
    _folder_text_files,
    _is_nanogpt_folder,
    _split_sources,
    _stdlib_files,
    check_source,
    load_splits,
)
from fivefold.train.tokenizer import (
    TokenizerError,
    TokenizerInfo,
    load_tokenizer,
    tokenizer_info,
)

__all__ = ["DataPlan", "VOCAB_MULTIPLE", "is_prepared", "open_dataset", "resolve_data"]

VOCAB_MULTIPLE = 64  # a padded vocabulary is a multiple of this × tp (matmul-friendly rows)
_SCAN_CHUNK = 1 << 24  # tokens read at a time when a .bin's largest id is looked for


@dataclass(frozen=True)
class DataPlan:
    """The data a run trains on, as `resolve_data` decided it (carried to the workers in the
    `RunPlan`)."""

    kind: str  # "prepared" | "text" | "nanogpt" | "default"
    tokenizer: TokenizerInfo
    tokenizer_from: str  # which key or file named the tokenizer
    max_id: int | None  # the data's largest id (None: not known before loading: below the vocab)
    documents: str = "cross"  # data.documents
    loss_across_documents: bool = True

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_id


def is_prepared(path: str | None) -> bool:
    """`path` is a directory `fivefold prepare` wrote (or is writing: its prepare.json present
    without an index.json, which `shards.read_index` then names), never text to read."""
    return path is not None and any(
        (Path(path) / name).is_file() for name in ("index.json", "prepare.json")
    )


def _padded(vocab: int, tp: int) -> int:
    multiple = VOCAB_MULTIPLE * tp // math.gcd(VOCAB_MULTIPLE, tp)
    return -(-vocab // multiple) * multiple


def _load_info(spec: str) -> TokenizerInfo:
    try:
        return tokenizer_info(load_tokenizer(spec), spec)
    except TokenizerError as e:
        raise ConfigError(str(e)) from None


def _init_from_tokenizer(init_from: str) -> str | None:
    """The tokenizer a Hugging Face model directory holds (its tokenizer.json), if any."""
    return init_from if init_from and (Path(init_from) / "tokenizer.json").is_file() else None


def _bin_max_id(path: str, max_bytes: int | None) -> int:
    """The largest id of a nanoGPT source (train and val), read in chunks of a memory map."""
    train, val = load_splits(path, max_bytes)
    top = 0
    for arr in (train, val) if val is not None else (train,):
        for lo in range(0, len(arr), _SCAN_CHUNK):
            top = max(top, int(np.asarray(arr[lo : lo + _SCAN_CHUNK]).max()))
    return top


def resolve_data(
    cfg: Config,
    model: LlamaConfig,
    tp: int,
    checkpoint_meta: dict | None = None,
) -> tuple[DataPlan, LlamaConfig, list[str]]:
    """The run's `DataPlan`, the model with its vocabulary decided, and what was changed (notes);
    `ConfigError` (one line naming both sides) on any disagreement. ``checkpoint_meta``: the
    metadata of the checkpoint a resume continues."""
    d, notes = cfg.data, []
    init_from = cfg.model.init_from
    index = None
    if is_prepared(d.path):
        from fivefold.train.shards import read_index

        try:
            index = read_index(Path(d.path))
        except ValueError as e:
            raise ConfigError(f"data.path: {e}") from None
        kind = "prepared"
    elif d.path is None:
        kind = "default"
    else:
        sources = _split_sources(d.path)
        is_bin = len(sources) == 1 and (
            _is_nanogpt_folder(sources[0]) or sources[0].suffix == ".bin"
        )
        kind = "nanogpt" if is_bin else "text"
    given = d.tokenizer
    prepared_tok = TokenizerInfo.from_dict(index.tokenizer) if index is not None else None
    if given:
        tok, source = _load_info(given), "data.tokenizer"
        if prepared_tok is not None and not tok.same_as(prepared_tok):
            raise ConfigError(
                f"data.tokenizer={given} is {tok.describe()}, but {d.path} was prepared with "
                f"{prepared_tok.describe()}: drop data.tokenizer, or prepare the data again with "
                f"--tokenizer {given}"
            )
    elif prepared_tok is not None:
        tok, source = prepared_tok, f"{d.path}/index.json"
    elif (hf := _init_from_tokenizer(init_from)) is not None:
        tok, source = _load_info(hf), "model.init_from"
    else:
        tok, source = _load_info("bytes"), "the default (bytes)"
    hf_dir = _init_from_tokenizer(init_from)
    if hf_dir is not None and source != "model.init_from":
        own = _load_info(hf_dir)
        if not tok.same_as(own):
            raise ConfigError(
                f"model.init_from={init_from} was trained with its tokenizer {own.describe()}, "
                f"but the data's tokenizer (from {source}) is {tok.describe()}: train on data "
                f"tokenized by {init_from}'s tokenizer (fivefold prepare --tokenizer {init_from})"
            )
    if checkpoint_meta and checkpoint_meta.get("tokenizer"):
        saved = TokenizerInfo.from_dict(checkpoint_meta["tokenizer"])
        if not tok.same_as(saved):
            raise ConfigError(
                f"the checkpoint was trained with tokenizer {saved.describe()}, this run's (from "
                f"{source}) is {tok.describe()}: resume with the same tokenizer and data"
            )
    if hf_dir is None and init_from:
        notes.append(
            f"model.init_from={init_from} holds no tokenizer.json: the data's tokenizer "
            f"({tok.describe()}) could not be checked against the model's own"
        )
    if checkpoint_meta and not checkpoint_meta.get("tokenizer"):
        notes.append(
            "the checkpoint records no tokenizer (saved before fivefold recorded one): this run's "
            f"tokenizer, {tok.describe()}, could not be checked against it"
        )
    if kind in ("text", "default") and tok.fingerprint != "bytes" and tok.eos_id is None:
        raise ConfigError(
            f"data.path is text, tokenized one document per file with an end-of-document token "
            f"between them, and the tokenizer {tok.describe()} has none: give one that has (or "
            "fivefold prepare the text with one)"
        )
    if (d.documents == "mask" or not d.loss_across_documents) and tok.eos_id is None:
        key = "data.documents=mask" if d.documents == "mask" else "data.loss_across_documents=false"
        raise ConfigError(
            f"{key} needs an end-of-document token, and the tokenizer {tok.describe()} has none: "
            "give data.tokenizer a tokenizer with one and data it prepared (fivefold prepare)"
        )
    if kind == "prepared":
        max_id = int(index.max_token_id)
    elif kind == "nanogpt":
        max_id = _bin_max_id(d.path, d.max_bytes)
    elif tok.fingerprint == "bytes":
        max_id = tok.vocab_size - 1  # text read as bytes: any byte may come
    else:
        max_id = None  # text tokenized by the tokenizer: its ids lie below its vocabulary
    vocab, fixed = model.vocab_size, bool(init_from) or bool(checkpoint_meta)
    if checkpoint_meta and "vocab_size" in checkpoint_meta.get("model", {}):
        vocab = int(checkpoint_meta["model"]["vocab_size"])  # (a grown one too)
        if vocab % tp:
            raise ConfigError(
                f"the checkpoint's vocabulary of {vocab:,} rows does not divide over tp={tp}: "
                "resume it with a tp that divides it"
            )
    if fixed:
        fixed_by = "model.init_from's config.json" if init_from else "the checkpoint"
        if tok.fingerprint != "bytes" and tok.vocab_size > vocab:
            raise ConfigError(
                f"the tokenizer {tok.describe()} has {tok.vocab_size:,} ids, more than the model's "
                f"vocabulary of {vocab:,} ({fixed_by}): use the model's own tokenizer"
            )
    elif tok.fingerprint != "bytes":
        vocab = _padded(tok.vocab_size, tp)
        if vocab != tok.vocab_size:
            notes.append(
                f"model vocabulary {vocab:,}: the tokenizer's {tok.vocab_size:,} ids padded to a "
                f"multiple of {VOCAB_MULTIPLE}"
                + (f" and of tp={tp}" if tp > 1 else "")
                + " (rows no id uses)"
            )
    if max_id is not None and max_id >= vocab:
        where = f"data.path={d.path!r}"
        if fixed or tok.fingerprint != "bytes":
            raise ConfigError(
                f"{where} holds token id {max_id:,}, at or above the model's vocabulary of "
                f"{vocab:,}"
                + (f" (the tokenizer {tok.describe()})" if tok.fingerprint != "bytes" else "")
                + ": the data was made with another tokenizer; prepare it with this model's"
            )
        grown = _padded(max_id + 1, tp)
        notes.append(
            f"model vocabulary {grown:,}: {where} holds ids up to {max_id:,} and names no "
            "tokenizer (the largest id + 1 rounded up to 64); set data.tokenizer to take the "
            "vocabulary from the tokenizer"
        )
        vocab = grown
    if vocab != model.vocab_size:
        model = LlamaConfig(**{**model.__dict__, "vocab_size": vocab}).validate()
    plan = DataPlan(kind, tok, source, max_id, d.documents, d.loss_across_documents)
    return plan, model, notes


def _text_documents(path: str | None, max_bytes: int | None) -> list[str]:
    """The documents of a text source: one per file (the default corpus: each stdlib source), read
    as UTF-8, ``max_bytes`` capping the bytes read in all."""
    if path is None:
        files = _stdlib_files()
        max_bytes = DEFAULT_CORPUS_MAX_BYTES if max_bytes is None else max_bytes
    else:
        files = []
        for src in _split_sources(path):
            files += _folder_text_files(src) if src.is_dir() else [src]
    docs, left = [], max_bytes
    for f in files:
        if left is not None and left <= 0:
            break
        try:
            data = f.read_bytes() if left is None else f.read_bytes()[:left]
        except OSError:  # the default corpus skips an unreadable file (as corpus.py does)
            if path is None:
                continue
            raise
        if data:
            docs.append(data.decode("utf-8", errors="replace"))
            left = None if left is None else left - len(data)
    return docs


def tokenize_documents(docs: list[str], spec: str, eos_id: int) -> np.ndarray:
    """Each document's ids followed by the end-of-document id, concatenated (uint32)."""
    tok = load_tokenizer(spec)
    parts = []
    for text in docs:
        parts += [np.asarray(tok.encode(text), dtype=np.uint32), np.array([eos_id], np.uint32)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint32)


def data_tokens(cfg: Config, data: DataPlan) -> tuple[int, int | None]:
    """(tokens, validation tokens when the source holds its own split) as `open_dataset` would
    load them: a prepared directory's from its index, a text source's by tokenizing it (what a
    worker does again: text is for small corpora; `fivefold prepare` the rest), else from file
    sizes (`corpus.check_source`)."""
    d = cfg.data
    if data.kind == "prepared":
        from fivefold.train.shards import read_index

        index = read_index(Path(d.path))
        return index.splits["train"].tokens, index.splits["val"].tokens
    if data.kind in ("text", "default") and data.tokenizer.fingerprint != "bytes":
        docs = _text_documents(d.path, d.max_bytes)
        return len(tokenize_documents(docs, data.tokenizer.spec, int(data.eos_id))), None
    return check_source(d.path, d.max_bytes)


def open_dataset(cfg: Config, data: DataPlan):  # noqa: ANN201 - a TokenDataset
    """This worker's `TokenDataset` for the plan: shards memory-mapped, a text source tokenized
    here (the same on every rank), bytes as before; with the document rules the plan carries."""
    from fivefold.train.data import TokenDataset

    d, t = cfg.data, cfg.train
    if data.kind == "prepared":
        ds = TokenDataset.from_prepared(d.path, t.seq_len, seed=t.seed)
    elif data.kind in ("text", "default") and data.tokenizer.fingerprint != "bytes":
        tokens = tokenize_documents(
            _text_documents(d.path, d.max_bytes), data.tokenizer.spec, int(data.eos_id)
        )
        source = repr(d.path) if d.path is not None else "<default: Python stdlib sources>"
        ds = TokenDataset(tokens, t.seq_len, d.val_fraction, t.seed, source=source)
    else:
        ds = TokenDataset.from_path(d.path, t.seq_len, d.val_fraction, t.seed, d.max_bytes)
    if not data.loss_across_documents:
        ds.ignore_targets_after(int(data.eos_id))
    return ds
