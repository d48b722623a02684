"""Pipeline parallelism: schedules as data (`schedules`), their timing model (`simulator`)."""

from fivefold.pipeline.schedules import (
    SCHEDULES,
    Action,
    DeadlockError,
    Schedule,
    ScheduleError,
    build_schedule,
    check_deadlock_free,
    gpipe,
    interleaved_1f1b,
    lower,
    one_f_one_b,
    validate,
    zero_bubble_h1,
)
from fivefold.pipeline.simulator import Timeline, bubble_formula, plot_timeline, simulate, to_chrome_trace

__all__ = [
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "check_deadlock_free",
    "gpipe",
    "interleaved_1f1b",
    "lower",
    "one_f_one_b",
    "validate",
    "zero_bubble_h1",
    "Timeline",
    "bubble_formula",
    "plot_timeline",
    "simulate",
    "to_chrome_trace",
]
