"""`fivefold plan` against measurement and against the published figures of docs/design.md.

One spawn of 4 gloo ranks (`multiprocess`) trains every layout of `plan_layouts.LAYOUTS` (ZeRO 0-3,
tp ± SP, pp schedules, cp, HSDP, ZeRO++, MoE over ep 2 and 4) for two steps. Per rank the plan must
give the model-state bytes and the second step's traffic per dimension and collective byte for byte
(expert all-to-alls: their mean over the ep group), a transient peak at or above `PeakSampler`'s and
at least 60 % of it, activations within 15 % (docs/plan.md#checked-against-measurement). In-process:
docs/design.md#model-state-memory's table at N = 64, Llama 3 405B's docs/design.md#reference-figures
fitting 80 GB only with recompute, the TP, SP, PP and CP volumes and bubble, the CLI and search."""

from __future__ import annotations

import dataclasses
import json

import plan_layouts
import pytest
from dist_utils import run_workers

from fivefold import formulas
from fivefold.cli import main as cli
from fivefold.config import load_config
from fivefold.plan import (
    BACKWARD_ALLOCATED,
    HARDWARE,
    Hardware,
    plan_layout,
    rank_memory,
    rank_parts,
    rank_traffic,
)
from fivefold.run_plan import validate_layout

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


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(plan_layouts.LAYOUTS))
def test_model_states_equal_the_measured_bytes(measured, planned, name):
    for rank, res in enumerate(measured):
        got = {k: sum(s[k] for s in res[name]["states"]) for k in ("params", "grads", "optimizer", "host")}
        want = {k: planned[name][rank][0].model_states[k] for k in got}
        assert got == want, f"rank {rank}"


@pytest.mark.multiprocess
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


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(plan_layouts.LAYOUTS))
def test_transient_peak_bounds_the_measured_peak(measured, planned, name):
    for rank, res in enumerate(measured):
        memory = planned[name][rank][0]
        bound = memory.model_states["total"] + sum(memory.transient.values())
        peak = res[name]["peak"]
        assert peak <= bound, f"rank {rank}: measured {peak} > planned {bound} ({memory.transient})"
        # not loose: 0.76-1.00 measured over the 21 layouts; the gathers' and frees' timing moves it
        assert peak >= 0.6 * bound, f"rank {rank}: the bound is loose: measured {peak}, planned {bound}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", plan_layouts.WHOLE)
def test_the_whole_peak_is_the_planned_total(measured, planned, name):
    """Every storage alive during a step (`PeakSampler(allocations=True)`: the engines' and whatever an operator
    allocated, autograd's saved tensors included) at its most, against the plan's total on the GPU — a sum of each
    part's own peak, so an upper estimate — but what is alive at once moves with when gloo's threads finish their
    collectives: four runs of tp 2 + SP + ZeRO-3 + full recompute measured 0.81-1.01 of the plan, all eight layouts
    0.75-1.01; four more of that layout alone 0.85-0.98 (2026-12-05), but one full-suite run on 2 cores 1.054 on one
    rank (74 KB over: about one more gathered unit alive than the plan's transient — a ZeRO-3 in-flight window the
    plan does not bound yet, docs/plan.md). Held: at most 10 % above it, at least 60 % of it."""
    for rank, res in enumerate(measured):
        total = planned[name][rank][0].total
        got = res[name]["whole"]
        assert 0.6 * total <= got <= 1.10 * total, f"rank {rank}: measured {got}, planned {total}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(plan_layouts.LAYOUTS))
def test_activations_within_15_percent(measured, planned, name):
    for rank, res in enumerate(measured):
        memory = planned[name][rank][0]
        kept = sum(v for k, v in memory.activations.items() if k not in BACKWARD_ALLOCATED)
        got = res[name]["activations"]
        assert got == pytest.approx(kept, rel=0.15), f"rank {rank}: measured {got}, planned {memory.activations}"


# -- the seeds' numbers through the planner ------------------------------------------------------------------------

def _plan(world: int, *overrides: str, pp_ranks=None, hardware: Hardware = HARDWARE["h100"]):
    return plan_layout(load_config(None, ["--precision.param", "bf16", "--precision.reduce", "bf16", *overrides]),
                       world, hardware, pp_ranks=pp_ranks)


