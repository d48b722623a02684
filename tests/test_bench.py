"""Smoke test of the benchmark harness: both DDPs run, bytes are measured, losses agree. No timing asserts."""

from __future__ import annotations

import pytest

from fivefold.bench import bench_ddp, format_table


@pytest.fixture(scope="module")
def result() -> dict:
    return bench_ddp(preset="tiny", world=2, steps=2, warmup=1, repeats=2, micro_batch=2, seq_len=16)


def test_both_timed(result):
    names = [r["name"] for r in result["impls"]]
    assert names == ["fivefold", "torch"]
    for r in result["impls"]:
        assert r["median_s"] > 0 and len(r["times_s"]) == 2 and r["tokens_per_s"] > 0
    assert result["ratio"] > 0 and result["ratio_label"] == "fivefold/torch"


def test_measured_allreduce_bytes(result):
    psi = result["params"]
    assert result["expected_payload_bytes"] == 4 * psi
    for r in result["impls"]:
        assert r["comm_source"].startswith("measured")
        assert r["comm_constant"]
        assert r["payload_bytes"] == 4 * psi, r["name"]
        assert r["wire_bytes"] == pytest.approx(2 * (2 - 1) / 2 * 4 * psi)


def test_same_loss_trajectory(result):
    fivefold, torch_ddp = result["impls"]
    assert len(fivefold["losses"]) == 3  # warmup + timed
    assert result["max_abs_loss_diff"] <= 1e-4
    assert max(abs(a - b) for a, b in zip(fivefold["losses"], torch_ddp["losses"])) <= 1e-4


def test_table(result):
    table = format_table(result)
    assert "fivefold/torch" in table and "| fivefold" in table and "| torch" in table


def test_cli_help(capsys):
    from fivefold.bench import main

    with pytest.raises(SystemExit) as e:
        main(["ddp", "--help"])
    assert e.value.code == 0 and "--bucket-mb" in capsys.readouterr().out
