"""Pipeline schedules as data: the vocabulary (`Action`, `Schedule`) and `steps`, the one reading of
a lowered list.

S = P·V virtual stages are placed by ``stage_to_rank`` (plain: stage s on rank s; interleaved:
``s % P``). Compute: ``F``, full backward ``B``, or its zero-bubble halves ``I`` (input gradient,
critical path) and ``W`` (weight gradient, fills bubbles). Comm (added by `lowering.lower`):
``SEND_F``/``RECV_F`` activations, ``SEND_B``/``RECV_B`` input gradients, ``stage`` being this
rank's stage that makes or uses the tensor (`Action.counterpart`). A lowered list means (runtime,
checks and simulator alike): computes one by one; the comm actions between two computes are one
batch (one ``batch_isend_irecv``, waited on before the next compute); sends buffered, receives
blocking.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

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
    "BACKWARD_KINDS",
    "Action",
    "Schedule",
    "ScheduleError",
    "DeadlockError",
    "steps",
    "iter_steps",
    "channel",
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
    """One step of a rank's list: ``kind`` of ``microbatch`` at virtual ``stage``; ``peer`` only for
    comm actions."""

    kind: str
    microbatch: int
    stage: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS and self.kind not in COMM_KINDS:
            raise ValueError(
                f"unknown action kind {self.kind!r}; expected one of {COMPUTE_KINDS + COMM_KINDS}"
            )
        if self.is_comm != (self.peer is not None):
            raise ValueError(
                f"{self.kind} needs peer={'a rank' if self.is_comm else 'None'}, got "
                f"peer={self.peer}"
            )

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
    """Per-rank action lists, compute only as built, with communication after `lower`
    (``is_lowered``). ``fuse_forward_backward`` asks `lower` to treat an F and the backward right
    after it as one unit."""

    name: str
    n_ranks: int
    n_microbatches: int
    n_virtual: int
    stage_to_rank: list[int]
    actions: list[list[Action]]
    is_lowered: bool = False
    fuse_forward_backward: bool = False  # see `lower`
    # Per rank, the backward actions that run *beside* the forward right before them (DualPipe's
    # overlapped F&B unit: one micro-batch's communication hides behind the other's compute); empty:
    # every compute runs alone.
    side_by_side: list[frozenset[Action]] = field(default_factory=list)

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

    def runs_beside_forward(self, rank: int, a: Action) -> bool:
        """True if ``a`` (a backward on ``rank``) runs side by side with the forward right before
        it."""
        return bool(self.side_by_side) and a in self.side_by_side[rank]

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.actions[rank] if a.is_compute]

    def format(self) -> str:
        """One line per rank, e.g. ``rank 0: F0@s0 F1@s0 B0@s0 ...`` (handy in error messages)."""

        def name(r: int, a: Action) -> str:
            return (
                f"&{a}" if self.runs_beside_forward(r, a) else str(a)
            )  # "F3@s0 &B1@s3": one overlapped unit

        return "\n".join(
            f"rank {r}: " + " ".join(name(r, a) for a in acts)
            for r, acts in enumerate(self.actions)
        )


Step = Action | list[Action]


def iter_steps(rank_actions: Sequence[Action]) -> Iterator[Action | list[Action]]:
    """Walk one rank's lowered list: compute actions one by one, each run of comm actions as one
    list (batch)."""
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
    """`iter_steps` as a list, one index per step."""
    return list(iter_steps(rank_actions))


def channel(rank: int, a: Action) -> tuple:
    """Identity of the message a communication action sends or receives: (src, dst, kind, m, src
    stage)."""
    if a.kind.startswith("SEND"):
        return (rank, a.peer, a.kind[-1], a.microbatch, a.stage)
    c = a.counterpart(rank)
    return (a.peer, rank, a.kind[-1], a.microbatch, c.stage)