@pytest.mark.parametrize("stage", range(4))
def test_model_states_follow_the_design_table_at_n64(stage):
    """16Ψ / 4Ψ + 12Ψ/N / 2Ψ + 14Ψ/N / 16Ψ/N (docs/design.md#model-state-memory; bf16, K = 12) for Llama-3 8B at
    N = 64: the planner's bytes are the table's for Ψ = its padded flat buffers, plus AdamW's 4-byte step counters."""
    plan = _plan(64, "--preset", "llama3-8b", "--zero.stage", str(stage), "--train.micro_batch", "1")
    states = plan.ranks[0].model_states
    psi = plan.params
    table = formulas.zero_model_states(psi, stage, 64)
    # padding: at most N - 1 elements per flat buffer, counted by the plan, not by the table
    assert states["total"] == pytest.approx(table["total"], rel=2e-3)
    assert states["total"] >= table["total"] * (1 - 1e-9) - 12 * psi / 64  # never less than m, v and the master


def test_llama3_405b_layouts_of_seed_003_fit_in_80gb_with_full_recompute():
    """docs/design.md#reference-figures: TP 8 × PP 16 × DP 128 at 8K and TP 8 × CP 16 × PP 16 × DP 8 at 128K on 16,384
    GPUs (ZeRO-1, SP, bf16, one sequence per micro-batch, 16 micro-batches); full recompute makes both fit, none does
    not."""
    common = ["--preset", "llama3-405b", "--parallel.tp", "8", "--parallel.sp", "true", "--parallel.pp", "16",
              "--zero.stage", "1", "--train.micro_batch", "1", "--train.grad_accum", "16"]
    short = _plan(16384, *common, "--train.seq_len", "8192", "--train.recompute", "full", pp_ranks=(0, -1))
    long = _plan(16384, *common, "--parallel.cp", "16", "--train.seq_len", "131072", "--train.recompute", "full",
                 pp_ranks=(0, -1))
    assert (short.dims.dp, long.dims.dp, long.dims.cp) == (128, 8, 16)
    for plan in (short, long):
        assert plan.fits, plan.peak_bytes / GB
    without = _plan(16384, *common, "--train.seq_len", "8192", pp_ranks=(0,))
    assert not without.fits and without.peak_bytes > 2 * short.peak_bytes


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
    instant = dataclasses.replace(HARDWARE["h100"], intra_node_gbps=1e9, inter_node_gbps=1e9)  # messages cost 0
    plan = _plan(P, *model, "--parallel.pp", str(P), "--train.grad_accum", str(M), "--train.micro_batch", "1",
                 "--train.seq_len", str(L), hardware=instant)
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
    assert "model states: optimizer" in text and "-> fits" in text and "MFU" in text
    assert "layout: tp 8+SP, pp 1, cp 1, dp 2, ZeRO-1" in text
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "16", "--tp", "8", "--zero", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dims"]["tp"] == 8 and data["traffic"]["tp"]["group"] == 8 and data["seq_len"] == 8192
    assert data["fits"] == (data["peak_bytes"] <= 80e9) and data["micro_batch"] == 1  # the planning defaults
    assert cli(["plan", "--model", "llama3-8b", "--gpus", "12", "--tp", "3"]) == 2
    assert "ffn_hidden=14336 is not divisible by tp=3; choose tp dividing" in capsys.readouterr().err


def test_cli_refuses_what_cannot_describe_a_machine(capsys):
    for flags, words in ((["--efficiency", "2"], "in (0, 1]"), (["--efficiency", "0"], "efficiency 0.0"),
                         (["--attention-efficiency", "1.5"], "attention_efficiency=1.5: a fraction"),
                         (["--allocator-reserve", "-0.1"], "allocator_reserve=-0.1"),
                         (["--intra-gbps", "-5"], "intra_node_gbps=-5.0"), (["--gpu-mem", "-1"], "memory_gb=-1.0"),
                         (["--gpus-per-node", "0"], "gpus_per_node=0"), (["--search", "--top", "0"], "top=0")):
        assert cli(["plan", "--model", "small", "--gpus", "2", *flags]) == 2, flags
        assert words in capsys.readouterr().err, flags


def test_the_issue_command_runs_with_planning_defaults(capsys):
    """The issue's own command: train's CPU-demo batch (8 × 128, one micro-batch) would stop a pp 4 pipeline;
    plan's defaults (one sequence of the model's context per micro-batch, 4 × pp micro-batches) and says so."""
    assert cli(["plan", "--model", "llama3-70b", "--gpus", "512", "--gpu-mem", "80", "--parallel.tp", "8",
                "--parallel.pp", "4", "--zero", "1", "--micro-batch", "1", "--seq", "8192"]) == 0
    text = capsys.readouterr().out
    assert "micro 1 × accum 16 × dp 16" in text and "--grad-accum / --global-batch not given" in text


