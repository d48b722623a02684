"""Step traces (`run.trace`): ``trace.json``, ``step_trace.png`` and the hidden-communication share.

One spawn of 2 gloo workers (`multiprocess`) trains dp 2 ZeRO-0, dp 2 ZeRO-3, ZeRO-3 with full
recompute, tp 2 + SP, pp 2 1F1B and tracing off in-process with the trainer, recording each step's
CommLog; the trace is checked against it: a forward and a backward span per block and micro-batch (a
recompute span inside backward), every collective of the traced steps with its op, dim, bytes and
tag, DDP's buckets during backward, ZeRO-3's gathers per unit with the prefetch ahead of use, the
hidden fraction recomputed from the file. Interval arithmetic, lanes and the device-event clock are
unit-tested in-process."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from dist_utils import coalescing_p2p, run_workers

from fivefold.clock import DeviceClock
from fivefold.distributed.comm import CommLog
from fivefold.observe.report import step_trace_lanes
from fivefold.observe.trace import intersect, length, overlap, subtract, trace_window, union

STEPS, TRACED = 3, 2  # the last two steps are traced
MODEL = ["--preset", "tiny", "--model.n_layers", "2", "--model.dim", "64", "--model.ffn_hidden", "128"]
RUNS = {  # name: overrides (world 2)
    "ddp": ["--zero", "0", "--zero.bucket_mb", "0.02"],
    "zero3": ["--zero", "3"],
    "zero3_recompute": ["--zero", "3", "--train.recompute", "full", "--train.grad_accum", "2",
                        "--train.micro_batch", "2"],
    "tp_sp": ["--parallel.tp", "2", "--parallel.sp", "true", "--zero", "1"],
    "pp": ["--parallel.pp", "2", "--train.grad_accum", "2", "--train.micro_batch", "2", "--zero", "1",
           "--pipeline.schedule", "1f1b"],
    # NCCL's p2p: one work per batch (`coalescing_p2p`), which stamps every message in it
    "pp_coalesced": ["--parallel.pp", "2", "--train.grad_accum", "2", "--train.micro_batch", "2", "--zero", "1",
                     "--pipeline.schedule", "1f1b", "--pipeline.p2p", "rendezvous"],
    "off": ["--zero", "0", "--run.trace", "false"],
}


def _config(name: str, out_dir: str):
    from fivefold.config import load_config

    return load_config(None, [*MODEL, "--steps", str(STEPS), "--nproc", "2", "--run.out_dir", out_dir,
                              "--run.name", name, "--run.progress", "false", "--train.seq_len", "16",
                              "--train.eval_every", "0", "--data.max_bytes", "200000", "--run.trace", "true",
                              "--run.trace_steps", str(TRACED), "--run.device", "cpu", *RUNS[name]])


def _hook_count(modules) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for root in modules for m in root.modules())


def _worker(out_dir: str) -> dict:
    """Every run of `RUNS` through the trainer, each step's CommLog records kept (op, dim, bytes, tag, seq, timed)."""
    import torch.distributed as dist

    from fivefold.distributed.comm import CommLog as PlainLog
    from fivefold.distributed.mesh import ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize
    from fivefold.train import trainer
    from fivefold.train.validate import validate

    kept: list[list[tuple]] = []

    class KeepingLog(PlainLog):
        def reset(self) -> None:
            kept.append([(r.op, r.dim, r.payload_bytes, r.tag, r.seq, r.timing is not None) for r in self.records])
            super().reset()

    made: list[KeepingLog] = []

    def make_log(**kw) -> KeepingLog:
        made.append(KeepingLog(**kw))
        return made[-1]

    trainer.CommLog = make_log
    out: dict = {"rank": dist.get_rank(), "runs": {}}
    try:
        for name in RUNS:
            kept.clear()
            cfg = _config(name, out_dir)
            with coalescing_p2p() if name == "pp_coalesced" else contextlib.nullcontext():
                trainer.train(cfg, validate(cfg, 2))
            records = kept[1:] + [[(r.op, r.dim, r.payload_bytes, r.tag, r.seq, r.timing is not None)
                                   for r in made[-1].records]]
            out["runs"][name] = {"steps": records}
    finally:
        trainer.CommLog = PlainLog
    # Off means no hook: the trainer makes no tracer, and a tracer's hooks go away with it.
    cfg = _config("ddp", str(Path(out_dir) / "hooks"))
    plan = validate(cfg, 2)
    mesh = ParallelMesh(plan.dims, "cpu", PlainLog())
    parts = parallelize(cfg, get_config("tiny", n_layers=2, dim=64, ffn_hidden=128), mesh, "cpu")
    before = _hook_count(parts.modules())
    cfg.run.trace = False
    out["off_tracer"] = trainer.make_tracer(cfg, parts, mesh.comm_log, mesh, torch.device("cpu"))
    cfg.run.trace = True
    tracer = trainer.make_tracer(cfg, parts, mesh.comm_log, mesh, torch.device("cpu"))
    out["hooks"] = (before, _hook_count(parts.modules()))
    tracer.close()
    out["hooks_after_close"] = _hook_count(parts.modules())
    return out


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("trace")
    results = run_workers(_worker, 2, str(out_dir))
    traces = {name: json.loads((out_dir / name / "trace.json").read_text())
              for name in RUNS if (out_dir / name / "trace.json").exists()}
    return out_dir, results, traces


