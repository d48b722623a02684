"""`validate(config, world_size)`: every bad input named in the launching process, before any spawn.

~50 bad inputs each get a clear message saying what to change, and one line with exit 2 from
`fivefold train`; a good config is resolved once (grid, batch, model); 300 fuzzed configs give a
plan or a clear error (hypothesis). No process is started."""

from __future__ import annotations

import pytest

from fivefold.config import ConfigError, load_config
from fivefold.train.trainer import run
from fivefold.train.validate import validate

TINY = ["--preset", "tiny"]

# (overrides, world size, message the error must contain)

@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    """Validation looks at the run directory (runs/<name> by default): never the checkout's own runs/."""
    monkeypatch.chdir(tmp_path)

BAD = [
    (["--steps", "0"], 2, "train.steps=0 must be positive"),
    (["--steps", "-3"], 2, "train.steps=-3 must be positive"),
    (["--run.log_every", "0"], 2, "run.log_every=0 must be positive"),
    ([], 0, "world size=0 must be positive"),
    (["--train.eps", "0"], 2, "train.eps=0.0 must be positive"),
    (["--zero.inflight_buckets", "0"], 2, "zero.inflight_buckets=0 must be positive"),
    (["--zero.prefetch", "-1"], 2, "zero.prefetch=-1 must not be negative"),
    (["--data.val_fraction", "1.0"], 2, "data.val_fraction=1.0 must lie in [0, 1)"),
    (["--train.min_lr_ratio", "2"], 2, "train.min_lr_ratio=2.0 must lie in [0, 1]"),
    (["--zero", "5"], 2, "zero.stage=5: choose a ZeRO stage 0 (DDP), 1, 2 or 3"),
    (["--precision.param", "fp8"], 2, "precision.param: unknown dtype 'fp8'"),
    (["--preset", "huge"], 2, "unknown model preset 'huge'"),
    (TINY + ["--model.dim", "132", "--model.n_heads", "4"], 2, "head_dim=33 (dim=132 / n_heads=4) must be even"),
    (TINY + ["--parallel.tp", "2", "--model.n_kv_heads", "1"], 2, "n_kv_heads=1 is not divisible by tp=2"),
    (TINY + ["--parallel.tp", "2", "--parallel.sp", "true", "--train.seq_len", "63"], 2,
     "train.seq_len=63 is not divisible by tp=2"),
    (TINY + ["--parallel.pp", "8", "--train.grad_accum", "8"], 8, "n_layers=4 is fewer than the 8 pipeline stages"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "2", "--precision.param", "fp16"], 2,
     "fp16 with pipeline parallelism is not supported"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "2", "--model.tie_embeddings", "true"], 2,
     "tie_embeddings=True with pipeline parallelism"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "2", "--pipeline.layers_per_stage", "3,3"], 2,
     "layers_per_stage=[3, 3] must have 2 non-negative entries summing to n_layers=4"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "2", "--pipeline.p2p", "eager"], 2,
     "pipeline.p2p='eager': choose auto, buffered or rendezvous"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "2", "--pipeline.p2p", "buffered", "--run.device", "cuda"],
     2, "pipeline.p2p=buffered relies on gloo's per-message completion"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "2", "--pipeline.layers_per_stage", "a,b"], 2,
     "give comma-separated block counts"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "2", "--pipeline.schedule", "pipedream"], 2,
     "unknown pipeline schedule 'pipedream'"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "1"], 2, "M=1 < P=2"),
    (["--parallel.cp", "2", "--train.seq_len", "130"], 2,
     "context parallel (zigzag, cp=2) cuts the sequence into 4 equal chunks: seq_len=130 is not divisible by 4"),
    (["--parallel.cp", "2", "--parallel.cp_layout", "ring"], 2,
     "parallel.cp_layout='ring': choose zigzag or contiguous"),
    (TINY + ["--parallel.cp", "2", "--parallel.cp_layout", "contiguous", "--parallel.tp", "2",
             "--parallel.sp", "true", "--train.seq_len", "66"], 4, "train.seq_len=66 / cp=2 = 33 is not divisible"),
    (["--parallel.ep", "2"], 2, "parallel.ep=2 splits the experts of an MoE model, but the model is dense"),
    (["--preset", "tiny-moe", "--parallel.ep", "2", "--model.moe.experts", "3"], 2,
     "moe.experts=3 is not divisible by parallel.ep=2"),
    (["--model.moe.experts", "2", "--model.moe.top_k", "3"], 2, "moe.top_k=3 exceeds moe.experts=2"),
    (["--preset", "tiny-moe", "--parallel.tp", "2"], 2, "an MoE model with parallel.tp=2 is not supported"),
    (["--preset", "tiny-moe", "--parallel.ep", "2", "--model.moe.experts", "8", "--model.moe.groups", "1",
      "--model.moe.group_limit", "1"], 2, "moe.groups=1 is not a multiple of parallel.ep=2"),
    (["--model.moe.experts", "8", "--model.moe.groups", "3"], 2, "moe.groups=3 must divide moe.experts=8"),
    (["--preset", "tiny-moe", "--precision.param", "fp16"], 2, "fp16 with an MoE model is not supported"),
    (["--parallel.ep", "3"], 2, "parallel.ep=3 must divide dp(2) × cp(1) = 2"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "4", "--pipeline.overlap", "maybe"], 2,
     "pipeline.overlap='maybe': choose off or on"),
    (["--pipeline.overlap", "maybe"], 2, "pipeline.overlap='maybe': choose off or on"),
    (["--pipeline.overlap", "on"], 2, "it needs parallel.pp > 1 and pipeline.schedule dualpipev"),
    (TINY + ["--parallel.pp", "2", "--parallel.tp", "2", "--train.grad_accum", "4", "--pipeline.schedule",
             "dualpipev", "--pipeline.overlap", "on"], 4, "parallel.tp=2: both passes would call the tp group"),
    (TINY + ["--parallel.pp", "2", "--parallel.cp", "2", "--train.grad_accum", "4", "--pipeline.schedule",
             "dualpipev", "--pipeline.overlap", "on"], 4,
     "parallel.cp=2: both passes would exchange context-parallel messages"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "4", "--pipeline.overlap", "on"], 2,
     "schedule 1f1b has no overlapped units (dualpipev has)"),
    (TINY + ["--parallel.pp", "2", "--parallel.dp", "2", "--zero.stage", "3", "--train.grad_accum", "4",
             "--pipeline.schedule", "dualpipev", "--pipeline.overlap", "on"], 4,
     "zero.stage=3: both passes would gather and free the same units"),
    (TINY + ["--parallel.pp", "2", "--train.grad_accum", "4", "--pipeline.schedule", "dualpipev",
             "--pipeline.overlap", "on", "--run.device", "cuda"], 2, "CPU/gloo only"),
    (["--train.recompute", "some"], 2, "train.recompute='some': choose none, full, selective"),
    (["--train.recompute", "selective-op", "--train.recompute_save", "mm,attn"], 2,
     "train.recompute_save='mm,attn': unknown op 'attn'; choose matmuls-every-other or all-but-attention"),
    (["--model.attention", "flash"], 2, "model.attention='flash': choose sdpa or eager"),
    (["--model.attention", "eager", "--parallel.cp", "2"], 2,
     "under parallel.cp=2 (cp_mode ring) attention is ring attention"),
    (["--model.attention", "eager", "--parallel.cp", "4", "--parallel.cp_mode", "ulysses"], 4,
     "under parallel.cp=4 (cp_mode ulysses) attention is sdpa on whole sequences whatever the core"),
    (["--parallel.cp", "4", "--parallel.cp_ulysses", "2"], 4,
     "parallel.cp_ulysses=2 is the hybrid's Ulysses degree, but parallel.cp_mode=ring"),
    (["--parallel.cp", "4", "--parallel.cp_mode", "hybrid", "--train.seq_len", "130"], 4,
     "seq_len=130 is not divisible by 4"),
    (["--preset", "tiny-mistral", "--parallel.cp", "4", "--parallel.cp_mode", "hybrid", "--train.seq_len", "128"], 4,
     "(cp_mode hybrid): ring attention attends to the whole prefix"),
    (["--parallel.cp", "2", "--parallel.cp_mode", "hybrid"], 2,
     "parallel.cp_ulysses=2 with cp_mode hybrid and cp=2: the hybrid is Ulysses over cp_ulysses ranks"),
    (["--parallel.cp", "4", "--parallel.cp_mode", "hybrid", "--parallel.cp_ulysses", "3"], 4,
     "parallel.cp_ulysses=3 with cp_mode hybrid and cp=4"),
    (["--parallel.cp", "4", "--parallel.cp_mode", "ulysses", "--model.n_heads", "6", "--model.n_kv_heads", "6",
      "--model.dim", "384"], 4, "splits the query heads: 6 (per tp rank) is not divisible by 4"),
    (["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.cp_mode", "ulysses", "--model.n_heads", "12",
      "--model.n_kv_heads", "6", "--model.dim", "384"], 4,
     "3 kv heads (per tp rank) neither divide into 2 groups nor divide 2"),
    (["--preset", "tiny-mistral", "--parallel.cp", "2", "--train.seq_len", "256"], 2,
     "(cp_mode ring): ring attention attends to the whole prefix; use cp_mode ulysses"),
    (["--parallel.cp_mode", "spiral"], 2, "parallel.cp_mode='spiral': choose ring, ulysses or hybrid"),
    (["--preset", "tiny-moe", "--parallel.pp", "2", "--train.grad_accum", "4", "--pipeline.schedule", "dualpipev",
      "--pipeline.overlap", "on", "--train.recompute", "full"], 2,
     "train.recompute=full: the backward would run the MoE layers' forward collectives again"),
    (["--parallel.dp", "3"], 2, "dp(3) × cp(1) × tp(1) = 3 but the world size is 2"),
    (["--parallel.dp_replicate", "3", "--zero", "2"], 4, "parallel.dp_replicate=3 must divide dp(4)"),
    (["--parallel.dp_replicate", "0", "--zero", "2"], 4, "parallel.dp_replicate=0 is invalid: use a positive degree"),
    (["--parallel.dp_replicate", "2"], 4, "parallel.dp_replicate=2 with zero.stage=0: nothing is sharded"),
    (["--parallel.dp_replicate", "4", "--zero", "3"], 4, "leaves one rank per shard group"),
    (["--train.global_batch", "30", "--train.micro_batch", "4"], 2,
     "global_batch=30 is not divisible by micro_batch(4)"),
    (["--train.beta1", "1.5"], 2, "train.beta1=1.5 must lie in [0, 1)"),
    (["--train.beta2", "-0.1"], 2, "train.beta2=-0.1 must lie in [0, 1)"),
    (["--data.max_bytes", "200"], 2, "leaves 10 validation tokens"),
    (["--data.max_bytes", "100", "--data.val_fraction", "0", "--train.eval_every", "0"], 2,
     "holds 100 training tokens, too few for train.seq_len=128"),
    (["--data.val_fraction", "0"], 2, "raise data.val_fraction or set train.eval_every 0"),
    (["--data.max_bytes", "0"], 2, "data.max_bytes=0 must be positive"),
    (["--data.max_bytes", "-5"], 2, "data.max_bytes=-5 must be positive"),
    (["--train.lr", "inf"], 2, "train.lr=inf must be a finite number"),
    (["--train.lr", "nan"], 2, "train.lr=nan must be a finite number"),
    (["--train.grad_clip", "-inf"], 2, "train.grad_clip=-inf must be a finite number"),
    # Muon and FP8 (docs/design.md#muon-under-zero, docs/design.md#fp8-training)
    (["--optim.name", "muon", "--parallel.tp", "2"], 2, "optim.name=muon with parallel.tp=2: Muon orthogonalises"),
    (["--optim.name", "muon", "--zero", "3", "--zero.qwz", "true"], 2, "optim.name=muon gives each rank whole matrices"),
    (["--optim.name", "muon", "--optim.muon_ns_steps", "0"], 2, "optim.muon_ns_steps=0: Muon runs 1 to 99"),
    (["--precision.fp8", "tensorwise", "--precision.param", "fp16"], 2, "precision.fp8=tensorwise with precision.param=fp16"),
    (["--precision.fp8", "rowwise", "--zero", "3", "--zero.fp8_gather", "true"], 2,
     "zero.fp8_gather all-gathers each FP8 linear's weight cast once"),
    (["--precision.fp8", "tensorwise", "--zero", "2", "--zero.fp8_gather", "true"], 2,
     "zero.fp8_gather casts ZeRO-3's parameter all-gathers to FP8: set zero.stage 3"),
    (["--precision.fp8", "tensorwise", "--zero", "3", "--zero.fp8_gather", "true", "--zero.qwz", "true"], 2,
     "zero.fp8_gather replaces ZeRO-3's gather as qwZ's"),
    (["--precision.fp8", "tensorwise", "--zero", "3", "--zero.fp8_gather", "true", "--zero.qgz", "true"], 2,
     "zero.fp8_gather gives each FP8 weight one owner"),
    (["--precision.fp8", "tensorwise", "--zero", "3", "--zero.fp8_gather", "true", "--zero.constant_buffers", "true"], 2,
     "zero.fp8_gather with zero.constant_buffers"),
    (["--precision.fp8", "fp4"], 2, "precision.fp8"),
    # ZeRO++ (docs/design.md#zero-qwz-qgz-hpz)
    (["--zero", "2", "--zero.qwz", "true"], 2, "zero.qwz quantises ZeRO-3's parameter all-gathers: set zero.stage 3"),
    (["--zero", "1", "--zero.qgz", "true"], 2, "zero.qgz replaces the gradient reduce-scatter of ZeRO-2/3"),
    (["--zero", "3", "--zero.qwz", "true", "--zero.quant_block", "8"], 2, "zero.quant_block=8: use at least 16"),
    (["--zero", "3", "--zero.hpz", "-1"], 4, "zero.hpz=-1 must not be negative"),
    (["--zero", "2", "--zero.hpz", "2"], 4, "zero.hpz keeps a secondary copy for ZeRO-3's backward all-gathers"),
    (["--zero", "3", "--zero.hpz", "2", "--zero.reshard_after_forward", "false"], 4,
     "needs zero.stage 3 with zero.reshard_after_forward true"),
    (["--zero", "3", "--zero.hpz", "3"], 4, "zero.hpz=3 must divide the data-parallel group, dp × cp = 4"),
    (["--zero", "3", "--zero.qwz", "true", "--zero.constant_buffers", "true"], 2,
     "zero.constant_buffers with zero.qwz / zero.qgz: their int8 staging buffers are allocated per collective"),
    (["--zero", "3", "--zero.hpz", "4", "--parallel.dp", "8", "--parallel.dp_replicate", "2"], 8,
     "zero.hpz=4 must divide the data-parallel group, a shard group (dp × cp / dp_replicate) = 4"),
    (["--zero", "3", "--zero.qgz", "true", "--parallel.dp_replicate", "2", "--parallel.dp", "4"], 4,
     "zero.qgz with parallel.dp_replicate=2: HSDP's all-reduce across the replicas would follow qgZ's"),
    (["--zero", "3", "--zero.hpz", "4"], 4,
     "zero.hpz=4 must divide the data-parallel group, dp × cp = 4, and be smaller"),
    (["--preset", "tiny-moe", "--zero", "3", "--zero.hpz", "2"], 4, "zero.hpz with an MoE model is not supported"),
    # train.compile (tests/test_compile.py: what it composes with)
    (["--train.compile", "true", "--train.recompute", "selective"], 2,
     "train.compile=true: train.recompute=selective recomputes the attention core inside the block"),
    (["--train.compile", "true", "--parallel.pp", "2", "--pipeline.schedule", "zb-h1", "--train.grad_accum", "2"], 2,
     "pipeline.schedule=zb-h1 defers weight gradients (W) past the input gradients"),
]


