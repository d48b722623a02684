"""`ParallelModel`: what this rank's parallel model offers the trainer, the checkpoints and the
tests, whatever its layout. `parallelize` returns one: a `WholeModel` (pp = 1) or a `PipelinedModel`
(pp > 1), both built on the private base of `models.parallelize`. Nothing here runs; the protocol
only names the members and their contracts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from fivefold.data_parallel import ZeroDataParallel
    from fivefold.distributed.comm import Comm
    from fivefold.models.documents import Documents
    from fivefold.optim.clip import NonFiniteWatch
    from fivefold.pipeline.simulator import Timeline

__all__ = ["Batch", "MeasuredPipeline", "ParallelModel"]

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets) of whole sequences [B, L], token ids


@dataclass(frozen=True)
class MeasuredPipeline:
    """The last step's measured pipeline timeline, the schedule's textbook bubble
    (docs/design.md#pipeline-schedules; None: a schedule without one) and the schedule's name with
    its P, M and V."""

    timeline: Timeline
    formula_bubble: float | None
    title: str


class ParallelModel(Protocol):
    """This rank's share of the model, laid out over the mesh, with its optimizer: the engines (one
    per stage and kind: dense / experts), the loss and, under pp, the pipeline runtime. Collective
    methods must be called by every rank in the same order."""

    engines: dict[
        Any, ZeroDataParallel
    ]  # WholeModel: 0 (and 1: experts); PipelinedModel: (stage, 0 / 1)
    loss_comm: Comm  # the group the loss is averaged over: dp, or dp × cp
    # ``check_finite``'s steps skipped on the device, read on log steps (`optim.clip`)
    finite_watch: NonFiniteWatch
    timeline: Timeline | None  # after `gather_timeline`, under pp: the last step's measured actions

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of whole sequences [B, L] on the device (its layout's positions under
        cp)."""
        ...

    def documents_of(self, tokens: torch.Tensor) -> Documents | None:
        """The documents of whole rows [B, L] of token ids on the CPU (this rank's part, on the
        device) for `forward_backward` and `evaluate`; None when attention crosses documents."""
        ...

    def forward_backward(
        self,
        micro_batches: list[Batch],
        documents: Sequence[Documents | None] | None = None,
        loss_weight: float = 1.0,
    ) -> torch.Tensor:
        """Forward and backward over the step's micro-batches (with their `documents_of`),
        gradients reduced; returns this rank's loss sum (each micro-batch's × `loss_weight`,
        divided by the number of micro-batches), a 0-d tensor on the device."""
        ...

    def step(self, max_norm: float | None, check_finite: bool = False) -> torch.Tensor | None:
        """Clip by the global norm and step every engine together, then update the MoE layers'
        expert bias from the step's loads (`moe.update_expert_bias`, summed over `loss_comm`);
        returns the norm (0-d, on the device) when one was computed. ``check_finite``: raise
        `NonFiniteGradient` on every rank instead of applying it — at once, or, where the
        optimizers skip the step on the device, when the trainer next reads ``finite_watch``."""
        ...

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The step's mean loss over the data-parallel ranks (and pp's last stage), 0-d on the
        device."""
        ...

    def evaluate(
        self,
        batches: list[Batch],
        documents: Sequence[Documents | None] | None = None,
        loss_weight: float = 1.0,
    ) -> float:
        """The mean loss over ``batches`` (forward only; × `loss_weight`), averaged like
        `global_loss`; syncs the host."""
        ...

    def param_groups(self) -> list[dict[str, Any]]:
        """Every engine's optimizer parameter groups (the trainer sets their ``lr``)."""
        ...

    def modules(self) -> list[nn.Module]:
        """The model, or this rank's stages."""
        ...

    def traced_modules(self) -> list[tuple[str, nn.Module]]:
        """What a step trace times, by single-process name: embedding, ``layers.N``, final norm,
        head."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters at master precision (collective over dp)."""
        ...

    def model_state_bytes(self) -> int:
        """Bytes of model states this rank holds (parameters, gradients, optimizer states)."""
        ...

    def moe_load(self) -> dict[str, dict[str, Any]] | None:
        """Per MoE layer, the last micro-batch's expert load (None: a dense model); collective,
        syncs the host."""
        ...

    def action_marks(self) -> list[tuple]:
        """The last step's pipeline actions as clock marks, for a step tracer (none without pp)."""
        ...

    def gather_timeline(self) -> None:
        """Gather the last step's measured pipeline actions into `timeline` (collective over pp;
        no-op without)."""
        ...

    def measured_pipeline(self) -> MeasuredPipeline | None:
        """`gather_timeline`, with the schedule's formula and title; None without pp."""
        ...

    @property
    def step_traffic_dims(self) -> tuple[str, ...]:
        """The mesh dimensions of a step's data-parallel traffic
        (docs/design.md#data-parallel-traffic), as `CommLog.totals` counts them."""
        ...

    def describe_layout(self) -> str:
        """One line naming the layout: degrees, ZeRO stage and ZeRO++, SP, cp, ep, schedule,
        recompute, dtypes."""
        ...
