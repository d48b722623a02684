"""Smoke tests of the TP / PP benchmarks against torch (world 2, a few tiny steps; no timing assertions).

One launch per benchmark: every contestant produces results, fivefold's TP bytes equal the
formula (and torch's collectives move the same volume), losses agree with torch's, and the
measured pipeline bubble is a fraction in [0, 1).
"""

from __future__ import annotations

import math

import pytest

from fivefold import bench_parallel
from fivefold.bench_parallel import PP_PAIRS, PPSpec, TPSpec, bench_pp, bench_tp, tp_comm_formula
from fivefold.models import get_config

LOSS_TOL = 1e-4
TP_SPEC = TPSpec(preset="tiny", steps=2, warmup=1, repeats=2, batch=2, seq_len=32)
PP_SPEC = PPSpec(preset="tiny", microbatches=(4,), steps=2, warmup=1, repeats=2, micro_batch=1, seq_len=32)


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


def test_tp_every_contestant_and_losses_agree(tp_results):
    impls = _by_name(tp_results)
    _check_common(impls, ["fivefold-TP", "torch-TP", "fivefold-TP+SP", "torch-TP+SP"], TP_SPEC.steps)
    assert {p["name"] for p in tp_results["pairs"]} == {"fivefold-TP", "fivefold-TP+SP"}
    for p in tp_results["pairs"]:
        assert p["max_abs_loss_diff"] <= LOSS_TOL, p
        assert p["ratio"] > 0


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


def test_pp_every_contestant_losses_and_bubble(pp_results):
    impls = _by_name(pp_results)
    names = [n for s in PP_SPEC.schedules for n in (f"fivefold-{s}-M4", f"torch-{PP_PAIRS[s]}-M4")]
    _check_common(impls, names, PP_SPEC.steps)
    assert len(pp_results["pairs"]) == len(PP_SPEC.schedules)
    for p in pp_results["pairs"]:
        assert p["max_abs_loss_diff"] <= LOSS_TOL, p
    for name, r in impls.items():
        assert 0.0 <= r["bubble_measured"] < 1.0, name
        assert 0.0 < r["bubble_formula"] < 1.0, name
        kinds = {rec[0] for rank in r["records_last_step"] for rec in rank}
        assert len(r["records_last_step"]) == PP_SPEC.pp and kinds, name
        assert kinds == ({"F", "I", "W"} if "zb-h1" in name or "ZeroBubble" in name else {"F", "B"}), name


def test_pp_fivefold_p2p_volume(pp_results):
    """Rank 0 of P = 2 touches every stage boundary: one activation and one gradient per micro-batch each."""
    c = get_config("tiny")
    act = PP_SPEC.micro_batch * PP_SPEC.seq_len * c.dim * 4
    for r in pp_results["impls"]:
        if r["name"].startswith("fivefold"):
            boundaries = r["info"]["n_stages"] - 1
            total = sum(b for _, b in r["comm_by_op"].values())
            assert total == 2 * boundaries * r["info"]["M"] * act, r["name"]


def test_main_prints_tables(tp_results, pp_results, monkeypatch, capsys):
    """The command line, on the results above (no further launch)."""
    seen = {}

    def fake(kind, results):
        def run(spec):
            seen[kind] = spec
            return results
        return run

    monkeypatch.setattr(bench_parallel, "bench_tp", fake("tp", tp_results))
    monkeypatch.setattr(bench_parallel, "bench_pp", fake("pp", pp_results))
    assert bench_parallel.main(["all", "--preset", "tiny", "--steps", "3", "--sp", "on", "--microbatches", "4,8"]) == 0
    out = capsys.readouterr().out
    assert seen["tp"].sequence_parallel == (True,) and seen["tp"].preset == "tiny" and seen["tp"].steps == 3
    assert seen["pp"].microbatches == (4, 8)
    for p in (*tp_results["pairs"], *pp_results["pairs"]):
        assert f"ratio {p['name']}/{p['baseline']}" in out
    assert "bubble measured" in out and "formula" in out
