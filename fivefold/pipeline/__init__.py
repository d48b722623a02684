"""Pipeline parallelism, schedules as data.

- `actions`: the vocabulary (F/B/I/W, SEND/RECV, `Action`, `Schedule`) and `steps`, the one
  reading of a lowered list (computes one by one, the communication between two as one batch);
- `builders`: one function per schedule, ``(P, M, V) -> Schedule``; `build_schedule` by name;
- `lowering`: the SEND / RECV each compute needs (`lower`);
- `checks`: `validate`, `check_deadlock_free`;
- `simulator`: timing only (`simulate` -> `Timeline`: bubble, activations in flight);
- `runtime`: executes a lowered schedule on this rank's stages;
- `split`: cutting a model into stages by module names (the model says which).
"""

from fivefold.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    DeadlockError,
    F,
    I,
    Schedule,
    ScheduleError,
    W,
    iter_steps,
    steps,
)
from fivefold.pipeline.builders import (
    SCHEDULES,
    build_schedule,
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)
from fivefold.pipeline.checks import check_deadlock_free, validate
from fivefold.pipeline.lowering import lower
from fivefold.pipeline.simulator import Timeline, bubble_formula, simulate

__all__ = [
    "B", "F", "I", "W", "RECV_B", "RECV_F", "SEND_B", "SEND_F", "SCHEDULES", "Action", "DeadlockError", "Schedule",
    "ScheduleError", "Timeline", "bubble_formula", "build_schedule", "check_deadlock_free", "forward_only", "gpipe",
    "interleaved_1f1b", "iter_steps", "lower", "one_f_one_b", "simulate", "steps", "validate", "zero_bubble_h1",
]
