"""``train.compile``: torch.compile'd transformer blocks train like eager blocks in every layout.

One spawn (world 2, `multiprocess`) runs DDP (also 12 blocks), ZeRO-3 (± full recompute: the unit
gathered and the compiled block run again in backward), tp 2 (its collectives graph breaks), pp 2
(1F1B), cp 2 and MoE ep 2, eager and compiled (inductor's C++ backend on the CPU). Both are held to
the bound tests/tolerance.py derives from a single-process reference of the same training, and every
block's output must come from a compiled graph; a copied compiled block runs its own weights. What
cannot compile is refused before any process starts, naming the key (in-process tests)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from dist_utils import run_workers, trainer_reference
from tolerance import KERNELS, assert_values_close, reference

from fivefold.config import Config, ConfigError, load_config
from fivefold.distributed.comm import CommLog
from fivefold.run_plan import validate_layout

SEQ, ROWS, MICRO, STEPS = 32, 4, 2, 2
# Adam divides by |g| + eps: at eps 1e-8 an entry whose gradient is below a reordered sum's error (the attention
# query weights' at initialisation) flips its update, so the bound tests/tolerance.py derives (rule 2) would be as
# large as the step itself; at 1e-4 it stays ~1% of what the parameters move.
EPS = 1e-4
# rule 1's n: the longest sum whose order changes — inside a block, inductor's kernels may reorder any reduction, the
# longest being w2's inner dimension (ffn_hidden 384; tiny-moe's compiled attention half: dim 128); across layouts
# the global batch's 4 x 32 tokens summed into a weight gradient, tp 2's shards of the same 384-term sums
TERMS = 384
LAYOUTS = {  # name: (mesh dims, ZeRO stage, recompute, preset)
    "ddp": (dict(dp=2), 0, "none", "tiny"),
    # more blocks than dynamo's recompile limit (8): were a block's identity guarded, the later ones would fall back
    # to eager silently (every block's output is checked, and a hit limit raises: fail_on_recompile_limit_hit)
    "ddp-12-blocks": (dict(dp=2), 0, "none", "tiny-12"),
    "zero3": (dict(dp=2), 3, "none", "tiny"),
    "zero3-full-recompute": (dict(dp=2), 3, "full", "tiny"),
    "tp2": (dict(tp=2), 0, "none", "tiny"),
    "pp2": (dict(pp=2), 0, "none", "tiny"),
    "cp2": (dict(cp=2), 0, "none", "tiny"),  # ring attention: a graph break inside the attention
    "cp2-ulysses": (dict(cp=2, cp_ulysses=2), 0, "none", "tiny"),  # graph breaks at Ulysses' all-to-alls
    "moe-ep2": (dict(dp=2, ep=2), 0, "none", "tiny-moe"),  # the attention half compiled, the experts eager
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + step)
    return (torch.randint(0, 256, (ROWS, SEQ), generator=g), torch.randint(0, 256, (ROWS, SEQ), generator=g))


def _model_config(preset: str):
    from fivefold.models import get_config

    return get_config("tiny", n_layers=12) if preset == "tiny-12" else get_config(preset)


def _reference(preset: str, dp: int) -> dict:
    """Single-process training as every layout trains: the losses and the final parameters ("state")."""
    out = trainer_reference(_model_config(preset), _batch, STEPS, MICRO, dp, Config().train.lr, EPS)
    return dict(losses=out["losses"], state=out["final"])


def _trained_reference(name: str, kernels: str) -> tuple[dict, dict]:
    dims, _, _, preset = LAYOUTS[name]
    return reference(_reference, preset, dims.get("dp", 1), kernels=kernels, terms=TERMS)


def _compiled_in_graph(out: torch.Tensor, limit: int = 64) -> bool:
    """Whether the autograd graph behind a block's output reaches a compiled region's backward within `limit` nodes
    (ZeRO-3's and the tracer's identity markers may sit in between)."""
    todo, seen = [out.grad_fn], 0
    while todo and seen < limit:
        fn = todo.pop(0)
        if fn is None:
            continue
        if "CompiledFunction" in type(fn).__name__:
            return True
        seen += 1
        todo += [nxt for nxt, _ in fn.next_functions]
    return False


def _train(name: str, compiled: bool) -> dict:
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    dims, stage, recompute, preset = LAYOUTS[name]
    cfg = Config()
    cfg.zero.stage, cfg.train.recompute, cfg.train.compile = stage, recompute, compiled
    cfg.train.grad_accum, cfg.train.seq_len, cfg.train.warmup_steps, cfg.train.eps = MICRO, SEQ, 0, EPS
    cfg.parallel.cp, cfg.parallel.ep, cfg.pipeline.schedule = dims.get("cp", 1), dims.get("ep", 1), "1f1b"
    cfg.parallel.cp_mode = "ulysses" if dims.get("cp_ulysses", 1) > 1 else "ring"
    mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
    parts = parallelize(cfg, _model_config(preset), mesh, "cpu")
    seen: list[bool] = []
    for module in parts.modules():
        for block in module.layers:
            block.register_forward_hook(lambda m, args, out: seen.append(_compiled_in_graph(out)))
    dp = mesh.comm("dp")
    losses = []
    for step in range(STEPS):
        x, y = (t.chunk(dp.size)[dp.rank] for t in _batch(step))
        loss = parts.forward_backward(list(zip(x.chunk(MICRO), y.chunk(MICRO))))
        parts.step(1.0)
        losses.append(parts.global_loss(loss).item())
    return dict(losses=losses, state=parts.full_state_dict(), compiled_blocks=seen)


def _worker() -> dict:
    import torch._dynamo.config

    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):  # (torch >= 2.7)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
    return {name: {mode: _train(name, mode == "compiled") for mode in ("eager", "compiled")} for name in LAYOUTS}


@pytest.fixture(scope="module")
def results():
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler for inductor's CPU backend (validate refuses train.compile here)")
    return run_workers(_worker, 2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_blocks_train_like_eager_ones(results, name, kernels):
    """Compiled against eager, the same layout: within the bound of the reference's training (a tp rank's slice, a
    pp rank's stages: the bound of the whole tensor, one number per tensor)."""
    _, bounds = _trained_reference(name, kernels)
    for rank, res in enumerate(results):
        eager, compiled = res[name]["eager"], res[name]["compiled"]
        for step, (got, want) in enumerate(zip(compiled["losses"], eager["losses"], strict=True)):
            bounds["losses"][step].assert_holds(got, want, f"rank {rank} {name} loss {step}")
        assert compiled["state"].keys() == eager["state"].keys()
        for pname, want in eager["state"].items():
            bounds["state"][pname].assert_holds(compiled["state"][pname], want, f"rank {rank} {name} {pname}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", [n for n in LAYOUTS if LAYOUTS[n][3] == "tiny"])