@pytest.mark.parametrize("overrides, world, message", BAD, ids=[m.split(":")[0][:40] for _, _, m in BAD])
def test_bad_input_is_named_before_anything_starts(overrides, world, message):
    with pytest.raises(ValueError) as err:
        validate(load_config(None, overrides), world)
    assert message in str(err.value)


def test_bad_data_sources_and_run_directories(tmp_path):
    def error(*overrides: str) -> str:
        with pytest.raises((ValueError, FileNotFoundError)) as err:
            validate(load_config(None, ["--run.out_dir", str(tmp_path / "runs"), *overrides]), 2)
        return str(err.value)

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "binaries").mkdir()
    (tmp_path / "binaries" / "blob.png").write_bytes(b"\x89PNG\x00")
    (tmp_path / "afile").write_text("x")
    assert "corpus path not found" in error("--data", str(tmp_path / "missing.txt"))
    assert "is empty" in error("--data", str(tmp_path / "empty.txt"))
    assert "not a whole number of uint16 tokens" in error("--data", str(tmp_path / "odd.bin"))
    assert "contains no non-empty text files" in error("--data", str(tmp_path / "binaries"))
    assert "is a file" in error("--run.out_dir", str(tmp_path / "afile" / "runs"))
    (tmp_path / "small.txt").write_text("x" * 40)
    assert "holds 38 training tokens, too few for train.seq_len=128" in error("--data", str(tmp_path / "small.txt"))


