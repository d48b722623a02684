"""Pipeline schedules as data.

A schedule is a pure function of (P ranks, M micro-batches, V virtual stages per rank) that
returns, for every rank, the ordered list of `Action` s that rank executes. One runtime executes
any such list; the simulator (`fivefold.pipeline.simulator`) times it; `validate` and
`check_deadlock_free` prove it complete and executable. Nothing here touches torch.

Stages and ranks
    The model is cut into S = P·V *virtual stages* 0..S-1, in model order. ``stage_to_rank[s]``
    says which rank holds stage s. Plain schedules have V = 1 and stage s on rank s; the
    interleaved schedule places stage v·P + r on rank r (rank r holds chunks r, P + r, 2P + r...),
    so ``stage_to_rank[s] = s % P``.

Action kinds
    Compute (what a schedule builder emits):

    - ``F``  forward of micro-batch m through stage s; stores the stage's activations.
    - ``B``  *full* backward of (m, s): input gradient and weight gradients in one pass
      (GPipe, 1F1B, interleaved 1F1B). Frees the activations of (m, s).
    - ``I``  input-gradient half of the backward (zero-bubble schedules): computes dL/d(input)
      and sends it upstream, so it is on the critical path. The activations still needed for the
      weight gradient stay alive.
    - ``W``  weight-gradient half (zero-bubble): dL/dW for (m, s), off the critical path, placed
      by the schedule to fill bubbles. Frees the activations of (m, s).

    A (m, s) pair is backed-off either by one ``B`` or by one ``I`` followed by one ``W``.

    Communication (inserted by `lower`):

    - ``SEND_F`` / ``RECV_F`` the activation leaving stage s after its F / entering stage s
      before its F; ``SEND_B`` / ``RECV_B`` the gradient w.r.t. a stage's input leaving stage s
      after its B or I / the gradient w.r.t. a stage's output entering stage s before its B or I.

    The ``stage`` of a communication action is always the stage *on this rank* that produces or
    consumes the tensor, and ``peer`` is the other rank. So ``SEND_F(m, s) -> peer`` is matched by
    ``RECV_F(m, s + 1) <- rank_of(s)`` on the peer, and ``SEND_B(m, s)`` by ``RECV_B(m, s - 1)``
    (`Action.counterpart` computes it).

Execution model of a lowered list (what `check_deadlock_free` simulates and the runtime does)
    Each rank walks its list in order. Compute actions run to completion. The communication
    actions between two compute actions form one *batch*, which the runtime issues as one
    ``batch_isend_irecv`` (receives first) and waits on before the next compute. Sends are
    buffered (never block); a receive blocks until its matching send was issued.
    `lower` puts the receive for an action's input right before the action and the send of its
    output right after it, so each batch is "send what I just produced, receive what I need next"
    (Megatron's ``send_forward_recv_backward`` pairing). The stricter *rendezvous* model — a batch
    completes only once every op in it is matched by a posted op on the peer, which is what NCCL
    guarantees — is available as ``check_deadlock_free(..., rendezvous=True)``, and every schedule
    here passes it too: the interleaved schedule with M > P only because `lower` pairs each F with
    the backward right after it, as Megatron does (``Schedule.fuse_forward_backward``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "F",
    "B",
    "I",
    "W",
    "SEND_F",
    "RECV_F",
    "SEND_B",
    "RECV_B",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "Action",
    "Schedule",
    "ScheduleError",
    "DeadlockError",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "zero_bubble_h1",
    "SCHEDULES",
    "build_schedule",
    "lower",
    "validate",
    "check_deadlock_free",
    "iter_steps",
]

F = "F"
B = "B"
I = "I"  # noqa: E741  (the paper's name for the input-gradient pass)
W = "W"
SEND_F = "SEND_F"
RECV_F = "RECV_F"
SEND_B = "SEND_B"
RECV_B = "RECV_B"

COMPUTE_KINDS = (F, B, I, W)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
BACKWARD_KINDS = (B, I)  # the backward passes that consume and produce gradients between stages


class ScheduleError(ValueError):
    """A schedule (or a lowered schedule) is incomplete, out of order or mismatched."""


class DeadlockError(ScheduleError):
    """Executing a lowered schedule would block forever."""


@dataclass(frozen=True)
class Action:
    """One step of a rank's list: ``kind`` of micro-batch ``microbatch`` at virtual stage ``stage``.

    ``peer`` is the other rank of a communication action and None for compute actions.
    """

    kind: str
    microbatch: int
    stage: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS and self.kind not in COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {COMPUTE_KINDS + COMM_KINDS}")
        if self.is_comm != (self.peer is not None):
            raise ValueError(f"{self.kind} needs peer={'a rank' if self.is_comm else 'None'}, got peer={self.peer}")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def counterpart(self, rank: int) -> Action:
        """The action on ``self.peer`` that matches this communication action issued by ``rank``."""
        if self.kind == SEND_F:
            return Action(RECV_F, self.microbatch, self.stage + 1, peer=rank)
        if self.kind == RECV_F:
            return Action(SEND_F, self.microbatch, self.stage - 1, peer=rank)
        if self.kind == SEND_B:
            return Action(RECV_B, self.microbatch, self.stage - 1, peer=rank)
        if self.kind == RECV_B:
            return Action(SEND_B, self.microbatch, self.stage + 1, peer=rank)
        raise ValueError(f"{self} is a compute action; it has no counterpart")

    def __str__(self) -> str:
        s = f"{self.kind}{self.microbatch}@s{self.stage}"
        if self.kind.startswith("SEND"):
            return f"{s}->r{self.peer}"
        if self.kind.startswith("RECV"):
            return f"{s}<-r{self.peer}"
        return s


@dataclass
class Schedule:
    """Per-rank action lists of one pipeline schedule.

    ``actions[r]`` is rank r's list: compute actions only as built by the schedule functions,
    compute + communication after `lower` (``is_lowered``). ``fuse_forward_backward`` asks `lower`
    to treat an F and the backward right after it as one unit with no communication inside.
    """

    name: str
    n_ranks: int
    n_microbatches: int
    n_virtual: int
    stage_to_rank: list[int]
    actions: list[list[Action]]
    is_lowered: bool = False
    fuse_forward_backward: bool = False  # see `lower`

    @property
    def n_stages(self) -> int:
        return len(self.stage_to_rank)

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages rank ``rank`` holds, in model order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    @property
    def split_backward(self) -> bool:
        """True when backward is split into I and W (zero-bubble)."""
        return any(a.kind == I for acts in self.actions for a in acts)

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def lowered(self) -> Schedule:
        return lower(self)

    def format(self) -> str:
        """One line per rank, e.g. ``rank 0: F0@s0 F1@s0 B0@s0 ...`` (handy in error messages)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))


