"""`ZeroDataParallel`: one data-parallel engine for ZeRO stages 0, 1, 2 and 3 (FSDP).

DESIGN.md / seed 001 table, Ψ parameters, N ranks, mixed-precision Adam (K = 12):

| stage | what is sharded            | model states / rank | collectives per step                       |
|-------|----------------------------|---------------------|--------------------------------------------|
| 0     | nothing (DDP)              | 2Ψ + 2Ψ + 12Ψ       | all-reduce Ψ                               |
| 1     | optimizer state            | 2Ψ + 2Ψ + 12Ψ/N     | reduce-scatter Ψ + all-gather Ψ            |
| 2     | + gradients                | 2Ψ + 14Ψ/N          | reduce-scatter Ψ + all-gather Ψ            |
| 3     | + parameters               | 16Ψ/N               | all-gather 2Ψ + reduce-scatter Ψ           |

Where each stage differs (everything else is shared):

- what a full gradient bucket does: `_launch_bucket` — all-reduce (0) or reduce-scatter (1-3),
  in place into the rank's own slice for stage 1 (the full gradient buffer is kept anyway);
- what is kept afterwards: `_finish_bucket` — **ZeRO-2/3 free the non-owned gradients here**
  (`GradBucket.release` after the shard was accumulated), during backward: the reducer completes
  a bucket as soon as it falls out of the ``inflight_buckets`` window; ZeRO-1 keeps the full buffer;
- stage 3 frees each unit's parameters after its reduce-scatter is launched and gathers them
  around each use (`fsdp.FSDPHooks`).

Gradient accumulation: each backward outside `no_sync()` reduces its buckets and accumulates the
result into the sharded gradient (memory stays at the stage's formula; communication is paid
every micro-step). Inside `no_sync()` gradients accumulate unreduced in full-size buffers and
are reduced once, by the first backward outside it (one reduction per step, but stage 2/3 then
hold full gradients until it — the DDP trade-off). ZeRO-1 keeps full buffers regardless, so
deferring costs it no memory.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from fivefold.comm import Comm, Placement
from fivefold.data_parallel.buckets import BucketedGradReducer, GradBucket, assign_buckets
from fivefold.data_parallel.ddp import broadcast_module_state
from fivefold.data_parallel.flat_param import FlatParam
from fivefold.data_parallel.fsdp import FSDPHooks, UnitSpec, find_unit_modules
from fivefold.data_parallel.mixed_precision import DynamicLossScaler, MixedPrecision
from fivefold.data_parallel.sharded_optimizer import ShardedOptimizer
from fivefold.optim.clip import step_together


def default_no_decay(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Norm weights, biases (1-D) and embedding tables get no weight decay (a parameter can also opt
    out with ``param.no_weight_decay = True``, as vocab-parallel embeddings do)."""
    if param.ndim < 2 or getattr(param, "no_weight_decay", False):
        return True
    return any(isinstance(m, nn.Embedding) and m.weight is param for m in module.modules())


