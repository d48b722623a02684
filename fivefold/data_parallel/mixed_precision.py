"""Mixed-precision policy and dynamic loss scaling.

Mixed-precision Adam (the ZeRO paper's accounting, docs/design.md#model-state-memory): 16-bit
parameters and gradients (2Ψ + 2Ψ), fp32 master weights plus Adam's m and v in the (sharded)
optimizer (KΨ, K = 12). fp16 needs loss scaling: a step whose gradients overflowed on any rank is
skipped and the scale halved; it doubles after `growth_interval` clean steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype '{name}'; use one of fp32, bf16, fp16")
    return _DTYPES[name]


@dataclass(frozen=True)
class MixedPrecision:
    """param_dtype: the parameters' storage and compute; reduce_dtype: gradient buckets, collectives
    (None = fp32)."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None

    @classmethod
    def from_names(cls, param: str, reduce: str | None = None) -> MixedPrecision:
        return cls(
            parse_dtype(param), parse_dtype(reduce) if reduce not in (None, "", "none") else None
        )

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.reduce_dtype or torch.float32

    @property
    def needs_loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16


class DynamicLossScaler:
    """Loss scale S for fp16: halve on overflow (step skipped), double after a run of good steps."""

    def __init__(
        self, init_scale: float = 2.0**16, growth_interval: int = 1000, min_scale: float = 1.0
    ) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self._good_steps = 0
        self.skipped_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "good_steps": self._good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale, self._good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])

    def update(self, found_inf: bool) -> None:
        """Called with the decision agreed by every rank."""
        if found_inf:
            self.scale = max(self.scale / 2, self.min_scale)
            self._good_steps = 0
            self.skipped_steps += 1
        else:
            self._good_steps += 1
            if self._good_steps % self.growth_interval == 0:
                self.scale *= 2
