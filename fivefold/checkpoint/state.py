"""The training state of one rank as a DCP state dict keyed by global names (`training_state`), and
its inverse (`after_load`).

Per parameter ``name`` (the single-process name, whatever the layout): ``model.<name>`` — the fp32
master values — and ``optim.<key>.<name>`` for every elementwise optimizer state (AdamW: exp_avg,
exp_avg_sq), each a `Pieces` of what this rank's ZeRO shard holds of the TP-local tensor, in global
coordinates: a flat shard is saved as the pieces of the parameters it covers. Per-parameter
optimizer scalars (AdamW's step) are plain 0-d tensors ``optim.<key>.<name>``. Per persistent module
buffer ``name`` (an MoE layer's ``expert_bias``): ``model.<name>``, a plain tensor — a copy of the
buffer, equal on every rank that holds its module (DCP writes replicas once; under pp each stage
its own), put back by `TrainingState.after_load`. So a consumer of the ``model.`` keys tells a
buffer (a `torch.Tensor`) from a parameter (`Pieces`) by its type. Everything else a resume needs
(step, loss scaler, RNG states, layout) is the caller's.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fivefold.checkpoint.pieces import Pieces
from fivefold.data_parallel import ZeroDataParallel
from fivefold.data_parallel.flat_param import FlatParam
from fivefold.data_parallel.sharded_optimizer import write_back
from fivefold.distributed.comm import Comm

__all__ = [
    "ParamShare",
    "TrainingState",
    "optimizer_state_keys",
    "param_shares",
    "persistent_buffers",
    "training_state",
]


@dataclass(frozen=True)
class ParamShare:
    """Where parameter ``name`` sits: global ``size``, its TP-local tensor's ``local_shape`` at
    ``local_offset``."""

    name: str
    size: torch.Size
    local_shape: tuple[int, ...]
    local_offset: tuple[int, ...]


def param_shares(engine: ZeroDataParallel, tp: Comm | None) -> dict[str, ParamShare]:
    """Every parameter of `engine` with its global size and TP offset (`ParamPlacement.tp_dim` of
    the module)."""
    placements = getattr(engine.module, "tp_placements", {})
    out = {}
    for flat in engine.flats:
        for slot in flat.layout.slots:
            local = tuple(slot.shape)
            dim = getattr(placements.get(slot.name), "tp_dim", None)
            size, offset = list(local), [0] * len(local)
            if dim is not None and tp is not None and tp.size > 1:
                size[dim] = local[dim] * tp.size
                offset[dim] = local[dim] * tp.rank
            out[slot.name] = ParamShare(slot.name, torch.Size(size), local, tuple(offset))
    return out


def persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of every buffer of `module` that its ``state_dict`` would hold (not the
    non-persistent ones: RoPE tables), meta ones left out."""
    for prefix, m in module.named_modules():
        for name, buf in m._buffers.items():
            if (
                buf is not None
                and name not in m._non_persistent_buffers_set
                and buf.device.type != "meta"
            ):
                yield (f"{prefix}.{name}" if prefix else name), buf


def _segment_ranges(flat: FlatParam) -> Iterator[tuple[int, int, int, Any, int]]:
    """(slot index, lo, hi, master param, its first index) for every overlap of a parameter slot
    with an optimizer segment, in flat-buffer coordinates [lo, hi)."""
    for (_, a, b), mp in zip(flat.segments, flat.master_params):
        seg_lo, seg_hi = flat.start + a, flat.start + b
        for i, slot in enumerate(flat.layout.slots):
            lo, hi = max(slot.offset, seg_lo), min(slot.offset + slot.numel, seg_hi)
            if lo < hi:
                yield i, lo, hi, mp, seg_lo


def _is_elementwise(value: Any, mp: torch.Tensor) -> bool:
    """A state tensor with one entry per element of its optimizer tensor (AdamW's exp_avg, Muon's
    momentum_buffer), as opposed to a per-tensor scalar (AdamW's step)."""
    return isinstance(value, torch.Tensor) and value.shape == mp.shape and value.dim() > 0


def optimizer_state_keys(engine: ZeroDataParallel) -> tuple[list[str], list[str]]:
    """(elementwise keys, scalar keys) of the optimizer state this engine holds now (empty before
    the first step); with several optimizers (Muon + AdamW) the keys of all of them."""
    elementwise, scalar = [], []
    for flat in engine.flats:
        for mp in flat.master_params:
            for k, v in engine.optimizer.state.get(mp, {}).items():
                if _is_elementwise(v, mp):
                    elementwise.append(k) if k not in elementwise else None
                elif k not in scalar:
                    scalar.append(k)
    return elementwise, scalar


def _segment_names(flat: FlatParam) -> list[set[str]]:
    """The parameters each optimizer segment of `flat` holds part of."""
    names: list[set[str]] = [set() for _ in flat.segments]
    segment_of = {id(mp): k for k, mp in enumerate(flat.master_params)}
    for i, _, _, mp, _ in _segment_ranges(flat):
        names[segment_of[id(mp)]].add(flat.layout.slots[i].name)
    return names