class ZeroDataParallel(nn.Module):
    """Data parallelism with ZeRO stage 0-3 on flat padded buffers, owning its sharded optimizer.

    Use: ``model = ZeroDataParallel(module, comm, zero_stage=2, lr=1e-3)``; per step
    ``model.backward(loss)`` (scales for fp16) for each micro-batch, then
    ``norm = model.step(max_norm)`` and nothing else (gradients are cleared by the step).

    ``inflight_buckets`` (ZeRO-2/3): reduce-scatters that may be outstanding after a launch; launching
    one more first waits for the oldest and frees its full-size gradient buffer (and ZeRO-3 frees a
    unit's gathered parameters as soon as all its gradients exist). The peak during backward is then
    the stage's formula plus about ``inflight_buckets + 1`` full gradient buffers (and, for ZeRO-3, the
    gathered units: the current one, ``prefetch`` ahead, and the root).
    """

    def __init__(self, module: nn.Module, comm: Comm, *, zero_stage: int = 0,
                 mixed_precision: MixedPrecision | None = None, bucket_mb: float = 25.0,
                 optimizer_class: type = torch.optim.AdamW, weight_decay: float = 0.0,
                 no_decay: Any = default_no_decay, find_unused: bool = False, units: UnitSpec = None,
                 reshard_after_forward: bool = True, prefetch: int = 1, inflight_buckets: int = 1,
                 loss_scaler: DynamicLossScaler | None = None, broadcast_init: bool = True,
                 elementwise: bool | None = None,
                 placement_of: Callable[[str, nn.Parameter], Placement] | None = None,
                 **optimizer_kwargs: Any) -> None:
        super().__init__()
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={zero_stage}: choose 0 (DDP), 1, 2 or 3 (FSDP)")
        if inflight_buckets < 1:
            raise ValueError(f"inflight_buckets={inflight_buckets}: at least one reduce-scatter must be allowed in "
                             "flight; use 1 (least memory) or more (more overlap)")
        self.module = module
        self.comm = comm
        self.zero_stage = zero_stage
        self.mp = mixed_precision or MixedPrecision()
        if broadcast_init and comm.size > 1:
            broadcast_module_state(module, comm)
        # Frozen parameters are not sharded: they stay replicated, cast to the compute dtype.
        for p in module.parameters():
            if not p.requires_grad:
                p.data = p.data.to(self.mp.param_dtype)

        # Optimizer groups: (weight decay or not) × placement — the mesh dimensions besides dp a parameter
        # is partitioned over (`placement_of`, from the model's plans: a TP slice is {"tp"}, a pipeline
        # stage's parameter adds "pp"). The placement matters only for the global gradient norm
        # (`fivefold.optim.clip`); the engine itself knows no other dimension.
        def key_of(name: str, p: nn.Parameter) -> tuple[bool, Placement]:
            skip_decay = no_decay is not None and no_decay(name, p, module)
            return skip_decay, frozenset(placement_of(name, p)) if placement_of is not None else frozenset()

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # decay first, then partitioned before replicated: a fixed order of the groups in every flat buffer
        keys = sorted({key_of(n, p) for n, p in named}, key=lambda k: (k[0], -len(k[1]), sorted(k[1])))

        def group_of(name: str, p: nn.Parameter) -> int:
            return keys.index(key_of(name, p))

        self.fsdp: FSDPHooks | None = None
        if zero_stage < 3:
            groups = assign_buckets(named, bucket_mb * 2**20)
            self.flats = [FlatParam(i, g, comm, group_of=group_of, param_dtype=self.mp.param_dtype,
                                    sharded=zero_stage >= 1) for i, g in enumerate(groups)]
        else:
            self.flats, unit_modules = self._build_units(module, named, units, group_of)
            # With find_unused, a unit whose backward is over completes its bucket even if a parameter got
            # no gradient, instead of holding every later bucket until backward ends.
            self.fsdp = FSDPHooks(list(zip(unit_modules, self.flats)), reshard_after_forward=reshard_after_forward,
                                  prefetch=prefetch,
                                  after_unit_backward=self._unit_backward_done if find_unused else None)
        # ZeRO-1 copies gradients in (no views): its reduced shard lives inside the kept buffer, and a
        # later backward must not add onto it before `_move_reduced_shard_out` ran.
        self.buckets = [GradBucket(f.index, list(zip(f.names, f.params)), f.layout, self.mp.grad_dtype,
                                   keep_buffer=zero_stage <= 1, views=zero_stage == 0, defer_copy=zero_stage == 3)
                        for f in self.flats]
        self.reducer = BucketedGradReducer(
            self.buckets, launch=self._launch_bucket, finish=self._finish_bucket, find_unused=find_unused,
            on_backward_end=self._on_backward_end,
            before_first_grad=self._move_reduced_shard_out if zero_stage == 1 else None,
            on_all_grads=self._free_unit if zero_stage == 3 else None,
            # ZeRO-2/3 free each full gradient buffer once its reduce-scatter is done; bounding the buckets
            # in flight makes that happen during backward, so the peak holds a few buffers, not all of them.
            # Stages 0/1 keep their buffers anyway: waiting early would buy no memory.
            max_inflight=inflight_buckets if zero_stage >= 2 else None)
        if loss_scaler is None and self.mp.needs_loss_scaling:
            loss_scaler = DynamicLossScaler()
        self.loss_scaler = loss_scaler
        group_kwargs = [{"weight_decay": 0.0 if skip else weight_decay, "placement": placement}
                        for skip, placement in keys]
        self.optimizer = ShardedOptimizer.for_flat_params(
            self.flats, optimizer_class, group_kwargs, comm, loss_scaler=loss_scaler, elementwise=elementwise,
            **optimizer_kwargs)

    def _build_units(self, module: nn.Module, named: list[tuple[str, nn.Parameter]], spec: UnitSpec,
                     group_of: Any) -> tuple[list[FlatParam], list[nn.Module]]:
        owner: dict[int, str] = {}
        by_unit: dict[str, list[tuple[str, nn.Parameter]]] = {}
        unit_mods = dict(find_unit_modules(module, spec))
        # Every name of every parameter (a tied one has several). A parameter used by two units must
        # belong to the root: the root stays gathered around all of its children (forward, and
        # backward until its last gradient), while two sibling units are never gathered together.
        for name, p in module.named_parameters(remove_duplicate=False):
            if not p.requires_grad:
                continue
            unit = max((u for u in unit_mods if u == "" or name.startswith(u + ".")), key=len)
            if id(p) in owner and owner[id(p)] != unit:
                if "" not in (owner[id(p)], unit):
                    raise ValueError(f"parameter '{name}' is shared by units '{owner[id(p)]}' and '{unit}'; tied "
                                     "parameters must live in one ZeRO-3 unit (or be used by the root module)")
                unit = ""
            owner[id(p)] = unit
        for name, p in named:
            by_unit.setdefault(owner[id(p)], []).append((name, p))
        # Bucket order = reverse order of each unit's first parameter: roughly when backward finishes it.
        first_index = {u: min(i for i, (n, _) in enumerate(named) if n in {x for x, _ in ps})
                       for u, ps in by_unit.items()}
        order = sorted(by_unit, key=lambda u: -first_index[u])
        flats = [FlatParam(i, by_unit[u], self.comm, group_of=group_of, param_dtype=self.mp.param_dtype,
                           sharded=True, reshard=True) for i, u in enumerate(order)]
        return flats, [unit_mods[u] for u in order]

    # -- the per-stage part ----------------------------------------------------------------
    def _unit_backward_done(self, unit: int) -> None:
        self.reducer.no_more_grads(self.buckets[unit])

    def _free_unit(self, bucket: GradBucket) -> None:
        """ZeRO-3: every gradient of this unit exists, so its gathered parameters are not needed any more
        (freed now, whatever the launch order; its gradients are copied into the bucket at launch)."""
        self.flats[bucket.index].reshard()

    def _launch_bucket(self, bucket: GradBucket) -> Any:
        flat = self.flats[bucket.index]
        if self.comm.size == 1:
            bucket.out = bucket.grad[flat.start:flat.end]
            return None
        bucket.grad.div_(self.comm.size)  # pre-divide: the sum of g_i / N is the mean
        if self.zero_stage == 0:
            bucket.out = bucket.grad
            return self.comm.all_reduce(bucket.grad, async_op=True, tag=f"bucket{bucket.index}")
        if self.zero_stage == 1:  # in place: the shard lands in this rank's own slice of the kept buffer
            bucket.out = bucket.grad[flat.start:flat.end]
        else:
            bucket.out = torch.empty(flat.shard_numel, dtype=bucket.grad.dtype, device=bucket.grad.device)
        return self.comm.reduce_scatter(bucket.out, bucket.grad, async_op=True, tag=f"bucket{bucket.index}")

    def _finish_bucket(self, bucket: GradBucket) -> None:
        flat = self.flats[bucket.index]
        if self.zero_stage == 0:
            flat.grad_shard = bucket.out  # the all-reduced buffer itself: no copy
        else:
            flat.accumulate_grad(bucket.out)
        bucket.out = None
        # ZeRO-2/3: this is where non-owned gradients are freed — the reducer calls
        # bucket.release() next, dropping the full-size buffer (keep_buffer=False).

    def _on_backward_end(self) -> None:
        if self.fsdp is not None:
            self.fsdp.backward_done()

    def _move_reduced_shard_out(self, bucket: GradBucket) -> None:
        """ZeRO-1, first gradient of a new backward into a bucket whose reduced shard still sits in
        place (gradients accumulated over several synchronising backwards): keep that shard in a
        tensor of its own and clear the buffer for the new local gradients."""
        flat = self.flats[bucket.index]
        if flat.grad_shard is not None and bucket.grad is not None and \
                flat.grad_shard.untyped_storage().data_ptr() == bucket.grad.untyped_storage().data_ptr():
            flat.grad_shard = flat.grad_shard.clone()
            bucket.grad.zero_()

    # -- public ------------------------------------------------------------------------------
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
        """Reduce the gradients accumulated under `no_sync()` now, outside any backward (a pipeline
        runs many backward passes per step and reduces once after the last)."""
        self.reducer.sync_now()
        if self.fsdp is not None:
            self.fsdp.backward_done()

    def step(self, max_norm: float | None = None) -> float | None:
        """Optimizer step on the shards (clipping by the global norm if `max_norm`); clears gradients.
        Parameters partitioned over other mesh dimensions (TP, PP) need those groups for the norm:
        use `fivefold.optim.step_together(engines, max_norm, comms)`."""
        return step_together([self], max_norm)

    def check_step_allowed(self) -> None:
        """Raise if the gradients are not ready for a step (an interrupted or unreduced backward)."""
        if self.reducer.interrupted:
            raise RuntimeError("a backward started but did not finish (did it raise?): its gradients are partly "
                               "reduced. Call zero_grad() and run the step's backward passes again before step()")
        if self.reducer.unsynced:
            raise RuntimeError("gradients from a backward under no_sync() were never reduced: run the last "
                               "micro-batch's backward outside no_sync(), or call sync_gradients(), before step()")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad()
        self.reducer.zero_grad()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter under the wrapped module's own names and shapes, at master (fp32)
        precision, gathered from the shards; frozen parameters and buffers included. Collective:
        call on every rank."""
        master_by_param: dict[int, torch.Tensor] = {}
        for flat in self.flats:
            gathered = flat.full_master()
            for name, p in zip(flat.names, flat.params):
                master_by_param[id(p)] = gathered[name]
        # keep_vars: parameters come back as the Parameter objects, tied ones under every name.
        return {name: master_by_param[id(t)] if id(t) in master_by_param else t.detach().clone()
                for name, t in self.module.state_dict(keep_vars=True).items()}

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank holds, for `fivefold.memory.model_state_bytes`."""
        params = [f.full for f in self.flats] + [f.local for f in self.flats]
        params += [p for p in self.module.parameters() if not p.requires_grad]
        grads = [b.grad for b in self.buckets if b.grad is not None]
        grads += [p.grad for b in self.buckets for p in b.params if p.grad is not None]  # waiting for copy-in
        grads += [f.grad_shard for f in self.flats if f.grad_shard is not None]
        optim = [f.master for f in self.flats]
        optim += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": params, "grads": grads, "optimizer": optim}