def _x_events(trace: dict, rank: int | None = None, step: int | None = None, cat: str | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and (rank is None or e["pid"] == rank)
            and (step is None or e["args"].get("step") == step) and (cat is None or e["cat"] == cat)]


def _spans(trace: dict, rank: int, step: int, cat: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for e in _x_events(trace, rank, step, cat):
        out.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    return out


def _traced_steps() -> list[int]:
    """Numbered as in metrics.jsonl (steps done, 1-based)."""
    return list(range(STEPS - TRACED + 1, STEPS + 1))


def _blocks_of(name: str, rank: int) -> list[str]:
    if name.startswith("pp"):  # 1F1B over 2 ranks: a block each
        return [f"layers.{rank}"]
    return ["layers.0", "layers.1"]


def _micro(name: str) -> int:
    return 2 if name in ("zero3_recompute", "pp", "pp_coalesced") else 1


# ----------------------------------------------------------------------------------------------------------------
# the trainer's output

@pytest.mark.multiprocess
def test_files_written_only_when_tracing(traced):
    out_dir, results, traces = traced
    for name in RUNS:
        on = name != "off"
        assert (out_dir / name / "trace.json").exists() == on, name
        assert (out_dir / name / "step_trace.png").exists() == on, name
        if on:
            assert (out_dir / name / "step_trace.png").stat().st_size > 5000
    assert (out_dir / "pp" / "timeline.png").exists()  # the pipeline picture stays; its actions are in trace.json


@pytest.mark.multiprocess
def test_off_means_no_hooks_and_no_timing(traced):
    _, results, _ = traced
    for res in results:
        assert res["off_tracer"] is None
        before, with_tracer = res["hooks"]
        assert with_tracer > before and res["hooks_after_close"] == before
        steps = res["runs"]["off"]["steps"]
        assert steps and all(not timed for step in steps for *_, timed in step), "a record timed with tracing off"
        # on: exactly the traced steps' records are timed
        ddp = res["runs"]["ddp"]["steps"]
        assert [any(r[-1] for r in step) for step in ddp] == [s in _traced_steps() for s in range(1, STEPS + 1)]


@pytest.mark.multiprocess
def test_chrome_trace_structure(traced):
    _, _, traces = traced
    for name, trace in traces.items():
        meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
        assert {e["pid"] for e in meta if e["name"] == "process_name"} == {0, 1}, name
        lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
        for e in _x_events(trace):
            assert e["ts"] >= 0 and e["dur"] >= 0, e
            assert (e["pid"], e["tid"]) in lanes, e
        for key in lanes:  # events of one lane nest (Perfetto draws a lane as a stack)
            evs = sorted(((e["ts"], e["ts"] + e["dur"]) for e in _x_events(trace) if (e["pid"], e["tid"]) == key),
                         key=lambda iv: (iv[0], -iv[1]))
            stack: list[float] = []
            for s, end in evs:
                while stack and stack[-1] <= s + 1e-3:
                    stack.pop()
                assert not stack or end <= stack[-1] + 1e-3, f"{name} lane {lanes[key]}: events overlap partly"
                stack.append(end)
        assert {e["args"]["step"] for e in _x_events(trace)} == set(_traced_steps())


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in RUNS if n != "off"])
def test_forward_and_backward_span_per_block(traced, name):
    _, _, traces = traced
    trace = traces[name]
    for rank in (0, 1):
        for step in _traced_steps():
            fwd = _spans(trace, rank, step, "forward")
            bwd = _spans(trace, rank, step, "backward")
            rec = _spans(trace, rank, step, "recompute")
            for block in _blocks_of(name, rank):
                assert len(fwd.get(block, [])) == _micro(name), (name, rank, step, block, fwd.keys())
                assert len(bwd.get(block, [])) == _micro(name), (name, rank, step, block, bwd.keys())
                for s, e in bwd[block]:
                    assert e > s
                if name == "zero3_recompute":  # the block's forward again, inside its backward: not a 2nd forward
                    assert len(rec.get(block, [])) == _micro(name)
                    for s, e in rec[block]:
                        assert any(bs <= s and e <= be for bs, be in bwd[block]), (block, s, e, bwd[block])
            other = {b for b in fwd if b.startswith("layers.")} - set(_blocks_of(name, rank))
            assert not other, f"{name} rank {rank} traced blocks it does not hold: {other}"
            if name != "zero3_recompute":
                assert not rec, (name, rec)
            # a backward begins after its forward ends (same micro-batch order)
            for block in _blocks_of(name, rank):
                assert min(s for s, _ in bwd[block]) >= min(e for _, e in fwd[block])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in RUNS if n != "off"])
