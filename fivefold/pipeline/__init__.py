"""Pipeline parallelism, schedules as data.

`actions` (vocabulary, `steps`), `builders` (one ``(P, M, V) -> Schedule`` per schedule), `lowering`
(`lower`), `checks` (`validate`, `check_deadlock_free`), `simulator` (timing only), `runtime`
(executes a lowered schedule on this rank's stages), `split` (cutting a model into stages by module
names).
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
    "B",
    "F",
    "I",
    "W",
    "RECV_B",
    "RECV_F",
    "SEND_B",
    "SEND_F",
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "bubble_formula",
    "build_schedule",
    "check_deadlock_free",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "iter_steps",
    "lower",
    "one_f_one_b",
    "simulate",
    "steps",
    "validate",
    "zero_bubble_h1",
]
