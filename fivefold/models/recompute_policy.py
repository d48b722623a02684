"""Op-level selective activation checkpointing (`train.recompute = "selective-op"`,
docs/design.md#activation-memory): which op outputs a block saves (`train.recompute_save`), as
data, and the policy `torch.utils.checkpoint.create_selective_checkpoint_contexts` runs with it.

A save set names op groups (`OP_GROUPS`: aten overloads by role). Each named group's outputs are
saved (MUST_SAVE) every time; a group in ``every_other`` only at its 1st, 3rd, 5th ... call in the
block (torchtitan's op-SAC: every other matmul); every other op is recomputed (PREFER_RECOMPUTE).
`SAVE_CHOICES` holds the presets; a comma list of group names is a custom set.

Collectives are not the policy's: the c10d ops write into their arguments, which SAC's cache cannot
replay (it hands back an op's outputs, not the writes into its inputs, and a c10d write bumps no
version counter to catch it). Every `Comm` call inside a selective-op region is therefore issued
once, in the forward; the recomputation gets the forward's buffers copied in
(`ops.collective_outputs`): nothing is sent again in backward, on any rank, so ranks cannot fall
out of step, and the TP traffic is that of no recompute. The kept buffers are part of the block's
bytes (`formulas.selective_op_block_bytes`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fivefold.config import ConfigError
from fivefold.formulas import SavePlan

__all__ = [
    "OP_GROUPS",
    "SAVE_CHOICES",
    "SavePlan",
    "save_plan",
    "selective_contexts",
]

# Op groups by role -> the aten overloads (by name: an overload a torch build lacks is skipped).
OP_GROUPS: dict[str, tuple[str, ...]] = {
    # the linears (a biased one is addmm): wq wk wv wo, w1 w3 w2 in that order in a dense block
    "mm": ("mm.default", "addmm.default"),
    # the fused attention core's outputs (its output and log-sum-exp)
    "sdpa": (
        "_scaled_dot_product_flash_attention_for_cpu.default",
        "_scaled_dot_product_flash_attention.default",
        "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_cudnn_attention.default",
        "_scaled_dot_product_fused_attention_overrideable.default",
    ),
    # the eager core's two batched matmuls (scores q·kᵀ, probabilities·v) and its softmax
    "bmm": ("bmm.default",),
    "softmax": ("_softmax.default",),
}


# train.recompute_save's presets (`formulas.SavePlan`: what `selective_op_block_bytes` prices)
SAVE_CHOICES: dict[str, SavePlan] = {
    # torchtitan's op-SAC: every other matmul, and the attention core's outputs
    "matmuls-every-other": SavePlan(frozenset({"sdpa"}), frozenset({"mm"})),
    # every matmul; the attention core and the elementwise ops run again
    "all-but-attention": SavePlan(frozenset({"mm"})),
}


def save_plan(spec: str) -> SavePlan:
    """`train.recompute_save` -> its `SavePlan`: a `SAVE_CHOICES` name or a comma list of
    `OP_GROUPS` names (each saved at every call); anything else one `ConfigError` line."""
    spec = spec.strip()
    if spec in SAVE_CHOICES:
        return SAVE_CHOICES[spec]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in OP_GROUPS]
    if unknown or not names:
        what = f"unknown op {', '.join(map(repr, unknown))}" if unknown else "no op named"
        raise ConfigError(
            f"train.recompute_save={spec!r}: {what}; choose {' or '.join(SAVE_CHOICES)}, or a "
            f"comma list of {', '.join(OP_GROUPS)}"
        )
    return SavePlan(frozenset(names))


def _groups_by_op() -> dict[Any, str]:
    aten, out = torch.ops.aten, {}
    for group, names in OP_GROUPS.items():
        for name in names:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(aten, packet, None), overload, None)
            if op is not None:
                out[op] = group
    return out


_GROUP_OF: dict[Any, str] = {}


def _policy(plan: SavePlan) -> Callable[..., CheckpointPolicy]:
    """The policy of one region's forward and its recomputation: each counts its own calls per
    group (torch runs the same ops in both, so the same ones are saved)."""
    if not _GROUP_OF:
        _GROUP_OF.update(_groups_by_op())
    calls: dict[tuple[bool, str], int] = defaultdict(int)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        group = _GROUP_OF.get(op)
        if group is None or not plan.saves(group):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if group in plan.always:
            return CheckpointPolicy.MUST_SAVE
        key = (ctx.is_recompute, group)
        calls[key] += 1
        return (
            CheckpointPolicy.MUST_SAVE if calls[key] % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        )

    return policy


def selective_contexts(plan: SavePlan) -> tuple[AbstractContextManager, AbstractContextManager]:
    """(forward, recomputation) contexts of one region under `plan`: torch's pair, made per call
    (each region counts its own ops)."""
    return create_selective_checkpoint_contexts(_policy(plan))
