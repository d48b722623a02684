"""Mixture-of-experts feed-forward (docs/design.md#expert-parallelism) as plain single-process
PyTorch.

A router scores every token against E experts (softmax, or sigmoid as DeepSeek-V3), keeps the top k
(optionally renormalised to sum to 1), and the token's output is the weighted sum of those experts'
SwiGLU outputs (plus shared experts every token goes through). The token copies are sorted by
expert and the experts run on their groups by a strategy (`ExpertsStrategy`, chosen by device:
`default_experts`): `GroupedExperts` (one `torch._grouped_mm` per projection),
`PaddedBatchedExperts` (one `torch.bmm` over the groups padded to one size) or `LoopedExperts`
(each expert's module on its rows, the reference). The batched ones keep what the loop keeps for
backward (the experts' weights are stacked for the product and again in backward, never saved) and
defer their weight gradients under a zero-bubble pipeline as `ops.linear` does.

One host sync per layer and forward (docs/design.md#expert-parallelism): everything routing needs
stays on the device (counts by `scatter_add`, the dropped rows sorted last instead of cut out, the
token total a device scalar); `exchange` reads the group sizes (under expert parallelism also the
all-to-all's splits) in one `.tolist()`, through `ops.host_values`, so a full recompute reuses the
forward's.

Capacity: with ``capacity_factor`` c an expert takes at most ceil(c·T·k/E) of a micro-batch's T·k
assignments, first by slot (every token's first choice before any second choice) then by token order
— deterministic; the dropped ones contribute nothing (the residual carries the token): they sort
after every kept row and are never sent. Without it, dropless.

Auxiliary losses (load balancing; router z-loss mean(logsumexp(logits)²)) are not returned: their
gradient is injected in backward (`_AuxGrad`), scaled like the main loss, so they work inside
pipeline stages unchanged. Load balancing by ``aux_convention`` (docs/design.md#expert-parallelism):
``switch``, Switch/GShard's E·Σ_e f_e·P_e per layer (f_e the fraction of assignments routed to e,
P_e the mean routing probability), summed over the layers; ``hf``, Hugging Face's
``load_balancing_loss_func``, one loss over all the model's layers pooled (`AuxPool`,
`_PooledAux`). Two hooks keep this file free of parallel code: ``exchange`` applies the experts to
expert-sorted tokens (here: all experts are local; expert parallelism swaps in an all-to-all),
``balance`` says over which tokens f and P are counted (here: this micro-batch; under data
parallelism: the global micro-batch, so the loss equals single-process).

Model families: the shared experts' width (``shared_hidden``) and Qwen2-MoE's sigmoid gate on them
(``shared_gate``); DeepSeek-V3's ``routed_scaling`` of the k weights, and its auxiliary-loss-free
balancing (``expert_bias``): a per-expert bias added to the scores for the choice of the top k (and
of the groups) only, moved after every optimizer step by `update_expert_bias` from the step's loads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fivefold import ops
from fivefold.models.layers import FeedForward
from fivefold.ops import Linear

__all__ = [
    "AuxPool",
    "ExpertGroups",
    "ExpertsStrategy",
    "GroupedExperts",
    "LocalBalance",
    "LocalExperts",
    "LoopedExperts",
    "MoEConfig",
    "MoEFeedForward",
    "MoEStats",
    "PaddedBatchedExperts",
    "RunExperts",
    "default_experts",
    "reset_expert_load",
    "run_experts",
    "share_aux_pool",
    "update_expert_bias",
]

SCORES = ("softmax", "sigmoid")
AUX_CONVENTIONS = ("switch", "hf")


@dataclass(frozen=True)
class MoEConfig:
    experts: int = 8
    top_k: int = 2
    score: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    norm_topk: bool = True  # renormalise the k weights to sum to 1
    # experts every token goes through (one SwiGLU of shared_hidden, by default shared_experts ×
    # hidden); they exist when shared_experts > 0
    shared_experts: int = 0
    hidden: int | None = None  # an expert's hidden size (default: the model's ffn_hidden)
    every: int = 1  # MoE in every `every`-th block (the others dense), counting from the first
    first_dense: int = 0  # the first blocks stay dense (DeepSeek-V3's first_k_dense_replace: 3)
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.0
    capacity_factor: float | None = None  # None: dropless
    # Device-limited routing (DeepSeek-V3): experts form `groups` contiguous groups (set it to ep,
    # or a multiple, and a group lives on one ep rank); a token's top k come from at most
    # `group_limit` groups, the groups ranked by the sum of their two best scores (+ expert bias).
    groups: int = 1
    group_limit: int | None = None
    # the shared SwiGLU's hidden width in total (Qwen2-MoE's shared_expert_intermediate_size, not a
    # multiple of hidden); None: hidden × shared_experts
    shared_hidden: int | None = None
    # Qwen2-MoE: the shared experts' output × sigmoid(x · g) per token, g the layer's `shared_gate`
    shared_gate: bool = False
    # DeepSeek-V3's routed_scaling_factor: the k weights × this, after the (optional)
    # renormalisation
    routed_scaling: float = 1.0
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias (`MoEFeedForward.expert_bias`)
    # added to the scores to choose the experts (not to weight them), moved after every step by
    # expert_bias_rate · sign(mean load − load) (`update_expert_bias`; rate 0: a fixed bias)
    expert_bias: bool = False
    expert_bias_rate: float = 1e-3
    # the load-balancing loss: switch (E·Σ f·P per layer, the layers summed) | hf (Hugging Face's
    # load_balancing_loss_func: all layers' routing pooled into one loss)
    aux_convention: str = "switch"

    def validate(self) -> MoEConfig:
        if self.first_dense < 0:
            raise ValueError(f"moe.first_dense={self.first_dense} must not be negative")
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
        if self.shared_hidden is not None and (self.shared_hidden < 1 or self.shared_experts == 0):
            raise ValueError(
                f"moe.shared_hidden={self.shared_hidden} needs moe.shared_experts > 0 (it is "
                f"{self.shared_experts}) and must be positive: set shared_experts or unset it"
            )
        if self.shared_gate and self.shared_experts == 0:
            raise ValueError(
                "moe.shared_gate=true gates the shared experts, but moe.shared_experts=0: set "
                "shared_experts > 0 or shared_gate false"
            )
        if not (self.routed_scaling > 0 and math.isfinite(self.routed_scaling)):
            raise ValueError(
                f"moe.routed_scaling={self.routed_scaling} must be a positive number (1: unscaled)"
            )
        if not (self.expert_bias_rate >= 0 and math.isfinite(self.expert_bias_rate)):
            raise ValueError(
                f"moe.expert_bias_rate={self.expert_bias_rate} must not be negative (0: a fixed "
                "bias)"
            )
        if self.aux_convention not in AUX_CONVENTIONS:
            raise ValueError(
                f"moe.aux_convention={self.aux_convention!r}: choose {' or '.join(AUX_CONVENTIONS)}"
            )
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


@dataclass
class ExpertGroups:
    """Rows sorted by expert: ``sizes[i]`` rows (on the host, read in the layer's one sync) for
    expert ``first + i``; ``counts`` the same sizes on the rows' device (int64), from which the
    grouped kernels' offsets and indices are computed without another sync."""

    sizes: list[int]
    counts: torch.Tensor
    first: int
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rows(self) -> int:
        return sum(self.sizes)

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


class ExpertsStrategy(Protocol):
    """How a layer's experts run on their groups: ``(experts, rows sorted by expert, groups) ->
    outputs`` in the rows' order; every expert of the groups gets a gradient (zero if it has no
    rows)."""

    def __call__(
        self, experts: nn.ModuleDict, tokens: torch.Tensor, groups: ExpertGroups
    ) -> torch.Tensor: ...


class LoopedExperts:
    """Each expert's module on its rows, one after the other (`run_experts`): the reference."""

    def __call__(
        self, experts: nn.ModuleDict, tokens: torch.Tensor, groups: ExpertGroups
    ) -> torch.Tensor:
        return run_experts(experts, tokens, groups.sizes, groups.first)


class _Kernel(Protocol):
    """The grouped products of a batched strategy, for rows [R, ·] sorted by group and stacked
    weights [G, out, in]: ``forward`` y_r = W_g x_r, ``backward`` x_r = W_gᵀ y_r, ``weight_grad``
    dW_g = Σ_r∈g dy_r x_rᵀ."""

    def forward(self, x: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor: ...

    def backward(self, g: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor: ...

    def weight_grad(
        self, g: torch.Tensor, x: torch.Tensor, groups: ExpertGroups
    ) -> torch.Tensor: ...


class _GroupedLinear(torch.autograd.Function):
    """y = x W_gᵀ for every row with its group's weight, the G weights given one by one: stacked
    for the product (a transient) and again in backward, so backward keeps x and views of the
    weights, as G separate linears would. Under `ops.recording_weight_grads` (``store``) the
    weights arrive detached and each expert's dW waits in the store as `ops.linear`'s does."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: torch.Tensor,
        kernel: _Kernel,
        groups: ExpertGroups,
        store: ops.WeightGradStore | None,
        params: tuple[torch.Tensor, ...],
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        ctx.kernel, ctx.groups, ctx.store, ctx.params = kernel, groups, store, params
        ctx.save_for_backward(x, *(w.detach() for w in weights))
        return kernel.forward(x, torch.stack(weights), groups)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        grad, groups = grad.contiguous(), ctx.groups
        dx = ctx.kernel.backward(grad, torch.stack(weights), groups)
        if ctx.store is not None:
            start = 0
            for param, n in zip(ctx.params, groups.sizes):
                ctx.store.queue(param, None, x[start : start + n], grad[start : start + n])
                start += n
            return (dx, None, None, None, None, *(None for _ in weights))
        dw = ctx.kernel.weight_grad(grad, x, groups)
        return (dx, None, None, None, None, *dw.unbind(0))


class _BatchedExperts:
    """SwiGLU experts as three grouped linears (w1, w3, then w2), elementwise ops between them as
    in `FeedForward`, so autograd keeps the loop's tensors."""

    kernel: _Kernel

    def _linear(
        self, x: torch.Tensor, weights: list[torch.Tensor], groups: ExpertGroups
    ) -> torch.Tensor:
        store = ops.weight_grad_store() if torch.is_grad_enabled() and x.requires_grad else None
        params = tuple(weights)
        if store is not None:  # the weights outside autograd's inputs until W (as ops.linear)
            weights = [w.detach() for w in weights]
        return _GroupedLinear.apply(x, self.kernel, groups, store, params, *weights)

    def __call__(
        self, experts: nn.ModuleDict, tokens: torch.Tensor, groups: ExpertGroups
    ) -> torch.Tensor:
        mods = [experts[str(groups.first + i)] for i in range(len(groups.sizes))]
        h1 = self._linear(tokens, [m.w1.weight for m in mods], groups)
        h3 = self._linear(tokens, [m.w3.weight for m in mods], groups)
        return self._linear(F.silu(h1) * h3, [m.w2.weight for m in mods], groups)


class _GroupedMM:
    """`torch._grouped_mm` with the groups' ends as int32 offsets (computed on the device)."""

    @staticmethod
    def _offsets(groups: ExpertGroups) -> torch.Tensor:
        return groups.cached("offsets", lambda: groups.counts.cumsum(0).to(torch.int32))

    def forward(self, x: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=self._offsets(groups))

    def backward(self, g: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return torch._grouped_mm(g, w, offs=self._offsets(groups))

    def weight_grad(self, g: torch.Tensor, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return torch._grouped_mm(g.t(), x, offs=self._offsets(groups))


class _PaddedBMM:
    """Each group's rows padded with zeros to one size T (the largest group, rounded up to a
    multiple of ``multiple``: fewer distinct shapes), then `torch.bmm` over [G, T, ·]. Padding and
    unpadding are gathers by indices computed on the device from the counts."""

    def __init__(self, multiple: int) -> None:
        self.multiple = multiple

    def _indices(self, groups: ExpertGroups) -> tuple[int, torch.Tensor, torch.Tensor]:
        def make() -> tuple[int, torch.Tensor, torch.Tensor]:
            counts, rows, n = groups.counts, groups.rows, len(groups.sizes)
            size = max(1, -(-max(groups.sizes, default=0) // self.multiple) * self.multiple)
            starts = counts.cumsum(0) - counts
            slot = torch.arange(size, device=counts.device)
            # padded slot (g, p) reads row starts[g] + p, or row `rows` (a zero row) past its group
            src = torch.where(slot < counts[:, None], starts[:, None] + slot, rows).reshape(-1)
            group = torch.repeat_interleave(
                torch.arange(n, device=counts.device), counts, output_size=rows
            )
            dest = group * size + torch.arange(rows, device=counts.device) - starts[group]
            return size, src, dest

        return groups.cached("padded", make)

    def _pad(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        size, src, _ = self._indices(groups)
        return torch.cat([x, x.new_zeros(1, x.shape[1])])[src].view(-1, size, x.shape[1])

    def _unpad(self, y: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return y.reshape(-1, y.shape[-1])[self._indices(groups)[2]]

    def forward(self, x: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return self._unpad(torch.bmm(self._pad(x, groups), w.transpose(1, 2)), groups)

    def backward(self, g: torch.Tensor, w: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return self._unpad(torch.bmm(self._pad(g, groups), w), groups)

    def weight_grad(self, g: torch.Tensor, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        return torch.bmm(self._pad(g, groups).transpose(1, 2), self._pad(x, groups))


class PaddedBatchedExperts(_BatchedExperts):
    """The experts as one `torch.bmm` per projection over their groups padded to one size (the
    largest, rounded up to ``multiple`` rows): for devices without a grouped matmul. Costs the
    padding's FLOPs (G·T − R rows) and transient padded copies."""

    def __init__(self, multiple: int = 8) -> None:
        self.kernel = _PaddedBMM(multiple)


class GroupedExperts(_BatchedExperts):
    """The experts as one `torch._grouped_mm` per projection (and per gradient), the groups given
    by offsets: no padding. torch 2.13 runs it on CUDA (bf16; CUTLASS kernels on sm90+) and on the
    CPU (a fallback over the groups); rows and weights must have 16-byte aligned strides, so a
    layer whose widths are not falls back to `fallback`."""

    def __init__(self, fallback: ExpertsStrategy | None = None) -> None:
        self.kernel = _GroupedMM()
        self.fallback = fallback or PaddedBatchedExperts()

    def __call__(
        self, experts: nn.ModuleDict, tokens: torch.Tensor, groups: ExpertGroups
    ) -> torch.Tensor:
        w = experts[str(groups.first)].w1.weight
        if any(n * tokens.element_size() % 16 for n in w.shape):
            return self.fallback(experts, tokens, groups)
        return super().__call__(experts, tokens, groups)


def default_experts(device: torch.device, dtype: torch.dtype) -> ExpertsStrategy:
    """The strategy for experts on ``device`` in ``dtype``: `GroupedExperts` where torch has a
    grouped matmul for it (CUDA sm90+ in bf16; the CPU), else `PaddedBatchedExperts`."""
    device = torch.device(device)
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        return GroupedExperts()
    if device.type == "cuda" and dtype == torch.bfloat16:
        if torch.cuda.get_device_capability(device) >= (9, 0):
            return GroupedExperts()
    return PaddedBatchedExperts()


# (rows sorted by expert, group sizes on the host, the same on the device, first expert id)
RunExperts = Callable[[torch.Tensor, list[int], torch.Tensor, int], torch.Tensor]


class LocalExperts:
    """Every expert is on this process: run them on their groups (the single-process `exchange`).
    The group sizes are the layer's one host sync."""

    def __call__(self, run: RunExperts, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sizes = ops.host_values(counts.tolist)
        return run(tokens[: sum(sizes)], sizes, counts, 0)


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


class _PoolRecord:
    """One micro-batch's pooled routing: the layers that added to it, their summed selection counts
    C [E] and token counts N (each layer's as `balance` summed them)."""

    def __init__(self) -> None:
        self.layers: set[int] = set()
        self.counts: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None


class AuxPool:
    """What Hugging Face's pooled load-balancing loss (``aux_convention`` hf) needs from all of a
    model's MoE layers, per micro-batch: every layer's forward adds its selection counts and tokens
    (`add`), and every layer's backward, which runs after all of that micro-batch's forwards, reads
    the totals. A layer that adds again starts the next micro-batch's record; a recomputation and a
    forward without autograd add nothing. One model's layers share one (`share_aux_pool`; `Llama`
    does), so the loss spans one model or one pipeline stage, never several."""

    def __init__(self) -> None:
        self.record = _PoolRecord()

    def add(self, layer: nn.Module, counts: torch.Tensor, tokens: torch.Tensor) -> _PoolRecord:
        record = self.record
        if id(layer) in record.layers:  # this layer's second forward: the next micro-batch
            record = self.record = _PoolRecord()
        record.layers.add(id(layer))
        counts, tokens = counts.detach(), tokens.detach()
        record.counts = counts if record.counts is None else record.counts + counts
        record.tokens = tokens if record.tokens is None else record.tokens + tokens
        return record


def share_aux_pool(module: nn.Module) -> None:
    """Every MoE layer of `module` (a model, or a stage of one) shares one `AuxPool`."""
    pool = AuxPool()
    for m in module.modules():
        if isinstance(m, MoEFeedForward):
            m.aux_pool = pool


class _PooledAux(torch.autograd.Function):
    """Hugging Face's pooled load-balancing loss as seen by one layer. The pooled loss is
    A = E·Σ_e (C_e/N)·(S_e/N) with C_e the assignments to e and N the tokens, both summed over the
    layers (and the ranks `balance` covers), S_e the softmax probabilities of e summed over the same
    tokens; C is a constant under autograd, so dA/dS_{l,e} = E·C_e/N² for every layer l. Forward:
    a 0-d zero (the value is `MoEStats`'); backward hands this layer's probability sums [E] that
    gradient, × ``ranks`` (the ranks' mean gradient is the global loss's), read from the
    micro-batch's record once every layer has added to it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, prob_sum: torch.Tensor, record: _PoolRecord, ranks: int
    ) -> torch.Tensor:
        ctx.record, ctx.ranks = record, ranks
        return prob_sum.new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        r = ctx.record
        n_experts = r.counts.numel()
        return grad * (ctx.ranks * n_experts) * r.counts / (r.tokens * r.tokens), None, None


@torch.no_grad()
def update_expert_bias(
    layers: Iterable[MoEFeedForward],
    all_reduce: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024, arXiv 2408.15664; DeepSeek-V3
    §2.1.2), after an optimizer step: every layer with an expert bias and a positive rate takes its
    load c — the assignments its router chose per expert in every forward since the last update
    (all of the step's micro-batches; the capacity-dropped ones too: the selection is counted;
    recomputations not) — summed over the ranks by ``all_reduce`` (one call for all the layers'
    loads, int64, in place; None: this process alone), and moves its bias by
    b_e += rate · sign(mean(c) − c_e), the sign computed exactly as sign(Σc − E·c_e). Device ops
    only (no host sync); every rank computes the same update from the same sums. The loads start
    again from zero; the summed ones stay in ``step_load``."""
    moving = [m for m in layers if m.expert_bias is not None and m.config.expert_bias_rate > 0]
    if not moving:
        return
    loads = torch.cat(
        [
            m.expert_load
            if m.expert_load is not None
            else torch.zeros(m.config.experts, dtype=torch.long, device=m.expert_bias.device)
            for m in moving
        ]
    )
    if all_reduce is not None:
        all_reduce(loads)
    for m, load in zip(moving, loads.split([m.config.experts for m in moving])):
        direction = torch.sign(load.sum() - m.config.experts * load)
        m.expert_bias.add_(direction.to(m.expert_bias.dtype) * m.config.expert_bias_rate)
        m.step_load, m.expert_load = load, None


def reset_expert_load(layers: Iterable[MoEFeedForward]) -> None:
    """Forget the loads counted since the last `update_expert_bias` (a step starts: evaluation
    forwards or an unfinished step are not its load)."""
    for m in layers:
        m.expert_load = None


class MoEFeedForward(nn.Module):
    """Router + experts (+ shared experts); see the module doc. Expert ``e`` is ``experts[str(e)]``:
    expert parallelism keeps only this rank's, and the parameter names stay the single-process
    ones. With ``shared_gate`` the layer has ``shared_gate`` (a bias-free [1, dim] linear); with
    ``expert_bias`` a persistent fp32 buffer ``expert_bias`` [E] (zeros at init: `init_buffers`),
    checkpointed with the parameters."""

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
            FeedForward(
                dim,
                config.shared_hidden or hidden * config.shared_experts,
                device=device,
                dtype=dtype,
            )
            if config.shared_experts
            else None
        )
        self.shared_gate = (
            Linear(dim, 1, bias=False, device=device, dtype=dtype) if config.shared_gate else None
        )
        self.register_buffer(
            "expert_bias",
            torch.zeros(config.experts, dtype=torch.float32, device=device)
            if config.expert_bias
            else None,
        )
        # assignments chosen per expert (int64 [E]) since the last `update_expert_bias`, and the
        # sums (over the ranks) that update read
        self.expert_load: torch.Tensor | None = None
        self.step_load: torch.Tensor | None = None
        # aux_convention hf: the pool this layer's model shares (`share_aux_pool`); its own alone
        self.aux_pool = AuxPool()
        self.exchange: Callable[[RunExperts, torch.Tensor, torch.Tensor], torch.Tensor] = (
            LocalExperts()
        )
        self.balance: Callable[
            [torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]
        ] = LocalBalance()
        # the main loss's scale for this micro-batch (1 / micro-batches), set per step
        self.aux_grad_scale = 1.0
        self.stats: MoEStats | None = None
        # how the experts run on their groups; None: `default_experts` for their device and dtype
        self.strategy: ExpertsStrategy | None = None

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The expert bias starts at zero (a checkpoint or a Hugging Face directory may load
        another)."""
        if self.expert_bias is not None and self.expert_bias.device.type != "meta":
            self.expert_bias.zero_()

    def run_experts(
        self, tokens: torch.Tensor, sizes: list[int], counts: torch.Tensor, first: int
    ) -> torch.Tensor:
        """This layer's experts ``first``, ``first + 1``, ... (those this rank holds under expert
        parallelism) on their groups of ``sizes`` rows (``counts`` on the device), by
        ``strategy``."""
        groups = ExpertGroups(sizes, counts, first)
        strategy = self.strategy
        if strategy is None:  # chosen at each call: the layer may have moved since
            w = self.experts[str(groups.first)].w1.weight
            strategy = default_experts(w.device, w.dtype)
        return strategy(self.experts, tokens, groups)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 logits [T, E] -> (weights [T, k], experts [T, k], probabilities [T, E] for load
        balancing)."""
        c = self.config
        scores = logits.softmax(dim=-1) if c.score == "softmax" else logits.sigmoid()
        # auxiliary-loss-free balancing: the bias moves the choice; the weights stay the scores'
        choosable = scores if self.expert_bias is None else scores + self.expert_bias
        if (
            c.group_limit is not None and c.group_limit < c.groups
        ):  # device-limited: the best groups only
            grouped = choosable.view(scores.shape[0], c.groups, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(c.group_limit, dim=-1).indices, True)
            # The other groups' experts at -inf: never chosen. Hugging Face's DeepSeek-V3 fills
            # 0.0 (its GLM-4-MoE -inf), which differs only when a kept expert's biased score is
            # negative: a masked expert would then outrank it.
            choosable = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(scores)
        experts = choosable.topk(c.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if c.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if c.routed_scaling != 1.0:
            weights = weights * c.routed_scaling
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
        # one-hot by comparison (F.one_hot checks its range on the host)
        one_hot = (by_slot[:, None] == torch.arange(c.experts, device=by_slot.device)).long()
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
        # Each (token, slot) is one row for its expert, sorted by expert (stable: token order
        # within); a dropped row sorts last, under a bucket E of its own, and is never computed.
        flat_experts = experts.reshape(-1)
        bucket = (
            flat_experts
            if c.capacity_factor is None
            else flat_experts.masked_fill(~kept.reshape(-1), c.experts)
        )
        order = bucket.argsort(stable=True)
        token_of = torch.div(order, c.top_k, rounding_mode="floor")
        flat_weights = weights.reshape(-1)[order]
        ones = torch.ones_like(flat_experts)
        counts = torch.zeros(c.experts + 1, dtype=torch.long, device=t.device)
        counts = counts.scatter_add_(0, bucket, ones)[: c.experts]
        y = self.exchange(self.run_experts, t[token_of], counts)
        rows = y.shape[0]  # the kept rows (known on the host from the exchange's sizes)
        weighted = y * flat_weights[:rows].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(t).index_add(0, token_of[:rows], weighted)
        if self.shared is not None:
            shared = self.shared(t)
            if self.shared_gate is not None:  # Qwen2-MoE: gated per token
                shared = torch.sigmoid(self.shared_gate(t)) * shared
            out = out + shared

        # a forward of training, not its recomputation: what it counts, it counts once
        first_run = torch.is_grad_enabled() and not ops.recomputing()
        if first_run and self.expert_bias is not None and c.expert_bias_rate > 0:
            load = torch.zeros(c.experts, dtype=torch.long, device=t.device)
            load = load.scatter_add_(0, flat_experts, ones)  # the selection, dropped ones too
            self.expert_load = load if self.expert_load is None else self.expert_load + load
        if c.aux_convention == "hf":
            aux, own, total, ranks = self._hf_aux(logits, experts, probs, n_tokens, first_run)
        else:
            # Load balancing over the tokens `balance` covers: f from (all-reduced) routing counts,
            # P from this rank's probabilities; scaled by the number of ranks so that the mean over
            # ranks of their aux is the global aux.
            chosen = torch.zeros(c.experts, device=t.device).scatter_add_(
                0, flat_experts, ones.to(torch.float32)
            )
            chosen, total, ranks = self.balance(chosen, chosen.new_full((), float(n_tokens)))
            f = chosen / (total * c.top_k)
            aux = own = c.experts * (f * probs.sum(dim=0)).sum() / total * ranks
        z = logits.logsumexp(dim=-1).pow(2).sum() / total * ranks
        out = _AuxGrad.apply(out, c.aux_loss_coef * aux + c.z_loss_coef * z, self.aux_grad_scale)
        self.stats = MoEStats(counts.detach(), (~kept).sum().detach(), own.detach(), z.detach())
        return out.view(shape)

    def _hf_aux(
        self,
        logits: torch.Tensor,
        experts: torch.Tensor,
        probs: torch.Tensor,
        n_tokens: int,
        first_run: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Hugging Face's load-balancing loss (``aux_convention`` hf; `_PooledAux`): the top k of
        the softmax of the logits counted (whatever the score function, groups or bias), P the
        softmax, both over the tokens `balance` covers; pooled over the model's layers through
        `aux_pool`. Returns (the loss's differentiable stand-in, this layer's own loss
        E·Σ_e (c_e/T)·(S_e/T) for the metrics, the tokens T, the ranks)."""
        c = self.config
        soft = probs if c.score == "softmax" else logits.softmax(dim=-1)
        plain = (
            c.score == "softmax" and self.expert_bias is None and c.group_limit in (None, c.groups)
        )
        picked = experts if plain else soft.topk(c.top_k, dim=-1).indices  # routing's if the same
        chosen = torch.zeros(c.experts, device=logits.device).scatter_add_(
            0, picked.reshape(-1), torch.ones(picked.numel(), device=logits.device)
        )
        chosen, total, ranks = self.balance(chosen, chosen.new_full((), float(n_tokens)))
        prob_sum = soft.sum(dim=0)
        own = c.experts * (chosen / total * prob_sum / total).sum() * ranks
        if not torch.is_grad_enabled():
            return own, own, total, ranks
        # (a recomputation's stand-in is never backwarded: the forward's carries the gradient)
        record = self.aux_pool.add(self, chosen, total) if first_run else self.aux_pool.record
        return _PooledAux.apply(prob_sum, record, ranks), own, total, ranks
