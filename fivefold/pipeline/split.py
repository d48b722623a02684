"""Cutting a model into pipeline stages by module names (torchtitan style;
docs/design.md#pipeline-schedules); imports no model. A stage is the model with every module not
named for it removed (`keep_only`), so parameters keep their single-process names and the model's
own forward, which skips absent parts, runs the stage."""

from __future__ import annotations

import copy
from collections.abc import Iterable

from torch import nn

__all__ = ["copy_kept", "keep_only", "split_layers"]


def split_layers(
    n_layers: int, n_stages: int, layers_per_stage: list[int] | None = None
) -> list[range]:
    """Contiguous block ranges per stage: explicit, or even with extras on early stages (the last
    has head and loss)."""
    if layers_per_stage is not None:
        if (
            len(layers_per_stage) != n_stages
            or sum(layers_per_stage) != n_layers
            or min(layers_per_stage) < 0
        ):
            raise ValueError(
                f"layers_per_stage={layers_per_stage} must have {n_stages} non-negative entries "
                f"summing to n_layers={n_layers}"
            )
        counts = layers_per_stage
    else:
        if n_layers < n_stages:
            raise ValueError(
                f"n_layers={n_layers} is fewer than the {n_stages} pipeline stages (pp × virtual "
                f"stages); use fewer stages or a deeper model"
            )
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def keep_only(model: nn.Module, names: Iterable[str]) -> nn.Module:
    """Remove in place (pass a copy) every submodule not named, inside a named one or containing
    one; return `model`. Refuses to remove from a ModuleList / Sequential: the later indices, hence
    parameter names, would shift."""
    keep = set(names)
    present = {name for name, _ in model.named_modules()}
    missing = sorted(keep - present)
    if missing:
        raise ValueError(
            f"cannot keep {missing}: no such module in {type(model).__name__} "
            f"(top-level modules: {[n for n, _ in model.named_children()]})"
        )
    _prune(model, "", keep)
    return model


def _prune(module: nn.Module, prefix: str, keep: set[str]) -> None:
    for child_name, child in list(module.named_children()):
        full = prefix + child_name
        if full in keep or any(full.startswith(k + ".") for k in keep):
            continue  # kept whole
        if any(k.startswith(full + ".") for k in keep):
            _prune(child, full + ".", keep)  # a container of kept modules
            continue
        if isinstance(module, nn.ModuleDict):
            del module[child_name]
        elif isinstance(module, nn.ModuleList | nn.Sequential):
            raise ValueError(
                f"cannot remove '{full}' from a {type(module).__name__}: the indices after it "
                "would shift and rename parameters; keep such blocks in an nn.ModuleDict"
            )
        else:
            setattr(module, child_name, None)


def copy_kept(model: nn.Module, names: Iterable[str]) -> nn.Module:
    """``keep_only(copy.deepcopy(model), names)`` without copying what is removed (a stage of a
    large model on the meta device: the copy is of its blocks, not of the whole model); `model` is
    left as it was."""
    keep = set(names)
    skip: dict[int, None] = {}
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if (
                id(parent) in skip
                or full in keep
                or any(full.startswith(k + ".") for k in keep)
                or any(k.startswith(full + ".") for k in keep)
            ):
                continue
            if isinstance(parent, nn.ModuleList | nn.Sequential):
                _prune(
                    parent, parent_name + "." if parent_name else "", keep
                )  # raises as keep_only does
            skip[id(child)] = None
    copied = copy.deepcopy(model, memo=dict(skip))
    for m in (
        copied.modules()
    ):  # a skipped child became None: drop it from its container as keep_only does
        for child_name, child in list(m._modules.items()):
            if child is None and isinstance(m, nn.ModuleDict):
                del m._modules[child_name]
    return keep_only(copied, keep)
