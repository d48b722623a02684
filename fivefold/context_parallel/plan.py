"""A context-parallel plan is data (which modules attend, which buffers are indexed by position),
applied by `apply_context_parallel`: every attention core becomes ring attention over the cp group
(a `SequenceLayout`), or Ulysses' all-to-all pair around the model's own core or around ring
attention over the ring group (a `UlyssesLayout`: ``parallel.cp_mode`` ulysses / hybrid, over the
`UlyssesGroups`), and each position table keeps the rows of this rank's tokens, so the model's own
forward runs unchanged on its part of the sequence. With ``whole_tables`` the uncut tables stay
reachable as ``<name>_whole`` (packed documents read RoPE rows at in-document positions,
`fivefold.models.documents`)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from fivefold.context_parallel.layout import SequenceLayout, UlyssesLayout
from fivefold.context_parallel.ring_attention import RingAttention
from fivefold.context_parallel.ulysses import UlyssesAttention
from fivefold.distributed.comm import Comm

__all__ = ["CPPlan", "UlyssesGroups", "apply_context_parallel"]


@dataclass(frozen=True)
class CPPlan:
    attention: (
        str  # module-name pattern of the attention modules; each has a ``core(q, k, v)`` to replace
    )
    position_tables: tuple[
        str, ...
    ]  # root buffers whose row i belongs to sequence position i (RoPE)


@dataclass(frozen=True)
class UlyssesGroups:
    """The two groups a `UlyssesLayout` runs over, cut from one cp group (`ParallelDims.groups`
    "cp_ulysses" and "cp_ring"): cp rank = ring rank × U + Ulysses rank."""

    ulysses: Comm  # U consecutive cp ranks: the all-to-all
    ring: Comm  # the ranks at the same place of every Ulysses group: ring attention (R = cp / U)

    @property
    def rank(self) -> int:
        """This rank's place in the cp group."""
        return self.ring.rank * self.ulysses.size + self.ulysses.rank

    @property
    def size(self) -> int:
        return self.ring.size * self.ulysses.size


def _core(
    module: nn.Module,
    comm: Comm | UlyssesGroups,
    layout: SequenceLayout | UlyssesLayout,
    seq_len: int,
    kernel: str,
):
    """The context-parallel attention core of `module` (which has the model's own ``core``)."""
    if isinstance(layout, SequenceLayout):
        if isinstance(comm, UlyssesGroups):
            raise TypeError("ring attention runs over the cp group's Comm, not UlyssesGroups")
        return RingAttention(comm, layout, seq_len, kernel=kernel)
    if not isinstance(comm, UlyssesGroups) or comm.ulysses.size != layout.ulysses:
        raise TypeError(
            f"{layout} runs over UlyssesGroups with a Ulysses group of {layout.ulysses}"
        )
    ring = layout.ring
    inner = module.core if ring.cp == 1 else RingAttention(comm.ring, ring, seq_len, kernel=kernel)
    return UlyssesAttention(comm.ulysses, inner, seq_len, seq_len // layout.cp)


def apply_context_parallel(
    model: nn.Module,
    comm: Comm | UlyssesGroups,
    layout: SequenceLayout | UlyssesLayout,
    seq_len: int,
    plan: CPPlan,
    kernel: str = "auto",
    whole_tables: bool = False,
) -> nn.Module:
    """Make `model` (whole or a pipeline stage, tables already filled) run on `comm.rank`'s part of
    sequences of `seq_len` tokens laid out by `layout` (a `SequenceLayout`: ring attention over
    ``comm``; a `UlyssesLayout`: over ``comm``'s two groups, `UlyssesGroups`); ``kernel``: the
    ring's block kernel choice (``parallel.cp_kernel``, `kernels.choose_kernel`).
    ``whole_tables``: keep the uncut tables too, as ``<name>_whole`` (packed documents read RoPE
    rows at in-document positions: ``data.documents`` mask; 2 · max_seq_len · head_dim fp32 more
    per stage)."""
    layout.check(seq_len)
    attention = [
        m for name, m in model.named_modules() if fnmatch.fnmatchcase(name, plan.attention)
    ]
    for module in attention:
        if not hasattr(module, "core"):
            raise TypeError(
                f"context parallel: {type(module).__name__} has no attention core to replace"
            )
        module.core = _core(module, comm, layout, seq_len, kernel)
    for name in plan.position_tables:
        table = getattr(model, f"{name}_whole", getattr(model, name))
        if table.shape[0] < seq_len:
            raise ValueError(
                f"context parallel: {name} covers {table.shape[0]} positions, fewer than "
                f"seq_len={seq_len}"
            )
        model.register_buffer(
            name,
            table.index_select(0, layout.positions(comm.rank, seq_len, table.device)),
            persistent=False,
        )
        if whole_tables:
            model.register_buffer(f"{name}_whole", table, persistent=False)
    model.cp_layout = layout
    # a data-parallel wrapper must not broadcast them (the whole tables: equal everywhere already)
    model.rank_local_buffers = frozenset(
        name + suffix
        for name in plan.position_tables
        for suffix in ("", "_whole")
        if hasattr(model, name + suffix)
    )
    return model
