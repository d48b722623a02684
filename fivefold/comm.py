"""Every collective fivefold issues goes through this module.

`Comm` binds one process group to the name of the mesh dimension it spans ("dp", "tp", ...)
and a `CommLog`. Each call is recorded with its payload and the ring-wire traffic per rank,
so tests and `fivefold plan` can check measured communication against the formulas of
DESIGN.md (seed 001 §communication, seed 003 §NCCL primitives; `fivefold.formulas.ring_wire_bytes`):

    all-reduce      wire = 2(N-1)/N · S      (reduce-scatter followed by all-gather)
    reduce-scatter  wire =  (N-1)/N · S      (S = the full, unscattered input)
    all-gather      wire =  (N-1)/N · S      (S = the full, gathered output)
    broadcast       wire =  (N-1)/N · S      (pipelined ring; the root sends S once)
    all-to-all      wire =  (N-1)/N · S
    send / recv     wire =  S

When the log is disabled, recording costs one attribute check per call.

Every tensor handed to a collective must live on the device the group's backend serves (NCCL:
CUDA; gloo: here, the CPU). gloo would quietly accept a CPU scalar where NCCL raises at the first
step, so CI on CPU could never see the mistake: `Comm` checks each tensor and names the op, and
`Comm.scalar` is the one way to make the small tensors collectives need (norms, flags, metrics).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fivefold.formulas import ring_wire_bytes  # re-exported: fivefold.comm.ring_wire_bytes

# torch 2.13 renamed the flat-tensor collectives; keep working on torch >= 2.6.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# The mesh dimensions ("tp", "dp", "pp", ...) a tensor's elements are partitioned over: each element
# lives on exactly one rank of those dimensions (a TP slice: {"tp"}; a ZeRO shard adds "dp"; a pipeline
# stage's parameter adds "pp"); over the others it is replicated. Global norms sum over exactly these.
Placement = frozenset[str]


@dataclass(frozen=True)
class CommRecord:
    """One collective call as seen by this rank."""

    seq: int  # global order of issue on this rank (shared counter with other events)
    op: str
    dim: str
    dtype: torch.dtype
    numel: int  # payload elements (full buffer for all-reduce / reduce-scatter / all-gather)
    payload_bytes: int
    wire_bytes: float
    group_size: int
    tag: str = ""  # free-form label from the caller, e.g. "bucket3"


@dataclass
class CommTotals:
    calls: int = 0
    numel: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class CommLog:
    """Per-rank record of collectives. Reset it at a step boundary, read it after."""

    enabled: bool = True
    records: list[CommRecord] = field(default_factory=list)
    _counter: itertools.count = field(default_factory=itertools.count, repr=False)

    def next_seq(self) -> int:
        """A tick of the rank-local clock shared by records and other traced events."""
        return next(self._counter)

    def record(self, op: str, dim: str, tensor: torch.Tensor, group_size: int, tag: str = "",
               numel: int | None = None) -> None:
        n = tensor.numel() if numel is None else numel
        payload = n * tensor.element_size()
        self.records.append(CommRecord(self.next_seq(), op, dim, tensor.dtype, n, payload,
                                       ring_wire_bytes(op, payload, group_size), group_size, tag))

    def reset(self) -> None:
        self.records.clear()

    def totals(self, op: str | None = None, dim: str | None = None) -> CommTotals:
        t = CommTotals()
        for r in self.records:
            if (op is None or r.op == op) and (dim is None or r.dim == dim):
                t.calls += 1
                t.numel += r.numel
                t.payload_bytes += r.payload_bytes
                t.wire_bytes += r.wire_bytes
        return t

    def summary(self) -> dict[tuple[str, str], CommTotals]:
        """Totals keyed by (op, dim)."""
        out: dict[tuple[str, str], CommTotals] = defaultdict(CommTotals)
        for r in self.records:
            t = out[(r.op, r.dim)]
            t.calls += 1
            t.numel += r.numel
            t.payload_bytes += r.payload_bytes
            t.wire_bytes += r.wire_bytes
        return dict(out)


def backend_devices(group: dist.ProcessGroup) -> dict[str, str]:
    """Device type -> backend of the group, for the devices fivefold uses it for: "gloo" ->
    {cpu: gloo}; "nccl" -> {cuda: nccl}; "cpu:gloo,cuda:nccl" (``init_process_group()`` without a
    backend) -> both. gloo also takes CUDA tensors ("cpu:gloo,cuda:gloo"), but fivefold runs gloo
    for the CPU only, so that entry is left out. Empty for a backend this table does not know."""
    config = getattr(dist, "get_backend_config", None)
    backend = str(config(group) if config is not None else dist.get_backend(group)).lower()
    if ":" in backend:
        pairs = dict(part.strip().split(":", 1) for part in backend.split(","))
    else:
        pairs = {dev: name for dev, name in dist.Backend.default_device_backend_map.items() if name == backend}
    return {dev: name for dev, name in pairs.items() if dev == "cpu" or name != "gloo"}


class Comm:
    """Collectives over one process group, logged under the name of its mesh dimension.

    Async calls return the torch work handle; callers `wait()` on it before reading the
    result (required for NCCL streams, harmless on gloo).

    ``device`` is where this group's tensors live (the mesh passes its compute device): a tensor on
    another device (type, or index when the device has one) is refused with an error naming the op,
    before anything is sent. Without it, the device follows the backend (gloo: CPU; NCCL: CUDA; a
    "cpu:gloo,cuda:nccl" group takes both and makes its scalars on CUDA).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, dim: str = "world",
                 log: CommLog | None = None, device: torch.device | str | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.dim = dim
        self.log = log if log is not None else CommLog(enabled=False)
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self._index: int | None = None
        if device is not None:
            self.device = torch.device(device)
            self._device_types = {self.device.type}
            self._index = self.device.index
        else:
            served = backend_devices(self.group)
            self._device_types = set(served)
            accelerators = sorted(dev for dev, name in served.items() if dev != "cpu")
            self.device = torch.device(accelerators[0] if accelerators else "cpu")

    def scalar(self, value: float | torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new 0-d tensor holding `value` on this group's device, to hand to a collective (a norm,
        an overflow flag, a metric). dtype: `value`'s if it is a tensor, else fp32."""
        if isinstance(value, torch.Tensor):
            return value.detach().to(device=self.device, dtype=dtype or value.dtype, copy=True).reshape(())
        return torch.tensor(value, dtype=dtype or torch.float32, device=self.device)

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            wrong_index = self._index is not None and t.device.index != self._index
            if (self._device_types and t.device.type not in self._device_types) or wrong_index:
                raise RuntimeError(
                    f"{op} over '{self.dim}': a tensor of shape {tuple(t.shape)} is on {t.device}, but this group's "
                    f"collectives run on {self.device} ({dist.get_backend(self.group)}); create it there "
                    f"(Comm.scalar for a scalar, device=comm.device) or move it with .to(comm.device)")

    def _record(self, op: str, tensor: torch.Tensor, tag: str, numel: int | None = None) -> None:
        if self.log.enabled:
            self.log.record(op, self.dim, tensor, self.size, tag, numel)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                   async_op: bool = False, tag: str = ""):
        self._check("all_reduce", tensor)
        self._record("all_reduce", tensor, tag)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       op: dist.ReduceOp = dist.ReduceOp.SUM, async_op: bool = False, tag: str = ""):
        """`input` is the full buffer (size N·len(output)); this rank keeps its slice in `output`.

        `output` may be this rank's own slice of `input` (in place), as ZeRO-1 does."""
        self._check("reduce_scatter", output, input)
        self._record("reduce_scatter", input, tag)
        return _reduce_scatter_flat(output, input, op=op, group=self.group, async_op=async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False,
                   tag: str = ""):
        """`output` is the full buffer (size N·len(input)), filled with every rank's `input`.

        `input` may be this rank's own slice of `output` (in place)."""
        self._check("all_gather", output, input)
        self._record("all_gather", output, tag)
        return _all_gather_flat(output, input, group=self.group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src_group_rank: int = 0, async_op: bool = False,
                  tag: str = ""):
        self._check("broadcast", tensor)
        self._record("broadcast", tensor, tag)
        return dist.broadcast(tensor, src=self.global_rank(src_group_rank), group=self.group,
                              async_op=async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_split_sizes: Sequence[int] | None = None,
                   input_split_sizes: Sequence[int] | None = None, async_op: bool = False, tag: str = ""):
        self._check("all_to_all", output, input)
        self._record("all_to_all", input, tag)
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      group=self.group, async_op=async_op)

    def batch_p2p(self, ops: Sequence[tuple[str, torch.Tensor, int]], tag: str = "") -> list:
        """Issue ("send"|"recv", tensor, peer_group_rank) ops as one batch; returns work handles."""
        p2p = []
        for kind, tensor, peer in ops:
            self._check(kind, tensor)
            self._record(kind, tensor, tag)
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, tensor, self.global_rank(peer), group=self.group))
        return dist.batch_isend_irecv(p2p) if p2p else []

    def all_gather_object(self, obj: object) -> list:
        """Small picklable objects (e.g. timing records) from every rank of the group; not logged."""
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)