def test_every_collective_of_the_traced_steps(traced, name):
    """Each traced step's CommLog records (op, dim, bytes, tag, seq) are exactly its collective events."""
    _, results, traces = traced
    for res in results:
        rank = res["rank"]
        steps = res["runs"][name]["steps"]
        assert len(steps) == STEPS
        for step in _traced_steps():
            logged = Counter((op, dim, nbytes, tag, seq) for op, dim, nbytes, tag, seq, _ in steps[step - 1])
            events = _x_events(traces[name], rank, step, "collective")
            got = Counter((e["args"]["op"], e["args"]["dim"], e["args"]["bytes"], e["args"]["tag"], e["args"]["seq"])
                          for e in events)
            assert logged and got == logged, f"{name} rank {rank} step {step}: {got - logged} / {logged - got}"
            assert all(e["args"]["completed"] for e in events)


@pytest.mark.multiprocess
def test_ddp_buckets_reduce_during_backward(traced):
    _, _, traces = traced
    trace = traces["ddp"]
    for rank in (0, 1):
        for step in _traced_steps():
            buckets = [e for e in _x_events(trace, rank, step, "collective") if e["args"]["tag"].startswith("bucket")]
            assert len(buckets) >= 3, "bucket_mb is meant to make several buckets"
            last_block_end = max(e for _, e in _spans(trace, rank, step, "backward")["layers.0"])
            early = [b for b in buckets if b["ts"] < last_block_end]
            assert len(early) >= len(buckets) - 1, "bucket all-reduces must start while backward still runs"


@pytest.mark.multiprocess
def test_zero3_gathers_per_unit_with_prefetch(traced):
    _, _, traces = traced
    trace = traces["zero3"]
    for rank in (0, 1):
        for step in _traced_steps():
            gathers = [e for e in _x_events(trace, rank, step, "collective") if e["args"]["op"] == "all_gather"]
            per_unit = Counter(e["args"]["tag"] for e in gathers)
            waits = sorted(_x_events(trace, rank, step, "wait"), key=lambda e: e["ts"])
            fwd = {b: s[0] for b, s in _spans(trace, rank, step, "forward").items()}
            unit_of = {}  # a block's unit: the gather waited for right before its forward
            for block in ("layers.0", "layers.1"):
                before = [w for w in waits if w["ts"] <= fwd[block][0] and "all_gather" in w["name"]]
                unit_of[block] = before[-1]["name"].split()[-1]
            assert len(set(unit_of.values())) == 2
            for block, unit in unit_of.items():
                assert per_unit[unit] == 2, f"{block} ({unit}): gathered for forward and for backward"
            # prefetch: layers.1's gather is launched before layers.0's forward is over
            first = min(e["ts"] for e in gathers if e["args"]["tag"] == unit_of["layers.1"])
            assert first < fwd["layers.0"][1]


