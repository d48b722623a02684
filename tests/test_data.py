"""Tests for fivefold.train.data: tokenizer, corpus sources, splits and the batch layout.

Round trips and hand-built expectations (disjoint train / val, shifted targets, micro-batches tiling
the global batch, val batches sharded disjointly); errors name the path. No process is started."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from fivefold.train.data import ByteTokenizer, TokenDataset, load_splits, load_tokens

N = 20_000  # positional corpus: token value == position, so windows reveal where they were read


def positional(n: int = N) -> np.ndarray:
    return np.arange(n, dtype=np.uint16)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "héllo wörld — 日本語 🙂\n\ttabs"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert ids.dtype == np.uint16 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert tok.decode(list(map(int, ids))) == text
    # a cut inside a multi-byte character decodes with a replacement char instead of raising
    assert tok.decode(tok.encode("日")[:2]) == "\ufffd"


# --------------------------------------------------------------------------- sources


def test_default_corpus_nontrivial_deterministic_fast():
    t0 = time.perf_counter()
    a = load_tokens(None)
    elapsed = time.perf_counter() - t0
    b = load_tokens(None)
    assert a.dtype == np.uint16
    assert len(a) > 1_000_000
    assert np.array_equal(a, b)
    assert elapsed < 2.0, elapsed
    assert b"def " in a[:200_000].astype(np.uint8).tobytes()
    small = load_tokens(None, max_bytes=1000)
    assert np.array_equal(small, a[:1000])


def test_text_file_and_comma_list(tmp_path):
    f1, f2 = tmp_path / "a.txt", tmp_path / "b.txt"
    f1.write_text("hello ünïcode")
    f2.write_text("second")
    tok = ByteTokenizer()
    assert np.array_equal(load_tokens(str(f1)), tok.encode("hello ünïcode"))
    assert np.array_equal(load_tokens(str(f1), max_bytes=5), tok.encode("hello"))
    both = load_tokens(f"{f1},{f2}")
    assert tok.decode(both) == "hello ünïcode" + "second"


def test_folder_skips_binary_and_hidden(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b.txt").write_text("BBB")
    (tmp_path / "sub" / "a.md").write_text("AAA")
    (tmp_path / "z.py").write_text("ZZZ")
    (tmp_path / "nul.dat").write_bytes(b"xx\x00yy")  # NUL byte in the first KiB
    (tmp_path / "img.png").write_bytes(b"not really a png")  # binary extension
    (tmp_path / ".git" / "HEAD").write_text("hidden")
    text = ByteTokenizer().decode(load_tokens(str(tmp_path)))
    # sorted walk: top-level files b.txt, z.py, then sub/a.md
    assert text == "BBB\n\nZZZ\n\nAAA"


def test_bin_file(tmp_path):
    ids = (np.arange(5000) * 7 % 50257).astype(np.uint16)
    ids.tofile(tmp_path / "data.bin")
    got = load_tokens(str(tmp_path / "data.bin"))
    assert got.dtype == np.uint16 and np.array_equal(got, ids)
    assert np.array_equal(load_tokens(str(tmp_path / "data.bin"), max_bytes=200), ids[:100])
    ds = TokenDataset.from_path(str(tmp_path / "data.bin"), seq_len=16, val_fraction=0.1)
    assert len(ds.train_tokens) == 4500 and len(ds.val_tokens) == 500


def test_nanogpt_folder_defines_split(tmp_path):
    train = np.arange(0, 3000, dtype=np.uint16)
    val = np.arange(40_000, 40_500, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    tr, va = load_splits(str(tmp_path))
    assert np.array_equal(tr, train) and va is not None and np.array_equal(va, val)
    assert np.array_equal(load_tokens(str(tmp_path)), np.concatenate([train, val]))
    ds = TokenDataset.from_path(str(tmp_path), seq_len=32, val_fraction=0.5)  # fraction ignored
    assert len(ds.train_tokens) == 3000 and len(ds.val_tokens) == 500
    x, _ = ds.global_batch(0, 8)
    assert int(x.max()) < 3000
    (vx, vy), *_ = ds.val_batches(2, 4)
    assert int(vx.min()) >= 40_000 and int(vy.max()) < 40_500


def test_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_tokens(str(missing))
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_tokens(f"{tmp_path / 'x.txt'},{missing}")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt"):
        load_tokens(str(empty))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(ValueError, match="emptydir"):
        load_tokens(str(tmp_path / "emptydir"))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("x" * 100)
    with pytest.raises(ValueError, match=r"tiny\.txt.*seq_len=64"):
        TokenDataset.from_path(str(tiny), seq_len=64)
    with pytest.raises(ValueError, match="seq_len=200"):
        TokenDataset(positional(150), seq_len=200, val_fraction=0.0)


# --------------------------------------------------------------------------- split and windows


def test_train_val_disjoint_and_shifted_targets():
    ds = TokenDataset(positional(), seq_len=64, val_fraction=0.1, seed=3)
    n_train = len(ds.train_tokens)
    assert n_train == N - int(N * 0.1) and len(ds.val_tokens) == int(N * 0.1)
    assert int(ds.val_tokens[0]) == n_train  # contiguous tail
    for step in range(20):
        x, y = ds.global_batch(step, 32)
        assert x.dtype == torch.int64 and x.shape == (32, 64) and y.shape == (32, 64)
        assert torch.equal(y, x + 1)  # positional corpus: y is x shifted by one
        assert int(y.max()) < n_train  # targets never read validation tokens
    for vx, vy in ds.val_batches(8, 16):
        assert torch.equal(vy, vx + 1)
        assert int(vx.min()) >= n_train and int(vy.max()) < N
    # the val windows span the val split evenly: first and last possible windows
    starts = ds.val_starts(8, 16)
    assert starts[0] == 0 and starts[-1] == len(ds.val_tokens) - 65
    assert "train_tokens=18,000" in repr(ds) and "val_tokens=2,000" in repr(ds)


def test_from_splits_without_val():
    ds = TokenDataset.from_splits(positional(500), None, seq_len=10)
    assert len(ds.val_tokens) == 0
    with pytest.raises(ValueError, match="validation"):
        ds.val_batches(1, 1)


# --------------------------------------------------------------------------- batch layout


def test_global_batch_deterministic_and_order_independent():
    ds = TokenDataset(positional(), seq_len=32, seed=0)
    later = ds.global_batch(7, 16)
    first = ds.global_batch(0, 16)
    again = TokenDataset(positional(), seq_len=32, seed=0)
    assert torch.equal(again.global_batch(0, 16)[0], first[0])
    assert torch.equal(again.global_batch(7, 16)[1], later[1])
    assert not torch.equal(first[0], later[0])
    assert not torch.equal(ds.global_batch(1, 16)[0], first[0])
    other_seed = TokenDataset(positional(), seq_len=32, seed=1)
    assert not torch.equal(other_seed.global_batch(0, 16)[0], first[0])


@pytest.mark.parametrize("dp_size,grad_accum", [(1, 1), (2, 1), (3, 2), (2, 4)])
def test_micro_batches_tile_global_batch(dp_size, grad_accum):
    ds = TokenDataset(positional(), seq_len=24, seed=5)
    gbs = 24
    for step in (0, 3):
        gx, gy = ds.global_batch(step, gbs)
        parts = [
            ds.micro_batch(step, gbs, micro_step=m, grad_accum=grad_accum, dp_rank=r, dp_size=dp_size)
            for m in range(grad_accum)
            for r in range(dp_size)
        ]
        mb = gbs // (grad_accum * dp_size)
        assert all(px.shape == (mb, 24) for px, _ in parts)
        assert torch.equal(torch.cat([px for px, _ in parts]), gx)
        assert torch.equal(torch.cat([py for _, py in parts]), gy)


def test_micro_batch_validation_messages():
    ds = TokenDataset(positional(), seq_len=8)
    with pytest.raises(ValueError) as err:
        ds.micro_batch(0, 30, micro_step=0, grad_accum=4, dp_rank=0, dp_size=2)
    msg = str(err.value)
    assert "30" in msg and "4" in msg and "2" in msg and "8" in msg
    with pytest.raises(ValueError, match="dp_rank=2"):
        ds.micro_batch(0, 8, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="micro_step=3"):
        ds.micro_batch(0, 8, micro_step=3, grad_accum=2)


def test_val_batches_sharded_disjointly():
    ds = TokenDataset(positional(), seq_len=16, val_fraction=0.1)
    full = ds.val_batches(6, 4)
    assert len(full) == 6
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, ds.val_batches(6, 4), strict=True))  # fixed
    dp_size = 3
    shards = [ds.val_batches(6, 4, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    seen: set[int] = set()
    for r, shard in enumerate(shards):
        assert len(shard) == 2
        for i, (vx, _) in enumerate(shard):
            assert torch.equal(vx, full[r + i * dp_size][0])  # rank r takes batches r, r+dp, ...
            firsts = set(vx[:, 0].tolist())
            assert not firsts & seen
            seen |= firsts
    assert len(seen) == 6 * 4
    with pytest.raises(ValueError, match="n_batches=5"):
        ds.val_batches(5, 4, dp_rank=0, dp_size=2)
