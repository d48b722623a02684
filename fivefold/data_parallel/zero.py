"""`ZeroDataParallel`: the data-parallel engine for ZeRO stages 0, 1, 2 and 3 (FSDP), composed of
strategies.

An engine is built from one `options.ZeroOptions` (or the same keywords) and composes (`compose`):

- the stage (`strategies`: `AllReduce` 0, `ReduceScatter(keep_full=True)` 1 / `(keep_full=False)` 2,
  `ShardedParams(gather=...)` 3; docs/design.md#model-state-memory,
  docs/design.md#data-parallel-traffic) — what is sharded and what a bucket does when the reducer
  (`buckets.BucketedGradReducer`) says so;
- the gradient transport of a sharded stage (`transports`: `PlainReduceScatter`, wrapped by HSDP's
  `ReplicaAllReduce` (docs/design.md#hsdp) or replaced by qgZ's `Int8AllToAll`
  (docs/design.md#zero-qwz-qgz-hpz));
- ZeRO-3's gather (`strategies.PlainGather`, qwZ's `Int8Gather`, hpZ's `SecondaryGather`);
- the buffer policy (`policies.FreshBuffers` or ZeRO-R's `ConstantBuffers`) and the master policy
  (`offload.MasterOnDevice` or ZeRO-Offload's `MasterOnHost`: where each flat's fp32 master and so
  the optimizer step live; docs/design.md#offload-and-constant-buffers).

This module owns what every stage shares: the parameters it owns, their materialisation from the
meta device and broadcast, the optimizer groups, the buckets and reducer, the sharded optimizer,
state dicts and the tensors it holds. Each backward outside `no_sync()` reduces into the sharded
gradient; inside it full gradients accumulate unreduced until the first one outside (costing stage
2/3 memory).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fivefold.data_parallel.buckets import BucketedGradReducer, GradBucket
from fivefold.data_parallel.ddp import broadcast_module_state
from fivefold.data_parallel.flat_param import FlatParam
from fivefold.data_parallel.fsdp import FSDPHooks
from fivefold.data_parallel.mixed_precision import DynamicLossScaler, MixedPrecision
from fivefold.data_parallel.offload import MasterOnDevice, MasterOnHost
from fivefold.data_parallel.options import ZeroOptions, check_options, default_no_decay
from fivefold.data_parallel.policies import ConstantBuffers, FreshBuffers
from fivefold.data_parallel.quantize import dequantize_sum
from fivefold.data_parallel.sharded_optimizer import ShardedOptimizer
from fivefold.data_parallel.strategies import (
    AllReduce,
    FlatSpec,
    Float8Gather,
    Gather,
    Int8Gather,
    PlainGather,
    ReduceScatter,
    SecondaryGather,
    ShardedParams,
    Stage,
)
from fivefold.data_parallel.transports import (
    GradTransport,
    Int8AllToAll,
    PlainReduceScatter,
    ReplicaAllReduce,
)
from fivefold.distributed.comm import Comm, Placement
from fivefold.materialize import materialize
from fivefold.optim.clip import step_together

__all__ = ["ZeroDataParallel", "ZeroOptions", "compose", "default_no_decay"]


def compose(options: ZeroOptions, comm: Comm, grad_dtype: torch.dtype) -> Stage:
    """The strategy objects `options` ask for, over the shard group `comm` (checked:
    `check_options`)."""
    replicate = (
        options.replicate if options.replicate is not None and options.replicate.size > 1 else None
    )
    # every rank a gradient is averaged over: the shard group, times the replicas under HSDP
    divisor = comm.size * (replicate.size if replicate is not None else 1)
    buffers = ConstantBuffers() if options.constant_buffers else FreshBuffers()
    common = dict(
        divisor=divisor, grad_dtype=grad_dtype, buffers=buffers, bucket_mb=options.bucket_mb
    )
    if options.stage == 0:
        return AllReduce(comm, **common)
    transport: GradTransport
    if options.qgz and comm.size > 1:
        # (`dequantize_sum` looked up as the engine is built: a test wraps it to see what arrives)
        transport = Int8AllToAll(comm, options.quant_block, dequantize_sum)
    else:
        transport = PlainReduceScatter(comm, divisor)
        if replicate is not None:
            transport = ReplicaAllReduce(transport, replicate)
    if options.stage in (1, 2):
        return ReduceScatter(
            comm,
            transport,
            keep_full=options.stage == 1,
            inflight_buckets=options.inflight_buckets,
            **common,
        )
    gather: Gather = Int8Gather(options.quant_block) if options.qwz else PlainGather()
    if options.fp8_gather is not None:
        gather = Float8Gather(options.fp8_gather)
    if options.hpz_comm is not None:
        gather = SecondaryGather(options.hpz_comm, gather)
    return ShardedParams(
        comm,
        transport,
        gather=gather,
        units=options.units,
        reshard_after_forward=options.reshard_after_forward,
        prefetch=options.prefetch,
        inflight_buckets=options.inflight_buckets,
        **common,
    )


class ZeroDataParallel(nn.Module):
    """Data parallelism with ZeRO stage 0-3 on flat padded buffers, owning its sharded optimizer.
    Per step: ``model.backward(loss)`` per micro-batch, then ``norm = model.step(max_norm)``. Built
    from `ZeroOptions` (``ZeroDataParallel(module, comm, ZeroOptions(stage=3, ...))``) or the same
    keywords (``ZeroDataParallel(module, comm, zero_stage=3, lr=1e-3)``;
    `ZeroOptions.from_keywords`). A module built on the meta device is materialised on ``device``
    from ``init_value(name)`` (the unsharded value, drawn one parameter at a time): each rank
    allocates only what it holds, so start-up costs its share, not the model. ``replicate`` (HSDP,
    stages 1-3): the group across which ``comm``'s shard groups hold the same shards; ZeRO++'s
    ``hpz_comm`` (stage 3, a `Comm` over a few ranks of ``comm``, e.g. `ParallelMesh.hpz_comm`).
    What each stage does is its strategy's (``self.strategy``, `compose`)."""

    def __init__(
        self,
        module: nn.Module,
        comm: Comm,
        options: ZeroOptions | None = None,
        **keywords: Any,
    ) -> None:
        super().__init__()
        if options is None:
            options = ZeroOptions.from_keywords(**keywords)
        elif keywords:
            raise TypeError(
                "ZeroDataParallel got options and keywords "
                f"({', '.join(sorted(keywords))}): put them in the ZeroOptions"
            )
        check_options(options, comm)
        o = self.options = options
        self.module = module
        self.comm = comm
        self.mp = o.mixed_precision or MixedPrecision()
        self.strategy = compose(o, comm, self.mp.grad_dtype)
        # HSDP: the replicas' group (None: plain ZeRO over `comm`)
        self.replicate = o.replicate if o.replicate is not None and o.replicate.size > 1 else None
        self.reduce_size = self.strategy.divisor
        self.offload_optimizer = o.offload_optimizer
        # `params`: the parameters this engine owns (default all; MoE experts get an engine of their
        # own).
        self.owns = o.params or (lambda name, p: True)
        # Gradients are averaged over `comm` (× replicate; each bucket pre-divided by
        # `reduce_size`); `grad_divisor` asks for another divisor (expert gradients, already summed
        # over ep by the all-to-all, divide by dp × cp): each backward's contribution is scaled by
        # size / divisor as it arrives — not the buffer, which accumulates micro-steps.
        self.grad_divisor = o.grad_divisor or self.reduce_size
        # Parameters on the meta device are materialised here, each rank only its share, from
        # `init_value`.
        deferred = {
            name
            for name, p in module.named_parameters()
            if p.device.type == "meta" and self.owns(name, p)
        }
        if deferred and (o.init_value is None or o.device is None):
            raise ValueError(
                f"{len(deferred)} parameters are on the meta device (e.g. '{min(deferred)}'): pass "
                "init_value=(name -> initial value) and device= so that each rank materialises its "
                "share, or materialise the module before wrapping it"
            )
        if deferred:  # storage-less stand-ins on the device, repointed into the flat buffers below
            materialize(module, o.device, storage=False, select=lambda name: name in deferred)
        init_value = o.init_value
        self._value_of = lambda name, p: init_value(name) if name in deferred else p.detach()
        # (deferred values are the same on every rank by construction); HSDP: then across the
        # replicas
        for group in (comm, self.replicate) if o.broadcast_init else ():
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

        named = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad and self.owns(n, p)
        ]
        # which torch optimizer steps each parameter (`optimizers`); a non-elementwise one (Muon)
        # steps whole parameters, so their flats get whole-parameter owners (`ownership`)
        self.optimizer_choice = choice = o.optimizer_choice()
        inner_of = {n: choice.which(n, p) for n, p in named}
        keys, group_of = self._optimizer_groups(module, named, inner_of)
        if self.grad_divisor != self.reduce_size:
            factor = self.reduce_size / self.grad_divisor
            for _, p in named:
                p.register_hook(lambda g, factor=factor: g * factor)

        master_home = MasterOnHost if o.offload_optimizer else MasterOnDevice  # the policy
        owned_whole = {n for n, i in inner_of.items() if not choice.optimizers[i].elementwise}
        if o.fp8_gather is not None and o.stage == 3:  # an FP8 weight is cast whole by its owner
            owned_whole |= {n for n, _ in named if o.fp8_gather.gathered_in_float8(n)}
        spec = FlatSpec(
            comm,
            group_of,
            self.mp.param_dtype,
            self._value_of,
            master_home,
            whole=(lambda name, p: name in owned_whole) if owned_whole else None,
        )
        self.flats: list[FlatParam] = self.strategy.build_flats(
            module,
            named,
            spec,
            owns=self.owns,
            after_unit_backward=self._unit_backward_done if o.find_unused else None,
        )
        self.fsdp: FSDPHooks | None = getattr(self.strategy, "fsdp", None)
        self.buckets: list[GradBucket] = self.strategy.make_buckets()
        self.reducer = BucketedGradReducer(self.buckets, self.strategy, find_unused=o.find_unused)
        loss_scaler = o.loss_scaler
        if loss_scaler is None and self.mp.needs_loss_scaling:
            loss_scaler = DynamicLossScaler()
        self.loss_scaler = loss_scaler
        group_kwargs = [
            {"weight_decay": 0.0 if skip else o.weight_decay, "placement": placement}
            for _, skip, placement in keys
        ]
        self.optimizer = ShardedOptimizer.for_flat_params(
            self.flats,
            choice,
            group_kwargs,
            comm,
            loss_scaler=loss_scaler,
            group_optimizers=[inner for inner, _, _ in keys],
        )

    def _optimizer_groups(
        self, module: nn.Module, named: list[tuple[str, nn.Parameter]], inner_of: dict[str, int]
    ) -> tuple[list[tuple[int, bool, Placement]], Any]:
        """Optimizer groups: the inner optimizer (``inner_of``: Muon or AdamW, `optimizers`) ×
        (weight decay or not) × placement (mesh dims besides dp a parameter is partitioned over,
        from `placement_of`); placement matters only for the global gradient norm, the engine knows
        no other dim. Returns the group keys (by optimizer, decay first, then partitioned before
        replicated: a fixed order of the groups in every flat buffer) and each parameter's group
        index."""
        o = self.options
        no_decay, placement_of = o.no_decay, o.placement_of
        embeddings = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
        keys_of: dict[str, tuple[int, bool, Placement]] = {}

        def key_of(name: str, p: nn.Parameter) -> tuple[int, bool, Placement]:
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
                    inner_of[name],
                    skip_decay,
                    frozenset(placement_of(name, p)) if placement_of is not None else frozenset(),
                )
            return keys_of[name]

        keys = sorted(
            {key_of(n, p) for n, p in named},
            key=lambda k: (k[0], k[1], -len(k[2]), sorted(k[2])),
        )

        def group_of(name: str, p: nn.Parameter) -> int:
            return keys.index(key_of(name, p))

        return keys, group_of

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the strategy (0-3)."""
        return self.strategy.number

    @property
    def hpz_comm(self) -> Comm | None:
        """ZeRO++ hpZ's group for backward gathers (None: off)."""
        return getattr(self.strategy, "hpz_comm", None)

    def _unit_backward_done(self, unit: int) -> None:
        self.reducer.no_more_grads(self.buckets[unit])

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
        """Reduce what `no_sync()` accumulated now, outside any backward (a pipeline reduces once
        after its last)."""
        self.reducer.sync_now()
        self.strategy.on_backward_end()

    def step(self, max_norm: float | None = None) -> float | None:
        """Optimizer step on the shards (clipping by the global norm if `max_norm`); clears
        gradients. With TP / PP partitioned parameters use `fivefold.optim.step_together(engines,
        max_norm, comms)`."""
        return step_together([self], max_norm)

    def check_step_allowed(self) -> None:
        """Raise if the gradients are not ready for a step (an interrupted or unreduced
        backward)."""
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
        self.strategy.drop_unfinished()
        self.optimizer.zero_grad()
        self.reducer.zero_grad()
        self.strategy.between_steps()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter (fp32 master) gathered under the module's own names, plus frozen ones and
        buffers. Collective: call on every rank."""
        master_by_param: dict[int, torch.Tensor] = {}
        for flat in self.flats:
            gathered = flat.full_master()
            for name, p in zip(flat.names, flat.params):
                master_by_param[id(p)] = gathered[name]
        # keep_vars: parameters come back as the Parameter objects, tied ones under every name.
        # Another engine's parameters (MoE experts / the rest) are that engine's to report.
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
        """What this rank holds, for `fivefold.observe.memory.model_state_bytes`: params, grads,
        optimizer; ``buffers``: the constant buffers (pools and gather slots, whoever borrows them
        now);
        ``host``: the offloaded ones."""
        buffers = self.strategy.buffers.tensors()
        buffers += (
            self.fsdp.slots.slots if self.fsdp is not None and self.fsdp.slots is not None else []
        )
        params = [f.full for f in self.flats if f.owns_storage] + [f.local for f in self.flats]
        params += [
            f.host_staging for f in self.flats if f.host_staging is not None
        ]  # offload: the cast shard
        params += [f.secondary for f in self.flats if f.secondary is not None]  # hpZ's copy
        params += [f.gathered for f in self.flats if f.gathered is not None]  # FP8-gathered units
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
