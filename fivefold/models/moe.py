"""Mixture-of-experts feed-forward (docs/design.md#expert-parallelism) as plain single-process
PyTorch.

A router scores every token against E experts (softmax, or sigmoid as DeepSeek-V3), keeps the top k
(optionally renormalised to sum to 1), and the token's output is the weighted sum of those experts'
SwiGLU outputs (plus shared experts every token goes through). Experts run batched: the token copies
are sorted by expert and each expert runs once on its group, through `ops.Linear`, so zero-bubble
deferral covers them.

Capacity: with ``capacity_factor`` c an expert takes at most ceil(c·T·k/E) of a micro-batch's T·k
assignments, first by slot (every token's first choice before any second choice) then by token order
— deterministic; the dropped ones contribute nothing (the residual carries the token). Without it,
dropless.

Auxiliary losses (Switch/GShard load balancing E·Σ_e f_e·P_e with f_e the fraction of assignments
routed to e and P_e the mean routing probability; router z-loss mean(logsumexp(logits)²)) are not
returned: their gradient is injected in backward (`_AuxGrad`), scaled like the main loss, so they
work inside pipeline stages unchanged. Two hooks keep this file free of parallel code: ``exchange``
applies the experts to expert-sorted tokens (here: all experts are local; expert parallelism swaps
in an all-to-all), ``balance`` says over which tokens f and P are counted (here: this micro-batch;
under data parallelism: the global micro-batch, so the loss equals single-process).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.models.layers import FeedForward
from fivefold.ops import Linear

__all__ = [
    "LocalBalance",
    "LocalExperts",
    "MoEConfig",
    "MoEFeedForward",
    "MoEStats",
    "RunExperts",
    "run_experts",
]

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    experts: int = 8
    top_k: int = 2
    score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    norm_topk: bool = True  # renormalise the k weights to sum to 1
    # experts every token goes through (one SwiGLU of shared_experts × hidden)
    shared_experts: int = 0
    hidden: int | None = None  # an expert's hidden size (default: the model's ffn_hidden)
    every: int = 1  # MoE in every `every`-th block (the others dense), counting from the first
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None  # None: dropless
    # Device-limited routing (DeepSeek-V3): experts form `groups` contiguous groups (set it to ep,
    # or a multiple, and a group lives on one ep rank); a token's top k come from at most
    # `group_limit` groups, the groups ranked by the sum of their two best scores.
    groups: int = 1
    group_limit: int | None = None

    def validate(self) -> MoEConfig:
        if self.experts < 1 or self.top_k < 1 or self.every < 1 or self.shared_experts < 0:
            raise ValueError(
                f"moe: experts={self.experts}, top_k={self.top_k}, every={self.every} must be "
                f"positive and shared_experts={self.shared_experts} not negative"
            )
        if self.top_k > self.experts:
            raise ValueError(
                f"moe.top_k={self.top_k} exceeds moe.experts={self.experts}: a token cannot choose "
                "more experts than there are"
            )
        if self.score not in SCORES:
            raise ValueError(f"moe.score={self.score!r}: choose {' or '.join(SCORES)}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(
                f"moe.capacity_factor={self.capacity_factor} must be positive (or unset: dropless)"
            )
        if self.aux_loss_coef < 0 or self.z_loss_coef < 0:
            raise ValueError("moe.aux_loss_coef and moe.z_loss_coef must not be negative")
        if self.groups < 1 or self.experts % self.groups:
            raise ValueError(f"moe.groups={self.groups} must divide moe.experts={self.experts}")
        if self.group_limit is not None:
            per_group = self.experts // self.groups
            if (
                not 1 <= self.group_limit <= self.groups
                or self.top_k > self.group_limit * per_group
            ):
                raise ValueError(
                    f"moe.group_limit={self.group_limit} must lie in [1, groups={self.groups}] and "
                    f"leave top_k={self.top_k} experts to choose from ({per_group} per group)"
                )
        return self

    def replace(self, **changes: object) -> MoEConfig:
        return dataclasses.replace(self, **changes).validate()


@dataclass
class MoEStats:
    """One forward's routing, for metrics: kept assignments per expert, dropped ones, the auxiliary
    losses."""

    tokens_per_expert: torch.Tensor  # [E], this micro-batch on this rank
    dropped: torch.Tensor  # 0-d
    aux_loss: torch.Tensor  # 0-d, load balancing (before its coefficient)
    z_loss: torch.Tensor  # 0-d


def run_experts(
    experts: nn.ModuleDict, tokens: torch.Tensor, counts: list[int], first: int
) -> torch.Tensor:
    """Tokens grouped by expert — counts[i] rows for expert ``first + i`` — through their experts,
    in order. An expert without tokens still runs (on zero rows): its parameters get a zero
    gradient, never none."""
    outs, start = [], 0
    for i, n in enumerate(counts):
        outs.append(experts[str(first + i)](tokens[start : start + n]))
        start += n
    return torch.cat(outs)


RunExperts = Callable[
    [torch.Tensor, list[int], int], torch.Tensor
]  # (grouped tokens, group sizes, first expert)


class LocalExperts:
    """Every expert is on this process: run them on their groups (the single-process `exchange`)."""

    def __call__(self, run: RunExperts, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return run(tokens, counts.tolist(), 0)  # group sizes on the host: a sync per layer


class LocalBalance:
    """Load-balancing statistics over this micro-batch alone: (counts, tokens, ranks) unchanged, 1
    rank."""

    def __call__(
        self, counts: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        return counts, tokens, 1


class _AuxGrad(torch.autograd.Function):
    """Identity on `out`; in backward also hands `aux` the gradient `scale` (the aux loss joins the
    loss)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, out: torch.Tensor, aux: torch.Tensor, scale: float
    ) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class MoEFeedForward(nn.Module):
    """Router + experts (+ shared experts); see the module doc. Expert ``e`` is ``experts[str(e)]``:
    expert parallelism keeps only this rank's, and the parameter names stay the single-process
    ones."""

    def __init__(
        self,
        dim: int,
        hidden: int,  # an expert's hidden size unless config.hidden sets one
        config: MoEConfig,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config.validate()
        hidden = config.hidden or hidden
        self.router = Linear(dim, config.experts, bias=False, device=device, dtype=dtype)
        self.experts = nn.ModuleDict(
            {
                str(e): FeedForward(dim, hidden, device=device, dtype=dtype)
                for e in range(config.experts)
            }
        )
        self.shared = (
            FeedForward(dim, hidden * config.shared_experts, device=device, dtype=dtype)
            if config.shared_experts
            else None
        )
        self.exchange: Callable[[RunExperts, torch.Tensor, torch.Tensor], torch.Tensor] = (
            LocalExperts()
        )
        self.balance: Callable[
            [torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]
        ] = LocalBalance()
        # the main loss's scale for this micro-batch (1 / micro-batches), set per step
        self.aux_grad_scale = 1.0
        self.stats: MoEStats | None = None

    def run_experts(self, tokens: torch.Tensor, counts: list[int], first: int) -> torch.Tensor:
        """`run_experts` on this layer's experts (those this rank holds under expert
        parallelism)."""
        return run_experts(self.experts, tokens, counts, first)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 logits [T, E] -> (weights [T, k], experts [T, k], probabilities [T, E] for load
        balancing)."""
        c = self.config
        scores = logits.softmax(dim=-1) if c.score == "softmax" else logits.sigmoid()
        choosable = scores
        if (
            c.group_limit is not None and c.group_limit < c.groups
        ):  # device-limited: the best groups only
            grouped = scores.view(scores.shape[0], c.groups, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(c.group_limit, dim=-1).indices, True)
            choosable = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(scores)
        experts = choosable.topk(c.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if c.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        probs = scores if c.score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
        return weights, experts, probs

    def capacity_mask(self, experts: torch.Tensor) -> torch.Tensor:
        """[T, k] bool: which assignments fit their expert's capacity (slot first, then token
        order)."""
        c = self.config
        if c.capacity_factor is None:
            return torch.ones_like(experts, dtype=torch.bool)
        tokens, k = experts.shape
        capacity = math.ceil(c.capacity_factor * tokens * k / c.experts)
        by_slot = experts.t().reshape(
            -1
        )  # every token's first choice, then every second choice, ...
        one_hot = torch.nn.functional.one_hot(by_slot, c.experts)
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # place in its expert's queue
        return (position < capacity).view(k, tokens).t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        n_tokens = t.shape[0]
        logits = self.router(t).float()
        weights, experts, probs = self.route(logits)
        kept = self.capacity_mask(experts)
        # Each kept (token, slot) is one row sent to its expert; sorted by expert (stable: token
        # order within).
        flat_experts = experts.reshape(-1)
        token_of = torch.arange(n_tokens, device=t.device).repeat_interleave(c.top_k)
        if c.capacity_factor is not None:
            keep = kept.reshape(-1)
            flat_experts, token_of, flat_weights = (
                flat_experts[keep],
                token_of[keep],
                weights.reshape(-1)[keep],
            )
        else:
            flat_weights = weights.reshape(-1)
        order = flat_experts.argsort(stable=True)
        token_of, flat_weights = token_of[order], flat_weights[order]
        counts = torch.bincount(flat_experts, minlength=c.experts)
        y = self.exchange(self.run_experts, t[token_of], counts)
        out = torch.zeros_like(t).index_add(0, token_of, y * flat_weights.unsqueeze(-1).to(y.dtype))
        if self.shared is not None:
            out = out + self.shared(t)

        # Load balancing over the tokens `balance` covers: f from (all-reduced) routing counts, P
        # from this rank's probabilities; scaled by the number of ranks so that the mean over ranks
        # of their aux is the global aux.
        chosen = torch.bincount(experts.reshape(-1), minlength=c.experts).float()
        chosen, total, ranks = self.balance(chosen, torch.tensor(float(n_tokens), device=t.device))
        f = chosen / (total * c.top_k)
        aux = c.experts * (f * probs.sum(dim=0)).sum() / total * ranks
        z = logits.logsumexp(dim=-1).pow(2).sum() / total * ranks
        out = _AuxGrad.apply(out, c.aux_loss_coef * aux + c.z_loss_coef * z, self.aux_grad_scale)
        self.stats = MoEStats(counts.detach(), (~kept).sum().detach(), aux.detach(), z.detach())
        return out.view(shape)
