"""What a run reads (`fivefold/train/data_source.py`), decided before spawning: the tokenizer and
where it came from, the model's vocabulary (the tokenizer's, padded and said), every disagreement
between data, tokenizer, model directory and checkpoint as one line naming both sides; the loss
across documents (`data.loss_across_documents`): targets ignored, the step's weight exact."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fivefold.config import ConfigError, load_config
from fivefold.models import get_config
from fivefold.tensor_parallel.loss import row_mean_cross_entropy
from fivefold.train.data import IGNORE, TokenDataset
from fivefold.train.data_source import open_dataset, resolve_data, tokenize_documents
from fivefold.train.tokenizer import load_tokenizer
from fivefold.train.validate import validate

TEXT = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
        "sphinx of black quartz, judge my vow"] * 20
TINY = ["--preset", "tiny", "--train.seq_len", "16", "--train.global_batch", "4", "--train.eval_every", "0",
        "--run.check_memory", "false"]


def _bpe(folder, vocab=300, eos="<|eos|>"):
    """A byte-level BPE trained here, saved as FOLDER/tokenizer.json (what save_pretrained writes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eos],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def _corpus(folder, n=40):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"doc{i:03d}.txt").write_text(" ".join(TEXT[i % 3: i % 3 + 1 + i % 5]))
    return folder


