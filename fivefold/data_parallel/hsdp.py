"""HSDP's second reduction (seed 003 §5.5): ZeRO shards inside a shard group, and each bucket's reduced gradient shard
is then all-reduced across the replicate groups, which hold the same shard.

Per step and rank, Ψ padded parameters, N_s = shard degree, R = replicas: over ``dp_shard`` the stage's traffic (ZeRO-3:
all-gather 2Ψ + reduce-scatter Ψ; ZeRO-1/2: reduce-scatter Ψ + all-gather Ψ), over ``dp_replicate`` an all-reduce of
Ψ/N_s; model states follow the stage's formula with N = N_s (ZeRO-3: 16Ψ/N_s). `formulas.hsdp_expected` has the
numbers.

The all-reduce of bucket k can start only when its reduce-scatter has finished. `ReplicaReduce` starts it as early
as that is known without blocking: after each new launch, the oldest buckets whose reduce-scatter is complete get
their all-reduce issued (`advance`), and waiting on a bucket (the reducer's bounded in-flight logic) forces it. The
all-reduces are issued in bucket order on every rank, whatever the timing: only a prefix of the queue is started.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from fivefold.comm import Comm

__all__ = ["ReplicaReduce", "ThenAllReduce"]


class ThenAllReduce:
    """The work handle of one bucket under HSDP: its reduce-scatter (None when there was none), then the all-reduce of
    its shard ``out`` over the replicate group. ``wait()`` returns when both are done."""

    def __init__(self, queue: ReplicaReduce, first: Any, out: torch.Tensor, tag: str) -> None:
        self.queue, self.first, self.out, self.tag = queue, first, out, tag
        self.second: Any = None

    @property
    def started(self) -> bool:
        return self.second is not None

    def ready(self) -> bool:
        """The reduce-scatter has finished (or there was none): the all-reduce may start without waiting."""
        return self.first is None or self.first.is_completed()

    def start(self) -> None:
        if self.first is not None:
            self.first.wait()  # (a stream dependency on NCCL, a host wait on gloo)
            self.first = None
        self.second = self.queue.replicate.all_reduce(self.out, async_op=True, tag=self.tag)

    def wait(self) -> None:
        self.queue.start_through(self)
        self.second.wait()


class ReplicaReduce:
    """The buckets of one engine whose replicate all-reduce has not started yet, oldest first."""

    def __init__(self, replicate: Comm) -> None:
        self.replicate = replicate
        self._waiting: deque[ThenAllReduce] = deque()

    def after(self, first: Any, out: torch.Tensor, tag: str) -> ThenAllReduce:
        """The handle for a bucket whose reduce-scatter `first` was just launched into `out`; older buckets whose
        reduce-scatter is already complete start their all-reduce now."""
        work = ThenAllReduce(self, first, out, tag)
        self._waiting.append(work)
        self.advance()
        return work

    def advance(self) -> None:
        """Start the all-reduce of the oldest buckets whose reduce-scatter is done, stopping at the first that is not
        (so every rank issues them in bucket order)."""
        while self._waiting and self._waiting[0].ready():
            self._waiting.popleft().start()

    def start_through(self, work: ThenAllReduce) -> None:
        """Start every all-reduce up to and including `work`'s, waiting for their reduce-scatters."""
        while not work.started:
            self._waiting.popleft().start()

    def clear(self) -> None:
        """Forget buckets of a backward that raised (their gradients are discarded with it)."""
        self._waiting.clear()