def test_moved_keys_say_where_they_went():
    with pytest.raises(ConfigError, match=r"'ddp.prefetch' is now 'zero.prefetch'"):
        load_config(None, ["--ddp.prefetch", "2"])
    with pytest.raises(ConfigError, match=r"'parallel.zero' is now 'zero.stage'"):
        load_config(None, ["--parallel.zero", "2"])


def test_a_good_config_is_resolved_once():
    plan = validate(load_config(None, TINY + ["--parallel.tp", "2", "--train.global_batch", "16",
                                              "--train.micro_batch", "2", "--train.seq_len", "512"]), 4)
    assert (plan.dims.dp, plan.dims.tp) == (2, 2)
    assert (plan.global_batch, plan.micro_batch, plan.grad_accum) == (16, 2, 4)
    assert plan.model.max_seq_len == 512 and plan.model.dim == 128  # grown to the sequence length, and said so
    assert any("max_seq_len raised from 256 to train.seq_len=512" in n for n in plan.notes)
    assert plan.model.vocab_size == 256 and plan.data.tokenizer.name == "bytes"  # the default corpus


def test_run_validates_in_the_launching_process():
    """The launcher refuses before spawning: a worker would take seconds to start and fail."""
    with pytest.raises(ValueError, match="train.steps=0 must be positive"):
        run(load_config(None, ["--steps", "0", "--nproc", "2"]))


