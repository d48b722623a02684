"""Every collective fivefold issues goes through this module.

`Comm` binds one process group to its mesh dimension ("dp", "tp", ...) and a `CommLog` recording
each call's payload and ring-wire bytes per rank (`formulas.ring_wire_bytes`;
docs/design.md#collectives-on-a-ring), which tests and `fivefold plan` check against the formulas.
Every tensor must be on the device the backend serves: gloo quietly takes a CPU scalar where NCCL
raises, so CPU CI would never see it; `Comm` checks each tensor, and `Comm.scalar` makes the small
ones (norms, flags, metrics). While the log has a clock (`run.trace`), each record also gets a
`CommTiming`: launch and completion on the rank's `DeviceClock`, and when its caller was blocked
waiting. Inside a selective-op recompute region a call is issued in the forward only; its
recomputation gets the forward's buffers (`ops.collective_outputs`), logging and sending nothing.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import os
import threading
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fivefold.clock import DeviceClock, Mark
from fivefold.formulas import (
    ring_wire_bytes,  # re-exported: fivefold.distributed.comm.ring_wire_bytes
)
from fivefold.ops import collective_outputs

# torch 2.13 renamed the flat-tensor collectives; keep working on torch >= 2.6.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# The mesh dimensions a tensor's elements are partitioned over, each element on exactly one rank of
# them (a TP slice: {"tp"}; a ZeRO shard adds "dp", a pipeline stage "pp"); replicated over the
# others. Norms sum over these.
Placement = frozenset[str]


@dataclass
class CommTiming:
    """When one traced collective ran, as `DeviceClock` marks. ``end`` (completion) is the end of
    the call for a synchronous op; for an async one, the earliest of gloo's completion callback (CPU
    collectives), a poll that found the work complete (CPU p2p, which has no callback) and the end
    of its first ``wait()`` — on an accelerator an event recorded on the waiting stream right after
    the wait, i.e. when the result became usable there. The caller was blocked from ``wait_start``
    to ``wait_end`` (a synchronous op: the whole call), in thread ``waiter``."""

    start: Mark
    end: Mark | None = None
    wait_start: Mark | None = None
    wait_end: Mark | None = None
    waiter: str = ""

    def finished(self, mark: Mark, host_clock: bool) -> None:
        if self.end is None or (
            host_clock and mark < self.end
        ):  # (events: the first one recorded stands)
            self.end = mark

    def blocked(self, start: Mark, end: Mark, host_clock: bool) -> None:
        if self.wait_start is None:
            self.wait_start, self.wait_end, self.waiter = (
                start,
                end,
                threading.current_thread().name,
            )
        self.finished(end, host_clock)


class TimedWork:
    """An async collective's work handle while tracing: ``wait()`` stamps the wait (and completion)
    on the records it covers (a coalesced p2p batch covers several); everything else is the work's
    own."""

    def __init__(self, work, timings: list[CommTiming], clock: DeviceClock) -> None:
        self.work, self.timings, self.clock, self._waited = work, timings, clock, False

    def wait(self, *args):
        if self._waited:
            return self.work.wait(*args)
        start = self.clock.mark()
        out = self.work.wait(*args)
        end = self.clock.mark()
        self._waited = True
        for t in self.timings:
            t.blocked(start, end, not self.clock.device_events)
        return out

    def stamp_if_completed(self) -> bool:
        """CPU: stamp completion now if the work is done (for works without a completion
        callback)."""
        if self.timings[0].end is None and self.work.is_completed():
            now = self.clock.mark()
            for t in self.timings:
                t.finished(now, True)
        return self.timings[0].end is not None

    def __getattr__(self, name: str):
        return getattr(self.work, name)


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
    timing: CommTiming | None = field(
        default=None, compare=False
    )  # only while the log has a clock (tracing)


@dataclass
class CommTotals:
    calls: int = 0
    numel: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0

    def add(self, record: CommRecord) -> None:
        """Count one more collective."""
        self.calls += 1
        self.numel += record.numel
        self.payload_bytes += record.payload_bytes
        self.wire_bytes += record.wire_bytes


_DEBUG: dict[str, object] = {"step": None}
DEBUG_ENV = "FIVEFOLD_DEBUG_COLLECTIVES"


class CollectiveMismatch(RuntimeError):
    """Ranks of one group were about to issue different collectives (debug mode): instead of a hang
    or a silent pairing of the wrong tensors, every rank raises this, naming what each side was
    doing and where."""


def set_debug_step(step: int | None) -> None:
    """The training step, part of every fingerprint: an extra backward on one rank shows as a step
    mismatch."""
    _DEBUG["step"] = step


def debug_collectives_requested(config_flag: bool = False) -> bool:
    return config_flag or os.environ.get(DEBUG_ENV, "") not in ("", "0", "false")


def _call_site() -> str:
    """The first frame outside this module (and `ops.collective_outputs`, which issues it under
    selective-op recompute): who issued the collective."""
    for frame in reversed(traceback.extract_stack(limit=16)[:-1]):
        relay = frame.filename.endswith("ops.py") and frame.name == "collective_outputs"
        if not frame.filename.endswith("comm.py") and not relay:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
    return "?"


def _mismatch_message(dim: str, prints: list) -> str:
    first = prints[0]
    other = next(i for i, p in enumerate(prints) if p != first)

    def show(rank: int, p: tuple) -> str:
        op, _, shapes, dtypes, seq, step, tag, site = p
        return (
            f"rank {rank}: {op}{' ' + tag if tag else ''} call {seq} at step {step}, shapes "
            f"{list(shapes)} {'/'.join(dtypes)}, from {site}"
        )

    return (
        f"collectives over '{dim}' disagree (debug.collectives): {show(0, first)}; "
        f"{show(other, prints[other])}. Every rank must issue the same collectives in the same "
        "order"
    )


@dataclass
class CommLog:
    """Per-rank record of collectives. Reset it at a step boundary, read it after."""

    enabled: bool = True
    records: list[CommRecord] = field(default_factory=list)
    # Tracing (`trace.StepTracer`) sets a clock: each record then gets a CommTiming. None: no timing
    # call at all.
    clock: DeviceClock | None = None
    _counter: itertools.count = field(default_factory=itertools.count, repr=False)
    _unfinished: list[TimedWork] = field(
        default_factory=list, repr=False
    )  # CPU works without a callback

    def next_seq(self) -> int:
        """A tick of the rank-local clock shared by records and other traced events."""
        return next(self._counter)

    def record(
        self,
        op: str,
        dim: str,
        tensor: torch.Tensor,
        group_size: int,
        tag: str = "",
        numel: int | None = None,
    ) -> CommTiming | None:
        """Log one call (about to be issued); its timing (launch marked now) if the log has a
        clock."""
        n = tensor.numel() if numel is None else numel
        payload = n * tensor.element_size()
        timing = CommTiming(self.clock.mark()) if self.clock is not None else None
        self.records.append(
            CommRecord(
                self.next_seq(),
                op,
                dim,
                tensor.dtype,
                n,
                payload,
                ring_wire_bytes(op, payload, group_size),
                group_size,
                tag,
                timing,
            )
        )
        return timing

    def timed(self, work, timings: list[CommTiming]):
        """``work`` (an async call's handle) stamping ``timings`` when it completes. On the CPU,
        completion comes from the work's future where the backend has one (gloo collectives), else
        from `poll` or the wait."""
        clock = self.clock
        if work is None or clock is None or not timings:
            return work
        timed = TimedWork(work, timings, clock)
        if not clock.device_events:
            try:
                work.get_future().add_done_callback(
                    lambda _: [t.finished(clock.mark(), True) for t in timings]
                )
            except (
                RuntimeError,
                AttributeError,
            ):  # gloo's p2p works have no future (nor do stand-in works)
                self._unfinished.append(timed)
        return timed

    def poll(self) -> None:
        """Stamp the completion of callback-less works that are done by now (the tracer calls it at
        its marks)."""
        if self._unfinished:
            self._unfinished[:] = [w for w in self._unfinished if not w.stamp_if_completed()]

    def reset(self) -> None:
        self.records.clear()
        self._unfinished.clear()

    def totals(
        self, op: str | None = None, dim: str | None = None, dims: Sequence[str] | None = None
    ) -> CommTotals:
        """Totals of the records of `op` (any if None) over `dim`, or any of `dims` (all if both are
        None)."""
        t = CommTotals()
        for r in self.records:
            if (
                (op is None or r.op == op)
                and (dim is None or r.dim == dim)
                and (dims is None or r.dim in dims)
            ):
                t.add(r)
        return t

    def by_dim(self) -> dict[str, CommTotals]:
        """Totals keyed by mesh dim, in the order the dims were first used."""
        out: dict[str, CommTotals] = {}
        for r in self.records:
            out.setdefault(r.dim, CommTotals()).add(r)
        return out

    def summary(self) -> dict[tuple[str, str], CommTotals]:
        """Totals keyed by (op, dim)."""
        out: dict[tuple[str, str], CommTotals] = defaultdict(CommTotals)
        for r in self.records:
            out[(r.op, r.dim)].add(r)
        return dict(out)


def backend_devices(group: dist.ProcessGroup) -> dict[str, str]:
    """Device type -> backend of the group, for the devices fivefold uses it for
    ("cpu:gloo,cuda:nccl" gives both). gloo's CUDA support is left out, as fivefold runs gloo for
    the CPU only; empty for an unknown backend."""
    config = getattr(dist, "get_backend_config", None)
    backend = str(config(group) if config is not None else dist.get_backend(group)).lower()
    if ":" in backend:
        pairs = dict(part.strip().split(":", 1) for part in backend.split(","))
    else:
        pairs = {
            dev: name
            for dev, name in dist.Backend.default_device_backend_map.items()
            if name == backend
        }
    return {dev: name for dev, name in pairs.items() if dev == "cpu" or name != "gloo"}


P2P_SEMANTICS = ("buffered", "rendezvous")


class P2PBatch:
    """The work handles of one `batch_isend_irecv`. gloo returns one per op; a coalescing backend
    (NCCL) returns ONE for the whole batch, complete only when every op in it is: `work_of(i)` is
    the handle that covers op i."""

    def __init__(self, works: Sequence, n_ops: int) -> None:
        works = [w for w in works if w is not None]
        if n_ops and len(works) not in (1, n_ops):
            raise RuntimeError(
                f"batch_isend_irecv returned {len(works)} works for {n_ops} ops (expected 1 or "
                f"{n_ops})"
            )
        self.works, self.n_ops = works, n_ops

    @property
    def coalesced(self) -> bool:
        return self.n_ops > 1 and len(self.works) == 1

    def work_of(self, i: int):
        return self.works[0] if self.coalesced else self.works[i]

    def wait(self) -> None:
        for w in self.works:
            w.wait()


_EAGER_REGIONS: list[
    tuple[list[Callable[..., Any]], Callable[..., Any]]
] = []  # (what `call` runs, the function)


def eager_region(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, a function that issues collectives from inside a model's forward (TP's f / g and SP,
    ring attention, expert all-to-alls): a compiled block (``train.compile``) must call it, not
    trace it — the collectives go through the process groups and the `CommLog` at run time, in the
    same order on every rank, and their autograd functions run eagerly with their own backward.
    `compile_eager_regions` (called when blocks are compiled) makes every such function a graph
    break for torch.compile; until then the wrapper just calls `fn` (importing torch's compiler
    costs start-up time no run without compile should pay)."""
    impl = [_disabled(fn) if _EAGER_REGIONS_ON else fn]
    _EAGER_REGIONS.append((impl, fn))

    def call(*args: Any, **kwargs: Any) -> Any:
        return impl[0](*args, **kwargs)

    return functools.update_wrapper(call, fn)


_EAGER_REGIONS_ON = False


def _disabled(fn: Callable[..., Any]) -> Callable[..., Any]:
    # (torch.compiler.disable's ``reason`` keyword is newer than the torch 2.6 fivefold supports:
    # not passed)
    return torch.compiler.disable(fn)


def compile_eager_regions() -> None:
    """Every `eager_region`, those defined later included, runs outside compiled graphs from now on
    (torch.compiler.disable: dynamo stops before the call and skips everything it calls). Once per
    process; harmless to code that is not compiled."""
    global _EAGER_REGIONS_ON
    _EAGER_REGIONS_ON = True
    for impl, fn in _EAGER_REGIONS:
        if impl[0] is fn:
            impl[0] = _disabled(fn)


def eager_regions_on() -> bool:
    """Whether `compile_eager_regions` ran in this process."""
    return _EAGER_REGIONS_ON


def _even(sizes: Sequence[int] | None) -> bool:
    """No uneven parts were asked for (None), or they are all equal: the flat collectives do."""
    return sizes is None or len(set(sizes)) <= 1


class AllOf:
    """One handle for several works (gloo's uneven all-gather: a broadcast per rank): complete
    when every one is."""

    def __init__(self, works: Sequence) -> None:
        self.works = list(works)

    def wait(self, *args: Any) -> bool:
        for w in self.works:
            w.wait(*args)
        self.works = []  # (a gloo work may be waited only once; waiting again returns at once)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class Comm:
    """Collectives over one process group, logged under the name of its mesh dimension; async calls
    return the work handle. ``device`` is where this group's tensors live (a tensor elsewhere is
    refused before anything is sent); by default it follows the backend (a "cpu:gloo,cuda:nccl"
    group makes scalars on CUDA)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        dim: str = "world",
        log: CommLog | None = None,
        device: torch.device | str | None = None,
        fingerprints: dist.ProcessGroup | None = None,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        # debug mode (`debug_collectives`): a gloo group over the same ranks where every
        # collective's fingerprint is compared before it is issued; None: off, and nothing is
        # computed
        self._side = fingerprints
        self._seq = 0
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
        """A new 0-d tensor holding `value` on this group's device for a collective (norm, flag,
        metric); dtype: `value`'s if it is a tensor, else fp32."""
        if isinstance(value, torch.Tensor):
            return (
                value.detach()
                .to(device=self.device, dtype=dtype or value.dtype, copy=True)
                .reshape(())
            )
        # a fill kernel with the value as its argument: `torch.tensor(value, device=...)` would be
        # a blocking host-to-device copy on an accelerator
        return torch.full((), value, dtype=dtype or torch.float32, device=self.device)

    def _check(self, op: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            wrong_index = self._index is not None and t.device.index != self._index
            if (self._device_types and t.device.type not in self._device_types) or wrong_index:
                raise RuntimeError(
                    f"{op} over '{self.dim}': a tensor of shape {tuple(t.shape)} is on {t.device}, "
                    f"but this group's collectives run on {self.device} "
                    f"({dist.get_backend(self.group)}); create it there (Comm.scalar for a scalar, "
                    "device=comm.device) or move it with .to(comm.device)"
                )

    def _agree(self, op: str, tensors: tuple[torch.Tensor, ...], tag: str) -> None:
        """Debug mode: every rank of the group compares this call's fingerprint — op, mesh dim,
        shapes (not for an all-to-all, whose splits differ), dtypes, this group's call number, the
        training step, tag and call site — before it is issued; on a mismatch every rank raises
        `CollectiveMismatch` naming both sides."""
        self._seq += 1
        site = _call_site()
        shapes = () if op == "all_to_all" else tuple(tuple(t.shape) for t in tensors)
        print_ = (
            op,
            self.dim,
            shapes,
            tuple(str(t.dtype) for t in tensors),
            self._seq,
            _DEBUG["step"],
            tag,
            site,
        )
        digest = int.from_bytes(
            hashlib.blake2b(repr(print_).encode(), digest_size=8).digest(), "little", signed=True
        )
        mine = torch.tensor(
            [digest], dtype=torch.int64, device="cpu"
        )  # the gloo side group: CPU by design
        every = torch.empty(self.size, dtype=torch.int64, device="cpu")
        _all_gather_flat(every, mine, group=self._side)
        if bool((every != digest).any()):
            prints: list = [None] * self.size
            dist.all_gather_object(prints, print_, group=self._side)
            raise CollectiveMismatch(_mismatch_message(self.dim, prints))

    def _record(
        self, op: str, tensor: torch.Tensor, tag: str, numel: int | None = None
    ) -> CommTiming | None:
        if self.log.enabled:
            return self.log.record(op, self.dim, tensor, self.size, tag, numel)
        return None

    def _begin(
        self,
        op: str,
        tensors: tuple[torch.Tensor, ...],
        logged: torch.Tensor,
        tag: str,
        agreed: tuple[torch.Tensor, ...] | None = None,
    ) -> CommTiming | None:
        """What every collective does before it is issued: its tensors' devices checked, in debug
        mode the ranks' agreement (`_agree`) on the ``agreed`` tensors (default all; an uneven
        collective's rank-local part differs by design), and the call logged by its `logged`
        buffer."""
        self._check(op, *tensors)
        if self._side is not None:
            self._agree(op, tensors if agreed is None else agreed, tag)
        return self._record(op, logged, tag)

    def _issued(self, timing: CommTiming | None, work, async_op: bool):
        """The call's result; while tracing, a synchronous call is complete now and an async one's
        work is timed."""
        if timing is None:
            return work
        if not async_op:
            now = self.log.clock.mark()
            timing.blocked(timing.start, now, not self.log.clock.device_events)
            return work
        return self.log.timed(work, [timing])

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: dist.ReduceOp = dist.ReduceOp.SUM,
        async_op: bool = False,
        tag: str = "",
    ):
        def issue():
            timing = self._begin("all_reduce", (tensor,), tensor, tag)
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
            return self._issued(timing, work, async_op)

        return collective_outputs([tensor], issue)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        op: dist.ReduceOp = dist.ReduceOp.SUM,
        async_op: bool = False,
        tag: str = "",
        sizes: Sequence[int] | None = None,
    ):
        """`input` is the full buffer (N·len(output)); `output`, maybe this rank's slice of `input`,
        gets its shard. ``sizes``: uneven shards, rank r's part of `input` is the next ``sizes[r]``
        elements (whole-parameter owners, docs/design.md#muon-under-zero): torch's list form, which
        gloo runs as one collective and NCCL as a group of reduces; logged as one reduce-scatter of
        the whole buffer."""

        def issue():
            agreed = (input,) if not _even(sizes) else None
            timing = self._begin("reduce_scatter", (output, input), input, tag, agreed)
            if _even(sizes):
                work = _reduce_scatter_flat(
                    output, input, op=op, group=self.group, async_op=async_op
                )
            else:
                parts = list(input.split(list(sizes)))
                work = dist.reduce_scatter(
                    output, parts, op=op, group=self.group, async_op=async_op
                )
            return self._issued(timing, work, async_op)

        return collective_outputs([output], issue)

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        tag: str = "",
        sizes: Sequence[int] | None = None,
    ):
        """`output` is the full buffer (N·len(input)), filled with every rank's `input` (which may
        be its slice). ``sizes``: uneven parts, rank r's `input` is ``sizes[r]`` elements landing
        at their sum before r: NCCL's list form (a group of broadcasts), on gloo (whose list form
        wants equal parts) one asynchronous broadcast per rank with a part, in rank order; logged
        as one all-gather of the whole buffer."""

        def issue():
            agreed = (output,) if not _even(sizes) else None
            timing = self._begin("all_gather", (output, input), output, tag, agreed)
            if _even(sizes):
                work = _all_gather_flat(output, input, group=self.group, async_op=async_op)
            else:
                work = self._uneven_all_gather(output, input, list(sizes), async_op)
            return self._issued(timing, work, async_op)

        return collective_outputs([output], issue)

    def _uneven_all_gather(
        self, output: torch.Tensor, input: torch.Tensor, sizes: list[int], async_op: bool
    ):
        parts = list(output.split(sizes))
        if self.device.type != "cpu":
            return dist.all_gather(parts, input, group=self.group, async_op=async_op)
        mine = parts[self.rank]
        if mine.numel() and mine.data_ptr() != input.data_ptr():
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(output):
                mine.copy_(input)  # (the collective's write, as NCCL's would be: no new version)
        works = [
            dist.broadcast(part, src=self.global_rank(r), group=self.group, async_op=True)
            for r, part in enumerate(parts)
            if part.numel()
        ]
        work = AllOf(works)
        if not async_op:
            work.wait()
            return None
        return work

    def broadcast(
        self, tensor: torch.Tensor, src_group_rank: int = 0, async_op: bool = False, tag: str = ""
    ):
        def issue():
            timing = self._begin("broadcast", (tensor,), tensor, tag)
            src = self.global_rank(src_group_rank)
            work = dist.broadcast(tensor, src=src, group=self.group, async_op=async_op)
            return self._issued(timing, work, async_op)

        return collective_outputs([tensor], issue)

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        async_op: bool = False,
        tag: str = "",
    ):
        def issue():
            timing = self._begin("all_to_all", (output, input), input, tag)
            work = dist.all_to_all_single(
                output,
                input,
                output_split_sizes,
                input_split_sizes,
                group=self.group,
                async_op=async_op,
            )
            return self._issued(timing, work, async_op)

        return collective_outputs([output], issue)

    def p2p_semantics(self) -> str:
        """How this group's point-to-point messages complete (`P2P_SEMANTICS`): "buffered" for gloo
        on CPU (every op progresses on its own, a batch returns one work per op), "rendezvous"
        otherwise (NCCL: a send completes only against the peer's matching receive, a pair's
        messages match by order, a batch is one work)."""
        return "buffered" if self.device.type == "cpu" else "rendezvous"

    def batch_p2p(
        self,
        ops: Sequence[tuple[str, torch.Tensor, int]],
        tag: str = "",
        expect: Sequence[tuple[tuple[int, ...], torch.dtype]] | None = None,
    ) -> P2PBatch:
        """Issue ("send"|"recv", tensor, peer_group_rank) ops as one `batch_isend_irecv`.
        ``expect``: the shape and dtype each op must have (the peer allocated the same), checked
        before anything is sent. (Inside a selective-op recomputation nothing is sent: the
        receives get the forward's messages, `ops.collective_outputs`.)"""
        recvs = [tensor for kind, tensor, _ in ops if kind == "recv"]
        issued = collective_outputs(recvs, lambda: self._batch_p2p(ops, tag, expect))
        return issued if isinstance(issued, P2PBatch) else P2PBatch([], 0)

    def _batch_p2p(
        self,
        ops: Sequence[tuple[str, torch.Tensor, int]],
        tag: str,
        expect: Sequence[tuple[tuple[int, ...], torch.dtype]] | None,
    ) -> P2PBatch:
        p2p, timings = [], []
        for i, (kind, tensor, peer) in enumerate(ops):
            self._check(kind, tensor)
            if expect is not None and (tuple(tensor.shape), tensor.dtype) != tuple(expect[i]):
                raise RuntimeError(
                    f"{kind} to/from '{self.dim}' rank {peer}: tensor {tuple(tensor.shape)} "
                    f"{tensor.dtype}, but the peer expects {tuple(expect[i][0])} {expect[i][1]}"
                )
            timings.append(self._record(kind, tensor, tag))
            fn = dist.isend if kind == "send" else dist.irecv
            p2p.append(dist.P2POp(fn, tensor, self.global_rank(peer), group=self.group))
        batch = P2PBatch(dist.batch_isend_irecv(p2p) if p2p else [], len(p2p))
        if (
            p2p and timings[0] is not None
        ):  # tracing: a work stamps the ops it covers (all of them if coalesced)
            batch.works = [
                self.log.timed(w, timings if batch.coalesced else [timings[i]])
                for i, w in enumerate(batch.works)
            ]
        return batch

    def all_gather_object(self, obj: object) -> list:
        """Small picklable objects (e.g. timing records) from every rank of the group; not
        logged."""
        out: list = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: object, dst_group_rank: int = 0) -> list | None:
        """Small picklable objects from every rank, to ``dst_group_rank`` alone (None elsewhere);
        not logged."""
        out: list | None = [None] * self.size if self.rank == dst_group_rank else None
        dist.gather_object(obj, out, dst=self.global_rank(dst_group_rank), group=self.group)
        return out

    def barrier(self) -> None:
        dist.barrier(group=self.group)


@eager_region
def amax_over(comm: Comm, amax: torch.Tensor) -> torch.Tensor:
    """An FP8 scale's amax as the max over `comm`'s ranks, each holding a slice of the operand
    (`float8.split_scope`; docs/design.md#fp8-training): one all-reduce (MAX, exact in fp32) of a
    scalar or a vector of per-slice amaxes, on the device."""
    exact = amax.float()
    comm.all_reduce(exact, op=dist.ReduceOp.MAX, tag="fp8_amax")
    return exact.to(amax.dtype)
