"""`fivefold prepare` and its token shards (`fivefold/train/prepare.py`, `fivefold/train/shards.py`),
in-process with a BPE tokenizer trained here: shard contents equal a direct tokenization (each
document's ids + EOS, split by the documented rule) for text files and folders, JSONL, Parquet and
`save_to_disk` inputs; uint32 shards above 65,536 ids; a stopped run resumed ends with the same
bytes, other settings are refused; 1 and 2 workers write the same bytes (multiprocess); a tampered
index is refused; `TokenDataset.from_prepared` reads windows straddling shards as the concatenation;
the CLI's errors are one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fivefold.cli import main
from fivefold.train.data import TokenDataset
from fivefold.train.prepare import PrepareError, plan_units, prepare, val_mask
from fivefold.train.shards import IndexError_, ShardedTokens, read_index
from fivefold.train.tokenizer import load_tokenizer

WORDS = (
    "the quick brown fox jumps over the lazy dog pack my box with five dozen liquor jugs "
    "sphinx of black quartz judge my vow"
).split()


def _docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))) + ("\n✓" if i % 7 == 3 else "")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        _docs(200, 1),
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def _expected(tok_path, keyed, val_fraction, seed=0):
    """(train, val) token arrays and document offsets of ``keyed``: (unit, index in unit, text)
    in order, each text's ids + EOS, to val by the rule."""
    tok = load_tokenizer(tok_path)
    out = {"train": ([], []), "val": ([], [])}
    for u, i, text in keyed:
        if not text:
            continue
        split = "val" if val_mask(seed, u, np.array([i]), val_fraction)[0] else "train"
        tokens, offsets = out[split]
        offsets.append(sum(len(t) for t in tokens))
        tokens.append(np.append(tok.encode(text), tok.eos_id))
    return {
        s: (
            np.concatenate(t).astype(np.int64) if t else np.zeros(0, np.int64),
            np.array(o, np.int64),
        )
        for s, (t, o) in out.items()
    }


def _assert_contents(out, expected):
    for split in ("train", "val"):
        a = ShardedTokens(out, split)
        np.testing.assert_array_equal(np.asarray(a[:], dtype=np.int64), expected[split][0])
        np.testing.assert_array_equal(a.document_offsets(), expected[split][1])


def _all_bytes(out: Path):
    return {
        p.name: p.read_bytes()
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != "prepare.json"
    }


def test_text_files_and_folders(tmp_path, tok_path):
    docs = _docs(11)
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    names = [folder / f"{i:02d}.txt" for i in range(6)] + [
        folder / "sub" / f"{i:02d}.md" for i in range(6, 10)
    ]
    for p, d in zip(names, docs):
        p.write_text(d)
    names[4].write_text("")  # an empty document: skipped, counted
    docs[4] = ""
    (folder / ".hidden").write_text("never read")
    (folder / "blob.bin").write_bytes(b"\x00\x01")
    lone = tmp_path / "lone.txt"
    lone.write_bytes(docs[10].encode() + b"\xff")  # invalid UTF-8: replaced
    docs[10] += "\ufffd"
    index = prepare(
        [str(folder), str(lone)],
        tok_path,
        tmp_path / "out",
        unit_docs=3,
        val_fraction=0.3,
        progress=False,
    )
    keyed = [(k // 3, k % 3, d) for k, d in enumerate(docs)]  # units of 3 files
    exp = _expected(tok_path, keyed, 0.3)
    _assert_contents(tmp_path / "out", exp)
    assert index.skipped_documents == 1 and index.dtype == "uint16"
    assert index.splits["val"].documents == len(exp["val"][1]) > 0
    assert index.tokens == len(exp["train"][0]) + len(exp["val"][0])
    raw = json.loads((tmp_path / "out" / "index.json").read_text())
    assert (
        raw["tokenizer"]["name"] == "tokenizer.json" and len(raw["tokenizer"]["fingerprint"]) == 64
    )


def test_jsonl_with_a_text_field_cut_at_line_ends(tmp_path, tok_path):
    docs = _docs(30)
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)]
    lines.insert(5, "\n")  # a blank line: no record
    path.write_text("".join(lines))
    prepare(
        [str(path)],
        tok_path,
        tmp_path / "out",
        text_field="body",
        unit_bytes=700,
        val_fraction=0.2,
        progress=False,
    )
    units, _ = plan_units([str(path)], "body", unit_bytes=700)
    assert len(units) > 3
    starts, pos = [], 0
    for line in path.read_bytes().splitlines(keepends=True):
        if line.strip():
            starts.append(pos)
        pos += len(line)
    keyed, seen = [], {}
    for start, d in zip(starts, docs):
        u = next(k for k, unit in enumerate(units) if unit.start <= start < unit.stop)
        keyed.append((u, seen.get(u, 0), d))
        seen[u] = seen.get(u, 0) + 1
    _assert_contents(tmp_path / "out", _expected(tok_path, keyed, 0.2))
    with pytest.raises(PrepareError, match=r"has no field 'text' \(it has: id, body\)"):
        prepare([str(path)], tok_path, tmp_path / "out2", progress=False)


