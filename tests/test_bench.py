"""Smoke tests of the DDP / ZeRO benchmarks: fivefold DDP and ZeRO 0-3 against torch's counterparts.

Against torch DDP, ZeroRedundancyOptimizer and FSDP2 (± kept for backward): every contestant runs,
measured bytes and model states equal the formulas (docs/design.md#data-parallel-traffic,
docs/design.md#model-state-memory), every contestant's losses lie within the bound
tests/tolerance.py derives around the contest's training in one process (`bench_reference`, shared
with test_bench_parallel.py), the ideal communicates nothing, offload keeps less on the device. No
timing asserts. The benchmark runs spawn gloo workers (`multiprocess`); CLI help runs in-process."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from tolerance import KERNELS, reference

from bench.data_parallel import bench_ddp, format_table

DDP_SPEC = dict(preset="tiny", world=2, steps=2, warmup=1, repeats=2, micro_batch=2, seq_len=16)


def bench_reference(preset: str, rows: int, seq_len: int, steps: int, *, dp: int = 1, micro: int = 1, cp: int = 1,
                    lr: float = 1e-3, weight_decay: float = 0.1, groups: bool = False,
                    betas: tuple[float, float] = (0.9, 0.999), clip: float | None = None, seed: int = 0) -> dict:
    """A contest's training in one process, as its contestants train: the harness's model and global batches,
    AdamW (one group, or with `groups` the engine's: no decay for 1-D parameters and embeddings), micro-batch i =
    every dp rank's i-th (as an MoE's balancing sees it). Per step: the global batch's loss, and each rank's (the
    mean over its dp rank's rows and its cp rank's zig-zag positions; ranks in dp-major order)."""
    from bench.harness import contest_config
    from fivefold.context_parallel import SequenceLayout
    from fivefold.data_parallel.zero import default_no_decay
    from fivefold.models import build_model
    from fivefold.models.parallelize import set_aux_grad_scale
    from fivefold.train.corpus import load_tokens
    from fivefold.train.data import TokenDataset

    model = build_model(contest_config(types.SimpleNamespace(preset=preset, seq_len=seq_len)), seed=seed)
    params = list(model.named_parameters())
    no_decay = [groups and default_no_decay(n, p, model) for n, p in params]
    opt = torch.optim.AdamW([{"params": [p for (_, p), nd in zip(params, no_decay) if not nd],
                              "weight_decay": weight_decay},
                             {"params": [p for (_, p), nd in zip(params, no_decay) if nd], "weight_decay": 0.0}],
                            lr=lr, betas=betas)
    set_aux_grad_scale([model], 1.0 / micro)
    data = TokenDataset(load_tokens(None), seq_len, seed=seed)
    order = torch.arange(rows).view(dp, micro, -1)  # [dp rank, micro-batch, row]
    positions = [SequenceLayout("zigzag", cp).positions(c, seq_len, "cpu") if cp > 1 else torch.arange(seq_len)
                 for c in range(cp)]
    losses, ranks = [], []
    for step in range(steps):
        x, y = data.global_batch(step, rows)
        opt.zero_grad()
        total, tokens = 0.0, torch.empty(rows, seq_len)
        for i in range(micro):
            idx = order[:, i].flatten()
            ce = F.cross_entropy(model(x[idx]).flatten(0, 1), y[idx].flatten(), reduction="none")
            loss = ce.mean() / micro
            loss.backward()
            total += loss.item()
            tokens[idx] = ce.detach().view(len(idx), seq_len)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(total)
        ranks.append([tokens[order[r].flatten()][:, pos].mean().item() for r in range(dp) for pos in positions])
    return dict(losses=losses, ranks=ranks)


def assert_trains_like_reference(impl: dict, want: dict, bounds: dict) -> None:
    """A contestant's loss of every step (the mean over the ranks: the global batch's) within the reference's."""
    assert len(impl["losses"]) == len(want["losses"]), impl["name"]
    for step, (got, loss) in enumerate(zip(impl["losses"], want["losses"])):
        bounds["losses"][step].assert_holds(got, loss, f"{impl['name']} step {step}")


def pair_loss_bound(want: dict, bounds: dict) -> float:
    """How far two contestants' losses of one rank and step may differ: they are two orders of the same sums, as the
    reference is a third, so within the bound of that rank's loss (the largest over ranks and steps)."""
    return max(b.atol + b.rtol * abs(w) for bs, ws in zip(bounds["ranks"], want["ranks"]) for b, w in zip(bs, ws))


