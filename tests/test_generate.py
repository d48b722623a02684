"""`fivefold generate` and `fivefold eval` (fivefold/use/, the KV cache in fivefold/models/kv_cache.py), checked
against transformers and against the trainer itself, on tiny models made here (no download).

In process: the cached decode's logits equal the full forward's at every position (rule 1 of tests/tolerance.py; the
prefill bit for bit) for each family's options (sliding window shorter than the sequence, q/k norms, biases, partial
rotary, MoE blocks with shared experts and an expert bias); greedy `generate` equals transformers' `generate` token for
token on a transformers model of each family; seeded sampling is reproducible and a nucleus of one is greedy; `eval`
equals a hand computation on a prepared directory's val and train splits; bad input is one line with exit code 2.
Spawned: (1) a Mistral-style run (window 8) trained by `fivefold train` under ZeRO-3 dp 2 with a BPE tokenizer:
`eval` gives the trainer's recorded val loss, `generate` from the run gives the tokens of its export and transformers'
`generate` on the export; (2) a dense Llama under tp 2 and a Qwen3-MoE under ep 2, checkpointed in one spawn:
generated from the run, from the export by fivefold and by transformers, the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dist_utils import run_workers
from tolerance import assert_values_close

from fivefold.cli import main
from fivefold.models.kv_cache import KVCache
from fivefold.models.llama import Llama, get_config
from fivefold.use.generate import Sampling, generate, generate_ids
from fivefold.use.model import load_model

transformers = pytest.importorskip("transformers")
from test_hf_families import TEXT, _bpe, hf_model  # noqa: E402 (transformers first: it skips without)

# rule 1's n for a logit: the longest sum behind it (the feed-forward's 384 or 256, a query over <= 24 keys),
# times the depth's compounding (2 blocks)
TERMS = 2 * 384


@pytest.fixture(autouse=True)
def one_thread():
    """Decoding a tiny model is one small kernel after another: one thread (as the workers run) spends no time
    waking others on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# The KV cache: the decode's logits are the full forward's.

CACHED = {
    "llama": ("tiny", {}),
    "window shorter than the sequence": ("tiny-mistral", dict(sliding_window=5)),
    "q/k norms": ("tiny-qwen3", {}),
    "biases, partial rotary": ("tiny", dict(attention_bias="all", rotary_dim=16)),
    "MoE, shared gated expert, q/k/v biases": ("tiny-qwen2-moe", {}),
    "MoE, expert bias, groups, a dense first block": ("tiny-deepseek-v3", {}),
}


