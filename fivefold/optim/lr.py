"""Learning-rate schedule: linear warmup, then cosine decay to ``lr × min_lr_ratio`` at the last
step."""

from __future__ import annotations

import math

from fivefold.config import Config

__all__ = ["lr_at"]


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr, then cosine decay to lr × min_lr_ratio at the last step."""
    t = cfg.train
    if t.warmup_steps > 0 and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    min_lr = t.lr * t.min_lr_ratio
    return min_lr + 0.5 * (t.lr - min_lr) * (1 + math.cos(math.pi * progress))
