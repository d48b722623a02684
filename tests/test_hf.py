"""Hugging Face Llama in and out, checked against `transformers` itself.

Config mapping and refusals; Llama-3 RoPE scaling equal to transformers'; `fivefold export` of a
ZeRO-1 dp 2 checkpoint (parameters equal, LlamaForCausalLM gives fivefold's logits); a model saved
by `transformers` (RoPE scaling, explicit head_dim, tied embeddings, several shards) loaded into
ZeRO-3 dp 2 × tp 2 reading only each rank's rectangles (parameters and logits equal); train from an
HF model and export it back; damaged files named. The export / load tests spawn (`multiprocess`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist_utils import run_workers
from tolerance import Bound, assert_values_close, reference, unit_roundoff

from fivefold.checkpoint.hf import (
    config_from_hf,
    config_to_hf,
    export_checkpoint,
    hf_name,
    iter_hf_tensors,
    load_hf_weights,
    read_hf_config,
)
from fivefold.checkpoint.manager import CheckpointError
from fivefold.models.llama import Llama, LlamaConfig, RopeScaling

transformers = pytest.importorskip("transformers")  # a test extra ([dev]); the rest of fivefold does not need it

HF_CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
                 rope_theta=50000.0, tie_word_embeddings=True,
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16})


# rule 1's n (tests/tolerance.py) for fivefold's logits against transformers': the same math, its sums perhaps in
# another order; the longest is o_proj's inner dimension, heads x head_dim = 64 (intermediate 48, hidden 32, 24 keys)
LOGIT_TERMS = HF_CONFIG["num_attention_heads"] * HF_CONFIG["head_dim"]


def _fivefold_logits(cfg: LlamaConfig, tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    model = Llama(cfg, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[hf_name(name)])
        return model(x)


def _hf_logits(directory: str, x: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaForCausalLM of `directory` on x: the reference the logits are compared with."""
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(x).logits


def test_config_maps_both_ways_and_refuses_what_llama_cannot_express():
    cfg = config_from_hf(HF_CONFIG)
    assert (cfg.dim, cfg.head_dim, cfg.attention_head_dim, cfg.tie_embeddings) == (32, 16, 16, True)
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 16)
    back = config_to_hf(cfg, torch.float32)
    assert {k: back[k] for k in HF_CONFIG} == HF_CONFIG
    v5 = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_scaling", "rope_theta")}  # transformers 5's spelling
    v5["rope_parameters"] = {**HF_CONFIG["rope_scaling"], "rope_theta": HF_CONFIG["rope_theta"]}
    assert config_from_hf(v5) == cfg and config_from_hf(back) == cfg
    for bad, why in ((dict(hidden_act="gelu"), "hidden_act"), (dict(mlp_bias=True), "mlp_bias"),
                     (dict(model_type="gpt2"), "model_type"),
                     (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'")):
        with pytest.raises(CheckpointError, match=why):
            config_from_hf({**HF_CONFIG, **bad})
    # the other families (tests/test_hf_families.py): a Llama with biases is attention_bias "all"
    assert config_from_hf({**HF_CONFIG, "attention_bias": True}).attention_bias == "all"
    with pytest.raises(CheckpointError, match="no Hugging Face llama counterpart"):
        hf_name("layers.0.feed_forward.expert_gate.weight")


def test_llama3_rope_scaling_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from fivefold.models.llama import precompute_rope
    hf_cfg = transformers.LlamaConfig(**HF_CONFIG)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    scaling = RopeScaling(8.0, 1.0, 4.0, 16)
    ours = scaling.apply(1.0 / (50000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)))
    # fivefold computes in fp64, HF in fp32: pow (within 1 ulp: 2u), the reciprocal, 2π in fp32 and the llama3
    # interpolation's 8 roundings, 12u in all, each amplified by at most the interpolation's condition number 10/3
    # (d ln f / d ln inv_freq <= 1 + (1/3)(7/8)/(1/8) at these factors)
    Bound(rtol=12 * 10 / 3 * unit_roundoff(), atol=0).assert_holds(inv_freq, ours, "inv_freq")
    assert not torch.allclose(ours.float(), 1.0 / (50000.0 ** (torch.arange(0, 16, 2) / 16)))  # it does scale
    cos, _ = precompute_rope(16, 64, 50000.0, scaling=scaling)
    assert torch.equal(cos[:, :8], torch.outer(torch.arange(64.0), ours).cos().float())  # the same fp64 ops, one cast


# ---------------------------------------------------------------------------------------------
# Out: a checkpoint written under ZeRO-1 dp 2 becomes HF safetensors.

def _train_and_save(root: str) -> dict:
    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    cfg = Config()
    cfg.zero.stage, cfg.train.seq_len, cfg.train.grad_accum, cfg.train.lr = 1, 16, 1, 1e-2
    model_cfg = config_from_hf({**HF_CONFIG, "tie_word_embeddings": False})
    mesh = ParallelMesh(ParallelDims(dp=2), "cpu", CommLog())
    parts = parallelize(cfg, model_cfg, mesh, "cpu")
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 64, (4, 16), generator=g)
        parts.forward_backward([(x[mesh.rank("dp") * 2:][:2], x[mesh.rank("dp") * 2:][:2])])
        parts.step(1.0)
    state = training_state(parts.engines.values(), mesh.comm("tp")).state_dict
    meta = {"steps_done": 2, "model": __import__("dataclasses").asdict(model_cfg)}
    Checkpointer(Path(root)).save(2, state, meta)
    return parts.full_state_dict()