@pytest.mark.parametrize("case", CACHED)
def test_the_cached_decode_gives_the_full_forwards_logits_at_every_position(case):
    preset, options = CACHED[case]
    model = Llama(get_config(preset, n_layers=2, max_seq_len=64, **options), seed=1).eval()
    for m in model.modules():  # an expert bias that matters for the choice
        if getattr(m, "expert_bias", None) is not None:
            m.expert_bias.copy_(torch.randn(m.expert_bias.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(64)
        prefill = model(x[:, :7], cache=cache)
        steps = [model(x[:, i:i + 1], cache=cache) for i in range(7, 20)]
        chunked = KVCache(64)  # several tokens after a cache: the mask of the general case
        chunks = torch.cat([model(x[:, a:b], cache=chunked) for a, b in ((0, 4), (4, 13), (13, 20))], 1)
        assert torch.equal(prefill, model(x[:, :7]))  # the prefill is the training path's forward, bit for bit
        assert torch.equal(model(x, cache=KVCache(64)), full)
    assert cache.length == 20 and chunked.length == 20
    assert_values_close(torch.cat([prefill, *steps], 1), full, TERMS, f"{case}: cached decode")
    assert_values_close(chunks, full, TERMS, f"{case}: chunks after a cache")
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        model(torch.zeros(1, 45, dtype=torch.long), cache=cache)


# ---------------------------------------------------------------------------------------------
# Greedy decoding equals transformers', family by family (transformers' own random models).

# the families' options: window 5 (shorter than prompt + new), q/k/v biases, q/k norms, MoE (softmax top-k;
# Qwen2-MoE's gated shared expert; GLM-4.5's sigmoid scores, expert bias, groups, partial rotary)
GREEDY = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "glm4_moe")


def _hf_greedy(directory, ids: list[int], new: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
    return out[0].tolist()


@pytest.mark.parametrize("family", GREEDY)
def test_greedy_generate_equals_transformers_token_for_token(family, tmp_path):
    hf_model(family).save_pretrained(tmp_path)
    used = load_model(tmp_path, tokenizer="bytes")
    prompt = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    got = generate_ids(used.model, prompt, 12, eos_ids=used.eos_ids)
    assert got == _hf_greedy(tmp_path, prompt, 12)
    assert len(got) > len(prompt) + 5  # (a generation, not an early end-of-sequence)


# ---------------------------------------------------------------------------------------------
# Sampling: seeded, reproducible; a nucleus of one token is greedy.

def test_seeded_sampling_is_reproducible_and_a_tiny_nucleus_is_greedy():
    model = Llama(get_config("tiny", n_layers=2, max_seq_len=64), seed=0).eval()  # near-uniform over 256 ids
    prompt = [5, 6, 7]
    draw = lambda seed, p=0.9: generate_ids(model, prompt, 20, Sampling(1.0, p, seed))  # noqa: E731
    assert draw(1) == draw(1)
    assert draw(1) != draw(2)  # 20 draws from ~90% of 256 ids: another seed gives other tokens
    assert draw(1, 1e-9) == draw(2, 1e-9) == generate_ids(model, prompt, 20)  # only the likeliest is kept
    assert len(draw(1)) == 23
    # the context ends a generation: 64 positions
    assert len(generate_ids(model, list(range(60)), 20)) == 64


def test_generate_decodes_dropless_and_gives_each_moe_layer_its_capacity_back():
    from fivefold.models.moe import MoEConfig, MoEFeedForward
    from fivefold.use.generate import dropless
    from fivefold.use.model import UsedModel, run_tokenizer

    moe = MoEConfig(experts=4, top_k=2, capacity_factor=1.25)
    model = Llama(get_config("tiny", n_layers=2, max_seq_len=64, moe=moe), seed=0).eval()
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    assert layers and all(m.config.capacity_factor == 1.25 for m in layers)
    seen = []
    real = MoEFeedForward.forward

    def forward(self, *args, **kwargs):  # the setting the decode runs under
        seen.append(self.config.capacity_factor)
        return real(self, *args, **kwargs)

    tok, record = run_tokenizer({})
    used = UsedModel(model, tok, record, (), "here", None)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MoEFeedForward, "forward", forward)
        assert generate(used, "abc", 4).new_tokens == 4
    assert seen and set(seen) == {None}
    assert [m.config.capacity_factor for m in layers] == [1.25, 1.25]
    with pytest.raises(RuntimeError, match="stop"), dropless(model):  # also back after an error
        assert {m.config.capacity_factor for m in layers} == {None}
        raise RuntimeError("stop")
    assert [m.config.capacity_factor for m in layers] == [1.25, 1.25]


# ---------------------------------------------------------------------------------------------
# eval: a hand computation, on a prepared directory.

def _hf_dir_of(model: Llama, directory: Path, tokenizer: Path) -> Path:
    """`model` as a Hugging Face directory (its family's names, config.json) with `tokenizer` beside it."""
    from safetensors.torch import save_file

    from fivefold.checkpoint.hf import config_to_hf, hf_name

    directory.mkdir(parents=True, exist_ok=True)
    save_file({hf_name(n): p.detach().contiguous() for n, p in model.named_parameters()},
              str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config_to_hf(model.config, torch.float32)))
    for f in tokenizer.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    return directory