def test_moe_keys_lay_over_the_presets_moe_settings():
    def moe(*args: str, world: int = 2):
        return validate(load_config(None, list(args)), world).model.moe

    small = moe("--preset", "small-moe")
    assert (small.experts, small.top_k, small.every, small.capacity_factor) == (8, 2, 2, None)
    # a key the run sets replaces the preset's; the others stay (every=2 survives)
    got = moe("--preset", "small-moe", "--model.moe.capacity_factor", "1.0", "--model.moe.top_k", "1")
    assert (got.experts, got.top_k, got.every, got.capacity_factor) == (8, 1, 2, 1.0)
    got = moe("--preset", "small-moe", "--model.moe.groups", "2", "--model.moe.group_limit", "1",
              "--parallel.ep", "2")
    assert (got.groups, got.group_limit, got.every) == (2, 1, 2)
    assert moe("--preset", "small-moe", "--model.moe.experts", "0") is None  # made dense
    assert moe("--preset", "tiny", "--model.moe.experts", "4").experts == 4  # a dense preset made MoE
    assert moe("--preset", "tiny") is None
    with pytest.raises(ConfigError, match="moe.top_k is set but the model is dense"):
        moe("--preset", "tiny", "--model.moe.top_k", "1")
    with pytest.raises(ConfigError, match="moe.group_limit=3 must lie in"):
        moe("--preset", "tiny-moe", "--model.moe.groups", "2", "--model.moe.group_limit", "3")


