"""Collective fingerprints (`debug.collectives`): before each collective the ranks of its group compare (op, mesh
dim, shapes, dtypes, call number, training step, tag, call site); a mismatch raises `CollectiveMismatch` on every
rank naming both sides — different shapes, a collective skipped on one rank, an extra backward on one rank under
DDP and under ZeRO-3 — instead of a hang or a silent pairing. Off, nothing is computed."""

from __future__ import annotations

import torch
from dist_utils import run_workers

MODEL = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16, vocab_size=32)


def _catch(fn) -> str | None:
    from fivefold.comm import CollectiveMismatch
    try:
        fn()
    except CollectiveMismatch as e:
        return str(e)
    return None


def _worker(scenario: str) -> dict:
    """One scenario per spawn: after a mismatch the group holds an unmatched collective (a real run exits)."""
    from fivefold.comm import CommLog, set_debug_step
    from fivefold.config import Config
    from fivefold.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize

    out = {}
    if scenario == "plain":
        mesh = ParallelMesh(ParallelDims(dp=2), "cpu", CommLog(), debug_collectives=True)
        dp = mesh.comm("dp")
        rank = dp.rank
        out["shapes"] = _catch(lambda: dp.all_reduce(torch.ones(3 + rank), tag="probe"))

        def skip():
            if rank == 0:
                dp.all_reduce(torch.ones(2), tag="first")
            dp.all_reduce(torch.ones(2), tag="second")
        out["skipped"] = _catch(skip)
        plain = ParallelMesh(ParallelDims(dp=2), "cpu", CommLog()).comm("dp")  # off: no fingerprint, no side group
        plain.all_reduce(torch.ones(2))
        out["off"] = (plain._side, plain._seq)
        return out
    zero = int(scenario[-1])
    cfg = Config()
    cfg.zero.stage, cfg.train.seq_len, cfg.train.grad_accum = zero, 8, 1
    mesh = ParallelMesh(ParallelDims(dp=2), "cpu", CommLog(), debug_collectives=True)
    parts = parallelize(cfg, get_config("tiny", **MODEL), mesh, "cpu")
    rank = mesh.rank("dp")
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(rank))

    def train_with_an_extra_backward_on_rank_1():
        for step in range(2):
            set_debug_step(step)
            parts.forward_backward([(x, x)])
            if rank == 1 and step == 0:
                parts.forward_backward([(x, x)])  # the bug: one rank runs one more backward
            parts.step(1.0)
    out["extra"] = _catch(train_with_an_extra_backward_on_rank_1)
    set_debug_step(None)
    return out


def test_mismatched_shapes_and_a_skipped_collective_raise_on_every_rank_naming_both_sides():
    results = run_workers(_worker, 2, "plain")
    for r in results:
        assert "shapes [(3,)]" in r["shapes"] and "shapes [(4,)]" in r["shapes"], r["shapes"]
        assert "all_reduce probe" in r["shapes"] and "test_debug_collectives.py" in r["shapes"]
        assert "all_reduce first" in r["skipped"] and "all_reduce second" in r["skipped"], r["skipped"]
        assert r["off"] == (None, 0)
    assert results[0]["shapes"] == results[1]["shapes"]  # every rank raises the same error


def test_an_extra_backward_on_one_rank_is_caught_under_ddp_and_zero3():
    """DDP: the extra backward's bucket all-reduce would pair with the other rank's next step (silent divergence);
    ZeRO-3: its gathers would hang both ranks. Here both raise at that collective, naming the steps and call sites."""
    for zero, want in ((0, ("all_reduce bucket0", "at step 1", "at step 0", "_launch_bucket")),
                       (3, ("all_reduce grad_norm", "all_gather unit", "flat_param.py"))):
        results = run_workers(_worker, 2, f"zero{zero}")
        for r in results:
            assert r["extra"] is not None, f"ZeRO-{zero}: the extra backward went unnoticed"
            assert all(w in r["extra"] for w in want), r["extra"]
