"""Per-rank step traces (`run.trace`): what each rank computed and communicated, when, and how much
of the communication was hidden behind compute.

`StepTracer` installs hooks on the modules it is given (the transformer blocks, the embedding, final
norm and head) and, for the steps it is told to trace (`begin_step` / `end_step`), records on one
`DeviceClock`:

- a **forward** span per module call (after ZeRO-3's gather of the unit: its forward pre-hooks run
  first, and the tracer's post-hook runs before ZeRO-3 frees it); a **backward** span from the
  moment the gradient of the module's output arrives (after ZeRO-3's re-gather) to the moment its
  input's gradient is computed — two identity markers (`ops.call_in_backward`), so no full backward
  hook and nothing in the way of other hooks; a module whose input needs no gradient (the embedding,
  fed token ids) has no backward span;
- a **recompute** span when activation recomputation runs a module's forward again inside the
  backward (`ops.recompute` tells the tracer; a module called again in backward counts too), instead
  of a second forward;
- every `CommLog` record of the step with its launch and completion (`comm.CommTiming`) and the time
  its caller spent blocked waiting for it;
- the pipeline runtime's F / B / I / W actions (`pipeline.runtime.ActionClock.marks`) when there are
  any.

Times are ns on the rank's wall clock (the step's origin taken as `time.time_ns()` beside the first
mark), so ranks on one host line up; across hosts they are as close as the hosts' clocks. On an
accelerator the marks are device events and `end_step` waits for the device once per traced step.

Hidden communication (`overlap`): the union C of the step's collective intervals [launch,
completion], the compute K on each thread (the union of its spans and pipeline actions) minus the
intervals B where that thread was blocked waiting for a collective (a synchronous call, a
``wait()``); hidden = |C ∩ ∪_threads (K \\ B)| / |C|.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fivefold.clock import DeviceClock, Mark
from fivefold.distributed.comm import CommLog
from fivefold.ops import call_in_backward, in_backward, unwatch_recompute, watch_recompute

__all__ = [
    "COMPUTE_LANE",
    "Interval",
    "StepTracer",
    "hidden_summary",
    "intersect",
    "length",
    "overlap",
    "subtract",
    "trace_window",
    "union",
]

Interval = tuple[int, int]
COMPUTE_LANE = "compute"
SIDE_LANE = "compute (side thread)"
PIPELINE_LANE = "pipeline"
STEP_LANE = "step"


# --------------------------------------------------------------------------------------------------
# Interval arithmetic on half-open [start, end) intervals of ints (ns)


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (empty ones dropped)."""
    out: list[list[int]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[Interval]) -> int:
    return sum(e - s for s, e in union(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The points in both `a` and `b`."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """The points in `a` and not in `b`."""
    out: list[Interval] = []
    b = union(b)
    for s, e in union(a):
        for bs, be in b:
            if be <= s or bs >= e:
                continue
            if bs > s:
                out.append((s, bs))
            s = max(s, be)
            if s >= e:
                break
        if s < e:
            out.append((s, e))
    return out


def overlap(
    comm: Iterable[Interval], compute: dict[str, list[Interval]], blocked: dict[str, list[Interval]]
) -> tuple[int, int]:
    """(communication time, the part of it hidden): |C| and |C ∩ ∪_lane (compute[lane] \\
    blocked[lane])|."""
    busy = union(
        iv for lane, spans in compute.items() for iv in subtract(spans, blocked.get(lane, []))
    )
    c = union(comm)
    return length(c), length(intersect(c, busy))


def trace_window(start: int, steps: int, trace_steps: int, exit_after: int = 0) -> range:
    """The steps a run traces: its last ``trace_steps`` (steady state: the first step also records
    ZeRO-3's orders and allocates the optimizer state), the end being where this invocation stops
    (``run.exit_after``)."""
    end = min(steps, start + exit_after) if exit_after > 0 else steps
    return range(max(start, end - trace_steps), end)


# --------------------------------------------------------------------------------------------------
# The tracer


class StepTracer:
    """Records this rank's traced steps (see the module docstring). ``modules``: (name, module)
    pairs, none inside another; ``side_threads``: names of threads whose compute goes to a second
    lane (a pipeline's overlapped forward). Hooks are installed here and removed by `close`; outside
    `begin_step`/`end_step` they only check a flag, and without a tracer there are none."""

    def __init__(
        self,
        modules: Sequence[tuple[str, nn.Module]],
        log: CommLog,
        device: torch.device | str,
        rank: int = 0,
        coords: dict[str, int] | None = None,
        side_threads: Sequence[str] = (),
    ) -> None:
        self.clock = DeviceClock(device)
        self.log = log
        self.rank, self.coords = rank, dict(coords or {})
        self.side_threads = frozenset(side_threads)
        self.active = False
        self.steps: list[dict[str, Any]] = []
        self._handles: list[Any] = []
        self._lock = threading.Lock()  # an overlapped forward records from a second thread
        for name, module in modules:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward(name)))
            self._handles.append(
                module.register_forward_hook(self._post_forward(name), prepend=True)
            )

    # -- recording ---------------------------------------------------------------------------------
    def _lane(self) -> str:
        return SIDE_LANE if threading.current_thread().name in self.side_threads else COMPUTE_LANE

    def _span(self, name: str, cat: str, start: Mark, end: Mark, lane: str | None = None) -> None:
        with self._lock:
            self._spans.append((lane or self._lane(), name, cat, start, end))

    def _mark(self) -> Mark:
        self.log.poll()  # a p2p work without a completion callback is stamped when found done
        return self.clock.mark()

    def _pre_forward(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> Any:
            if not self.active:
                return None
            key = (threading.get_ident(), name)
            if (
                in_backward()
            ):  # the module's forward run again in backward (recompute around the module)
                self._open[(key, "recompute")] = self._mark()
                return None
            self._open[(key, "forward")] = self._mark()
            self._tokens[key] = watch_recompute(lambda starting: self._recomputing(name, starting))
            if not torch.is_grad_enabled():
                return None
            wrapped = call_in_backward(args, lambda: self._backward_end(name))
            self._has_backward[key] = wrapped is not None
            return wrapped

        return hook

    def _post_forward(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not self.active:
                return None
            key = (threading.get_ident(), name)
            if in_backward():
                start = self._open.pop((key, "recompute"), None)
                if start is not None:
                    self._span(name, "recompute", start, self._mark())
                return None
            start = self._open.pop((key, "forward"), None)
            if start is None:  # the step began inside this forward
                return None
            self._span(name, "forward", start, self._mark())
            token = self._tokens.pop(key, None)
            if token is not None:
                unwatch_recompute(token)
            if not self._has_backward.pop(key, False):
                return None
            return call_in_backward(output, lambda: self._backward_start(name))

        return hook

    def _backward_start(self, name: str) -> None:
        if self.active:
            self._open[(threading.get_ident(), name, "backward")] = self._mark()

    def _backward_end(self, name: str) -> None:
        if self.active:
            start = self._open.pop((threading.get_ident(), name, "backward"), None)
            if start is not None:
                self._span(name, "backward", start, self._mark())

    def _recomputing(self, name: str, starting: bool) -> None:
        if not self.active:
            return
        key = (threading.get_ident(), name, "recompute")
        if starting:
            self._open[key] = self._mark()
        else:
            start = self._open.pop(key, None)
            if start is not None:
                self._span(name, "recompute", start, self._mark())

    # -- steps -------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Trace from here: hooks record, and the log times every collective."""
        self._step = step
        self._spans: list[tuple[str, str, str, Mark, Mark]] = []
        self._open: dict[Any, Mark] = {}
        self._tokens: dict[Any, Any] = {}
        self._has_backward: dict[Any, bool] = {}
        self._first_seq = self.log.next_seq()  # records of this step come after this tick
        self._origin = self.clock.mark()
        self._origin_wall_ns = time.time_ns()
        self.log.clock = self.clock
        self.active = True

    def end_step(
        self, pipeline_marks: Sequence[tuple[str, int, int, Mark, Mark, str]] = ()
    ) -> dict[str, Any]:
        """Stop tracing; turn the step's marks into events (waits for the device once on an
        accelerator) and its hidden-communication figures. ``pipeline_marks``: the runtime's actions
        (`ActionClock.marks`)."""
        self.log.poll()
        end = self.clock.mark()
        self.active = False
        # (a forward that raised left its recompute watcher set: it is idle while inactive)
        self.log.clock = None
        timed = [r for r in self.log.records if r.timing is not None and r.seq > self._first_seq]
        marks: list[Mark] = [end]
        for _, _, _, s, e in self._spans:
            marks += [s, e]
        for r in timed:
            t = r.timing
            marks += [
                t.start,
                t.end if t.end is not None else end,
                t.wait_start if t.wait_start is not None else t.start,
                t.wait_end if t.wait_end is not None else t.start,
            ]
        for _, _, _, s, e, _ in pipeline_marks:
            marks += [s, e]
        at = iter([self._origin_wall_ns + ns for ns in self.clock.elapsed_ns(self._origin, marks)])
        step_end = next(at)
        step, events = self._step, []
        compute: dict[str, list[Interval]] = {}
        blocked: dict[str, list[Interval]] = {}
        comm: list[Interval] = []
        events.append(
            dict(
                lane=STEP_LANE,
                name=f"step {step}",
                cat="step",
                start=self._origin_wall_ns,
                end=step_end,
                args={"step": step},
            )
        )
        for lane, name, cat, _, _ in self._spans:
            s, e = next(at), next(at)
            events.append(dict(lane=lane, name=name, cat=cat, start=s, end=e, args={"step": step}))
            compute.setdefault(lane, []).append((s, e))
        for r in timed:
            s, e, ws, we = next(at), next(at), next(at), next(at)
            args = {
                "step": step,
                "op": r.op,
                "dim": r.dim,
                "tag": r.tag,
                "bytes": r.payload_bytes,
                "wire_bytes": r.wire_bytes,
                "numel": r.numel,
                "dtype": str(r.dtype).replace("torch.", ""),
                "group_size": r.group_size,
                "seq": r.seq,
                "completed": r.timing.end is not None,
            }
            events.append(
                dict(
                    lane=f"comm {r.dim}",
                    name=f"{r.op} {r.tag}".strip(),
                    cat="collective",
                    start=s,
                    end=e,
                    args=args,
                )
            )
            comm.append((s, e))
            if r.timing.wait_start is not None and we > ws:
                lane = SIDE_LANE if r.timing.waiter in self.side_threads else COMPUTE_LANE
                events.append(
                    dict(
                        lane=lane,
                        name=f"wait {r.op} {r.dim} {r.tag}".strip(),
                        cat="wait",
                        start=ws,
                        end=we,
                        args={"step": step, "seq": r.seq},
                    )
                )
                blocked.setdefault(lane, []).append((ws, we))
        for kind, mb, stage, _, _, thread in pipeline_marks:
            s, e = next(at), next(at)
            events.append(
                dict(
                    lane=PIPELINE_LANE,
                    name=f"{kind}{mb}@s{stage}",
                    cat="pipeline",
                    start=s,
                    end=e,
                    args={"step": step, "kind": kind, "microbatch": mb, "stage": stage},
                )
            )
            compute.setdefault(
                SIDE_LANE if thread in self.side_threads else COMPUTE_LANE, []
            ).append((s, e))
        comm_ns, hidden_ns = overlap(comm, compute, blocked)
        record = {
            "step": step,
            "start": self._origin_wall_ns,
            "end": step_end,
            "events": events,
            "comm_ns": comm_ns,
            "hidden_ns": hidden_ns,
        }
        self.steps.append(record)
        return record

    def result(self) -> dict[str, Any]:
        """What this rank hands to rank 0: its coordinates, clock and traced steps (plain data)."""
        return {
            "rank": self.rank,
            "coords": self.coords,
            "steps": self.steps,
            "clock": "device events" if self.clock.device_events else "host perf_counter",
        }

    def close(self) -> None:
        """Remove every hook (the log stops timing)."""
        self.active = False
        self.log.clock = None
        for h in self._handles:
            h.remove()
        self._handles.clear()


def hidden_summary(ranks: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's figures from every rank's `StepTracer.result`: per rank the share of its
    communication time hidden behind compute over its traced steps; their mean, min and max;
    communication and exposed (not hidden) communication per step, averaged over ranks. None if no
    rank communicated in a traced step."""
    per_rank: list[float | None] = []
    comm_ms, exposed_ms = [], []
    for r in ranks:
        steps = r["steps"]
        comm = sum(s["comm_ns"] for s in steps)
        hidden = sum(s["hidden_ns"] for s in steps)
        per_rank.append(hidden / comm if comm > 0 else None)
        if steps:
            comm_ms.append(comm / len(steps) / 1e6)
            exposed_ms.append((comm - hidden) / len(steps) / 1e6)
    known = [f for f in per_rank if f is not None]
    if not known:
        return None
    return {
        "comm_hidden_fraction": sum(known) / len(known),
        "comm_hidden_min": min(known),
        "comm_hidden_max": max(known),
        "comm_hidden_per_rank": per_rank,
        "comm_ms_per_step": sum(comm_ms) / len(comm_ms),
        "exposed_comm_ms_per_step": sum(exposed_ms) / len(exposed_ms),
        "traced_steps": sorted({s["step"] for r in ranks for s in r["steps"]}),
    }
