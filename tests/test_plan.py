"""`fivefold plan` against measurement and against the seeds.

One spawn of 4 gloo ranks trains every layout of `plan_layouts.LAYOUTS` (ZeRO 0-3, fp32 and bf16, defer_reduce,
tp ± SP with full recompute, pp with GPipe / 1F1B / interleaved / ZB-H1, cp, HSDP, ZeRO++ hpZ + qwZ, MoE over ep 2
and 4 with selective recompute) for two steps. On every rank the plan laid out for that rank must give
- the model-state bytes `memory.model_state_bytes` measures after the second backward, byte for byte;
- the second step's traffic `CommLog` records, per mesh dimension and collective, byte for byte (expert
  all-to-alls depend on the routing: their mean over the ep group equals the plan);
- a transient peak (model states + buffers in flight) at or above the peak `memory.PeakSampler` sees over the
  engines during that step, and not loosely (at least 3/4 of it);
- activations within 15 % of what the forwards keep (`memory.block_activation_bytes`; pipelines: the most alive
  at once over a step, `memory.peak_activation_bytes`).
Then the seeds' numbers through the planner: the DESIGN.md model-state table at N = 64, Llama 3 405B's layouts of
seed 003 §13.1 fitting 80 GB (and not without recompute), the TP, SP, PP and CP volumes, the bubble formula.
"""

from __future__ import annotations

import json
import math

import plan_layouts
import pytest
from dist_utils import run_workers

from fivefold import formulas
from fivefold.cli import main as cli
from fivefold.config import load_config
from fivefold.plan import BACKWARD_ALLOCATED, plan_layout, rank_memory, rank_parts, rank_traffic
from fivefold.train.validate import validate_layout

GB = 1e9


@pytest.fixture(scope="module")
def measured():
    return run_workers(plan_layouts.worker, plan_layouts.WORLD)


def _planned(name: str, coords: dict) -> tuple:
    cfg = plan_layouts.config_of(name)
    run = validate_layout(cfg, plan_layouts.WORLD)
    parts = rank_parts(cfg, run, coords["pp"], coords)
    return rank_memory(cfg, run, coords["pp"], parts), rank_traffic(cfg, run, coords["pp"], parts)


@pytest.fixture(scope="module")
def planned(measured):
    return {name: [_planned(name, res[name]["coords"]) for res in measured] for name in plan_layouts.LAYOUTS}


def _traffic(measured_rank: dict) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for key, (_, nbytes) in measured_rank["traffic"].items():
        op, dim = key.split()
        out.setdefault(dim, {})[op] = nbytes
    return out


@pytest.mark.parametrize("name", list(plan_layouts.LAYOUTS))
def test_model_states_equal_the_measured_bytes(measured, planned, name):
    for rank, res in enumerate(measured):
        got = {k: sum(s[k] for s in res[name]["states"]) for k in ("params", "grads", "optimizer", "host")}
        want = {k: planned[name][rank][0].model_states[k] for k in got}
        assert got == want, f"rank {rank}"


@pytest.mark.parametrize("name", list(plan_layouts.LAYOUTS))
def test_traffic_per_dimension_equals_the_comm_log(measured, planned, name):
    ep_means: dict[str, list[int]] = {}
    for rank, res in enumerate(measured):
        got, want = _traffic(res[name]), planned[name][rank][1]
        assert set(got) == set(want), f"rank {rank}: dimensions {sorted(got)} vs planned {sorted(want)}"
        for dim in got:
            if dim == "ep":  # routed rows differ by rank; their sum over the group does not
                ep_means.setdefault(dim, []).append(got[dim].pop("all_to_all"))
                ep_means.setdefault("plan", []).append(want[dim]["all_to_all"])
                want = {**want, "ep": {k: v for k, v in want["ep"].items() if k != "all_to_all"}}
            assert got[dim] == want[dim], f"rank {rank} over {dim}"
    if ep_means:
        assert sum(ep_means["ep"]) == sum(ep_means["plan"])


