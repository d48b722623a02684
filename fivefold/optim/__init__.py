"""Optimizer pieces shared by every layout: the global-norm step over placements (`clip`), the LR
schedule (`lr`)."""

from fivefold.optim.clip import global_grad_sq_norm, step_together
from fivefold.optim.lr import lr_at

__all__ = ["global_grad_sq_norm", "lr_at", "step_together"]
