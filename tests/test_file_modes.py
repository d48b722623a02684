"""Every file a run, a resume, an export and a prepare write gets the mode the user's umask gives (0644 under
022, directories 0755), none mkstemp's or safetensors' 0600: the pictures, trace.json, metrics.jsonl (also as
a resume rewrites it), the checkpoint's files and ``latest``, model.safetensors and its configs, the
shards, ``done`` records and index.json (`fivefold.paths.atomic_path`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fivefold.paths import atomic_write_bytes, user_file_mode


def _modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]}


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def test_an_atomic_write_gets_the_umasks_mode(tmp_path, umask_022):
    atomic_write_bytes(tmp_path / "a", b"x")
    assert user_file_mode() == 0o644 and stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o644
    os.umask(0o002)
    atomic_write_bytes(tmp_path / "a", b"y", fsync=True)
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o664 and (tmp_path / "a").read_bytes() == b"y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no temporary left


@pytest.mark.multiprocess
def test_a_run_a_resume_an_export_and_a_prepare_write_0644_files_and_0755_directories(tmp_path, umask_022):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fivefold import cli

    text = [" ".join(f"word{i % 17} line{i % 5}" for i in range(j, j + 40)) for j in range(300)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(0, 300, 30):
        (corpus / f"doc{i}.txt").write_text("\n".join(text[i:i + 30]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    prepared, runs, exported = tmp_path / "prepared", tmp_path / "runs", tmp_path / "hf"
    assert cli.main(["prepare", str(corpus), "--tokenizer", str(tmp_path / "tokenizer.json"), "--out",
                     str(prepared), "--val-fraction", "0.2"]) == cli.EXIT_DONE
    train = ["train", "--preset", "tiny", "--steps", "3", "--nproc", "2", "--run.out_dir", str(runs), "--run.name",
             "modes", "--run.progress", "false", "--run.plot", "true", "--run.trace", "true", "--run.trace_steps",
             "1", "--train.eval_every", "0", "--train.global_batch", "4", "--train.seq_len", "32", "--data",
             str(prepared)]
    assert cli.main([*train, "--run.exit_after", "2"]) == cli.EXIT_STOPPED
    assert cli.main(["train", "--resume", str(runs / "modes")]) == cli.EXIT_DONE  # metrics.jsonl rewritten
    assert cli.main(["export", str(runs / "modes"), "--to", str(exported)]) == 0
    written = {f"{where.name}/{k}": v for where in (prepared, runs, exported) for k, v in _modes(where).items()}
    for name in ("runs/modes/loss.png", "runs/modes/step_trace.png", "runs/modes/trace.json",
                 "runs/modes/metrics.jsonl", "runs/modes/checkpoints/latest", "hf/model.safetensors",
                 "hf/tokenizer.json", "prepared/index.json"):
        assert name in written, sorted(written)
    assert any(k.endswith(".distcp") for k in written) and any(k.endswith("fivefold.json") for k in written)
    wrong = {k: v for k, v in written.items()
             if v != (oct(0o755) if (tmp_path / k).is_dir() else oct(0o644))}
    assert not wrong, wrong
