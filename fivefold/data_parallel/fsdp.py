"""ZeRO-3 / FSDP: parameters live as shards; a unit is gathered just before use and freed after.

ZeRO-3: 2Ψ all-gather + Ψ reduce-scatter per step, memory 16Ψ/N
(docs/design.md#data-parallel-traffic). This module owns *when* units are gathered and freed: the
forward pre-hook gathers and prefetches the next ``prefetch`` units in recorded forward order; the
post-hook frees (``reshard_after_forward``) and wraps the outputs (`ops.call_in_backward`) so that
their backward gathers again and prefetches in backward order. With ``after_unit_backward`` the
inputs are wrapped too, so the engine learns a unit's backward is over even if a parameter got no
gradient (as FSDP2 does).

Constant buffers (ZeRO-R C_B, docs/design.md#offload-and-constant-buffers; `GatherSlots`): instead
of re-growing each unit's own storage for every gather, units gather into a few slots allocated
once. Autograd keeps views of a unit's gathered parameters from its forward until its backward, so a
unit must always gather into the same slot, and two units may share one only if they are never
gathered at the same time: the first two steps are watched (storage of their own, as without the
pool; the second one prefetches along the recorded orders), then units that were never gathered
together share a slot. A later gather into a slot another gathered unit holds raises instead of
overwriting it. A forward that runs inside a backward (activation recompute of a whole unit) only
makes sure the unit is gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fivefold.data_parallel.flat_param import FlatParam
from fivefold.ops import call_in_backward, in_backward

UnitSpec = Sequence[type] | Callable[[str, nn.Module], bool] | None


def default_unit_classes(module: nn.Module) -> tuple[type, ...]:
    """Transformer blocks: fivefold's `TransformerBlock`, or any class named like one."""
    names = ("TransformerBlock", "Block", "DecoderLayer", "EncoderLayer")
    return tuple({type(m) for m in module.modules() if type(m).__name__.endswith(names)})


def find_unit_modules(module: nn.Module, spec: UnitSpec = None) -> list[tuple[str, nn.Module]]:
    """Wrapping units in module order: matches of `spec` (classes or a predicate), outermost only,
    then the root. By default each transformer block plus the modules the root names in
    ``fsdp_units`` (torchtitan's layout), so their gradients are freed on arrival instead of living
    in the root's buffer: only the model can say a module's weights are used through its own forward
    alone. A named module with shared (tied) parameters stays in the root."""
    if spec is None:
        classes = default_unit_classes(module)
        match = lambda name, m: isinstance(m, classes) if classes else False  # noqa: E731
    elif callable(spec) and not isinstance(spec, type | tuple | list):
        match = spec
    else:
        classes = tuple(spec)
        match = lambda name, m: isinstance(m, classes)  # noqa: E731
    units: list[tuple[str, nn.Module]] = []
    claimed: set[str] = set()
    for name, m in module.named_modules():
        if m is module or any(name.startswith(c + ".") for c in claimed):
            continue
        if match(name, m):
            units.append((name, m))
            claimed.add(name)
    if spec is None:
        names_of: dict[int, set[str]] = {}  # every name of every parameter, shared ones included
        for pname, p in module.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), set()).add(pname)
        for name in getattr(module, "fsdp_units", ()):
            m = module.get_submodule(name)
            own = list(m.named_parameters(prefix=name))
            if own and all(names_of[id(p)] <= {n for n, _ in own} for _, p in own):
                units.append((name, m))
        order = {name: i for i, (name, _) in enumerate(module.named_modules())}
        units.sort(key=lambda u: order[u[0]])
    units.append(("", module))
    return units


class GatherSlots:
    """Which units share a gather slot (ZeRO-R constant buffers for ZeRO-3). While `watching`, every
    gather notes the units gathered at that moment (conflicts); `assign` then colours the conflict
    graph greedily in first-gather order — at most ``max_slots`` slots, each as large as its largest
    unit; a unit left without one keeps storage of its own (listed in ``dedicated``) — and from then
    on `before_gather` refuses a gather into a held slot."""

    def __init__(self, flats: Sequence[FlatParam], max_slots: int) -> None:
        self.flats = list(flats)
        self.max_slots = max_slots
        self.watching = True
        self.conflicts: list[set[int]] = [set() for _ in self.flats]
        self.first_gathered: list[int] = []
        self.slot_of: dict[int, int] = {}
        self.slots: list[torch.Tensor] = []
        self.dedicated: list[int] = []

    def _gathered(self, i: int) -> list[int]:
        return [j for j, f in enumerate(self.flats) if j != i and (f.is_unsharded or f.gathering)]

    def before_gather(self, i: int) -> None:
        if self.watching:
            if i not in self.first_gathered:
                self.first_gathered.append(i)
            for j in self._gathered(i):
                self.conflicts[i].add(j)
                self.conflicts[j].add(i)
            return
        slot = self.slot_of.get(i)
        holder = next(
            (j for j in self._gathered(i) if slot is not None and self.slot_of.get(j) == slot), None
        )
        if holder is not None:
            raise RuntimeError(
                f"ZeRO-3 constant buffers: unit {i} must be gathered into gather slot {slot}, "
                f"which unit {holder} holds now; the two were never gathered together in the first "
                "two steps (the order of gathers changed: a unit skipped or run twice, another "
                "prefetch). Set zero.constant_buffers=false "
                "(ZeroDataParallel(constant_buffers=False)) to give every unit storage of its own"
            )

    def assign(self) -> None:
        """Give units slots (between steps: no autograd graph holds views of the units' old
        storage)."""
        members: list[list[int]] = []
        order = self.first_gathered + [
            i for i in range(len(self.flats)) if i not in self.first_gathered
        ]
        for i in order:
            flat = self.flats[i]
            if not flat.reshard_enabled:
                continue
            taken = {self.slot_of[j] for j in self.conflicts[i] if j in self.slot_of}
            free = [c for c in range(len(members)) if c not in taken]
            if free:  # the largest free slot: a small unit joining a large slot costs nothing
                c = max(
                    free, key=lambda c: max(self.flats[j].layout.padded_numel for j in members[c])
                )
            elif len(members) < self.max_slots:
                c = len(members)
                members.append([])
            else:
                self.dedicated.append(i)
                continue
            self.slot_of[i] = c
            members[c].append(i)
        for group in members:
            first = self.flats[group[0]]
            slot = torch.empty(
                max(self.flats[j].layout.padded_numel for j in group),
                dtype=first.param_dtype,
                device=first.full.device,
            )
            self.slots.append(slot)
            for j in group:
                self.flats[j].use_storage(slot)
        self.watching = False


