"""Timing model of pipeline schedules: simulated (or measured) timelines, bubble, activations in
flight.

A `Timeline` is only per-rank ``(kind, microbatch, stage, start, end)`` records, reused for measured
steps. Tests check `formulas.bubble_formula` exactly: GPipe and 1F1B for any constant F and B,
interleaved when a chunk costs 1/V of a rank's F and B, ZB-H1 with F = I = W.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from fivefold.formulas import (
    bubble_formula,
)  # re-exported: the textbook formula next to its simulation
from fivefold.pipeline.actions import (
    BACKWARD_KINDS,
    COMPUTE_KINDS,
    Action,
    B,
    DeadlockError,
    F,
    I,
    Schedule,
    W,
    channel,
    steps,
)
from fivefold.pipeline.checks import play_until_stuck

__all__ = ["DEFAULT_COSTS", "OVERLAPPED", "Event", "Timeline", "simulate", "bubble_formula"]

DEFAULT_COSTS: dict[str, float] = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}
OVERLAPPED = "F&B"  # the cost key of an overlapped (forward, backward) unit, as DeepSeek writes it


class Event(NamedTuple):
    """One timed action on one rank: an action kind or a runtime label (e.g. ``"RECV_F"`` for a
    wait)."""

    kind: str
    microbatch: int
    stage: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage} [{self.start:g}, {self.end:g}]"


class Timeline:
    """Per-rank timed events of one pipeline step, from ``(kind, microbatch, stage, start, end)``
    tuples, `Event` s or ``(Action, start, end)`` in execution order, in any time unit. Only F, B,
    I, W count as busy."""

    def __init__(self, records: Sequence[Iterable], name: str = "", n_virtual: int = 1):
        self.name = name
        self.n_virtual = n_virtual
        self.events: list[list[Event]] = []
        for rank_records in records:
            evs = []
            for rec in rank_records:
                rec = tuple(rec)
                if len(rec) == 3 and isinstance(rec[0], Action):
                    a, start, end = rec
                    rec = (a.kind, a.microbatch, a.stage, start, end)
                kind, mb, stage, start, end = rec
                if end < start:
                    raise ValueError(
                        f"event {kind}{mb}@s{stage} ends ({end}) before it starts ({start})"
                    )
                evs.append(Event(str(kind), int(mb), int(stage), float(start), float(end)))
            self.events.append(evs)

    @property
    def n_ranks(self) -> int:
        return len(self.events)

    @property
    def start(self) -> float:
        return min((e.start for evs in self.events for e in evs), default=0.0)

    @property
    def end(self) -> float:
        return max((e.end for evs in self.events for e in evs), default=0.0)

    @property
    def makespan(self) -> float:
        """First start to last end, over all ranks."""
        return self.end - self.start

    def busy(self, rank: int) -> float:
        """Time ``rank`` spends computing: the union of its compute intervals (an overlapped F and B
        count once)."""
        total, reach = 0.0, float("-inf")
        for e in sorted((e for e in self.events[rank] if e.is_compute), key=lambda e: e.start):
            if e.end > reach:
                total += e.end - max(e.start, reach)
                reach = e.end
        return total

    def lanes(self, rank: int) -> list[int]:
        """A lane per event of ``rank`` (aligned with ``events[rank]``) so that events in one lane
        never overlap: 0 for all of a sequential rank, 1 for the second of two passes that ran side
        by side (for drawing)."""
        ends: list[float] = []  # per lane, when its last event ends
        out = [0] * len(self.events[rank])
        for i in sorted(range(len(out)), key=lambda i: self.events[rank][i].start):
            e = self.events[rank][i]
            lane = next((k for k, end in enumerate(ends) if end <= e.start), len(ends))
            if lane == len(ends):
                ends.append(e.end)
            ends[lane] = e.end
            out[i] = lane
        return out

    def overlapped(self, rank: int) -> list[tuple[Event, Event]]:
        """Pairs of ``rank``'s compute events that ran at the same time (DualPipe's F&B units), in
        time order."""
        evs = sorted((e for e in self.events[rank] if e.is_compute), key=lambda e: e.start)
        return [
            (a, b)
            for i, a in enumerate(evs)
            for b in evs[i + 1 :]
            if b.start < a.end and a.start < b.end
        ]

    @property
    def bubble_fraction(self) -> float:
        """1 - (total busy time) / (P · makespan): the share of rank-time spent idle."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.n_ranks)) / (self.n_ranks * self.makespan)

    @property
    def peak_in_flight(self) -> list[int]:
        """Per rank, the most (stage, micro-batch) activations alive at once: an F stores one from
        its start, a B or W frees it at its end (not I: the weight gradient still needs the inputs),
        a free first on a tie. So a forward run beside a backward counts with the activation that
        backward is still using. With V > 1 a unit is one chunk's activations."""
        peaks = []
        for evs in self.events:
            changes = sorted(
                [(e.start, 1, +1) for e in evs if e.kind == F]
                + [(e.end, 0, -1) for e in evs if e.kind in (B, W)]
            )
            alive = peak = 0
            for _, _, delta in changes:
                alive += delta
                peak = max(peak, alive)
            peaks.append(peak)
        return peaks

    def __repr__(self) -> str:
        return (
            f"Timeline({self.name!r}, ranks={self.n_ranks}, makespan={self.makespan:g}, "
            f"bubble={self.bubble_fraction:.4f}, peak_in_flight={self.peak_in_flight})"
        )


