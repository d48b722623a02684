"""Lowering: insert the SEND / RECV each rank needs around its compute actions.

Each batch between two computes is "send what the last compute produced, receive what the next one
needs" (Megatron's ``send_forward_recv_backward`` pairing); a neighbouring stage on the same rank
needs no transfer.
"""

from __future__ import annotations

import dataclasses

from fivefold.pipeline.actions import (
    BACKWARD_KINDS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    F,
    Schedule,
    ScheduleError,
)

__all__ = ["transfers", "lower"]


def transfers(schedule: Schedule, rank: int, a: Action) -> tuple[list[Action], list[Action]]:
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
    """Return a copy of ``schedule`` with the communication each rank needs made explicit. With
    ``fuse_forward_backward`` an F and the backward right after it are one unit with no
    communication inside (Megatron's ``send_forward_backward_recv_forward_backward``): interleaved
    1F1B with M > P needs it under NCCL."""
    if schedule.is_lowered:
        return schedule
    out: list[list[Action]] = []
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if a.is_comm:
                raise ScheduleError(f"rank {rank}: {a} in a schedule not marked lowered")
        lowered: list[Action] = []
        pending_sends: list[
            Action
        ] = []  # sends of the last unit, issued with the next unit's receives
        for j, a in enumerate(acts):
            recvs, sends = transfers(schedule, rank, a)
            if (
                schedule.fuse_forward_backward
                and a.kind in BACKWARD_KINDS
                and j > 0
                and acts[j - 1].kind == F
            ):
                lowered.append(
                    a
                )  # second half of an (F, backward) unit: its receive went before the F
                pending_sends += sends
                continue
            nxt = acts[j + 1] if j + 1 < len(acts) else None
            if (
                schedule.fuse_forward_backward
                and a.kind == F
                and nxt is not None
                and nxt.kind in BACKWARD_KINDS
            ):
                recvs = recvs + transfers(schedule, rank, nxt)[0]
            lowered += pending_sends + recvs + [a]
            pending_sends = sends
        lowered += pending_sends
        out.append(lowered)
    return dataclasses.replace(schedule, actions=out, is_lowered=True)
