"""A run that cannot fit is refused before any worker starts, in one line naming the figures.

`fivefold.plan.fits.check_fits` names what would fit; absurd shapes are refused before anything is
built (`check_model_bounds`, `config_from_hf`); `param_counts` is arithmetic, checked against the
meta-device model. The prediction is `plan.memory.rank_memory`'s, part for part, without building a
module. No process is spawned; available memory is given (8 GiB), so nothing depends on this
machine."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from fivefold.checkpoint.hf import read_hf_config
from fivefold.checkpoint.manager import CheckpointError
from fivefold.config import ConfigError, load_config
from fivefold.models.llama import (
    MODEL_LIMITS,
    PRESETS,
    Llama,
    check_model_bounds,
    get_config,
    param_counts,
)
from fivefold.models.moe import MoEConfig
from fivefold.pipeline.builders import build_schedule
from fivefold.plan import fits
from fivefold.plan.fits import PROCESS_BASELINE, check_fits, predict_rank
from fivefold.plan.memory import in_flight, rank_memory
from fivefold.run_plan import validate_layout

GiB = 2**30
MACHINE = 8 * GiB  # the CI machine the checks are sized for: 2 cores, 8 GB

# Hugging Face config.json of published Llama shapes (the keys config_from_hf reads)
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16"}
LLAMA2_13B = {**LLAMA3_8B, "vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824,
              "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 40,
              "max_position_embeddings": 4096, "rope_theta": 10000.0}
LLAMA31_405B = {**LLAMA3_8B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
                "num_attention_heads": 128, "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _hf_dir(tmp_path, config: dict, name: str = "hf"):
    """A model directory holding only config.json (no weights: the check runs before any are read)."""
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def _plan(args: list[str], world: int = 2):
    cfg = load_config(None, args)
    return cfg, validate_layout(cfg, world, device_type="cpu")


def _timed(fn, *args, **kwargs):
    t = time.perf_counter()
    try:
        return fn(*args, **kwargs), time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - returned for the test to inspect
        return e, time.perf_counter() - t


# -- param_counts: arithmetic, equal to the meta model's count ------------------------------------------------------

def _meta_counts(config) -> tuple[int, int]:
    """The former `param_counts`: a meta `Llama`'s parameter shapes, each expert's counted top_k / experts — summed
    exactly (Fraction), where the float sum it used could round a whole count down by one."""
    total, active = 0, Fraction(0)
    for name, shape in Llama(config, device="meta").full_shapes().items():
        numel = math.prod(shape)
        total += numel
        if not name.startswith("tok_embeddings"):
            active += numel * (Fraction(config.moe.top_k, config.moe.experts) if ".experts." in name else 1)
    if config.tie_embeddings:
        active += config.vocab_size * config.dim
    assert active.denominator == 1  # every layer's E experts × top_k / E: whole
    return total, int(active)


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "deepseek-v3"])
def test_param_counts_equal_the_meta_model_for_every_preset(name):
    config = get_config(name)
    assert param_counts(config) == _meta_counts(config)


def test_param_counts_of_deepseek_v3_by_its_blocks():
    """61 blocks of 256 experts take seconds on meta: 4 and 5 blocks (3 dense, then MoE) are counted there, and the
    count is affine in the MoE blocks (every one alike), so 61 follows."""
    c4, c5 = (get_config("deepseek-v3", n_layers=n) for n in (4, 5))
    assert param_counts(c4) == _meta_counts(c4) and param_counts(c5) == _meta_counts(c5)
    per_block = [b - a for a, b in zip(param_counts(c4), param_counts(c5))]
    assert param_counts(get_config("deepseek-v3")) == tuple(a + 57 * d for a, d in zip(param_counts(c4),
                                                                                        per_block))
    assert param_counts(get_config("deepseek-v3"))[0] == 666_776_728_576  # the preset's 666.8B


@pytest.mark.parametrize("overrides", [
    dict(moe=MoEConfig(experts=8, top_k=2, every=2), n_layers=5),
    dict(moe=MoEConfig(experts=6, top_k=2)),  # not a power of two: the old float sum rounded these down by one
    dict(moe=MoEConfig(experts=60, top_k=4, shared_experts=4, hidden=96, every=3), n_layers=7),
    dict(moe=MoEConfig(experts=7, top_k=3, every=2, shared_experts=1), tie_embeddings=True, attention_head_dim=48),
    dict(moe=MoEConfig(experts=4, top_k=4, score="sigmoid", hidden=64), n_layers=3, n_kv_heads=4),
    dict(tie_embeddings=True, attention_head_dim=64, n_layers=3),
    dict(n_heads=8, n_kv_heads=1, dim=256, ffn_hidden=100),
])
def test_param_counts_equal_the_meta_model_for_moe_and_dense_variants(overrides):
    config = get_config("tiny", **overrides)
    assert param_counts(config) == _meta_counts(config)


def test_param_counts_of_huge_shapes_take_no_time():
    config = get_config("small", n_layers=10_000, dim=2**20 - 2**20 % 6, ffn_hidden=2**22)
    (counts, seconds) = _timed(param_counts, config)
    assert counts[0] > 10**16 and seconds < 0.1


# -- bounds: absurd shapes refused before anything is built ----------------------------------------------------------

def test_published_shapes_are_within_bounds(tmp_path):
    for name in PRESETS:  # Llama-3 8B / 70B / 405B, DeepSeek-V3's shape, ...
        check_model_bounds(get_config(name))
    for i, config in enumerate((LLAMA3_8B, LLAMA2_13B, LLAMA31_405B,
                                {**LLAMA3_8B, "max_position_embeddings": 4194304})):  # Gradient's 4M context
        cfg = load_config(None, ["--model.init_from", str(_hf_dir(tmp_path, config, f"m{i}"))])
        check_model_bounds(validate_layout(cfg, 2, device_type="cpu").model)


@pytest.mark.parametrize("field, value", [("n_layers", 100_000), ("dim", 2**21), ("ffn_hidden", 2**23),
                                          ("n_heads", 2**17)])
def test_absurd_sizes_are_refused_at_once(field, value):
    config = dataclasses.replace(get_config("tiny"), **{field: value})
    error, seconds = _timed(check_model_bounds, config)
    assert isinstance(error, ConfigError) and seconds < 1
    assert f"model.{field}={value:,} exceeds {MODEL_LIMITS[field][0]:,}" in str(error) and "\n" not in str(error)


def test_n_layers_100000_from_the_command_line_is_refused_within_a_second():
    cfg = load_config(None, ["--model.n_layers", "100000"])
    error, seconds = _timed(validate_layout, cfg, 2, device_type="cpu")  # (before any plan is priced)
    assert isinstance(error, ConfigError) and "model.n_layers=100,000 exceeds 10,000" in str(error)
    assert seconds < 1


def test_moe_and_total_bounds():
    with pytest.raises(ConfigError, match=r"model.moe.experts=100,000 exceeds 16,384"):
        check_model_bounds(get_config("tiny", moe=MoEConfig(experts=100_000, top_k=2)))
    with pytest.raises(ConfigError, match=r"parameters, more than"):  # each size allowed, together absurd
        check_model_bounds(get_config("tiny", n_layers=10_000, dim=2**20, ffn_hidden=2**22))


def test_absurd_config_json_is_refused_naming_the_file_and_key(tmp_path):
    d = _hf_dir(tmp_path, {**LLAMA3_8B, "hidden_size": 10**9})
    cfg = load_config(None, ["--model.init_from", str(d)])
    error, seconds = _timed(validate_layout, cfg, 2, device_type="cpu")
    assert isinstance(error, ConfigError) and seconds < 1
    assert str(d / "config.json") in str(error) and "hidden_size=1,000,000,000 exceeds" in str(error)


@pytest.mark.parametrize("change, message", [
    ({"vocab_size": "abc"}, "vocab_size='abc' is not an integer"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5 is not an integer"),
    ({"num_attention_heads": True}, "num_attention_heads=True is not an integer"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps='small' is not a finite number"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' is not true or false"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "x", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "rope_scaling.factor='x' is not a finite number"),
    ({"intermediate_size": None}, "no 'intermediate_size'"),
    ({"hidden_size": 0}, "dim=0 must be a positive integer"),
])
def test_config_json_values_of_the_wrong_type_name_key_and_file(tmp_path, change, message):
    d = _hf_dir(tmp_path, {**LLAMA3_8B, **change})
    with pytest.raises(CheckpointError) as e:
        read_hf_config(d)
    assert str(e.value).startswith(f"{d / 'config.json'}: ") and message in str(e.value)
    assert "\n" not in str(e.value) and "invalid literal" not in str(e.value)


def test_read_hf_config_names_the_file_in_every_error(tmp_path):
    for i, text in enumerate(("{not json", "[1, 2]", json.dumps({k: v for k, v in LLAMA3_8B.items()
                                                                 if k != "vocab_size"}))):
        d = tmp_path / f"d{i}"
        d.mkdir()
        (d / "config.json").write_text(text)
        with pytest.raises(CheckpointError, match=str(d / "config.json")):
            read_hf_config(d)
    with pytest.raises(CheckpointError, match="not a Hugging Face model directory"):
        read_hf_config(tmp_path)


# -- the prediction: rank_memory's, without building -----------------------------------------------------------------

LAYOUTS = [
    ([], 2),  # the default `make run` job
    (["--preset", "tiny", "--zero", "1"], 2),
    (["--preset", "tiny", "--zero", "2", "--train.grad_accum", "3", "--zero.inflight_buckets", "2"], 2),
    (["--preset", "tiny", "--zero", "3", "--zero.reshard_after_forward", "false"], 4),
    (["--preset", "small", "--precision.param", "bf16", "--zero", "1", "--zero.bucket_mb", "1"], 4),
    (["--preset", "small", "--precision.param", "bf16", "--precision.reduce", "fp32"], 2),
    (["--preset", "tiny-moe", "--parallel.ep", "2", "--zero", "3"], 4),
    (["--preset", "small-moe", "--parallel.ep", "2", "--zero", "2", "--model.moe.shared_experts", "1"], 2),
    (["--preset", "deepseek-v3", "--model.n_layers", "2", "--model.moe.first_dense", "0", "--parallel.ep", "2",
      "--zero", "1",
      "--train.micro_batch", "1", "--train.seq_len", "64"], 2),
    (["--preset", "tiny", "--parallel.tp", "2", "--parallel.sp", "true", "--zero", "3"], 4),
    (["--preset", "tiny-qwen3", "--parallel.tp", "2", "--model.attention_bias", "all", "--zero", "3"], 2),
    (["--preset", "tiny-mistral", "--train.seq_len", "128", "--zero", "1"], 2),  # + the window's mask
    (["--preset", "tiny-deepseek-v3", "--parallel.ep", "2", "--zero", "1", "--model.rotary_dim", "16"], 2),
    (["--preset", "tiny", "--parallel.cp", "2", "--zero", "2", "--model.tie_embeddings", "true"], 4),
    (["--preset", "tiny", "--parallel.cp", "2", "--zero", "1", "--data.documents", "mask"], 2),  # + whole RoPE
    (["--preset", "small", "--parallel.dp_replicate", "2", "--zero", "3", "--zero.hpz", "2"], 8),
    (["--preset", "small", "--zero", "2", "--zero.offload_optimizer", "true", "--train.recompute", "selective"], 2),
    (["--preset", "small", "--train.recompute", "full", "--model.attention", "eager"], 2),
    (["--preset", "small-moe", "--parallel.pp", "2", "--train.grad_accum", "4", "--pipeline.layers_per_stage", "2,4",
      "--zero", "2"], 4),
    (["--preset", "small", "--parallel.pp", "2", "--train.grad_accum", "40", "--pipeline.schedule", "zb-h1"], 2),
    (["--preset", "small", "--parallel.pp", "2", "--train.grad_accum", "4", "--pipeline.schedule", "interleaved",
      "--pipeline.virtual", "3"], 2),
    (["--preset", "small", "--parallel.pp", "2", "--train.grad_accum", "6", "--pipeline.schedule", "dualpipev",
      "--pipeline.virtual", "2", "--zero", "1"], 2),
]


@pytest.mark.parametrize("args, world", LAYOUTS)
def test_prediction_is_rank_memory_part_for_part(args, world):
    cfg, plan = _plan(args, world)
    for pp_rank in range(plan.dims.pp):
        assert dataclasses.asdict(predict_rank(cfg, plan, pp_rank)) == dataclasses.asdict(rank_memory(cfg, plan,
                                                                                                      pp_rank))


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("dualpipev", 2),
                                               ("gpipe", 1)])
def test_in_flight_beyond_the_simulated_micro_batches(schedule, virtual):
    """`_in_flight` simulates at most 8·P·V micro-batches (GPipe: all M by definition): the counts are those of the
    whole simulation."""
    pp = 2
    for m in (2 * pp, 8 * pp * virtual, 24 * pp * virtual + pp):
        for rank in range(pp):
            assert fits._in_flight(schedule, pp, m, virtual, rank) == in_flight(build_schedule(schedule, pp, m,
                                                                                               virtual), rank)


def test_prediction_of_huge_shapes_takes_no_time():
    for args in (["--preset", "llama3-405b"], ["--preset", "deepseek-v3"], ["--model.n_layers", "10000"],
                 ["--preset", "llama3-405b", "--parallel.pp", "2", "--train.grad_accum", "512", "--zero", "3"]):
        cfg, plan = _plan(args)
        fits._ENGINES.clear()
        _, seconds = _timed(predict_rank, cfg, plan)
        assert seconds < 2, (args, seconds)


# -- check_fits ------------------------------------------------------------------------------------------------------

def _refusal(cfg, plan, **kwargs) -> str:
    error, seconds = _timed(check_fits, cfg, plan, plan.dims.world_size, available=MACHINE, **kwargs)
    assert isinstance(error, ConfigError), error
    assert seconds < 5  # a guard, not a benchmark: milliseconds here
    message = str(error)
    assert "\n" not in message and message.startswith("memory: this run needs about ")
    assert "per rank" in message and "local ranks =" in message and "8.6 GB available" in message
    assert message.endswith("or --run.check_memory false to start it anyway")
    return message


def test_default_and_tiny_runs_fit_an_8_gb_machine():
    for args in ([], ["--preset", "tiny"], ["--preset", "tiny-moe"], ["--preset", "small", "--zero", "3"]):
        cfg, plan = _plan(args)
        assert check_fits(cfg, plan, 2, available=MACHINE) == []
    cfg, plan = _plan([])  # the default job: far below the machine, with each rank's process baseline
    assert fits._predict(cfg, plan, (0, 1), True, PROCESS_BASELINE).total < 1.5e9


def test_dim_1000000_is_refused_naming_the_figures():
    message = _refusal(*_plan(["--preset", "tiny", "--model.dim", "1000000"]))
    assert "the model does not fit on this machine" in message and "--model.preset" in message


def test_micro_batch_100000_is_refused_with_a_micro_batch_that_fits():
    message = _refusal(*_plan(["--train.micro_batch", "100000"]))
    # the first smaller micro-batch that fits, grad_accum raised to keep the global batch of 200,000
    assert "--train.micro_batch 125 --train.grad_accum 800 (the same global batch, 200000) would need" in message


def test_13b_shape_is_refused(tmp_path):
    message = _refusal(*_plan(["--model.init_from", str(_hf_dir(tmp_path, LLAMA2_13B))]))
    assert "model states 208.3 GB" in message and "does not fit on this machine" in message
    message = _refusal(*_plan(["--model.dim", "5120", "--model.n_layers", "40", "--model.n_heads", "40",
                               "--model.n_kv_heads", "40", "--model.ffn_hidden", "13824"]))
    assert "ZeRO-3 would need at least" in message


def test_8b_config_json_without_weights_is_refused(tmp_path):
    message = _refusal(*_plan(["--model.init_from", str(_hf_dir(tmp_path, LLAMA3_8B))]))
    assert "model states 128.5 GB" in message and "× 2 local ranks = 284.6 GB" in message


def test_long_rope_tables_count_their_start_up_build(tmp_path):
    """A narrow model with 2^23 positions: 2.1 GB of fp32 tables per rank, built in fp64 (6.4 GB more) at start-up."""
    config = {**LLAMA3_8B, "vocab_size": 256, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2**23}
    message = _refusal(*_plan(["--model.init_from", str(_hf_dir(tmp_path, config))]))
    assert "buffers 2.1 GB" in message and "at start-up the RoPE tables' fp64 build, 6.4 GB, is the peak" in message


def test_the_first_change_that_fits_is_named():
    message = _refusal(*_plan(["--preset", "medium", "--train.micro_batch", "64"]))
    assert "--train.micro_batch 16 --train.grad_accum 4 (the same global batch, 128) would need 6.2 GB" in message
    # 16 bytes per parameter on each of 8 ranks (2 GB each): ZeRO-3 shards them, no smaller micro-batch is left
    message = _refusal(*_plan(["--preset", "bench-120m", "--train.micro_batch", "1", "--train.seq_len", "64"], 8))
    assert "--zero 3 (parameters, gradients and optimizer state sharded over 8 ranks) would need" in message


def test_check_memory_false_skips_the_check():
    cfg, plan = _plan(["--train.micro_batch", "100000"])
    run = SimpleNamespace(**{**vars(cfg.run), "check_memory": False})
    notes = check_fits(dataclasses.replace(cfg, run=run), plan, 2, available=MACHINE)
    assert notes == ["memory check skipped (run.check_memory false)"]
    run = SimpleNamespace(**{k: v for k, v in vars(cfg.run).items() if k != "check_memory"})  # before the key
    with pytest.raises(ConfigError, match="memory: "):
        check_fits(dataclasses.replace(cfg, run=run), plan, 2, available=MACHINE)


def test_cpu_path_reads_host_memory_and_never_torch_cuda(monkeypatch):
    def no_cuda(*args, **kwargs):
        raise AssertionError("torch.cuda called on the CPU path")

    for name in ("mem_get_info", "is_available", "current_device", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(fits, "_mem_available", lambda: 8 * GiB)
    monkeypatch.setattr(fits, "_cgroup_room", lambda: 6 * GiB)  # a tighter cgroup wins
    cfg, plan = _plan([])
    assert check_fits(cfg, plan, 2) == []
    with pytest.raises(ConfigError, match=r"more than the 6.4 GB available \(host memory: the cgroup's limit"):
        check_fits(*_plan(["--train.micro_batch", "100000"]), 2)


def test_accelerator_compares_each_rank_with_its_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (8 * GiB, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cfg, plan = _plan(["--preset", "llama3-8b", "--train.micro_batch", "1"], 8)
    with pytest.raises(ConfigError, match=r"per rank \(model states 128.5 GB.*8.6 GB available \(free on cuda:0"):
        check_fits(cfg, plan, 1, "cuda", ranks=[3])
    cfg, plan = _plan(["--preset", "small"], 8)
    assert check_fits(cfg, plan, 1, "cuda", ranks=[3]) == []


def test_cgroup_room_v1_and_v2(tmp_path):
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory\n")
    (v2 / "job" / "memory.max").write_text(f"{4 * GiB}\n")
    (v2 / "job" / "memory.current").write_text(f"{3 * GiB}\n")
    (v2 / "job" / "memory.stat").write_text(f"anon 1\ninactive_file {GiB}\n")  # reclaimable page cache
    (v2 / "memory.max").write_text("max\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    assert fits._cgroup_room(proc, v2) == 2 * GiB
    v1 = tmp_path / "v1"
    (v1 / "memory" / "a" / "b").mkdir(parents=True)
    (v1 / "memory" / "a" / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")  # the parent's limit binds
    (v1 / "memory" / "a" / "memory.usage_in_bytes").write_text(f"{GiB // 2}\n")
    (v1 / "memory" / "a" / "b" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (v1 / "memory" / "a" / "b" / "memory.usage_in_bytes").write_text("1\n")
    proc.write_text("5:cpu:/\n4:memory:/a/b\n")
    assert fits._cgroup_room(proc, v1) == GiB + GiB // 2
    proc.write_text("4:memory:/\n")
    assert fits._cgroup_room(proc, v1) is None  # no limit anywhere
