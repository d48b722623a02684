"""Lowering: a schedule's compute lists -> the communication each rank needs, made explicit.

`transfers` says what one compute action receives before it and sends after it; `lower` inserts
those SEND / RECV actions so that each batch between two computes is "send what the last compute
produced, receive what the next one needs" (Megatron's ``send_forward_recv_backward`` pairing).
With ``Schedule.fuse_forward_backward`` an F and the backward right after it form one unit with no
communication inside (Megatron's combined step): the interleaved schedule needs it for M > P to
stay deadlock-free when sends block (NCCL; `checks.check_deadlock_free(..., rendezvous=True)`).
"""

from __future__ import annotations

import dataclasses

from fivefold.pipeline.actions import BACKWARD_KINDS, RECV_B, RECV_F, SEND_B, SEND_F, Action, F, Schedule, ScheduleError

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
            recvs, sends = transfers(schedule, rank, a)
            if schedule.fuse_forward_backward and a.kind in BACKWARD_KINDS and j > 0 and acts[j - 1].kind == F:
                lowered.append(a)  # second half of an (F, backward) unit: its receive went before the F
                pending_sends += sends
                continue
            nxt = acts[j + 1] if j + 1 < len(acts) else None
            if schedule.fuse_forward_backward and a.kind == F and nxt is not None and nxt.kind in BACKWARD_KINDS:
                recvs = recvs + transfers(schedule, rank, nxt)[0]
            lowered += pending_sends + recvs + [a]
            pending_sends = sends
        lowered += pending_sends
        out.append(lowered)
    return dataclasses.replace(schedule, actions=out, is_lowered=True)
