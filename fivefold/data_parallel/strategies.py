"""The ZeRO stages as strategy objects (docs/design.md#model-state-memory,
docs/design.md#data-parallel-traffic): what a stage shards, what it does with a bucket when the
reducer says so (`buckets.BucketStrategy`), and what it costs — model-state bytes per rank
(`flat_state_bytes`), buffers alive at the backward's peak (`transient_bytes`), collective bytes per
step (`collectives`): `fivefold.plan.memory` and `fivefold.plan.traffic` read them here.

| strategy                         | stage | also sharded    | per step                        |
|----------------------------------|-------|-----------------|---------------------------------|
| `AllReduce`                      | 0     | nothing (DDP)   | all-reduce Ψ                    |
| `ReduceScatter(keep_full=True)`  | 1     | optimizer state | reduce-scatter Ψ + all-gather Ψ |
| `ReduceScatter(keep_full=False)` | 2     | + gradients     | reduce-scatter Ψ + all-gather Ψ |
| `ShardedParams(gather=...)`      | 3     | + parameters    | all-gather 2Ψ + reduce-scatter Ψ |

A sharded stage's gradients travel by a `transports` object (plain, HSDP's replicas, qgZ's int8);
ZeRO-3's gathers by a `Gather` (`PlainGather`, qwZ's `Int8Gather`, hpZ's `SecondaryGather`); buffers
follow a `policies` object (fresh or constant). ZeRO-2 frees non-owned gradients in
`ReduceScatter._keep` (the reducer's `on_bucket_done`): only the shard is kept, and the reducer then
releases the bucket's full buffer — during backward, ``inflight_buckets`` at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fivefold import formulas
from fivefold.data_parallel.buckets import BucketStrategy, GradBucket, assign_buckets
from fivefold.data_parallel.flat_param import FlatParam, Float8Units, GroupOf, ValueOf
from fivefold.data_parallel.fsdp import FSDPHooks, UnitSpec, find_unit_modules
from fivefold.data_parallel.offload import MasterHome
from fivefold.data_parallel.ownership import balance_owners
from fivefold.data_parallel.policies import FreshBuffers
from fivefold.data_parallel.transports import Collective, GradTransport
from fivefold.distributed.comm import Comm

__all__ = [
    "AllReduce",
    "Collective",
    "FlatSpec",
    "Float8Gather",
    "Gather",
    "Int8Gather",
    "PlainGather",
    "ReduceScatter",
    "SecondaryGather",
    "ShardedParams",
    "Stage",
]


@dataclass(frozen=True)
class FlatSpec:
    """What every flat buffer of an engine is built with (`FlatParam`'s keywords besides its
    parameters)."""

    comm: Comm
    group_of: GroupOf
    param_dtype: torch.dtype
    value_of: ValueOf
    # where each flat's fp32 master lives: `offload.MasterOnDevice`, or ZeRO-Offload's
    # `MasterOnHost` (a class: one instance per flat, holding its host buffers)
    master_home: type[MasterHome]
    # which parameters a non-elementwise optimizer steps whole (Muon): a flat holding one gets
    # whole-parameter owners (`ownership`); None: every flat is cut into equal shards
    whole: Callable[[str, nn.Parameter], bool] | None = None

    def layout_kind(self, name: str, param: nn.Parameter) -> str | None:
        """What a bucket must not mix (`buckets.assign_buckets`): parameters stepped whole, or
        large ones cut into equal shards; a 1-D one (a norm) goes with either."""
        if self.whole is not None and self.whole(name, param):
            return "whole"
        return None if param.ndim < 2 else "shards"

    def owners(self, groups: list[list[tuple[str, nn.Parameter]]]) -> list[dict[str, int] | None]:
        """Per flat (its parameters): owners balanced over the shard group across every flat that
        holds a whole-stepped parameter (all of its parameters owned whole), None for the others."""
        whole = [self.whole is not None and any(self.whole(n, p) for n, p in g) for g in groups]
        sizes = [(n, p.numel()) for g, w in zip(groups, whole) if w for n, p in g]
        owner = balance_owners(sizes, self.comm.size) if sizes else {}
        return [{n: owner[n] for n, _ in g} if w else None for g, w in zip(groups, whole)]


# -- ZeRO-3's gathers (docs/design.md#zero-qwz-qgz-hpz), run by `FlatParam._start_gather` -----


@dataclass(frozen=True)
class PlainGather:
    """A unit's shards all-gathered in the compute dtype, in forward and again in backward."""

    quant_block = None  # (FlatParam's keywords)
    secondary = None

    def gather_bytes(self, padded: list[int], world: int, param_bytes: int) -> int:
        return formulas.zero3_gather_bytes(padded, world, param_bytes)

    def unit_bytes(self, flats: list[FlatParam], param_bytes: int) -> int:
        """One gather of every unit (`flats`)."""
        padded = [f.layout.padded_numel for f in flats]
        return self.gather_bytes(padded, flats[0].comm.size if flats else 1, param_bytes)

    def backward_gathers(
        self, comm: Comm, flats: list[FlatParam], param_bytes: int, micro_batches: int
    ) -> Collective:
        nbytes = micro_batches * self.unit_bytes(flats, param_bytes)
        return Collective(comm.dim, "all_gather", "backward", nbytes, comm.size)