@pytest.mark.multiprocess
def test_tp_collectives_inside_block_spans_and_blocking(traced):
    _, _, traces = traced
    trace = traces["tp_sp"]
    for rank in (0, 1):
        for step in _traced_steps():
            spans = [iv for cat in ("forward", "backward") for ivs in _spans(trace, rank, step, cat).values()
                     for iv in ivs]
            tp = [e for e in _x_events(trace, rank, step, "collective") if e["args"]["dim"] == "tp"
                  and e["args"]["tag"].startswith("sp_")]
            assert tp
            waits = {e["args"]["seq"]: e for e in _x_events(trace, rank, step, "wait")}
            outside = [e["name"] for e in tp if not any(s <= e["ts"] <= end for s, end in spans)]
            assert outside == ["all_gather sp_scatter_bwd"], outside  # (the embedding has no backward span)
            for e in tp:  # synchronous: the caller is blocked for the whole call
                w = waits[e["args"]["seq"]]
                assert w["ts"] == pytest.approx(e["ts"]) and w["dur"] == pytest.approx(e["dur"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["pp", "pp_coalesced"])
def test_pipeline_actions_and_p2p_in_the_one_trace(traced, name):
    _, _, traces = traced
    trace = traces[name]
    for rank in (0, 1):
        for step in _traced_steps():
            actions = Counter(e["args"]["kind"] for e in _x_events(trace, rank, step, "pipeline"))
            assert actions == {"F": 2, "B": 2}, actions
            p2p = Counter(e["args"]["op"] for e in _x_events(trace, rank, step, "collective")
                          if e["args"]["dim"] == "pp" and e["args"]["tag"] == "pp")
            assert p2p == {"send": 2, "recv": 2}, p2p
            for f_start, f_end in _spans(trace, rank, step, "forward")[f"layers.{rank}"]:  # blocks inside actions
                assert any(e["ts"] <= f_start and f_end <= e["ts"] + e["dur"] + 1e-3
                           for e in _x_events(trace, rank, step, "pipeline") if e["args"]["kind"] == "F")


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n in RUNS if n != "off"])
def test_hidden_fraction_printed_figures_match_the_file(traced, name):
    out_dir, _, traces = traced
    records = [json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()]
    figures = next(r for r in records if r["kind"] == "trace")
    summary = next(r for r in records if r["kind"] == "summary")
    assert summary["comm_hidden_fraction"] == pytest.approx(figures["comm_hidden_fraction"])
    assert 0.0 <= figures["comm_hidden_min"] <= figures["comm_hidden_fraction"] <= figures["comm_hidden_max"] <= 1.0
    assert figures["traced_steps"] == _traced_steps()
    trace = traces[name]
    for rank in (0, 1):  # recomputed from the file's events: collectives, compute per lane minus waits per lane
        comm_ns = hidden_ns = 0
        for step in _traced_steps():
            evs = _x_events(trace, rank, step)
            ns = lambda e: (round(e["ts"] * 1e3), round((e["ts"] + e["dur"]) * 1e3))  # noqa: E731
            comm = [ns(e) for e in evs if e["cat"] == "collective"]
            compute = [ns(e) for e in evs if e["cat"] in ("forward", "backward", "recompute", "pipeline")]
            blocked = [ns(e) for e in evs if e["cat"] == "wait"]
            c, h = overlap(comm, {"compute": compute}, {"compute": blocked})
            comm_ns, hidden_ns = comm_ns + c, hidden_ns + h
        assert figures["comm_hidden_per_rank"][rank] == pytest.approx(hidden_ns / comm_ns, abs=0.01)
    if name == "tp_sp":  # everything is synchronous: nothing is hidden
        assert figures["comm_hidden_max"] < 0.05
    if name == "ddp":  # buckets reduce while earlier blocks compute their backward: some of it is hidden, how much
        assert figures["comm_hidden_fraction"] > 0.0  # depends on the machine's load (0.09-0.7 seen on 2 cores)


# ----------------------------------------------------------------------------------------------------------------
# pieces

