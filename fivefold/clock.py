"""One clock for everything fivefold times on a rank: pipeline actions
(`pipeline.runtime.ActionClock`), collectives (`comm.CommLog` while tracing) and module spans
(`trace.StepTracer`), so their marks share one timeline.

On the CPU a mark is `time.perf_counter_ns()`. On an accelerator the host only queues kernels, so
host time says when work was *queued*, not when it ran: a mark is a `torch.Event` recorded on the
current stream, and marks are turned into times once, when asked (one device synchronisation for a
whole batch of marks, not one per mark). Device-agnostic: `torch.accelerator` / `torch.Event`, never
a backend's own module.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DeviceClock", "Mark"]

Mark = Any  # an int (ns, CPU) or a recorded torch.Event (accelerator)


class DeviceClock:
    """Marks on ``device``'s timeline: device events where ``device`` is the current accelerator's
    type, else the host's monotonic clock. Marks of one clock are comparable with each other (and
    with any clock of the same kind on the same device)."""

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        accelerator = (
            torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        )
        self.device_events = accelerator is not None and device.type == accelerator.type

    def mark(self) -> Mark:
        if self.device_events:
            event = torch.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def elapsed_ns(self, origin: Mark, marks: Sequence[Mark]) -> list[int]:
        """Each mark's time after ``origin`` in ns (negative if before). On an accelerator this
        waits for the device once (the marks must all have been recorded)."""
        if not self.device_events:
            return [m - origin for m in marks]
        torch.accelerator.synchronize()
        return [round(origin.elapsed_time(m) * 1e6) for m in marks]  # elapsed_time: milliseconds