@dataclass(frozen=True)
class Int8Gather(PlainGather):
    """qwZ: every shard all-gathered as a block-wise int8 chunk and dequantised into the unit."""

    block: int = 2048

    @property
    def quant_block(self) -> int:  # type: ignore[override]
        return self.block

    def gather_bytes(self, padded: list[int], world: int, param_bytes: int) -> int:
        return formulas.zero3_gather_bytes(padded, world, param_bytes, self.block)


@dataclass(frozen=True)
class SecondaryGather:
    """hpZ: ``forward`` gathers as it would alone and keeps this rank's 1/|comm| slice of each unit;
    a backward gathers from those slices inside ``comm`` (a few consecutive ranks, e.g. a node),
    unquantised."""

    comm: Comm
    forward: PlainGather = PlainGather()

    @property
    def quant_block(self) -> int | None:
        return self.forward.quant_block

    @property
    def secondary(self) -> Comm:
        return self.comm

    def gather_bytes(self, padded: list[int], world: int, param_bytes: int) -> int:
        return self.forward.gather_bytes(padded, world, param_bytes)

    def unit_bytes(self, flats: list[FlatParam], param_bytes: int) -> int:
        return self.forward.unit_bytes(flats, param_bytes)

    def backward_gathers(
        self, comm: Comm, flats: list[FlatParam], param_bytes: int, micro_batches: int
    ) -> Collective:
        g = self.comm.size
        padded = [f.layout.padded_numel for f in flats]
        nbytes = micro_batches * formulas.zero3_gather_bytes(padded, g, param_bytes)
        return Collective(self.comm.dim, "all_gather", "backward", nbytes, g)


@dataclass(frozen=True)
class Float8Gather:
    """ZeRO-3 with FP8 linears (tensorwise): a unit holding FP8 weights is all-gathered as bytes —
    each such weight cast to e4m3 once per gather by the rank that owns it whole, with its scale;
    the other parameters in the compute dtype (`flat_param.Float8Units`, `Float8Layout`). The
    master stays fp32; the FP8 linears use the gathered cast as it came (`float8.Float8Matmul`).
    Units without an FP8 weight gather as `PlainGather`."""

    units: Float8Units
    quant_block = None  # (FlatParam's keywords)
    secondary = None

    def unit_bytes(self, flats: list[FlatParam], param_bytes: int) -> int:
        """One gather of every unit: the FP8 units' byte layouts, the others in the compute dtype
        (`formulas.float8_gather_bytes`)."""
        return sum(f.gathered_nbytes(param_bytes) for f in flats)

    def backward_gathers(
        self, comm: Comm, flats: list[FlatParam], param_bytes: int, micro_batches: int
    ) -> Collective:
        nbytes = micro_batches * self.unit_bytes(flats, param_bytes)
        return Collective(comm.dim, "all_gather", "backward", nbytes, comm.size)


