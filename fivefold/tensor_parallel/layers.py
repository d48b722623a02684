"""Tensor-parallel layers (Megatron, docs/design.md#tensor-and-sequence-parallelism), each holding
this rank's slice of a weight: column-parallel splits output features, row-parallel input features
(partial outputs summed by the exit), the embedding vocabulary rows. Each is built *from* the full
module (`from_linear`): every rank initialises the whole weight from the model's seed and keeps its
slice, so TP and single-process runs start from identical weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.distributed.comm import Comm
from fivefold.ops import Matmul, linear
from fivefold.tensor_parallel.comm_ops import (
    all_reduce_grad_hook,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    scatter_to_sp,
)


def shard_range(size: int, comm: Comm, what: str) -> tuple[int, int]:
    if size % comm.size:
        raise ValueError(
            f"{what}={size} is not divisible by tp={comm.size}; choose a tensor-parallel degree "
            f"that divides it"
        )
    chunk = size // comm.size
    return comm.rank * chunk, (comm.rank + 1) * chunk


def _entry(x: torch.Tensor, comm: Comm, mode: str) -> torch.Tensor:
    if mode == "copy":
        return copy_to_tp(x, comm)
    if mode == "gather":
        return gather_from_sp(x, comm)
    return x


def _exit(x: torch.Tensor, comm: Comm, sequence_parallel: bool) -> torch.Tensor:
    return scatter_to_sp(x, comm) if sequence_parallel else reduce_from_tp(x, comm)


class _ShardedLinear(nn.Module):
    """What both parallel linears hold: this rank's slice of the weight (and of the bias, if any)
    and the TP group it is split over; ``matmul``: how x Wᵀ is computed (`ops.linear`, or an FP8
    strategy), ``split_dims``: which operand dims this rank holds a slice of (an FP8 matmul's
    scales are the max over the group along them: `float8.split_scope`)."""

    matmul: Matmul = staticmethod(linear)
    split_dims: dict[str, int] = {}

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm) -> None:
        super().__init__()
        self.comm = comm
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None


class ColumnParallelLinear(_ShardedLinear):
    """y_local = x W_localᵀ, W split by rows; `input_mode` "copy" (f), "gather" (SP) or "none" (e.g.
    `RegionEntry`)."""

    # the weight's rows and the output's (and its gradient's) columns are this rank's
    split_dims = {"weight": 0, "grad_output": 1}

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm, input_mode: str = "none"
    ) -> None:
        super().__init__(weight, bias, comm)
        self.input_mode = input_mode

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        comm: Comm,
        input_mode: str = "none",
        what: str = "out_features",
    ) -> ColumnParallelLinear:
        a, b = shard_range(linear.out_features, comm, what)
        bias = linear.bias.detach()[a:b].clone() if linear.bias is not None else None
        return cls(linear.weight.detach()[a:b].clone(), bias, comm, input_mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(_entry(x, self.comm, self.input_mode), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, tp={self.comm.size}, input={self.input_mode}"


class RowParallelLinear(_ShardedLinear):
    """y = Σ_ranks x_local W_localᵀ (+ bias once) with W split by columns; exit all-reduce / SP
    scatter."""

    # the weight's columns and the input's are this rank's
    split_dims = {"input": 1, "weight": 1}

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        comm: Comm,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__(weight, bias, comm)
        self.sequence_parallel = sequence_parallel
        if (
            self.bias is not None and sequence_parallel
        ):  # added to each rank's chunk: sum the partial grads
            self.bias.register_hook(all_reduce_grad_hook(comm, "sp_bias_grad"))

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        comm: Comm,
        sequence_parallel: bool = False,
        what: str = "in_features",
    ) -> RowParallelLinear:
        a, b = shard_range(linear.in_features, comm, what)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(linear.weight.detach()[:, a:b].clone(), bias, comm, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _exit(self.matmul(x, self.weight, None), self.comm, self.sequence_parallel)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"local {tuple(self.weight.shape)}, tp={self.comm.size}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [vocab_start, vocab_end) on this rank; the exit operator sums the ranks'
    parts."""

    def __init__(
        self, weight: torch.Tensor, vocab_start: int, comm: Comm, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + weight.shape[0]
        self.weight = nn.Parameter(weight)
        self.weight.no_weight_decay = True  # an embedding table, like nn.Embedding's

    @classmethod
    def from_embedding(
        cls, emb: nn.Embedding, comm: Comm, sequence_parallel: bool = False
    ) -> VocabParallelEmbedding:
        a, b = shard_range(emb.num_embeddings, comm, "vocab_size")
        return cls(emb.weight.detach()[a:b].clone(), a, comm, sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return _exit(out, self.comm, self.sequence_parallel)

    def extra_repr(self) -> str:
        return (
            f"rows [{self.vocab_start}, {self.vocab_end}), tp={self.comm.size}, "
            f"sp={self.sequence_parallel}"
        )
