"""Checks of schedules: `validate` (each rank's list complete and ordered, communication matched)
and `check_deadlock_free` (the lists together cannot block and pair their messages in order), the
latter reading lowered lists through `actions.steps` like the runtime and simulator.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from fivefold.pipeline.actions import (
    BACKWARD_KINDS,
    COMPUTE_KINDS,
    Action,
    B,
    DeadlockError,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    channel,
    steps,
)
from fivefold.pipeline.lowering import transfers

__all__ = ["validate", "check_deadlock_free", "play_until_stuck"]


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` unless ``schedule`` is complete (one F and one B, or I and W, per
    micro-batch and stage, on the stage's rank), ordered within each rank, and, if lowered, has
    every SEND matched by its RECV around the right computes. Cross-rank feasibility is
    `check_deadlock_free`'s job."""
    P, M, S = schedule.n_ranks, schedule.n_microbatches, schedule.n_stages
    errors: list[str] = []
    if len(schedule.actions) != P:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {P} ranks")
    if S != P * schedule.n_virtual:
        raise ScheduleError(
            f"{schedule.name}: stage_to_rank has {S} entries, expected P·V = "
            f"{P * schedule.n_virtual}"
        )
    if any(not 0 <= r < P for r in schedule.stage_to_rank):
        raise ScheduleError(
            f"{schedule.name}: stage_to_rank {schedule.stage_to_rank} names a rank outside "
            f"0..{P - 1}"
        )
    rank_of = schedule.stage_to_rank

    where: dict[tuple[str, int, int], list[tuple[int, int]]] = defaultdict(
        list
    )  # (kind, m, s) -> [(rank, index)]
    for rank, acts in enumerate(schedule.actions):
        for idx, a in enumerate(acts):
            if not (0 <= a.microbatch < M and 0 <= a.stage < S):
                errors.append(
                    f"rank {rank} step {idx}: {a} is outside micro-batches 0..{M - 1} / stages "
                    f"0..{S - 1}"
                )
                continue
            if a.is_compute:
                if rank_of[a.stage] != rank:
                    errors.append(
                        f"rank {rank} step {idx}: {a} but stage {a.stage} lives on rank "
                        f"{rank_of[a.stage]}"
                    )
                where[(a.kind, a.microbatch, a.stage)].append((rank, idx))
            elif not schedule.is_lowered:
                errors.append(f"rank {rank} step {idx}: {a} in a schedule that is not lowered")

    forward_only = not any(
        kind != F for kind, _, _ in where
    )  # evaluation: every micro-batch forward only
    for s in range(S):
        for m in range(M):
            n = {k: len(where.get((k, m, s), ())) for k in COMPUTE_KINDS}
            label = f"micro-batch {m} stage {s}"
            if n[F] != 1:
                errors.append(f"{label}: {n[F]} forwards (F), expected exactly 1")
            if (n[B], n[I], n[W]) not in ((1, 0, 0), (0, 1, 1)) and not forward_only:
                errors.append(
                    f"{label}: backward passes B={n[B]} I={n[I]} W={n[W]}; "
                    "expected one B, or one I and one W"
                )
    if errors:
        raise ScheduleError(_report(schedule.name, "is incomplete", errors))

    # order within a rank
    pos = {key: places[0][1] for key, places in where.items()}
    for (kind, m, s), idx in pos.items():
        rank = rank_of[s]
        if kind in BACKWARD_KINDS and pos[(F, m, s)] > idx:
            errors.append(
                f"rank {rank}: {kind}{m}@s{s} (step {idx}) before F{m}@s{s} (step {pos[(F, m, s)]})"
            )
        if kind == W and pos[(I, m, s)] > idx:
            errors.append(
                f"rank {rank}: W{m}@s{s} (step {idx}) before I{m}@s{s} (step {pos[(I, m, s)]})"
            )
    if errors:
        raise ScheduleError(_report(schedule.name, "runs a pass before its input exists", errors))

    _validate_side_by_side(schedule, errors)
    if errors:
        raise ScheduleError(
            _report(schedule.name, "marks an overlapped unit that is not one", errors)
        )

    if schedule.is_lowered:
        _validate_comm(schedule, errors)
        if errors:
            raise ScheduleError(_report(schedule.name, "has mismatched communication", errors))


