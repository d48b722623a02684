"""Context parallelism (docs/design.md#context-parallelism): the sequence split over the cp group,
attention as a ring."""

from fivefold.context_parallel.layout import LAYOUTS, SequenceLayout
from fivefold.context_parallel.plan import CPPlan, apply_context_parallel
from fivefold.context_parallel.ring_attention import RingAttention, ring_attention

__all__ = [
    "CPPlan",
    "LAYOUTS",
    "RingAttention",
    "SequenceLayout",
    "apply_context_parallel",
    "ring_attention",
]