def test_every_layout_trains_the_same_model(results, name, kernels):
    """The compiled layouts' losses equal the single-process model's (their eager layouts: the layouts' own tests)."""
    want, bounds = _trained_reference(name, kernels)
    for rank, res in enumerate(results):
        for step, got in enumerate(res[name]["compiled"]["losses"]):
            bounds["losses"][step].assert_holds(got, want["losses"][step], f"rank {rank} {name} loss {step}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_blocks_really_ran_compiled(results, name):
    for res in results:
        assert res[name]["compiled"]["compiled_blocks"] and all(res[name]["compiled"]["compiled_blocks"])
        assert res[name]["eager"]["compiled_blocks"] and not any(res[name]["eager"]["compiled_blocks"])


REFUSED = [
    (["--train.recompute", "selective"], "train.recompute=selective"),
    (["--train.recompute", "selective-op"], "train.recompute=selective-op"),
    (["--parallel.pp", "2", "--pipeline.schedule", "zb-h1", "--train.grad_accum", "2"], "pipeline.schedule=zb-h1"),
    (["--parallel.pp", "2", "--pipeline.schedule", "dualpipev", "--train.grad_accum", "4"],
     "pipeline.schedule=dualpipev"),
    (["--data.documents", "mask"], "data.documents=mask"),
]


@pytest.mark.parametrize("overrides, key", REFUSED)
def test_what_cannot_compile_is_refused_naming_the_key(overrides, key):
    cfg = load_config(None, ["--model.preset", "tiny", "--train.compile", "true", *overrides])
    for device in ("cpu", "cuda"):  # `fivefold plan` checks a layout for its target device
        with pytest.raises(ConfigError, match="train.compile=true") as err:
            validate_layout(cfg, 2, device)
        assert key in str(err.value) and "train.compile false" in str(err.value)
    cfg.train.compile = False
    validate_layout(cfg, 2, "cpu")  # the same layout without compile is fine


def test_no_cpp_compiler_is_refused_on_the_cpu_only(monkeypatch):
    import sys

    cfg = load_config(None, ["--model.preset", "tiny", "--train.compile", "true"])
    monkeypatch.setenv("CXX", sys.executable)  # some program on PATH: this machine need not have g++
    validate_layout(cfg, 2, "cpu")
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(ConfigError, match="no-such-c\\+\\+-compiler, which is not on PATH"):
        validate_layout(cfg, 2, "cpu")
    validate_layout(cfg, 2, "cuda")  # triton: a C compiler (CC), not CXX
    monkeypatch.setenv("CC", "no-such-c-compiler")
    with pytest.raises(ConfigError, match="triton builds its kernel launchers with a C compiler"):
        validate_layout(cfg, 2, "cuda")


@pytest.mark.multiprocess
def test_a_compiled_block_copy_runs_its_own_parameters():
    """`copy.deepcopy` of a compiled block keeps it compiled and computing with the copy's weights (the compiled
    function is the class's, given `self` at each call), and compiling without the eager regions is refused."""
    import copy

    from fivefold.distributed import comm
    from fivefold.models import get_config
    from fivefold.models.llama import Llama

    model = Llama(get_config("tiny", n_layers=1), seed=0)
    block = model.layers[0]
    saved = comm._EAGER_REGIONS_ON
    comm._EAGER_REGIONS_ON = False
    try:
        with pytest.raises(RuntimeError, match="compile_eager_regions"):
            block.compile_body()
    finally:
        comm._EAGER_REGIONS_ON = saved
    comm.compile_eager_regions()
    block.compile_body()
    twin = copy.deepcopy(block)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2.0)
    assert twin.compiled and twin._compiled_forward.__self__ is twin
    x = torch.randn(1, 8, 128)
    cos, sin = model.rope_cos, model.rope_sin
    assert_values_close(twin(x, cos, sin), twin._forward(x, cos, sin), TERMS, "block output")  # its longest sum: w2's
    assert not torch.allclose(twin(x, cos, sin), block(x, cos, sin))


@pytest.mark.multiprocess
def test_compile_off_keeps_torch_compiler_out_of_the_import_path():
    import subprocess
    import sys

    code = ("import sys, fivefold.train.trainer, fivefold.models.parallelize, fivefold.tensor_parallel, "
            "fivefold.context_parallel, fivefold.expert_parallel; print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