def _dp_reference(kernels: str, weight_decay: float, groups: bool) -> tuple[dict, dict]:
    spec = DDP_SPEC
    # rule 1's n: tiny's widest inner dimension, ffn_hidden 384 (another kernel path may sum it in another order),
    # longer than the 2 x 2 x 16 tokens a weight gradient sums over the ranks
    return reference(bench_reference, spec["preset"], spec["world"] * spec["micro_batch"], spec["seq_len"],
                     spec["warmup"] + spec["steps"], dp=spec["world"], weight_decay=weight_decay, groups=groups,
                     kernels=kernels, terms=384)


@pytest.fixture(scope="module")
def result() -> dict:
    return bench_ddp(**DDP_SPEC)


@pytest.mark.multiprocess
def test_both_timed(result):
    names = [r["name"] for r in result["impls"]]
    assert names == ["fivefold", "torch", "ideal"]
    for r in result["impls"]:
        assert r["median_s"] > 0 and len(r["times_s"]) == 2 and r["tokens_per_s"] > 0
    assert result["ratio"] > 0 and result["ratio_label"] == "fivefold/torch"


@pytest.mark.multiprocess
def test_measured_allreduce_bytes(result):
    psi = result["params"]
    assert result["expected_payload_bytes"] == 4 * psi
    for r in result["impls"][:2]:
        assert r["comm_source"].startswith("measured")
        assert r["comm_constant"]
        assert r["payload_bytes"] == 4 * psi, r["name"]
        assert r["wire_bytes"] == pytest.approx(2 * (2 - 1) / 2 * 4 * psi)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
def test_same_loss_trajectory(result, kernels):
    fivefold, torch_ddp, _ = result["impls"]
    assert len(fivefold["losses"]) == 3  # warmup + timed
    want, bounds = _dp_reference(kernels, weight_decay=0.1, groups=False)  # bench_ddp's AdamW: one group
    assert_trains_like_reference(fivefold, want, bounds)
    assert_trains_like_reference(torch_ddp, want, bounds)
    assert result["max_abs_loss_diff"] <= pair_loss_bound(want, bounds)


@pytest.mark.multiprocess
def test_table(result):
    table = format_table(result)
    assert "fivefold/torch" in table and "| fivefold" in table and "| torch" in table


def test_cli_help(capsys):
    from bench.run import main

    with pytest.raises(SystemExit) as e:
        main(["ddp", "--help"])
    assert e.value.code == 0 and "--bucket-mb" in capsys.readouterr().out


# -- ZeRO 0-3 vs torch DDP / ZeroRedundancyOptimizer / FSDP2 ---------------------------------------

ZERO_NAMES = ["fivefold-z0", "torch-DDP", "fivefold-z1", "torch-ZeRO1", "fivefold-z2", "fivefold-z3", "torch-FSDP2",
              "fivefold-z3-keep", "torch-FSDP2-keep", "ideal"]
BASELINES = {"fivefold-z0": "torch-DDP", "fivefold-z1": "torch-ZeRO1", "fivefold-z2": "torch-ZeRO1",
             "fivefold-z3": "torch-FSDP2", "fivefold-z3-keep": "torch-FSDP2-keep"}


@pytest.fixture(scope="module")
def zero_result() -> dict:
    from bench.data_parallel import bench_zero

    return bench_zero(**DDP_SPEC, keep=True)


def _impls(result: dict) -> dict[str, dict]:
    return {r["name"]: r for r in result["impls"]}


@pytest.mark.multiprocess
def test_zero_every_contestant_timed(zero_result):
    assert [r["name"] for r in zero_result["impls"]] == ZERO_NAMES
    for r in zero_result["impls"]:
        assert r["median_s"] > 0 and len(r["times_s"]) == 2 and r["tokens_per_s"] > 0
        assert len(r["losses"]) == 3 and all(loss == loss for loss in r["losses"])  # warmup + timed, no NaN
    assert {p["name"]: p["baseline"] for p in zero_result["pairs"]} == BASELINES
    assert all(p["ratio"] > 0 for p in zero_result["pairs"])


