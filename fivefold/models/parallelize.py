"""The one assembly of a parallel model (trainer, tests, benchmarks): `parallelize` returns this
rank's `ParallelModel` (`models.parallel_model`), a `WholeModel` (pp = 1) or `PipelinedModel`: the
model or its stages TP-sharded by `plans.LLAMA_TP_PLAN`, one `ZeroDataParallel` each (its groups
declaring their `Placement` for the global norm), the loss and, under pp, a `PipelineRuntime`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fivefold.config import Config
from fivefold.context_parallel import (
    SequenceLayout,
    UlyssesGroups,
    UlyssesLayout,
    apply_context_parallel,
    layout_for,
)
from fivefold.data_parallel import MixedPrecision, ZeroDataParallel, ZeroOptions
from fivefold.data_parallel.flat_param import Float8Units
from fivefold.data_parallel.optimizers import (
    InnerOptimizer,
    MatricesApart,
    Muon,
    OptimizerChoice,
)
from fivefold.distributed.comm import Comm, Placement, amax_over, compile_eager_regions
from fivefold.distributed.topology import MeshLike
from fivefold.expert_parallel import AllToAllExperts, GlobalBalance
from fivefold.float8 import RECIPES, Float8Matmul, compose_scopes, split_scope
from fivefold.formulas import bubble_formula
from fivefold.materialize import materialize
from fivefold.models.llama import Llama, LlamaConfig
from fivefold.models.loss import lm_cross_entropy
from fivefold.models.moe import MoEFeedForward, reset_expert_load, update_expert_bias
from fivefold.models.parallel_model import Batch, MeasuredPipeline, ParallelModel
from fivefold.models.plans import (
    LLAMA_CP_PLAN,
    LLAMA_TP_PLAN,
    is_block_matrix,
    is_float8_linear,
    is_float8_weight,
    llama_stage_modules,
)
from fivefold.observe.memory import model_state_bytes
from fivefold.optim.clip import NonFiniteWatch, step_together
from fivefold.pipeline.actions import Schedule
from fivefold.pipeline.builders import build_schedule, forward_only
from fivefold.pipeline.runtime import PipelineRuntime
from fivefold.pipeline.simulator import Timeline
from fivefold.pipeline.split import copy_kept
from fivefold.rules import (  # the rules a model's assembly checks again (`validate_layout` first)
    check_compile_supported,
    check_pipeline_supported,
    compile_blockers,
    pipeline_overlap,
)
from fivefold.tensor_parallel.loss import VocabParallelLoss
from fivefold.tensor_parallel.plan import ParamPlacement, TPPlan, shard_by_plan

if TYPE_CHECKING:
    from fivefold.models.documents import Documents

__all__ = [
    "PipelinedModel",
    "WholeModel",
    "apply_tensor_parallel",
    "build_stages",
    "check_compile_supported",
    "compile_blockers",
    "is_expert",
    "is_tp_sharded",
    "optimizer_choice",
    "parallelize",
    "pipeline_forward_backward",
    "pipeline_overlap",
    "set_aux_grad_scale",
    "tp_loss",
]


def apply_tensor_parallel(
    model: nn.Module, comm: Any, sequence_parallel: bool = False, plan: TPPlan = LLAMA_TP_PLAN
) -> nn.Module:
    """Shard `model` (a `Llama` or a stage of one) in place over `comm`; placements go to
    ``model.tp_placements``."""
    model.tp_placements = shard_by_plan(model, comm, plan, sequence_parallel)
    model.tp_comm = comm
    return model


def is_tp_sharded(name: str, param: nn.Parameter, model: nn.Module) -> bool:
    """True if this parameter holds a 1/T slice (False: replicated across the TP group)."""
    placement = getattr(model, "tp_placements", {}).get(name)
    return placement is not None and placement.tp_dim is not None


def tp_loss(model: nn.Module) -> VocabParallelLoss:
    """The loss on a TP-sharded head: rank r holds vocabulary rows [r·V/T, (r+1)·V/T)."""
    comm = model.tp_comm
    return VocabParallelLoss(comm, comm.rank * (model.config.vocab_size // comm.size))


def build_stages(
    config: LlamaConfig,
    stage_ids: Sequence[int],
    n_stages: int,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    layers_per_stage: list[int] | None = None,
) -> dict[int, Llama]:
    """The stages `stage_ids` of the model cut into `n_stages`, each with its single-process weights
    (on ``device="meta"``: nothing allocated, for `parallelize` to materialise each rank's
    share)."""
    names = llama_stage_modules(config, n_stages, layers_per_stage)
    meta = Llama(config, device="meta", dtype=dtype)
    stages = {}
    for s in stage_ids:
        stage = copy_kept(
            meta, names[s]
        )  # (copies only the stage's modules: a 700B model's stage in a second)
        if torch.device(device).type != "meta":
            materialize(stage, device)
            stage.init_weights(
                seed
            )  # each parameter from its own seeded generator: the single-process values
        stages[s] = stage
    return stages


def pipeline_forward_backward(
    runtime: PipelineRuntime,
    engines: dict[Any, ZeroDataParallel],
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    documents: Sequence[Documents | None] | None = None,
    loss_weight: float = 1.0,
) -> torch.Tensor | None:
    """One pipeline step; each stage's M backwards run unreduced (`no_sync`), then every engine
    reduces over dp once."""
    with contextlib.ExitStack() as unreduced:
        for e in engines.values():
            unreduced.enter_context(e.no_sync())
        loss = runtime.step(inputs, targets, documents, loss_weight)
    for e in engines.values():
        e.sync_gradients()
    return loss


def _set_activations(model: Llama, cfg: Config) -> None:
    """The attention core (``model.attention``; cp swaps in ring attention later) and activation
    recompute (``train.recompute``, selective-op's ``train.recompute_save``), inside each block:
    under ZeRO-3 the recomputation runs while the block's unit is gathered for its backward, and
    TP / SP / ring / expert collectives run again in backward in the same order on every rank (full;
    selective-op issues each once, in the forward, and replays its buffers)."""
    model.set_attention(cfg.model.attention).set_recompute(
        cfg.train.recompute, cfg.train.recompute_save
    )
    if (
        cfg.train.compile
    ):  # each block's computation; the hooks around the blocks and the collectives stay eager
        compile_eager_regions()
        model.compile_blocks()


def _shard(module: nn.Module, cfg: Config, mesh: MeshLike):
    """TP-shard `module` if tp > 1; returns its loss function."""
    tp = mesh.comm("tp")
    if tp.size == 1:
        return lm_cross_entropy
    apply_tensor_parallel(module, tp, sequence_parallel=cfg.parallel.sp)
    return tp_loss(module)


def _set_float8(module: nn.Module, cfg: Config, mesh: MeshLike) -> None:
    """``precision.fp8``: every linear `plans.is_float8_linear` names (after TP sharding) computes
    by a `float8.Float8Matmul` of the recipe, its scope the max over the ranks its operands are
    split over (docs/design.md#fp8-training): over tp along the layer's ``split_dims`` (a column-
    or row-parallel slice), over cp along the tokens (a rank holds part of each sequence). Over dp
    nothing: an activation's scales are its rank's micro-batch's, as torchao's."""
    if cfg.precision.fp8 == "off":
        return
    recipe = RECIPES[cfg.precision.fp8]
    tp, cp = mesh.comm("tp"), mesh.comm("cp")
    tokens = (
        split_scope({"input": 0, "grad_output": 0}, functools.partial(amax_over, cp))
        if cp.size > 1
        else None
    )
    for name, layer in module.named_modules():
        if not is_float8_linear(name):
            continue
        split = getattr(layer, "split_dims", {})
        sliced = (
            split_scope(split, functools.partial(amax_over, tp)) if split and tp.size > 1 else None
        )
        layer.matmul = Float8Matmul(recipe, compose_scopes(sliced, tokens))


def _grad_comm(mesh: MeshLike):
    """Gradients and the loss are averaged over dp × cp: a cp rank holds the same parameters for
    another part of the same sequences (its loss is the mean over its tokens, the same count on
    every cp rank)."""
    return mesh.comm("dp_cp") if mesh.size("cp") > 1 else mesh.comm("dp")


def _shard_comms(mesh: MeshLike) -> tuple[Comm, Comm | None]:
    """The dense engine's groups: (shard, replicate). HSDP (parallel.dp_replicate > 1): ZeRO shards
    over dp_shard (its dp rows with all their cp ranks) and all-reduces each shard across
    dp_replicate; else shards span dp × cp."""
    if mesh.size("dp_replicate") == 1:
        return _grad_comm(mesh), None
    return mesh.comm("dp_shard"), mesh.comm("dp_replicate")


def is_expert(name: str, param: nn.Parameter | None = None) -> bool:
    """An MoE expert's parameter (``...feed_forward.experts.3.w1.weight``): sharded over ep, its own
    engine."""
    return ".experts." in f".{name}"


def _moe_layers(module: nn.Module) -> list[MoEFeedForward]:
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


def _expert_parallel(module: Llama, mesh: MeshLike, overlap: bool = False) -> None:
    """Keep this ep rank's experts of every MoE layer (on meta: nothing allocated), exchange tokens
    by all-to-all over ep, and balance the load over the global micro-batch (dp × cp). ``overlap``:
    backwards run beside forwards (`pipeline_overlap`), so the backward's all-to-alls get a group of
    their own."""
    ep, loss_comm = mesh.comm("ep"), _grad_comm(mesh)
    for layer in _moe_layers(module):
        per_rank = layer.config.experts // ep.size
        for e in range(layer.config.experts):
            if e // per_rank != ep.rank:
                del layer.experts[str(e)]
        if ep.size > 1:
            layer.exchange = AllToAllExperts(
                ep, layer.config.experts, mesh.backward_comm("ep") if overlap else None
            )
        if loss_comm.size > 1:
            layer.balance = GlobalBalance(loss_comm)


def _engines(
    module: Llama, cfg: Config, mesh: MeshLike, device: torch.device, overlap: bool = False
) -> list[ZeroDataParallel]:
    """`module` (on meta, TP-sharded if tp > 1) in its engines, which materialise this rank's share
    of it: the TP slice of each seeded single-process value, and under ZeRO-3 only the dp(× cp)
    shard of that; then ring attention if cp > 1. An MoE model's experts get a second engine: kept
    over ep, averaged over the rest of dp × cp (`ep_dp`), their gradients (already summed over ep by
    the all-to-all) divided by dp × cp like the others. HSDP shards the dense engine over dp_shard
    and all-reduces across dp_replicate; the experts' engine is as above."""
    t, z = cfg.train, cfg.zero
    tp_placements: dict[str, ParamPlacement] = getattr(module, "tp_placements", {})
    pp: Placement = frozenset({"pp"}) if mesh.size("pp") > 1 else frozenset()
    tp, grad_comm = mesh.comm("tp"), _grad_comm(mesh)
    shard_comm, replicate = _shard_comms(mesh)
    moe = bool(_moe_layers(module))
    if moe:
        _expert_parallel(module, mesh, overlap)

    def init_value(name: str) -> torch.Tensor:
        # on the meta device (`fivefold.plan` laying a rank out without holding it) nothing is drawn
        full = (
            torch.empty(module.full_shapes()[name], device="meta")
            if device.type == "meta"
            else module.initial_value(name, t.seed, device)  # drawn where it will live
        )
        return tp_placements.get(name, ParamPlacement()).local_part(full, tp)

    hpz = (
        mesh.hpz_comm(z.hpz) if z.hpz > 1 else None
    )  # ZeRO++ hpZ (dense models: validate refuses it with MoE)

    def engine(
        comm: Comm,
        owns: Any,
        extra: Placement,
        divisor: int | None = None,
        replicate: Comm | None = None,
        hpz_comm: Comm | None = None,
    ) -> ZeroDataParallel:
        options = ZeroOptions(
            stage=z.stage,
            mixed_precision=MixedPrecision.from_names(cfg.precision.param, cfg.precision.reduce),
            bucket_mb=z.bucket_mb,
            find_unused=z.find_unused,
            reshard_after_forward=z.reshard_after_forward,
            prefetch=z.prefetch,
            inflight_buckets=z.inflight_buckets,
            optimizer_class=torch.optim.AdamW,
            weight_decay=t.weight_decay,
            optimizer_kwargs=dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps),
            optimizers=optimizer_choice(cfg),
            params=owns,
            placement_of=lambda name, p: (
                tp_placements.get(name, ParamPlacement()).mesh_dims | pp | extra
            ),
            init_value=init_value,
            device=device,
            grad_divisor=divisor,
            replicate=replicate,
            qwz=z.qwz,
            qgz=z.qgz,
            quant_block=z.quant_block,
            hpz_comm=hpz_comm,
            constant_buffers=z.constant_buffers,
            offload_optimizer=z.offload_optimizer,
            fp8_gather=Float8Units(is_float8_weight, tp) if z.fp8_gather else None,
        )
        return ZeroDataParallel(module, comm, options)

    engines = [
        engine(
            shard_comm,
            (lambda n, p: not is_expert(n)) if moe else None,
            frozenset(),
            replicate=replicate,
            hpz_comm=hpz,
        )
    ]
    if moe:
        ep_dims: Placement = frozenset({"ep"}) if mesh.size("ep") > 1 else frozenset()
        engines.append(engine(mesh.comm("ep_dp"), is_expert, ep_dims, divisor=grad_comm.size))
    materialize(
        module, device, parameters=False
    )  # the engines own the parameters; left: RoPE tables
    module.init_buffers()
    if mesh.size("cp") > 1:
        apply_context_parallel(
            module,
            _cp_groups(cfg, mesh),
            _layout(cfg, mesh),
            cfg.train.seq_len,
            LLAMA_CP_PLAN,
            kernel=cfg.parallel.cp_kernel,
            whole_tables=cfg.data.documents == "mask",  # positions restart at each document
        )
    return engines