@pytest.mark.multiprocess
def test_export_writes_hf_llama_that_transformers_runs_with_the_same_logits(tmp_path):
    params = run_workers(_train_and_save, 2, str(tmp_path / "ckpt"))[0]
    small = export_checkpoint(tmp_path / "ckpt", tmp_path / "one")
    assert small["files"] == ["model.safetensors"]
    sharded = export_checkpoint(tmp_path / "ckpt", tmp_path / "many", max_shard_bytes=20_000)
    assert len(sharded["files"]) > 2 and (tmp_path / "many" / "model.safetensors.index.json").is_file()
    largest = max(p.numel() * 4 for p in params.values())
    assert sharded["peak_held_bytes"] <= 20_000 + largest  # one shard (and one parameter) at a time
    for out in ("one", "many"):
        got = dict(iter_hf_tensors(tmp_path / out))
        assert set(got) == {hf_name(n) for n in params}
        assert all(torch.equal(got[hf_name(n)], v) for n, v in params.items())
    x = torch.randint(0, 64, (2, 24))
    want = reference(_hf_logits, str(tmp_path / "many"), x)
    got = _fivefold_logits(read_hf_config(tmp_path / "many"), dict(iter_hf_tensors(tmp_path / "many")), x)
    assert_values_close(got, want, LOGIT_TERMS, "logits")
    bf16 = export_checkpoint(tmp_path / "ckpt", tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert bf16["bytes"] * 2 == small["bytes"]


# ---------------------------------------------------------------------------------------------
# In: a model saved by transformers, loaded into ZeRO-3 dp 2 × tp 2.

def _load_worker(directory: str) -> dict:
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    cfg = Config()
    cfg.zero.stage, cfg.parallel.tp, cfg.train.seq_len = 3, 2, 16
    mesh = ParallelMesh(ParallelDims(dp=2, tp=2), "cpu", CommLog())
    parts = parallelize(cfg, read_hf_config(directory), mesh, "cpu")
    read = load_hf_weights(directory, parts.engines.values(), mesh.comm("tp"))
    placements = {}
    for e in parts.engines.values():
        placements.update(getattr(e.module, "tp_placements", {}))
    tp, out = mesh.comm("tp"), {}
    for name, value in parts.full_state_dict().items():
        dim = getattr(placements.get(name), "tp_dim", None)
        if dim is not None:
            pieces = [torch.empty_like(value) for _ in range(tp.size)]
            torch.distributed.all_gather(pieces, value.contiguous(), group=tp.group)
            value = torch.cat(pieces, dim=dim)
        out[name] = value
    return dict(params=out, read=read)


@pytest.mark.multiprocess
def test_a_transformers_model_loads_into_zero3_dp2_tp2_reading_only_each_ranks_share(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG)).eval()
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    results = run_workers(_load_worker, 4, str(tmp_path / "hf"))
    want = hf.state_dict()  # lm_head.weight is the embedding (tied), on both sides
    total = sum(v.numel() for k, v in want.items() if k != "lm_head.weight")
    for r in results:
        assert {hf_name(n) for n in r["params"]} == set(want)
        for name, value in r["params"].items():
            assert torch.equal(value, want[hf_name(name)]), name
        assert r["read"] < total / 2  # a ZeRO-3 shard of a TP slice: about a quarter, never the whole model
    x = torch.randint(0, 64, (2, 24))
    ref = reference(_hf_logits, str(tmp_path / "hf"), x)  # the saved model, read back: hf's own weights
    got = _fivefold_logits(read_hf_config(tmp_path / "hf"), dict(iter_hf_tensors(tmp_path / "hf")), x)
    assert_values_close(got, ref, LOGIT_TERMS, "logits")


