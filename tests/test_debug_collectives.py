"""Collective fingerprints (`debug.collectives`): a mismatch raises on every rank naming both sides.

Before each collective the ranks of its group compare (op, mesh dim, shapes, dtypes, call number,
step, tag, call site); different shapes, a collective skipped on one rank and an extra backward on
one rank under DDP and ZeRO-3 raise `CollectiveMismatch` instead of a hang or a silent pairing, and
HSDP issues its collectives in one order everywhere. Off, nothing is computed. Every test spawns
gloo workers (`multiprocess`)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_workers

pytestmark = pytest.mark.multiprocess  # every test here starts processes

MODEL = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16, vocab_size=32)


def _catch(fn) -> str | None:
    from fivefold.distributed.comm import CollectiveMismatch
    try:
        fn()
    except CollectiveMismatch as e:
        return str(e)
    return None


def _worker(scenario: str) -> dict:
    """One scenario per spawn: after a mismatch the group holds an unmatched collective (a real run exits)."""
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog, set_debug_step
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
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


def _hsdp_worker() -> list[float]:
    """HSDP 2 × 2, ZeRO-2 with small buckets, in debug mode: every collective's fingerprint is a blocking exchange
    in its group, so the shard and replica collectives must come in one order on every rank. Each rank here sees
    its reduce-scatters finish at different times (injected): a start of the replicas' all-reduce that depended on
    it would pair different collectives and raise, or hang."""
    from fivefold.config import Config
    from fivefold.distributed.comm import Comm, CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize

    # shard groups {0, 1}, {2, 3}, replica groups {0, 2}, {1, 3}: a reduce-scatter looks finished at once on
    # ranks 0 and 3 and never on 1 and 2, so each replica group pairs an early rank with a late one
    class _Timing:
        def __init__(self, work, done: bool) -> None:
            self.work, self.done = work, done

        def is_completed(self) -> bool:
            return self.done

        def wait(self, *args) -> bool:
            return self.work.wait(*args)

    plain = Comm.reduce_scatter

    def reduce_scatter(self, *args, **kwargs):
        work = plain(self, *args, **kwargs)
        return _Timing(work, torch.distributed.get_rank() in (0, 3)) if work is not None else None

    Comm.reduce_scatter = reduce_scatter
    cfg = Config()
    cfg.zero.stage, cfg.zero.bucket_mb, cfg.zero.inflight_buckets, cfg.train.seq_len = 2, 0.005, 3, 8
    cfg.parallel.dp_replicate = 2
    mesh = ParallelMesh(ParallelDims(dp=4, dp_replicate=2), "cpu", CommLog(), debug_collectives=True)
    parts = parallelize(cfg, get_config("tiny", **MODEL), mesh, "cpu")
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(mesh.rank("dp")))
    losses = []
    for _ in range(2):
        loss = parts.forward_backward([(x, x)])
        parts.step(1.0)
        losses.append(parts.global_loss(loss).item())
    return losses


def test_hsdp_issues_its_collectives_in_one_order_on_every_rank():
    results = run_workers(_hsdp_worker, 4)
    assert all(r == results[0] for r in results)