def optimizer_choice(cfg: Config) -> OptimizerChoice | None:
    """``optim.name``: None for AdamW alone (the engine's own class and kwargs); for muon, Muon for
    the blocks' matrices (`plans.is_block_matrix`) and AdamW for the rest, both at ``train.lr``
    (docs/design.md#muon-under-zero)."""
    t, o = cfg.train, cfg.optim
    if o.name == "adamw":
        return None
    muon = dict(
        lr=t.lr,
        momentum=o.muon_momentum,
        nesterov=o.muon_nesterov,
        ns_steps=o.muon_ns_steps,
        adjust_lr_fn=o.muon_adjust_lr,
    )
    adamw = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    return MatricesApart(
        matrices=InnerOptimizer(Muon, muon, elementwise=False),
        rest=InnerOptimizer(torch.optim.AdamW, adamw),
        is_matrix=is_block_matrix,
    )


def set_aux_grad_scale(modules: Any, scale: float) -> None:
    """The MoE auxiliary losses' gradient scale = the main loss's (1 / micro-batches)."""
    for module in modules:
        for layer in _moe_layers(module):
            layer.aux_grad_scale = scale


def _layout(cfg: Config, mesh: MeshLike) -> SequenceLayout | UlyssesLayout:
    return layout_for(cfg.parallel, mesh.size("cp"))


