"""Data parallelism: flat buckets (shared by all), DDP, and the ZeRO 0-3 engine.

`ZeroDataParallel(module, comm, ZeroOptions(stage=...))` is what the trainer wraps every model (or
pipeline stage) in (`fivefold.models.parallelize`): the engine composes a stage strategy
(`strategies`), a gradient transport (`transports`) and buffer policies (`policies`). `DDP` and
`ShardedOptimizer` stand alone for any module.
"""

from fivefold.data_parallel.buckets import (
    BucketedGradReducer,
    FlatLayout,
    GradBucket,
    assign_buckets,
)
from fivefold.data_parallel.ddp import DDP, broadcast_module_state
from fivefold.data_parallel.flat_param import FlatParam
from fivefold.data_parallel.mixed_precision import DynamicLossScaler, MixedPrecision
from fivefold.data_parallel.options import ZeroOptions
from fivefold.data_parallel.sharded_optimizer import ShardedOptimizer
from fivefold.data_parallel.zero import ZeroDataParallel

__all__ = [
    "DDP",
    "BucketedGradReducer",
    "DynamicLossScaler",
    "FlatLayout",
    "FlatParam",
    "GradBucket",
    "MixedPrecision",
    "ShardedOptimizer",
    "ZeroDataParallel",
    "ZeroOptions",
    "assign_buckets",
    "broadcast_module_state",
]
