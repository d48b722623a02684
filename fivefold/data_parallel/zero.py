"""`ZeroDataParallel`: one data-parallel engine for ZeRO stages 0, 1, 2 and 3 (FSDP).

The stages (docs/design.md#model-state-memory, docs/design.md#data-parallel-traffic), Ψ parameters, N ranks,
mixed-precision Adam (K = 12):

| stage | what is sharded            | model states / rank | collectives per step                       |
|-------|----------------------------|---------------------|--------------------------------------------|
| 0     | nothing (DDP)              | 2Ψ + 2Ψ + 12Ψ       | all-reduce Ψ                               |
| 1     | optimizer state            | 2Ψ + 2Ψ + 12Ψ/N     | reduce-scatter Ψ + all-gather Ψ            |
| 2     | + gradients                | 2Ψ + 14Ψ/N          | reduce-scatter Ψ + all-gather Ψ            |
| 3     | + parameters               | 16Ψ/N               | all-gather 2Ψ + reduce-scatter Ψ           |

Stages differ only in `_launch_bucket`, `_finish_bucket` (where ZeRO-2/3 free non-owned gradients, during backward)
and stage 3's per-unit gather / free (`fsdp.FSDPHooks`). Each backward outside `no_sync()` reduces into the sharded
gradient; inside it full gradients accumulate unreduced until the first one outside (costing stage 2/3 memory).

HSDP (``replicate``, stages 1-3): ``comm`` is the shard group (N = its size in the table), and each bucket's reduced
shard is all-reduced over ``replicate`` after its reduce-scatter (`hsdp.ReplicaReduce`); the mean divides by both.

ZeRO++ (Wang et al. 2023; docs/design.md#zero-qwz-qgz-hpz), each switchable: ``qwz`` (ZeRO-3 gathers in block-wise int8,
`FlatParam`), ``qgz`` (ZeRO-2/3 gradient reduce-scatter as an int8 all-to-all, dequantised and summed in fp32 here:
`_launch_quantized`), ``hpz_comm`` (ZeRO-3 backward gathers inside a smaller group, from a secondary copy).

``constant_buffers`` (ZeRO-R C_B, docs/design.md#offload-and-constant-buffers): temporary full gradient buffers come
from a `BufferPool`, reduce-scatters land in a gradient-shard buffer kept for the run (or a pooled one when a micro-step
adds to it), and ZeRO-3 units gather into shared slots (`fsdp.GatherSlots`): after warm-up a step allocates none of
them. ``offload_optimizer`` (ZeRO-Offload, same section): fp32 masters and optimizer state on the host, the optimizer
step there (`offload`, `ShardedOptimizer`); the device keeps the compute parameters and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fivefold.comm import Comm, Placement
from fivefold.data_parallel.buckets import (
    BucketedGradReducer,
    BufferPool,
    GradBucket,
    assign_buckets,
)
from fivefold.data_parallel.ddp import broadcast_module_state
from fivefold.data_parallel.flat_param import FlatParam
from fivefold.data_parallel.fsdp import FSDPHooks, UnitSpec, find_unit_modules
from fivefold.data_parallel.hsdp import ReplicaReduce
from fivefold.data_parallel.mixed_precision import DynamicLossScaler, MixedPrecision
from fivefold.data_parallel.quantize import dequantize_sum, packed_bytes, quantize_rows_into
from fivefold.data_parallel.sharded_optimizer import ShardedOptimizer
from fivefold.materialize import materialize
from fivefold.optim.clip import step_together


def default_no_decay(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Norm weights, biases (1-D), embedding tables and ``param.no_weight_decay`` parameters get no weight decay."""
    if param.ndim < 2 or getattr(param, "no_weight_decay", False):
        return True
    return any(isinstance(m, nn.Embedding) and m.weight is param for m in module.modules())