Gather = PlainGather | Int8Gather | SecondaryGather | Float8Gather


# -- the stages ------------------------------------------------------------------------------------


class Stage(BucketStrategy):
    """What every stage shares: flats built from buckets of parameters, buckets over the flats, a
    bucket reduced over ``divisor`` ranks (the shard group, × the replicas under HSDP; 1: nothing
    travels), the result kept."""

    number: int  # the ZeRO stage (`formulas.flat_model_state_bytes`' ``stage``)
    # the bucket's full gradient buffer lives for the run (GradBucket's keep_buffer)
    keep_full_grads = True
    grad_views = False  # ``param.grad`` is a view of the bucket (stage 0)
    defer_copy = False  # gradients copied in just before the launch (stage 3)

    def __init__(
        self,
        comm: Comm,
        *,
        divisor: int,
        grad_dtype: torch.dtype,
        buffers: FreshBuffers | None = None,
        bucket_mb: float = 25.0,
    ) -> None:
        self.comm, self.divisor, self.grad_dtype = comm, divisor, grad_dtype
        self.bucket_bytes = bucket_mb * 2**20  # (stages 0-2: flat buffers of about this size)
        self.buffers = buffers or FreshBuffers()
        self.flats: list[FlatParam] = []
        self.buckets: list[GradBucket] = []

    @property
    def sharded(self) -> bool:
        """Shards the optimizer state over ``comm`` (stage ≥ 1; the global norm sums over it)."""
        return self.number >= 1

    # -- layout

    def build_flats(
        self, module: nn.Module, named: list[tuple[str, nn.Parameter]], spec: FlatSpec, **_: Any
    ) -> list[FlatParam]:
        """Buckets of about `bucket_bytes` in reverse registration order, one flat buffer each."""
        groups = assign_buckets(named, self.bucket_bytes, spec.layout_kind)
        self.flats = [
            FlatParam(
                i,
                g,
                spec.comm,
                group_of=spec.group_of,
                param_dtype=spec.param_dtype,
                sharded=self.sharded,
                value_of=spec.value_of,
                master_home=spec.master_home(),
                owners=owners,
            )
            for i, (g, owners) in enumerate(zip(groups, spec.owners(groups)))
        ]
        return self.flats

    def make_buckets(self) -> list[GradBucket]:
        self.buckets = [
            GradBucket(
                f.index,
                list(zip(f.names, f.params)),
                f.layout,
                self.grad_dtype,
                keep_buffer=self.keep_full_grads,
                views=self.grad_views,
                defer_copy=self.defer_copy,
                pool=self.buffers.grad_pool,
            )
            for f in self.flats
        ]
        return self.buckets

    # -- the reducer's events

    def _local(self, bucket: GradBucket, flat: FlatParam) -> None:
        """One rank in all: the mean is the bucket itself (this rank's slice, the whole buffer
        unsharded)."""
        bucket.out = self.buffers.keep_local(
            flat, bucket.grad[flat.start : flat.end], self.grad_dtype
        )

    def on_bucket_done(self, bucket: GradBucket) -> None:
        self._keep(bucket, self.flats[bucket.index])
        bucket.out = None

    def _keep(self, bucket: GradBucket, flat: FlatParam) -> None:
        raise NotImplementedError

    def drop_unfinished(self) -> None:
        """Before the reducer forgets a backward: outputs of collectives still in flight are never
        reused."""
        self.buffers.forget_unfinished(self.buckets, self.flats)

    def between_steps(self) -> None:
        """The gradients were cleared."""

    # -- statements (read by `fivefold.plan`)

    def flat_state_bytes(
        self, flat: FlatParam, *, param_bytes: int, grad_bytes: int, state: int | None = None
    ) -> dict[str, int]:
        """One rank's model-state bytes for `flat` (docs/design.md#model-state-memory, one flat
        buffer exactly); ``state``: its optimizer state's bytes when not AdamW's
        (`ShardedOptimizer.state_bytes`)."""
        return formulas.flat_model_state_bytes(
            flat.layout.padded_numel,
            flat.shard_numel,
            sum(b - a for _, a, b in flat.segments),
            len(flat.segments),
            stage=self.number,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
            separate_master=param_bytes != 4,
            hpz=self.hpz,
            offload=flat.offload,
            state=state,
        )

    hpz = 0  # hpZ's group size (the secondary copy), 0: none

    def transient_bytes(
        self,
        *,
        param_bytes: int,
        grad_bytes: int,
        accumulating: bool,
        reductions: int,
        deferred_w: bool = False,
    ) -> dict[str, int]:
        """Buffers that come and go during a step, at the backward's peak
        (`fivefold.plan.memory._transient`)."""
        return {}

    def collectives(
        self,
        *,
        param_bytes: int,
        grad_bytes: int,
        reductions: int,
        reduce_phase: str,
        micro_batches: int,
    ) -> list[Collective]:
        """What this rank sends per step: `reductions` gradient reductions (in `reduce_phase`), the
        parameter gathers of `micro_batches` forwards and backwards
        (docs/design.md#data-parallel-traffic)."""
        return []

    def _largest_param_grad(self, param_bytes: int) -> dict[str, int]:
        """The gradient autograd makes before a hook copies it into its bucket."""
        largest = max(p.numel() for f in self.flats for p in f.params)
        return {"parameter gradient": largest * param_bytes}