# --------------------------------------------------------------------------------------------
# argument checks


def _check_sizes(name: str, P: int, M: int, V: int = 1) -> None:
    for label, value in (("P (pipeline ranks)", P), ("M (micro-batches)", M), ("V (virtual stages per rank)", V)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {label} must be a positive integer, got {value!r}")


def _check_m_ge_p(name: str, P: int, M: int, why: str) -> None:
    if M < P:
        raise ValueError(
            f"{name} needs at least as many micro-batches as stages (M={M} < P={P}): {why}; use M >= P"
        )


def _plain_placement(P: int) -> list[int]:
    return list(range(P))


# --------------------------------------------------------------------------------------------
# schedules


def gpipe(P: int, M: int) -> Schedule:
    """GPipe (Huang et al. 2019): every rank runs all M forwards, then all M backwards.

    Backwards run in *reverse* micro-batch order (B_{M-1} ... B_0, as in seed 003 §9.2): the last
    stage can start on the micro-batch it has just finished. (Forward order gives the same
    makespan; reverse order is the stack order of the stored activations.) Every rank holds the
    activations of all M micro-batches at the turn. Bubble (P-1)/(M+P-1) for any F and B cost.
    """
    name = "gpipe"
    _check_sizes(name, P, M)
    _check_m_ge_p(
        name,
        P,
        M,
        "with fewer the pipeline never fills (no moment has every stage busy) and the bubble "
        "(P-1)/(M+P-1) is at least 50%",
    )
    actions = [[Action(F, m, r) for m in range(M)] + [Action(B, m, r) for m in reversed(range(M))] for r in range(P)]
    return Schedule(name, P, M, 1, _plain_placement(P), actions)


def one_f_one_b(P: int, M: int) -> Schedule:
    """1F1B (PipeDream-flush / Megatron, seed 003 §9.5).

    Rank r: warm-up of P-1-r forwards; steady state of (F, B) pairs — forward of the next
    micro-batch, then backward of the oldest one; cool-down of the last P-1-r backwards.
    Rank r holds at most P-r micro-batches of activations (P on the first stage). Same bubble as
    GPipe, (P-1)/(M+P-1), for any F and B cost.
    """
    name = "1f1b"
    _check_sizes(name, P, M)
    _check_m_ge_p(
        name,
        P,
        M,
        "with fewer, the first stage runs out of forwards before the first backward returns",
    )
    actions = []
    for r in range(P):
        n_warmup = P - 1 - r
        acts = [Action(F, m, r) for m in range(n_warmup)]
        for i in range(M - n_warmup):
            acts += [Action(F, n_warmup + i, r), Action(B, i, r)]
        acts += [Action(B, i, r) for i in range(M - n_warmup, M)]
        actions.append(acts)
    return Schedule(name, P, M, 1, _plain_placement(P), actions)


def interleaved_1f1b(P: int, M: int, V: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM, Narayanan et al. SC 2021; seed 003 §9.4).

    Rank r holds V model chunks: virtual stages r, P + r, ..., (V-1)·P + r. Micro-batches go
    through the chunks in groups of P: a rank's k-th forward is chunk ``(k mod P·V) // P`` of
    micro-batch ``(k // P·V)·P + k mod P`` (backwards visit the chunks in reverse). Rank r warms up
    with ``2·(P-1-r) + (V-1)·P`` forwards, then alternates forward k+warmup / backward k, then
    cools down — Megatron's ``forward_backward_pipelining_with_interleaving`` (which also, for
    M == P, runs every forward first; this builder uses the general warm-up for M == P too, which
    keeps less memory alive and has the same makespan).

    Bubble (P-1)/(V·M+P-1) when every chunk costs F/V and B/V (each rank runs 1/V of its layers
    per chunk). Megatron requires M to be a multiple of P, and so does this function.
    """
    name = "interleaved"
    _check_sizes(name, P, M, V)
    if V < 2:
        raise ValueError(f"{name}: needs V >= 2 virtual stages per rank (got V={V}); V=1 is plain 1F1B, use '1f1b'")
    _check_m_ge_p(
        name,
        P,
        M,
        "micro-batches enter each model chunk in groups of P, and with fewer the first chunk's group is "
        "incomplete before the second chunk starts",
    )
    if M % P != 0:
        raise ValueError(
            f"{name} needs the number of micro-batches to be a multiple of the pipeline size "
            f"(M={M}, P={P}, M % P = {M % P}), as Megatron requires: micro-batches are processed in groups "
            f"of P per model chunk; use M = {(M // P + 1) * P} or {max(P, M // P * P)}"
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
    # sends that block (NCCL) deadlock; M == P: that pairing itself deadlocks, per-action batches are safe
    return Schedule(name, P, M, V, [s % P for s in range(S)], actions, fuse_forward_backward=M > P)


def zero_bubble_h1(P: int, M: int) -> Schedule:
    """ZB-H1 ("Zero Bubble Pipeline Parallelism", Qi et al. 2023, §3.1).

    The backward is split into I (input gradient, on the critical path: the upstream stage waits
    for it) and W (weight gradient, needed only by the optimizer step). The skeleton is 1F1B with
    B replaced by I — rank r warms up with P-1-r forwards, then runs (F, I) pairs, then the
    remaining I's — and each rank *defers* its W's: rank r runs W of micro-batch i after the I of
    micro-batch i + r, and flushes its r last W's at the end (interleaved with the cool-down I's
    on the first ranks). The later W's fill the cool-down bubbles of 1F1B: with F = I = W the
    makespan drops from 3·(M+P-1) to 3·M + P-1, i.e. the bubble shrinks from (P-1)/(M+P-1) to
    (P-1)/(3M+P-1).

    Memory: activations of (m, s) live from F to W. Rank r then holds at most (P-1-r) + 1 + r = P
    micro-batches — 1F1B's peak on its first stage, so the pipeline's peak activation memory is
    that of 1F1B (the paper's "same peak memory"); ranks r > 0 hold more than 1F1B's P-r.
    """
    name = "zb-h1"
    _check_sizes(name, P, M)
    _check_m_ge_p(
        name,
        P,
        M,
        "with fewer, the first stage runs out of forwards before the first input-gradient pass returns",
    )
    actions = []
    for r in range(P):
        n_warmup = P - 1 - r
        acts = [Action(F, m, r) for m in range(n_warmup)]
        n_w = 0  # weight-gradient passes emitted so far (in micro-batch order)
        for i in range(M):
            if i < M - n_warmup:  # steady state: forward of the next micro-batch first
                acts.append(Action(F, n_warmup + i, r))
            acts.append(Action(I, i, r))
            while n_w <= i - r:  # W of micro-batch i - r: r micro-batches behind the I's
                acts.append(Action(W, n_w, r))
                n_w += 1
        acts += [Action(W, m, r) for m in range(n_w, M)]  # flush the last r
        actions.append(acts)
    return Schedule(name, P, M, 1, _plain_placement(P), actions)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zero_bubble_h1,
}


def forward_only(P: int, M: int, stage_to_rank: list[int], name: str = "forward-only") -> Schedule:
    """Evaluation: every micro-batch through every stage, no backward. Each rank runs its stages in
    model order per micro-batch; dependencies only point to lower stages, so no cycle can form."""
    actions = [[Action(F, m, s) for m in range(M) for s in range(len(stage_to_rank)) if stage_to_rank[s] == r]
               for r in range(P)]
    V = len(stage_to_rank) // P
    return Schedule(name, P, M, V, list(stage_to_rank), actions)


def build_schedule(name: str, P: int, M: int, V: int = 1) -> Schedule:
    """Build schedule ``name`` (a key of `SCHEDULES`) for P ranks, M micro-batches, V chunks per rank."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
    if fn is interleaved_1f1b:
        return fn(P, M, V)
    if V != 1:
        raise ValueError(f"schedule {name!r} has one stage per rank (V=1), got V={V}; only 'interleaved' takes V > 1")
    return fn(P, M)


# --------------------------------------------------------------------------------------------
# lowering: insert SEND / RECV actions


def _transfers(schedule: Schedule, rank: int, a: Action) -> tuple[list[Action], list[Action]]:
    """(receives ``a`` needs before it runs, sends of what it produces) on ``rank``."""
    S, rank_of = schedule.n_stages, schedule.stage_to_rank
    m, s = a.microbatch, a.stage
    recvs: list[Action] = []
    sends: list[Action] = []
    if a.kind == F:
        if s > 0 and rank_of[s - 1] != rank:
            recvs.append(Action(RECV_F, m, s, peer=rank_of[s - 1]))
        if s < S - 1 and rank_of[s + 1] != rank:
            sends.append(Action(SEND_F, m, s, peer=rank_of[s + 1]))
    elif a.kind in BACKWARD_KINDS:
        if s < S - 1 and rank_of[s + 1] != rank:
            recvs.append(Action(RECV_B, m, s, peer=rank_of[s + 1]))
        if s > 0 and rank_of[s - 1] != rank:
            sends.append(Action(SEND_B, m, s, peer=rank_of[s - 1]))
    return recvs, sends


def lower(schedule: Schedule) -> Schedule:
    """Return a copy of ``schedule`` with the communication each rank needs made explicit.

    Before the F of stage s > 0: ``RECV_F`` from the rank of s-1. After the F of stage s < S-1:
    ``SEND_F`` to the rank of s+1. Before a backward (B or I) of stage s < S-1: ``RECV_B`` from
    the rank of s+1. After a backward of stage s > 0: ``SEND_B`` to the rank of s-1. W moves no
    data. When the neighbouring stage lives on the same rank the tensor stays local: no action.
    So each batch between two computes is "send what the last compute produced, receive what the
    next one needs".

    With ``schedule.fuse_forward_backward`` an F directly followed by a backward is one unit with
    no communication inside: the backward's RECV_B joins the F's receives before the F, and the
    F's SEND_F goes out with the backward's SEND_B after it — Megatron's
    ``send_forward_backward_recv_forward_backward`` step. The interleaved schedule needs this
    pairing (for M > P) to stay deadlock-free when sends block (`check_deadlock_free` with
    ``rendezvous=True``, i.e. NCCL semantics).
    """
    if schedule.is_lowered:
        return schedule
    out: list[list[Action]] = []
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if a.is_comm:
                raise ScheduleError(f"rank {rank}: {a} in a schedule not marked lowered")
        lowered: list[Action] = []
        pending_sends: list[Action] = []  # sends of the last unit, issued with the next unit's receives
        for j, a in enumerate(acts):
            recvs, sends = _transfers(schedule, rank, a)
            if schedule.fuse_forward_backward and a.kind in BACKWARD_KINDS and j > 0 and acts[j - 1].kind == F:
                lowered.append(a)  # second half of an (F, backward) unit: its receive went before the F
                pending_sends += sends
                continue
            nxt = acts[j + 1] if j + 1 < len(acts) else None
            if schedule.fuse_forward_backward and a.kind == F and nxt is not None and nxt.kind in BACKWARD_KINDS:
                recvs = recvs + _transfers(schedule, rank, nxt)[0]
            lowered += pending_sends + recvs + [a]
            pending_sends = sends
        lowered += pending_sends
        out.append(lowered)
    return dataclasses.replace(schedule, actions=out, is_lowered=True)


def iter_steps(rank_actions: Sequence[Action]) -> Iterator[Action | list[Action]]:
    """Walk one rank's lowered list as the runtime does: compute actions one by one, and each
    maximal run of communication actions between two computes as one list (one batch)."""
    batch: list[Action] = []
    for a in rank_actions:
        if a.is_comm:
            batch.append(a)
            continue
        if batch:
            yield batch
            batch = []
        yield a
    if batch:
        yield batch


# --------------------------------------------------------------------------------------------
# validation


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` unless ``schedule`` is complete and ordered.

    - shape: one list per rank, ``stage_to_rank`` has P·V entries, every rank in range;
    - completeness: for every micro-batch and virtual stage, exactly one F and either exactly one
      B or exactly one I and one W, all on the rank that holds the stage;
    - order within a rank: F(m, s) before the B / I of (m, s), I(m, s) before W(m, s);
    - lowered schedules: every SEND has exactly one matching RECV on its peer and vice versa (see
      `Action.counterpart`), peers are the ranks holding the neighbouring stages, every compute
      whose input comes from another rank is preceded by its RECV, and every compute whose output
      goes to another rank is followed by its SEND.

    Cross-rank feasibility (could the lists block each other?) is `check_deadlock_free`'s job.
    """
    P, M, S = schedule.n_ranks, schedule.n_microbatches, schedule.n_stages
    errors: list[str] = []
    if len(schedule.actions) != P:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {P} ranks")
    if S != P * schedule.n_virtual:
        raise ScheduleError(f"{schedule.name}: stage_to_rank has {S} entries, expected P·V = {P * schedule.n_virtual}")
    if any(not 0 <= r < P for r in schedule.stage_to_rank):
        raise ScheduleError(f"{schedule.name}: stage_to_rank {schedule.stage_to_rank} names a rank outside 0..{P - 1}")
    rank_of = schedule.stage_to_rank

    where: dict[tuple[str, int, int], list[tuple[int, int]]] = defaultdict(list)  # (kind, m, s) -> [(rank, index)]
    for rank, acts in enumerate(schedule.actions):
        for idx, a in enumerate(acts):
            if not (0 <= a.microbatch < M and 0 <= a.stage < S):
                errors.append(f"rank {rank} step {idx}: {a} is outside micro-batches 0..{M - 1} / stages 0..{S - 1}")
                continue
            if a.is_compute:
                if rank_of[a.stage] != rank:
                    errors.append(f"rank {rank} step {idx}: {a} but stage {a.stage} lives on rank {rank_of[a.stage]}")
                where[(a.kind, a.microbatch, a.stage)].append((rank, idx))
            elif not schedule.is_lowered:
                errors.append(f"rank {rank} step {idx}: {a} in a schedule that is not lowered")

    for s in range(S):
        for m in range(M):
            n = {k: len(where.get((k, m, s), ())) for k in COMPUTE_KINDS}
            label = f"micro-batch {m} stage {s}"
            if n[F] != 1:
                errors.append(f"{label}: {n[F]} forwards (F), expected exactly 1")
            if n[B] == 1 and n[I] == 0 and n[W] == 0:
                pass
            elif n[B] == 0 and n[I] == 1 and n[W] == 1:
                pass
            else:
                errors.append(
                    f"{label}: backward passes B={n[B]} I={n[I]} W={n[W]}; expected one B, or one I and one W"
                )
    if errors:
        raise ScheduleError(_report(schedule.name, "is incomplete", errors))

    # order within a rank
    pos = {key: places[0][1] for key, places in where.items()}
    for (kind, m, s), idx in pos.items():
        rank = rank_of[s]
        if kind in BACKWARD_KINDS and pos[(F, m, s)] > idx:
            errors.append(f"rank {rank}: {kind}{m}@s{s} (step {idx}) before F{m}@s{s} (step {pos[(F, m, s)]})")
        if kind == W and pos[(I, m, s)] > idx:
            errors.append(f"rank {rank}: W{m}@s{s} (step {idx}) before I{m}@s{s} (step {pos[(I, m, s)]})")
    if errors:
        raise ScheduleError(_report(schedule.name, "runs a pass before its input exists", errors))

    if schedule.is_lowered:
        _validate_comm(schedule, errors)
        if errors:
            raise ScheduleError(_report(schedule.name, "has mismatched communication", errors))


def _validate_comm(schedule: Schedule, errors: list[str]) -> None:
    S = schedule.n_stages
    rank_of = schedule.stage_to_rank
    comm_pos: dict[tuple[int, Action], list[int]] = defaultdict(list)  # (rank, action) -> step indices
    compute_pos: dict[tuple[str, int, int], int] = {}
    for rank, acts in enumerate(schedule.actions):
        for idx, a in enumerate(acts):
            if a.is_comm:
                comm_pos[(rank, a)].append(idx)
            else:
                compute_pos[(a.kind, a.microbatch, a.stage)] = idx

    for (rank, a), idxs in comm_pos.items():
        if len(idxs) > 1:
            errors.append(f"rank {rank}: {a} appears {len(idxs)} times (steps {idxs})")
        s = a.stage
        neighbour = {SEND_F: s + 1, RECV_F: s - 1, SEND_B: s - 1, RECV_B: s + 1}[a.kind]
        if not 0 <= neighbour < S:
            errors.append(f"rank {rank}: {a} talks to stage {neighbour}, which does not exist")
            continue
        if rank_of[neighbour] != a.peer:
            errors.append(f"rank {rank}: {a} but stage {neighbour} lives on rank {rank_of[neighbour]}")
            continue
        if rank_of[neighbour] == rank:
            errors.append(f"rank {rank}: {a} although stage {neighbour} is on the same rank (no transfer needed)")
            continue
        if (a.peer, a.counterpart(rank)) not in comm_pos:
            verb = "never received" if a.kind.startswith("SEND") else "never sent"
            errors.append(f"rank {rank}: {a} is {verb}: rank {a.peer} has no {a.counterpart(rank)}")

    # every cross-rank dependency has its RECV before the consumer and its SEND after the producer
    for (kind, m, s), idx in compute_pos.items():
        rank = rank_of[s]
        needs, gives = _transfers(schedule, rank, Action(kind, m, s))
        for c in needs:
            got = comm_pos.get((rank, c))
            if not got:
                errors.append(f"rank {rank}: {kind}{m}@s{s} (step {idx}) has no {c} for its input")
            elif got[0] > idx:
                errors.append(f"rank {rank}: {kind}{m}@s{s} (step {idx}) runs before {c} (step {got[0]})")
        for c in gives:
            got = comm_pos.get((rank, c))
            if not got:
                errors.append(f"rank {rank}: {kind}{m}@s{s} (step {idx}) never sends its output ({c} missing)")
            elif got[0] < idx:
                errors.append(f"rank {rank}: {c} (step {got[0]}) before the {kind}{m}@s{s} that produces it")


def _report(name: str, what: str, errors: list[str], limit: int = 12) -> str:
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    return f"schedule {name!r} {what}:\n  " + "\n  ".join(errors[:limit]) + more


# --------------------------------------------------------------------------------------------
# deadlock check


def _channel(rank: int, a: Action) -> tuple:
    """Identity of the message a communication action sends or receives: (src, dst, kind, m, src stage)."""
    if a.kind.startswith("SEND"):
        return (rank, a.peer, a.kind[-1], a.microbatch, a.stage)
    c = a.counterpart(rank)
    return (a.peer, rank, a.kind[-1], a.microbatch, c.stage)


def check_deadlock_free(schedule: Schedule | Sequence[Sequence[Action]], rendezvous: bool = False) -> None:
    """Execute a lowered schedule's lists symbolically; raise `DeadlockError` if they block forever.

    Model (``rendezvous=False``, the default): each rank runs its list in order; computes and
    sends never block (sends are buffered); a RECV blocks until the matching SEND has been
    executed by the peer. With ``rendezvous=True`` the communication actions between two computes
    form one batch (one ``batch_isend_irecv``): all its ops are posted together and the rank moves
    on only when every one of them is matched by an op the peer has posted — sends block too, as
    with NCCL. Also raises if a rank finishes with a SEND nobody receives.
    """
    lists = [list(acts) for acts in (schedule.actions if isinstance(schedule, Schedule) else schedule)]
    name = schedule.name if isinstance(schedule, Schedule) else "schedule"
    if isinstance(schedule, Schedule) and not schedule.is_lowered:
        raise ScheduleError(f"check_deadlock_free needs a lowered schedule; pass lower(schedule) for {name!r}")
    P = len(lists)
    pc = [0] * P  # index of the next action of each rank
    sent: Counter = Counter()
    received: Counter = Counter()
    posted: set = set()  # rendezvous: (channel, "SEND"/"RECV") of every op posted so far
    issued: set = set()  # buffered: ranks whose current batch's sends are already out

    def batch_end(r: int) -> int:
        j = pc[r]
        while j < len(lists[r]) and lists[r][j].is_comm:
            j += 1
        return j

    def matched(r: int, a: Action) -> bool:
        return (_channel(r, a), "RECV" if a.kind.startswith("SEND") else "SEND") in posted

    def advance(r: int) -> bool:
        """Move rank r past its next action or batch; False if it is blocked."""
        a = lists[r][pc[r]]
        if a.is_compute:
            pc[r] += 1
            return True
        if rendezvous:
            batch = lists[r][pc[r] : batch_end(r)]
            posted.update((_channel(r, b), b.kind[:4]) for b in batch)
            if not all(matched(r, b) for b in batch):
                return False
            for b in batch:
                (sent if b.kind.startswith("SEND") else received)[_channel(r, b)] += 1
            pc[r] += len(batch)
            return True
        # buffered: issuing the batch posts its sends (once); the rank waits until every receive
        # of the batch has its send
        end = batch_end(r)
        batch = lists[r][pc[r] : end]
        if r not in issued:
            issued.add(r)
            for b in batch:
                if b.kind.startswith("SEND"):
                    sent[_channel(r, b)] += 1
        if not all(sent[_channel(r, b)] > received[_channel(r, b)] for b in batch if b.kind.startswith("RECV")):
            return False
        for b in batch:
            if b.kind.startswith("RECV"):
                received[_channel(r, b)] += 1
        issued.discard(r)
        pc[r] = end
        return True

    progress = True
    while progress:
        progress = False
        for r in range(P):
            while pc[r] < len(lists[r]) and advance(r):
                progress = True

    if any(pc[r] < len(lists[r]) for r in range(P)):
        lines = []
        for r in range(P):
            if pc[r] >= len(lists[r]):
                lines.append(f"rank {r}: finished its list")
            elif rendezvous:
                batch = lists[r][pc[r] : batch_end(r)]
                missing = ", ".join(str(b) for b in batch if not matched(r, b))
                lines.append(
                    f"rank {r}: blocked at step {pc[r]} in batch [{' '.join(map(str, batch))}]: "
                    f"no matching op posted for {missing}"
                )
            else:
                batch = lists[r][pc[r] : batch_end(r)]
                waiting = [
                    b for b in batch if b.kind.startswith("RECV") and sent[_channel(r, b)] <= received[_channel(r, b)]
                ]
                lines.append(
                    f"rank {r}: blocked at step {pc[r] + batch.index(waiting[0])} on "
                    + ", ".join(f"{b} (rank {b.peer} has not sent {b.counterpart(r)})" for b in waiting)
                )
        raise DeadlockError(f"{name!r} deadlocks: no rank can make progress\n  " + "\n  ".join(lines))

    leftover = sent - received
    if leftover:
        msgs = [f"rank {src} SEND_{kind}{m}@s{s}->r{dst}" for (src, dst, kind, m, s) in sorted(leftover)]
        raise DeadlockError(
            f"{name!r}: sends never received (the peer has no matching RECV): " + ", ".join(msgs[:12])
        )
