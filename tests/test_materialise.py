"""Each rank materialises only its share of the model (docs/design.md#mechanisms).

`parallelize` builds on the meta device and the ZeRO engine fills this rank's TP slice / pipeline
stages / ZeRO shard from the seeded initial values. One spawn of two gloo ranks (every test
`multiprocess`) checks per layout: every parameter equals the seeded single-process init
(`Llama(config, seed)`) bit for bit — the fp32 master from the fp32 value, never the 16-bit copy —;
the resident high-water mark while `parallelize` runs (Linux VmHWM) rises by at most what the engine
holds plus one ZeRO-3 unit and two copies of the largest parameter, while a plain fp32 `Llama` build
(the control) shows at least its 4Ψ bytes; ZeRO-3 draws only the values overlapping its dp shard;
`broadcast_module_state` in small messages makes every rank equal rank 0."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch
from dist_utils import run_workers
from torch import nn

pytestmark = pytest.mark.multiprocess  # every test here starts processes

CONFIG = dict(vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536, max_seq_len=64)
SEED = 7
MiB = 2**20
LAYOUTS = {  # name: (mesh dims, config overrides)
    "dp2-zero3-fp32": (dict(dp=2), dict(zero=3, param="fp32")),
    "dp2-zero3-bf16": (dict(dp=2), dict(zero=3, param="bf16")),
    "dp2-zero1-bf16": (dict(dp=2), dict(zero=1, param="bf16")),
    "tp2-zero0": (dict(dp=1, tp=2), dict(zero=0, tp=2, param="fp32")),
    "tp2-sp-zero1-bf16": (dict(dp=1, tp=2), dict(zero=1, tp=2, sp=True, param="bf16")),
    "pp2-zero3": (dict(pp=2, dp=1), dict(zero=3, pp=2, param="bf16")),
}


def _memory_kib() -> dict[str, int]:
    status = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", status).group(1)) for k in ("VmRSS", "VmHWM")}


def _peak_while(build, *args):
    """(build(*args), bytes the resident high-water mark rose above the resident size at the start)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _memory_kib()["VmRSS"]
    result = build(*args)
    return result, (_memory_kib()["VmHWM"] - before) * 1024


def _worker():
    import torch.distributed as dist

    from fivefold.config import Config
    from fivefold.data_parallel import broadcast_module_state
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.llama import Llama
    from fivefold.models.parallelize import parallelize
    from fivefold.tensor_parallel.plan import ParamPlacement

    model_cfg = get_config("tiny", **CONFIG)
    rank = dist.get_rank()
    out: dict = {"layouts": {}}

    _, out["control_peak"] = _peak_while(Llama, model_cfg, SEED)
    reference = Llama(model_cfg, seed=SEED).state_dict()
    out["psi"] = sum(v.numel() for v in reference.values())
    largest = max(v.numel() * 4 for v in reference.values())

    drawn: list[str] = []  # the initial values each layout draws
    initial_value = Llama.initial_value

    def counting(self, pname, seed, *device):
        drawn.append(pname)
        return initial_value(self, pname, seed, *device)

    Llama.initial_value = counting
    for name, (dims, o) in LAYOUTS.items():
        cfg = Config()
        cfg.train.seed, cfg.train.seq_len, cfg.train.grad_accum = SEED, 64, 2
        cfg.zero.stage, cfg.precision.param = o["zero"], o["param"]
        cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.sp = o.get("tp", 1), o.get("pp", 1), o.get("sp", False)
        mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
        drawn.clear()
        parts, peak = _peak_while(parallelize, cfg, model_cfg, mesh, "cpu")
        held = parts.model_state_bytes()
        unit = max((f.full.numel() * f.full.element_size() for e in parts.engines.values() for f in e.flats
                    if f.reshard_enabled), default=0)
        mismatched, compared = [], 0
        tp = mesh.comm("tp")
        for engine in parts.engines.values():
            module = engine.module
            placements = getattr(module, "tp_placements", {})
            master = engine.full_state_dict()
            compute = dict(module.named_parameters()) if o["zero"] < 3 else {}
            for pname, got in master.items():
                part = placements.get(pname, ParamPlacement()).local_part(reference[pname], tp)
                compared += 1
                if not torch.equal(got, part):
                    mismatched.append(f"master {pname}")
                if pname in compute and not torch.equal(compute[pname].detach(), part.to(compute[pname].dtype)):
                    mismatched.append(f"compute {pname}")
        out["layouts"][name] = dict(peak=peak, held=held, unit=unit, largest=largest, mismatched=mismatched,
                                    compared=compared, rope_ok=_rope_equal(parts, model_cfg), drawn=len(drawn))
        del parts
        gc.collect()

    # The broadcast moves rank 0's values in messages of at most 4 KiB: several tensors per message, big ones alone.
    module = nn.Sequential(nn.Linear(40, 30), nn.LayerNorm(30), nn.Linear(30, 5))
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(torch.full_like(p, float(10 * rank + i)))
    from fivefold.distributed.comm import Comm
    broadcast_module_state(module, Comm(None, "dp", CommLog()), message_bytes=4096)
    out["broadcast"] = [p.detach().clone() for p in module.parameters()]
    return out


