"""``fivefold prepare``: text in, token shards out (the format of `fivefold.train.shards`).

`prepare` reads its inputs — a text file (one document), a folder (the text files below it, one
document each, sorted, hidden entries skipped; JSONL and Parquet files and saved datasets found in
it are read as such), a ``.jsonl``/``.json`` file (one JSON object per line, its ``text_field``), a
``.parquet`` file (its ``text_field`` column, streamed by row group), or a directory written by
`datasets`' ``save_to_disk`` (a ``Dataset``; of a ``DatasetDict`` its ``train`` split, or, without
one, every split in sorted order) — and writes token shards with the tokenizer's end-of-document
id after every document. Empty documents are skipped (and counted).

Units of work. The inputs are cut into deterministic units: a run of text files (up to
``unit_docs`` files or ``unit_bytes`` bytes), a byte range of a JSONL file (``unit_bytes``, cut at
line ends), a Parquet row group, ``unit_docs`` rows of a saved dataset. A unit is streamed (no
unit holds a whole file's tokens) and writes its own shards (``train-{unit:06d}.tokens`` and
``.offsets``, the same for ``val``), so the output is the same, byte for byte, for 1 worker and N
(``workers`` processes, the "spawn" context, ``TOKENIZERS_PARALLELISM=false`` in each).

The split, by document. Document ``i`` of unit ``u`` (``i`` counts the unit's records, empty ones
included) goes to ``val`` when ``splitmix64(splitmix64(splitmix64(seed) ^ u) + i) / 2**64 <
val_fraction``. If that picks no document while there are at least two and ``val_fraction > 0``,
the last training document (the last one of the last unit with training documents) is moved to
``val``, so a validation split always exists.

Resume. ``prepare.json`` in the output directory records the settings (format version, tokenizer
fingerprint, inputs and their files' sizes and times, text field, val_fraction, seed, unit sizes);
each finished unit writes its shards atomically (temporary name, fsync, rename), then a done record
(``done/{unit:06d}.json``). A re-run with the same settings skips the done units and ends with the
same bytes as a run never stopped; with other settings it is refused in one line naming the
setting. ``index.json`` is written last (atomically): its presence means complete.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fivefold.paths import atomic_write_bytes
from fivefold.train.shards import (
    DTYPES,
    FORMAT,
    INDEX,
    OFFSET_DTYPE,
    VERSION,
    Index,
    IndexError_,
    dtype_for,
    read_index,
)

__all__ = ["DEFAULT_VAL_FRACTION", "PrepareError", "Unit", "plan_units", "prepare", "val_mask"]

DEFAULT_VAL_FRACTION = 0.005
UNIT_BYTES = 64 << 20
UNIT_DOCS = 100_000
MANIFEST = "prepare.json"
DONE = "done"
BATCH = 1024  # documents per call into the tokenizer
_M64 = (1 << 64) - 1


class PrepareError(ValueError):
    """Inputs or settings prepare refuses: the message says what to change."""


# --- the split ------------------------------------------------------------------------------------


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def val_mask(seed: int, unit: int, indices: np.ndarray, val_fraction: float) -> np.ndarray:
    """Which of the documents ``indices`` of unit ``unit`` go to ``val`` (the module's rule)."""
    key = _splitmix64(np.array([seed & _M64], dtype=np.uint64)) ^ np.uint64(unit & _M64)
    with np.errstate(over="ignore"):
        h = _splitmix64(_splitmix64(key) + np.asarray(indices, dtype=np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53) < val_fraction


# --- units ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One deterministic piece of work: ``kind`` text (``files``, one document each), jsonl (bytes
    ``[start, stop)`` of ``path``), parquet (row groups ``[start, stop)``) or hf (rows ``[start,
    stop)`` of the saved dataset ``path``, its split ``split`` for a DatasetDict)."""

    kind: str
    path: str = ""
    files: tuple[str, ...] = ()
    start: int = 0
    stop: int = 0
    split: str = ""


def _need(module: str) -> Any:
    try:
        return __import__(module)
    except ImportError:
        raise PrepareError(
            f"reading this input needs the {module} library: pip install {module}"
        ) from None


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any(
        (path / n).is_file() for n in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def _folder_inputs(folder: Path) -> list[Path]:
    """What a folder holds, in the order `corpus._folder_text_files` walks it (sorted, hidden and
    ``__pycache__`` skipped): its text files (JSONL among them) and Parquet files, and saved
    datasets below it as one entry each."""
    from fivefold.train.corpus import _is_text_file

    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        if here != folder and _is_saved_dataset(here):
            found.append(here)
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            p = here / name
            if name.startswith(".") or not p.is_file():
                continue
            if p.suffix.lower() == ".parquet" or _is_text_file(p):
                found.append(p)
    return found


def _jsonl_ranges(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
    size = path.stat().st_size
    cuts = [0]
    with path.open("rb") as fh:
        for target in range(unit_bytes, size, unit_bytes):
            if target <= cuts[-1]:
                continue
            fh.seek(target - 1)
            fh.readline()  # to the end of the line holding byte target - 1
            if fh.tell() < size:
                cuts.append(fh.tell())
    cuts.append(size)
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _parquet_units(path: Path, text_field: str) -> list[Unit]:
    _need("pyarrow")
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except Exception as e:
        raise PrepareError(f"{path} is not a Parquet file ({e})") from None
    names = pf.schema_arrow.names
    if text_field not in names:
        raise PrepareError(
            f"{path} has no column {text_field!r} (columns: {', '.join(names)}): name the text "
            "column with --text-field"
        )
    return [Unit("parquet", str(path), start=g, stop=g + 1) for g in range(pf.num_row_groups)]


def _load_saved(path: str, split: str) -> Any:
    _need("datasets")
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:
        raise PrepareError(f"{path} is not a dataset saved by save_to_disk ({e})") from None
    return ds[split] if split else ds


def _hf_units(path: Path, text_field: str, unit_docs: int) -> list[Unit]:
    ds = _load_saved(str(path), "")
    if hasattr(ds, "column_names") and isinstance(ds.column_names, dict):  # a DatasetDict
        splits = ["train"] if "train" in ds else sorted(ds)
        parts = [(s, ds[s]) for s in splits]
    else:
        parts = [("", ds)]
    units = []
    for split, d in parts:
        if text_field not in d.column_names:
            raise PrepareError(
                f"{path}{'[' + split + ']' if split else ''} has no column {text_field!r} "
                f"(columns: {', '.join(d.column_names)}): name the text column with --text-field"
            )
        units += [
            Unit("hf", str(path), start=a, stop=min(a + unit_docs, d.num_rows), split=split)
            for a in range(0, d.num_rows, unit_docs)
        ]
    return units


def plan_units(
    inputs: Sequence[str], text_field: str, unit_bytes: int = UNIT_BYTES, unit_docs: int = UNIT_DOCS
) -> tuple[list[Unit], list[list[Any]]]:
    """The units of ``inputs`` in order, and the files they read with their sizes and times (what
    a resumed run must find unchanged)."""
    units: list[Unit] = []
    files: list[list[Any]] = []
    group: list[str] = []
    group_bytes = 0

    def flush() -> None:
        nonlocal group, group_bytes
        if group:
            units.append(Unit("text", files=tuple(group)))
        group, group_bytes = [], 0

    def one(p: Path) -> None:
        nonlocal group_bytes
        if _is_saved_dataset(p):
            flush()
            units.extend(_hf_units(p, text_field, unit_docs))
            for f in sorted(p.rglob("*")):
                if f.is_file():
                    files.append([str(f), f.stat().st_size, f.stat().st_mtime_ns])
            return
        st = p.stat()
        files.append([str(p), st.st_size, st.st_mtime_ns])
        suffix = p.suffix.lower()
        if suffix in (".jsonl", ".json"):
            flush()
            units.extend(
                Unit("jsonl", str(p), start=a, stop=b) for a, b in _jsonl_ranges(p, unit_bytes)
            )
        elif suffix == ".parquet":
            flush()
            units.extend(_parquet_units(p, text_field))
        else:
            if group and (len(group) >= unit_docs or group_bytes + st.st_size > unit_bytes):
                flush()
            group.append(str(p))
            group_bytes += st.st_size

    for given in inputs:
        p = Path(given)
        if not p.exists():
            raise PrepareError(f"input {given!r} not found: name a text, JSONL or Parquet file, a "
                               "folder, or a dataset saved with save_to_disk")  # fmt: skip
        if p.is_dir() and not _is_saved_dataset(p):
            found = _folder_inputs(p)
            if not found:
                raise PrepareError(f"input folder {given!r} holds no text, JSONL or Parquet files")
            for f in found:
                one(f)
        else:
            one(p)
    flush()
    return units, files


# --- reading documents ----------------------------------------------------------------------------


def _documents(unit: Unit, text_field: str) -> Iterator[list[str | None]]:
    """The unit's records in batches; ``None`` or ``""`` for a record without text (skipped)."""
    if unit.kind == "text":
        for i in range(0, len(unit.files), 64):
            yield [
                Path(f).read_bytes().decode("utf-8", errors="replace")
                for f in unit.files[i : i + 64]
            ]
    elif unit.kind == "jsonl":
        yield from _jsonl_documents(unit, text_field)
    elif unit.kind == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(unit.path)
        groups = list(range(unit.start, unit.stop))
        for batch in pf.iter_batches(batch_size=BATCH, row_groups=groups, columns=[text_field]):
            yield _texts(batch.column(0).to_pylist(), f"{unit.path}'s column {text_field!r}")
    elif unit.kind == "hf":
        ds = _load_saved(unit.path, unit.split).select_columns([text_field])
        for a in range(unit.start, unit.stop, BATCH):
            rows = ds[a : min(a + BATCH, unit.stop)][text_field]
            yield _texts(rows, f"{unit.path}'s column {text_field!r}")
    else:  # pragma: no cover - plan_units makes only the kinds above
        raise AssertionError(unit.kind)


def _texts(values: list[Any], where: str) -> list[str | None]:
    for v in values:
        if v is not None and not isinstance(v, str):
            raise PrepareError(f"{where} holds {type(v).__name__} values, not text: name a text "
                               "column with --text-field")  # fmt: skip
    return values


def _jsonl_documents(unit: Unit, text_field: str) -> Iterator[list[str | None]]:
    batch: list[str | None] = []
    with open(unit.path, "rb") as fh:
        fh.seek(unit.start)
        pos = unit.start
        while pos < unit.stop:
            line = fh.readline()
            if not line:
                break
            at, pos = pos, pos + len(line)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise PrepareError(
                    f"{unit.path}: the line at byte {at} is not JSON ({e}): a JSONL file holds "
                    "one JSON object per line"
                ) from None
            if not isinstance(obj, dict) or text_field not in obj:
                fields = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
                raise PrepareError(
                    f"{unit.path}: the line at byte {at} has no field {text_field!r} (it has: "
                    f"{fields}): name the text field with --text-field"
                )
            batch += _texts([obj[text_field]], f"{unit.path}'s field {text_field!r}")
            if len(batch) >= BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


# --- one unit -------------------------------------------------------------------------------------


def _fsync_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary name beside it, fsync, rename."""
    atomic_write_bytes(path, data, fsync=True)


class _ShardWriter:
    """One split's shard of one unit: tokens streamed to a temporary file, renamed when done."""

    def __init__(self, out: Path, split: str, unit: int, dtype: np.dtype) -> None:
        self.name = f"{split}-{unit:06d}"
        self.path = out / f"{self.name}.tokens"
        self.offsets_path = out / f"{self.name}.offsets"
        self.tmp = out / f".{self.name}.tokens.tmp-{os.getpid()}"
        self.dtype, self.fh = dtype, None
        self.tokens, self.offsets, self.max_id = 0, [], -1

    def add(self, docs: list[np.ndarray], eos: int) -> None:
        if not docs:
            return
        if self.fh is None:
            self.fh = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish
        inside = [i for i, d in enumerate(docs) if (d == eos).any()]
        if inside:  # it would end the document there: masking and the loss's weight would split it
            raise PrepareError(
                f"{self.name}: a document's text encodes to the end-of-document id {eos} (an added "
                "token the tokenizer does not treat as special?): fix the tokenizer or the text"
            )
        lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
        starts = self.tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self.offsets.extend(int(s) for s in starts)
        flat = np.concatenate([np.append(d, eos) for d in docs])
        self.max_id = max(self.max_id, int(flat.max()))
        self.fh.write(flat.astype(self.dtype).tobytes())
        self.tokens += int(lengths.sum())

    def finish(self) -> dict[str, Any] | None:
        if self.fh is None:
            return None
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.path)
        _fsync_write(self.offsets_path, np.asarray(self.offsets, dtype=OFFSET_DTYPE).tobytes())
        return {
            "file": self.path.name,
            "offsets": self.offsets_path.name,
            "tokens": self.tokens,
            "documents": len(self.offsets),
            "max_token_id": self.max_id,
        }


