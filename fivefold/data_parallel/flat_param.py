"""`FlatParam`: a bucket's (ZeRO-0/1/2) or unit's (ZeRO-3) parameters as views of one flat buffer.

ZeRO (docs/design.md#model-state-memory): every rank owns a contiguous 1/N shard of each buffer
(padded to a multiple of N), keeps fp32 master weights and optimizer state only for it and receives
only its shard of the averaged gradient. Parameters are ordered by optimizer group (each group
contiguous in a shard). ``full``: the whole buffer in compute dtype, parameters are views into it;
ZeRO-3 frees its storage between uses (``untyped_storage().resize_(0)``) and gathers into it again,
so tensors autograd saved stay valid — or, with constant buffers (ZeRO-R), ``full`` becomes a view
of a gather slot it keeps for the run (`use_storage`), shared with units never gathered at the same
time. ``local`` is this rank's shard, ``master`` its fp32 copy: with ``offload`` (ZeRO-Offload) a
host buffer of its own (pinned on an accelerator; never ``local``, even for fp32), updated on the
host and copied back by `write_back`. The master shard is cut into the optimizer's tensors by a
`Segmentation` (docs/design.md#mechanisms, the optimizer on shards): `WholeShards` (one per
optimizer group, fused kernels) where the master lives on an accelerator, `CacheSizedSegments` of 1
MiB on the CPU (`segmentation_for`).

ZeRO++ (docs/design.md#zero-qwz-qgz-hpz) changes only how a ZeRO-3 gather travels (`_start_gather`):
qwZ (``quant_block``) all-gathers every shard as block-wise int8 (`quantize`) and dequantises into
``full``, the stored shards keeping their dtype; hpZ (``secondary``, a `Comm` over a few consecutive
ranks, e.g. a node) keeps this rank's slice of each forward gather as ``secondary`` and gathers a
backward's weights from those slices inside that group alone.

Whole-parameter owners (``owners``, docs/design.md#muon-under-zero, `ownership`): for an optimizer
that is not elementwise (Muon) each parameter belongs to one rank; the buffer is ordered by owner,
each rank's shard is the run of its own parameters (``shard_sizes``: unequal, no padding), each
owned parameter is one optimizer tensor of its own shape, and the gathers pass the sizes to the
uneven collectives.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fivefold.data_parallel import offload as host
from fivefold.data_parallel.buckets import FlatLayout
from fivefold.data_parallel.ownership import owner_bounds
from fivefold.data_parallel.quantize import dequantize_packed, packed_bytes, quantize_rows_into
from fivefold.distributed.comm import Comm, amax_over
from fivefold.float8 import E4M3, GATHERED, Float8, quantize, scale_from_amax

GroupOf = Callable[[str, nn.Parameter], int]
# A parameter's value to start from (default: its own data); ZeRO's meta-device path draws it from
# the model's init.
ValueOf = Callable[[str, nn.Parameter], torch.Tensor]

# Optimizer pieces of at most 1 MiB of fp32 on the CPU (`CacheSizedSegments`): an elementwise
# optimizer's per-tensor loop makes ~10 passes over (param, grad, m, v), which stay in cache for
# 1 MiB but stream from memory for a 25 MiB bucket (docs/benchmarks.md#the-optimizer-step).
OPTIMIZER_CHUNK = 2**18


# -- how a shard is cut into optimizer tensors, and the kernels that step them ---------------------


class Segmentation(Protocol):
    """How each optimizer group's part of a shard becomes optimizer tensors (master parameters),
    and the inner optimizer's kernel options that go with it (docs/design.md#mechanisms)."""

    def cut(self, a: int, b: int) -> list[tuple[int, int]]:
        """The pieces [a, b) of one group's part of the shard (local coordinates; a < b)."""
        ...

    def kernel_options(self, optimizer_class: type, device: torch.device) -> dict[str, Any]:
        """Defaults for the inner optimizer over these pieces on `device` (a user's own win)."""
        ...


def _takes(optimizer_class: type, option: str) -> bool:
    return option in inspect.signature(optimizer_class).parameters


