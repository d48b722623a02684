"""Pipeline schedules as data: the vocabulary (action kinds, `Action`, `Schedule`) and the one
reading of a lowered list (`steps`).

A schedule is a pure function of (P ranks, M micro-batches, V virtual stages per rank) that
returns, for every rank, the ordered list of `Action` s that rank executes (`builders`). One
runtime executes any such list; the simulator times it; `checks.validate` and
`checks.check_deadlock_free` prove it complete and executable. Nothing here touches torch.

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

    Communication (inserted by `lowering.lower`):

    - ``SEND_F`` / ``RECV_F`` the activation leaving stage s after its F / entering stage s
      before its F; ``SEND_B`` / ``RECV_B`` the gradient w.r.t. a stage's input leaving stage s
      after its B or I / the gradient w.r.t. a stage's output entering stage s before its B or I.

    The ``stage`` of a communication action is always the stage *on this rank* that produces or
    consumes the tensor, and ``peer`` is the other rank. So ``SEND_F(m, s) -> peer`` is matched by
    ``RECV_F(m, s + 1) <- rank_of(s)`` on the peer, and ``SEND_B(m, s)`` by ``RECV_B(m, s - 1)``
    (`Action.counterpart` computes it).

What a lowered list means (`steps`: the runtime, the deadlock check and the simulator all read it so)
    Each rank walks its list in order. Compute actions run to completion. The communication
    actions between two compute actions form one *batch*, which the runtime issues as one
    ``batch_isend_irecv`` (receives first) and waits on before the next compute. Sends are
    buffered (never block); a receive blocks until its matching send was issued. The stricter
    *rendezvous* model — a batch completes only once every op in it is matched by a posted op on
    the peer, which is what NCCL guarantees — is ``check_deadlock_free(..., rendezvous=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = [
    "F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "COMPUTE_KINDS", "COMM_KINDS", "BACKWARD_KINDS",
    "Action", "Schedule", "ScheduleError", "DeadlockError", "steps", "iter_steps", "channel",
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
        from fivefold.pipeline.lowering import lower

        return lower(self)

    def format(self) -> str:
        """One line per rank, e.g. ``rank 0: F0@s0 F1@s0 B0@s0 ...`` (handy in error messages)."""
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))


# --------------------------------------------------------------------------------------------
# the one reading of a lowered list


Step = Action | list[Action]


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




def steps(rank_actions: Sequence[Action]) -> list[Step]:
    """`iter_steps` as a list: what every reader of a lowered list walks, one index per step."""
    return list(iter_steps(rank_actions))


def channel(rank: int, a: Action) -> tuple:
    """Identity of the message a communication action sends or receives: (src, dst, kind, m, src stage)."""
    if a.kind.startswith("SEND"):
        return (rank, a.peer, a.kind[-1], a.microbatch, a.stage)
    c = a.counterpart(rank)
    return (a.peer, rank, a.kind[-1], a.microbatch, c.stage)