def _rope_equal(parts, model_cfg) -> bool:
    from fivefold.models.llama import precompute_rope
    cos, sin = precompute_rope(model_cfg.head_dim, model_cfg.max_seq_len, model_cfg.rope_theta)
    return all(torch.equal(e.module.rope_cos, cos) and torch.equal(e.module.rope_sin, sin)
               for e in parts.engines.values())


@pytest.fixture(scope="module")
def results(monkeypatch_module):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the resident high-water mark")
    # Freed blocks go back to the OS at once (no dynamic mmap threshold), so the high-water mark is the real peak.
    monkeypatch_module.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    return run_workers(_worker, 2)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_starts_from_the_single_process_init(results, layout):
    for rank, res in enumerate(results):
        r = res["layouts"][layout]
        assert r["compared"] > 0
        assert r["mismatched"] == [], f"rank {rank}: {r['mismatched'][:5]}"
        assert r["rope_ok"], f"rank {rank}: RoPE tables"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_start_up_peak_is_the_ranks_share(results, layout):
    for rank, res in enumerate(results):
        r = res["layouts"][layout]
        full_fp32 = 4 * res["psi"]
        # The instrument sees allocations: building the whole fp32 model shows at least its 4Ψ bytes.
        assert res["control_peak"] >= 0.95 * full_fp32, res["control_peak"] / MiB
        allowance = r["unit"] + 2 * r["largest"] + 8 * MiB  # one unit gathered, one value drawn + its slice; noise
        print(f"{layout} rank {rank}: start-up peak {r['peak'] / MiB:.1f} MiB, held {r['held'] / MiB:.1f} MiB, "
              f"fp32 model {full_fp32 / MiB:.1f} MiB, whole-model build {res['control_peak'] / MiB:.1f} MiB")
        assert r["peak"] <= r["held"] + allowance, (
            f"rank {rank}: start-up peak {r['peak'] / MiB:.1f} MiB > held {r['held'] / MiB:.1f} MiB + "
            f"{allowance / MiB:.1f} MiB (the whole fp32 model is {full_fp32 / MiB:.1f} MiB)")
        assert allowance < 0.5 * full_fp32, "the model is too small for the bound to tell a whole-model copy apart"


def test_zero3_draws_only_the_values_overlapping_its_shard(results):
    for res in results:
        n_params = res["layouts"]["dp2-zero1-bf16"]["drawn"]  # ZeRO 0-2 keep the whole compute copy: all drawn
        assert n_params == res["layouts"]["tp2-zero0"]["drawn"] > 0
        for layout in ("dp2-zero3-fp32", "dp2-zero3-bf16"):
            assert res["layouts"][layout]["drawn"] < 0.75 * n_params, layout


def test_broadcast_in_small_messages_makes_every_rank_equal_rank_0(results):
    for res in results:
        for i, p in enumerate(res["broadcast"]):
            assert torch.equal(p, torch.full_like(p, float(i)))