@pytest.mark.parametrize("name", list(plan_layouts.LAYOUTS))
def test_transient_peak_bounds_the_measured_peak(measured, planned, name):
    for rank, res in enumerate(measured):
        memory = planned[name][rank][0]
        bound = memory.model_states["total"] + sum(memory.transient.values())
        peak = res[name]["peak"]
        assert peak <= bound, f"rank {rank}: measured {peak} > planned {bound} ({memory.transient})"
        assert peak >= 0.75 * bound, f"rank {rank}: the bound is loose: measured {peak}, planned {bound}"


@pytest.mark.parametrize("name", list(plan_layouts.LAYOUTS))
def test_activations_within_15_percent(measured, planned, name):
    for rank, res in enumerate(measured):
        memory = planned[name][rank][0]
        kept = sum(v for k, v in memory.activations.items() if k not in BACKWARD_ALLOCATED)
        got = res[name]["activations"]
        assert got == pytest.approx(kept, rel=0.15), f"rank {rank}: measured {got}, planned {memory.activations}"


# -- the seeds' numbers through the planner ------------------------------------------------------------------------

def _plan(world: int, *overrides: str, pp_ranks=None):
    return plan_layout(load_config(None, ["--precision.param", "bf16", "--precision.reduce", "bf16", *overrides]),
                       world, pp_ranks=pp_ranks)


@pytest.mark.parametrize("stage", range(4))
def test_model_states_follow_the_design_table_at_n64(stage):
    """DESIGN.md's 16Ψ / 4Ψ + 12Ψ/N / 2Ψ + 14Ψ/N / 16Ψ/N (bf16, K = 12) for Llama-3 8B at N = 64: the planner's
    bytes are the table's for Ψ = its padded flat buffers, plus AdamW's 4-byte step counters."""
    plan = _plan(64, "--preset", "llama3-8b", "--zero.stage", str(stage), "--train.micro_batch", "1")
    states = plan.ranks[0].model_states
    psi = plan.params
    table = formulas.zero_model_states(psi, stage, 64)
    # padding: at most N - 1 elements per flat buffer, counted by the plan, not by the table
    assert states["total"] == pytest.approx(table["total"], rel=2e-3)
    assert states["total"] >= table["total"] * (1 - 1e-9) - 12 * psi / 64  # never less than m, v and the master


def test_llama3_405b_layouts_of_seed_003_fit_in_80gb_with_full_recompute():
    """Seed 003 §13.1: TP 8 × PP 16 × DP 128 at 8K and TP 8 × CP 16 × PP 16 × DP 8 at 128K on 16,384 GPUs (ZeRO-1,
    SP, bf16, one sequence per micro-batch, 16 micro-batches); full recompute makes both fit, none does not."""
    common = ["--preset", "llama3-405b", "--parallel.tp", "8", "--parallel.sp", "true", "--parallel.pp", "16",
              "--zero.stage", "1", "--train.micro_batch", "1", "--train.grad_accum", "16"]
    short = _plan(16384, *common, "--train.seq_len", "8192", "--train.recompute", "full", pp_ranks=(0, -1))
    long = _plan(16384, *common, "--parallel.cp", "16", "--train.seq_len", "131072", "--train.recompute", "full",
                 pp_ranks=(0, -1))
    assert (short.dims.dp, long.dims.dp, long.dims.cp) == (128, 8, 16)
    for plan in (short, long):
        assert plan.fits, plan.peak_bytes / GB
        assert plan.peak_bytes < 80 * GB
    assert not _plan(16384, *common, "--train.seq_len", "8192", pp_ranks=(0,)).fits


