"""`fivefold plan`: what a layout costs per GPU before any GPU is rented — `fivefold.formulas` run
forward on the layout `fivefold train` would build.

Nothing is computed twice: `assembly` runs the trainer's own `parallelize` on the meta device over
stand-in groups, one pipeline rank at a time, so every flat buffer, its padding, ZeRO-3 unit and
expert shard is the one a run would hold; `memory` and `traffic` turn them into bytes with
`formulas` (docs/design.md: model states, TP, SP, PP, CP, EP volumes and activations), the pipeline
simulator gives micro-batches in flight and the bubble; `timing` estimates a step from FLOPs and
link bandwidths (`hardware`); `layout.plan_layout` puts one plan together, `search` ranks every
layout of a GPU count, `report` prints them. `tests/test_plan.py` holds the memory and traffic
against measurement, byte for byte where the math allows."""

from fivefold.plan.assembly import PlanningMesh, local_numels, rank_parts
from fivefold.plan.hardware import GB, HARDWARE, Hardware
from fivefold.plan.layout import LayoutPlan, plan_layout
from fivefold.plan.memory import BACKWARD_ALLOCATED, RankMemory, rank_memory
from fivefold.plan.report import SearchProgress, format_plan, format_search
from fivefold.plan.search import SEARCHED, candidate_layouts, search
from fivefold.plan.traffic import rank_traffic, rank_transfers

__all__ = [
    "BACKWARD_ALLOCATED",
    "GB",
    "HARDWARE",
    "SEARCHED",
    "SearchProgress",
    "Hardware",
    "LayoutPlan",
    "PlanningMesh",
    "RankMemory",
    "candidate_layouts",
    "format_plan",
    "format_search",
    "local_numels",
    "plan_layout",
    "rank_memory",
    "rank_parts",
    "rank_traffic",
    "rank_transfers",
    "search",
]