def test_parquet_by_row_group(tmp_path, tok_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs: list = _docs(10)
    docs[2], docs[7] = None, ""
    pq.write_table(
        pa.table({"n": list(range(10)), "text": docs}), tmp_path / "d.parquet", row_group_size=4
    )
    index = prepare(
        [str(tmp_path / "d.parquet")], tok_path, tmp_path / "out", val_fraction=0.25, progress=False
    )
    _assert_contents(
        tmp_path / "out",
        _expected(tok_path, [(k // 4, k % 4, d) for k, d in enumerate(docs)], 0.25),
    )
    assert index.skipped_documents == 2


def test_save_to_disk_dataset_and_datasetdict(tmp_path, tok_path):
    import datasets

    docs = _docs(9)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    prepare(
        [str(tmp_path / "ds")],
        tok_path,
        tmp_path / "out",
        unit_docs=4,
        val_fraction=0.2,
        progress=False,
    )
    _assert_contents(
        tmp_path / "out", _expected(tok_path, [(k // 4, k % 4, d) for k, d in enumerate(docs)], 0.2)
    )
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": docs[:5]}),
            "test": datasets.Dataset.from_dict({"text": docs[5:]}),
        }
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    prepare([str(tmp_path / "dd")], tok_path, tmp_path / "out2", val_fraction=0.2, progress=False)
    _assert_contents(
        tmp_path / "out2", _expected(tok_path, [(0, k, d) for k, d in enumerate(docs[:5])], 0.2)
    )


def test_at_least_one_val_document(tmp_path, tok_path):
    docs = _docs(5)
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    files = [str(tmp_path / f"{i}.txt") for i in range(5)]
    index = prepare(
        files, tok_path, tmp_path / "out", unit_docs=2, val_fraction=1e-12, progress=False
    )
    tok = load_tokenizer(tok_path)
    assert index.splits["val"].documents == 1 and index.splits["train"].documents == 4
    np.testing.assert_array_equal(
        np.asarray(ShardedTokens(index, "val")[:], np.int64),
        np.append(tok.encode(docs[4]), tok.eos_id),
    )  # the last training document
    assert not any(val_mask(0, k // 2, np.array([k % 2]), 1e-12)[0] for k in range(5))
    with pytest.raises(PrepareError, match="every document went to validation"):
        prepare(files[:1], tok_path, tmp_path / "one", val_fraction=0.5, progress=False)


def test_a_run_stopped_while_moving_a_document_into_val_resumes_to_the_same_bytes(tmp_path, tok_path,
                                                                                 monkeypatch):
    """The move writes the val shard, then the unit's done record, then cuts the training shard: stopped
    between the last two (the record says the move, the shard is still whole), a re-run cuts it and ends
    byte for byte as a run that was never stopped."""
    import fivefold.train.prepare as prepare_module

    docs = _docs(5)
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    files = [str(tmp_path / f"{i}.txt") for i in range(5)]
    kw = dict(unit_docs=3, val_fraction=1e-12, progress=False)  # the last unit: 2 documents, one moved
    prepare(files, tok_path, tmp_path / "whole", **kw)
    real = prepare_module.os.truncate

    def killed(*args):
        raise KeyboardInterrupt("killed before the cut")

    monkeypatch.setattr(prepare_module.os, "truncate", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(files, tok_path, tmp_path / "stopped", **kw)
    monkeypatch.setattr(prepare_module.os, "truncate", real)
    assert not (tmp_path / "stopped" / "index.json").exists()
    prepare(files, tok_path, tmp_path / "stopped", **kw)
    names = sorted(p.name for p in (tmp_path / "whole").iterdir() if p.is_file())
    assert names == sorted(p.name for p in (tmp_path / "stopped").iterdir() if p.is_file())
    for name in names:
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "stopped" / name).read_bytes(), name
    assert read_index(tmp_path / "stopped").splits["val"].documents == 1
    # a last unit of one document: the move empties its training shard; stopped before removing it
    kw["unit_docs"] = 2
    prepare(files, tok_path, tmp_path / "one", **kw)
    whole = {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir() if p.is_file()}
    assert "train-000002.tokens" not in whole and "val-000002.tokens" in whole
    (tmp_path / "one" / "index.json").unlink()
    (tmp_path / "one" / "train-000002.tokens").write_bytes(b"\0" * 8)
    (tmp_path / "one" / "train-000002.offsets").write_bytes(b"\0" * 8)
    prepare(files, tok_path, tmp_path / "one", **kw)
    assert {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir() if p.is_file()} == whole


def test_a_document_that_encodes_to_the_end_of_document_id_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<eos>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens(["<eos>"])  # an added token, not a special one: text spells it
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (tmp_path / "d.txt").write_text("a b <eos> a")
    with pytest.raises(PrepareError, match="encodes to the end-of-document id 2"):
        prepare([str(tmp_path / "d.txt")], str(path), tmp_path / "out", progress=False)


def test_uint32_above_65536_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    docs = ["w1 w65534 w65535 w69999", "w70 w66000 w3"]
    (tmp_path / "a.txt").write_text(docs[0])
    (tmp_path / "b.txt").write_text(docs[1])
    index = prepare(
        [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")],
        str(tmp_path / "big.json"),
        tmp_path / "out",
        val_fraction=0.0,
        progress=False,
    )
    assert index.dtype == "uint32" and index.max_token_id == 70_001
    train = ShardedTokens(index, "train")
    assert train.dtype == np.dtype("<u4")
    expected = [3, 65536, 65537, 70001, 0, 72, 66002, 5, 0]
    np.testing.assert_array_equal(np.asarray(train[:], np.int64), expected)
    assert (tmp_path / "out" / "train-000000.tokens").stat().st_size == 4 * len(expected)
    t = load_tokenizer(str(tmp_path / "big.json"))
    assert t.decode(train[:4]) == docs[0]


def _corpus(tmp_path, n=14):
    folder = tmp_path / "c"
    folder.mkdir()
    for i, d in enumerate(_docs(n, 3)):
        (folder / f"{i:03d}.txt").write_text(d)
    return folder


def test_a_stopped_run_resumes_to_the_same_bytes(tmp_path, tok_path):
    folder = _corpus(tmp_path)
    kw = dict(unit_docs=3, val_fraction=0.2, progress=False)
    prepare([str(folder)], tok_path, tmp_path / "whole", **kw)
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        prepare([str(folder)], tok_path, out, stop_after_units=2, **kw)
    assert not (out / "index.json").exists() and len(list((out / "done").iterdir())) == 2
    (out / "train-000002.tokens").write_bytes(b"torn")  # unit 2 stopped between its renames
    (out / ".train-000003.tokens.tmp-999").write_bytes(b"partial")
    with pytest.raises(IndexError_, match="holds no index.json"):
        read_index(out)
    prepare([str(folder)], tok_path, out, **kw)
    assert _all_bytes(out) == _all_bytes(tmp_path / "whole")
    # other settings: refused in one line naming the setting; --overwrite starts over
    for change, match in (
        (dict(val_fraction=0.3), "val_fraction differs"),
        (dict(seed=1), "seed differs"),
        (dict(text_field="body"), "text_field differs"),
    ):
        with pytest.raises(PrepareError, match=match) as e:
            prepare([str(folder)], tok_path, out, **{**kw, **change})
        assert "\n" not in str(e.value) and "--overwrite" in str(e.value)
    (folder / "000.txt").write_text("changed")
    with pytest.raises(PrepareError, match="the input files"):
        prepare([str(folder)], tok_path, out, **kw)
    index = prepare([str(folder)], tok_path, out, overwrite=True, **{**kw, "seed": 5})
    assert index.seed == 5 and not list(out.glob("*.tmp-*"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("x")
    with pytest.raises(PrepareError, match="holds other files"):
        prepare([str(folder)], tok_path, tmp_path / "other", overwrite=True, **kw)


@pytest.mark.multiprocess
def test_two_workers_write_the_same_bytes(tmp_path, tok_path):
    folder = _corpus(tmp_path)
    kw = dict(unit_docs=3, val_fraction=0.2, progress=False)
    prepare([str(folder)], tok_path, tmp_path / "one", workers=1, **kw)
    prepare([str(folder)], tok_path, tmp_path / "two", workers=2, **kw)
    assert len(list((tmp_path / "two").glob("*.tokens"))) > 4
    assert _all_bytes(tmp_path / "one") == _all_bytes(tmp_path / "two")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 50 + "not json\n")
    with pytest.raises(PrepareError, match="is not JSON") as e:
        prepare(
            [str(bad), str(folder)],
            tok_path,
            tmp_path / "bad",
            workers=2,
            unit_bytes=200,
            **{k: v for k, v in kw.items() if k != "unit_docs"},
        )
    assert "\n" not in str(e.value)


def test_a_tampered_index_is_refused(tmp_path, tok_path):
    out = tmp_path / "out"
    prepare([str(_corpus(tmp_path))], tok_path, out, unit_docs=3, val_fraction=0.2, progress=False)
    good = (out / "index.json").read_text()
    raw = json.loads(good)
    raw["splits"]["train"]["shards"][0]["file"] = "../x"
    (out / "index.json").write_text(json.dumps(raw))
    with pytest.raises(IndexError_, match="outside"):
        read_index(out)
    raw = json.loads(good)
    raw["version"] = 99
    (out / "index.json").write_text(json.dumps(raw))
    with pytest.raises(IndexError_, match="format version 99"):
        read_index(out)
    (out / "index.json").write_text(good)
    shard = out / "train-000001.tokens"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(
        IndexError_, match="train-000001.tokens: .* bytes, but index.json says"
    ) as e:
        read_index(out)
    assert "\n" not in str(e.value)


def test_from_prepared_windows_straddle_shards(tmp_path, tok_path):
    out = tmp_path / "out"
    index = prepare(
        [str(_corpus(tmp_path, 30))], tok_path, out, unit_docs=2, val_fraction=0.2, progress=False
    )
    concat = {
        s: np.concatenate(
            [np.fromfile(out / sh.file, dtype="<u2") for sh in index.splits[s].shards]
        )
        for s in ("train", "val")
    }
    train = ShardedTokens(out, "train")
    assert len(train) == len(concat["train"]) and train.max() == concat["train"].max()
    b = int(train.starts[1])
    idx = np.array([[b - 3, b - 2, b - 1, b, b + 1], [0, 1, 2, len(train) - 1, -1]])
    np.testing.assert_array_equal(train[idx], concat["train"][idx])
    np.testing.assert_array_equal(
        train[b - 5 : int(train.starts[3]) + 2], concat["train"][b - 5 : int(train.starts[3]) + 2]
    )
    np.testing.assert_array_equal(train[1:40:3], concat["train"][1:40:3])
    assert train[b] == concat["train"][b]
    with pytest.raises(IndexError):
        train[np.array([len(train)])]
    seq = 16
    a, a2 = (
        TokenDataset.from_prepared(out, seq, seed=4),
        TokenDataset.from_prepared(out, seq, seed=4),
    )
    ref = TokenDataset.from_splits(concat["train"], concat["val"], seq, seed=4)
    straddled = False
    for step in range(6):
        x, y = a.global_batch(step, 8)
        for other in (a2, ref):
            ox, oy = other.global_batch(step, 8)
            assert x.equal(ox) and y.equal(oy)
        starts = a._train_starts(step, 8)
        straddled |= bool(
            np.any((starts < b) & (starts + seq + 1 > b))
            or np.any([(starts < s) & (starts + seq + 1 > s) for s in train.starts[1:-1]])
        )
    assert straddled
    for (vx, vy), (rx, ry) in zip(a.val_batches(2, 2), ref.val_batches(2, 2)):
        assert vx.equal(rx) and vy.equal(ry)


def test_cli_prepare_summary_and_one_line_errors(tmp_path, tok_path, capsys):
    folder = _corpus(tmp_path)
    assert (
        main(
            [
                "prepare",
                str(folder),
                "--tokenizer",
                tok_path,
                "--out",
                str(tmp_path / "out"),
                "--val-fraction",
                "0.2",
            ]
        )
        == 0
    )
    assert "14 documents" in capsys.readouterr().out
    for argv, match in (
        ([str(tmp_path / "missing"), "--tokenizer", tok_path], "input '.*missing' not found"),
        ([str(folder), "--tokenizer", "bytes"], "has no end-of-document token"),
        ([str(folder), "--tokenizer", tok_path, "--val-fraction", "1.5"], "--val-fraction 1.5"),
    ):
        assert main(["prepare", *argv, "--out", str(tmp_path / "o2")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("fivefold prepare: error: ")
        assert __import__("re").search(match, err), err
