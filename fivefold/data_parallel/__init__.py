"""Data parallelism: flat buckets (shared), DDP, and (next) ZeRO stages 1-3."""

from fivefold.data_parallel.buckets import BucketedGradReducer, FlatLayout, GradBucket, assign_buckets
from fivefold.data_parallel.ddp import DDP, broadcast_module_state

__all__ = ["DDP", "BucketedGradReducer", "FlatLayout", "GradBucket", "assign_buckets", "broadcast_module_state"]