def fused_devices() -> list[str]:
    """The device types torch's fused optimizer kernels run on (read at each call)."""
    from torch.optim import optimizer as torch_optimizer

    supported = getattr(torch_optimizer, "_get_fused_kernels_supported_devices", None)
    return list(supported()) if supported is not None else ["cuda"]


@dataclass(frozen=True)
class WholeShards:
    """One optimizer tensor per group per flat buffer, stepped by a fused kernel where the
    optimizer class and the device have one (AdamW on CUDA: one launch per group for every
    buffer), else by the multi-tensor (`foreach`) kernels; the CPU keeps the per-tensor loop."""

    def cut(self, a: int, b: int) -> list[tuple[int, int]]:
        return [(a, b)]

    def kernel_options(self, optimizer_class: type, device: torch.device) -> dict[str, Any]:
        if device.type == "cpu":
            return {}
        if _takes(optimizer_class, "fused") and device.type in fused_devices():
            return {"fused": True}
        return {"foreach": True} if _takes(optimizer_class, "foreach") else {}


@dataclass(frozen=True)
class CacheSizedSegments:
    """Pieces of at most `chunk` elements, stepped one tensor at a time (torch's CPU default):
    each piece's passes stay in cache."""

    chunk: int = OPTIMIZER_CHUNK

    def cut(self, a: int, b: int) -> list[tuple[int, int]]:
        return [(c, min(c + self.chunk, b)) for c in range(a, b, self.chunk)]

    def kernel_options(self, optimizer_class: type, device: torch.device) -> dict[str, Any]:
        return {}


def segmentation_for(device: torch.device | str) -> Segmentation:
    """The segmentation of a master shard on `device`: cache-sized segments on the CPU (host
    masters under offload included), whole shards elsewhere (an accelerator; `meta`, standing in
    for one when a rank is planned)."""
    return CacheSizedSegments() if torch.device(device).type == "cpu" else WholeShards()


# -- ZeRO-3's FP8 gather (docs/design.md#fp8-training) ------------------------------------------

# bytes: every parameter of an FP8 gather starts on a 16-byte boundary (CUDA's FP8 GEMMs want it)
ALIGN = 16


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Float8Units:
    """Which parameters of a ZeRO-3 unit travel in FP8 (``gathered_in_float8``: the FP8 linears'
    weights) and over which group a weight's amax is the max besides its owner (``amax_comm``: tp,
    whose ranks each hold a slice of it)."""

    gathered_in_float8: Callable[[str], bool]
    amax_comm: Comm | None = None


@dataclass(frozen=True)
class Float8Layout:
    """Where each parameter of a whole-parameter unit lies in its FP8 gather's bytes: rank r's part
    is its parameters in order, each at a 16-byte boundary — an FP8 weight as its numel bytes of
    e4m3 and, 16-aligned after them, its 4-byte fp32 scale; any other parameter in the compute
    dtype (`formulas.float8_gather_bytes`)."""

    offsets: list[int]
    scales: list[int | None]
    rank_starts: list[int]
    rank_bytes: list[int]

    @property
    def total(self) -> int:
        return sum(self.rank_bytes)

    @classmethod
    def of(cls, flat: FlatParam, in_float8: Callable[[str], bool]) -> Float8Layout:
        element = flat.full.element_size()
        bounds = flat.layout.bounds or [0, flat.layout.padded_numel]
        offsets: list[int] = []
        scales: list[int | None] = []
        rank_starts, rank_bytes, at = [], [], 0
        slots = iter(flat.layout.slots)
        slot = next(slots, None)
        for r in range(len(bounds) - 1):
            rank_starts.append(at)
            while slot is not None and slot.offset < bounds[r + 1]:
                offsets.append(at)
                if in_float8(slot.name):
                    at += _aligned(slot.numel)
                    scales.append(at)
                    at += ALIGN
                else:
                    at += _aligned(slot.numel * element)
                    scales.append(None)
                slot = next(slots, None)
            rank_bytes.append(at - rank_starts[-1])
        return cls(offsets, scales, rank_starts, rank_bytes)