class AllReduce(Stage):
    """Stage 0 (DDP): nothing sharded; each bucket pre-divided and all-reduced whole, ``param.grad``
    views of it. No transport applies (HSDP and qgZ need a sharded stage: `options.check_options`).
    """

    number = 0
    grad_views = True

    def on_launch_bucket(self, bucket: GradBucket) -> Any:
        if self.divisor == 1:
            return self._local(bucket, self.flats[bucket.index])
        bucket.grad.div_(self.divisor)  # pre-divide: the sum of g_i / N is the mean
        bucket.out = bucket.grad
        return self.comm.all_reduce(bucket.grad, async_op=True, tag=f"bucket{bucket.index}")

    def _keep(self, bucket: GradBucket, flat: FlatParam) -> None:
        flat.grad_shard = bucket.out  # the all-reduced buffer itself: no copy

    def transient_bytes(self, *, param_bytes: int, grad_bytes: int, **_: Any) -> dict[str, int]:
        # the gradient is copied in only when the bucket's dtype is not the parameter's
        return self._largest_param_grad(param_bytes) if param_bytes != grad_bytes else {}

    def collectives(
        self, *, grad_bytes: int, reductions: int, reduce_phase: str, **_: Any
    ) -> list[Collective]:
        n = self.comm.size
        if n == 1:
            return []
        padded = sum(f.layout.padded_numel for f in self.flats)
        return [
            Collective(
                self.comm.dim, "all_reduce", reduce_phase, reductions * padded * grad_bytes, n
            )
        ]


