"""Smoke tests of the TP / PP / CP / EP and other benchmarks (world 2, a few tiny steps, no timing).

One launch per benchmark: every contestant produces results; fivefold's TP bytes equal the formula
and torch TP's collectives move the same volume; losses agree with torch's (TP, and PP against
`torch.distributed.pipelining`); the measured bubble is in [0, 1); ring attention equals the
all-gather-K/V baseline and sends the formula's volume; the scaling benchmark's MFU is model FLOPs
counted by hand over step time × peak. Losses are held to the contest's training in one process
(`bench_reference`) by tolerance.py's bound. Each launch is `multiprocess`; `all`'s dispatch is not.
"""

from __future__ import annotations

import math

import pytest
from test_bench import assert_trains_like_reference, bench_reference, pair_loss_bound
from tolerance import KERNELS, reference

from bench import run as bench_run
from bench.context_parallel import CPSpec, bench_cp
from bench.pipeline import PP_PAIRS, PPSpec, bench_pp
from bench.tensor_parallel import TPSpec, bench_tp
from fivefold.formulas import ring_attention_p2p_elements, tp_comm_formula
from fivefold.models import get_config
from fivefold.models.llama import Llama

TP_SPEC = TPSpec(preset="tiny", steps=2, warmup=1, repeats=2, batch=2, seq_len=32)
PP_SPEC = PPSpec(preset="tiny", microbatches=(4,), steps=2, warmup=1, repeats=2, micro_batch=1, seq_len=32)
CP_SPEC = CPSpec(preset="tiny", seq_lens=(64,), steps=2, warmup=1, repeats=2)
EP_SPEC = dict(steps=2, warmup=1, repeats=2, micro_batch=2, seq_len=32)
EP_OVERLAP_SPEC = dict(steps=2, warmup=1, repeats=2, micro_batch=1, seq_len=32)
# rule 1's n (tests/tolerance.py): the longest sum whose order a contestant (or another kernel path) changes — tiny's
# widest inner dimension, ffn_hidden 384, which TP also splits into shards, is longer than any contest's tokens (PP:
# 4 x 32 in micro-batches; CP: 64, split by position); tiny-moe's experts are 256 wide, its contests' tokens 128
# (EP) and 256 (EP overlap: 4 micro-batches x 2 ranks x 32)
TERMS, MOE_TERMS = 384, 256
# fivefold parallelize's training (the config's defaults), as the MoE contests run it
PARALLELIZE = dict(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, groups=True, clip=1.0)


def _reference(kernels: str, preset: str, rows: int, seq_len: int, steps: int, terms: int, **kw) -> tuple[dict, dict]:
    return reference(bench_reference, preset, rows, seq_len, steps, kernels=kernels, terms=terms, **kw)


@pytest.fixture(scope="module")
def tp_results():
    return bench_tp(TP_SPEC)


@pytest.fixture(scope="module")
def pp_results():
    return bench_pp(PP_SPEC)


def _by_name(results: dict) -> dict[str, dict]:
    return {r["name"]: r for r in results["impls"]}


def _check_common(impls: dict[str, dict], names: list[str], steps: int) -> None:
    assert sorted(impls) == sorted(names)
    for name, r in impls.items():
        assert r["median_s"] > 0 and r["tokens_per_s"] > 0, name
        assert len(r["times_s"]) == steps, name
        assert all(math.isfinite(v) for v in r["losses"]), name


def _assert_losses_agree(results: dict, want: dict, bounds: dict) -> None:
    """Every contestant's losses within the reference's bound, and a pair's per-rank difference within a rank's."""
    for r in results["impls"]:
        assert_trains_like_reference(r, want, bounds)
    for p in results["pairs"]:
        assert p["max_abs_loss_diff"] <= pair_loss_bound(want, bounds), p


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
def test_tp_every_contestant_and_losses_agree(tp_results, kernels):
    impls = _by_name(tp_results)
    _check_common(impls, ["fivefold-TP", "torch-TP", "fivefold-TP+SP", "torch-TP+SP"], TP_SPEC.steps)
    assert {p["name"] for p in tp_results["pairs"]} == {"fivefold-TP", "fivefold-TP+SP"}
    for p in tp_results["pairs"]:
        assert p["ratio"] > 0
    s = TP_SPEC  # every tp rank: the whole batch, its loss; AdamW over all parameters
    _assert_losses_agree(tp_results, *_reference(kernels, s.preset, s.batch, s.seq_len, s.warmup + s.steps, TERMS,
                                                 lr=s.lr, weight_decay=s.weight_decay))


