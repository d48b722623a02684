"""Context parallelism (docs/design.md#context-parallelism): the sequence split over the cp group,
attention as a ring, Ulysses' all-to-all over heads, or both."""

from fivefold.context_parallel.layout import LAYOUTS, SequenceLayout, UlyssesLayout, layout_for
from fivefold.context_parallel.plan import CPPlan, UlyssesGroups, apply_context_parallel
from fivefold.context_parallel.ring_attention import RingAttention, ring_attention
from fivefold.context_parallel.ulysses import UlyssesAttention

__all__ = [
    "CPPlan",
    "LAYOUTS",
    "RingAttention",
    "SequenceLayout",
    "UlyssesAttention",
    "UlyssesGroups",
    "UlyssesLayout",
    "apply_context_parallel",
    "layout_for",
    "ring_attention",
]