def test_search_ranks_fitting_layouts_and_keeps_given_dimensions(capsys):
    common = ["plan", "--model", "small", "--gpus", "4", "--search", "--top", "3", "--seq", "256", "--micro-batch",
              "4", "--global-batch", "16"]
    assert cli(common) == 0
    out = capsys.readouterr().out
    assert "valid layouts for 4" in out and out.count("ZeRO-") == 3
    assert cli([*common, "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    steps = [p["time"]["step"] for p in plans]
    assert len(plans) == 3 and steps == sorted(steps) and all(p["fits"] for p in plans)
    assert cli([*common, "--tp", "2"]) == 0  # tp given: only tp 2 layouts
    rows = [line for line in capsys.readouterr().out.splitlines() if "ZeRO-" in line]
    assert rows and all("tp 2+SP" in r for r in rows)
    assert cli(["plan", "--model", "small-moe", "--gpus", "4", "--search", "--seq", "128", "--micro-batch", "2",
                "--global-batch", "8", "--top", "50"]) == 0
    assert "ep 4" in capsys.readouterr().out  # MoE: expert parallel degrees are searched too


def test_copy_kept_is_keep_only_of_a_copy():
    """The stage cut without copying the removed modules: the same names and shapes as keep_only(deepcopy), the
    original untouched, and the same refusal for a ModuleList."""
    import copy

    from torch import nn

    from fivefold.models.llama import Llama, get_config
    from fivefold.models.plans import llama_stage_modules
    from fivefold.pipeline.split import copy_kept, keep_only

    model = Llama(get_config("tiny"), device="meta")
    before = {n: p.shape for n, p in model.named_parameters()}
    for names in llama_stage_modules(model.config, 3):
        want = keep_only(copy.deepcopy(model), names)
        got = copy_kept(model, names)
        assert {n: p.shape for n, p in got.named_parameters()} == {n: p.shape for n, p in want.named_parameters()}
        assert [n for n, _ in got.named_modules()] == [n for n, _ in want.named_modules()]
    assert {n: p.shape for n, p in model.named_parameters()} == before
    listed = nn.Module()
    listed.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="ModuleList"):
        keep_only(copy.deepcopy(listed), ["blocks.1"])
    with pytest.raises(ValueError, match="ModuleList"):
        copy_kept(listed, ["blocks.1"])
    assert len(listed.blocks) == 2


def test_keeping_zero3_units_gathered_is_recommended_when_it_fits():
    """DeepSpeed's default (units kept from forward to backward, 2Ψ of gathers instead of 3Ψ) is
    suggested with the peak it would have — the plan of that layout's — and only when it fits."""
    common = ["--zero.stage", "3", "--train.seq_len", "4096", "--train.micro_batch", "1", "--train.global_batch", "64"]
    plan = _plan(64, "--preset", "llama3-8b", *common)
    kept = _plan(64, "--preset", "llama3-8b", *common, "--zero.reshard_after_forward", "false")
    note = next(n for n in plan.notes if n.startswith("--zero.reshard_after_forward false fits"))
    assert f"peak {kept.peak_bytes / GB:,.1f} GB" in note
    ops, kept_ops = plan.traffic["dp"]["ops"], kept.traffic["dp"]["ops"]
    assert kept_ops["all_gather"] * 2 == ops["all_gather"] and kept_ops["reduce_scatter"] == ops["reduce_scatter"]
    assert kept.time["step"] < plan.time["step"]
    big = _plan(64, "--preset", "llama3-70b", *common, "--train.recompute", "full")
    assert big.fits and not any("reshard_after_forward false fits" in n for n in big.notes)


def test_search_shows_progress_and_ctrl_c_prints_the_best_so_far(capsys, monkeypatch):
    """A batch job's log (stderr not a terminal) gets a line once the candidates are listed and lines of
    layouts planned / total with the best so far; a Ctrl-C mid-search (raised here from the progress call
    after the 5th candidate, where `search` would see the user's) ends it with the best of the 5 planned,
    said, and exit code 130."""
    from fivefold.plan import search as plan_search

    cfg = load_config(None, ["--model.preset", "small", "--train.seq_len", "256", "--train.micro_batch", "4",
                             "--train.global_batch", "16", "--precision.param", "bf16"])
    calls = []
    full = plan_search(cfg, 4, HARDWARE["h100"], top=50, progress=lambda d, t, b: calls.append((d, t, b)))
    assert calls[0] == (0, 0, None) and calls[-1][:2] == (full.total, full.total) and not full.stopped
    assert [d for d, _, _ in calls[1:]] == list(range(1, full.total + 1)) and full.tried == full.total
    assert calls[-1][2].layout == full.plans[0].layout  # the best so far at the end is the winner

    def interrupt(done, total, best):
        if done == 5:
            raise KeyboardInterrupt

    part = plan_search(cfg, 4, HARDWARE["h100"], top=50, progress=interrupt)
    assert part.stopped and part.tried == 5 and part.total == full.total and len(part.plans) <= 5

    import fivefold.plan.report as report

    def interrupting_progress(stream):
        shown = report.SearchProgress(stream, every_s=0.0)

        def call(done, total, best):
            shown(done, total, best)
            interrupt(done, total, best)

        call.close = shown.close
        return call

    common = ["plan", "--model", "small", "--gpus", "4", "--search", "--seq", "256", "--micro-batch", "4",
              "--global-batch", "16"]
    assert cli(common) == 0
    captured = capsys.readouterr()
    assert "listing the layouts" in captured.err and f"{full.total}/{full.total} layouts planned" in captured.err
    monkeypatch.setattr("fivefold.plan.SearchProgress", interrupting_progress)
    assert cli(common) == 130
    captured = capsys.readouterr()
    assert "5/" in captured.err and "best " in captured.err
    assert f"stopped after 5 of {full.total} candidates (Ctrl-C): the best so far" in captured.out


def test_search_keeps_a_given_schedule(capsys):
    """`--schedule` given with --search holds the schedule (it was replaced by 1F1B before)."""
    assert cli(["plan", "--model", "small", "--gpus", "4", "--search", "--pp", "2", "--schedule", "zb-h1",
                "--top", "3", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert plans and all("zb-h1" in p["layout"] for p in plans)


def test_the_plan_prices_ring_ulysses_and_the_hybrid_and_search_chooses():
    """Each cp mode's traffic per step is its formula (docs/design.md#ulysses-and-the-hybrid) × layers; with slow
    links and a fixed cp 8 the search tries the ring, Ulysses and every hybrid and ranks Ulysses (the least
    exposed traffic) first."""
    from fivefold.plan import candidate_layouts, search

    model = ["--preset", "tiny", "--model.n_layers", "8", "--model.dim", "256", "--model.n_heads", "8",
             "--model.n_kv_heads", "8", "--model.ffn_hidden", "512"]
    C, L, n = 8, 4096, 8
    common = [*model, "--parallel.cp", str(C), "--train.micro_batch", "1", "--train.seq_len", str(L),
              "--zero.stage", "0"]
    ring = _plan(C, *common).traffic
    uly = _plan(C, *common, "--parallel.cp_mode", "ulysses").traffic
    hyb = _plan(C, *common, "--parallel.cp_mode", "hybrid", "--parallel.cp_ulysses", "2").traffic
    a2a = formulas.ulysses_all_to_all_elements(1, L, 8, 8, 32, C, C)
    assert uly["cp_ulysses"]["ops"] == {"all_to_all": n * 2 * sum(a2a.values())} and "cp" not in uly
    a2a2 = formulas.ulysses_all_to_all_elements(1, L, 8, 8, 32, C, 2)
    p2p = formulas.ring_attention_p2p_elements(1, L, 4, 32, C // 2)  # 4 kv heads a rank after the all-to-all
    assert hyb["cp_ulysses"]["ops"] == {"all_to_all": n * 2 * sum(a2a2.values())}
    assert hyb["cp_ring"]["ops"]["send"] == n * 2 * sum(p2p.values())
    assert uly["cp_ulysses"]["wire_bytes"] < ring["cp"]["wire_bytes"] / 4
    cfg = load_config(None, ["--precision.param", "bf16", *common])
    slow = dataclasses.replace(HARDWARE["h100"], intra_node_gbps=1.0, inter_node_gbps=1.0)
    fixed = {"parallel.tp", "parallel.pp", "parallel.cp", "zero.stage", "train.recompute"}
    modes = set()
    for o in candidate_layouts(cfg, C, slow, fixed):
        mode = o[o.index("--parallel.cp_mode") + 1]
        modes.add(mode + (o[o.index("--parallel.cp_ulysses") + 1] if mode == "hybrid" else ""))
    assert modes == {"ring", "ulysses", "hybrid2", "hybrid4"}
    best = search(cfg, C, slow, top=4, fixed=fixed).plans
    assert "cp 8 ulysses," in best[0].layout, [p.layout for p in best]
