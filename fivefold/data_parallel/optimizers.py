"""Which torch optimizer steps which parameter, as data an engine lays its buffers out by
(docs/design.md#muon-under-zero).

An `InnerOptimizer` is one torch optimizer class with its keyword arguments and one fact ZeRO needs:
whether it is elementwise (AdamW: any slice of a parameter is stepped from the same slice of its
gradient, so equal shards cut anywhere are exact) or steps whole parameters (Muon orthogonalises
each whole matrix: its parameters get whole-parameter owners, `ownership`). A choice
(`OptimizerChoice`) says which inner optimizer takes each parameter: `OneOptimizer` (every
parameter, the engine's default) or `MatricesApart` (Muon for the matrices a predicate names,
AdamW for the rest, as Muon's authors and torch recommend). Each inner optimizer also states its
state bytes (per element and per optimizer tensor) for `fivefold plan`'s memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "CombinedOptimizer",
    "PER_PARAMETER_OPTIMIZERS",
    "InnerOptimizer",
    "MatricesApart",
    "Muon",
    "OneOptimizer",
    "OptimizerChoice",
    "inner_optimizer",
    "muon_class",
    "takes_found_inf",
]

ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.ASGD,
    torch.optim.Rprop,
)


def muon_class() -> type | None:
    """torch.optim.Muon where this torch has it (2.9 and later), else None."""
    return getattr(torch.optim, "Muon", None)


# Optimizers that step each parameter on its own but not elementwise: whole-parameter owners serve
# them exactly (Muon orthogonalises a matrix). Adafactor would be one too, but its factored state
# (a row and a column per matrix) is not what a checkpoint's per-element pieces hold: not listed
# (elementwise=False takes it, checkpoints excepted). An optimizer that couples parameters (LBFGS)
# is neither and stays refused.
PER_PARAMETER_OPTIMIZERS: tuple[type, ...] = tuple(c for c in (muon_class(),) if c is not None)

# fp32 optimizer-state bytes (per element, per optimizer tensor) for the memory formulas: Adam's
# m and v and its `step` counter; Muon's momentum buffer (no step). Others: Adam's, stated.
_STATE_BYTES: dict[str, tuple[int, int]] = {"Muon": (4, 0), "SGD": (4, 0)}
_ADAM_STATE_BYTES = (8, 4)


def takes_found_inf(optimizer: Any) -> bool:
    """Whether `optimizer` skips its step on the device when given ``found_inf`` (torch's fused
    kernels; fivefold's `Muon` on an accelerator)."""
    takes = getattr(optimizer, "takes_found_inf", None)
    return bool(optimizer.defaults.get("fused")) if takes is None else bool(takes)


@dataclass(frozen=True)
class InnerOptimizer:
    """One torch optimizer class, its keyword arguments (lr, betas, ...) and whether it is
    elementwise (False: it steps whole parameters, which then get owners)."""

    cls: type
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    elementwise: bool = True

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def state_bytes(self) -> tuple[int, int]:
        """fp32 state bytes per element and per optimizer tensor
        (`formulas.flat_model_state_bytes`)."""
        return _STATE_BYTES.get(self.name, _ADAM_STATE_BYTES)


def inner_optimizer(
    cls: type, kwargs: Mapping[str, Any] | None = None, elementwise: bool | None = None
) -> InnerOptimizer:
    """`cls` with `kwargs`; ``elementwise`` None: known elementwise optimizers are, known
    per-parameter ones (Muon, Adafactor) step whole parameters, anything else is refused (sharding
    its state could change its math)."""
    if elementwise is None:
        if issubclass(cls, ELEMENTWISE_OPTIMIZERS):
            elementwise = True
        elif PER_PARAMETER_OPTIMIZERS and issubclass(cls, PER_PARAMETER_OPTIMIZERS):
            elementwise = False
        else:
            known = ELEMENTWISE_OPTIMIZERS + PER_PARAMETER_OPTIMIZERS
            raise ValueError(
                f"{cls.__name__} is not known to step each parameter on its own: ZeRO shards its "
                "state by element (elementwise optimizers) or by whole parameter (Muon). "
                f"Use one of {', '.join(c.__name__ for c in known)}, or pass elementwise=True "
                "(any slice of a parameter can be stepped alone) or elementwise=False (each "
                "parameter is stepped whole, on its own)"
            )
    return InnerOptimizer(cls, dict(kwargs or {}), elementwise)


class OptimizerChoice(Protocol):
    """The inner optimizers of an engine and which one takes each parameter."""

    @property
    def optimizers(self) -> tuple[InnerOptimizer, ...]: ...

    def which(self, name: str, param: nn.Parameter) -> int:
        """The index in ``optimizers`` of the one that steps `param`."""
        ...


@dataclass(frozen=True)
class OneOptimizer:
    """One optimizer for every parameter."""

    optimizer: InnerOptimizer

    @property
    def optimizers(self) -> tuple[InnerOptimizer, ...]:
        return (self.optimizer,)

    def which(self, name: str, param: nn.Parameter) -> int:
        return 0


def _two_dimensional(name: str, param: nn.Parameter) -> bool:
    return param.ndim == 2


@dataclass(frozen=True)
class MatricesApart:
    """``matrices`` (Muon) steps the parameters ``is_matrix`` names, ``rest`` (AdamW) the others
    (embeddings, the head, norms, biases: what Muon's authors leave to AdamW)."""

    matrices: InnerOptimizer
    rest: InnerOptimizer
    is_matrix: Callable[[str, nn.Parameter], bool] = _two_dimensional

    @property
    def optimizers(self) -> tuple[InnerOptimizer, ...]:
        return (self.matrices, self.rest)

    def which(self, name: str, param: nn.Parameter) -> int:
        return 0 if self.is_matrix(name, param) else 1


class Muon(torch.optim.Muon if hasattr(torch.optim, "Muon") else torch.optim.Optimizer):
    """torch's Muon that also takes ``found_inf`` (a 0-d flag on the device, as torch's fused
    optimizers do, `ShardedOptimizer.apply_step`): a step with it set changes no parameter and no
    momentum, without the host reading it — so a non-finite gradient is skipped on an accelerator
    with no host sync (docs/gpus.md#no-host-sync-in-a-step). Without a flag it is torch's own step;
    with one, torch's update computed out of place and kept where the flag is 0: the same values."""

    @property
    def takes_found_inf(self) -> bool:
        """On an accelerator (meta standing in for one), not on the CPU (whose check reads the
        norm)."""
        return all(p.device.type != "cpu" for g in self.param_groups for p in g["params"])

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return super().step(closure)
        from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

        skip = found_inf.bool()
        for group in self.param_groups:
            lr, decay, mu = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = torch.zeros_like(p.grad)
                # torch.optim._muon._single_tensor_muon, out of place
                new_buf = buf.lerp(p.grad, 1 - mu)
                update = p.grad.lerp(new_buf, mu) if group["nesterov"] else new_buf
                update = _zeropower_via_newtonschulz(
                    update, group["ns_coefficients"], group["ns_steps"], group["eps"]
                )
                new_p = p.mul(1 - lr * decay)
                new_p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
                p.copy_(torch.where(skip, p, new_p))
                buf.copy_(torch.where(skip, buf, new_buf))
        return None


class _RoutedState(MutableMapping):
    """The optimizers' per-parameter state as one mapping: each parameter's entry lives in the
    state of the optimizer that steps it."""

    def __init__(self, owner_of: dict[int, torch.optim.Optimizer]) -> None:
        self._owner_of = owner_of

    def _state(self, p: torch.Tensor) -> dict:
        owner = self._owner_of.get(id(p))
        if owner is None:
            raise KeyError(p)
        return owner.state

    def __getitem__(self, p: torch.Tensor) -> dict:
        state = self._state(p)
        if p not in state:
            raise KeyError(p)
        return state[p]

    def __setitem__(self, p: torch.Tensor, value: dict) -> None:
        self._state(p)[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._state(p)[p]

    def __iter__(self) -> Iterator[torch.Tensor]:
        seen: set[int] = set()
        for owner in self._owner_of.values():
            if id(owner) not in seen:
                seen.add(id(owner))
                yield from owner.state

    def __len__(self) -> int:
        return sum(1 for _ in self)


class CombinedOptimizer:
    """Several torch optimizers over disjoint parameters, stepped together and seen as one (the
    LR schedule, checkpoints, healing and the memory count read ``param_groups`` and ``state``)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        owner_of = {id(p): o for o in optimizers for g in o.param_groups for p in g["params"]}
        self.state = _RoutedState(owner_of)
        self.defaults: dict[str, Any] = {}

    @property
    def takes_found_inf(self) -> bool:
        """Every optimizer skips a step on the device from a flag
        (`ShardedOptimizer.skips_on_device`): a fused kernel's, or fivefold's `Muon`'s."""
        return all(takes_found_inf(o) for o in self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def found_inf(self) -> torch.Tensor | None:
        return getattr(self.optimizers[0], "found_inf", None)

    @found_inf.setter
    def found_inf(self, value: torch.Tensor | None) -> None:
        for o in self.optimizers:
            o.found_inf = value

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for o, s in zip(self.optimizers, state["optimizers"], strict=True):
            o.load_state_dict(s)
