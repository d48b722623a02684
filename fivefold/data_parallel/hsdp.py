"""HSDP's second reduction (docs/design.md#hsdp): ZeRO shards inside a shard group, and each
bucket's reduced gradient shard is then all-reduced across the replicate groups, which hold the same
shard.

Per step and rank, Ψ padded parameters, N_s = shard degree, R = replicas: over ``dp_shard`` the
stage's traffic (ZeRO-3: all-gather 2Ψ + reduce-scatter Ψ; ZeRO-1/2: reduce-scatter Ψ + all-gather
Ψ), over ``dp_replicate`` an all-reduce of Ψ/N_s; model states follow the stage's formula with N =
N_s (ZeRO-3: 16Ψ/N_s). `formulas.hsdp_expected` has the numbers.

The all-reduce of bucket k can start only when its reduce-scatter has finished. `ReplicaReduce`
starts it at points of the program that are the same on every rank, never on a timing-dependent
test: when bucket k + 1 is launched (waiting for bucket k's reduce-scatter, issued one launch
earlier, so usually done), or when the reducer frees or finishes bucket k. Every rank thus issues
the shard and replica collectives in one interleaving — which debug mode's fingerprint exchange (a
blocking gloo call before each collective) and NCCL's communicators (posted in different orders on
different ranks, they may deadlock) both need.

Its result is waited where it is needed, as FSDP2 does: the handle is staged
(`buckets.StagedWork`). The reducer's in-flight bound waits only the first stage (`wait_input`:
the reduce-scatter done, the all-reduce started), after which the bucket's full gradient buffer is
no longer read and goes; the all-reduce itself is waited at the end of backward, before its shard is
added to the flat's gradient (`wait`). So the all-reduce's shard — the one buffer it reads and
writes — lives until then: under accumulation a later micro-step's shard output of every bucket is
alive at the end of backward, not only the ``inflight_buckets`` newest
(`transports.ReplicaAllReduce.outputs_held`). When there was no reduce-scatter (a one-rank shard
group) the all-reduce runs on a slice of the bucket's buffer, and the handle is not staged: the
buffer is kept until the all-reduce is waited.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from fivefold.distributed.comm import Comm

__all__ = ["ReplicaReduce", "StagedThenAllReduce", "ThenAllReduce"]


class ThenAllReduce:
    """The work handle of one bucket under HSDP: its reduce-scatter (None when there was none), then
    the all-reduce of its shard ``out`` over the replicate group. ``wait()`` returns when both are
    done."""

    def __init__(self, queue: ReplicaReduce, first: Any, out: torch.Tensor, tag: str) -> None:
        self.queue, self.first, self.out, self.tag = queue, first, out, tag
        self.second: Any = None

    @property
    def started(self) -> bool:
        return self.second is not None

    def start(self) -> None:
        if self.first is not None:
            self.first.wait()  # (a stream dependency on NCCL, a host wait on gloo)
            self.first = None
        self.second = self.queue.replicate.all_reduce(self.out, async_op=True, tag=self.tag)

    def wait(self) -> None:
        self.queue.start_through(self)
        self.second.wait()


class StagedThenAllReduce(ThenAllReduce):
    """A bucket with a reduce-scatter (`buckets.StagedWork`): its shard lies apart from the
    temporary full buffer (ZeRO-2/3) or in the kept one, never freed (ZeRO-1), so once the
    reduce-scatter is done the reducer may free the full buffer while the all-reduce still runs on
    the shard."""

    def wait_input(self) -> None:
        """The reduce-scatter done (so the bucket's full buffer is no longer read) and this
        bucket's all-reduce started — not waited."""
        self.queue.start_through(self)


class ReplicaReduce:
    """The buckets of one engine whose replicate all-reduce has not started yet, oldest first."""

    def __init__(self, replicate: Comm) -> None:
        self.replicate = replicate
        self._waiting: deque[ThenAllReduce] = deque()

    def after(self, first: Any, out: torch.Tensor, tag: str) -> ThenAllReduce:
        """The handle for a bucket whose reduce-scatter `first` was just launched into `out` (apart
        from the bucket's buffer; None: no reduce-scatter, `out` a slice of that buffer); every
        older bucket starts its all-reduce now (in bucket order, whatever the timing)."""
        while self._waiting:
            self._waiting.popleft().start()
        kind = ThenAllReduce if first is None else StagedThenAllReduce
        work = kind(self, first, out, tag)
        self._waiting.append(work)
        return work

    def start_through(self, work: ThenAllReduce) -> None:
        """Start every all-reduce up to and including `work`'s, waiting for their
        reduce-scatters."""
        while not work.started:
            self._waiting.popleft().start()

    def clear(self) -> None:
        """Forget buckets of a backward that raised (their gradients are discarded with it)."""
        self._waiting.clear()
