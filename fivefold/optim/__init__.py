"""Optimizer-side pieces shared by every layout: the global gradient norm over placements and the
step of several engines together (`clip`), the learning-rate schedule (`lr`)."""

from fivefold.optim.clip import global_grad_sq_norm, step_together
from fivefold.optim.lr import lr_at

__all__ = ["global_grad_sq_norm", "lr_at", "step_together"]