def simulate(
    schedule: Schedule,
    costs: Mapping[str, float] | Callable[[Action], float] | None = None,
    comm_cost: float = 0.0,
) -> Timeline:
    """Event-driven play of ``schedule`` with ``costs`` per action kind (or a function of the
    `Action`): an action starts when its rank is free and its input exists (+ ``comm_cost`` across
    ranks); lowered batches wait for their receives as in the runtime. Raises `DeadlockError` if the
    lists can never finish.

    An overlapped unit (`Schedule.side_by_side`: a forward and the backward after it) takes
    ``costs["F&B"]``, DeepSeek's notation, with both events spanning it; without that key (or with
    callable costs) the two run one after the other, F then B, as they do in a runtime that does not
    overlap them."""
    if costs is None:
        costs = DEFAULT_COSTS
    cost_of = costs if callable(costs) else (lambda a: costs[a.kind])
    unit_cost = None if callable(costs) else costs.get(OVERLAPPED)
    S = schedule.n_stages
    rank_of = schedule.stage_to_rank
    plans = [steps(acts) for acts in schedule.actions]  # computes, and batches of communication
    P = len(plans)
    done: dict[
        tuple[str, int, int], float
    ] = {}  # (kind, m, s) -> end time; B and I share the key "BW"
    sent_at: dict[tuple, float] = {}  # message channel -> time its send was issued
    pc = [0] * P
    free = [0.0] * P
    records: list[list[Event]] = [[] for _ in range(P)]

    def ready_time(a: Action) -> float | None:
        m, s = a.microbatch, a.stage
        if a.kind == F:
            if s == 0:
                return 0.0
            dep, dep_stage = (F, m, s - 1), s - 1
        elif a.kind in BACKWARD_KINDS:
            dep, dep_stage = ((F, m, s), s) if s == S - 1 else (("BW", m, s + 1), s + 1)
        else:  # W
            dep, dep_stage = (("BW", m, s), s)
        if dep not in done:
            return None
        return done[dep] + (comm_cost if rank_of[dep_stage] != rank_of[s] else 0.0)

    def advance(r: int) -> bool:
        """Run rank r's next step (a compute, or a batch of communication); False if it must
        wait."""
        step = plans[r][pc[r]]
        if not isinstance(step, Action):
            for c in step:
                if c.kind.startswith("SEND"):
                    sent_at.setdefault(channel(r, c), free[r])
            arrivals = [sent_at.get(channel(r, c)) for c in step if c.kind.startswith("RECV")]
            if any(t is None for t in arrivals):
                return False
            free[r] = max([free[r]] + [t + comm_cost for t in arrivals])
            pc[r] += 1
            return True
        nxt = plans[r][pc[r] + 1] if pc[r] + 1 < len(plans[r]) else None
        unit = (
            [step, nxt]
            if isinstance(nxt, Action) and schedule.runs_beside_forward(r, nxt)
            else [step]
        )
        ready = [ready_time(a) for a in unit]
        if any(t is None for t in ready):
            return False
        if len(unit) == 2 and unit_cost is not None:  # side by side: both span the unit
            start = max(free[r], *ready)
            spans = [(start, start + float(unit_cost))] * 2
        else:  # one after the other
            spans, at = [], free[r]
            for a, t in zip(unit, ready):
                begin = max(at, t)
                at = begin + float(cost_of(a))
                spans.append((begin, at))
        for a, (start, end_time) in zip(unit, spans):
            done[("BW" if a.kind in BACKWARD_KINDS else a.kind, a.microbatch, a.stage)] = end_time
            records[r].append(Event(a.kind, a.microbatch, a.stage, start, end_time))
        free[r] = spans[-1][1]
        pc[r] += len(unit)
        return True

    stuck = [f"rank {r} waits at {plans[r][pc[r]]}" for r in play_until_stuck(plans, pc, advance)]
    if stuck:
        raise DeadlockError(
            f"{schedule.name!r} cannot finish: its orders contradict the data dependencies; "
            + "; ".join(stuck)
        )
    return Timeline(records, name=schedule.name, n_virtual=schedule.n_virtual)
