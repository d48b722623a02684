"""Every Hugging Face family fivefold reads and writes (fivefold/checkpoint/families.py), checked against
`transformers` itself on tiny random models made here (no download).

In process: each family's config.json maps to fivefold's options and back; the model saved by `save_pretrained`
passes the strict check and, its tensors loaded by name, gives HF's logits and HF's own loss (fp32); what no family
expresses is refused naming the keys. Spawned (one spawn, four ranks): each family loaded into a sharded layout
(dense: ZeRO-3 dp 2 x tp 2; MoE: dp 2 x ep 2) reading only each rank's share, first-step loss equal to HF's, a few
steps trained, a checkpoint written and exported; transformers loads the export (config.json, generation config,
tokenizer) and gives the trained model's logits."""

from __future__ import annotations

import json

import pytest
import torch
from tolerance import assert_values_close, reference

from fivefold.checkpoint.families import FAMILIES
from fivefold.checkpoint.hf import (
    check_hf_weights,
    config_from_hf,
    config_to_hf,
    hf_name,
    iter_hf_tensors,
    read_hf_config,
)
from fivefold.checkpoint.manager import CheckpointError
from fivefold.models.llama import Llama

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
DEEPSEEK = dict(**MOE, n_routed_experts=8, n_group=4, topk_group=2, first_k_dense_replace=1, n_shared_experts=1,
                routed_scaling_factor=2.5, norm_topk_prob=True)
# family -> (config class, model class, the family's own keys): each key set exercises the family's options
SPECS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True)),  # q, k, v and o biases
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q, k, v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),  # per-head q/k norms
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(**MOE, num_experts=4, shared_expert_intermediate_size=24, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(**MOE, num_experts=4, norm_topk_prob=True)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(**DEEPSEEK, attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5)),
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(DEEPSEEK)),
}
DENSE = ("llama", "mistral", "qwen2", "qwen3")
EXPORTED = {"dots1": "glm4_moe"}  # a family export writes another as (its model is the other's with options)
# rule 1's n (tests/tolerance.py): the longest sum behind a logit, o_proj's heads x head_dim = 32 or the
# feed-forward's 48, times the depth's compounding (3 blocks)
TERMS = 3 * 48


def hf_model(family: str, seed: int = 0):
    """A random transformers model of `family`; a DeepSeek-style router gets a nonzero expert bias, so that the
    biased selection matters."""
    config_cls, model_cls, own = SPECS[family]
    config = getattr(transformers, config_cls)(**BASE, **own)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    return model