class ReduceScatter(Stage):
    """Stages 1 and 2: the optimizer state sharded; each bucket reduced to this rank's shard by
    ``transport``, the updated shards all-gathered after the step (`FlatParam.gather_params`).
    ``keep_full=True`` (ZeRO-1): the full gradient buffer is kept and reduced in place.
    ``keep_full=False`` (ZeRO-2): the shard lands apart and the full buffer is freed once the
    reduction is done, during backward (at most ``inflight_buckets`` in flight)."""

    def __init__(
        self,
        comm: Comm,
        transport: GradTransport,
        *,
        keep_full: bool,
        inflight_buckets: int = 1,
        **common: Any,
    ) -> None:
        super().__init__(comm, **common)
        self.transport = transport
        self.keep_full = keep_full
        self.number = 1 if keep_full else 2
        self.keep_full_grads = keep_full
        # bounded in flight so ZeRO-2/3 free full buffers during backward; ZeRO-1 keeps them anyway
        self.max_inflight = None if keep_full else inflight_buckets
        self._reduced_in_buffer: set[int] = (
            set()
        )  # ZeRO-1 buckets whose kept buffer was reduced and counted

    def build_flats(self, *args: Any, **kwargs: Any) -> list[FlatParam]:
        flats = super().build_flats(*args, **kwargs)
        self._start_pools()
        return flats

    def _start_pools(self) -> None:
        if not self.keep_full:  # temporary full buffers: a constant-buffers policy pools them
            self.buffers.start_pools(self.flats, self.grad_dtype, self.comm.device)

    def on_launch_bucket(self, bucket: GradBucket) -> Any:
        flat = self.flats[bucket.index]
        if self.divisor == 1:
            return self._local(bucket, flat)
        return self.transport.launch(bucket, flat, lambda: self._shard_out(bucket, flat))

    def _shard_out(self, bucket: GradBucket, flat: FlatParam) -> torch.Tensor:
        """Where the reduced shard lands: in place (this rank's slice of the kept buffer, or of a
        one-rank shard group's under HSDP), else where the buffer policy says (a gradient shard
        apart from the full buffer)."""
        if self.keep_full or self.comm.size == 1:
            return bucket.grad[flat.start : flat.end]
        return self.buffers.shard_output(flat, self.grad_dtype)

    def _keep(self, bucket: GradBucket, flat: FlatParam) -> None:
        """Add the reduced shard to the flat's gradient shard. ZeRO-2: nothing else of the bucket is
        kept — the reducer releases its full buffer next (`GradBucket.release`): the non-owned
        gradients are freed here."""
        self.transport.finish(bucket, flat)
        flat.accumulate_grad(bucket.out)
        if self.keep_full:  # the kept buffer's contents are now counted in the shard
            self._reduced_in_buffer.add(bucket.index)
        else:  # added to the shard: a pooled temporary goes back
            self.buffers.give_back(flat, bucket.out)

    def on_first_grad(self, bucket: GradBucket) -> None:
        """ZeRO-1, first new gradient of a micro-step into a bucket whose last contents are already
        counted in the gradient shard: move the shard out if it still lives in the buffer, and clear
        the buffer (every micro-step, not only the second: else the third adds onto the second's
        gradients and counts them twice)."""
        if not self.keep_full:
            return
        flat = self.flats[bucket.index]
        if (
            bucket.index not in self._reduced_in_buffer
            or flat.grad_shard is None
            or bucket.grad is None
        ):
            # (after a no_sync backward the buffer holds unreduced gradients still to be counted:
            # keep them)
            return
        self._reduced_in_buffer.discard(bucket.index)
        if flat.grad_shard.untyped_storage().data_ptr() == bucket.grad.untyped_storage().data_ptr():
            flat.grad_shard = self.buffers.moved_shard(flat, flat.grad_shard)
        bucket.grad.zero_()

    def between_steps(self) -> None:
        self.transport.clear()
        self._reduced_in_buffer.clear()

    def transient_bytes(
        self, *, param_bytes: int, grad_bytes: int, accumulating: bool, reductions: int, **_: Any
    ) -> dict[str, int]:
        """ZeRO-2/3's full gradient buffers (at most ``inflight_buckets`` launched and one filling;
        all of them while gradients accumulate unreduced) and the temporaries later reduce-scatters
        land in (as many as the transport holds at once: `outputs_held`); ZeRO-1/2: the gradient
        autograd makes before a hook copies it into its bucket."""
        out: dict[str, int] = {}
        if not self.keep_full and self.comm.size > 1:
            sizes = sorted((f.layout.padded_numel for f in self.flats), reverse=True)
            n = len(sizes) if accumulating else self.max_inflight + 1
            out["gradient buckets"] = sum(sizes[:n]) * grad_bytes
            if (
                reductions > 1
            ):  # a later reduction's reduce-scatter lands in a temporary added to the shard
                shards = sorted((f.shard_numel for f in self.flats), reverse=True)
                held = self.transport.outputs_held(self.max_inflight, len(shards))
                out["reduce-scatter outputs"] = sum(shards[:held]) * grad_bytes
        return out | self._param_gradient(param_bytes)

    def _param_gradient(self, param_bytes: int) -> dict[str, int]:
        return self._largest_param_grad(param_bytes)

    def collectives(
        self, *, param_bytes: int, grad_bytes: int, reductions: int, reduce_phase: str, **rest: Any
    ) -> list[Collective]:
        """The gradient reductions (the transport's), then the parameter gathers
        (`_param_gathers`)."""
        padded = [f.layout.padded_numel for f in self.flats]
        out = self.transport.collectives(padded, grad_bytes, reductions, reduce_phase)
        if self.comm.size > 1:
            out += self._param_gathers(padded, param_bytes, **rest)
        return out

    def _param_gathers(self, padded: list[int], param_bytes: int, **_: Any) -> list[Collective]:
        """The all-gather of the updated shards once per step."""
        n = self.comm.size
        return [Collective(self.comm.dim, "all_gather", "after", sum(padded) * param_bytes, n)]