def test_interval_arithmetic_by_hand():
    assert union([(5, 7), (0, 2), (1, 3), (7, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert length([(0, 10), (5, 15)]) == 15
    assert intersect([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
    assert subtract([(0, 10), (20, 30)], [(2, 4), (8, 22), (29, 40)]) == [(0, 2), (4, 8), (22, 29)]
    assert subtract([(0, 10)], []) == [(0, 10)]


def test_hidden_fraction_by_hand():
    """Collectives [0, 10) and [20, 40) (30 ns); compute [5, 30) but blocked waiting in [25, 28); a second thread
    computes [36, 50). Hidden: [5, 10) + [20, 25) + [28, 30) + [36, 40) = 16 of 30."""
    comm = [(0, 10), (20, 40), (22, 24)]
    total, hidden = overlap(comm, {"compute": [(5, 30)], "side": [(36, 50)]}, {"compute": [(25, 28)]})
    assert (total, hidden) == (30, 16)
    # blocked on the other thread does not stop this one
    assert overlap(comm, {"compute": [(5, 30)]}, {"side": [(0, 100)]}) == (30, 15)
    assert overlap([], {"compute": [(0, 5)]}, {}) == (0, 0)


def test_trace_window():
    assert trace_window(0, 10, 2) == range(8, 10)
    assert trace_window(9, 10, 3) == range(9, 10)  # a resumed run traces what it has left
    assert trace_window(0, 10, 2, exit_after=4) == range(2, 4)  # it stops after 4 steps: its last two
    assert trace_window(0, 3, 5) == range(0, 3)


def test_collective_lanes_never_overlap_partly():
    evs = [dict(lane="comm dp", start=s, end=e, cat="collective") for s, e in ((0, 10), (5, 15), (12, 20), (16, 18))]
    evs.append(dict(lane="compute", start=0, end=30, cat="forward"))
    lanes = dict(step_trace_lanes(evs))
    assert [(e["start"], e["end"]) for e in lanes["comm dp"]] == [(0, 10), (12, 20)]
    assert [(e["start"], e["end"]) for e in lanes["comm dp #2"]] == [(5, 15), (16, 18)]
    assert list(lanes)[0] == "compute"


class _FakeEvent:
    """A device event as `torch.Event` has it: recorded later, time read after the device is synchronised."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        _FakeEvent.clock += 1.5  # ms on the "device"
        self.at = _FakeEvent.clock

    def elapsed_time(self, other: _FakeEvent) -> float:
        assert _FakeEvent.synced, "read before the device was synchronised"
        return other.at - self.at


def test_device_clock_uses_events_on_an_accelerator(monkeypatch):
    """On an accelerator a mark is an event on the stream and times are read once, after one synchronisation;
    nothing of torch.cuda is touched (the device-agnostic API only)."""
    _FakeEvent.synced = False
    fake = type("Acc", (), {"type": "meta"})()  # meta stands in for the accelerator (as in test_gpu_path)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: fake)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: setattr(_FakeEvent, "synced", True))
    monkeypatch.setattr(torch, "Event", _FakeEvent)
    monkeypatch.setattr(torch, "cuda", None)
    clock = DeviceClock("meta")
    assert clock.device_events
    origin, a, b = clock.mark(), clock.mark(), clock.mark()
    assert clock.elapsed_ns(origin, [a, b, origin]) == [1_500_000, 3_000_000, 0]
    assert not DeviceClock("cpu").device_events  # a CPU group on an accelerator host: the host clock


class _Work:
    def __init__(self, done: bool = False, future: bool = True) -> None:
        self.done, self.callbacks, self.waits, self.has_future = done, [], 0, future

    def wait(self, *args) -> bool:
        self.waits += 1
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done

    def get_future(self):
        if not self.has_future:
            raise RuntimeError("Work::getFuture not implemented.")
        work = self

        class _Future:
            def add_done_callback(self, fn) -> None:
                work.callbacks.append(fn)
        return _Future()


def test_timed_work_stamps_completion_and_waits():
    log = CommLog()
    log.clock = DeviceClock("cpu")
    t = log.record("all_reduce", "dp", torch.zeros(4), 2, "bucket0")
    work = _Work()
    timed = log.timed(work, [t])
    for fn in work.callbacks:  # gloo reports completion before anyone waits
        fn(None)
    done_at = t.end
    assert done_at is not None and t.wait_start is None
    timed.wait()
    assert t.end == done_at and t.wait_start <= t.wait_end and work.waits == 1  # completion stays the callback's
    timed.wait()  # a second wait changes nothing recorded
    assert t.end == done_at
    # a p2p work without a future: stamped by a poll once it is complete, else by its wait
    p = log.record("send", "pp", torch.zeros(2), 2, "pp")
    send = _Work(future=False)
    log.timed(send, [p])
    log.poll()
    assert p.end is None
    send.done = True
    log.poll()
    assert p.end is not None and not log._unfinished
    # off: no clock, no timing, the work itself
    log.clock = None
    assert log.record("all_reduce", "dp", torch.zeros(1), 2) is None and log.records[-1].timing is None
    raw = _Work()
    assert log.timed(raw, []) is raw


def test_no_torch_cuda_in_new_modules():
    root = Path(__file__).resolve().parent.parent / "fivefold"
    for name in ("clock.py", "observe/trace.py"):
        assert "torch.cuda" not in (root / name).read_text(), name
