"""`fivefold.formulas` at known values and the figures of docs/design.md#reference-figures.

Model states per ZeRO stage (docs/design.md#model-state-memory), DDP / ZeRO traffic
(docs/design.md#data-parallel-traffic), HSDP (docs/design.md#hsdp), TP / SP volumes and the ZeRO
paper's numbers; the module imports nothing but `typing`. No processes. `ring_wire_bytes` is tested
in test_config_mesh, `bubble_formula` in test_pipeline_schedules."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from fivefold import formulas
from fivefold.distributed import comm
from fivefold.formulas import (
    RECIPES,
    expected_for,
    hsdp_expected,
    ring_wire_bytes,
    tp_comm_formula,
    zero_model_states,
)

PSI, N = 1000, 4


def test_pure_module():
    tree = ast.parse(Path(formulas.__file__).read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)
                for a in (n.names if isinstance(n, ast.Import) else [None])}
    assert imported <= {"__future__", "typing"}, imported
    assert comm.ring_wire_bytes is ring_wire_bytes  # the CommLog uses the same formula


@pytest.mark.parametrize("recipe, params, grads, optimizer", [
    ("ddp", 4 * PSI, 4 * PSI, 8 * PSI),  # 16Ψ
    ("zero1", 4 * PSI, 4 * PSI, 8 * PSI / N),  # 4Ψ + 4Ψ + 8Ψ/N
    ("zero2", 4 * PSI, 4 * PSI / N, 8 * PSI / N),  # 4Ψ + 12Ψ/N
    ("zero3", 4 * PSI / N, 4 * PSI / N, 8 * PSI / N),  # 16Ψ/N
    ("ddp+zero_optim", 4 * PSI, 4 * PSI, 8 * PSI / N),
])
def test_expected_memory(recipe, params, grads, optimizer):
    memory = expected_for(recipe, PSI, N)["memory"]
    assert memory == {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def test_expected_communication():
    wire = (N - 1) / N
    ddp, z1, z2, z3 = (expected_for(r, PSI, N) for r in ("ddp", "zero1", "zero2", "zero3"))
    assert ddp["by_op"] == {"all_reduce": 4 * PSI} and ddp["wire_bytes"] == pytest.approx(2 * wire * 4 * PSI)
    # ZeRO-1/2 move what DDP moves (RS + AG = AR on the wire); ZeRO-3 1.5× (docs/design.md#data-parallel-traffic).
    for z in (z1, z2):
        assert z["by_op"] == {"reduce_scatter": 4 * PSI, "all_gather": 4 * PSI}
        assert z["wire_bytes"] == pytest.approx(ddp["wire_bytes"])
    assert z3["by_op"] == {"all_gather": 8 * PSI, "reduce_scatter": 4 * PSI} and z3["payload_bytes"] == 12 * PSI
    assert z3["wire_bytes"] == pytest.approx(1.5 * ddp["wire_bytes"])
    assert expected_for("ddp+zero_optim", PSI, N)["by_op"] == {"all_reduce": 4 * PSI, "broadcast": 4 * PSI}
    # keeping the gathered units from forward to backward drops the backward's all-gather: 2Ψ of traffic, not 3Ψ
    keep = expected_for("zero3-keep", PSI, N)
    assert keep["by_op"] == {"all_gather": 4 * PSI, "reduce_scatter": 4 * PSI} and keep["memory"] == z3["memory"]
    assert keep["wire_bytes"] == pytest.approx(ddp["wire_bytes"])
    assert set(RECIPES) == {"ddp", "zero1", "zero2", "zero3", "zero3-keep", "ddp+zero_optim"}


def test_hsdp_memory_follows_the_shard_degree_and_traffic_splits_by_sub_dimension():
    # docs/design.md#hsdp: 1024 GPUs as 128 ZeRO-3 groups of 8 hold 16Ψ/8 = 2Ψ each (fp32 here: 16 bytes per element)
    z3 = hsdp_expected(3, 8 * PSI, 8, 128)
    assert z3["memory"] == expected_for("zero3", 8 * PSI, 8)["memory"] and z3["memory"]["total"] == 16 * PSI
    assert z3["by_dim"] == {"dp_shard": {"all_gather": 8 * 8 * PSI, "reduce_scatter": 4 * 8 * PSI},
                            "dp_replicate": {"all_reduce": 4 * PSI}}  # Ψ/N_s of the 8Ψ elements
    assert z3["wire_bytes"]["dp_replicate"] == pytest.approx(2 * 127 / 128 * 4 * PSI)
    assert z3["wire_bytes"]["dp_shard"] == pytest.approx(expected_for("zero3", 8 * PSI, 8)["wire_bytes"])
    for stage in (1, 2):
        z = hsdp_expected(stage, PSI, N, 2)
        assert z["by_dim"]["dp_shard"] == {"reduce_scatter": 4 * PSI, "all_gather": 4 * PSI}
        assert z["payload_bytes"] == {"dp_shard": 8 * PSI, "dp_replicate": 4 * PSI // N}
    with pytest.raises(ValueError, match="stage 0 over both groups is DDP"):
        hsdp_expected(0, PSI, N, 2)


def test_tp_formula_sp_moves_the_same_activation_volume():
    cfg = SimpleNamespace(n_layers=3, dim=16)
    B, L, bld = 2, 8, 2 * 8 * 16
    tp, sp = tp_comm_formula(cfg, B, L, False), tp_comm_formula(cfg, B, L, True)
    assert tp == {"all_reduce": ((4 * 3 + 2) * bld + 3 * B * L) * 4}
    assert sp["all_gather"] == sp["reduce_scatter"] == (4 * 3 + 2) * bld * 4
    assert sp["all_reduce"] == (3 * B * L + (2 * 3 + 1) * 16) * 4
    # An all-gather + reduce-scatter pair puts an all-reduce's bytes on the wire (docs/design.md#collectives-on-a-ring).
    activations = (4 * 3 + 2) * bld * 4
    pair = ring_wire_bytes("all_gather", activations, N) + ring_wire_bytes("reduce_scatter", activations, N)
    assert pair == pytest.approx(ring_wire_bytes("all_reduce", activations, N))



def test_model_states_reproduce_the_seeds_numbers():
    """The ZeRO paper's numbers: 7.5B parameters over N_d = 64 with mixed-precision Adam (K = 12): 120 / 31.4 / 16.6 /
    1.88 GB for DDP / ZeRO-1 / ZeRO-2 / ZeRO-3; 1T over 1024 with ZeRO-3: 15.6 GB; a 7B model's Adam states 112 GB
    (docs/design.md#reference-figures)."""
    gb = 1e9
    totals = [zero_model_states(7.5e9, stage, 64)["total"] / gb for stage in range(4)]
    assert [round(t, 2) for t in totals] == [120.0, 31.41, 16.64, 1.88]
    assert round(zero_model_states(1e12, 3, 1024)["total"] / gb, 1) == 15.6
    assert zero_model_states(7e9, 0, 1)["total"] / gb == 112.0
    # fp32 AdamW (fivefold's default training): the recipes the engine tests measure against
    for stage in range(4):
        fp32 = zero_model_states(1000, stage, 4, 4, 4, 8)
        assert fp32 == expected_for(("ddp", "zero1", "zero2", "zero3")[stage], 1000, 4)["memory"]
    with pytest.raises(ValueError, match="zero stage 4"):
        zero_model_states(1, 4, 1)