_WORKER: dict[str, Any] = {}


def _worker_init() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _worker_tokenizer(spec: str, fingerprint: str) -> Any:
    """The tokenizer of this process, loaded by its first unit: an error here comes back through
    the pool's results (one raised in a pool's initializer would respawn the worker forever)."""
    if "tok" not in _WORKER:
        from fivefold.train.tokenizer import load_tokenizer

        tok = load_tokenizer(spec)
        if getattr(tok, "fingerprint", "bytes") != fingerprint:
            raise PrepareError(f"tokenizer {spec} changed while prepare ran: run it again")
        _WORKER["tok"] = tok
    return _WORKER["tok"]


def _encode(tok: Any, texts: list[str]) -> list[np.ndarray]:
    batch = getattr(tok, "encode_batch", None)
    return batch(texts) if batch is not None else [tok.encode(t) for t in texts]


def _run_unit(job: tuple[int, Unit, dict[str, Any]]) -> dict[str, Any]:
    """Tokenize unit ``u`` into its shards; write its done record; return it."""
    u, unit, s = job
    tok, out = _worker_tokenizer(s["spec"], s["fingerprint"]), Path(s["out"])
    dtype = DTYPES[s["dtype"]]
    writers = {split: _ShardWriter(out, split, u, dtype) for split in ("train", "val")}
    seen = skipped = 0
    for texts in _documents(unit, s["text_field"]):
        keep = [i for i, t in enumerate(texts) if t]
        skipped += len(texts) - len(keep)
        ids = _encode(tok, [texts[i] for i in keep])
        to_val = val_mask(s["seed"], u, np.array(keep, dtype=np.int64) + seen, s["val_fraction"])
        writers["train"].add([d for d, v in zip(ids, to_val) if not v], s["eos"])
        writers["val"].add([d for d, v in zip(ids, to_val) if v], s["eos"])
        seen += len(texts)
    record = {
        "unit": u,
        "what": asdict(unit),
        "skipped": skipped,
        "shards": {split: w.finish() for split, w in writers.items()},
    }
    _fsync_write(out / DONE / f"{u:06d}.json", json.dumps(record).encode())
    return record


