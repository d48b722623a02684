"""Moving a module off the meta device (imports only torch): `materialize` gives its meta parameters
and buffers storage on a device; with ``storage=False`` parameters get storage-less stand-ins
instead (right shape, dtype and device, zero strides) for an engine that repoints them into its flat
buffers and fills only what this rank holds.

Parameters are replaced, not refilled in place (a payload cannot change device type, and
`FakeTensorMode` refuses the swap), so what the old Parameter carried travels to the new one: ties,
attributes (``no_weight_decay``) and gradient hooks (sequence parallel's norm-weight all-reduce,
registered when TP sharded the model on meta)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["materialize"]


@torch.no_grad()
def materialize(
    module: nn.Module,
    device: torch.device | str,
    *,
    parameters: bool = True,
    storage: bool = True,
    select: Callable[[str], bool] | None = None,
) -> nn.Module:
    """Give `module`'s meta buffers, and its meta parameters unless not `parameters` (only those
    whose name `select` accepts, if given), uninitialised storage on `device` (``storage=False``:
    parameters get stand-ins without storage). Shared tensors stay shared."""
    made: dict[int, torch.Tensor] = {}
    chosen = None if select is None else {id(p) for n, p in module.named_parameters() if select(n)}
    for m in module.modules():
        for name, p in list(m._parameters.items()) if parameters else ():
            if p is not None and p.device.type == "meta" and (chosen is None or id(p) in chosen):
                if id(p) not in made:
                    data = (
                        torch.empty_like(p, device=device)
                        if storage
                        else torch.empty((), dtype=p.dtype, device=device).expand(p.shape)
                    )
                    made[id(p)] = _carry_over(p, nn.Parameter(data, requires_grad=p.requires_grad))
                m._parameters[name] = made[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and b.device.type == "meta":
                m._buffers[name] = made.setdefault(id(b), torch.empty_like(b, device=device))
    return module


def _carry_over(old: nn.Parameter, new: nn.Parameter) -> nn.Parameter:
    new.__dict__.update(old.__dict__)
    for hook in (old._backward_hooks or {}).values():
        new.register_hook(hook)
    return new