def test_eval_equals_a_hand_computation_on_a_prepared_directory(tmp_path):
    from fivefold.train.prepare import prepare
    from fivefold.train.shards import ShardedTokens, read_index
    from fivefold.use.evaluate import evaluate

    tok = _bpe(tmp_path / "tok")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i:02d}.txt").write_text(" ".join(TEXT[i % 3 + j] for j in range(i % 5 + 1)))
    prepare([str(docs)], str(tok), tmp_path / "prepared", val_fraction=0.3, progress=False)
    model = Llama(get_config("tiny", n_layers=2, vocab_size=320, max_seq_len=64), seed=4).eval()
    used = load_model(_hf_dir_of(model, tmp_path / "hf", tok), device="cpu")
    index = read_index(tmp_path / "prepared")
    for split in ("val", "train"):
        report = evaluate(used, str(tmp_path / "prepared"), split, batches=3, seq_len=16, micro_batch=2)
        tokens = np.asarray(ShardedTokens(index, split), dtype=np.int64)
        starts = np.linspace(0, len(tokens) - 17, 6).round().astype(np.int64)  # evenly spaced windows
        windows = torch.from_numpy(tokens[starts[:, None] + np.arange(17)])
        with torch.no_grad():
            losses = [torch.nn.functional.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten())
                      for w in windows.split(2)]
        want = sum(float(v) for v in losses) / 3
        assert (report.batches, report.micro_batch, report.seq_len, report.split) == (3, 2, 16, split)
        # the same logits; the loss's sums (over 320 ids, chunked in fp32) in another order
        assert report.loss == pytest.approx(want, rel=1e-6), split
        assert report.perplexity == pytest.approx(np.exp(want), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2.

@pytest.fixture
def byte_model(tmp_path):
    """A tiny Llama of 64 positions as a Hugging Face directory with the byte tokenizer."""
    from fivefold.checkpoint.hf import _byte_tokenizer

    tok = tmp_path / "bytes"
    tok.mkdir()
    _byte_tokenizer(tok)
    return _hf_dir_of(Llama(get_config("tiny", n_layers=1, max_seq_len=64), seed=0), tmp_path / "hf", tok)


def test_bad_input_is_one_line_with_exit_code_2(byte_model, tmp_path, capsys):
    cases = [
        (["generate", str(tmp_path / "missing"), "--prompt", "hi"], "does not exist"),
        (["generate", str(byte_model), "--prompt", ""], "empty"),
        (["generate", str(byte_model), "--prompt", "hi", "--temperature", "-1"], "--temperature -1"),
        (["generate", str(byte_model), "--prompt", "hi", "--top-p", "0"], "--top-p 0: give a probability in (0, 1]"),
        (["generate", str(byte_model), "--prompt", "hi", "--top-p", "1.5"], "--top-p 1.5"),
        (["generate", str(byte_model), "--prompt", "x" * 65], "65 tokens, longer than the model's context of 64"),
        (["generate", str(byte_model), "--prompt", "hi", "--device", "cuda"], "--device='cuda'"),
        (["generate", str(tmp_path), "--prompt", "hi"], "holds no complete fivefold checkpoint"),
        (["eval", str(byte_model), "--data", str(tmp_path / "none")], "--data"),
        (["eval", str(byte_model), "--data", str(byte_model / "config.json"), "--seq-len", "100"],
         "--seq-len 100 exceeds the model's context of 64"),
        (["eval", str(byte_model), "--data", str(byte_model / "config.json"), "--batches", "0"], "--batches 0"),
    ]
    if torch.accelerator.is_available():  # (the cuda case is refused only where there is none)
        cases = [c for c in cases if "--device" not in c[0]]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, (argv, err)
    assert main(["generate", str(byte_model), "--prompt", "hello", "--max-new", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("hello") and len(out.rstrip("\n").encode()) >= 5


# ---------------------------------------------------------------------------------------------
# Spawned (1): a run trained by `fivefold train` under ZeRO-3 dp 2.

@pytest.mark.multiprocess
def test_a_zero3_run_evaluates_to_its_val_loss_and_generates_as_its_export(tmp_path, capsys):
    tok = _bpe(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text("\n".join(TEXT))
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny-mistral", "--model.n_layers", "2", "--model.sliding_window", "8",
                 "--tokenizer", str(tok), "--data", str(tmp_path / "corpus.txt"), "--data.val_fraction", "0.25",
                 "--steps", "3", "--nproc", "2", "--zero", "3", "--train.seq_len", "32", "--train.global_batch", "4",
                 "--train.eval_every", "3", "--train.eval_batches", "4", "--checkpoint.interval", "3",
                 "--run.out_dir", str(tmp_path), "--run.name", "run", "--run.progress", "false", "--run.plot", "false",
                 "--run.check_memory", "false"]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if r.get("kind") == "val"]
    capsys.readouterr()
    # eval: the trainer's batches (4 of 2 windows of 32: its eval_batches, micro-batch, seq_len), the same mean; the
    # trainer sums each rank's 2 batches and averages the ranks in fp64, eval the 4 in one sum: equal within fp64's
    # reordering, far below 1e-12
    assert main(["eval", str(run), "--data", str(tmp_path / "corpus.txt"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["batches"], report["micro_batch"], report["seq_len"]) == (4, 2, 32)
    assert report["loss"] == pytest.approx(val[-1], rel=1e-12, abs=0)
    assert main(["eval", str(run), "--data", str(tmp_path / "corpus.txt"), "--split", "train", "--batches", "2"]) == 0
    assert "(train, 2 batches x 2 x 32 tokens): loss" in capsys.readouterr().out
    # generate: from the run (its checkpoint's shards, its recorded tokenizer) = from its export = transformers'
    assert main(["export", str(run), "--to", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mistral"
    capsys.readouterr()
    prompt = "the quick brown"
    assert main(["generate", str(run), "--prompt", prompt, "--max-new", "12"]) == 0
    from_run = capsys.readouterr().out
    assert main(["generate", str(tmp_path / "hf"), "--prompt", prompt, "--max-new", "12"]) == 0
    assert capsys.readouterr().out == from_run and from_run.startswith(prompt)
    ours = generate(load_model(run), prompt, 12)
    assert ours.ids == generate(load_model(tmp_path / "hf"), prompt, 12).ids
    assert ours.prompt_tokens + 12 > 8  # prompt + new longer than the window
    assert ours.ids == _hf_greedy(tmp_path / "hf", ours.ids[:ours.prompt_tokens], 12)
    # seeded sampling from the run: reproducible
    sampled = []
    for seed in (5, 5, 6):
        assert main(["generate", str(run), "--prompt", prompt, "--temperature", "1", "--top-p", "0.9", "--seed",
                     str(seed), "--max-new", "20"]) == 0
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1] != sampled[2] and sampled[2].startswith(prompt)
    # the recorded tokenizer moved: named by --tokenizer (checked by its sha256), else one line
    (tok / "tokenizer.json").rename(tmp_path / "moved.json")
    assert main(["generate", str(run), "--prompt", prompt]) == 2
    assert "is gone (or unreadable): --tokenizer FILE names it" in capsys.readouterr().err
    assert main(["generate", str(run), "--prompt", prompt, "--max-new", "12", "--tokenizer",
                 str(tmp_path / "moved.json")]) == 0
    assert capsys.readouterr().out == from_run
    (tmp_path / "other.json").write_text((tmp_path / "moved.json").read_text() + "\n")
    assert main(["generate", str(run), "--prompt", prompt, "--tokenizer", str(tmp_path / "other.json")]) == 2
    assert "the run trained with" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Spawned (2): a dense Llama under tp 2 and a Qwen3-MoE under ep 2, checkpointed in one spawn.

SHARDED = {"llama-tp2": ("tiny", dict(tp=2)), "qwen3_moe-ep2": ("tiny-qwen3-moe", dict(dp=2, ep=2))}


def _sharded_worker(root: str) -> None:
    import dataclasses

    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    for name, (preset, dims) in SHARDED.items():
        model_cfg = get_config(preset, n_layers=2, max_seq_len=64)
        cfg = Config()
        cfg.train.seq_len, cfg.train.grad_accum, cfg.train.lr, cfg.train.warmup_steps = 16, 1, 1e-2, 0
        cfg.parallel.tp, cfg.parallel.ep = dims.get("tp", 1), dims.get("ep", 1)
        mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
        parts = parallelize(cfg, model_cfg, mesh, "cpu")
        g = torch.Generator().manual_seed(7)
        dp = mesh.comm("dp")
        for _ in range(2):
            batch = torch.randint(0, 256, (2, 17), generator=g).chunk(dp.size)[dp.rank]
            parts.forward_backward([(batch[:, :-1], batch[:, 1:])])
            parts.step(1.0)
        state = training_state(parts.engines.values(), mesh.comm("tp")).state_dict
        meta = {"steps_done": 2, "model": dataclasses.asdict(model_cfg)}
        Checkpointer(Path(root) / name).save(2, state, meta)


@pytest.mark.multiprocess
def test_runs_sharded_by_tp_and_ep_generate_as_their_exports_and_transformers(tmp_path):
    from fivefold.checkpoint.hf import export_checkpoint

    run_workers(_sharded_worker, 2, str(tmp_path))
    prompt = torch.randint(0, 256, (5,), generator=torch.Generator().manual_seed(8)).tolist()
    for name in SHARDED:
        family = export_checkpoint(tmp_path / name, tmp_path / f"{name}-hf")["family"]
        assert family == name.split("-")[0]
        from_run = generate_ids(load_model(tmp_path / name).model, prompt, 12)
        exported = load_model(tmp_path / f"{name}-hf")
        assert from_run == generate_ids(exported.model, prompt, 12, eos_ids=exported.eos_ids)
        assert from_run == _hf_greedy(tmp_path / f"{name}-hf", prompt, 12), name