# --- the run --------------------------------------------------------------------------------------


class _Progress:
    """units done / total, documents, tokens, tokens/s on stderr (rewritten in place on a TTY)."""

    def __init__(self, total: int, done: int, show: bool) -> None:
        self.total, self.done, self.show = total, done, show
        self.docs = self.tokens = 0
        self.t0 = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, record: dict[str, Any]) -> None:
        self.done += 1
        for sh in record["shards"].values():
            if sh:
                self.docs += sh["documents"]
                self.tokens += sh["tokens"]
        now = time.perf_counter()
        if self.show and (now - self.last > (0.2 if self.tty else 30) or self.done == self.total):
            self.last = now
            rate = self.tokens / max(now - self.t0, 1e-9)
            line = (f"prepare: {self.done}/{self.total} units, {self.docs:,} documents, "
                    f"{self.tokens:,} tokens, {rate:,.0f} tokens/s")  # fmt: skip
            end = "\n" if self.done == self.total or not self.tty else ""
            print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


def _settings(tok: Any, spec: str, inputs: Sequence[str], files: list, **kw: Any) -> dict:
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": getattr(tok, "fingerprint", "bytes"),
        "inputs": list(inputs),
        "input_files": digest,
        **kw,
        "tokenizer_spec": spec,
    }


