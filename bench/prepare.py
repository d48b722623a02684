"""``fivefold prepare``'s throughput (tokens/s) with 1 and 2 workers against a plain `tokenizers`
``encode_batch`` loop over the same documents (the same tokenizer, the same batches of 1024).

The corpus: this Python's stdlib ``.py`` files in sorted order up to ``mb`` MiB (deterministic per
Python version, offline), one document per file; the tokenizer: a byte-level BPE trained here on
that corpus. The baseline tokenizes texts already in memory (file reads not timed) and writes
nothing; ``fivefold prepare`` runs as the command (a fresh interpreter, its start timed) on a folder
of links to those files: it reads them, tokenizes, writes the shards (fsync'd) and the index. Each
contestant runs ``repeats`` times, alternating; the median is reported, with its ratio to the
baseline. Workers=1 runs in the calling process, where `tokenizers` may use its own threads;
workers > 1 are spawned processes with ``TOKENIZERS_PARALLELISM=false``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import markdown_table

__all__ = ["PrepareSpec", "bench_prepare", "format_prepare_table"]


@dataclass(frozen=True)
class PrepareSpec:
    mb: float = 4.0
    vocab_size: int = 4096
    repeats: int = 3
    workers: tuple[int, ...] = (1, 2)
    unit_bytes: int = 256 << 10  # small units, so 2 workers have work to share on a few MiB


def bench_prepare(spec: PrepareSpec = PrepareSpec()) -> dict[str, Any]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fivefold.train.corpus import _stdlib_files
    from fivefold.train.shards import read_index

    files, size = [], 0
    for f in _stdlib_files():
        if size >= spec.mb * 2**20:
            break
        files.append(str(f))
        size += f.stat().st_size
    texts = [Path(f).read_bytes().decode("utf-8", errors="replace") for f in files]
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    t0 = time.perf_counter()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=spec.vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    train_s = time.perf_counter() - t0
    tok.save(str(tmp / "tokenizer.json"))

    def baseline() -> int:
        n = 0
        for i in range(0, len(texts), 1024):
            n += sum(len(e.ids) + 1 for e in tok.encode_batch(texts[i : i + 1024]))
        return n

    (tmp / "inputs").mkdir()
    for i, f in enumerate(files):  # one folder of the documents, in the same order
        os.symlink(f, tmp / "inputs" / f"{i:06d}.py")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}

    (tmp / "tiny").mkdir()
    (tmp / "tiny" / "a.txt").write_text("a tiny document\n")
    (tmp / "tiny" / "b.txt").write_text("and another one\n")

    def run(workers: int, inputs: str = "inputs") -> int:
        out = tmp / f"out-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "fivefold.cli", "prepare", str(tmp / inputs),
                        "--tokenizer", str(tmp / "tokenizer.json"), "--out", str(out), "--workers",
                        str(workers), "--unit-mb", str(spec.unit_bytes / 2**20)],
                       check=True, env=env, stdout=subprocess.DEVNULL)  # fmt: skip
        return read_index(out).tokens

    try:
        return _contest(spec, files, size, train_s, baseline, run)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _contest(spec: PrepareSpec, files: list[str], size: int, train_s: float, baseline: Any,
             run: Any) -> dict[str, Any]:  # fmt: skip
    contestants = {"encode_batch loop": baseline, "startup (prepare of 2 tiny files)":
                   lambda: run(1, "tiny"), **{
        f"prepare, {w} worker{'s' if w > 1 else ''}": (lambda w=w: run(w)) for w in spec.workers}}  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in contestants}
    tokens: dict[str, int] = {}
    for r in range(spec.repeats):
        order = list(contestants) if r % 2 == 0 else list(reversed(contestants))
        for name in order:
            t0 = time.perf_counter()
            tokens[name] = contestants[name]()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["encode_batch loop"])
    start = statistics.median(times["startup (prepare of 2 tiny files)"])
    rows = {name: {"tokens": tokens[name], "median_s": statistics.median(t), "times_s": t,
                   "tokens_per_s": tokens[name] / statistics.median(t),
                   "tokens_per_s_less_startup": tokens[name] / max(statistics.median(t) - start, 1e-9)
                   if name.startswith("prepare") else None,
                   "time_vs_baseline": statistics.median(t) / base}
            for name, t in times.items()}  # fmt: skip
    return {"spec": asdict(spec), "documents": len(files), "bytes": size, "cpus": os.cpu_count(),
            "tokenizer_train_s": train_s, "rows": rows}  # fmt: skip


def format_prepare_table(result: dict[str, Any]) -> str:
    s = result["spec"]
    head = (f"fivefold prepare vs a tokenizers encode_batch loop: {result['documents']} stdlib files, "
            f"{result['bytes'] / 2**20:.1f} MiB, BPE vocab {s['vocab_size']}, median of "
            f"{s['repeats']}, {result['cpus']} CPUs")  # fmt: skip
    rows = [["contestant", "tokens", "median s", "tokens/s", "tokens/s less startup",
             "time / encode_batch"]]  # fmt: skip
    for name, r in result["rows"].items():
        less = r["tokens_per_s_less_startup"]
        rows.append([name, f"{r['tokens']:,}", f"{r['median_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
                     f"{less:,.0f}" if less else "", f"{r['time_vs_baseline']:.2f}x"])  # fmt: skip
    return "\n".join([head, "", *markdown_table(rows)])