class ShardedParams(ReduceScatter):
    """Stage 3 (FSDP): parameters sharded too. One flat per unit (`fsdp.find_unit_modules`),
    gathered just before use and freed after (`fsdp.FSDPHooks`) by ``gather``; gradients copied in
    just before the launch, after the unit's parameters were freed (`on_all_grads`); the reduction
    as ZeRO-2's."""

    defer_copy = True

    def __init__(
        self,
        comm: Comm,
        transport: GradTransport,
        *,
        gather: Gather = PlainGather(),
        units: UnitSpec = None,
        reshard_after_forward: bool = True,
        prefetch: int = 1,
        **common: Any,
    ) -> None:
        super().__init__(comm, transport, keep_full=False, **common)
        self.number = 3
        self.gather = gather
        self.units, self.reshard_after_forward, self.prefetch = (
            units,
            reshard_after_forward,
            prefetch,
        )
        secondary = gather.secondary
        self.hpz_comm = secondary if secondary is not None and secondary.size > 1 else None
        self.hpz = self.hpz_comm.size if self.hpz_comm is not None else 0
        self.fsdp: FSDPHooks | None = None
        self.root: nn.Module | None = None

    def build_flats(
        self,
        module: nn.Module,
        named: list[tuple[str, nn.Parameter]],
        spec: FlatSpec,
        *,
        owns: Callable[[str, nn.Parameter], bool] = lambda n, p: True,
        after_unit_backward: Callable[[int], None] | None = None,
    ) -> list[FlatParam]:
        """One flat per unit; a parameter used by two units belongs to the root. With
        ``after_unit_backward`` (find_unused) a finished unit completes its bucket instead of
        holding later buckets back."""
        self.flats, unit_modules = _build_units(module, named, self.units, spec, self.gather, owns)
        self.root = module
        self.fsdp = FSDPHooks(
            list(zip(unit_modules, self.flats)),
            reshard_after_forward=self.reshard_after_forward,
            prefetch=self.prefetch,
            after_unit_backward=after_unit_backward,
            constant_buffers=self.buffers.constant,
        )
        self._start_pools()
        return self.flats

    def on_all_grads(self, bucket: GradBucket) -> None:
        """Every gradient of this unit exists, so free its gathered parameters (copied in at
        launch)."""
        self.flats[bucket.index].reshard()

    def on_backward_end(self) -> None:
        self.fsdp.backward_done()

    def between_steps(self) -> None:
        super().between_steps()
        self.fsdp.between_steps()

    def _param_gradient(self, param_bytes: int) -> dict[str, int]:
        return {}  # (a unit's gradients are counted whole: "unit gradients")

    def transient_bytes(
        self, *, param_bytes: int, grad_bytes: int, deferred_w: bool = False, **rest: Any
    ) -> dict[str, int]:
        """ZeRO-2's buffers, ZeRO-3's gathered units (the root, the unit in use and ``prefetch``
        ahead; all without ``reshard_after_forward``) and a unit's gradients before they are copied
        into its bucket. ``deferred_w`` (a zero-bubble schedule): a unit stays gathered from its I
        to its W — every unit of the stage."""
        out = super().transient_bytes(param_bytes=param_bytes, grad_bytes=grad_bytes, **rest)
        if self.comm.size > 1:
            units = [(m is self.root, f.gathered_nbytes(param_bytes)) for m, f in self.fsdp.units]
            root = sum(n for is_root, n in units if is_root)  # gathered around all its children
            others = sorted((n for is_root, n in units if not is_root), reverse=True)
            every = not self.reshard_after_forward or deferred_w
            gathered = (
                sum(n for _, n in units) if every else root + sum(others[: 1 + self.prefetch])
            )
            out["gathered units"] = gathered
            out["unit gradients"] = max(f.layout.padded_numel for f in self.flats) * param_bytes
        return out

    def _param_gathers(
        self, padded: list[int], param_bytes: int, *, micro_batches: int, **_: Any
    ) -> list[Collective]:
        """Every unit gathered in each forward and, when freed after it, again in each backward
        (hpZ: inside its secondary group)."""
        n = self.comm.size
        forward = micro_batches * self.gather.unit_bytes(self.flats, param_bytes)
        out = [Collective(self.comm.dim, "all_gather", "forward", forward, n)]
        if self.reshard_after_forward:
            out.append(
                self.gather.backward_gathers(self.comm, self.flats, param_bytes, micro_batches)
            )
        return out