def test_half_set_torchrun_variables_are_named_instead_of_waiting(monkeypatch, capsys):
    from fivefold.cli import main

    for k, v in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert main(["train", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "RANK=0, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=29500 set but not LOCAL_RANK" in err
    assert "env -u RANK -u WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT" in err


def test_mostly_binary_data_is_noted(tmp_path):
    import random
    noise = tmp_path / "noise.txt"
    noise.write_bytes(bytes(random.Random(0).randrange(256) for _ in range(4000)))
    plan = validate(load_config(None, ["--data", str(noise), "--train.seq_len", "64", "--train.eval_every", "0"]), 2)
    assert any("are not text" in n and "noise.txt" in n for n in plan.notes)
    text = tmp_path / "prose.txt"
    text.write_text("An ordinary sentence, with punctuation — and some UTF-8: café.\n" * 100)
    plan = validate(load_config(None, ["--data", str(text), "--train.seq_len", "64", "--train.eval_every", "0"]), 2)
    assert not any("are not text" in n for n in plan.notes)


@pytest.mark.parametrize("overrides, world, message", BAD, ids=[m.split(":")[0][:40] for _, _, m in BAD])
def test_every_bad_input_is_one_line_and_exit_2_from_the_command_line(overrides, world, message, capsys):
    """The same table through `fivefold train`: exit 2 in the launching process (no worker starts), one line. (A
    CUDA device is refused sooner there: local spawning runs CPU workers; under torchrun `validate` says the rest.)"""
    import time

    from fivefold.cli import main
    if "cuda" in overrides:
        message = "local spawning runs CPU workers; use torchrun for accelerators"
    t0 = time.perf_counter()
    assert main(["train", *overrides, "--nproc", str(world)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fivefold train: error: ") and message in err[0], err
    assert time.perf_counter() - t0 < 5.0


def test_config_fuzz_never_raises_anything_but_a_clear_error():
    """Random keys of the schema (and some that are not) with random values: `load_config` + `validate` give a
    valid plan or a ValueError (ConfigError) — never another exception."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    import dataclasses

    from fivefold.config import Config
    keys = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
            for f in dataclasses.fields(s.default_factory())] + ["train.nope", "nosection.x", "train", "zero"]
    values = st.one_of(st.integers(-5, 5000).map(str), st.floats(allow_nan=True, allow_infinity=True).map(str),
                       st.sampled_from(["", "true", "false", "none", "fp16", "bf16", "zigzag", "1,2", "-1", "latest",
                                        "auto", "cpu"]),
                       st.text(max_size=12))
    pairs = st.lists(st.tuples(st.sampled_from(keys), values), max_size=4)

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True, database=None)
    @hypothesis.given(pairs)
    def check(overrides):
        args = [a for k, v in overrides for a in (f"--{k}", v)] + ["--steps", "2"]
        try:
            validate(load_config(None, args), 2)
        except ValueError:
            pass

    check()


def test_the_gpu_profile_is_a_layer_of_defaults_that_validates_for_one_gpu(tmp_path, capsys):
    """`--profile gpu` (configs/gpu.toml): bf16 parameters, fp32 reduction, a log every 10 steps, defer_reduce,
    compiled blocks — under --config and the overrides, which win; the layout validates for a world of one on an
    accelerator and on this CPU, and `fivefold plan --profile gpu --gpus 1` plans it (in process, on meta)."""
    from fivefold.cli import main
    from fivefold.config import PROFILES_DIR, Config
    from fivefold.run_plan import validate_layout

    cfg = load_config(profile="gpu")
    assert (cfg.precision.param, cfg.precision.reduce, cfg.precision.tf32) == ("bf16", "fp32", True)
    assert (cfg.run.log_every, cfg.zero.defer_reduce, cfg.train.compile) == (10, True, True)
    assert cfg.model == Config().model and cfg.parallel == Config().parallel  # no model, layout or data
    layered = load_config(PROFILES_DIR / "llama-1b.toml", ["--run.log_every", "5"], profile="gpu")
    assert (layered.model.preset, layered.run.log_every, layered.train.compile) == ("llama3.2-1b", 5, True)
    assert load_config(profile=PROFILES_DIR / "gpu.toml") == cfg  # a path works too
    for device in ("cuda", "cpu"):
        plan = validate_layout(cfg, 1, device)
        assert (plan.dims.dp, plan.dims.tp, plan.dims.pp) == (1, 1, 1)
    with pytest.raises(ConfigError, match=r"--profile tpu: no .*tpu.toml; profiles: .*gpu"):
        load_config(profile="tpu")
    assert main(["plan", "--profile", "gpu", "--gpus", "1", "--json"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("{")


def test_fp8_on_cuda_wants_every_gemm_dimension_a_multiple_of_16():
    """torch._scaled_mm on CUDA: features per tp rank and the tokens of a rank's micro-batch; the CPU takes any."""
    from fivefold.run_plan import validate_layout

    cfg = load_config(None, ["--preset", "tiny", "--precision.fp8", "tensorwise", "--precision.param", "bf16",
                             "--train.micro_batch", "1", "--train.seq_len", "100", "--train.global_batch", "2"])
    validate_layout(cfg, 2, device_type="cpu")
    with pytest.raises(ConfigError, match=r"micro_batch × seq_len / cp \(tokens\) = 100 is not a multiple of 16"):
        validate_layout(cfg, 2, device_type="cuda")
    cfg.train.seq_len = 128
    validate_layout(cfg, 2, device_type="cuda")
