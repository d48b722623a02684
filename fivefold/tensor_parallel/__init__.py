"""Tensor and sequence parallelism: conjugate comm operators, parallel layers, vocab-parallel
loss."""

from fivefold.tensor_parallel.comm_ops import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    scatter_to_sp,
)
from fivefold.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from fivefold.tensor_parallel.loss import vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "gather_from_sp",
    "reduce_from_tp",
    "scatter_to_sp",
    "vocab_parallel_cross_entropy",
]
