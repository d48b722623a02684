"""Measured model-state memory of one rank: parameters, gradients, optimizer state.

Seed 001 (ZeRO paper, memory accounting): model states are parameters (2Ψ in 16-bit),
gradients (2Ψ) and optimizer state (KΨ, K = 12 for mixed-precision Adam). This module
measures what a rank actually holds by counting each *unique storage* once (a gradient that
is a view of a flat bucket counts the bucket, padding included; a tied weight counts once),
so tests can compare measurement with the formulas of DESIGN.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ModelStateBytes:
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_mb(self) -> dict[str, float]:
        return {k: v / 2**20 for k, v in
                (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer), ("total", self.total))}


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]]) -> int:
    total = 0
    for t in tensors:
        if t is None or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                      extra_params: Iterable[torch.Tensor] = ()) -> ModelStateBytes:
    """Bytes of unique storages held for parameters, gradients and optimizer state.

    `extra_params` are parameter storages the model does not expose (e.g. fp32 master shards
    kept by a sharded optimizer count as optimizer state instead: pass them via the optimizer).
    """
    seen: set[tuple[str, int]] = set()
    if hasattr(model, "model_state_tensors"):  # ZeRO engines know what they hold (shards, buffers)
        held = model.model_state_tensors()
        return ModelStateBytes(_storage_bytes(held["params"], seen), _storage_bytes(held["grads"], seen),
                               _storage_bytes(held["optimizer"], seen))
    params = list(model.parameters())
    p_bytes = _storage_bytes([*params, *extra_params], seen)
    g_bytes = _storage_bytes((p.grad for p in params), seen)
    o_bytes = 0
    if optimizer is not None:
        state_tensors = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        # Parameters owned by the optimizer but not by the model (fp32 masters) are optimizer state.
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        o_bytes = _storage_bytes([*owned, *state_tensors], seen)
        # A scalar `step` tensor per parameter is bookkeeping, not model state, but it is real
        # memory too: it is counted, and is negligible (4-8 bytes).
    return ModelStateBytes(p_bytes, g_bytes, o_bytes)