@pytest.mark.multiprocess
def test_zero_fivefold_bytes_equal_formulas(zero_result):
    world, impls = 2, _impls(zero_result)
    for stage in range(4):
        r = impls[f"fivefold-z{stage}"]
        psi = r["padded_params"]
        assert psi % world == 0 and psi - r["params"] < world * 8  # padded per flat buffer
        want = [{"all_reduce": 4 * psi}, {"reduce_scatter": 4 * psi, "all_gather": 4 * psi},
                {"reduce_scatter": 4 * psi, "all_gather": 4 * psi},
                {"reduce_scatter": 4 * psi, "all_gather": 8 * psi}][stage]
        assert r["comm_source"].startswith("measured") and r["comm_constant"]
        assert {op: b for op, (_, b) in r["comm_by_op"].items()} == want, r["name"]
        wire = sum(b * (2 if op == "all_reduce" else 1) * (world - 1) / world for op, b in want.items())
        assert r["wire_bytes"] == pytest.approx(wire)
        assert not r["mismatches"], r["mismatches"]
    # The torch counterparts are measured too, and their bytes are those of their recipes.
    psi = zero_result["params"]
    assert impls["torch-DDP"]["payload_bytes"] == 4 * psi
    assert {op: b for op, (_, b) in impls["torch-ZeRO1"]["comm_by_op"].items()} == {
        "all_reduce": 4 * psi, "broadcast": 4 * psi}
    fsdp = impls["torch-FSDP2"]
    assert {op: b for op, (_, b) in fsdp["comm_by_op"].items()} == {
        "all_gather": 8 * fsdp["padded_params"], "reduce_scatter": 4 * fsdp["padded_params"]}


@pytest.mark.multiprocess
def test_zero3_kept_for_backward_moves_2psi_and_computes_the_same(zero_result):
    """reshard_after_forward false: one all-gather per step (Ψ, not 2Ψ), the same model states and losses as ZeRO-3,
    and the same bytes as FSDP2 with reshard_after_forward=False."""
    impls = _impls(zero_result)
    keep, z3, fsdp_keep = impls["fivefold-z3-keep"], impls["fivefold-z3"], impls["torch-FSDP2-keep"]
    psi = keep["padded_params"]
    assert keep["recipe"] == fsdp_keep["recipe"] == "zero3-keep" and not keep["mismatches"], keep["mismatches"]
    assert {op: b for op, (_, b) in keep["comm_by_op"].items()} == {"all_gather": 4 * psi, "reduce_scatter": 4 * psi}
    assert keep["payload_bytes"] * 3 == z3["payload_bytes"] * 2
    assert {op: b for op, (_, b) in fsdp_keep["comm_by_op"].items()} == {
        "all_gather": 4 * fsdp_keep["padded_params"], "reduce_scatter": 4 * fsdp_keep["padded_params"]}
    assert keep["memory"]["total"] == z3["memory"]["total"]
    assert keep["losses"] == z3["losses"]