def test_tp_and_sp_volumes_of_seed_003():
    """§7.5: a 7B-class model (D = 4096, 32 blocks), B·L = 2048 tokens: 4 all-reduces of B·L·D per block, 128 per
    step, "≈ 32 MB" each and "≈ 4 GB" per step — the seed's megabytes are of 4-byte elements (2048·4096·4); in
    bf16 half of it. §8.2: SP's all-gathers + reduce-scatters put the same bytes on the wire as the all-reduces
    (each all-reduce of S sends 2(T-1)/T·S on a ring, an all-gather or reduce-scatter (T-1)/T·S)."""
    common = ["--preset", "llama3-8b", "--parallel.tp", "8", "--train.micro_batch", "1", "--train.seq_len", "2048"]
    for precision, s in (("bf16", 2), ("fp32", 4)):
        tp = _plan(8, *common, "--precision.param", precision).traffic["tp"]
        sp = _plan(8, *common, "--precision.param", precision, "--parallel.sp", "true").traffic["tp"]
        bld = 2048 * 4096 * s
        assert tp["ops"]["all_reduce"] == pytest.approx(4 * 32 * bld, rel=0.02)  # + embedding, head and loss
        assert sp["ops"]["all_gather"] == sp["ops"]["reduce_scatter"] == pytest.approx(tp["ops"]["all_reduce"],
                                                                                       rel=1e-3)
        assert sp["wire_bytes"] == pytest.approx(tp["wire_bytes"], rel=1e-3)
    assert 4.0e9 < tp["ops"]["all_reduce"] < 4.5e9  # fp32: the seed's ≈ 4 GB


def test_pipeline_and_context_volumes_and_bubble_of_seed_003():
    """§9.6: a stage boundary carries one micro-batch's B/M·L·D per message; §10.1: ring attention sends
    2·L·D/C per K/V shard C-1 times per layer forward; §9.3: the bubble (P-1)/(M+P-1) when the stages cost alike."""
    model = ["--preset", "tiny", "--model.n_layers", "8", "--model.dim", "256", "--model.n_heads", "8",
             "--model.n_kv_heads", "8", "--model.ffn_hidden", "512"]
    P, M, L = 4, 8, 256
    plan = _plan(P, *model, "--parallel.pp", str(P), "--train.grad_accum", str(M), "--train.micro_batch", "1",
                 "--train.seq_len", str(L))
    sends = plan.traffic["pp"]["ops"]["send"]
    assert sends == M * L * 256 * 2 * 2  # rank with the most: an activation forward, a gradient back per micro-batch
    assert plan.bubble == pytest.approx(formulas.bubble_formula("1f1b", P, M), abs=0.03)
    C = 4
    ring = _plan(C, *model, "--parallel.cp", str(C), "--train.micro_batch", "1", "--train.seq_len", str(L),
                 "--zero.stage", "0").traffic["cp"]["ops"]["send"]
    forward_per_layer = 2 * (L // C) * 256 * 2 * (C - 1)
    assert ring == 8 * (forward_per_layer * 2 + 2 * (L // C) * 256 * 2 * C)  # + backward: K/V again, dK/dV home


def test_a_layout_that_does_not_divide_is_named():
    with pytest.raises(ValueError, match="n_kv_heads=8 is not divisible by tp=16"):
        _plan(16, "--preset", "llama3-8b", "--parallel.tp", "16", "--parallel.pp", "1")
    with pytest.raises(ValueError, match="world size 12 is not divisible by pp"):
        _plan(12, "--preset", "llama3-8b", "--parallel.tp", "8")


def test_cli_table_json_and_search(capsys):
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "16", "--tp", "8", "--sp", "--zero", "1",
                "--micro-batch", "1", "--seq", "4096", "--global-batch", "16"]) == 0
    text = capsys.readouterr().out
    assert "model states: optimizer" in text and "fits" in text and "MFU" in text and "tp " in text
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "16", "--tp", "8", "--zero", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dims"]["tp"] == 8 and data["fits"] in (True, False) and data["traffic"]["tp"]["group"] == 8
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "16", "--tp", "3"]) == 2
    assert "tp" in capsys.readouterr().err
    assert cli(["plan", "--model", "small", "--gpus", "4", "--search", "--top", "3", "--seq", "256",
                "--micro-batch", "4", "--global-batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "valid layouts for 4" in out and out.count("ZeRO-") == 3


def test_seed_model_states_figures():
    """The seed's 7.5B at N = 64, 1T at N = 1024 and 7B figures (formulas.zero_model_states, the planner's base)."""
    gb = 1e9
    assert [round(formulas.zero_model_states(7.5e9, s, 64)["total"] / gb, 1) for s in range(4)] == \
        [120.0, 31.4, 16.6, 1.9]
    assert math.isclose(round(formulas.zero_model_states(1e12, 3, 1024)["total"] / gb, 1), 15.6)