def hf_logits_and_loss(directory: str, family: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own model of `directory`: logits and its loss with labels = x (it shifts them)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    assert type(model).__name__ == SPECS[family][1]
    with torch.no_grad():
        out = model(x, labels=x)
    return out.logits, out.loss


def fivefold_logits(directory, x: torch.Tensor) -> torch.Tensor:
    """fivefold's model of `directory` with the tensors loaded by name (the single-process reading)."""
    cfg = read_hf_config(directory)
    tensors = dict(iter_hf_tensors(directory))
    family = FAMILIES[json.loads((directory / "config.json").read_text())["model_type"]]
    model = Llama(cfg, seed=0)
    with torch.no_grad():
        for name, value in model.state_dict(keep_vars=True).items():
            if not (cfg.tie_embeddings and name == "output.weight"):
                value.copy_(tensors[hf_name(name, family)])
        return model(x)


def shifted_loss(logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())


@pytest.mark.parametrize("family", SPECS)
def test_each_family_loads_strictly_and_gives_transformers_logits_and_loss(family, tmp_path):
    hf_model(family).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    cfg = config_from_hf(d)
    assert check_hf_weights(tmp_path, cfg) == []  # every tensor used, every parameter found
    back = config_to_hf(cfg, torch.float32, FAMILIES[family])
    assert config_from_hf(back) == cfg  # the family's config.json, written and read again
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    want_logits, want_loss = reference(hf_logits_and_loss, str(tmp_path), family, x)
    got = fivefold_logits(tmp_path, x)
    assert_values_close(got, want_logits, TERMS, f"{family} logits")
    assert_values_close(shifted_loss(got, x), want_loss, TERMS, f"{family} loss")


def test_options_each_family_sets():
    def cfg(family):
        d = json.loads(hf_model(family).config.to_json_string())
        return config_from_hf(d)

    assert cfg("llama").attention_bias == "all" and cfg("qwen2").attention_bias == "qkv"
    assert cfg("qwen3").qk_norm and not cfg("llama").qk_norm and cfg("mistral").sliding_window == 5
    glm = cfg("glm4_moe")
    assert (glm.rotary_dim, glm.attention_bias, glm.qk_norm) == (4, "qkv", True)
    m = glm.moe
    assert (m.score, m.groups, m.group_limit, m.first_dense, m.routed_scaling, m.expert_bias) == (
        "sigmoid", 4, 2, 1, 2.5, True)
    q = cfg("qwen2_moe").moe
    assert (q.shared_experts, q.shared_hidden, q.shared_gate, q.norm_topk) == (1, 24, True, False)
    assert not cfg("mixtral").moe.shared_experts and cfg("mixtral").moe.norm_topk


def test_what_no_family_expresses_is_refused_naming_it():
    base = {**BASE, "model_type": "qwen2"}
    for bad, why in ((dict(hidden_act="gelu"), "hidden_act='gelu'"),
                     (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
                     (dict(model_type="gpt2"), "model_type='gpt2' is not a family"),
                     (dict(model_type="deepseek_v3"), "multi-head latent attention"),
                     (dict(layer_types=["full_attention", "sliding_attention", "full_attention"],
                           sliding_window=8, use_sliding_window=True), "a sliding window on 1 of 3 layers"),
                     (dict(layer_types=["full_attention"], sliding_window=8), "layer_types has 1 entries"),
                     (dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=0.1), "router_jitter_noise")):
        with pytest.raises(CheckpointError, match=why):
            config_from_hf({**base, **bad})
    # both problems of one config.json in one line
    with pytest.raises(CheckpointError, match="hidden_act.*; mlp_bias"):
        config_from_hf({**base, "model_type": "llama", "hidden_act": "gelu", "mlp_bias": True})
    import dataclasses

    from fivefold.models.llama import get_config

    tiny = get_config("tiny")
    with pytest.raises(CheckpointError, match="no Hugging Face family expresses this model"):
        config_to_hf(dataclasses.replace(tiny, rotary_dim=16), torch.float32)
    with pytest.raises(CheckpointError, match="a qwen2 model has attention_bias qkv"):
        config_to_hf(tiny, torch.float32, FAMILIES["qwen2"])
    assert config_to_hf(dataclasses.replace(tiny, qk_norm=True), torch.float32)["model_type"] == "qwen3"
    assert config_to_hf(dataclasses.replace(tiny, sliding_window=9), torch.float32)["model_type"] == "mistral"


def test_a_family_relabelled_is_refused_before_any_step(tmp_path):
    """A Qwen3 checkpoint whose config.json says qwen2: the q/k norms have no place, the q/k/v biases are missing."""
    hf_model("qwen3").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": "qwen2"}))
    with pytest.raises(CheckpointError, match=r"has no tensor 'model.layers.0.self_attn.q_proj.bias'.*\(qwen2\)"):
        check_hf_weights(tmp_path, read_hf_config(tmp_path))


# ---------------------------------------------------------------------------------------------
# Sharded: each family in, trained, out (one spawn of four ranks for all of them).

STEPS = 3


def _batches(family: str) -> list[torch.Tensor]:
    """STEPS training batches and one to evaluate, [4, 17] tokens each (inputs [:, :-1], targets [:, 1:])."""
    g = torch.Generator().manual_seed(sum(map(ord, family)))
    return [torch.randint(0, 96, (4, 17), generator=g) for _ in range(STEPS + 1)]


def _family_worker(root: str, families: list[str]) -> dict:
    """Per family: its HF directory loaded into ZeRO-3 dp 2 x tp 2 (dense) or ZeRO-1 dp 4 with ep 2 (MoE: the
    experts dp 2 x ep 2), the first step's loss, STEPS steps, a checkpoint, the loss of the trained model on the
    last batch."""
    import dataclasses
    from pathlib import Path

    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.hf import load_hf_weights
    from fivefold.checkpoint.manager import Checkpointer
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    out = {}
    for family in families:
        directory = Path(root) / family / "hf"
        model_cfg = read_hf_config(directory)
        cfg = Config()
        cfg.train.seq_len, cfg.train.grad_accum, cfg.train.lr, cfg.train.warmup_steps = 16, 1, 3e-3, 0
        if model_cfg.moe is None:
            cfg.zero.stage, cfg.parallel.tp = 3, 2
            dims = ParallelDims(dp=2, tp=2)
        else:
            cfg.zero.stage, cfg.parallel.ep = 1, 2
            dims = ParallelDims(dp=4, ep=2)
        mesh = ParallelMesh(dims, "cpu", CommLog())
        parts = parallelize(cfg, model_cfg, mesh, "cpu")
        load_hf_weights(directory, parts.engines.values(), mesh.comm("tp"))
        dp = mesh.comm("dp")
        losses = []
        for step, batch in enumerate(_batches(family)):
            mine = batch.chunk(dp.size)[dp.rank]
            loss = parts.forward_backward([(mine[:, :-1], mine[:, 1:])])
            losses.append(parts.global_loss(loss).item())
            if step < STEPS:
                parts.step(1.0)
        state = training_state(parts.engines.values(), mesh.comm("tp")).state_dict
        meta = {"steps_done": STEPS, "model": dataclasses.asdict(model_cfg)}
        Checkpointer(Path(root) / family / "run").save(STEPS, state, meta)
        out[family] = dict(first=losses[0], trained=losses[-1])
    return out


@pytest.mark.multiprocess
def test_each_family_in_a_sharded_layout_equals_transformers_then_exports_back(tmp_path, families=tuple(SPECS)):
    from dist_utils import run_workers

    from fivefold.checkpoint.hf import export_checkpoint

    for family in families:
        hf_model(family).save_pretrained(tmp_path / family / "hf")
    results = run_workers(_family_worker, 4, str(tmp_path), list(families))
    assert all(r == results[0] for r in results)  # the global losses, the same on every rank
    for family, got in results[0].items():
        first, last = _batches(family)[0], _batches(family)[-1]
        _, want = reference(hf_logits_and_loss, str(tmp_path / family / "hf"), family, first)
        assert_values_close(got["first"], want, TERMS, f"{family}: the first step's loss")
        # written as the family it came from, the plainest that expresses it: dots1's model is a GLM-4.5 one
        # with q/k norms; --family writes another that expresses it
        choices = [(EXPORTED.get(family, family), None)] + ([(family, family)] if family in EXPORTED else [])
        for written, chosen in choices:
            out = tmp_path / family / f"out-{written}"
            assert export_checkpoint(tmp_path / family / "run", out, family=chosen)["family"] == written
            logits, loss = reference(hf_logits_and_loss, str(out), written, last)
            assert_values_close(got["trained"], loss, TERMS, f"{family}: the trained model's loss as {written}")
            assert_values_close(fivefold_logits(out, last), logits, TERMS, f"{family}: exported logits")
        assert abs(got["trained"] - got["first"]) > 1e-3  # it trained
        trained, initial = dict(iter_hf_tensors(out)), dict(iter_hf_tensors(tmp_path / family / "hf"))
        assert trained.keys() == initial.keys()
        for name, value in initial.items():
            if name.endswith("e_score_correction_bias"):  # the aux-loss-free bias moved with the load
                assert not torch.equal(trained[name], value), name


# ---------------------------------------------------------------------------------------------
# The export carries the run's tokenizer: from_pretrained + the tokenizer + generate, no hand decoding.

TEXT = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
        "sphinx of black quartz, judge my vow"] * 20


