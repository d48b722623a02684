"""`ZeroOptions`: everything a `ZeroDataParallel` engine is built from, in one typed object, and the
checks of combinations no strategy can serve (`check_options`).

The engine turns the options into strategy objects (`strategies.compose`): the stage
(docs/design.md#model-state-memory), the gradient transport (plain, HSDP's replicas, qgZ's int8;
docs/design.md#hsdp, docs/design.md#zero-qwz-qgz-hpz), ZeRO-3's gather and the buffer policy
(docs/design.md#offload-and-constant-buffers). ``ZeroDataParallel(module, comm, zero_stage=2,
lr=...)`` remains a shorthand: `ZeroOptions.from_keywords` reads the same keywords (those it does
not know go to the optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from fivefold.data_parallel.flat_param import Float8Units
from fivefold.data_parallel.fsdp import UnitSpec
from fivefold.data_parallel.mixed_precision import DynamicLossScaler, MixedPrecision
from fivefold.data_parallel.optimizers import OneOptimizer, OptimizerChoice, inner_optimizer
from fivefold.distributed.comm import Comm, Placement

__all__ = ["ZeroOptions", "check_options", "default_no_decay"]


def default_no_decay(name: str, param: nn.Parameter, module: nn.Module) -> bool:
    """Norm weights, biases (1-D), embedding tables and ``param.no_weight_decay`` parameters get no
    weight decay."""
    if param.ndim < 2 or getattr(param, "no_weight_decay", False):
        return True
    return any(isinstance(m, nn.Embedding) and m.weight is param for m in module.modules())


@dataclass
class ZeroOptions:
    """How one engine shards, reduces and steps. Groups: what is sharded (``stage``), the buckets
    and the ZeRO-3 units, the optimizer, the parameters it owns and how they start, HSDP, ZeRO++,
    and the buffer / offload policies. ``inflight_buckets`` (ZeRO-2/3) bounds the outstanding
    reduce-scatters: the backward peak is the stage's formula plus about ``inflight_buckets + 1``
    full gradient buffers."""

    # what is sharded: 0 nothing (DDP), 1 optimizer state, 2 + gradients, 3 + parameters (FSDP)
    stage: int = 0
    mixed_precision: MixedPrecision | None = None
    loss_scaler: DynamicLossScaler | None = None
    # buckets (stages 0-2) and units (stage 3)
    bucket_mb: float = 25.0
    find_unused: bool = False
    units: UnitSpec = None
    reshard_after_forward: bool = True
    prefetch: int = 1
    inflight_buckets: int = 1
    # the optimizer on the shards; ``optimizer_kwargs``: lr, betas, eps, ... ``optimizers``: a
    # choice of several by parameter (Muon for the matrices, AdamW for the rest: `optimizers`);
    # when given, the class, kwargs and elementwise above are not used
    optimizer_class: type = torch.optim.AdamW
    weight_decay: float = 0.0
    no_decay: Any = default_no_decay
    elementwise: bool | None = None
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    optimizers: OptimizerChoice | None = None
    # which parameters, where they are partitioned besides dp, how they start
    params: Callable[[str, nn.Parameter], bool] | None = None
    placement_of: Callable[[str, nn.Parameter], Placement] | None = None
    init_value: Callable[[str], torch.Tensor] | None = None
    device: torch.device | str | None = None
    broadcast_init: bool = True
    grad_divisor: int | None = None
    # HSDP (stages 1-3): the group across which the shard groups hold the same shards
    replicate: Comm | None = None
    # ZeRO++: ZeRO-3's int8 gathers (qwZ), ZeRO-2/3's int8 gradient reduce (qgZ), hpZ's group
    qwz: bool = False
    qgz: bool = False
    quant_block: int = 2048
    hpz_comm: Comm | None = None
    # ZeRO-3's FP8 gather (docs/design.md#fp8-training): which parameters travel in FP8 (the FP8
    # linears' weights) and the group a weight's amax is also the max over (tp); None: off
    fp8_gather: Float8Units | None = None
    # policies: ZeRO-R constant buffers, ZeRO-Offload of the optimizer
    constant_buffers: bool = False
    offload_optimizer: bool = False

    def optimizer_choice(self) -> OptimizerChoice:
        """``optimizers``, or the one optimizer the class and kwargs name (checked: an optimizer
        ZeRO cannot shard is refused here)."""
        if self.optimizers is not None:
            return self.optimizers
        return OneOptimizer(
            inner_optimizer(self.optimizer_class, self.optimizer_kwargs, self.elementwise)
        )

    @classmethod
    def from_keywords(cls, zero_stage: int = 0, **keywords: Any) -> ZeroOptions:
        """The engine's keyword shorthand: ``zero_stage`` is ``stage``; keywords that are no option
        (``lr``, ``betas``, ...) go to the optimizer."""
        names = {f.name for f in fields(cls)} - {"stage", "optimizer_kwargs"}
        known = {k: v for k, v in keywords.items() if k in names}
        extra = {k: v for k, v in keywords.items() if k not in names}
        return cls(stage=zero_stage, optimizer_kwargs=extra, **known)


def _replicas(o: ZeroOptions) -> bool:
    return o.replicate is not None and o.replicate.size > 1


def check_options(o: ZeroOptions, comm: Comm) -> None:
    """Raise on a combination no strategy serves (before anything is built)."""
    if o.stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={o.stage}: choose 0 (DDP), 1, 2 or 3 (FSDP)")
    if o.replicate is not None and o.stage == 0:
        raise ValueError(
            "HSDP (a replicate group) shards inside a group: it needs zero_stage 1, 2 or 3 (stage "
            "0 over both groups is plain DDP: use zero_stage=0 over the whole data-parallel group)"
        )
    if o.qgz and _replicas(o):
        raise ValueError(
            "qgz with HSDP (a replicate group) is not supported: the replicas' all-reduce would "
            "have to follow qgZ's dequantised sum; use qwz / hpz_comm with HSDP, or no replicate "
            "group"
        )
    if o.inflight_buckets < 1:
        raise ValueError(
            f"inflight_buckets={o.inflight_buckets}: at least one reduce-scatter must be allowed "
            "in flight; use 1 (least memory) or more (more overlap)"
        )
    _check_zeropp(o, comm)
    whole = not all(inner.elementwise for inner in o.optimizer_choice().optimizers)
    if whole and (o.qwz or o.qgz or (o.hpz_comm is not None and o.hpz_comm.size > 1)):
        raise ValueError(
            "a non-elementwise optimizer (Muon) owns whole parameters, so shards differ in size; "
            "ZeRO++'s qwz / qgz / hpz_comm assume equal shards: turn them off, or use an "
            "elementwise optimizer (AdamW)"
        )
    if o.fp8_gather is not None and o.qgz:
        raise ValueError(
            "fp8_gather gives each FP8 weight one owner, so shards differ in size; qgz's int8 "
            "all-to-all assumes equal shards: use one or the other"
        )
    if o.constant_buffers and _replicas(o) and comm.size == 1:
        raise ValueError(
            "constant_buffers with HSDP over one-rank shard groups: nothing is sharded (that is "
            "DDP over the replicate group); use zero_stage=0 over it, or larger shard groups"
        )
    if o.constant_buffers and (o.qwz or o.qgz):
        raise ValueError(
            "constant_buffers with qwz / qgz: their int8 staging buffers are allocated per "
            "collective, not pooled; use one or the other"
        )


def _check_zeropp(o: ZeroOptions, comm: Comm) -> None:
    stage = o.stage
    if o.fp8_gather is not None and (stage != 3 or o.qwz or o.constant_buffers):
        raise ValueError(
            "fp8_gather casts ZeRO-3's unit gathers to FP8: it needs zero_stage=3, without qwz "
            "(another gather) or constant_buffers (a unit gathers into its own byte buffer)"
        )
    if o.fp8_gather is not None and o.hpz_comm is not None and o.hpz_comm.size > 1:
        raise ValueError("fp8_gather with hpz_comm: hpZ's secondary copy is not built for FP8")
    if o.qwz and stage != 3:
        raise ValueError(
            f"qwz quantises ZeRO-3's parameter all-gathers: it needs zero_stage=3, not {stage}"
        )
    if o.qgz and stage not in (2, 3):
        raise ValueError(
            f"qgz replaces the gradient reduce-scatter of ZeRO-2/3 by a quantised all-to-all: it "
            f"needs zero_stage 2 or 3, not {stage}"
        )
    if (o.qwz or o.qgz) and o.quant_block < 1:
        raise ValueError(
            f"quant_block={o.quant_block}: a quantisation block holds at least one element"
        )
    if o.hpz_comm is not None and o.hpz_comm.size > 1:
        if stage != 3 or not o.reshard_after_forward:
            raise ValueError(
                "hpz_comm (hpZ) gathers a ZeRO-3 unit's backward weights from a secondary copy: it "
                "needs zero_stage=3 with reshard_after_forward=True"
            )
        if comm.size % o.hpz_comm.size:
            raise ValueError(
                f"the hpZ group ({o.hpz_comm.size} ranks) must divide the data-parallel group "
                f"({comm.size})"
            )