def _validate_side_by_side(schedule: Schedule, errors: list[str]) -> None:
    """An overlapped unit is a backward (B or I) right after a forward of another micro-batch, no
    message between: the two run at once, so neither may need the other's result."""
    if not schedule.side_by_side:
        return
    if len(schedule.side_by_side) != schedule.n_ranks:
        errors.append(
            f"side_by_side has {len(schedule.side_by_side)} entries for {schedule.n_ranks} ranks"
        )
        return
    for rank, acts in enumerate(schedule.actions):
        marked = set(schedule.side_by_side[rank])
        for idx, a in enumerate(acts):
            if a not in marked:
                continue
            marked.discard(a)
            before = acts[idx - 1] if idx else None
            if a.kind not in BACKWARD_KINDS or before is None or before.kind != F:
                errors.append(
                    f"rank {rank} step {idx}: {a} is marked to run beside a forward, but "
                    f"{'nothing' if before is None else before} comes right before it"
                )
            elif before.microbatch == a.microbatch:
                errors.append(
                    f"rank {rank} step {idx}: {a} beside {before}: one micro-batch's passes cannot "
                    "overlap"
                )
        errors.extend(
            f"rank {rank}: {a} is marked to run beside a forward but is not in its list"
            for a in marked
        )


def _validate_comm(schedule: Schedule, errors: list[str]) -> None:
    S = schedule.n_stages
    rank_of = schedule.stage_to_rank
    comm_pos: dict[tuple[int, Action], list[int]] = defaultdict(
        list
    )  # (rank, action) -> step indices
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
        neighbour = a.counterpart(rank).stage  # the stage it sends to or receives from
        if not 0 <= neighbour < S:
            errors.append(f"rank {rank}: {a} talks to stage {neighbour}, which does not exist")
            continue
        if rank_of[neighbour] != a.peer:
            errors.append(
                f"rank {rank}: {a} but stage {neighbour} lives on rank {rank_of[neighbour]}"
            )
            continue
        if rank_of[neighbour] == rank:
            errors.append(
                f"rank {rank}: {a} although stage {neighbour} is on the same rank (no transfer "
                "needed)"
            )
            continue
        if (a.peer, a.counterpart(rank)) not in comm_pos:
            verb = "never received" if a.kind.startswith("SEND") else "never sent"
            errors.append(f"rank {rank}: {a} is {verb}: rank {a.peer} has no {a.counterpart(rank)}")

    # every cross-rank dependency has its RECV before the consumer and its SEND after the producer
    for (kind, m, s), idx in compute_pos.items():
        rank = rank_of[s]
        needs, gives = transfers(schedule, rank, Action(kind, m, s))
        for c in needs:
            got = comm_pos.get((rank, c))
            if not got:
                errors.append(f"rank {rank}: {kind}{m}@s{s} (step {idx}) has no {c} for its input")
            elif got[0] > idx:
                errors.append(
                    f"rank {rank}: {kind}{m}@s{s} (step {idx}) runs before {c} (step {got[0]})"
                )
        for c in gives:
            got = comm_pos.get((rank, c))
            if not got:
                errors.append(
                    f"rank {rank}: {kind}{m}@s{s} (step {idx}) never sends its output ({c} missing)"
                )
            elif got[0] < idx:
                errors.append(
                    f"rank {rank}: {c} (step {got[0]}) before the {kind}{m}@s{s} that produces it"
                )


def _order_errors(lists: Sequence[Sequence[Action]]) -> list[str]:
    """Point-to-point messages between two ranks match in posting order (no tags: NCCL, and gloo as
    the runtime uses them), so the k-th receive of rank d from rank s must expect the k-th message s
    sends to d."""
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    for r, acts in enumerate(lists):
        for a in acts:
            if a.is_comm:
                (sends[(r, a.peer)] if a.kind.startswith("SEND") else recvs[(a.peer, r)]).append(
                    (a, channel(r, a))
                )
    errors = []
    for (src, dst), sent in sorted(sends.items()):
        for k, ((s_act, s_ch), (r_act, r_ch)) in enumerate(zip(sent, recvs[(src, dst)])):
            if s_ch != r_ch:
                errors.append(
                    f"rank {dst}'s receive #{k} from rank {src} is {r_act} but rank {src}'s "
                    f"message #{k} to rank {dst} is {s_act}: messages between two ranks match in "
                    "posting order"
                )
                break
    return errors


def play_until_stuck(
    plans: Sequence[Sequence], pc: list[int], advance: Callable[[int], bool]
) -> list[int]:
    """Move the ranks in turn, each as far as ``advance(r)`` takes it (it moves ``pc[r]``, the
    index of rank r's next step in ``plans[r]``), until none moves; the ranks left before the end of
    their plan (the deadlock check's and the simulator's common loop)."""
    progress = True
    while progress:
        progress = False
        for r in range(len(plans)):
            while pc[r] < len(plans[r]) and advance(r):
                progress = True
    return [r for r in range(len(plans)) if pc[r] < len(plans[r])]