def _bpe(folder):
    """A byte-level BPE trained here with an end-of-document token named in a tokenizer_config.json beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|eos|>"],
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>",
                                                             "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


def _greedy(directory, ids: torch.Tensor, new: int) -> torch.Tensor:
    """Greedy continuation by fivefold's own model of `directory` (the whole sequence each token)."""
    for _ in range(new):
        ids = torch.cat([ids, fivefold_logits(directory, ids)[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.multiprocess
def test_export_carries_the_runs_tokenizer_so_transformers_generates(tmp_path):
    from fivefold.cli import main

    tok = _bpe(tmp_path / "tok")
    (tmp_path / "corpus.txt").write_text("\n".join(TEXT))
    args = ["train", "--preset", "tiny", "--model.qk_norm", "true", "--tokenizer", str(tok), "--data",
            str(tmp_path / "corpus.txt"), "--steps", "2", "--nproc", "2", "--train.seq_len", "32",
            "--train.global_batch", "4", "--train.eval_every", "0", "--checkpoint.interval", "2", "--run.out_dir",
            str(tmp_path), "--run.name", "run", "--run.progress", "false", "--run.plot", "false",
            "--run.check_memory", "false"]
    assert main(args) == 0
    assert main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    eos = json.loads((tok / "tokenizer.json").read_text())["added_tokens"][0]["id"]
    assert config["model_type"] == "qwen3" and config["eos_token_id"] == eos
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = hf_tok("the quick brown", return_tensors="pt").input_ids
    from fivefold.train.tokenizer import load_tokenizer

    assert ids[0].tolist() == load_tokenizer(str(tok)).encode("the quick brown").tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    generated = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 6)
    assert torch.equal(generated, _greedy(out, ids, 6))  # transformers' greedy decoding = fivefold's
    assert hf_tok.decode(generated[0]).startswith("the quick brown")
    # the tokenizer moved: the export says so and --tokenizer names it (checked against the recorded sha256)
    (tok / "tokenizer.json").rename(tmp_path / "moved.json")
    from fivefold.checkpoint.hf import export_checkpoint

    assert "is gone" in export_checkpoint(tmp_path / "run", tmp_path / "again")["notes"][0]
    assert export_checkpoint(tmp_path / "run", tmp_path / "again", tokenizer=str(tmp_path / "moved.json"))[
        "notes"] == []
    (tmp_path / "other.json").write_text((tmp_path / "moved.json").read_text() + "\n")  # another file
    assert "sha256 differs" in export_checkpoint(tmp_path / "run", tmp_path / "again",
                                                 tokenizer=str(tmp_path / "other.json"))["notes"][0]


def test_the_byte_tokenizer_is_exported_as_one_transformers_reads(tmp_path):
    from fivefold.checkpoint.hf import write_tokenizer

    notes, ids = write_tokenizer(None, tmp_path)
    assert notes == [] and ids == {"bos_token_id": None, "eos_token_id": None}
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "héllo, wörld\n\t ~"
    assert hf_tok(text).input_ids == list(text.encode())  # id i is byte i
    assert hf_tok.decode(list(text.encode())) == text


# ---------------------------------------------------------------------------------------------
# What a config.json leaves out, and the windows, read as transformers reads them.

def _hf_windows(family: str, config) -> list:
    """transformers' window per layer for `config` (its config class's post-init): the families with layer_types
    read them, the others put config.sliding_window on every layer."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if family in ("qwen2", "qwen3", "qwen2_moe", "dots1") and types is not None:
        return [config.sliding_window if t == "sliding_attention" else None for t in types]
    return [getattr(config, "sliding_window", None) or None] * n


# every family's default kv heads (4 to 32) divide 32 heads
MINIMAL = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=32)
TOP2 = dict(num_experts_per_tok=2, moe_intermediate_size=16)
MINIMAL_MOE = {"mixtral": dict(num_experts_per_tok=2), "qwen2_moe": dict(num_experts=4, **TOP2),
               "qwen3_moe": dict(num_experts=4, **TOP2), "glm4_moe": dict(n_routed_experts=4, head_dim=8, **TOP2),
               "dots1": dict(n_routed_experts=4, n_shared_experts=1, **TOP2)}
WINDOWS = [dict(sliding_window=6), dict(sliding_window=6, use_sliding_window=True),
           dict(sliding_window=6, use_sliding_window=True, max_window_layers=0),
           dict(sliding_window=6, max_window_layers=2), dict(sliding_window=None)]


@pytest.mark.parametrize("family", SPECS)
def test_a_minimal_config_is_read_with_transformers_defaults_and_windows(family):
    """A config.json with only the sizes (and the keys each window case sets): fivefold's model is the one
    transformers' config class makes of it — its defaults for what is left out, its window on every layer or none
    (a window on some layers only is refused, as fivefold's is one for the model)."""
    config_cls = getattr(transformers, SPECS[family][0])
    for window in [{}] + ([] if family in ("llama", "glm4_moe") else WINDOWS):  # (no window there)
        d = {"model_type": family, **MINIMAL, **MINIMAL_MOE.get(family, {}), **window}
        full = json.loads(config_cls(**d).to_json_string())
        windows = _hf_windows(family, config_cls(**d))
        if len(set(windows)) > 1:  # transformers slides on some layers only
            with pytest.raises(CheckpointError, match="a sliding window on"):
                config_from_hf(d)
            continue
        got = config_from_hf(d)
        assert got == config_from_hf(full), (family, window)  # the defaults are transformers' own
        assert got.sliding_window == windows[0], (family, window, windows)


def test_the_review_findings_stay_fixed(tmp_path):
    """A Mixtral whose experts are narrower than ffn_hidden exports its experts' width; DeepSeek-V3 (read only) is
    never written; decoder_sparse_step 0 is one line; a resumed checkpoint must have the families' options; a tensor
    in a shard the index does not name is unused."""
    import dataclasses

    from fivefold.models.llama import get_config
    from fivefold.models.moe import MoEConfig
    from fivefold.train.checkpointing import check_model_matches

    narrow = dataclasses.replace(get_config("tiny"), moe=MoEConfig(experts=4, top_k=2, hidden=16))
    d = config_to_hf(narrow, torch.float32)
    assert (d["model_type"], d["intermediate_size"]) == ("mixtral", 16)
    back = config_from_hf(d)  # no dense block: the experts' width is Mixtral's intermediate_size
    assert (back.moe.hidden or back.ffn_hidden) == 16 and back.moe.experts == 4
    with pytest.raises(CheckpointError, match="deepseek_v3 is read, never written"):
        config_to_hf(get_config("tiny-deepseek-v3"), torch.float32, FAMILIES["deepseek_v3"])
    with pytest.raises(CheckpointError, match="decoder_sparse_step=0 must be at least 1"):
        config_from_hf({"model_type": "qwen3_moe", **MINIMAL, "num_experts": 4, "decoder_sparse_step": 0})
    saved = dataclasses.asdict(get_config("tiny-qwen2"))
    with pytest.raises(CheckpointError, match="attention_bias='qkv' there, attention_bias='off' here"):
        check_model_matches(tmp_path, {"model": saved}, dataclasses.asdict(get_config("tiny")))
    from safetensors.torch import load_file, save_file

    hf_model("qwen3").save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shard = tmp_path / "hf" / sorted(set(index["weight_map"].values()))[0]
    save_file({**load_file(shard), "model.stray.weight": torch.zeros(2)}, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="holds 'model.stray.weight'"):
        check_hf_weights(tmp_path / "hf", read_hf_config(tmp_path / "hf"))