def test_a_truncated_safetensors_file_is_named(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_CONFIG))
    hf.save_pretrained(tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors file"):
        list(iter_hf_tensors(tmp_path / "hf"))
    with pytest.raises(CheckpointError, match="not a Hugging Face model directory"):
        read_hf_config(tmp_path)


@pytest.mark.multiprocess
def test_train_init_from_a_hf_model_then_export_gives_its_weights_back(tmp_path):
    """`fivefold train --model.init_from DIR` (the shape from config.json, the weights read per rank), one step at
    a learning rate of 1e-30 (no fp32 weight moves) with a checkpoint, `fivefold export` of the run: the weights
    that come out are the ones that went in."""
    from fivefold.cli import main

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_CONFIG, "vocab_size": 256}))  # bytes
    hf.save_pretrained(tmp_path / "hf")
    args = ["train", "--init-from", str(tmp_path / "hf"), "--steps", "1", "--train.lr", "1e-30", "--nproc", "2",
            "--parallel.tp", "2", "--zero", "1", "--train.seq_len", "32", "--train.global_batch", "2",
            "--train.eval_every", "0", "--checkpoint.interval", "1", "--run.out_dir", str(tmp_path), "--run.name",
            "ft", "--run.progress", "false", "--run.plot", "false"]
    assert main(args) == 0
    assert main(["export", str(tmp_path / "ft"), "--to", str(tmp_path / "out")]) == 0
    got = dict(iter_hf_tensors(tmp_path / "out"))
    want = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    from fivefold.config import load_config
    from fivefold.train.validate import validate
    with pytest.raises(ValueError, match="takes the model's shape from"):  # the shape comes from the HF config
        validate(load_config(None, ["--model.init_from", str(tmp_path / "hf"), "--model.dim", "64"]), 2)


def test_init_from_is_strict_every_tensor_used_or_named(tmp_path):
    """A Qwen2-style checkpoint (q/k/v biases) whose config.json says llama is refused before anything starts, naming
    the first tensor the model has no place for; a stray extra tensor too; ``--init-from-allow-unused`` loads the
    rest on purpose and says what was left. A tied checkpoint that still stores its head loads (the head is the
    embedding)."""
    from safetensors.torch import load_file, save_file

    from fivefold.config import load_config
    from fivefold.train.validate import validate

    torch.manual_seed(0)
    biased = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_CONFIG, "vocab_size": 256,
                                                                       "attention_bias": True}))
    biased.save_pretrained(tmp_path / "qwen-as-llama")
    config_file = tmp_path / "qwen-as-llama" / "config.json"  # relabelled: a Qwen2 config.json says no biases
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "attention_bias": False}))
    args = ["--steps", "1", "--train.seq_len", "32", "--train.global_batch", "2", "--run.check_memory", "false"]
    cfg = load_config(None, ["--init-from", str(tmp_path / "qwen-as-llama"), *args])
    with pytest.raises(ValueError, match=r"holds 'model.layers.0.self_attn.[kqv]_proj.bias' \(and \d+ more\), which "
                                         r"this llama model has no place for.*--init-from-allow-unused"):
        validate(cfg, 1)
    plan = validate(load_config(None, ["--init-from", str(tmp_path / "qwen-as-llama"), "--init-from-allow-unused",
                                       *args]), 1)
    assert any("left unread (model.init_from_allow_unused)" in n for n in plan.notes)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_CONFIG, "vocab_size": 256}))
    plain.save_pretrained(tmp_path / "extra")
    tensors = load_file(tmp_path / "extra" / "model.safetensors")
    save_file({**tensors, "model.extra_adapter.weight": torch.zeros(2)}, tmp_path / "extra" / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="holds 'model.extra_adapter.weight', which this llama model has no place"):
        validate(load_config(None, ["--init-from", str(tmp_path / "extra"), *args]), 1)
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**HF_CONFIG, "vocab_size": 256,
                                                                     "tie_word_embeddings": True}))
    tied.save_pretrained(tmp_path / "tied")
    tensors = load_file(tmp_path / "tied" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # some tied checkpoints keep it
    save_file(tensors, tmp_path / "tied" / "model.safetensors", metadata={"format": "pt"})
    validate(load_config(None, ["--init-from", str(tmp_path / "tied"), *args]), 1)
