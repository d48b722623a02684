"""Tokenizers a run can name (`fivefold/train/tokenizer.py`), in-process, no download: a BPE
tokenizer trained here with `tokenizers` (as a ``tokenizer.json`` and as a ``save_pretrained``-style
directory whose ``tokenizer_config.json`` names the end-of-document token) and a tiktoken BPE file
written here. Text round-trips through the ids, the special ids are the tokenizer's, the
fingerprint follows the file's bytes, and a name that is no tokenizer is one clear error."""

from __future__ import annotations

import base64
import json

import pytest

from fivefold.train.corpus import ByteTokenizer
from fivefold.train.tokenizer import HFTokenizer, TiktokenBPE, TokenizerError, load_tokenizer

TEXT = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
        "sphinx of black quartz, judge my vow"] * 20


def _bpe(tmp_path, specials=("<|bos|>", "<|eos|>")):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def test_a_tokenizer_json_round_trips_and_names_its_special_ids(tmp_path):
    path, tok = _bpe(tmp_path)
    t = load_tokenizer(str(path))
    assert isinstance(t, HFTokenizer)
    assert t.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    assert (t.eos_id, t.bos_id) == (tok.token_to_id("<|eos|>"), tok.token_to_id("<|bos|>"))
    for text in ("the lazy fox", "judge my quartz box", "unseen wörds ✓"):
        ids = t.encode(text)
        assert ids.max() < t.vocab_size and t.decode(ids) == text
    assert list(t.encode("the dog")) == tok.encode("the dog", add_special_tokens=False).ids
    assert len(t.fingerprint) == 64


def test_a_model_directory_is_read_with_its_tokenizer_config(tmp_path):
    _bpe(tmp_path, specials=("<|bos|>", "<|eos|>", "<stop>"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<stop>"}}))
    t = load_tokenizer(str(tmp_path))
    stop = load_tokenizer(str(tmp_path / "tokenizer.json"))._tok.token_to_id("<stop>")
    assert t.eos_id == stop != None  # noqa: E711 — the config's token, not the usual name


def test_a_tiktoken_file_round_trips(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    for merge in (b"th", b"the", b"he", b" t", b"qu"):
        ranks[merge] = len(ranks)
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in ranks.items()))
    t = load_tokenizer(str(path))
    assert isinstance(t, TiktokenBPE)
    assert (t.vocab_size, t.eos_id) == (len(ranks) + 1, len(ranks))
    ids = t.encode("the quick theme")
    assert t.decode(ids) == "the quick theme" and ranks[b"the"] in ids
    path.write_text(path.read_text() + f"{base64.b64encode(b'ck').decode()} {len(ranks)}\n")
    assert load_tokenizer(str(path)).fingerprint != t.fingerprint


def test_bytes_is_the_byte_tokenizer():
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


@pytest.mark.parametrize("what, match", [
    ("missing", "neither a file nor a directory"),
    ("empty-dir", "holds no tokenizer.json"),
    ("bad-json", "is not a tokenizer.json"),
    ("bad-bpe", "is not a tiktoken BPE file"),
])
def test_what_is_no_tokenizer_is_one_clear_error(tmp_path, what, match):
    target = tmp_path / what
    if what == "empty-dir":
        target.mkdir()
    elif what == "bad-json":
        target.write_text('{"model": 3}')
    elif what == "bad-bpe":
        target.write_text("not base64 at all\n")
    with pytest.raises(TokenizerError, match=match) as e:
        load_tokenizer(str(target))
    assert "\n" not in str(e.value) and str(e.value).startswith("data.tokenizer: ")
