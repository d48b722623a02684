"""Schedule builders: one function per pipeline schedule, ``(P, M, V) -> Schedule`` (compute actions
only; `lowering.lower` adds the communication). A new schedule is one more builder here and one
entry in `SCHEDULES`.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from collections.abc import Callable

from fivefold.pipeline.actions import (
    Action,
    B,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
)
from fivefold.pipeline.lowering import transfers

__all__ = [
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zero_bubble_h1",
    "dualpipe_v",
    "forward_only",
    "SCHEDULES",
    "build_schedule",
]


def _check_sizes(name: str, P: int, M: int, V: int = 1) -> None:
    for label, value in (
        ("P (pipeline ranks)", P),
        ("M (micro-batches)", M),
        ("V (virtual stages per rank)", V),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")


# Why each schedule needs M >= P micro-batches (`_check_m_ge_p`).
_WHY_M_GE_P = {
    "gpipe": "with fewer the pipeline never fills (no moment has every stage busy) and the bubble "
    "(P-1)/(M+P-1) is at least 50%",
    "1f1b": "with fewer, the first stage runs out of forwards before the first backward returns",
    "interleaved": "micro-batches enter each model chunk in groups of P, and with fewer the first "
    "chunk's group is incomplete before the second chunk starts",
    "zb-h1": "with fewer, the first stage runs out of forwards before the first input-gradient "
    "pass returns",
}


def _check_m_ge_p(name: str, P: int, M: int) -> None:
    if M < P:
        raise ValueError(
            f"{name} needs at least as many micro-batches as stages (M={M} < P={P}): "
            f"{_WHY_M_GE_P[name]}; use M >= P"
        )


def _plain_placement(P: int) -> list[int]:
    return list(range(P))


def _check_one_stage_per_rank(name: str, P: int, M: int, V: int) -> None:
    """The checks of a schedule with one stage per rank: the sizes, V == 1, M >= P."""
    _check_sizes(name, P, M, V)
    if V != 1:
        raise ValueError(
            f"schedule {name!r} has one stage per rank (V=1), got V={V}; only 'interleaved' takes "
            "V > 1"
        )
    _check_m_ge_p(name, P, M)


def _warmed_up(
    name: str, P: int, M: int, V: int, after_warmup: Callable[[int, int], list[Action]]
) -> Schedule:
    """A schedule with one stage per rank in which rank r first runs the P-1-r forwards that fill
    the pipeline below it (1F1B's warm-up), then ``after_warmup(r, n_warmup)``."""
    _check_one_stage_per_rank(name, P, M, V)
    actions = []
    for r in range(P):
        n_warmup = P - 1 - r
        warmup = [Action(F, m, r) for m in range(n_warmup)]
        actions.append(warmup + after_warmup(r, n_warmup))
    return Schedule(name, P, M, 1, _plain_placement(P), actions)


def gpipe(P: int, M: int, V: int = 1) -> Schedule:
    """GPipe (Huang et al. 2019; docs/design.md#pipeline-schedules): all M forwards, then all M
    backwards in reverse order (the stack order of the stored activations). Every rank holds M
    micro-batches at the turn; bubble (P-1)/(M+P-1)."""
    name = "gpipe"
    _check_one_stage_per_rank(name, P, M, V)
    actions = [
        [Action(F, m, r) for m in range(M)] + [Action(B, m, r) for m in reversed(range(M))]
        for r in range(P)
    ]
    return Schedule(name, P, M, 1, _plain_placement(P), actions)


def one_f_one_b(P: int, M: int, V: int = 1) -> Schedule:
    """1F1B (PipeDream-flush / Megatron): rank r warms up with P-1-r forwards, then runs (F, B)
    pairs, then the last P-1-r backwards. Rank r holds at most P-r micro-batches; bubble as
    GPipe."""

    def after_warmup(r: int, n_warmup: int) -> list[Action]:
        acts: list[Action] = []
        for i in range(M - n_warmup):
            acts += [Action(F, n_warmup + i, r), Action(B, i, r)]
        return acts + [Action(B, i, r) for i in range(M - n_warmup, M)]

    return _warmed_up("1f1b", P, M, V, after_warmup)


def interleaved_1f1b(P: int, M: int, V: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. SC 2021): rank r holds chunks r, P + r, ...;
    micro-batches pass them in groups of P (M % P == 0, as in Megatron). Warm-up
    ``2·(P-1-r) + (V-1)·P`` forwards, also for M == P (Megatron runs all forwards first there: same
    makespan, more memory). Bubble (P-1)/(V·M+P-1)."""
    name = "interleaved"
    _check_sizes(name, P, M, V)
    if V < 2:
        raise ValueError(
            f"{name}: needs V >= 2 virtual stages per rank (got V={V}); V=1 is plain 1F1B, use "
            "'1f1b'"
        )
    _check_m_ge_p(name, P, M)
    if M % P != 0:
        raise ValueError(
            f"{name} needs the number of micro-batches to be a multiple of the pipeline size "
            f"(M={M}, P={P}, M % P = {M % P}), as Megatron requires: micro-batches are processed "
            f"in groups of P per model chunk; use M = {(M // P + 1) * P} or {max(P, M // P * P)}"
        )
    S = P * V
    total = M * V

    def chunk(k: int, forward: bool) -> int:
        c = (k % S) // P
        return c if forward else V - 1 - c

    def microbatch(k: int) -> int:
        return (k // S) * P + k % P

    actions = []
    for r in range(P):

        def fwd(k: int, r: int = r) -> Action:
            return Action(F, microbatch(k), chunk(k, True) * P + r)

        def bwd(k: int, r: int = r) -> Action:
            return Action(B, microbatch(k), chunk(k, False) * P + r)

        n_warmup = min(2 * (P - 1 - r) + (V - 1) * P, total)
        acts = [fwd(k) for k in range(n_warmup)]
        n_steady = total - n_warmup
        for k in range(n_steady):
            acts += [fwd(n_warmup + k), bwd(k)]
        acts += [bwd(k) for k in range(n_steady, total)]
        actions.append(acts)
    # M > P: pair each F with the backward after it when lowering (Megatron's combined step), else
    # sends that block (NCCL) deadlock; M == P: that pairing itself deadlocks, per-action batches
    # are safe
    return Schedule(name, P, M, V, [s % P for s in range(S)], actions, fuse_forward_backward=M > P)


def zero_bubble_h1(P: int, M: int, V: int = 1) -> Schedule:
    """ZB-H1 ("Zero Bubble Pipeline Parallelism", Qi et al. 2023, §3.1): 1F1B with B split into I
    (critical path) and W, deferred: rank r runs W(i) after I(i + r), filling 1F1B's cool-down; with
    F = I = W the bubble shrinks to (P-1)/(3M+P-1). Activations live F to W: at most P micro-batches
    per rank (1F1B's peak, "same peak memory")."""

    def after_warmup(r: int, n_warmup: int) -> list[Action]:
        acts: list[Action] = []
        n_w = 0  # weight-gradient passes emitted so far (in micro-batch order)
        for i in range(M):
            if i < M - n_warmup:  # steady state: forward of the next micro-batch first
                acts.append(Action(F, n_warmup + i, r))
            acts.append(Action(I, i, r))
            while n_w <= i - r:  # W of micro-batch i - r: r micro-batches behind the I's
                acts.append(Action(W, n_w, r))
                n_w += 1
        return acts + [Action(W, m, r) for m in range(n_w, M)]  # flush the last r

    return _warmed_up("zb-h1", P, M, V, after_warmup)


def dualpipe_v(P: int, M: int, V: int = 2) -> Schedule:
    """DualPipeV (DeepSeek's single-copy, V-shaped DualPipe; torch's ``ScheduleDualPipeV``): 2P
    stages, rank r holds stage r (chunk 0, going down) and stage 2P-1-r (chunk 1, coming back up),
    so the first and the last stage share rank 0 and stages P-1, P meet on the last rank without
    communication. Per rank, in DeepSeek's eight phases: 2(P-1-r) chunk-0 forwards; r+1 pairs (F0,
    F1); P-1-r (I1, W1, F1), zero-bubble; the main phase of (F0, B1), (F1, B0) pairs — one
    micro-batch's forward beside another's backward, DualPipe's overlap unit; P-1-r (B1, F1, B0);
    r+1 (B1, B0), the later half split into I + W; P-1-r (W, I0); the r+1 W left. Deferred weight
    passes run in the order their I ran. Needs M >= 2P."""
    name = "dualpipev"
    _check_sizes(name, P, M, V)
    if V not in (1, 2):
        raise ValueError(f"{name}: every rank holds exactly two stages (V=2), got V={V}")
    if M < 2 * P:
        raise ValueError(
            f"{name} needs at least twice as many micro-batches as pipeline ranks (M={M} < "
            f"2P={2 * P}): the main phase pairs one micro-batch's forward with another's backward; "
            f"use M >= {2 * P}"
        )
    frame = Schedule(name, P, M, 2, list(range(P)) + list(reversed(range(P))), [[]] * P)
    ranks = [_dualpipe_v_rank(frame, r) for r in range(P)]
    return dataclasses.replace(
        frame,
        actions=[k.acts for k in ranks],
        is_lowered=True,
        side_by_side=[frozenset(k.overlapped) for k in ranks],
    )


class _DualPipeVRank:
    """One rank's lowered DualPipeV list, written the way DeepSeek's reference posts its messages:
    receives and sends gather in a pending batch that is issued (`commit`) right before the next
    compute, some receives posted one unit early and some sends held back a unit. Messages between
    two ranks must pair in posting order (NCCL), and this order is what makes them pair; the generic
    `lower` would not."""

    def __init__(self, frame: Schedule, r: int) -> None:
        self.frame, self.r = frame, r  # frame: the placement the messages follow
        self.stage = (r, 2 * frame.n_ranks - 1 - r)
        self.acts: list[Action] = []
        self.pending: list[Action] = []
        # computes and messages so far, by chunk: the next micro-batch
        self.count: Counter[object] = Counter()
        # backwards of the (F, B) units, run beside their forward
        self.overlapped: set[Action] = set()
        # (micro-batch, stage) of I's whose W is still to run
        self.deferred: deque[tuple[int, int]] = deque()

    def _next(self, key: object) -> int:
        self.count[key] += 1
        return self.count[key] - 1

    def _comm(self, compute: str, phase: int, receive: bool) -> None:
        """Post the next message that a ``compute`` at ``phase``'s stage receives (or sends), if
        there is one: the neighbouring stage exists and lives on another rank (`transfers`; the
        first stage has no input, the loss stage no output, and on the last rank the two chunks meet
        locally)."""
        key = (compute, phase, receive)
        probe = Action(compute, self.count[key], self.stage[phase])
        messages = transfers(self.frame, self.r, probe)[0 if receive else 1]
        if messages:
            self._next(key)
            self.pending += messages

    def recv_forward(self, phase: int) -> None:
        self._comm(F, phase, receive=True)

    def send_forward(self, phase: int) -> None:
        self._comm(F, phase, receive=False)

    def recv_backward(self, phase: int) -> None:
        self._comm(B, phase, receive=True)

    def send_backward(self, phase: int) -> None:
        self._comm(B, phase, receive=False)

    def commit(self) -> None:
        self.acts += self.pending
        self.pending = []

    def forward(self, phase: int, recv: bool = True, send: bool = True) -> None:
        if recv:
            self.recv_forward(phase)
        self.commit()
        self.acts.append(Action(F, self._next(f"F{phase}"), self.stage[phase]))
        if send:
            self.send_forward(phase)

    def backward(
        self, phase: int, zero_bubble: bool = False, recv: bool = True, send: bool = True
    ) -> None:
        if recv:
            self.recv_backward(phase)
        self.commit()
        m = self._next(f"B{phase}")
        self.acts.append(Action(I if zero_bubble else B, m, self.stage[phase]))
        if zero_bubble:
            self.deferred.append((m, self.stage[phase]))
        if send:
            self.send_backward(phase)

    def forward_backward(self, phase0: int, phase1: int, recv0: bool = True) -> None:
        """DualPipe's overlap unit: one micro-batch's forward beside another's backward
        (`Schedule.side_by_side`; their messages travel together, before and after the unit)."""
        if recv0:
            self.recv_forward(phase0)
        self.recv_backward(phase1)
        self.commit()
        self.acts.append(Action(F, self._next(f"F{phase0}"), self.stage[phase0]))
        self.acts.append(Action(B, self._next(f"B{phase1}"), self.stage[phase1]))
        self.overlapped.add(self.acts[-1])
        self.send_forward(phase0)
        self.send_backward(phase1)

    def weight(self) -> None:
        self.commit()
        m, s = self.deferred.popleft()
        self.acts.append(Action(W, m, s))


def _dualpipe_v_rank(frame: Schedule, r: int) -> _DualPipeVRank:
    """DeepSeek's eight phases for rank r (dualpipev.py), step for step."""
    P, M = frame.n_ranks, frame.n_microbatches
    k = _DualPipeVRank(frame, r)
    last = r == P - 1
    for _ in range(2 * (P - 1 - r)):  # 1: F0
        k.forward(0)
    k.recv_forward(0)  # 2: (F0, F1), F0's input received one unit early, its output sent after F1's
    for i in range(r + 1):
        k.forward(0, recv=False, send=False)
        k.recv_forward(0)
        k.forward(1, send=not last or i < r)
        k.send_forward(0)
    for _ in range(P - 1 - r):  # 3: (I1, W, F1), zero bubble
        k.backward(1, zero_bubble=True)
        k.recv_forward(1)
        k.weight()
        k.forward(1, recv=False)
    for i in range(M - 2 * P + r + 1):  # 4: the main phase, (F0, B1) and (F1, B0) units
        if i == 0 and last:  # the last rank does not overlap these two, to shrink the bubble
            k.forward(0, recv=False, send=False)
            k.send_forward(1)
            k.backward(1, send=False)
            k.send_forward(0)
            k.send_backward(1)
        else:
            k.forward_backward(0, 1, recv0=i > 0)
        k.forward_backward(1, 0)
    for _ in range(P - 1 - r):  # 5: B1, (F1, B0)
        k.backward(1)
        k.forward_backward(1, 0)
    zero_bubble = False
    for i in range(r + 1):  # 6: (B1, B0), the later half split into I + W
        if i == (r + 1) // 2 and r % 2 == 1:
            zero_bubble = True
        k.backward(1, zero_bubble)
        if i == (r + 1) // 2 and r % 2 == 0:
            zero_bubble = True
        k.backward(0, zero_bubble)
    for _ in range(P - 1 - r):  # 7: (W, I0)
        k.weight()
        k.backward(0, zero_bubble=True)
    for _ in range(r + 1):  # 8: the W left
        k.weight()
    k.commit()
    if k.deferred:
        raise ScheduleError(f"dualpipev rank {r}: {len(k.deferred)} weight passes left over")
    return k


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
    "dualpipev": dualpipe_v,
}


def forward_only(P: int, M: int, stage_to_rank: list[int], name: str = "forward-only") -> Schedule:
    """Evaluation: every micro-batch through every stage in model order, no backward (no cycle can
    form)."""
    actions = [
        [
            Action(F, m, s)
            for m in range(M)
            for s in range(len(stage_to_rank))
            if stage_to_rank[s] == r
        ]
        for r in range(P)
    ]
    V = len(stage_to_rank) // P
    return Schedule(name, P, M, V, list(stage_to_rank), actions)


def build_schedule(name: str, P: int, M: int, V: int = 1) -> Schedule:
    """Build schedule ``name`` (a key of `SCHEDULES`) for P ranks, M micro-batches, V chunks per
    rank."""
    try:
        builder = SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}"
        ) from None
    return builder(P, M, V)