class ZeroDataParallel(nn.Module):
    """Data parallelism with ZeRO stage 0-3 on flat padded buffers, owning its sharded optimizer. Per step:
    ``model.backward(loss)`` per micro-batch, then ``norm = model.step(max_norm)``. ``inflight_buckets`` (ZeRO-2/3)
    bounds the outstanding reduce-scatters: the backward peak is the stage's formula plus about ``inflight_buckets
    + 1`` full gradient buffers (ZeRO-3 also: the current unit, ``prefetch`` ahead, and the root). A module built
    on the meta device is materialised on ``device`` from ``init_value(name)`` (the unsharded value, drawn one
    parameter at a time): each rank allocates only what it holds, so start-up costs its share, not the model.
    ``replicate`` (HSDP, stages 1-3): the group across which ``comm``'s shard groups hold the same shards.
    ZeRO++: ``qwz`` (stage 3) and ``qgz`` (stages 2-3) quantise the parameter gathers / gradient reduction to int8 in
    blocks of ``quant_block``; ``hpz_comm`` (stage 3, a `Comm` over a few ranks of ``comm``, e.g.
    `ParallelMesh.hpz_comm`) keeps a secondary copy for backward gathers inside it.
    ``constant_buffers``: communication buffers allocated once and reused (see the module doc); ``offload_optimizer``:
    the fp32 master shards and optimizer state live and step on the host."""

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        *,
        zero_stage: int = 0,
        mixed_precision: MixedPrecision | None = None,
        bucket_mb: float = 25.0,
        optimizer_class: type = torch.optim.AdamW,
        weight_decay: float = 0.0,
        no_decay: Any = default_no_decay,
        find_unused: bool = False,
        units: UnitSpec = None,
        reshard_after_forward: bool = True,
        prefetch: int = 1,
        inflight_buckets: int = 1,
        loss_scaler: DynamicLossScaler | None = None,
        broadcast_init: bool = True,
        elementwise: bool | None = None,
        placement_of: Callable[[str, nn.Parameter], Placement] | None = None,
        init_value: Callable[[str], torch.Tensor] | None = None,
        device: torch.device | str | None = None,
        params: Callable[[str, nn.Parameter], bool] | None = None,
        grad_divisor: int | None = None,
        replicate: Comm | None = None,
        qwz: bool = False,
        qgz: bool = False,
        quant_block: int = 2048,
        hpz_comm: Comm | None = None,
        constant_buffers: bool = False,
        offload_optimizer: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        super().__init__()
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage}: choose 0 (DDP), 1, 2 or 3 (FSDP)")
        if replicate is not None and zero_stage == 0:
            raise ValueError(
                "HSDP (a replicate group) shards inside a group: it needs zero_stage 1, 2 or 3 (stage 0 "
                "over both groups is plain DDP: use zero_stage=0 over the whole data-parallel group)"
            )
        if qgz and replicate is not None and replicate.size > 1:
            raise ValueError(
                "qgz with HSDP (a replicate group) is not supported: the replicas' all-reduce would have "
                "to follow qgZ's dequantised sum; use qwz / hpz_comm with HSDP, or no replicate group"
            )
        if inflight_buckets < 1:
            raise ValueError(
                f"inflight_buckets={inflight_buckets}: at least one reduce-scatter must be allowed in "
                "flight; use 1 (least memory) or more (more overlap)"
            )
        self._check_zeropp(zero_stage, qwz, qgz, quant_block, hpz_comm, comm, reshard_after_forward)
        if constant_buffers and replicate is not None and replicate.size > 1 and comm.size == 1:
            raise ValueError(
                "constant_buffers with HSDP over one-rank shard groups: nothing is sharded (that is DDP "
                "over the replicate group); use zero_stage=0 over it, or larger shard groups"
            )
        if constant_buffers and (qwz or qgz):
            raise ValueError(
                "constant_buffers with qwz / qgz: their int8 staging buffers are allocated per "
                "collective, not pooled; use one or the other"
            )
        self.module = module
        self.comm = comm
        # HSDP: the replicas' all-reduce after each reduce-scatter (None: plain ZeRO over `comm`)
        self.replicate = replicate if replicate is not None and replicate.size > 1 else None
        self.replica_reduce = ReplicaReduce(self.replicate) if self.replicate is not None else None
        # every rank a gradient is averaged over: the shard group, times the replicas under HSDP
        self.reduce_size = comm.size * (self.replicate.size if self.replicate is not None else 1)
        self.zero_stage = zero_stage
        self.qgz, self.quant_block = qgz and comm.size > 1, quant_block
        self._qgz_sends: dict[
            int, torch.Tensor
        ] = {}  # qgZ: packed chunks kept alive while their all-to-all runs
        self._zeropp_gather = dict(
            quant_block=quant_block if qwz else None, secondary=hpz_comm
        )  # ZeRO-3 units
        # ZeRO++ hpZ's group for backward gathers (None: off)
        self.hpz_comm = (
            hpz_comm if zero_stage == 3 and hpz_comm is not None and hpz_comm.size > 1 else None
        )
        self.constant_buffers = constant_buffers
        self.offload_optimizer = offload_optimizer
        self.mp = mixed_precision or MixedPrecision()
        # `params`: the parameters this engine owns (default all; MoE experts get an engine of their own).
        self.owns = params or (lambda name, p: True)
        # Gradients are averaged over `comm` (× replicate; each bucket pre-divided by `reduce_size`); `grad_divisor`
        # asks for another divisor (expert gradients, already summed over ep by the all-to-all, divide by dp × cp):
        # each backward's contribution is scaled by size / divisor as it arrives — not the buffer, which accumulates
        # micro-steps.
        self.grad_divisor = grad_divisor or self.reduce_size
        # Parameters on the meta device are materialised here, each rank only its share, from `init_value`.
        deferred = {
            name
            for name, p in module.named_parameters()
            if p.device.type == "meta" and self.owns(name, p)
        }
        if deferred and (init_value is None or device is None):
            raise ValueError(
                f"{len(deferred)} parameters are on the meta device (e.g. '{min(deferred)}'): pass "
                "init_value=(name -> initial value) and device= so that each rank materialises its "
                "share, or materialise the module before wrapping it"
            )
        if deferred:  # storage-less stand-ins on the device, repointed into the flat buffers below
            materialize(module, device, storage=False, select=lambda name: name in deferred)
        self._value_of = lambda name, p: init_value(name) if name in deferred else p.detach()
        # (deferred values are the same on every rank by construction); HSDP: then across the replicas
        for group in (comm, self.replicate) if broadcast_init else ():
            if group is not None and group.size > 1:
                broadcast_module_state(
                    module,
                    group,
                    skip={
                        n
                        for n, p in module.named_parameters()
                        if n in deferred or not self.owns(n, p)
                    },
                )
        # Frozen parameters are not sharded: they stay replicated, cast to the compute dtype.
        for name, p in module.named_parameters():
            if not p.requires_grad and self.owns(name, p):
                p.data = self._value_of(name, p).to(p.device, self.mp.param_dtype)

        # Optimizer groups: (weight decay or not) × placement (mesh dims besides dp a parameter is partitioned over,
        # from `placement_of`); placement matters only for the global gradient norm, the engine knows no other dim.
        embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
        keys_of: dict[str, tuple[bool, Placement]] = {}

        def key_of(name: str, p: nn.Parameter) -> tuple[bool, Placement]:
            if name not in keys_of:
                if (
                    no_decay is default_no_decay
                ):  # (its module scan once, not per parameter: 70B-scale plans)
                    skip_decay = (
                        p.ndim < 2 or getattr(p, "no_weight_decay", False) or id(p) in embeddings
                    )
                else:
                    skip_decay = no_decay is not None and no_decay(name, p, module)
                keys_of[name] = (
                    skip_decay,
                    frozenset(placement_of(name, p)) if placement_of is not None else frozenset(),
                )
            return keys_of[name]

        named = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad and self.owns(n, p)
        ]
        if self.grad_divisor != self.reduce_size:
            factor = self.reduce_size / self.grad_divisor
            for _, p in named:
                p.register_hook(lambda g, factor=factor: g * factor)
        # decay first, then partitioned before replicated: a fixed order of the groups in every flat buffer
        keys = sorted(
            {key_of(n, p) for n, p in named}, key=lambda k: (k[0], -len(k[1]), sorted(k[1]))
        )

        def group_of(name: str, p: nn.Parameter) -> int:
            return keys.index(key_of(name, p))

        self.fsdp: FSDPHooks | None = None
        if zero_stage < 3:
            groups = assign_buckets(named, bucket_mb * 2**20)
            self.flats = [
                FlatParam(
                    i,
                    g,
                    comm,
                    group_of=group_of,
                    param_dtype=self.mp.param_dtype,
                    sharded=zero_stage >= 1,
                    value_of=self._value_of,
                    offload=offload_optimizer,
                )
                for i, g in enumerate(groups)
            ]
        else:
            self.flats, unit_modules = self._build_units(module, named, units, group_of)
            # With find_unused, a finished unit completes its bucket instead of holding later buckets back.
            self.fsdp = FSDPHooks(
                list(zip(unit_modules, self.flats)),
                reshard_after_forward=reshard_after_forward,
                prefetch=prefetch,
                after_unit_backward=self._unit_backward_done if find_unused else None,
                constant_buffers=constant_buffers,
            )
        self.grad_pool, self.shard_pool = (
            self._pools() if constant_buffers and zero_stage >= 2 else (None, None)
        )
        # ZeRO-1 copies gradients in (no views): its reduced shard lives in the kept buffer until moved out.
        self.buckets = [
            GradBucket(
                f.index,
                list(zip(f.names, f.params)),
                f.layout,
                self.mp.grad_dtype,
                keep_buffer=zero_stage <= 1,
                views=zero_stage == 0,
                defer_copy=zero_stage == 3,
                pool=self.grad_pool,
            )
            for f in self.flats
        ]
        self._reduced_in_buffer: set[int] = (
            set()
        )  # ZeRO-1 buckets whose kept buffer was reduced and counted
        self.reducer = BucketedGradReducer(
            self.buckets,
            launch=self._launch_bucket,
            finish=self._finish_bucket,
            find_unused=find_unused,
            on_backward_end=self._on_backward_end,
            before_first_grad=self._move_reduced_shard_out if zero_stage == 1 else None,
            on_all_grads=self._free_unit if zero_stage == 3 else None,
            # bounded in flight so ZeRO-2/3 free full buffers during backward; stages 0/1 keep them anyway
            max_inflight=inflight_buckets if zero_stage >= 2 else None,
        )
        if loss_scaler is None and self.mp.needs_loss_scaling:
            loss_scaler = DynamicLossScaler()
        self.loss_scaler = loss_scaler
        group_kwargs = [
            {"weight_decay": 0.0 if skip else weight_decay, "placement": placement}
            for skip, placement in keys
        ]
        self.optimizer = ShardedOptimizer.for_flat_params(
            self.flats,
            optimizer_class,
            group_kwargs,
            comm,
            loss_scaler=loss_scaler,
            elementwise=elementwise,
            **optimizer_kwargs,
        )

    def _build_units(
        self,
        module: nn.Module,
        named: list[tuple[str, nn.Parameter]],
        spec: UnitSpec,
        group_of: Any,
    ) -> tuple[list[FlatParam], list[nn.Module]]:
        owner: dict[int, str] = {}
        by_unit: dict[str, list[tuple[str, nn.Parameter]]] = {}
        unit_mods = dict(find_unit_modules(module, spec))
        # Every name of every parameter (a tied one has several). A parameter used by two units belongs to the root,
        # which stays gathered around all its children; two sibling units are never gathered together.
        for name, p in module.named_parameters(remove_duplicate=False):
            if not p.requires_grad or not self.owns(name, p):
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
        # Bucket order = reverse order of each unit's first parameter: roughly when backward finishes it.
        first_index = {
            u: min(i for i, (n, _) in enumerate(named) if n in {x for x, _ in ps})
            for u, ps in by_unit.items()
        }
        order = sorted(by_unit, key=lambda u: -first_index[u])
        flats = [
            FlatParam(
                i,
                by_unit[u],
                self.comm,
                group_of=group_of,
                param_dtype=self.mp.param_dtype,
                sharded=True,
                reshard=True,
                value_of=self._value_of,
                offload=self.offload_optimizer,
                **self._zeropp_gather,
            )
            for i, u in enumerate(order)
        ]
        return flats, [unit_mods[u] for u in order]

    @staticmethod
    def _check_zeropp(
        stage: int,
        qwz: bool,
        qgz: bool,
        block: int,
        hpz_comm: Comm | None,
        comm: Comm,
        reshard_after_forward: bool,
    ) -> None:
        if qwz and stage != 3:
            raise ValueError(
                f"qwz quantises ZeRO-3's parameter all-gathers: it needs zero_stage=3, not {stage}"
            )
        if qgz and stage not in (2, 3):
            raise ValueError(
                f"qgz replaces the gradient reduce-scatter of ZeRO-2/3 by a quantised all-to-all: it "
                f"needs zero_stage 2 or 3, not {stage}"
            )
        if (qwz or qgz) and block < 1:
            raise ValueError(
                f"quant_block={block}: a quantisation block holds at least one element"
            )
        if hpz_comm is not None and hpz_comm.size > 1:
            if stage != 3 or not reshard_after_forward:
                raise ValueError(
                    "hpz_comm (hpZ) gathers a ZeRO-3 unit's backward weights from a secondary copy: it "
                    "needs zero_stage=3 with reshard_after_forward=True"
                )
            if comm.size % hpz_comm.size:
                raise ValueError(
                    f"the hpZ group ({hpz_comm.size} ranks) must divide the data-parallel group "
                    f"({comm.size})"
                )

    def _pools(self) -> tuple[BufferPool, BufferPool]:
        """Constant buffers of ZeRO-2/3: full gradient buffers (the largest bucket's size) and gradient shards for the
        reduce-scatters of a micro-step that adds to a shard already there (the largest shard's size)."""
        device = self.flats[0].full.device if self.flats else self.comm.device
        full = max((f.layout.padded_numel for f in self.flats), default=0)
        shard = max((f.shard_numel for f in self.flats), default=0)
        return (
            BufferPool(full, self.mp.grad_dtype, device),
            BufferPool(shard, self.mp.grad_dtype, device),
        )

    def _scatter_output(self, flat: FlatParam) -> torch.Tensor:
        """Where a ZeRO-2/3 reduce-scatter lands: the flat's gradient shard itself when none is there yet (constant
        buffers: its buffer kept for the run), else a temporary added to it in `_finish_bucket`."""
        if self.shard_pool is None:
            return torch.empty(flat.shard_numel, dtype=self.mp.grad_dtype, device=flat.full.device)
        if flat.grad_shard is None:
            return flat.persistent_grad_shard(self.mp.grad_dtype)
        return self.shard_pool.acquire(flat.shard_numel)

    def _forget_unfinished_outputs(self) -> None:
        """A backward raised with reduce-scatters in flight: their outputs (pooled, or a flat's own gradient-shard
        buffer) may still be written, so they are never used again (their input buffers: `GradBucket.release`)."""
        for bucket in self.buckets:
            if bucket.work is None or bucket.out is None:
                continue
            flat = self.flats[bucket.index]
            if bucket.out is flat.grad_shard_buffer:
                flat.grad_shard_buffer = None
            else:
                self.shard_pool.forget(bucket.out)
            bucket.out = None

    def _unit_backward_done(self, unit: int) -> None:
        self.reducer.no_more_grads(self.buckets[unit])

    def _free_unit(self, bucket: GradBucket) -> None:
        """ZeRO-3: every gradient of this unit exists, so free its gathered parameters (copied in at launch)."""
        self.flats[bucket.index].reshard()

    def _launch_bucket(self, bucket: GradBucket) -> Any:
        flat = self.flats[bucket.index]
        tag = f"bucket{bucket.index}"
        if self.reduce_size == 1:
            bucket.out = bucket.grad[flat.start : flat.end]
            if (
                self.shard_pool is not None
            ):  # the bucket's buffer goes back to the pool: keep the gradient apart
                bucket.out = self._scatter_output(flat).copy_(bucket.out)
            return None
        if self.qgz:
            return self._launch_quantized(bucket)
        bucket.grad.div_(self.reduce_size)  # pre-divide: the sum of g_i / N is the mean
        if self.zero_stage == 0:
            bucket.out = bucket.grad
            return self.comm.all_reduce(bucket.grad, async_op=True, tag=tag)
        if (
            self.zero_stage == 1 or self.comm.size == 1
        ):  # in place: the shard is this rank's slice of the buffer
            bucket.out = bucket.grad[flat.start : flat.end]
        else:
            bucket.out = self._scatter_output(flat)
        work = (
            self.comm.reduce_scatter(bucket.out, bucket.grad, async_op=True, tag=tag)
            if self.comm.size > 1
            else None
        )
        if self.replica_reduce is not None:  # HSDP: then the shard's all-reduce across the replicas
            return self.replica_reduce.after(work, bucket.out, tag)
        return work

    def _launch_quantized(self, bucket: GradBucket) -> Any:
        """qgZ: destination j's chunk of the bucket quantised per block, one int8 all-to-all (values + scales); the
        full-precision buffer is freed at once. `_finish_bucket` dequantises what every rank sent and sums it in fp32:
        no quantised sum on the wire, so the error stays within Σ scale/2 per block (one hop: ZeRO++'s two-hop,
        node-first version only saves inter-node traffic)."""
        n, size = self.flats[bucket.index].shard_numel, self.comm.size
        send = torch.empty(
            size, packed_bytes(n, self.quant_block), dtype=torch.int8, device=bucket.grad.device
        )
        quantize_rows_into(bucket.grad.view(size, n), self.quant_block, send)
        bucket.release()
        self._qgz_sends[bucket.index] = send
        bucket.out = torch.empty_like(send)
        return self.comm.all_to_all(bucket.out, send, async_op=True, tag=f"bucket{bucket.index}")

    def _finish_bucket(self, bucket: GradBucket) -> None:
        flat = self.flats[bucket.index]
        if self._qgz_sends.pop(bucket.index, None) is not None:
            mean = dequantize_sum(bucket.out, flat.shard_numel, self.quant_block).div_(
                self.comm.size
            )
            bucket.out = mean.to(bucket.grad_dtype)
        if self.zero_stage == 0:
            flat.grad_shard = bucket.out  # the all-reduced buffer itself: no copy
        else:
            flat.accumulate_grad(bucket.out)
            if self.zero_stage == 1:  # the kept buffer's contents are now counted in the shard
                self._reduced_in_buffer.add(bucket.index)
            elif self.shard_pool is not None and bucket.out is not flat.grad_shard:
                self.shard_pool.release(bucket.out)  # added to the shard: the temporary goes back
        bucket.out = None

    def _on_backward_end(self) -> None:
        if self.fsdp is not None:
            self.fsdp.backward_done()

    def _move_reduced_shard_out(self, bucket: GradBucket) -> None:
        """ZeRO-1, first new gradient of a micro-step into a bucket whose last contents are already counted in the
        gradient shard: move the shard out if it still lives in the buffer, and clear the buffer (every micro-step,
        not only the second: else the third adds onto the second's gradients and counts them twice)."""
        flat = self.flats[bucket.index]
        if (
            bucket.index not in self._reduced_in_buffer
            or flat.grad_shard is None
            or bucket.grad is None
        ):
            return  # (after a no_sync backward the buffer holds unreduced gradients still to be counted: keep them)
        self._reduced_in_buffer.discard(bucket.index)
        if flat.grad_shard.untyped_storage().data_ptr() == bucket.grad.untyped_storage().data_ptr():
            if self.constant_buffers:  # into the shard's own buffer, allocated once
                flat.grad_shard = flat.persistent_grad_shard(flat.grad_shard.dtype).copy_(
                    flat.grad_shard
                )
            else:
                flat.grad_shard = flat.grad_shard.clone()
        bucket.grad.zero_()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), multiplied by the loss scale when fp16 needs one."""
        if self.loss_scaler is not None:
            loss = loss * self.loss_scaler.scale
        loss.backward()

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate unreduced full gradients; the next backward outside reduces them once."""
        return self.reducer.no_sync()

    def sync_gradients(self) -> None:
        """Reduce what `no_sync()` accumulated now, outside any backward (a pipeline reduces once after its last)."""
        self.reducer.sync_now()
        self._on_backward_end()

    def step(self, max_norm: float | None = None) -> float | None:
        """Optimizer step on the shards (clipping by the global norm if `max_norm`); clears gradients. With
        TP / PP partitioned parameters use `fivefold.optim.step_together(engines, max_norm, comms)`."""
        return step_together([self], max_norm)

    def check_step_allowed(self) -> None:
        """Raise if the gradients are not ready for a step (an interrupted or unreduced backward)."""
        if self.reducer.interrupted:
            raise RuntimeError(
                "a backward started but did not finish (did it raise?): its gradients are partly "
                "reduced. Call zero_grad() and run the step's backward passes again before step()"
            )
        if self.reducer.unsynced:
            raise RuntimeError(
                "gradients from a backward under no_sync() were never reduced: run the last "
                "micro-batch's backward outside no_sync(), or call sync_gradients(), before step()"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.shard_pool is not None:
            self._forget_unfinished_outputs()
        self.optimizer.zero_grad()
        self.reducer.zero_grad()
        if self.replica_reduce is not None:
            self.replica_reduce.clear()
        self._reduced_in_buffer.clear()
        self._qgz_sends.clear()
        if self.fsdp is not None:
            self.fsdp.between_steps()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter (fp32 master) gathered under the module's own names, plus frozen ones and buffers.
        Collective: call on every rank."""
        master_by_param: dict[int, torch.Tensor] = {}
        for flat in self.flats:
            gathered = flat.full_master()
            for name, p in zip(flat.names, flat.params):
                master_by_param[id(p)] = gathered[name]
        # keep_vars: parameters come back as the Parameter objects, tied ones under every name. Another engine's
        # parameters (MoE experts / the rest) are that engine's to report.
        theirs = {
            id(p)
            for n, p in self.module.named_parameters(remove_duplicate=False)
            if not self.owns(n, p)
        }
        return {
            name: master_by_param[id(t)] if id(t) in master_by_param else t.detach().clone()
            for name, t in self.module.state_dict(keep_vars=True).items()
            if id(t) not in theirs
        }

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, for `fivefold.memory.model_state_bytes`: params, grads, optimizer; ``buffers``: the
        constant buffers (pools and gather slots, whoever borrows them now); ``host``: the offloaded ones."""
        buffers = (
            [*self.grad_pool.buffers, *self.shard_pool.buffers]
            if self.grad_pool is not None
            else []
        )
        buffers += (
            self.fsdp.slots.slots if self.fsdp is not None and self.fsdp.slots is not None else []
        )
        params = [f.full for f in self.flats if f.owns_storage] + [f.local for f in self.flats]
        params += [
            f.host_staging for f in self.flats if f.host_staging is not None
        ]  # offload: the cast shard
        params += [f.secondary for f in self.flats if f.secondary is not None]  # hpZ's copy
        params += [
            p for n, p in self.module.named_parameters() if not p.requires_grad and self.owns(n, p)
        ]
        grads = [b.grad for b in self.buckets if b.grad is not None]
        grads += [
            p.grad for b in self.buckets for p in b.params if p.grad is not None
        ]  # waiting for copy-in
        grads += [
            t
            for f in self.flats
            for t in (f.grad_shard, f.grad_shard_buffer, f.host_grad)
            if t is not None
        ]
        optim = [f.master for f in self.flats]
        state = [
            v
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        ]
        optim += state
        host = [
            t
            for f in self.flats
            if f.offload
            for t in (f.master, f.host_grad, f.host_staging)
            if t is not None
        ]
        host += state if self.offload_optimizer else []
        return {
            "params": params,
            "grads": grads,
            "optimizer": optim,
            "buffers": buffers,
            "host": host,
        }
