"""How a sharded stage's gradient bucket travels to this rank's mean shard: the plain
reduce-scatter, HSDP's all-reduce across replicas after it (docs/design.md#hsdp), or qgZ's int8
all-to-all in its place (docs/design.md#zero-qwz-qgz-hpz). A transport launches one bucket
(`launch`: its result in ``bucket.out``), completes it once the handle is waited (`finish`), and
states what it sends per step (`collectives`, read by `fivefold.plan.traffic`): per gradient
reduction a reduce-scatter of every bucket (`formulas.zero_grad_reduce_bytes`), qgZ the same shapes
as quantised chunks, HSDP plus an all-reduce of each shard, Ψ/N_s, over ``dp_replicate``; and how
many buckets' reduced shards are alive at once (`outputs_held`, read by the stage's
`transient_bytes`): the in-flight bound, or under HSDP every bucket's (its all-reduce is waited at
the end of backward: `hsdp`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from fivefold import formulas
from fivefold.data_parallel.buckets import GradBucket
from fivefold.data_parallel.flat_param import FlatParam
from fivefold.data_parallel.hsdp import ReplicaReduce
from fivefold.data_parallel.quantize import dequantize_sum, packed_bytes, quantize_rows_into
from fivefold.distributed.comm import Comm

__all__ = [
    "Collective",
    "GradTransport",
    "Int8AllToAll",
    "PlainReduceScatter",
    "ReplicaAllReduce",
]

ShardOut = Callable[[], torch.Tensor]  # where the stage wants the bucket's reduced shard


class Collective(NamedTuple):
    """One collective's payload per step, as `CommLog` counts it (`fivefold.plan.traffic.Transfer`'s
    fields)."""

    dim: str
    op: str
    phase: str
    nbytes: int
    group: int  # ranks in the group


class GradTransport(Protocol):
    """The interface a sharded stage (`strategies.ReduceScatter`) calls."""

    comm: Comm

    def launch(self, bucket: GradBucket, flat: FlatParam, shard_out: ShardOut) -> Any: ...

    def finish(self, bucket: GradBucket, flat: FlatParam) -> None: ...

    def clear(self) -> None: ...

    def collectives(
        self, padded: list[int], grad_bytes: int, reductions: int, phase: str
    ) -> list[Collective]: ...

    def outputs_held(self, inflight: int, buckets: int) -> int: ...


class PlainReduceScatter:
    """The bucket pre-divided by ``divisor`` (every rank its mean runs over: the sum of g_i / N is
    the mean) and reduce-scattered over ``comm`` into the shard the stage chose (nothing to send
    over a one-rank group)."""

    def __init__(self, comm: Comm, divisor: int) -> None:
        self.comm, self.divisor = comm, divisor

    def launch(self, bucket: GradBucket, flat: FlatParam, shard_out: ShardOut) -> Any:
        bucket.grad.div_(self.divisor)
        bucket.out = shard_out()
        if self.comm.size == 1:
            return None
        tag = f"bucket{bucket.index}"
        return self.comm.reduce_scatter(
            bucket.out, bucket.grad, async_op=True, tag=tag, sizes=flat.shard_sizes
        )

    def finish(self, bucket: GradBucket, flat: FlatParam) -> None:
        pass

    def clear(self) -> None:
        pass

    def collectives(
        self, padded: list[int], grad_bytes: int, reductions: int, phase: str
    ) -> list[Collective]:
        n = self.comm.size
        if n == 1:
            return []
        nbytes = reductions * formulas.zero_grad_reduce_bytes(padded, n, grad_bytes)
        return [Collective(self.comm.dim, "reduce_scatter", phase, nbytes, n)]

    def outputs_held(self, inflight: int, buckets: int) -> int:
        """Buckets whose reduced shard is alive at once, of `buckets` with a bound of `inflight`:
        a shard is added to the gradient as its bucket completes."""
        return min(inflight, buckets)


class ReplicaAllReduce:
    """HSDP: the `inner` reduce-scatter inside the shard group, then the shard's all-reduce across
    ``replicate`` (started in bucket order on every rank, waited at the end of backward:
    `hsdp.ReplicaReduce`)."""

    def __init__(self, inner: PlainReduceScatter, replicate: Comm) -> None:
        self.inner, self.comm, self.replicate = inner, inner.comm, replicate
        self.queue = ReplicaReduce(replicate)

    def launch(self, bucket: GradBucket, flat: FlatParam, shard_out: ShardOut) -> Any:
        work = self.inner.launch(bucket, flat, shard_out)
        return self.queue.after(work, bucket.out, f"bucket{bucket.index}")

    def finish(self, bucket: GradBucket, flat: FlatParam) -> None:
        self.inner.finish(bucket, flat)

    def clear(self) -> None:
        self.queue.clear()
        self.inner.clear()

    def collectives(
        self, padded: list[int], grad_bytes: int, reductions: int, phase: str
    ) -> list[Collective]:
        shard = reductions * sum(padded) // self.comm.size * grad_bytes
        replicas = Collective(self.replicate.dim, "all_reduce", phase, shard, self.replicate.size)
        return [*self.inner.collectives(padded, grad_bytes, reductions, phase), replicas]

    def outputs_held(self, inflight: int, buckets: int) -> int:
        """Every bucket's: each shard's all-reduce is waited at the end of backward, so the shard
        (what it reads and writes) lives until then."""
        return buckets


class Int8AllToAll:
    """qgZ: destination j's chunk of the bucket quantised per block of ``block``, one int8
    all-to-all (values + scales); the full-precision buffer is freed at once. `finish` dequantises
    what every rank sent and sums it in fp32: no quantised sum on the wire, so the error stays
    within Σ scale/2 per block (one hop: ZeRO++'s two-hop, node-first version only saves inter-node
    traffic). ``dequantize``: the sum of the received chunks."""

    def __init__(
        self,
        comm: Comm,
        block: int,
        dequantize: Callable[[torch.Tensor, int, int], torch.Tensor] = dequantize_sum,
    ) -> None:
        self.comm, self.block, self.dequantize = comm, block, dequantize
        self._sends: dict[
            int, torch.Tensor
        ] = {}  # packed chunks kept alive while their all-to-all runs

    def launch(self, bucket: GradBucket, flat: FlatParam, shard_out: ShardOut) -> Any:
        n, size = flat.shard_numel, self.comm.size
        send = torch.empty(
            size, packed_bytes(n, self.block), dtype=torch.int8, device=bucket.grad.device
        )
        quantize_rows_into(bucket.grad.view(size, n), self.block, send)
        bucket.release()
        self._sends[bucket.index] = send
        bucket.out = torch.empty_like(send)
        return self.comm.all_to_all(bucket.out, send, async_op=True, tag=f"bucket{bucket.index}")

    def finish(self, bucket: GradBucket, flat: FlatParam) -> None:
        if self._sends.pop(bucket.index, None) is not None:
            mean = self.dequantize(bucket.out, flat.shard_numel, self.block).div_(self.comm.size)
            bucket.out = mean.to(bucket.grad_dtype)

    def clear(self) -> None:
        self._sends.clear()

    def collectives(
        self, padded: list[int], grad_bytes: int, reductions: int, phase: str
    ) -> list[Collective]:
        n = self.comm.size
        nbytes = reductions * formulas.zero_grad_reduce_bytes(padded, n, grad_bytes, self.block)
        return [Collective(self.comm.dim, "all_to_all", phase, nbytes, n)]

    def outputs_held(self, inflight: int, buckets: int) -> int:
        return min(inflight, buckets)