def _hf_config_dir(folder, vocab):
    """A model directory's config.json (all resolve_data reads of it), Llama-shaped."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False}))
    return folder


def test_the_vocabulary_is_the_tokenizers_padded_and_said(tmp_path):
    tok = _bpe(tmp_path / "tok", vocab=300)
    n = load_tokenizer(str(tok)).vocab_size
    cfg = load_config(None, TINY + ["--data.path", str(_corpus(tmp_path / "c")), "--data.tokenizer", str(tok)])
    data, model, notes = resolve_data(cfg, get_config("tiny"), tp=1)
    assert data.tokenizer.vocab_size == n and data.tokenizer_from == "data.tokenizer"
    assert model.vocab_size == -(-n // 64) * 64 and any(f"tokenizer's {n:,} ids padded" in s for s in notes)
    _, model2, _ = resolve_data(cfg, get_config("tiny"), tp=3)  # a multiple of 64 and of tp
    assert model2.vocab_size % 192 == 0 and model2.vocab_size - n < 192
    plan = validate(cfg, 1)  # the plan the workers get carries both
    assert plan.model.vocab_size == model.vocab_size and plan.data.eos_id == data.eos_id


def test_a_text_source_is_tokenized_one_document_per_file_with_eos(tmp_path):
    tok = _bpe(tmp_path / "tok")
    corpus = _corpus(tmp_path / "c")
    cfg = load_config(None, TINY + ["--data.path", str(corpus), "--data.tokenizer", str(tok),
                                    "--data.val_fraction", "0.1"])
    plan = validate(cfg, 1)
    ds = open_dataset(cfg, plan.data)
    t = load_tokenizer(str(tok))
    want = np.concatenate([np.append(t.encode(p.read_text()), t.eos_id) for p in sorted(corpus.iterdir())])
    got = np.concatenate([np.asarray(ds.train_tokens), np.asarray(ds.val_tokens)])
    assert np.array_equal(got, want) and int(got.max()) < t.vocab_size
    # a special token's spelling inside a document is text, not the end of the document
    ids = tokenize_documents(["a <|eos|> b"], str(tok), t.eos_id)
    assert list(ids).count(t.eos_id) == 1 and ids[-1] == t.eos_id


def test_init_from_uses_the_model_directorys_tokenizer_and_refuses_another(tmp_path):
    hf = _hf_config_dir(tmp_path / "hf", vocab=320)
    _bpe(hf, vocab=300)  # the model's own tokenizer.json beside its config.json
    base = TINY[2:] + ["--data.path", str(_corpus(tmp_path / "c")), "--model.init_from", str(hf)]
    from fivefold.checkpoint.hf import read_hf_config

    data, model, _ = resolve_data(load_config(None, base), read_hf_config(str(hf)), tp=1)
    assert data.tokenizer_from == "model.init_from" and model.vocab_size == 320  # the model keeps its own
    other = _bpe(tmp_path / "other", vocab=290)
    with pytest.raises(ConfigError, match=r"trained with its tokenizer .*vocabulary 3\d\d.* is tokenizer.json "
                                          r"\(vocabulary 290"):
        resolve_data(load_config(None, base + ["--data.tokenizer", str(other)]), read_hf_config(str(hf)), 1)
    small = _hf_config_dir(tmp_path / "small", vocab=256)
    _bpe(small, vocab=300)
    with pytest.raises(ConfigError, match=r"has 3\d\d ids, more than the model's vocabulary of 256"):
        resolve_data(load_config(None, base[:-1] + [str(small)]), read_hf_config(str(small)), 1)


def test_a_bin_id_beyond_a_fixed_vocabulary_is_named_before_spawning(tmp_path):
    np.array([1, 2, 3, 50_000] * 64, dtype=np.uint16).tofile(tmp_path / "train.bin")
    cfg = load_config(None, TINY + ["--data.path", str(tmp_path / "train.bin")])
    data, model, notes = resolve_data(cfg, get_config("tiny"), tp=1)  # no tokenizer: grown, and said
    assert data.max_id == 50_000 and model.vocab_size == 50_048
    assert any("holds ids up to 50,000 and names no tokenizer" in n for n in notes)
    hf = _hf_config_dir(tmp_path / "hf", vocab=1024)
    cfg = load_config(None, TINY[2:] + ["--data.path", str(tmp_path / "train.bin"), "--model.init_from", str(hf)])
    from fivefold.checkpoint.hf import read_hf_config

    with pytest.raises(ConfigError, match="holds token id 50,000, at or above the model's vocabulary of 1,024"):
        resolve_data(cfg, read_hf_config(str(hf)), tp=1)
    meta = {"model": {"vocab_size": 256}, "tokenizer": None}  # a checkpoint fixes it too
    with pytest.raises(ConfigError, match="holds token id 50,000, at or above the model's vocabulary of 256"):
        resolve_data(load_config(None, TINY + ["--data.path", str(tmp_path / "train.bin")]), get_config("tiny"),
                     1, meta)


def test_a_checkpoint_of_another_tokenizer_and_documents_without_eos_are_refused(tmp_path):
    a, b = _bpe(tmp_path / "a", vocab=300), _bpe(tmp_path / "b", vocab=280)
    corpus = str(_corpus(tmp_path / "c"))
    cfg = load_config(None, TINY + ["--data.path", corpus, "--data.tokenizer", str(a)])
    data, model, _ = resolve_data(cfg, get_config("tiny"), 1)
    import dataclasses

    meta = {"model": {"vocab_size": model.vocab_size}, "tokenizer": dataclasses.asdict(data.tokenizer)}
    resolve_data(cfg, get_config("tiny"), 1, meta)  # the same tokenizer: fine
    other = load_config(None, TINY + ["--data.path", corpus, "--data.tokenizer", str(b)])
    with pytest.raises(ConfigError, match=r"checkpoint was trained with tokenizer tokenizer.json \(vocabulary "
                                          r"\d+, sha256 \w+, end-of-document id 0\), this run's .* \(vocabulary \d+"):
        resolve_data(other, get_config("tiny"), 1, meta)
    for key in (["--data.documents", "mask"], ["--data.loss_across_documents", "false"]):
        with pytest.raises(ConfigError, match="needs an end-of-document token, and the tokenizer bytes"):
            validate(load_config(None, TINY + key), 1)


def test_targets_after_a_boundary_are_ignored_and_the_weight_is_exact():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, 4000).astype(np.uint32)
    tokens[rng.choice(4000, 300, replace=False)] = 7  # the end-of-document id, here and there
    ds = TokenDataset(tokens, 16, 0.1, seed=3).ignore_targets_after(7)
    x, y = ds.global_batch(5, 12)
    assert torch.equal(y == IGNORE, x == 7) and (y[x != 7] >= 0).all()
    kept = int((y != IGNORE).sum())
    assert ds.loss_weight(5, 12) == 12 * 16 / kept
    vx = torch.cat([b[0] for b in ds.val_batches(4, 3)])
    assert ds.val_loss_weight(4, 3) == vx.numel() / int((vx != 7).sum())
    assert TokenDataset(tokens, 16, 0.1, seed=3).loss_weight(5, 12) == 1.0
    # the weighted row-mean loss is the mean over the targets kept
    logits = torch.randn(12, 16, 50)  # (the loss is fp32 whatever the logits)
    got = row_mean_cross_entropy(logits, y) * ds.loss_weight(5, 12)
    want = F.cross_entropy(logits.reshape(-1, 50), y.reshape(-1), ignore_index=IGNORE)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.multiprocess
def test_prepare_then_train_on_the_shards_as_a_user_does(tmp_path):
    """The path a user takes: `fivefold prepare` a corpus with a tokenizer trained here, then `fivefold train`
    on the shards with configs/llama-1b.toml scaled down (documents masked, no loss across a boundary, two
    workers at tp 2, a checkpoint), a resume of it, and a resume with another tokenizer refused before spawning."""
    from pathlib import Path

    from fivefold.cli import main

    tok = _bpe(tmp_path / "tok", vocab=400)
    corpus = _corpus(tmp_path / "corpus", n=60)
    shards = tmp_path / "shards"
    assert main(["prepare", str(corpus), "--tokenizer", str(tok), "--out", str(shards), "--val-fraction", "0.2"]) == 0
    config = Path(__file__).resolve().parent.parent / "configs" / "llama-1b.toml"
    run = ["train", "--config", str(config), "--data", str(shards), "--preset", "tiny", "--nproc", "2",
           "--parallel.tp", "2", "--train.global_batch", "4", "--train.micro_batch", "2", "--train.seq_len", "32",
           "--train.warmup_steps", "1", "--train.eval_every", "2", "--train.eval_batches", "2",
           "--data.loss_across_documents", "false", "--checkpoint.interval", "2", "--run.out_dir", str(tmp_path),
           "--name", "mine", "--run.progress", "false", "--run.plot", "false"]
    assert main([*run, "--steps", "2"]) == 0
    records = [json.loads(line) for line in (tmp_path / "mine" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "val"] == [2]
    meta = json.loads((tmp_path / "mine" / "checkpoints" / "step-00000002" / "fivefold.json").read_text())
    n = load_tokenizer(str(tok)).vocab_size
    assert meta["model"]["vocab_size"] == -(-n // 64) * 64  # the tokenizer's ids padded to a multiple of 64
    assert meta["tokenizer"]["fingerprint"] == load_tokenizer(str(tok)).fingerprint
    assert main([*run, "--steps", "3", "--resume"]) == 0
    other = _bpe(tmp_path / "other", vocab=380, eos="<|end|>")  # (the same text: its own bytes)
    with pytest.raises(ConfigError, match="drop data.tokenizer, or prepare the data again"):
        validate(load_config(config, [*run[3:], "--steps", "4", "--resume", "--data.tokenizer", str(other)]), 2)


def test_a_prepared_directory_too_small_for_the_sequence_is_named_before_spawning(tmp_path):
    from fivefold.train.prepare import prepare

    tok = _bpe(tmp_path / "tok")
    prepare([str(_corpus(tmp_path / "c", n=12))], str(tok), str(tmp_path / "p"), val_fraction=0.1,
            progress=False)
    cfg = load_config(None, TINY + ["--data", str(tmp_path / "p"), "--train.seq_len", "4096"])
    with pytest.raises(ConfigError, match=r"holds \d+ training tokens, too few for train.seq_len=4096"):
        validate(cfg, 1)
    from fivefold.train.shards import read_index

    val = read_index(tmp_path / "p").splits["val"].tokens  # (152 tokens in 2 documents)
    cfg = load_config(None, TINY + ["--data", str(tmp_path / "p"), "--train.seq_len", str(val + 10)])
    with pytest.raises(ConfigError, match=f"holds {val} validation tokens, .* larger --val-fraction"):
        validate(cfg, 1)
    plan = validate(load_config(None, TINY + ["--data", str(tmp_path / "p")]), 1)  # seq 16: fine
    assert plan.data.kind == "prepared" and plan.data.tokenizer_from.endswith("index.json")


def test_what_the_review_found_is_refused_in_one_line(tmp_path):
    """An unfinished prepare directory is not read as text; a text source with a tokenizer without an
    end-of-document token; bytes beyond a fixed vocabulary; the same tokenizer.json with another
    end-of-document token (a tokenizer_config.json the fingerprint does not cover)."""
    from fivefold.checkpoint.hf import read_hf_config
    from fivefold.train.prepare import prepare

    tok = _bpe(tmp_path / "tok")
    corpus = _corpus(tmp_path / "c", n=12)
    prepare([str(corpus)], str(tok), str(tmp_path / "p"), val_fraction=0.2, progress=False)
    (tmp_path / "p" / "index.json").unlink()  # stopped before the end
    with pytest.raises(ConfigError, match=r"^data.path: .*index.json"):
        validate(load_config(None, TINY + ["--data", str(tmp_path / "p")]), 1)
    from tokenizers import Tokenizer, models, pre_tokenizers

    no_eos = Tokenizer(models.WordLevel({"[UNK]": 0, "the": 1}, unk_token="[UNK]"))
    no_eos.pre_tokenizer = pre_tokenizers.Whitespace()
    no_eos.save(str(tmp_path / "noeos.json"))
    with pytest.raises(ConfigError, match="tokenized one document per file with an end-of-document token"):
        validate(load_config(None, TINY + ["--data", str(corpus), "--tokenizer", str(tmp_path / "noeos.json")]), 1)
    hf = _hf_config_dir(tmp_path / "hf", vocab=128)
    cfg = load_config(None, TINY[2:] + ["--data", str(corpus), "--model.init_from", str(hf)])
    with pytest.raises(ConfigError, match="holds token id 255, at or above the model's vocabulary of 128"):
        resolve_data(cfg, read_hf_config(str(hf)), 1)
    prepare([str(corpus)], str(tok), str(tmp_path / "p2"), val_fraction=0.2, progress=False)
    copy = tmp_path / "copy"
    _bpe(copy, eos="<|eos|>")  # the same file, but a config naming another end-of-document token
    (copy / "tokenizer_config.json").write_text(json.dumps({"eos_token": "e"}))
    assert load_tokenizer(str(copy)).fingerprint == load_tokenizer(str(tok)).fingerprint
    assert load_tokenizer(str(copy)).eos_id != load_tokenizer(str(tok)).eos_id
    with pytest.raises(ConfigError, match="but .* was prepared with"):
        validate(load_config(None, TINY + ["--data", str(tmp_path / "p2"), "--tokenizer", str(copy)]), 1)