_OURS = (".tokens", ".offsets")


def _claim(out: Path, settings: dict[str, Any], overwrite: bool) -> None:
    """Make ``out`` this run's: new (or empty) and given the manifest; or already this run's
    (same settings); or, with ``overwrite``, a former prepare's emptied."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file: give a directory (it is created if missing)")
    manifest = out / MANIFEST
    if out.is_dir() and not manifest.is_file() and any(out.iterdir()):
        raise PrepareError(
            f"--out {out} holds other files and no {MANIFEST}: give a new or empty directory"
        )
    if manifest.is_file() and overwrite:
        for p in out.iterdir():
            if p.name in (MANIFEST, INDEX) or p.suffix in _OURS or ".tmp-" in p.name:
                p.unlink()
        for p in (out / DONE).glob("*") if (out / DONE).is_dir() else ():
            p.unlink()
    elif manifest.is_file():
        try:
            before = json.loads(manifest.read_text())
        except ValueError:
            before = {}
        names = {"tokenizer": "the tokenizer (its fingerprint)", "input_files":
                 "the input files (their sizes or times)"}  # fmt: skip
        for key, now in settings.items():
            if key != "tokenizer_spec" and before.get(key) != now:
                what = names.get(key, key)
                detail = "" if key in names else f": {before.get(key)!r} then, {now!r} now"
                raise PrepareError(
                    f"--out {out} was prepared with other settings ({what} differs{detail}): give "
                    "a new --out, or --overwrite to start over"
                )
        return
    (out / DONE).mkdir(parents=True, exist_ok=True)
    _fsync_write(manifest, json.dumps(settings, indent=1).encode())


def _done_records(out: Path, n: int) -> dict[int, dict[str, Any]]:
    records = {}
    for u in range(n):
        path = out / DONE / f"{u:06d}.json"
        try:
            records[u] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not done (or its record torn): the unit runs again
    return records


def _ensure_val(out: Path, records: list[dict], dtype: np.dtype) -> None:
    """No validation document at all: move the last training document (of the last unit with
    training documents) into that unit's val shard. The val shard is written first, then the
    unit's done record says the move, then the training shard is cut: a run stopped anywhere in
    this ends the same when run again (`_settle` finishes a cut the record already says)."""
    u = max(r["unit"] for r in records if r["shards"]["train"])
    rec = records[u]
    train = rec["shards"]["train"]
    item = dtype.itemsize
    tokens_path, offsets_path = out / train["file"], out / train["offsets"]
    offsets = np.fromfile(offsets_path, dtype=OFFSET_DTYPE)
    n, length = train["documents"], train["tokens"]
    if len(offsets) != n or tokens_path.stat().st_size != length * item:
        raise PrepareError(f"{tokens_path} was changed: start over with --overwrite")
    start = int(offsets[n - 1])
    val_path = out / f"val-{u:06d}.tokens"
    if not val_path.is_file():
        doc = np.fromfile(tokens_path, dtype=dtype, offset=start * item, count=length - start)
        _fsync_write(out / f"val-{u:06d}.offsets", np.zeros(1, dtype=OFFSET_DTYPE).tobytes())
        _fsync_write(val_path, doc.tobytes())
    doc = np.fromfile(val_path, dtype=dtype)
    rec["shards"]["val"] = {
        "file": val_path.name,
        "offsets": f"val-{u:06d}.offsets",
        "tokens": len(doc),
        "documents": 1,
        "max_token_id": int(doc.max()),
    }
    if n == 1:
        rec["shards"]["train"] = None
    else:
        left = np.fromfile(tokens_path, dtype=dtype, count=start)
        train.update(tokens=start, documents=n - 1, max_token_id=int(left.max()))
    _fsync_write(out / DONE / f"{u:06d}.json", json.dumps(rec).encode())
    _settle(out, [rec], dtype)
    if n == 1:
        tokens_path.unlink(missing_ok=True)
        offsets_path.unlink(missing_ok=True)


def _settle(out: Path, records: list[dict], dtype: np.dtype) -> None:
    """Cut each shard named by a done record to the record's length, and remove one its record
    says is empty: files are written whole before their record, so a file longer than its record,
    or one it no longer names, is a training shard `_ensure_val` moved a document out of and was
    stopped before cutting or removing."""
    for rec in records:
        for split, sh in rec["shards"].items():
            if sh is None:  # a shard the move emptied, stopped before it was removed
                for ext in _OURS:
                    (out / f"{split}-{rec['unit']:06d}{ext}").unlink(missing_ok=True)
                continue
            sizes = {
                sh["file"]: sh["tokens"] * dtype.itemsize,
                sh["offsets"]: sh["documents"] * OFFSET_DTYPE.itemsize,
            }
            for name, size in sizes.items():
                path = out / name
                if path.is_file() and path.stat().st_size > size:
                    os.truncate(path, size)


def prepare(
    inputs: Sequence[str],
    tokenizer_spec: str,
    out_dir: str | Path,
    *,
    workers: int = 1,
    text_field: str = "text",
    val_fraction: float = DEFAULT_VAL_FRACTION,
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    unit_bytes: int = UNIT_BYTES,
    unit_docs: int = UNIT_DOCS,
    stop_after_units: int | None = None,
) -> Index:
    """Tokenize ``inputs`` into token shards in ``out_dir`` (see the module docstring) and return
    the checked index. ``stop_after_units`` stops the run (`KeyboardInterrupt`) once that many
    units are done in this call, as a kill would: for tests of resuming."""
    from fivefold.train.tokenizer import load_tokenizer

    if not inputs:
        raise PrepareError(
            "no inputs: name text, JSONL or Parquet files, folders or saved datasets"
        )
    if int(workers) != workers or workers < 1:
        raise PrepareError(f"--workers {workers}: give a positive number of processes")
    if not 0.0 <= val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {val_fraction}: give a fraction in [0, 1), e.g. 0.005")
    if unit_bytes < 1 or unit_docs < 1:
        raise PrepareError("unit_bytes and unit_docs must be positive")
    tok = load_tokenizer(tokenizer_spec)
    eos = getattr(tok, "eos_id", None)
    if eos is None:
        raise PrepareError(
            f"tokenizer {tokenizer_spec!r} has no end-of-document token, which prepare appends "
            "after every document: name a tokenizer that has one (a tokenizer.json with "
            "<|endoftext|>, </s> or a tokenizer_config.json eos_token, or a tiktoken file)"
        )
    units, files = plan_units(inputs, text_field, unit_bytes, unit_docs)
    dtype = dtype_for(tok.vocab_size)
    settings = _settings(
        tok,
        tokenizer_spec,
        inputs,
        files,
        text_field=text_field,
        val_fraction=float(val_fraction),
        seed=int(seed),
        unit_bytes=int(unit_bytes),
        unit_docs=int(unit_docs),
        dtype=dtype,
        eos_id=int(eos),  # (from a tokenizer_config.json the fingerprint does not cover)
    )
    out = Path(out_dir)
    _claim(out, settings, overwrite)
    if (out / INDEX).is_file():
        return read_index(out)
    for p in out.glob(".*.tmp-*"):  # a stopped run's partial files
        p.unlink()
    records = _done_records(out, len(units))
    todo = [u for u in range(len(units)) if u not in records]
    for u in todo:  # a unit stopped between its renames leaves files its re-run may not write
        for name in (f"{split}-{u:06d}{ext}" for split in ("train", "val") for ext in _OURS):
            (out / name).unlink(missing_ok=True)
    fingerprint = getattr(tok, "fingerprint", "bytes")
    shared = {"out": str(out), "text_field": text_field, "seed": int(seed), "eos": int(eos),
              "val_fraction": float(val_fraction), "dtype": dtype, "spec": tokenizer_spec,
              "fingerprint": fingerprint}  # fmt: skip
    jobs = [(u, units[u], shared) for u in todo]
    bar = _Progress(len(units), len(records), progress)
    stopped = 0

    def account(record: dict[str, Any]) -> None:
        nonlocal stopped
        records[record["unit"]] = record
        bar.update(record)
        stopped += 1
        if stop_after_units is not None and stopped >= stop_after_units:
            raise KeyboardInterrupt(f"stopped after {stopped} units (stop_after_units)")

    if workers == 1 or len(jobs) <= 1:
        _WORKER["tok"] = tok
        for job in jobs:
            account(_run_unit(job))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(workers, len(jobs)), _worker_init) as pool:
            for record in pool.imap(_run_unit, jobs):
                account(record)
    return _finish(out, units, records, tok, tokenizer_spec, settings)


def _finish(
    out: Path, units: list[Unit], by_unit: dict[int, dict], tok: Any, spec: str, settings: dict
) -> Index:
    records = [by_unit[u] for u in range(len(units))]
    dtype = DTYPES[settings["dtype"]]
    _settle(out, records, dtype)  # (a move of a document into val stopped half-way)
    docs = {s: sum(r["shards"][s]["documents"] for r in records if r["shards"][s]) for s in
            ("train", "val")}  # fmt: skip
    if docs["train"] + docs["val"] == 0:
        raise PrepareError(f"the inputs hold no non-empty documents: nothing to prepare in {out}")
    if settings["val_fraction"] > 0 and docs["val"] == 0 and docs["train"] >= 2:
        _ensure_val(out, records, dtype)
    splits = {}
    for s in ("train", "val"):
        shards = [r["shards"][s] for r in records if r["shards"][s]]
        splits[s] = {
            "tokens": sum(x["tokens"] for x in shards),
            "documents": sum(x["documents"] for x in shards),
            "max_token_id": max((x["max_token_id"] for x in shards), default=-1),
            "shards": shards,
        }
    if not splits["train"]["shards"]:
        raise PrepareError(
            f"every document went to validation ({splits['val']['documents']} of them): give more "
            "documents, or a smaller --val-fraction"
        )
    index = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": {
            "spec": spec,
            "name": Path(spec).name if spec != "bytes" else "bytes",
            "fingerprint": getattr(tok, "fingerprint", "bytes"),
            "vocab_size": int(tok.vocab_size),
            "eos_id": getattr(tok, "eos_id", None),
            "bos_id": getattr(tok, "bos_id", None),
        },
        "dtype": settings["dtype"],
        "byteorder": "little",
        "max_token_id": max(x["max_token_id"] for x in splits.values()),
        "splits": splits,
        "val_fraction": settings["val_fraction"],
        "seed": settings["seed"],
        "inputs": settings["inputs"],
        "text_field": settings["text_field"],
        "units": len(units),
        "skipped_documents": sum(r["skipped"] for r in records),
        "split_rule": "splitmix64 of (seed, unit, index in unit) < val_fraction; at least one "
        "val document (the last training one moved) when val_fraction > 0",
    }
    _fsync_write(out / INDEX, json.dumps(index, indent=1).encode())
    try:
        return read_index(out)
    except IndexError_ as e:
        (out / INDEX).unlink()
        raise PrepareError(f"{e} (start over with --overwrite)") from None