@pytest.mark.multiprocess
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_tp_bytes_equal_formula(tp_results, sp):
    impls = _by_name(tp_results)
    tag = "TP+SP" if sp else "TP"
    formula = tp_comm_formula(get_config("tiny"), TP_SPEC.batch, TP_SPEC.seq_len, sp)
    ours = impls[f"fivefold-{tag}"]
    assert {op: b for op, (_, b) in ours["comm_by_op"].items()} == formula
    assert ours["comm_constant"]
    n = get_config("tiny").n_layers
    calls = {op: c for op, (c, _) in ours["comm_by_op"].items()}
    assert calls == ({"all_reduce": 4 * n + 2 + 3} if not sp else
                     {"all_gather": 4 * n + 2, "reduce_scatter": 4 * n + 2, "all_reduce": 3 + 2 * n + 1})
    # torch's DTensor plan moves the same activation volume (its SP norm-gradient all-reduces may repeat).
    theirs = {op: b for op, (_, b) in impls[f"torch-{tag}"]["comm_by_op"].items()}
    for op in ("all_gather", "reduce_scatter"):
        assert theirs.get(op, 0) == formula.get(op, 0), op
    if sp:
        assert theirs["all_reduce"] >= formula["all_reduce"]
    else:
        assert theirs == formula


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
def test_pp_every_contestant_losses_and_bubble(pp_results, kernels):
    impls = _by_name(pp_results)
    names = [n for s in PP_SPEC.schedules for n in (f"fivefold-{s}-M4", f"torch-{PP_PAIRS[s]}-M4")]
    _check_common(impls, names, PP_SPEC.steps)
    assert len(pp_results["pairs"]) == len(PP_SPEC.schedules)
    s, (M,) = PP_SPEC, PP_SPEC.microbatches  # the last stage: the mean of M micro-batches' losses
    _assert_losses_agree(pp_results, *_reference(kernels, s.preset, M * s.micro_batch, s.seq_len, s.warmup + s.steps,
                                                 TERMS, micro=M, lr=s.lr, weight_decay=s.weight_decay))
    for name, r in impls.items():
        assert 0.0 <= r["bubble_measured"] < 1.0, name
        assert 0.0 < r["bubble_formula"] < 1.0, name
        kinds = {rec[0] for rank in r["records_last_step"] for rec in rank}
        assert len(r["records_last_step"]) == PP_SPEC.pp and kinds, name
        if "dualpipev" in name or "DualPipeV" in name:  # full backwards in the main phase, I + W around it
            assert {"F", "I", "W"} <= kinds <= {"F", "B", "I", "W"}, name
        else:
            assert kinds == ({"F", "I", "W"} if "zb-h1" in name or "ZeroBubble" in name else {"F", "B"}), name


@pytest.mark.multiprocess
def test_pp_fivefold_p2p_volume(pp_results):
    """Rank 0 moves one activation and one gradient per micro-batch across each stage boundary it sits on (P = 2:
    every boundary between ranks; DualPipeV's middle boundary stays on rank 1)."""
    from fivefold.pipeline import build_schedule

    c = get_config("tiny")
    act = PP_SPEC.micro_batch * PP_SPEC.seq_len * c.dim * 4
    for r in pp_results["impls"]:
        if r["name"].startswith("fivefold"):
            i = r["info"]
            rank_of = build_schedule(i["schedule"], i["P"], i["M"], i["V"]).stage_to_rank
            boundaries = sum(1 for s in range(i["n_stages"] - 1)
                             if rank_of[s] != rank_of[s + 1] and 0 in (rank_of[s], rank_of[s + 1]))
            total = sum(b for _, b in r["comm_by_op"].values())
            assert total == 2 * boundaries * r["info"]["M"] * act, r["name"]