def _float8_units(gather: Gather, named: list[tuple[str, nn.Parameter]]) -> Float8Units | None:
    """A unit's FP8 gather, if its gather is one and it holds a weight gathered in FP8."""
    if isinstance(gather, Float8Gather) and any(
        gather.units.gathered_in_float8(n) for n, _ in named
    ):
        return gather.units
    return None


def _build_units(
    module: nn.Module,
    named: list[tuple[str, nn.Parameter]],
    unit_spec: UnitSpec,
    spec: FlatSpec,
    gather: Gather,
    owns: Callable[[str, nn.Parameter], bool],
) -> tuple[list[FlatParam], list[nn.Module]]:
    owner: dict[int, str] = {}
    by_unit: dict[str, list[tuple[str, nn.Parameter]]] = {}
    unit_mods = dict(find_unit_modules(module, unit_spec))
    # Every name of every parameter (a tied one has several). A parameter used by two units belongs
    # to the root, which stays gathered around all its children; two sibling units are never
    # gathered together.
    for name, p in module.named_parameters(remove_duplicate=False):
        if not p.requires_grad or not owns(name, p):
            continue
        unit = max((u for u in unit_mods if u == "" or name.startswith(u + ".")), key=len)
        if id(p) in owner and owner[id(p)] != unit:
            if "" not in (owner[id(p)], unit):
                raise ValueError(
                    f"parameter '{name}' is shared by units '{owner[id(p)]}' and '{unit}'; tied "
                    "parameters must live in one ZeRO-3 unit (or be used by the root module)"
                )
            unit = ""
        owner[id(p)] = unit
    for name, p in named:
        by_unit.setdefault(owner[id(p)], []).append((name, p))
    # Bucket order = reverse order of each unit's first parameter: roughly when backward finishes
    # it.
    first_index = {
        u: min(i for i, (n, _) in enumerate(named) if n in {x for x, _ in ps})
        for u, ps in by_unit.items()
    }
    order = sorted(by_unit, key=lambda u: -first_index[u])
    owners = spec.owners([by_unit[u] for u in order])
    flats = [
        FlatParam(
            i,
            by_unit[u],
            spec.comm,
            group_of=spec.group_of,
            param_dtype=spec.param_dtype,
            sharded=True,
            reshard=True,
            value_of=spec.value_of,
            master_home=spec.master_home(),
            quant_block=gather.quant_block,
            secondary=gather.secondary,
            owners=owners[i],
            float8=_float8_units(gather, by_unit[u]),
        )
        for i, u in enumerate(order)
    ]
    return flats, [unit_mods[u] for u in order]
