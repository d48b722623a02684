"""Numerical guards: a non-finite gradient stops every rank before the step, naming the parameter.

The first parameter whose gradient is not finite is named; fp16 skips such a step instead (in
process); a diverging run keeps strict-JSON metrics and its last checkpoint intact, and `fivefold
train` exits non-zero with one line. The training runs spawn workers (`multiprocess`)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from dist_utils import run_workers

from fivefold.optim.clip import NonFiniteGradient

MODEL = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16, vocab_size=32)


def _guard_worker() -> dict:
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize

    out = {}
    for zero in (1, 3):
        cfg = Config()
        cfg.zero.stage, cfg.train.seq_len, cfg.train.grad_accum = zero, 8, 1
        mesh = ParallelMesh(ParallelDims(dp=2), "cpu", CommLog())
        parts = parallelize(cfg, get_config("tiny", **MODEL), mesh, "cpu")
        x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(mesh.rank("dp")))
        parts.forward_backward([(x, x)])
        parts.step(1.0, check_finite=True)  # a finite step passes
        before = {k: v.clone() for k, v in parts.full_state_dict().items()}
        parts.forward_backward([(x, x)])
        flat = parts.engine.flats[-1]
        injected = None
        if mesh.rank("dp") == 1:  # one element of one rank's reduced gradient shard
            flat.grad_shard[3] = float("nan")
            injected = next(s.name for s in flat.layout.slots if s.offset <= flat.start + 3 < s.offset + s.numel)
        try:
            parts.step(1.0, check_finite=True)
            error = None
        except NonFiniteGradient as e:
            error = str(e)
        after = parts.full_state_dict()
        out[zero] = dict(error=error, injected=injected,
                         unchanged=all(torch.equal(before[k], after[k]) for k in before))
    return out


@pytest.mark.multiprocess
def test_a_nan_in_one_ranks_gradient_stops_every_rank_before_the_step_naming_the_parameter():
    results = run_workers(_guard_worker, 2)
    for zero in (1, 3):
        name = results[1][zero]["injected"]
        for rank in results:
            r = rank[zero]
            assert r["error"] is not None, f"ZeRO-{zero}: no error"
            assert "global gradient norm is nan" in r["error"] and f"{name!r} (rank 1)" in r["error"], r["error"]
            assert r["unchanged"], f"ZeRO-{zero}: the weights moved"


def _strict(line: str) -> dict:
    def refuse(constant: str) -> float:
        raise ValueError(f"non-JSON constant {constant}")
    return json.loads(line, parse_constant=refuse)


@pytest.mark.multiprocess
def test_a_diverging_run_exits_non_zero_with_valid_metrics_and_its_last_checkpoint_intact(tmp_path, capsys):
    from fivefold.checkpoint.manager import complete_checkpoints, read_checkpoint_meta, verify_files
    from fivefold.cli import main

    code = main(["train", "--preset", "tiny", "--steps", "8", "--nproc", "2", "--train.lr", "1e30",
                 "--train.warmup_steps", "0", "--train.seq_len", "32", "--train.global_batch", "4",
                 "--train.eval_every", "0", "--checkpoint.interval", "1", "--run.out_dir", str(tmp_path),
                 "--run.name", "boom", "--run.progress", "false", "--run.plot", "false"])
    err = capsys.readouterr().err
    assert code == 1 and "NonFiniteGradient: step" in err and "first non-finite gradient is" in err, err
    assert len([line for line in err.splitlines() if "fivefold train: error" in line]) == 1
    records = [_strict(line) for line in (tmp_path / "boom" / "metrics.jsonl").read_text().splitlines()]
    (error,) = [r for r in records if r["kind"] == "error"]
    trained = [r["step"] for r in records if r["kind"] == "train"]
    assert trained == list(range(1, len(trained) + 1))
    assert error["step"] == len(trained) + 1 <= 8  # the failing step (1-based) wrote no train record
    last = complete_checkpoints(tmp_path / "boom" / "checkpoints")[-1]
    assert read_checkpoint_meta(last)["steps_done"] == len(trained)  # saved after the last good step
    assert verify_files(last, read_checkpoint_meta(last)) == []
    assert not math.isnan(records[-2].get("loss") or 0.0)


def test_fp16_skips_an_overflowing_step_instead():
    from fivefold.optim.clip import step_together

    class Optimizer:
        def local_sq_norms(self):
            return {frozenset(): torch.tensor(float("inf"))}

        def apply_step(self, norm, max_norm, found_inf):
            self.skipped = found_inf

        def first_non_finite_grad(self):
            return None

    class Engine:
        comm, zero_stage, loss_scaler, optimizer = None, 0, object(), Optimizer()

        def check_step_allowed(self):
            pass

        def zero_grad(self):
            pass

    engine = Engine()
    engine.comm = type("C", (), {"device": torch.device("cpu"), "dim": "dp"})()
    step_together([engine], None, {}, check_finite=True)
    assert engine.optimizer.skipped  # fp16: skipped, no error
    with pytest.raises(NonFiniteGradient):
        engine.loss_scaler = None
        step_together([engine], None, {}, check_finite=True)
