"""Timing model of pipeline schedules: simulated (or measured) timelines, bubble, activations in flight.

`simulate` plays a `Schedule` with a cost per action kind and returns a `Timeline`. A
`Timeline` is only per-rank records ``(kind, microbatch, stage, start, end)``, so the runtime
can build one from wall-clock measurements and reuse the bubble / memory computation; drawing
one (`fivefold.report.plot_timeline`, `to_chrome_trace`) lives with the other pictures.

Dependencies the simulation enforces (each rank runs its compute actions in list order):

- F(m, s) starts after F(m, s-1) ended (+ ``comm_cost`` when s-1 is on another rank);
- B(m, s) / I(m, s) starts after B/I(m, s+1) ended (+ ``comm_cost`` across ranks); on the last
  stage after F(m, s);
- W(m, s) starts after I(m, s).

Exactness of the textbook bubble formulas (`fivefold.formulas.bubble_formula`), checked in the tests:

- GPipe and 1F1B: ``(P-1)/(M+P-1)`` exactly, for *any* constant F and B costs (the warm-up and
  the cool-down each cost P-1 times one stage's F, resp. B; ``comm_cost = 0``).
- Interleaved 1F1B: ``(P-1)/(V·M+P-1)`` exactly when each model chunk costs 1/V of a rank's
  per-micro-batch F and B (any constant chunk costs, e.g. the defaults F=1, B=2 per chunk).
- ZB-H1 with F = I = W = c: ``(P-1)/(3M+P-1)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from fivefold.formulas import bubble_formula  # re-exported: the textbook formula next to its simulation
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

__all__ = ["DEFAULT_COSTS", "Event", "Timeline", "simulate", "bubble_formula"]

DEFAULT_COSTS: dict[str, float] = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}



class Event(NamedTuple):
    """One timed action on one rank. ``kind`` is an action kind (F, B, I, W) or any label the
    runtime records (e.g. ``"RECV_F"`` for time spent waiting on a receive)."""

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
    """Per-rank timed events of one pipeline step.

    ``Timeline(records)`` takes, for every rank, a list of records — ``(kind, microbatch, stage,
    start, end)`` tuples, `Event` s, or ``(Action, start, end)`` — in execution order. Times are
    in any unit (simulation cost units, or seconds when measured). Only compute events (F, B, I,
    W) count as busy time; other labels are drawn in grey and count as idle.
    """

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
                    raise ValueError(f"event {kind}{mb}@s{stage} ends ({end}) before it starts ({start})")
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
        return sum(e.duration for e in self.events[rank] if e.is_compute)

    @property
    def bubble_fraction(self) -> float:
        """1 - (total busy time) / (P · makespan): the share of rank-time spent idle."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.n_ranks)) / (self.n_ranks * self.makespan)

    @property
    def peak_in_flight(self) -> list[int]:
        """Per rank, the most (stage, micro-batch) activations alive at once.

        An F stores one; the pass that last needs them frees it: a full B, or the W of a split
        backward (an I frees nothing — the weight gradient still needs the stored inputs; in real
        code I can free the part only the input gradient used, which this count ignores). With
        V > 1 chunks per rank, each unit is one chunk's activations (1/V of the rank's layers).
        """
        peaks = []
        for evs in self.events:
            alive = peak = 0
            for e in sorted((e for e in evs if e.is_compute), key=lambda e: (e.start, e.end)):
                if e.kind == F:
                    alive += 1
                    peak = max(peak, alive)
                elif e.kind in (B, W):
                    alive -= 1
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
    """Event-driven play of ``schedule``; returns the simulated `Timeline`.

    ``costs`` maps an action kind to its duration (default `DEFAULT_COSTS`: F=1, B=2, I=1, W=1),
    or is a function of the `Action` (e.g. a heavier last stage). Each rank runs its compute
    actions in order; an action starts when its rank is free and its input exists: F(m, s) after
    F(m, s-1), B/I(m, s) after B/I(m, s+1) (on the last stage after F(m, s)), W after I; plus
    ``comm_cost`` when the input comes from another rank.

    A *lowered* schedule is played the way the runtime runs it: a send leaves when its rank
    reaches it (after the compute before it), and a rank at a batch of communication actions waits
    until every receive of the batch has arrived (send time + ``comm_cost``) before the next
    compute. For the plain lowering this changes nothing; a fused (F, backward) unit delays the
    F's output by one backward. Raises `DeadlockError` if the lists can never finish.
    """
    if costs is None:
        costs = DEFAULT_COSTS
    cost_of = costs if callable(costs) else (lambda a: costs[a.kind])
    S = schedule.n_stages
    rank_of = schedule.stage_to_rank
    plans = [steps(acts) for acts in schedule.actions]  # computes, and batches of communication
    P = len(plans)
    done: dict[tuple[str, int, int], float] = {}  # (kind, m, s) -> end time; B and I share the key "BW"
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
        """Run rank r's next step (a compute, or a batch of communication); False if it must wait."""
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
        t = ready_time(step)
        if t is None:
            return False
        start = max(free[r], t)
        end_time = start + float(cost_of(step))
        done[("BW" if step.kind in BACKWARD_KINDS else step.kind, step.microbatch, step.stage)] = end_time
        records[r].append(Event(step.kind, step.microbatch, step.stage, start, end_time))
        free[r] = end_time
        pc[r] += 1
        return True

    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pc[r] < len(plans[r]) and advance(r):
                progress = True
    stuck = [f"rank {r} waits at {plans[r][pc[r]]}" for r in range(P) if pc[r] < len(plans[r])]
    if stuck:
        raise DeadlockError(
            f"{schedule.name!r} cannot finish: its orders contradict the data dependencies; " + "; ".join(stuck)
        )
    return Timeline(records, name=schedule.name, n_virtual=schedule.n_virtual)
