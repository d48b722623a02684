"""A tensor-parallel plan is data (module-name patterns -> typed styles), applied by `shard_by_plan`
(docs/design.md#tensor-and-sequence-parallelism).
`Colwise` splits output features; `Rowwise` input features (its bias, added once after the exit, is
replicated); `VocabEmbedding` / `VocabHead` the vocabulary; `RegionEntry` is one entry operator
shared by a region's column layers (2 entries + 2 exits per block); `Norm` stays replicated, its
weight gradient all-reduced under SP (a partial sum); `HeadNorm` (per-head q/k norms) too, its
gradient always all-reduced (each rank holds other heads). ``divides`` names the config field tp
must divide, checked before anything is sharded."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fivefold.distributed.comm import Comm, Placement
from fivefold.tensor_parallel.comm_ops import all_reduce_grad_hook, copy_to_tp, gather_from_sp
from fivefold.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

__all__ = [
    "Colwise",
    "HeadNorm",
    "Norm",
    "ParamPlacement",
    "RegionEntry",
    "Rowwise",
    "TPPlan",
    "VocabEmbedding",
    "VocabHead",
    "shard_by_plan",
]


@dataclass(frozen=True)
class ParamPlacement:
    """Where a parameter's elements live under TP: split along tensor dimension `tp_dim` over the tp
    group (rank r holds the r-th contiguous chunk), or replicated (None). The global norm needs
    `mesh_dims`; checkpoints that reshard, and tests, need the dimension."""

    tp_dim: int | None = None

    @property
    def mesh_dims(self) -> Placement:
        return frozenset({"tp"}) if self.tp_dim is not None else frozenset()

    def local_part(self, full: torch.Tensor, comm: Comm) -> torch.Tensor:
        """What tp rank ``comm.rank`` holds of the unsharded value `full` (a view)."""
        return full if self.tp_dim is None else full.chunk(comm.size, self.tp_dim)[comm.rank]


@dataclass(frozen=True)
class Colwise:
    divides: str  # config field split by this layer's output features (e.g. "n_heads")


@dataclass(frozen=True)
class Rowwise:
    divides: str | None = None  # input features are another layer's outputs: checked there


@dataclass(frozen=True)
class VocabEmbedding:
    divides: str = "vocab_size"


@dataclass(frozen=True)
class VocabHead:
    divides: str = "vocab_size"


@dataclass(frozen=True)
class RegionEntry:
    divides: None = None


@dataclass(frozen=True)
class Norm:
    divides: None = None


@dataclass(frozen=True)
class HeadNorm:
    """A norm over each head's channels (Qwen3's q/k norms), one weight for every head: replicated,
    and its gradient always a partial sum (each rank normalises its own heads), all-reduced."""

    divides: None = None


Style = Colwise | Rowwise | VocabEmbedding | VocabHead | RegionEntry | Norm | HeadNorm
TPPlan = Mapping[str, Style]


def style_for(name: str, plan: TPPlan) -> Style | None:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def check_divisible(config: Any, plan: TPPlan, tp: int) -> None:
    """Every config field the plan splits is divisible by `tp`, or a ValueError naming them all."""
    fields = sorted({s.divides for s in plan.values() if s.divides is not None})
    bad = [f for f in fields if getattr(config, f) % tp]
    if bad:
        f = bad[0]
        raise ValueError(
            f"tensor parallel: {f}={getattr(config, f)} is not divisible by tp={tp}; choose tp "
            "dividing " + ", ".join(f"{g} ({getattr(config, g)})" for g in fields)
        )


def shard_by_plan(
    model: nn.Module, comm: Comm, plan: TPPlan, sequence_parallel: bool = False, config: Any = None
) -> dict[str, Placement]:
    """Swap `model`'s modules in place for their parallel versions over `comm` (tied weights stay
    tied); return each parameter's placement. `config` (default ``model.config``) is checked for
    divisibility first."""
    check_divisible(config if config is not None else model.config, plan, comm.size)
    entry = "gather" if sequence_parallel else "copy"
    names_of: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(pname)
    sliced: dict[str, int] = {}  # parameter -> the tensor dimension split over tp
    for name, module in list(model.named_modules()):
        style = style_for(name, plan)
        if style is None:
            continue
        prefix = f"{name}." if name else ""
        if isinstance(style, VocabEmbedding):
            _set_module(
                model, name, VocabParallelEmbedding.from_embedding(module, comm, sequence_parallel)
            )
            sliced[prefix + "weight"] = 0  # vocabulary rows
        elif isinstance(style, Colwise | VocabHead):
            mode = entry if isinstance(style, VocabHead) else "none"
            _set_module(
                model, name, ColumnParallelLinear.from_linear(module, comm, mode, style.divides)
            )
            sliced.update({prefix + "weight": 0, prefix + "bias": 0})  # output features
        elif isinstance(style, Rowwise):
            _set_module(model, name, RowParallelLinear.from_linear(module, comm, sequence_parallel))
            sliced[prefix + "weight"] = 1  # input features; the bias is added once, after the exit
        elif isinstance(style, RegionEntry):
            module.register_forward_pre_hook(_region_entry(comm, entry))
        elif isinstance(style, Norm):
            if sequence_parallel:
                module.weight.register_hook(all_reduce_grad_hook(comm, "sp_norm_grad"))
        elif isinstance(style, HeadNorm):
            module.weight.register_hook(all_reduce_grad_hook(comm, "head_norm_grad"))
        else:
            raise TypeError(f"unknown tensor-parallel style {style!r} for module '{name}'")
    for tied in (
        names for names in names_of.values() if len(names) > 1
    ):  # e.g. embedding = head: same slice
        shared = model.get_parameter(tied[0])
        for other in tied[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    return {
        n: ParamPlacement(sliced.get(n)) for n, _ in model.named_parameters(remove_duplicate=False)
    }


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _region_entry(comm: Comm, mode: str):
    def hook(module: nn.Module, args: tuple) -> tuple:
        x = copy_to_tp(args[0], comm) if mode == "copy" else gather_from_sp(args[0], comm)
        return (x, *args[1:])

    return hook
