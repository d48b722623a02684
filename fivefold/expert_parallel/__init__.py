"""Expert parallelism (docs/design.md#expert-parallelism): MoE experts split over the ep group,
tokens exchanged by all-to-all."""

from fivefold.expert_parallel.dispatch import AllToAllExperts, GlobalBalance, all_to_all

__all__ = ["AllToAllExperts", "GlobalBalance", "all_to_all"]