class FSDPHooks:
    """Installs the gather/free/prefetch hooks of ZeRO-3 on the unit modules."""

    def __init__(
        self,
        units: list[tuple[nn.Module, FlatParam]],
        *,
        reshard_after_forward: bool = True,
        prefetch: int = 1,
        after_unit_backward: Callable[[int], None] | None = None,
        constant_buffers: bool = False,
        max_slots: int | None = None,
    ) -> None:
        self.units = units
        # At most: the root, the unit being computed, `prefetch` ahead, the one whose backward is
        # finishing — or, units staying gathered from forward to backward, all of them (that is the
        # peak anyway).
        max_slots = max_slots or (prefetch + 3 if reshard_after_forward else len(units))
        self.slots = GatherSlots([f for _, f in units], max_slots) if constant_buffers else None
        self._steps_watched = 0
        self._backwards = 0
        self.after_unit_backward = after_unit_backward
        self.reshard_after_forward = reshard_after_forward
        self.prefetch = prefetch
        self.forward_order: list[int] = []  # unit indices as first seen in a forward
        self.backward_order: list[int] = []
        self._recording_forward = True
        self._recording_backward = True
        self.trace: list[tuple[str, int, int]] | None = None  # (event, unit, #units unsharded)
        for i, (module, _) in enumerate(units):
            module.register_forward_pre_hook(self._make_pre_forward(i))
            module.register_forward_hook(self._make_post_forward(i))

    def n_unsharded(self) -> int:
        return sum(1 for _, f in self.units if f.is_unsharded or f.gathering)

    def _record(self, event: str, i: int) -> None:
        if self.trace is not None:
            self.trace.append((event, i, self.n_unsharded()))

    def _unshard(self, i: int, async_op: bool = False, backward: bool = False) -> None:
        flat = self.units[i][1]
        if self.slots is not None and not (flat.is_unsharded or flat.gathering):
            self.slots.before_gather(i)
        flat.unshard(async_op=async_op, backward=backward)

    def _prefetch_after(self, order: list[int], i: int, backward: bool = False) -> None:
        if self.prefetch <= 0 or i not in order:
            return
        pos = order.index(i)
        for j in order[pos + 1 : pos + 1 + self.prefetch]:
            self._unshard(j, async_op=True, backward=backward)

    def _make_pre_forward(self, i: int):
        def hook(module: nn.Module, args: Any) -> Any:
            if (
                in_backward()
            ):  # recomputed inside the unit's backward: it is gathered; nothing else changes
                self._unshard(i)
                return None
            if self._recording_forward:
                if i in self.forward_order:
                    self._recording_forward = False
                else:
                    self.forward_order.append(i)
            self._unshard(i)
            self._prefetch_after(
                self.forward_order, i
            )  # nothing to prefetch until the order is known
            self._record("forward", i)
            if self.after_unit_backward is None or not torch.is_grad_enabled():
                return None
            return call_in_backward(args, lambda: self.after_unit_backward(i))

        return hook

    def _make_post_forward(self, i: int):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if (
                in_backward()
            ):  # a recompute: the unit's backward still needs it, and it is already hooked
                return output
            flat = self.units[i][1]
            if self.reshard_after_forward or not torch.is_grad_enabled():
                flat.reshard()
            if not torch.is_grad_enabled():
                return output
            return call_in_backward(output, lambda: self._pre_backward(i))

        return hook

    def _pre_backward(self, i: int) -> None:
        if self._recording_backward and i not in self.backward_order:
            self.backward_order.append(i)
        self._unshard(
            i, backward=True
        )  # (hpZ gathers a backward's weights inside its secondary group)
        self._prefetch_after(self.backward_order, i, backward=True)
        self._record("backward", i)

    def backward_done(self) -> None:
        """End of a backward: orders are known from now on; nothing stays gathered."""
        if self.backward_order:
            self._recording_backward = False
        for _, flat in self.units:
            flat.reshard()
        self._backwards += 1

    def between_steps(self) -> None:
        """The engine's gradients were cleared (after a step): nothing stays gathered (a backward
        that raised may have left units so; a later gather re-fills them) and no autograd graph of
        the units is alive. Constant buffers: after two watched steps with a backward (the second
        one prefetching along the known orders), units are given their gather slots."""
        for _, flat in self.units:
            flat.reshard()
        if self.slots is None or not self.slots.watching or not self._backwards:
            return
        self._backwards = 0
        self._steps_watched += 1
        if self._steps_watched >= 2 and not any(
            f.is_unsharded or f.gathering for _, f in self.units
        ):
            self.slots.assign()