def _report(name: str, what: str, errors: list[str], limit: int = 12) -> str:
    more = f"\n  ... and {len(errors) - limit} more" if len(errors) > limit else ""
    return f"schedule {name!r} {what}:\n  " + "\n  ".join(errors[:limit]) + more


def check_deadlock_free(
    schedule: Schedule | Sequence[Sequence[Action]], rendezvous: bool = False
) -> None:
    """Execute a lowered schedule's lists symbolically; raise `DeadlockError` if they block forever,
    a SEND is never received, or two ranks post a pair's messages in different orders (they match by
    order on the wire). Default: sends are buffered, a batch waits for its receives;
    ``rendezvous=True`` (NCCL): a batch completes only when every op in it is matched by a posted
    peer op."""
    lists = [
        list(acts) for acts in (schedule.actions if isinstance(schedule, Schedule) else schedule)
    ]
    name = schedule.name if isinstance(schedule, Schedule) else "schedule"
    if isinstance(schedule, Schedule) and not schedule.is_lowered:
        raise ScheduleError(
            f"check_deadlock_free needs a lowered schedule; pass lower(schedule) for {name!r}"
        )
    plans = [steps(acts) for acts in lists]
    starts = [
        _step_starts(plan) for plan in plans
    ]  # index in the action list where each step begins
    P = len(lists)
    pc = [0] * P  # index of the next step of each rank
    sent: Counter = Counter()
    received: Counter = Counter()
    posted: set = set()  # rendezvous: (channel, "SEND"/"RECV") of every op posted so far
    issued: set = set()  # buffered: ranks whose current batch's sends are already out

    def matched(r: int, a: Action) -> bool:
        return (channel(r, a), "RECV" if a.kind.startswith("SEND") else "SEND") in posted

    def unsent(r: int, batch: list[Action]) -> list[Action]:
        return [
            b
            for b in batch
            if b.kind.startswith("RECV") and sent[channel(r, b)] <= received[channel(r, b)]
        ]

    def advance(r: int) -> bool:
        """Move rank r past its next step; False if it is blocked."""
        step = plans[r][pc[r]]
        if isinstance(step, Action):
            pc[r] += 1
            return True
        if rendezvous:
            posted.update((channel(r, b), b.kind[:4]) for b in step)
            if not all(matched(r, b) for b in step):
                return False
            for b in step:
                (sent if b.kind.startswith("SEND") else received)[channel(r, b)] += 1
        else:
            # issuing the batch posts its sends (once); it completes when every receive has its send
            if r not in issued:
                issued.add(r)
                for b in step:
                    if b.kind.startswith("SEND"):
                        sent[channel(r, b)] += 1
            if unsent(r, step):
                return False
            for b in step:
                if b.kind.startswith("RECV"):
                    received[channel(r, b)] += 1
            issued.discard(r)
        pc[r] += 1
        return True

    if play_until_stuck(plans, pc, advance):
        lines = []
        for r in range(P):
            if pc[r] >= len(plans[r]):
                lines.append(f"rank {r}: finished its list")
                continue
            batch, at = plans[r][pc[r]], starts[r][pc[r]]
            if rendezvous:
                missing = ", ".join(str(b) for b in batch if not matched(r, b))
                lines.append(
                    f"rank {r}: blocked at step {at} in batch [{' '.join(map(str, batch))}]: "
                    f"no matching op posted for {missing}"
                )
            else:
                waiting = unsent(r, batch)
                lines.append(
                    f"rank {r}: blocked at step {at + batch.index(waiting[0])} on "
                    + ", ".join(
                        f"{b} (rank {b.peer} has not sent {b.counterpart(r)})" for b in waiting
                    )
                )
        raise DeadlockError(
            f"{name!r} deadlocks: no rank can make progress\n  " + "\n  ".join(lines)
        )

    leftover = sent - received
    if leftover:
        msgs = [
            f"rank {src} SEND_{kind}{m}@s{s}->r{dst}" for (src, dst, kind, m, s) in sorted(leftover)
        ]
        raise DeadlockError(
            f"{name!r}: sends never received (the peer has no matching RECV): "
            + ", ".join(msgs[:12])
        )
    order = _order_errors(lists)  # matched by identity above; the wire matches by order
    if order:
        raise DeadlockError(f"{name!r} would pair messages wrongly:\n  " + "\n  ".join(order[:12]))


def _step_starts(plan: list) -> list[int]:
    out, i = [], 0
    for step in plan:
        out.append(i)
        i += 1 if isinstance(step, Action) else len(step)
    return out