def _ensure_optimizer_state(
    engine: ZeroDataParallel,
    elementwise: Iterable[str],
    scalars: dict[str, torch.dtype],
    saved: Container[str] | None = None,
) -> None:
    """Create the optimizer state a load will fill (a torch optimizer allocates it at its first
    step). ``saved``: the checkpoint's keys; then a segment gets only the keys saved for its
    parameters (Muon's momentum for its matrices, AdamW's moments and step for the rest)."""
    # torch keeps a non-fused optimizer's step count on the CPU, a fused (or capturable) one's
    # beside its parameter
    on_param = {
        id(p)
        for g in engine.optimizer.param_groups
        if g.get("fused") or g.get("capturable")
        for p in g["params"]
    }
    for flat in engine.flats:
        for mp, names in zip(flat.master_params, _segment_names(flat)):

            def wanted(key: str, names: set[str] = names) -> bool:
                return saved is None or any(f"optim.{key}.{n}" in saved for n in names)

            state = engine.optimizer.state.setdefault(mp, {})
            for k in elementwise:
                if wanted(k):
                    state.setdefault(k, torch.zeros_like(mp, memory_format=torch.preserve_format))
            device = mp.device if id(mp) in on_param else "cpu"
            for k, dtype in scalars.items():
                if wanted(k):
                    state.setdefault(k, torch.zeros((), dtype=dtype, device=device))


def _keyed(
    engine: ZeroDataParallel,
    keys_of: dict[int, set[str] | None],
    flat: FlatParam,
    name: str,
    key: str,
) -> bool:
    """Whether the optimizer that steps parameter `name` of `flat` keeps per-element state `key`
    on this rank (``keys_of``: `ShardedOptimizer.state_keys_of` per inner optimizer; a rank that
    holds none of an optimizer's parameters declares none of its pieces: the holders do)."""
    inner = engine.optimizer.group_optimizers[flat.group_ids[flat.names.index(name)]]
    keys = keys_of[inner]
    return keys is None or key in keys


@dataclass
class TrainingState:
    """What `training_state` returns: the DCP state dict, and for a load the plain tensors to hand
    on: the optimizer scalars (one loaded value per parameter, copied into every optimizer segment
    holding a part of it) and the persistent buffers (copied into the module's)."""

    state_dict: dict[str, Any]
    scalar_targets: list[tuple[str, torch.Tensor]]

    def after_load(self, engines: Iterable[ZeroDataParallel]) -> None:
        """The fp32 masters and optimizer state were loaded: set the segments' scalars and the
        modules' persistent buffers, refresh the compute copies (16-bit shards; ZeRO-1/2's full
        buffers)."""
        for fqn, target in self.scalar_targets:
            target.copy_(self.state_dict[fqn])
        write_back(flat for engine in engines for flat in engine.flats)


def training_state(
    engines: Iterable[ZeroDataParallel],
    tp: Comm | None,
    optimizer_scalars: dict[str, torch.dtype] | None = None,
    optimizer_elementwise: Iterable[str] | None = None,
    saved: Container[str] | None = None,
) -> TrainingState:
    """This rank's model and optimizer state keyed by global names, as `Pieces` viewing the live
    tensors (save: what is written; load: where it lands), and the engines' modules' persistent
    buffers as copies (`after_load` puts a loaded one back). For a load give the optimizer keys the
    checkpoint has (and with several optimizers ``saved``, its keys: which parameter has which):
    the state is created (zeros) where the optimizer has none yet. A parameter's optimizer keys are
    those of the optimizer that steps it: with Muon for the matrices, ``optim.momentum_buffer.*``
    for them and AdamW's keys for the rest."""
    engines = list(engines)
    state: dict[str, Any] = {}
    targets: list[tuple[str, torch.Tensor]] = []
    for engine in engines:
        if optimizer_elementwise is not None or optimizer_scalars:
            _ensure_optimizer_state(
                engine, optimizer_elementwise or (), optimizer_scalars or {}, saved
            )
        elementwise, _ = optimizer_state_keys(engine)
        keys_of = {
            inner: engine.optimizer.state_keys_of(inner)
            for inner in range(len(engine.optimizer.choice.optimizers))
        }
        shares = param_shares(engine, tp)
        for flat in engine.flats:
            # every rank of the group declares the same pieces: a key for a parameter wherever
            # some segment of the flat steps any part of it with that key
            keyed = {
                name: [k for k in elementwise if _keyed(engine, keys_of, flat, name, k)]
                for name in (slot.name for slot in flat.layout.slots)
            }
            for slot in flat.layout.slots:
                share = shares[slot.name]
                for key in ["model", *(f"optim.{k}" for k in keyed[slot.name])]:
                    state.setdefault(f"{key}.{slot.name}", Pieces(share.size, torch.float32))
            for i, lo, hi, mp, seg_lo in _segment_ranges(flat):
                slot = flat.layout.slots[i]
                share = shares[slot.name]
                start = lo - slot.offset
                state[f"model.{slot.name}"].add_flat_range(
                    flat.master[lo - flat.start : hi - flat.start],
                    share.local_shape,
                    start,
                    share.local_offset,
                )
                opt = engine.optimizer.state.get(mp, {})
                for k, v in opt.items():
                    fqn = f"optim.{k}.{slot.name}"
                    if _is_elementwise(v, mp):  # (a whole matrix's state: its rows, flattened)
                        state[fqn].add_flat_range(
                            v.reshape(-1)[lo - seg_lo : hi - seg_lo],
                            share.local_shape,
                            start,
                            share.local_offset,
                        )
                    else:  # equal in every segment of a parameter: one value per parameter
                        state.setdefault(fqn, v.detach().clone())
                        targets.append((fqn, v))
        for name, buf in persistent_buffers(engine.module):  # (the engines may share a module)
            fqn = f"model.{name}"
            if fqn not in state:
                state[fqn] = buf.detach().clone()
                targets.append((fqn, buf))
    return TrainingState(state, targets)