@pytest.mark.multiprocess
def test_zero_fivefold_memory_equals_formula(zero_result):
    world, impls = 2, _impls(zero_result)
    for stage in range(4):
        r = impls[f"fivefold-z{stage}"]
        psi, pad = r["padded_params"], r["padded_params"] - r["params"]
        params, grads = [(4 * psi, 4 * psi), (4 * psi, 4 * psi), (4 * psi, 4 * psi // world),
                         (4 * psi // world, 4 * psi // world)][stage]
        optim = 8 * psi // (1 if stage == 0 else world)
        assert len(r["memory_per_rank"]) == world
        for mem in r["memory_per_rank"]:
            assert mem["params"] == params and mem["grads"] == grads, (r["name"], mem)
            # AdamW m, v for every real element (not padding), plus 4-byte step counters.
            assert 0 < mem["step_counters"] <= 4 * 64
            assert optim - 8 * pad <= mem["optimizer"] - mem["step_counters"] <= optim, (r["name"], mem)
    # ZeRO-3 holds exactly what FSDP2 holds when no padding is needed.
    assert impls["fivefold-z3"]["memory"]["total"] - impls["fivefold-z3"]["memory"]["step_counters"] == (
        impls["torch-FSDP2"]["memory"]["total"] - impls["torch-FSDP2"]["memory"]["step_counters"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
def test_zero_losses_match_torch(zero_result, kernels):
    impls = _impls(zero_result)
    want, bounds = _dp_reference(kernels, weight_decay=0.0, groups=True)  # bench_zero's AdamW: the engine's groups
    for name, baseline in BASELINES.items():
        assert_trains_like_reference(impls[name], want, bounds)
        assert_trains_like_reference(impls[baseline], want, bounds)
        assert impls[name]["max_abs_loss_diff"] <= pair_loss_bound(want, bounds), name


@pytest.mark.multiprocess
def test_zero_table(zero_result):
    table = format_table(zero_result)
    for name in ZERO_NAMES:
        assert f"| {name}" in table
    assert "fivefold-z3/torch-FSDP2" in table and "16Ψ/N" in table and "AG 2Ψ + RS Ψ" in table


def test_cli_zero_help(capsys):
    from bench.run import main

    with pytest.raises(SystemExit) as e:
        main(["zero", "--help"])
    assert e.value.code == 0 and "--stages" in capsys.readouterr().out


# -- ZeRO-Offload and constant buffers vs the plain engine ------------------------------------------

@pytest.mark.multiprocess
def test_offload_bench_same_losses_less_on_the_device():
    """One stage keeps it short: the offloaded engine holds only parameters and gradients on the device (its
    optimizer state and masters on the host), the pooled one its constant buffers besides; the math is the same."""
    from bench.data_parallel import bench_offload, format_offload_table

    result = bench_offload(preset="tiny", world=2, steps=1, warmup=3, repeats=1, micro_batch=2, seq_len=16,
                           stages=(3,))
    impls = _impls(result)
    plain, off, cb = (impls[f"fivefold-z3{s}"]["memory"] for s in ("", "-offload", "-constbuf"))
    assert off["device"] == plain["params"] + plain["grads"] and off["host"] == off["optimizer"] + plain["grads"]
    assert cb["buffers"] > 0 and cb["device"] == plain["device"] + cb["buffers"] and plain["host"] == 0
    assert all(p["max_abs_loss_diff"] == 0.0 for p in result["pairs"])
    assert "fivefold-z3-offload/fivefold-z3" in format_offload_table(result)


@pytest.mark.multiprocess
def test_ideal_has_no_communication_and_every_row_its_efficiency(zero_result):
    """The ideal contestant communicates nothing; every other row carries step / ideal (paired) and its inverse."""
    impls = _impls(zero_result)
    ideal = impls["ideal"]
    assert ideal["payload_bytes"] == 0 and ideal["comm_calls"] == 0 and "vs_reference" not in ideal
    assert ideal["losses"][0] == impls["torch-DDP"]["losses"][0]  # step 0: the same weights, the same forward
    for name in ZERO_NAMES[:-1]:
        r = impls[name]
        assert r["vs_reference"]["name"] == "ideal" and r["vs_reference"]["ratio_paired"] > 0
        assert r["dp_efficiency"] == pytest.approx(1 / r["vs_reference"]["ratio_paired"])
        assert r["vs_reference"]["ratio"] == pytest.approx(r["median_s"] / ideal["median_s"])
        assert r["vs_reference"]["cpu_ratio"] == pytest.approx(r["cpu_median_s"] / ideal["cpu_median_s"])
    assert all(r["minor_faults"] >= 0 and 0 <= r["kernel_median_s"] <= r["cpu_median_s"] for r in impls.values())
    table = format_table(zero_result)
    assert "step / ideal (paired)" in table and "ideal CPU / CPU" in table and "| ideal" in table
    assert "page faults" in table


@pytest.mark.multiprocess
def test_zero_only_runs_the_named_contestants_alone():
    """``only``: just those contestants, a baseline not among them dropped; an unknown name is refused up front."""
    from bench.data_parallel import bench_zero

    with pytest.raises(ValueError, match="--only fivefold-z9: not among"):
        bench_zero(preset="tiny", stages=(3,), only=("fivefold-z9",))
    result = bench_zero(preset="tiny", world=2, steps=1, warmup=1, repeats=1, micro_batch=2, seq_len=16, stages=(3,),
                        keep=True, only=("fivefold-z3-keep",))
    (impl,) = result["impls"]
    assert impl["name"] == "fivefold-z3-keep" and impl["baseline"] is None and not result["pairs"]
    assert not impl["mismatches"], impl["mismatches"]
    ideal = bench_zero(preset="tiny", world=2, steps=1, warmup=1, repeats=1, micro_batch=2, seq_len=16, stages=(3,),
                       only=("ideal",))
    assert "| ideal" in format_table(ideal)


@pytest.mark.multiprocess
def test_the_save_share_bench_counts_the_default_saves_and_the_50_waits_rule():
    from bench.checkpoint import bench_save_share, format_save_share_table

    result = bench_save_share(preset="tiny", steps=6, seq_len=32, every_minutes=(10.0, 1e-6))
    default, tiny = result["runs"]
    assert [reason for reason, _ in default["saves"]] == ["end"]  # a short run: only at the end
    reasons = [reason for reason, _ in tiny["saves"]]
    assert reasons[-1] == "end" and "time" in reasons
    for r in result["runs"]:
        assert r["saving_s"] == pytest.approx(sum(s for _, s in r["saves"]))
        assert 0 < r["share"] == pytest.approx(r["saving_s"] / (r["steps_s"] + r["saving_s"]))
    assert "share, saves by time" in format_save_share_table(result)
