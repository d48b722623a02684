"""Checkpoints (DCP) keyed by global parameter names, readable by any layout of the same model."""

from fivefold.checkpoint.pieces import Box, Pieces, row_major_boxes
from fivefold.checkpoint.planner import CheckpointMismatch, PiecesLoadPlanner, PiecesSavePlanner
from fivefold.checkpoint.state import TrainingState, param_shares, training_state

__all__ = [
    "Box",
    "CheckpointMismatch",
    "Pieces",
    "PiecesLoadPlanner",
    "PiecesSavePlanner",
    "TrainingState",
    "param_shares",
    "row_major_boxes",
    "training_state",
]
