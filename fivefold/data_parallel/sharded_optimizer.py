"""`ShardedOptimizer`: torch optimizers stepping only this rank's shard.

ZeRO-1 (docs/design.md#mechanisms): for AdamW, knowing part of the gradient is enough to compute
that part's first and second moments and update that part of the parameters, so an optimizer over
the fp32 master shard is exact with state KΨ/N. An optimizer that is not elementwise but steps each
parameter on its own (Muon orthogonalises a whole matrix; docs/design.md#muon-under-zero) is exact
over whole parameters: its flats have whole-parameter owners (`ownership`) and each owned parameter
is one optimizer tensor of its own shape. Several optimizers side by side (Muon for the matrices,
AdamW for the rest: `optimizers.MatricesApart`) are one `optimizers.CombinedOptimizer`; an
optimizer coupling parameters (LBFGS) is refused. Used standalone after DDP (like
ZeroRedundancyOptimizer) or by the ZeRO engine. A step: unscale
(fp16) -> global norm by placement (`fivefold.optim.clip`; also the inf/nan skip every rank agrees
on) -> clip -> inner step -> write back -> all-gather (ZeRO-1/2).

The inner optimizer's tensors are each flat's `FlatParam.segmentation` of its master shard: whole
shards stepped by a fused (else multi-tensor) kernel on an accelerator, cache-sized segments stepped
one at a time on the CPU; the squared norms come from one `torch._foreach_norm` per placement, so a
step dispatches a few operations per flat buffer whatever its size.

Offloaded flats (`FlatParam.offload`, docs/design.md#offload-and-constant-buffers): the norm and the
clipping still run on the device gradient shards (the global-norm collectives stay on the group's
device); then every flat's clipped fp32 shard starts its copy to the host (`offload.copy_to_host`,
one arrival event each), and the host steps the flats in order, waiting for each one's arrival
only before stepping it (so the copies of the next flats overlap the host step of this one), with
the host's share of the local cores (`offload.host_step_threads`); each flat's update starts back
to the device (`FlatParam.write_back`) as soon as it is stepped.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from typing import Any

import torch
from torch import nn

from fivefold import formulas
from fivefold.data_parallel import offload as host
from fivefold.data_parallel.flat_param import FlatParam, segmentation_for
from fivefold.data_parallel.mixed_precision import DynamicLossScaler
from fivefold.data_parallel.optimizers import (
    ELEMENTWISE_OPTIMIZERS,  # noqa: F401 (re-exported)
    CombinedOptimizer,
    OneOptimizer,
    OptimizerChoice,
    inner_optimizer,
    takes_found_inf,
)
from fivefold.data_parallel.ownership import balance_owners
from fivefold.distributed.comm import Comm, Placement
from fivefold.optim.clip import global_grad_sq_norm


def check_elementwise(optimizer_class: type, elementwise: bool | None) -> None:
    """Raise (one line saying what to pass) unless ZeRO can shard `optimizer_class`'s state: by
    element, or by whole parameter (`optimizers.inner_optimizer`)."""
    inner_optimizer(optimizer_class, None, elementwise)


def write_back(flats: Iterable[FlatParam], refreshed: Collection[FlatParam] = ()) -> None:
    """Refresh the compute copies from the fp32 masters (`FlatParam.write_back`; not those in
    `refreshed`, written back already), then all-gather the updated shards of the sharded flats
    that stay gathered (ZeRO-1/2), all launched before any is waited on."""
    works = []
    done = {id(f) for f in refreshed}
    for f in flats:
        if id(f) not in done:
            f.write_back()
        if f.sharded and not f.reshard_enabled:
            works.append(f.gather_params())
    for w in works:
        w.wait()


class ShardedOptimizer:
    """An inner torch optimizer over the fp32 master shards of a list of `FlatParam`s."""

    def __init__(
        self,
        params: Iterable[nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_class: type,
        comm: Comm,
        *,
        elementwise: bool | None = None,
        **defaults: Any,
    ) -> None:
        """Standalone: flattens `params` (tensors or param-group dicts) into one flat buffer per
        (dtype, device); a non-elementwise optimizer (Muon) gets whole-parameter owners."""
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        group_kwargs = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        group_index = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
        by_kind: dict[tuple[torch.dtype, torch.device], list[tuple[str, nn.Parameter]]] = {}
        for gi, g in enumerate(groups):
            for pi, p in enumerate(g["params"]):
                if p.requires_grad:
                    by_kind.setdefault((p.dtype, p.device), []).append((f"group{gi}.param{pi}", p))
        choice = OneOptimizer(inner_optimizer(optimizer_class, defaults, elementwise))
        whole = not choice.optimizer.elementwise
        sizes = [(n, p.numel()) for named in by_kind.values() for n, p in named]
        owners = balance_owners(sizes, comm.size) if whole else None
        flats = [
            FlatParam(
                i,
                named,
                comm,
                group_of=lambda n, p: group_index[id(p)],
                param_dtype=dtype,
                sharded=True,
                owners=owners,
            )
            for i, ((dtype, _), named) in enumerate(by_kind.items())
        ]
        self.flats, self.comm, self.grads_from_params = flats, comm, True
        self.loss_scaler: DynamicLossScaler | None = None
        self._build_inner(choice, group_kwargs, [0] * len(group_kwargs))

    @classmethod
    def for_flat_params(
        cls,
        flats: list[FlatParam],
        optimizer: type | OptimizerChoice,
        group_kwargs: list[dict[str, Any]],
        comm: Comm,
        *,
        loss_scaler: DynamicLossScaler | None = None,
        elementwise: bool | None = None,
        group_optimizers: list[int] | None = None,
        **defaults: Any,
    ) -> ShardedOptimizer:
        """Engine use: gradient shards arrive in ``flat.grad_shard`` from the reduce-scatter.
        `optimizer`: a class (with ``defaults`` as its keywords) or a choice of several
        (`optimizers`), ``group_optimizers[g]`` naming the one that steps group g."""
        self = cls.__new__(cls)
        self.flats, self.comm, self.grads_from_params = flats, comm, False
        self.loss_scaler = loss_scaler
        if isinstance(optimizer, type):
            optimizer = OneOptimizer(inner_optimizer(optimizer, defaults, elementwise))
        self._build_inner(optimizer, group_kwargs, group_optimizers or [0] * len(group_kwargs))
        return self

    def _build_inner(
        self,
        choice: OptimizerChoice,
        group_kwargs: list[dict[str, Any]],
        group_optimizers: list[int],
    ) -> None:
        """Both constructors' common part, once ``flats``, ``comm``, ``grads_from_params`` and
        ``loss_scaler`` are set: one torch optimizer per inner optimizer of `choice` over its
        groups of the flats' master shards (`optimizers.CombinedOptimizer` when there are
        several), with each parameter's norm placement."""
        flats, comm = self.flats, self.comm
        self.sharded = any(f.sharded for f in flats)
        self.choice, self.group_optimizers = choice, group_optimizers
        by_inner: list[list[dict[str, Any]]] = [[] for _ in choice.optimizers]
        for g, kwargs in enumerate(group_kwargs):
            members = [
                mp
                for f in flats
                for (gid, _, _), mp in zip(f.segments, f.master_params)
                if gid == g
            ]
            if members:
                by_inner[group_optimizers[g]].append({"params": members, **kwargs})
        inner_groups = [g for groups in by_inner for g in groups]
        # What the global norm sums over: the group's own placement, plus dp where this optimizer
        # shards.
        dp: Placement = (
            frozenset({self.comm.dim}) if self.sharded else frozenset()
        )  # "dp" (or dp_cp, ep_dp, dp_shard)
        self._placement = {
            id(p): frozenset(g.get("placement", ())) | dp for g in inner_groups for p in g["params"]
        }
        # the kernels that go with the masters' segmentation (fused AdamW over whole shards on an
        # accelerator; the CPU's per-tensor loop is the reference's); options the user gave win
        master_device = flats[0].master.device if flats else comm.device
        segmentation = flats[0].segmentation if flats else segmentation_for(master_device)
        optimizers = []
        for inner, groups in zip(choice.optimizers, by_inner):
            if not groups and (optimizers or any(by_inner)):
                continue
            if not groups:  # a rank whose shards are all padding still needs a valid optimizer
                # (a 2-D stand-in: Muon takes matrices only)
                empty = nn.Parameter(torch.zeros(0, 0, device=comm.device))
                groups = [{"params": [empty], **(group_kwargs[0] if group_kwargs else {})}]
            kwargs = dict(inner.kwargs)
            if not {"fused", "foreach"} & kwargs.keys():
                kwargs.update(segmentation.kernel_options(inner.cls, master_device))
            optimizers.append(inner.cls(groups, **kwargs))
        self.optimizer: torch.optim.Optimizer | CombinedOptimizer = (
            optimizers[0] if len(optimizers) == 1 else CombinedOptimizer(optimizers)
        )
        self.last_step_skipped = False

    def state_bytes(self, flat: FlatParam) -> int | None:
        """The fp32 optimizer state this rank holds for `flat` (`formulas.optimizer_state_bytes`:
        each segment's elements and tensors at its optimizer's rates); None when AdamW alone steps
        it (the formula's own default)."""
        if all(inner.name == "AdamW" for inner in self.choice.optimizers):
            return None
        parts = []
        for gid, a, b in flat.segments:
            per_element, per_tensor = self.choice.optimizers[self.group_optimizers[gid]].state_bytes
            parts.append((b - a, per_element, 1, per_tensor))
        return formulas.optimizer_state_bytes(parts)

    def state_keys_of(self, inner: int) -> set[str] | None:
        """The per-element state keys the `inner`-th optimizer holds on this rank (Muon:
        momentum_buffer; AdamW: exp_avg, exp_avg_sq), for a checkpoint's pieces; None with one
        optimizer (every key is its)."""
        if len(self.choice.optimizers) == 1:
            return None
        keys: set[str] = set()
        for f in self.flats:
            for (g, _, _), mp in zip(f.segments, f.master_params):
                if self.group_optimizers[g] == inner:
                    for k, v in self.optimizer.state.get(mp, {}).items():
                        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == mp.shape:
                            keys.add(k)
        return keys

    # torch.optim.Optimizer look-alikes, so LR schedules and checkpoints work unchanged.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    def _grad_shards_from_params(self) -> None:
        """Standalone: cut this rank's shard out of each (already averaged) full parameter
        gradient."""
        for f in self.flats:
            f.grad_shard = f.shard_of([p.grad for p in f.params], f.param_dtype)

    def _master_grads(self) -> list[tuple[torch.Tensor, Placement]]:
        """(fp32 gradient of each master segment on the device, its placement): per flat one cast
        (16-bit gradients) and one split into the segments; fp16's unscaling one multi-tensor
        multiply. Offloaded, the master's own ``.grad`` is its view of the host buffer, filled by
        `_host_step` after clipping."""
        grads = []
        # offload: (flat, host gradient buffer, fp32 device gradient shard)
        self._to_host: list[tuple[FlatParam, torch.Tensor, torch.Tensor]] = []
        for f in self.flats:
            if f.grad_shard is None:  # no gradient since the last step: like torch, leave it alone
                for mp in f.master_params:
                    mp.grad = None
                continue
            g = f.grad_shard if f.grad_shard.dtype == torch.float32 else f.grad_shard.float()
            views = f.segment_views(g)
            buffer = f.master_grad_buffer()  # offload: the host's copy
            if buffer is not None:
                self._to_host.append((f, buffer, g))
            homes = f.segment_views(buffer) if buffer is not None else views
            for mp, view, home in zip(f.master_params, views, homes):
                mp.grad = home
                grads.append((view, self._placement[id(mp)]))
        if self.loss_scaler is not None and grads:
            torch._foreach_mul_([g for g, _ in grads], 1.0 / self.loss_scaler.scale)
        return grads

    def _host_step(self) -> None:
        """Offload: start every flat's (clipped) gradient copy to the host, then step the flats in
        order, each after its own copy arrived, and start its update back to the device; the other
        flats' copies travel meanwhile. The same arithmetic as one step over all: an elementwise
        optimizer steps each tensor on its own, and a parameter without ``.grad`` is left alone."""
        arrivals = [host.copy_to_host(buffer, g) for _, buffer, g in self._to_host]
        held = {id(mp): mp.grad for f, _, _ in self._to_host for mp in f.master_params}
        for f, _, _ in self._to_host:
            for mp in f.master_params:
                mp.grad = None
        with host.host_step_threads():
            for (f, _, _), arrival in zip(self._to_host, arrivals):
                host.wait_for(arrival)
                for mp in f.master_params:
                    mp.grad = held[id(mp)]
                self.optimizer.step()
                for mp in f.master_params:
                    mp.grad = None
                f.write_back()
        write_back(self.flats, refreshed=[f for f, _, _ in self._to_host])

    @torch.no_grad()
    def step(self, max_norm: float | None = None) -> torch.Tensor | None:
        """Step the shards; returns the global gradient norm (0-d, on the group's device) when
        computed (clipping or fp16). Standalone, the norm is over this optimizer's groups and dp
        shards; with a loss scaler a non-finite norm makes every rank skip the step."""
        norm, found_inf = None, False
        if max_norm is not None or self.loss_scaler is not None:
            norm = global_grad_sq_norm(
                [self.local_sq_norms()], {self.comm.dim: self.comm}, self.comm.device
            ).sqrt()
            if self.loss_scaler is not None:
                found_inf = not math.isfinite(norm.item())
        self.apply_step(norm, max_norm, found_inf)
        return norm

    @torch.no_grad()
    def local_sq_norms(self) -> dict[Placement, torch.Tensor]:
        """Prepare the fp32 unscaled gradient shards; return this rank's squared sums by placement
        (device tensors)."""
        self._prepare_grads()
        by_placement: dict[Placement, list[torch.Tensor]] = {}
        for g, placement in self._grads:
            by_placement.setdefault(placement, []).append(g)
        # one multi-tensor norm per placement (as torch's clip_grad_norm_), squared and summed
        return {
            placement: torch.stack(torch._foreach_norm(gs)).square().sum()
            for placement, gs in by_placement.items()
        }

    @torch.no_grad()
    def first_non_finite_grad(self) -> str | None:
        """The name of the first parameter whose gradient in this rank's shard has a NaN or Inf
        element (None if none); after `local_sq_norms` prepared the gradients."""
        self._prepare_grads()
        for f in self.flats:
            if f.grad_shard is None:
                continue
            bad = (~torch.isfinite(f.grad_shard)).nonzero()
            if bad.numel():
                at = f.start + int(bad[0, 0])
                for slot in f.layout.slots:
                    if slot.offset <= at < slot.offset + slot.numel:
                        return slot.name
        return None

    def _prepare_grads(self) -> None:
        if getattr(self, "_grads", None) is None:
            if self.grads_from_params:
                self._grad_shards_from_params()
            self._grads = self._master_grads()

    @property
    def skips_on_device(self) -> bool:
        """Whether a step can be skipped on the device, from a flag the host never reads: the inner
        optimizers take ``found_inf`` (fused kernels; fivefold's `Muon`), no loss scaler (its
        scale is updated on the host) and the masters live on the device (offload's host
        optimizer would need the flag on the host)."""
        # (decided by what every rank of the group shares — offload, the optimizers' kind —, never
        # by the masters this rank happens to hold: one that owns none must choose as the others)
        return (
            takes_found_inf(self.optimizer)
            and self.loss_scaler is None
            and not any(f.offload for f in self.flats)
            and all(mp.device == self.comm.device for f in self.flats for mp in f.master_params)
        )

    @torch.no_grad()
    def apply_step(
        self,
        norm: torch.Tensor | None,
        max_norm: float | None = None,
        found_inf: bool | torch.Tensor = False,
    ) -> None:
        """Skip (`found_inf`, agreed by every rank: a loss scaler saw a non-finite norm) or clip to
        `max_norm` by the global `norm` (on the device, as torch's clip_grad_norm_) and step; write
        back, all-gather. A `found_inf` tensor (`NonFiniteWatch`, when `skips_on_device`) is
        handed to the fused kernels, which skip the update on the device when it is 1."""
        if isinstance(found_inf, torch.Tensor):
            self.optimizer.found_inf = found_inf  # read by torch's fused step (GradScaler's way)
            try:
                return self.apply_step(norm, max_norm, False)
            finally:
                self.optimizer.found_inf = None
        self._prepare_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        if found_inf:
            self.last_step_skipped = True
            self.zero_grad()
            return
        if max_norm is not None and norm is not None and self._grads:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_([g for g, _ in self._grads], coef)
        self.last_step_skipped = False
        # a step without a backward: no update, no all-gather. Decided by the gradient shards, not
        # by `_grads`: a rank whose shards are all padding has no segment to step, yet must join the
        # others' all-gathers
        if all(f.grad_shard is None for f in self.flats):
            self.zero_grad()
            return
        if self._to_host:
            self._host_step()
        else:
            self.optimizer.step()
            write_back(self.flats)
        self.zero_grad()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._grads = None
        # (it views the device gradient shards: holding it would keep them alive)
        self._to_host = []
        for f in self.flats:
            f.grad_shard = None
            for mp in f.master_params:
                mp.grad = None
            if self.grads_from_params:
                for p in f.params:
                    p.grad = None
