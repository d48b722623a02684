"""A context-parallel plan is data (which modules attend, which buffers are indexed by position),
applied by `apply_context_parallel`: every attention core becomes ring attention over the cp group,
and each position table keeps the rows of this rank's tokens, so the model's own forward runs
unchanged on its part of the sequence. With ``whole_tables`` the uncut tables stay reachable as
``<name>_whole`` (packed documents read RoPE rows at in-document positions,
`fivefold.models.documents`)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

from fivefold.context_parallel.layout import SequenceLayout
from fivefold.context_parallel.ring_attention import RingAttention
from fivefold.distributed.comm import Comm

__all__ = ["CPPlan", "apply_context_parallel"]


@dataclass(frozen=True)
class CPPlan:
    attention: (
        str  # module-name pattern of the attention modules; each has a ``core(q, k, v)`` to replace
    )
    position_tables: tuple[
        str, ...
    ]  # root buffers whose row i belongs to sequence position i (RoPE)


def apply_context_parallel(
    model: nn.Module,
    comm: Comm,
    layout: SequenceLayout,
    seq_len: int,
    plan: CPPlan,
    kernel: str = "auto",
    whole_tables: bool = False,
) -> nn.Module:
    """Make `model` (whole or a pipeline stage, tables already filled) run on `comm.rank`'s part of
    sequences of `seq_len` tokens laid out by `layout`; ``kernel``: the ring's block kernel choice
    (``parallel.cp_kernel``, `kernels.choose_kernel`). ``whole_tables``: keep the uncut tables
    too, as ``<name>_whole`` (packed documents read RoPE rows at in-document positions:
    ``data.documents`` mask; 2 · max_seq_len · head_dim fp32 more per stage)."""
    layout.check(seq_len)
    attention = [
        m for name, m in model.named_modules() if fnmatch.fnmatchcase(name, plan.attention)
    ]
    for module in attention:
        if not hasattr(module, "core"):
            raise TypeError(
                f"context parallel: {type(module).__name__} has no attention core to replace"
            )
        module.core = RingAttention(comm, layout, seq_len, kernel=kernel)
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
