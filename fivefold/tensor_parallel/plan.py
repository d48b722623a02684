"""A tensor-parallel plan is data: module-name patterns -> typed styles; `shard_by_plan` applies one.

Seed 003 §7-8 (Megatron). Each style says what a module becomes and which of its parameters end
up holding a 1/T slice (their *placement* is ``{"tp"}``; the others are replicated over tp):

- `Colwise`    weight rows (output features) split; weight and bias sliced;
- `Rowwise`    weight columns (input features) split, exit all-reduce (SP: reduce-scatter); the
               bias is added once, after the exit: replicated;
- `VocabEmbedding` vocabulary rows split, exit as Rowwise;
- `VocabHead`  the output head, column-parallel over the vocabulary with its own entry operator
               (f, or the SP all-gather); its logits feed the vocab-parallel cross-entropy;
- `RegionEntry` one entry operator (f, or the SP all-gather) shared by the column layers of a
               region (attention, MLP), so a block costs 2 entries + 2 exits; no parameters;
- `Norm`       replicated; under SP it sees a sequence chunk, so its weight gradient (a partial
               sum) is all-reduced over tp.

``Colwise``/``Rowwise`` name the config field that must be divisible by the TP degree (for a
clear error before anything is sharded). The plan of fivefold's Llama is `models.plans.LLAMA_TP_PLAN`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from fivefold.comm import Comm, Placement
from fivefold.tensor_parallel.comm_ops import all_reduce_grad_hook, copy_to_tp, gather_from_sp
from fivefold.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["Colwise", "Norm", "RegionEntry", "Rowwise", "TPPlan", "VocabEmbedding", "VocabHead", "shard_by_plan"]

TP: Placement = frozenset({"tp"})
REPLICATED: Placement = frozenset()


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


Style = Colwise | Rowwise | VocabEmbedding | VocabHead | RegionEntry | Norm
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
        raise ValueError(f"tensor parallel: {f}={getattr(config, f)} is not divisible by tp={tp}; choose tp dividing "
                         + ", ".join(f"{g} ({getattr(config, g)})" for g in fields))


def shard_by_plan(model: nn.Module, comm: Comm, plan: TPPlan, sequence_parallel: bool = False,
                  config: Any = None) -> dict[str, Placement]:
    """Swap `model`'s modules (in place) for their parallel versions over the TP group of `comm`;
    return the placement of every parameter ({"tp"}: a slice, {}: replicated). `config` (default
    ``model.config``) is checked for divisibility first. Tied weights stay tied."""
    check_divisible(config if config is not None else model.config, plan, comm.size)
    entry = "gather" if sequence_parallel else "copy"
    names_of: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(pname)
    sliced: set[str] = set()
    for name, module in list(model.named_modules()):
        style = style_for(name, plan)
        if style is None:
            continue
        prefix = f"{name}." if name else ""
        if isinstance(style, VocabEmbedding):
            _set_module(model, name, VocabParallelEmbedding.from_embedding(module, comm, sequence_parallel))
            sliced.add(prefix + "weight")
        elif isinstance(style, Colwise | VocabHead):
            mode = entry if isinstance(style, VocabHead) else "none"
            _set_module(model, name, ColumnParallelLinear.from_linear(module, comm, mode, style.divides))
            sliced.update({prefix + "weight", prefix + "bias"})
        elif isinstance(style, Rowwise):
            _set_module(model, name, RowParallelLinear.from_linear(module, comm, sequence_parallel))
            sliced.add(prefix + "weight")
        elif isinstance(style, RegionEntry):
            module.register_forward_pre_hook(_region_entry(comm, entry))
        elif isinstance(style, Norm):
            if sequence_parallel:
                module.weight.register_hook(all_reduce_grad_hook(comm, "sp_norm_grad"))
        else:
            raise TypeError(f"unknown tensor-parallel style {style!r} for module '{name}'")
    for tied in (names for names in names_of.values() if len(names) > 1):  # e.g. embedding = head: same slice
        shared = model.get_parameter(tied[0])
        for other in tied[1:]:
            owner, _, attr = other.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    return {n: TP if n in sliced else REPLICATED for n, _ in model.named_parameters(remove_duplicate=False)}


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _region_entry(comm: Comm, mode: str):
    def hook(module: nn.Module, args: tuple) -> tuple:
        x = copy_to_tp(args[0], comm) if mode == "copy" else gather_from_sp(args[0], comm)
        return (x, *args[1:])
    return hook