def _cp_groups(cfg: Config, mesh: MeshLike) -> Any:
    """What context parallel's cores run over: the cp group (ring), or Ulysses' and the ring's."""
    if cfg.parallel.cp_mode == "ring":
        return mesh.comm("cp")
    return UlyssesGroups(mesh.comm("cp_ulysses"), mesh.comm("cp_ring"))


class _Parts:
    """What both layouts share (the `ParallelModel` protocol but the forward, backward and
    evaluation): engines, the step over every placement, metrics, the layout's one-line description.
    """

    engines: dict[
        Any, ZeroDataParallel
    ]  # WholeModel: 0 (and 1: experts); PipelinedModel: (stage, 0 / 1)
    timeline: Timeline | None = None
    schedule: Schedule | None = None  # the pipeline's (PipelinedModel)

    def __init__(
        self, cfg: Config, mesh: MeshLike, device: torch.device, documents_eos: int | None
    ) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.loss_comm = _grad_comm(mesh)
        self.layout = _layout(cfg, mesh)
        self.finite_watch = NonFiniteWatch()
        self.documents_eos = documents_eos

    def documents_of(self, tokens: torch.Tensor) -> Documents | None:
        """The documents of whole rows [B, L] of token ids on the CPU, for this rank's part (its
        cp positions), on the device; None when attention runs across documents
        (``data.documents`` cross)."""
        if self.documents_eos is None:
            return None
        from fivefold.models.documents import find_documents

        layout = self.layout if self.layout.cp > 1 else None
        return find_documents(
            tokens, self.documents_eos, layout, self.mesh.rank("cp"), device=self.device
        )

    def local(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's part of whole sequences [B, L] on the device: its layout's positions under
        cp."""
        if self.layout.cp > 1:
            if (
                tokens.shape[1] != self.cfg.train.seq_len
            ):  # the RoPE tables hold the positions of train.seq_len
                raise ValueError(
                    f"context parallel: a batch of {tokens.shape[1]}-token sequences, but the "
                    f"model was laid out for train.seq_len={self.cfg.train.seq_len}"
                )
            tokens = self.layout.shard(tokens, self.mesh.rank("cp"))
        return tokens.to(self.device)

    def param_groups(self) -> list[dict[str, Any]]:
        return [g for e in self.engines.values() for g in e.param_groups]

    def step(self, max_norm: float | None, check_finite: bool = False) -> torch.Tensor | None:
        """Clip and step every engine together, then move the MoE layers' expert bias (auxiliary-
        loss-free balancing, `_update_expert_bias`); ``check_finite``: stop (`NonFiniteGradient`,
        on every rank) instead of applying a non-finite gradient."""
        comms = {
            d: self.mesh.comm(d)
            for d in ("tp", "pp", "ep")
            if d != "ep" or self.mesh.size("ep") > 1
        }
        norm = step_together(
            list(self.engines.values()),
            max_norm,
            comms,
            check_finite,
            self.mesh.world if check_finite else None,
            self.finite_watch,
        )
        self._update_expert_bias()
        return norm

    def _update_expert_bias(self) -> None:
        """Auxiliary-loss-free balancing after the optimizer step (`moe.update_expert_bias`): this
        rank's MoE layers (its stages' under pp) move their expert bias by the step's loads summed
        over dp × cp (`loss_comm`, the group `GlobalBalance` sums over; it contains the ep group),
        in one all-reduce for all of them: the same update on every rank of the group."""
        layers = [m for module in self.modules() for m in _moe_layers(module)]
        comm = self.loss_comm

        def all_reduce(loads: torch.Tensor) -> None:
            comm.all_reduce(loads, tag="moe_expert_bias")

        update_expert_bias(layers, all_reduce if comm.size > 1 else None)

    def gather_timeline(self) -> None:
        """Only a pipeline has a timeline to gather."""

    def measured_pipeline(self) -> MeasuredPipeline | None:
        """`gather_timeline` (collective over pp), with the schedule's textbook bubble
        (docs/design.md#pipeline-schedules) and its title; None without pp."""
        self.gather_timeline()
        if self.timeline is None or self.schedule is None:
            return None
        s = self.schedule
        try:
            formula = bubble_formula(s.name, s.n_ranks, s.n_microbatches, s.n_virtual)
        except ValueError:  # a schedule without a textbook formula: the measured bubble alone
            formula = None
        title = f"{s.name} P={s.n_ranks} M={s.n_microbatches} V={s.n_virtual}"
        return MeasuredPipeline(self.timeline, formula, title)

    @property
    def step_traffic_dims(self) -> tuple[str, ...]:
        """The dimensions of a step's data-parallel traffic (docs/design.md#data-parallel-traffic):
        gradients over dp or dp_cp, HSDP's dp_shard and dp_replicate, hpZ's backward gathers over
        dp_hpz; MoE: experts over ep_dp, all-to-alls over ep."""
        return (self.loss_comm.dim, "ep", "ep_dp", "dp_shard", "dp_replicate", "dp_hpz")

    def describe_layout(self) -> str:
        """One line naming the layout, e.g. ``pp=1 dp=2 ZeRO-1 tp=1 (fp32 params, fp32 reduce)``."""
        cfg, mesh = self.cfg, self.mesh
        pp, cp, hsdp, z = mesh.size("pp"), mesh.size("cp"), mesh.size("dp_replicate"), cfg.zero
        zeropp = "".join(
            f"+{name}"
            for name, on in (("qwZ", z.qwz), ("qgZ", z.qgz), (f"hpZ({z.hpz})", z.hpz > 1))
            if on
        )
        return (
            f"pp={pp} dp={mesh.size('dp')} ZeRO-{z.stage}{zeropp} tp={mesh.size('tp')}"
            + (" Muon (whole matrices)" if cfg.optim.name == "muon" else "")
            + (f" HSDP {hsdp} replicas × {mesh.size('dp_shard')} shards" if hsdp > 1 else "")
            + (" +SP" if cfg.parallel.sp else "")
            + (f" cp={cp} {self.layout.describe()}" if cp > 1 else "")
            + (f" ep={mesh.size('ep')}" if mesh.size("ep") > 1 else "")
            + (f" {cfg.pipeline.schedule}" if pp > 1 else "")
            + self._overlap_note()
            + (f" recompute {cfg.train.recompute}" if cfg.train.recompute != "none" else "")
            + (f" ({t.recompute_save})" if (t := cfg.train).recompute == "selective-op" else "")
            + f" ({cfg.precision.param} params, {cfg.precision.reduce} reduce"
            + (f", FP8 {cfg.precision.fp8} linears" if cfg.precision.fp8 != "off" else "")
            + (", FP8 gathers" if cfg.zero.fp8_gather else "")
            + ")"
        )

    def _overlap_note(self) -> str:
        """Under a schedule with overlapped units: whether they run side by side, and why (not)."""
        if self.schedule is None or not any(self.schedule.side_by_side):
            return ""
        if self.overlap:
            return f" ({self.overlap_reason})"
        return f" (F&B one after the other: {self.overlap_reason})"

    def action_marks(self) -> list[tuple]:
        """The last step's pipeline actions as clock marks (`ActionClock.marks`), for a tracer; none
        without pp."""
        return []

    def modules(self) -> list[nn.Module]:
        return [self.module] if hasattr(self, "module") else list(self.stages.values())

    def traced_modules(self) -> list[tuple[str, nn.Module]]:
        """What a step trace times on this rank, by single-process name: the embedding, each
        transformer block (``layers.N``), the final norm and the head — those of this rank's stages
        under pp."""
        out: list[tuple[str, nn.Module]] = []
        for module in self.modules():
            for name, child in module.named_children():
                if isinstance(child, nn.ModuleDict):  # the blocks, keyed by their global index
                    out += [(f"{name}.{key}", block) for key, block in child.items()]
                elif child is not None and any(True for _ in child.parameters()):
                    out.append((name, child))
        return out

    def moe_load(self) -> dict[str, dict[str, Any]] | None:
        """Per MoE layer, the last micro-batch's kept assignments per expert and dropped ones summed
        over dp × cp, and its load-balancing loss; None for a dense model. Collective over dp × cp
        (and pp); syncs the host, so for log steps only."""
        layers = {
            name: m
            for module in self.modules()
            for name, m in module.named_modules()
            if isinstance(m, MoEFeedForward) and m.stats is not None
        }
        out: dict[str, dict[str, Any]] = {}
        if layers:
            st = [m.stats for m in layers.values()]
            packed = torch.cat(
                [
                    torch.stack([s.tokens_per_expert.float() for s in st]).flatten(),
                    torch.stack([s.dropped.float() for s in st]),
                    torch.stack([s.aux_loss for s in st]),
                ]
            )
            self.loss_comm.all_reduce(packed, tag="metrics")
            n, e = len(st), st[0].tokens_per_expert.numel()
            counts, dropped, aux = (
                packed[: n * e].view(n, e),
                packed[n * e : n * e + n],
                packed[n * e + n :],
            )
            for i, name in enumerate(layers):
                out[name] = {
                    "tokens_per_expert": counts[i].tolist(),
                    "dropped": int(dropped[i]),
                    "aux_loss": aux[i].item() / self.loss_comm.size,
                }
        if self.mesh.size("pp") > 1:  # every stage's layers
            merged: dict[str, dict[str, Any]] = {}
            for part in self.mesh.comm("pp").all_gather_object(out):
                merged.update(part)
            out = merged
        return dict(sorted(out.items(), key=lambda kv: int(kv[0].split(".")[1]))) or None

    def model_state_bytes(self) -> int:
        return sum(model_state_bytes(e).total for e in self.engines.values())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters (all of its stages) at master precision; collective over dp."""
        state: dict[str, torch.Tensor] = {}
        for e in self.engines.values():
            state.update(e.full_state_dict())
        return state


class WholeModel(_Parts):
    """pp = 1: the whole model (TP-sharded if tp > 1) in one engine (two with MoE experts)."""

    def __init__(
        self,
        cfg: Config,
        model_cfg: LlamaConfig,
        mesh: MeshLike,
        device: torch.device,
        documents_eos: int | None = None,
    ) -> None:
        super().__init__(cfg, mesh, device, documents_eos)
        check_compile_supported(cfg, device.type)
        model = Llama(
            model_cfg, device="meta"
        )  # nothing allocated: the engines materialise this rank's share
        _set_activations(model, cfg)
        self.loss_fn = _shard(model, cfg, mesh)
        _set_float8(model, cfg, mesh)
        self.module = model
        self.engines = dict(enumerate(_engines(model, cfg, mesh, device)))
        self.engine = self.engines[0]

    def forward_backward(
        self,
        micro_batches: list[Batch],
        documents: Sequence[Documents | None] | None = None,
        loss_weight: float = 1.0,
    ) -> torch.Tensor:
        n = len(micro_batches)
        documents = documents or [None] * n
        set_aux_grad_scale([self.module], 1.0 / n)
        reset_expert_load(_moe_layers(self.module))  # the step's load: its micro-batches
        loss_sum = self.loss_comm.scalar(0.0)  # all-reduced for the metrics
        for i, ((x, y), docs) in enumerate(zip(micro_batches, documents, strict=True)):
            defer = self.cfg.zero.defer_reduce and i < n - 1
            with contextlib.ExitStack() as unreduced:
                for e in self.engines.values() if defer else ():
                    unreduced.enter_context(e.no_sync())
                loss = self.loss_fn(self._forward(x, docs), self.local(y)) * loss_weight / n
                self.engine.backward(loss)  # (scales by the loss scaler, fp16 without MoE only)
            loss_sum += loss.detach()
        return loss_sum

    def _forward(self, x: torch.Tensor, docs: Documents | None) -> torch.Tensor:
        return self.module(self.local(x)) if docs is None else self.module(self.local(x), docs)

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The step's mean loss over dp (× cp), a 0-d tensor on the device (no host sync)."""
        local = self.loss_comm.scalar(local)
        self.loss_comm.all_reduce(local, tag="metrics")
        return local / self.loss_comm.size

    @torch.no_grad()
    def evaluate(
        self,
        batches: list[Batch],
        documents: Sequence[Documents | None] | None = None,
        loss_weight: float = 1.0,
    ) -> float:
        total = self.loss_comm.scalar(0.0, torch.float64)
        for (x, y), docs in zip(batches, documents or [None] * len(batches), strict=True):
            total += self.loss_fn(self._forward(x, docs), self.local(y))
        return self.global_loss(total * loss_weight / len(batches)).item()


class PipelinedModel(_Parts):
    """pp > 1: this rank's stages, one engine each, run by a `PipelineRuntime` over the accumulation
    micro-batches."""

    def __init__(
        self,
        cfg: Config,
        model_cfg: LlamaConfig,
        mesh: MeshLike,
        device: torch.device,
        documents_eos: int | None = None,
    ) -> None:
        super().__init__(cfg, mesh, device, documents_eos)
        check_pipeline_supported(cfg)
        p, pp = cfg.pipeline, mesh.comm("pp")
        self.pp = pp
        self.schedule = build_schedule(p.schedule, pp.size, cfg.train.grad_accum, p.virtual)
        check_compile_supported(cfg, device.type, self.schedule)
        stages = build_stages(
            model_cfg,
            self.schedule.stages_of(pp.rank),
            self.schedule.n_stages,
            device="meta",
            layers_per_stage=p.layers(),
        )
        for stage in stages.values():
            _set_activations(stage, cfg)
        loss_fns = {s: _shard(m, cfg, mesh) for s, m in stages.items()}
        for stage in stages.values():
            _set_float8(stage, cfg, mesh)
        self.stages = stages
        self.overlap, self.overlap_reason = pipeline_overlap(
            cfg, model_cfg.moe, mesh.size, device.type
        )
        self.engines = {
            (s, i): e
            for s, m in stages.items()
            for i, e in enumerate(_engines(m, cfg, mesh, device, self.overlap))
        }
        # Between stages flows the hidden state [mb, L/C, D] (this cp rank's tokens), [mb, L/C/T, D]
        # under SP.
        seq = cfg.train.seq_len // mesh.size("cp")
        seq = seq // mesh.size("tp") if cfg.parallel.sp else seq
        self.dtype = MixedPrecision.from_names(cfg.precision.param).param_dtype
        self.shape = lambda mb: (mb, seq, model_cfg.dim)
        self.loss_fn = loss_fns.get(self.schedule.n_stages - 1, lm_cross_entropy)
        self.p2p = None if p.p2p == "auto" else p.p2p
        self.runtime = PipelineRuntime(
            self.schedule,
            self.stages,
            pp,
            self.loss_fn,
            self.shape,
            self.dtype,
            device,
            p2p=self.p2p,
            overlap=self.overlap,
        )

    def forward_backward(
        self,
        micro_batches: list[Batch],
        documents: Sequence[Documents | None] | None = None,
        loss_weight: float = 1.0,
    ) -> torch.Tensor:
        set_aux_grad_scale(self.stages.values(), 1.0 / len(micro_batches))
        reset_expert_load(m for stage in self.stages.values() for m in _moe_layers(stage))
        loss = pipeline_forward_backward(
            self.runtime,
            self.engines,
            [self.local(x) for x, _ in micro_batches],
            [self.local(y) for _, y in micro_batches],
            documents,
            loss_weight,
        )
        return loss if loss is not None else self.pp.scalar(0.0)

    def action_marks(self) -> list[tuple]:
        return self.runtime.clock.marks()

    def gather_timeline(self) -> None:
        """The last step's measured action times from every pp rank (one gather, at the end of
        training)."""
        records = self.pp.all_gather_object(self.runtime.records)
        self.timeline = Timeline(
            records, name=f"{self.schedule.name} (measured)", n_virtual=self.schedule.n_virtual
        )

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Only the last stage has the loss: sum over pp (others add 0), mean over dp (× cp); on the
        device."""
        local = self.pp.scalar(local, torch.float32)
        self.pp.all_reduce(local, tag="metrics")
        self.loss_comm.all_reduce(local, tag="metrics")
        return local / self.loss_comm.size

    def evaluate(
        self,
        batches: list[Batch],
        documents: Sequence[Documents | None] | None = None,
        loss_weight: float = 1.0,
    ) -> float:
        sched = forward_only(self.pp.size, len(batches), self.schedule.stage_to_rank)
        runtime = PipelineRuntime(
            sched,
            self.stages,
            self.pp,
            self.loss_fn,
            self.shape,
            self.dtype,
            self.device,
            p2p=self.p2p,
        )
        loss = runtime.step(
            [self.local(x) for x, _ in batches],
            [self.local(y) for _, y in batches],
            documents,
            loss_weight,
        )
        return self.global_loss(loss if loss is not None else self.pp.scalar(0.0)).item()


def parallelize(
    cfg: Config,
    model_cfg: LlamaConfig,
    mesh: MeshLike,
    device: torch.device | str,
    documents_eos: int | None = None,
) -> ParallelModel:
    """This rank's parts of the model described by `model_cfg`, laid out by `cfg` over `mesh`: a
    `WholeModel` (pp = 1) or a `PipelinedModel`. ``documents_eos``: the end-of-document id when
    attention is masked per document (``data.documents`` mask; `documents_of`), else None."""
    device = torch.device(device)
    _groups_of_the_layout(cfg, model_cfg, mesh, device)
    kind = PipelinedModel if mesh.size("pp") > 1 else WholeModel
    return kind(cfg, model_cfg, mesh, device, documents_eos)


def _groups_of_the_layout(
    cfg: Config, model_cfg: LlamaConfig, mesh: MeshLike, device: torch.device
) -> None:
    """The groups only some layouts use (hpZ's, the expert all-to-alls' backward twin), made here on
    every rank, before any stage is built: making a group is a collective every rank joins (NCCL
    splits the world's communicator), so it must not wait for the ranks whose stage needs it."""
    if cfg.zero.hpz > 1:
        mesh.hpz_comm(cfg.zero.hpz)
    if model_cfg.moe is not None and mesh.size("pp") > 1 and mesh.size("ep") > 1:
        if pipeline_overlap(cfg, model_cfg.moe, mesh.size, device.type)[0]:
            mesh.backward_comm("ep")