@pytest.fixture(scope="module")
def cp_run():
    return bench_cp(CP_SPEC)["runs"][0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
def test_cp_ring_equals_allgather_and_sends_the_formula(cp_run, kernels):
    run = cp_run
    impls = _by_name(run)
    _check_common(impls, ["fivefold-ring", "allgather-kv"], CP_SPEC.steps)
    s, (seq_len,) = CP_SPEC, CP_SPEC.seq_lens  # a cp rank's loss: its zig-zag positions'; a fivefold ZeRO-0 engine
    _assert_losses_agree(run, *_reference(kernels, s.preset, s.batch, seq_len, s.warmup + s.steps, TERMS, cp=s.cp,
                                          lr=s.lr, weight_decay=s.weight_decay, groups=True))
    c = get_config("tiny")
    per_layer = ring_attention_p2p_elements(CP_SPEC.batch, 64, c.n_kv_heads, c.head_dim, CP_SPEC.cp)
    sends = impls["fivefold-ring"]["comm_by_op"]["send"]
    assert sends[1] == c.n_layers * sum(per_layer.values()) * 4  # fp32 K/V and dK/dV
    ring, gathered = (impls[n]["info"]["saved_activation_bytes"] for n in ("fivefold-ring", "allgather-kv"))
    assert 0 < ring < gathered


@pytest.fixture(scope="module")
def ep_results():
    from bench.expert_parallel import EPSpec, bench_ep

    return bench_ep(EPSpec(**EP_SPEC))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
def test_ep_bench_halves_expert_memory_and_matches_the_replicated_losses(ep_results, kernels):
    from bench.expert_parallel import EPSpec

    results, s = ep_results, EPSpec(**EP_SPEC)
    impls = _by_name(results)
    _check_common(impls, ["fivefold-ep", "replicated"], 2)
    _assert_losses_agree(results, *_reference(kernels, s.preset, s.ep * s.micro_batch, s.seq_len, s.warmup + s.steps,
                                              MOE_TERMS, dp=s.ep, **PARALLELIZE))
    assert impls["fivefold-ep"]["info"]["experts_per_rank"] * 2 == impls["replicated"]["info"]["experts_per_rank"]
    assert impls["fivefold-ep"]["memory"]["total"] < impls["replicated"]["memory"]["total"]
    assert "all_to_all" in impls["fivefold-ep"]["comm_by_op"] and "all_to_all" not in impls["replicated"]["comm_by_op"]


@pytest.fixture(scope="module")
def ep_overlap_results():
    from bench.expert_parallel import EPOverlapSpec, bench_ep_overlap

    return bench_ep_overlap(EPOverlapSpec(**EP_OVERLAP_SPEC))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
def test_ep_overlap_bench_runs_units_side_by_side_with_the_same_losses(ep_overlap_results, kernels):
    from bench.expert_parallel import EPOverlapSpec, format_ep_overlap_table

    results, s = ep_overlap_results, EPOverlapSpec(**EP_OVERLAP_SPEC)
    impls = _by_name(results)
    _check_common(impls, ["overlap", "sequential"], 2)
    # the ranks of the last stage report their dp rank's loss (the others none): their mean is the global batch's
    want, bounds = _reference(kernels, s.preset, s.microbatches * s.micro_batch * s.ep, s.seq_len, s.warmup + s.steps,
                              MOE_TERMS, dp=s.ep, micro=s.microbatches, **PARALLELIZE)
    _assert_losses_agree(results, want, bounds)
    assert impls["overlap"]["info"]["overlap"] and not impls["sequential"]["info"]["overlap"]
    assert impls["overlap"]["overlapped_per_step"] >= 1 and impls["sequential"]["overlapped_per_step"] == 0
    assert "units overlapped per step" in format_ep_overlap_table(results)


@pytest.mark.multiprocess
def test_checkpoint_bench_measures_save_load_and_a_bounded_export():
    from bench.checkpoint import CheckpointSpec, bench_checkpoint, format_checkpoint_table

    results = bench_checkpoint(CheckpointSpec(preset="tiny", repeats=1, max_shard_mb=0.5))
    assert set(results["median_s"]) == {"sync", "async_blocked", "async_complete", "load"}
    assert all(v > 0 for v in results["median_s"].values())
    assert len(results["export"]["files"]) > 1 and results["export"]["peak_held_bytes"] <= 2**20
    assert "save, async: training blocked" in format_checkpoint_table(results)


@pytest.mark.multiprocess
def test_recompute_bench_keeps_what_the_formula_says_and_trains_alike():
    from bench.recompute import RecomputeSpec, bench_recompute, format_recompute_table

    results = bench_recompute(RecomputeSpec(preset="tiny", seq_len=64, steps=1, warmup=0, repeats=1,
                                            cores=("eager",)))
    rows = results["cores"]["eager"]
    assert set(rows) == {"none", "full", "selective", "torch-full"}
    outside_blocks = {name: r["kept_bytes"] - r["formula_bytes"] for name, r in rows.items()}
    assert max(outside_blocks.values()) - min(outside_blocks.values()) < 1024, outside_blocks  # embedding, logits
    assert rows["full"]["kept_bytes"] == rows["torch-full"]["kept_bytes"] < rows["selective"]["kept_bytes"]
    assert rows["selective"]["kept_bytes"] < rows["none"]["kept_bytes"]
    assert len({r["loss"] for r in rows.values()}) == 1
    assert "torch-full" in format_recompute_table(results)


@pytest.mark.multiprocess
def test_main_prints_tables(tp_results, pp_results, monkeypatch, capsys):
    """The command line, on the results above (no further launch)."""
    seen = {}

    def fake(kind, results):
        def run(spec):
            seen[kind] = spec
            return results
        return run

    monkeypatch.setattr(bench_run, "bench_tp", fake("tp", tp_results))
    monkeypatch.setattr(bench_run, "bench_pp", fake("pp", pp_results))
    monkeypatch.setattr(bench_run, "bench_cp", fake("cp", {"kind": "cp"}))
    monkeypatch.setattr(bench_run, "format_cp_table", lambda results: "table of cp")
    monkeypatch.setattr(bench_run, "bench_ep", fake("ep", {"kind": "ep"}))
    monkeypatch.setattr(bench_run, "format_ep_table", lambda results: "table of ep")
    monkeypatch.setattr(bench_run, "bench_ep_overlap", fake("ep-overlap", {"kind": "ep-overlap"}))
    monkeypatch.setattr(bench_run, "format_ep_overlap_table", lambda results: "table of ep-overlap")
    assert bench_run.main(["parallel", "--preset", "tiny", "--steps", "3", "--sp", "on", "--microbatches", "4,8"]) == 0
    out = capsys.readouterr().out
    assert seen["tp"].sequence_parallel == (True,) and seen["tp"].preset == "tiny" and seen["tp"].steps == 3
    assert seen["pp"].microbatches == (4, 8)
    for p in (*tp_results["pairs"], *pp_results["pairs"]):
        assert f"ratio {p['name']}/{p['baseline']}" in out
    assert "bubble measured" in out and "formula" in out


def test_all_runs_every_dimension(monkeypatch, capsys):
    """``all`` runs ddp, zero, tp, pp, cp, ep, ep-overlap and ckpt, in that order, with the common options given
    to each (no launch)."""
    seen = []

    def fake(kind):
        def run(*args, **kwargs):
            seen.append((kind, args[0] if args else kwargs))
            return {"kind": kind}
        return run

    for name, kind in (("bench_ddp", "ddp"), ("bench_zero", "zero"), ("bench_tp", "tp"), ("bench_pp", "pp"),
                       ("bench_cp", "cp"), ("bench_ep", "ep"), ("bench_ep_overlap", "ep-overlap"),
                       ("bench_checkpoint", "ckpt")):
        monkeypatch.setattr(bench_run, name, fake(kind))
    for name in ("format_table", "format_tp_table", "format_pp_table", "format_cp_table", "format_ep_table",
                 "format_ep_overlap_table", "format_checkpoint_table"):
        monkeypatch.setattr(bench_run, name, lambda results: f"table of {results['kind']}")
    assert bench_run.main(["all", "--preset", "tiny", "--steps", "2", "--stages", "0,3"]) == 0
    assert [kind for kind, _ in seen] == ["ddp", "zero", "tp", "pp", "cp", "ep", "ep-overlap", "ckpt"]
    ddp, zero, tp, pp, cp, _, _, ckpt = (given for _, given in seen)
    assert ckpt.preset == "tiny"
    assert ddp == {"preset": "tiny", "steps": 2} and zero["stages"] == (0, 3) and zero["preset"] == "tiny"
    assert tp.preset == pp.preset == cp.preset == "tiny" and tp.steps == pp.steps == cp.steps == 2
    out = capsys.readouterr().out
    assert all(f"## {kind}" in out and f"table of {kind}" in out for kind in ("ddp", "zero", "tp", "pp", "cp", "ep"))


@pytest.mark.multiprocess
def test_debug_collectives_bench_times_both_modes():
    from bench.debug_collectives import DebugSpec, bench_debug, format_debug_table

    results = bench_debug(DebugSpec(calls=3, repeats=1, sizes=(1,)))
    assert set(results["median_s_per_call"]) == {"off", "debug"}
    assert all(v[1] > 0 for v in results["median_s_per_call"].values())
    assert "debug µs/call" in format_debug_table(results)


@pytest.mark.multiprocess
def test_scaling_bench_rows_and_mfu_arithmetic():
    """One size, DDP at world 2, ZeRO-3 (+ kept) and TP 2: every row present, formulas matched, and MFU = the step's
    model FLOPs / (step time × the cores' peak), recomputed here from the formula by hand."""
    from bench.scaling import ScaleSpec, bench_scaling, format_scaling_table

    spec = ScaleSpec(presets=("tiny",), worlds=(2,), steps=1, warmup=1, repeats=1, micro_batch=2, tp_batch=4,
                     seq_len=16)
    results = bench_scaling(spec)
    (size,) = results["sizes"]
    rows = {(r["layout"], r["name"]): r for r in size["rows"]}
    assert set(rows) == {("DDP", "fivefold"), ("DDP", "torch"), ("DDP", "ideal"), ("ZeRO-3", "fivefold-z3"),
                         ("ZeRO-3", "torch-FSDP2"), ("ZeRO-3", "fivefold-z3-keep"), ("ZeRO-3", "torch-FSDP2-keep"),
                         ("TP 2", "fivefold-TP"), ("TP 2", "torch-TP")}
    assert all(not r["mismatches"] for r in size["rows"])
    c = get_config("tiny")
    assert not c.tie_embeddings
    n = sum(math.prod(s) for name, s in Llama(c, device="meta").full_shapes().items()
            if not name.startswith("tok_embeddings"))
    flops = 6 * n + 6 * c.n_layers * 16 * c.dim  # attention: the causal half
    assert size["flops_per_token"] == flops
    ddp, tp = rows[("DDP", "fivefold")], rows[("TP 2", "fivefold-TP")]
    assert ddp["mfu"] == pytest.approx(2 * 2 * 16 * flops / ddp["median_s"] / (2 * results["core_peak_flops"]))
    assert tp["mfu"] == pytest.approx(4 * 16 * flops / tp["median_s"] / (2 * results["core_peak_flops"]))
    assert rows[("ZeRO-3", "fivefold-z3-keep")]["payload_bytes"] * 3 == rows[("ZeRO-3", "fivefold-z3")][
        "payload_bytes"] * 2
    assert rows[("DDP", "fivefold")]["vs_ideal"] > 0 and rows[("DDP", "ideal")]["payload_bytes"] == 0
    assert "fivefold-z3-keep" in format_scaling_table(results)


@pytest.mark.multiprocess
def test_fp8_and_muon_benches_run_every_contestant():
    """The FP8 bench's contestants all train (ZeRO-3's FP8 gather moving fewer all-gather bytes than bf16's), and
    the Muon bench's optimizer state per rank is below AdamW's."""
    from bench.numerics import (
        NumericsSpec,
        bench_fp8,
        bench_muon,
        format_fp8_table,
        format_muon_table,
    )

    spec = NumericsSpec(preset="tiny", steps=1, warmup=1, repeats=1, batch=4, seq_len=32)
    fp8 = bench_fp8(spec, layouts=("zero3",))
    impls = {i["name"]: i for i in fp8["layouts"]["zero3"]["impls"]}
    assert set(impls) == {"fp8-tensorwise", "fp8-rowwise", "fp8-gather", "bf16"}
    gathered = {name: i["comm_by_op"]["all_gather"][1] for name, i in impls.items()}
    assert gathered["fp8-gather"] < 0.7 * gathered["bf16"] == 0.7 * gathered["fp8-tensorwise"]
    assert "all-gather MiB per step" in format_fp8_table(fp8)
    muon = bench_muon(spec)
    by = {i["name"]: i for i in muon["impls"]}
    assert by["muon"]["info"]["optimizer_state_bytes"] < by["adamw"]["info"]["optimizer_state_bytes"]
    assert "optimizer state MiB / rank" in format_muon_table(muon)