class FlatParam:
    def __init__(
        self,
        index: int,
        named_params: Sequence[tuple[str, nn.Parameter]],
        comm: Comm,
        *,
        group_of: GroupOf,
        param_dtype: torch.dtype,
        sharded: bool,
        reshard: bool = False,
        value_of: ValueOf | None = None,
        quant_block: int | None = None,
        secondary: Comm | None = None,
        master_home: host.MasterHome | None = None,
        segmentation: Segmentation | None = None,
        owners: Mapping[str, int] | None = None,
        float8: Float8Units | None = None,
    ) -> None:
        self.index = index
        self.comm = comm
        self.sharded = sharded and comm.size > 1
        self.world = comm.size if self.sharded else 1
        self.rank = comm.rank if self.sharded else 0
        # whole-parameter owners (`ownership`; a non-elementwise optimizer): parameters ordered by
        # owner, then group; each rank's shard is the run of the parameters it owns
        self.whole_params = owners is not None
        if self.whole_params and (
            quant_block is not None or (secondary is not None and secondary.size > 1)
        ):
            raise ValueError(
                "whole-parameter shards (a non-elementwise optimizer such as Muon) are gathered "
                "unevenly: qwZ's int8 gathers and hpZ's secondary copy assume equal shards"
            )
        owner_of = (lambda n: owners[n] if self.sharded else 0) if owners is not None else None
        if owner_of is None:
            ordered = sorted(named_params, key=lambda item: group_of(*item))  # groups contiguous
        else:
            ordered = sorted(named_params, key=lambda item: (owner_of(item[0]), group_of(*item)))
        self.names = [n for n, _ in ordered]
        self.params = [p for _, p in ordered]
        self.group_ids = [group_of(n, p) for n, p in ordered]
        bounds = None
        if owner_of is not None:
            owned = [owner_of(n) for n in self.names]
            bounds = owner_bounds(owned, [p.numel() for p in self.params], self.world)
        self.layout = FlatLayout(ordered, pad_to=1 if bounds else self.world, bounds=bounds)
        self.start, self.end = self.layout.shard_range(self.rank, self.world)
        # every rank's shard size where they differ (the uneven collectives' sizes), else None
        self.shard_sizes = self.layout.shard_sizes if self.sharded else None
        self.param_dtype = param_dtype
        self.reshard_enabled = reshard and self.sharded
        device = self.params[0].device
        make = (
            torch.empty if self.reshard_enabled else torch.zeros
        )  # (ZeRO-3's is freed at once, below)
        self.full = make(self.layout.padded_numel, dtype=param_dtype, device=device)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self._empty = torch.empty(0, dtype=param_dtype, device=device)
        self._gather_work = None
        self._after_gather: Callable[[], None] | None = None
        # ZeRO++ (ZeRO-3 gathers only): qwZ's block size (None: gathers in the compute dtype), hpZ's
        # group and copy
        self.quant_block = quant_block if self.reshard_enabled else None
        self.secondary_comm = (
            secondary
            if self.reshard_enabled and secondary is not None and secondary.size > 1
            else None
        )
        # hpZ: this rank's 1/|secondary| of the last forward gather
        self.secondary: torch.Tensor | None = None
        # False after the shard changed (write_back): the next gather is a full one
        self._secondary_fresh = False
        self.owns_storage = True  # False once `full` views a shared gather slot (constant buffers)
        if self.reshard_enabled:  # ZeRO-3 holds only its shard: the full buffer grows when gathered
            self.full.untyped_storage().resize_(0)
            self.local = torch.zeros(self.shard_numel, dtype=param_dtype, device=device)
        else:
            self.local = self.full[self.start : self.end]
        self.is_unsharded = not self.reshard_enabled
        # ZeRO-3's FP8 gather (docs/design.md#fp8-training): the unit travels and stays gathered as
        # bytes, its FP8 linears' weights cast by their owners (`Float8Units`); None: in `full`
        self.float8 = float8 if self.reshard_enabled and float8 is not None else None
        self.float8_layout: Float8Layout | None = None
        self.gathered: torch.Tensor | None = None
        if self.float8 is not None:
            if not self.whole_params:
                raise ValueError("an FP8-gathered unit needs whole-parameter owners")
            self.float8_layout = Float8Layout.of(self, self.float8.gathered_in_float8)
            self.gathered = torch.empty(self.float8_layout.total, dtype=torch.uint8, device=device)
            self._gathered_bytes = self.gathered.untyped_storage().nbytes()
            self.gathered.untyped_storage().resize_(0)
            one = torch.zeros((), dtype=param_dtype, device=device)
            self._stand_ins = [one.expand(slot.shape) for slot in self.layout.slots]
        # The fp32 master comes from the values as given (fp32 for a fp32 model), never from the
        # 16-bit copy: wrapping must not round the weights. Where it lives is the policy's
        # (`offload.MasterOnDevice`, or ZeRO-Offload's `MasterOnHost`).
        self.master_home = master_home or host.MasterOnDevice()
        self.master = self.master_home.make_master(self.local, param_dtype, device)
        value_of = value_of or (lambda name, p: p.detach())
        with torch.no_grad():
            for i, (name, p) in enumerate(zip(self.names, self.params)):
                slot = self.layout.slots[i]
                needed = not self.reshard_enabled or (
                    slot.offset < self.end and slot.offset + slot.numel > self.start
                )
                if needed:  # (ZeRO-3 does not even draw a value that falls outside its shard)
                    value = value_of(
                        name, p
                    )  # one parameter at a time: the peak is the shard plus one value
                    if self.reshard_enabled:
                        self._fill_shard(self.local, i, value)
                    else:
                        self.layout.view(self.full, i).copy_(value)
                    if self.master is not self.local:
                        self._fill_shard(self.master, i, value)
                    del value
                p.data = self._empty if self.reshard_enabled else self.layout.view(self.full, i)
        # how the master shard is cut into optimizer tensors: by where it lives
        self.segmentation = segmentation or segmentation_for(self.master.device)
        self.segments = self._whole_segments() if self.whole_params else self._group_segments()
        # a whole parameter's optimizer tensor has its shape (Muon needs the matrix)
        self.segment_shapes: list[torch.Size] | None = (
            [self.layout.slots[i].shape for i in self._owned_slots()] if self.whole_params else None
        )
        self.master_params = [
            nn.Parameter(self._shaped(self.master[a:b], k))
            for k, (_, a, b) in enumerate(self.segments)
        ]
        self._split_sizes, self._pieces = self._split_plan()
        self.grad_shard: torch.Tensor | None = None
        # constant buffers: where reduce-scatters land
        self.grad_shard_buffer: torch.Tensor | None = None

    def _fill_shard(self, shard: torch.Tensor, i: int, value: torch.Tensor) -> None:
        """Copy the part of parameter `i`'s `value` that falls in this rank's [start, end) into
        `shard`."""
        slot = self.layout.slots[i]
        a, b = max(slot.offset, self.start), min(slot.offset + slot.numel, self.end)
        if a < b:
            shard[a - self.start : b - self.start].copy_(
                value.reshape(-1)[a - slot.offset : b - slot.offset]
            )

    def shard_of(self, tensors: Sequence[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
        """This rank's [start, end) of the flat layout filled from `tensors` (one per parameter,
        None = zeros)."""
        shard = torch.zeros(self.shard_numel, dtype=dtype, device=self.full.device)
        with torch.no_grad():
            for i, t in enumerate(tensors):
                if t is not None:
                    self._fill_shard(shard, i, t)
        return shard

    def _group_segments(self) -> list[tuple[int, int, int]]:
        """(group, a, b): each group's part [a, b) of this rank's shard (local coordinates), cut by
        the `segmentation`."""
        segments = []
        for g in sorted(set(self.group_ids)):
            members = [i for i, gid in enumerate(self.group_ids) if gid == g]
            lo = self.layout.slots[members[0]].offset
            last = self.layout.slots[members[-1]]
            hi = last.offset + last.numel
            a, b = max(lo, self.start), min(hi, self.end)
            if a < b:
                for c, d in self.segmentation.cut(a - self.start, b - self.start):
                    segments.append((g, c, d))
        return segments

    def _owned_slots(self) -> list[int]:
        """Whole-parameter layout: the slots inside this rank's shard (all of each, by
        construction)."""
        return [
            i
            for i, slot in enumerate(self.layout.slots)
            if self.start <= slot.offset and slot.offset + slot.numel <= self.end and slot.numel
        ]

    def _whole_segments(self) -> list[tuple[int, int, int]]:
        """(group, a, b): one optimizer tensor per owned parameter, whole."""
        out = []
        for i in self._owned_slots():
            slot = self.layout.slots[i]
            a = slot.offset - self.start
            out.append((self.group_ids[i], a, a + slot.numel))
        return out

    def _shaped(self, piece: torch.Tensor, k: int) -> torch.Tensor:
        """Segment k's 1-D piece, as its parameter's shape when segments are whole parameters."""
        return piece if self.segment_shapes is None else piece.view(self.segment_shapes[k])

    def _split_plan(self) -> tuple[list[int], list[int]]:
        """The sizes one `split_with_sizes` of a shard-sized tensor cuts (the segments, and the gaps
        and padding between and after them) and which of its pieces are the segments, in order."""
        sizes, pieces, at = [], [], 0
        for _, a, b in self.segments:
            if a > at:
                sizes.append(a - at)
            pieces.append(len(sizes))
            sizes.append(b - a)
            at = b
        if at < self.shard_numel:
            sizes.append(self.shard_numel - at)
        return sizes, pieces

    def segment_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """One view of `shard` (a tensor of this rank's shard size) per optimizer segment, cut by a
        single operation (none when one segment is the whole shard)."""
        if not self._pieces:
            return []
        if len(self._split_sizes) == 1:
            return [self._shaped(shard, 0)]
        views = shard.split_with_sizes(self._split_sizes)
        return [self._shaped(views[i], k) for k, i in enumerate(self._pieces)]

    @property
    def shard_numel(self) -> int:
        return self.end - self.start

    def unshard(self, async_op: bool = False, backward: bool = False) -> None:
        """Re-grow ``full`` and all-gather every rank's ``local`` into it (no-op if already there).
        ``backward``: the gather before the unit's backward (hpZ takes it from the secondary
        copies)."""
        if self.is_unsharded:
            return
        if self._gather_work is None:
            if self.float8 is not None:
                self.gathered.untyped_storage().resize_(self._gathered_bytes)
                self._point_into_gathered()
            else:
                if self.owns_storage:
                    self.full.untyped_storage().resize_(self._full_bytes)
                for i, p in enumerate(self.params):
                    p.data = self.layout.view(self.full, i)
            self._gather_work, self._after_gather = self._start_gather(backward)
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
            if self._after_gather is not None:
                self._after_gather()
                self._after_gather = None
            self.is_unsharded = True

    def _start_gather(self, backward: bool) -> tuple[object, Callable[[], None] | None]:
        """Launch the gather of ``full``; returns its work and what to do once it is waited. Plain:
        the compute-dtype shards over ``comm``. hpZ, backward, secondary copy fresh: the secondary
        slices over the secondary group, unquantised (as ZeRO++: the values are the forward's,
        dequantised if qwZ, so both passes see the same weights). qwZ otherwise: packed int8
        shards + scales over ``comm``, dequantised into ``full``."""
        tag = f"unit{self.index}"
        if self.float8 is not None:
            return self._start_float8_gather(tag), None
        if backward and self.secondary_comm is not None and self._secondary_fresh:
            return self.secondary_comm.all_gather(
                self.full, self.secondary, async_op=True, tag=tag
            ), None
        keep = self._keep_secondary if self.secondary_comm is not None else None
        if self.quant_block is None:
            gather = self.comm.all_gather(
                self.full, self.local, async_op=True, tag=tag, sizes=self.shard_sizes
            )
            return gather, keep
        block, n = self.quant_block, self.shard_numel
        chunk = packed_bytes(n, block)
        send = quantize_rows_into(
            self.local.view(1, n),
            block,
            torch.empty(1, chunk, dtype=torch.int8, device=self.local.device),
        )
        received = torch.empty(self.world, chunk, dtype=torch.int8, device=self.local.device)
        work = self.comm.all_gather(received.view(-1), send.view(-1), async_op=True, tag=tag)

        def dequantize(
            _sent: torch.Tensor = send,
        ) -> None:  # (holds the send buffer until the gather is done)
            with torch.no_grad():
                self.full.view(self.world, n).copy_(dequantize_packed(received, n, block))
            if keep is not None:
                keep()

        return work, dequantize

    def _point_into_gathered(self) -> None:
        """FP8 gather: each parameter a view of the gathered bytes — an FP8 linear's weight as its
        `Float8` (data and scale: `float8.GATHERED`, what `float8.Float8Matmul` uses), its
        ``.data`` a stand-in of its shape and dtype (one element, read by nothing: the gradient
        still arrives in the parameter's shape); the others in their dtype."""
        layout = self.float8_layout
        for i, p in enumerate(self.params):
            slot = self.layout.slots[i]
            at = layout.offsets[i]
            if layout.scales[i] is None:
                n = slot.numel * self.full.element_size()
                p.data = self.gathered[at : at + n].view(self.param_dtype).view(slot.shape)
            else:
                data = self.gathered[at : at + slot.numel].view(E4M3).view(slot.shape)
                s = layout.scales[i]
                scale = self.gathered[s : s + 4].view(torch.float32).view(())
                p.data = self._stand_ins[i]
                setattr(p, GATHERED, Float8(data, scale))

    def _start_float8_gather(self, tag: str) -> object:
        """This rank casts the FP8 weights it owns — amax of the whole (TP-local) weight, the max
        over tp (`Float8Units.amax_comm`: one all-reduce of their amaxes), the tensorwise scale —
        into its part of the gathered bytes beside its other parameters' bytes, then every rank's
        part is all-gathered (uneven: the owners' parts differ in size)."""
        layout = self.float8_layout
        mine = [i for i in range(len(self.params)) if self._owned(i)]
        cast = [i for i in mine if layout.scales[i] is not None]
        # The writes are the gather's, as a collective's would be: autograd's saved views of the
        # forward's gather (the FP8 weights a backward reads) must not see a new version.
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.gathered):
            if cast:
                amax = torch.stack([self._owned_local(i).abs().amax().float() for i in cast])
                if self.float8.amax_comm is not None and self.float8.amax_comm.size > 1:
                    amax = amax_over(self.float8.amax_comm, amax)
                scales = scale_from_amax(amax, E4M3, power_of_2=False)
            for i in mine:
                slot, at = self.layout.slots[i], layout.offsets[i]
                local = self._owned_local(i)
                if layout.scales[i] is None:
                    n = slot.numel * self.full.element_size()
                    self.gathered[at : at + n].view(self.param_dtype).copy_(local)
                else:
                    scale = scales[cast.index(i)]
                    out = self.gathered[at : at + slot.numel].view(E4M3)
                    out.copy_(quantize(local, scale, E4M3))
                    at = layout.scales[i]
                    self.gathered[at : at + 4].view(torch.float32).copy_(scale.reshape(1))
        lo = layout.rank_starts[self.rank]
        part = self.gathered[lo : lo + layout.rank_bytes[self.rank]]
        return self.comm.all_gather(
            self.gathered, part, async_op=True, tag=tag, sizes=layout.rank_bytes
        )

    def _owned(self, i: int) -> bool:
        slot = self.layout.slots[i]
        return self.start <= slot.offset < self.end

    def _owned_local(self, i: int) -> torch.Tensor:
        """Parameter i of this rank's shard (whole-parameter layout), flat, in the compute dtype."""
        slot = self.layout.slots[i]
        return self.local[slot.offset - self.start : slot.offset - self.start + slot.numel]

    def gathered_nbytes(self, param_bytes: int) -> int:
        """Bytes of this unit gathered: its FP8 byte layout (`Float8Layout.total`), else the
        padded buffer in the compute dtype."""
        if self.float8_layout is not None:
            return self.float8_layout.total
        return self.layout.padded_numel * param_bytes

    def _keep_secondary(self) -> None:
        """hpZ: keep this rank's slice of the freshly gathered ``full`` (no communication)."""
        size = self.layout.padded_numel // self.secondary_comm.size
        start = self.secondary_comm.rank * size
        if self.secondary is None:
            self.secondary = torch.empty(size, dtype=self.param_dtype, device=self.full.device)
        with torch.no_grad():
            self.secondary.copy_(self.full[start : start + size])
        self._secondary_fresh = True

    @property
    def gathering(self) -> bool:
        return self._gather_work is not None

    def reshard(self) -> None:
        if self.reshard_enabled and (self.is_unsharded or self._gather_work is not None):
            self.wait_unshard()
            if self.float8 is not None:
                self.gathered.untyped_storage().resize_(0)
            elif self.owns_storage:
                self.full.untyped_storage().resize_(0)
            # Parameters point at an empty tensor while sharded, so stray use fails loudly instead
            # of reading freed memory; views saved by autograd keep the storage and see it regrown.
            for p in self.params:
                p.data = self._empty
                if self.float8 is not None:
                    setattr(p, GATHERED, None)
            self.is_unsharded = False

    def use_storage(self, slot: torch.Tensor) -> None:
        """ZeRO-3 constant buffers: gather into `slot` (at least ``padded_numel`` elements, shared
        with units never gathered together with this one) from now on instead of re-growing a
        storage of its own. Only while sharded and no autograd graph holds views of the old storage
        (the engine calls it between steps)."""
        if not self.reshard_enabled or self.is_unsharded or self.gathering:
            raise RuntimeError(
                f"unit {self.index}: a gather slot can only be assigned to a sharded ZeRO-3 unit"
            )
        self.full = slot[: self.layout.padded_numel]
        self.owns_storage = False

    def persistent_grad_shard(self, dtype: torch.dtype) -> torch.Tensor:
        """Constant buffers: the gradient shard's buffer, allocated once (reduce-scatters land in it
        directly)."""
        if self.grad_shard_buffer is None or self.grad_shard_buffer.dtype != dtype:
            self.grad_shard_buffer = torch.empty(
                self.shard_numel, dtype=dtype, device=self.full.device
            )
        return self.grad_shard_buffer

    def accumulate_grad(self, shard_grad: torch.Tensor) -> None:
        if self.grad_shard is None:
            self.grad_shard = shard_grad
        elif (
            0
            != self.grad_shard.untyped_storage().data_ptr()
            == shard_grad.untyped_storage().data_ptr()
        ):
            raise RuntimeError(
                f"flat buffer {self.index}: the new gradient shard aliases the accumulated one"
            )
        else:
            self.grad_shard += shard_grad

    @property
    def offload(self) -> bool:
        """ZeRO-Offload: the fp32 master shard (and the optimizer state) on the host."""
        return self.master_home.on_host

    @property
    def host_grad(self) -> torch.Tensor | None:
        """Offload: the fp32 gradient shard on the host (once the first step allocated it)."""
        return self.master_home.grad

    @property
    def host_staging(self) -> torch.Tensor | None:
        """Offload on an accelerator: the cast shard before its copy to the device."""
        return self.master_home.staging

    def master_grad_buffer(self) -> torch.Tensor | None:
        """Where the optimizer reads this shard's gradient (offload: a host buffer, allocated once;
        None: the device gradient itself)."""
        return self.master_home.grad_buffer(self.shard_numel, self.local.device)

    def write_back(self) -> None:
        """Copy the updated fp32 master shard into the compute-dtype shard (if they differ;
        offloaded: host to device, cast on the host first on an accelerator)."""
        # hpZ: the shard changed (a step, a load); the next forward gathers afresh
        self._secondary_fresh = False
        if self.master is self.local:
            return
        with torch.no_grad():
            self.master_home.write_back(self.local, self.master)

    def gather_params(self):
        """ZeRO-1/2 after the step: all-gather the updated shards in place; returns the work."""
        return self.comm.all_gather(
            self.full, self.local, async_op=True, tag=f"bucket{self.index}", sizes=self.shard_sizes
        )

    def full_master(self) -> dict[str, torch.Tensor]:
        """Every parameter of this buffer at fp32 master precision, gathered from all shards."""
        if self.sharded:  # (an offloaded master travels to the group's device for the gather)
            flat = torch.empty(
                self.layout.padded_numel, dtype=torch.float32, device=self.full.device
            )
            master = self.master.detach().to(self.full.device)
            self.comm.all_gather(flat, master, tag="state_dict", sizes=self.shard_sizes)
        else:
            flat = self.master.detach()
        return {name: self.layout.view(flat, i).clone() for i, name in enumerate(self.names)}
