"""The trainable model of one rank, as the trainer sees it: built, parallelised and wrapped.

`WholeModel` (pp = 1): the full model, TP-sharded if tp > 1, in one `ZeroDataParallel` engine.
`PipelinedModel` (pp > 1): this rank's pipeline stages (TP-sharded if tp > 1), one engine per
stage, driven by a `PipelineRuntime` over the configured schedule; the pipeline's micro-batches
are the gradient-accumulation micro-batches, and gradients are reduced over dp once per step.

Both offer the same small interface to the training loop: `param_groups()`,
`forward_backward(micro_batches)`, `step(max_norm)`, `global_loss(local)`, `evaluate(data)`,
`model_state_bytes()`, and (pipelines) the measured timeline of the last step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import Config
from fivefold.data_parallel import MixedPrecision, ZeroDataParallel
from fivefold.data_parallel.zero import step_together
from fivefold.memory import model_state_bytes
from fivefold.mesh import ParallelMesh
from fivefold.models import build_model
from fivefold.models.llama import LlamaConfig
from fivefold.models.parallelize import apply_tensor_parallel, is_tp_sharded, tp_loss
from fivefold.pipeline.builders import build_schedule, forward_only
from fivefold.pipeline.runtime import PipelineRuntime
from fivefold.pipeline.simulator import Timeline, bubble_formula
from fivefold.pipeline.stage import build_stages
from fivefold.report import plot_timeline, to_chrome_trace
from fivefold.train.data import TokenDataset


def lm_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def _parallelize(module: nn.Module, cfg: Config, mesh: ParallelMesh):
    """TP-shard `module` if tp > 1; returns the matching loss function."""
    tp = mesh.comm("tp")
    if tp.size == 1:
        return lm_cross_entropy
    apply_tensor_parallel(module, tp, sequence_parallel=cfg.parallel.sp)
    return tp_loss(module)


def _engine(module: nn.Module, cfg: Config, mesh: ParallelMesh) -> ZeroDataParallel:
    t = cfg.train
    return ZeroDataParallel(
        module, mesh.comm("dp"), zero_stage=cfg.parallel.zero,
        mixed_precision=MixedPrecision.from_names(cfg.precision.param, cfg.precision.reduce),
        bucket_mb=cfg.ddp.bucket_mb, find_unused=cfg.ddp.find_unused,
        reshard_after_forward=cfg.ddp.reshard_after_forward, prefetch=cfg.ddp.prefetch,
        inflight_buckets=cfg.ddp.inflight_buckets,
        tp_comm=mesh.comm("tp"), tp_sharded=lambda name, p: is_tp_sharded(name, p, module),
        optimizer_class=torch.optim.AdamW, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)


def _eval_batches(data: TokenDataset, cfg: Config, mesh: ParallelMesh) -> list:
    dp, rank = mesh.size("dp"), mesh.rank("dp")
    n_batches = max(dp, cfg.train.eval_batches - cfg.train.eval_batches % dp)
    return data.val_batches(n_batches, cfg.train.micro_batch, dp_rank=rank, dp_size=dp)


def pipeline_forward_backward(runtime: PipelineRuntime, engines: dict[int, ZeroDataParallel],
                              inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor | None:
    """One pipeline step's forward and backward with every stage's gradients reduced over dp once:
    the M backward passes of a stage run unreduced (`no_sync`), then each engine syncs."""
    with contextlib.ExitStack() as unreduced:
        for e in engines.values():
            unreduced.enter_context(e.no_sync())
        loss = runtime.step(inputs, targets)
    for e in engines.values():
        e.sync_gradients()
    return loss


class WholeModel:
    timeline: Timeline | None = None

    def __init__(self, cfg: Config, model_cfg: LlamaConfig, mesh: ParallelMesh, device: torch.device) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        model = build_model(model_cfg, seed=cfg.train.seed, device=device)
        self.loss_fn = _parallelize(model, cfg, mesh)  # every rank built the full model: keep its slices
        self.engine = _engine(model, cfg, mesh)

    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.param_groups

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        n = len(micro_batches)
        loss_sum = self.mesh.comm("dp").scalar(0.0)  # all-reduced for the metrics
        for i, (x, y) in enumerate(micro_batches):
            defer = self.cfg.ddp.defer_reduce and i < n - 1
            with self.engine.no_sync() if defer else contextlib.nullcontext():
                loss = self.loss_fn(self.engine(x.to(self.device)), y.to(self.device)) / n
                self.engine.backward(loss)
            loss_sum += loss.detach()
        return loss_sum

    def step(self, max_norm: float | None) -> float | None:
        return self.engine.step(max_norm)

    def global_loss(self, local: torch.Tensor) -> float:
        dp = self.mesh.comm("dp")
        local = dp.scalar(local)
        dp.all_reduce(local, tag="metrics")
        return local.item() / self.mesh.size("dp")

    @torch.no_grad()
    def evaluate(self, data: TokenDataset) -> float:
        batches = _eval_batches(data, self.cfg, self.mesh)
        total = self.mesh.comm("dp").scalar(0.0, torch.float64)
        for x, y in batches:
            total += self.loss_fn(self.engine(x.to(self.device)), y.to(self.device))
        return self.global_loss(total / len(batches))

    def model_state_bytes(self) -> int:
        return model_state_bytes(self.engine).total


class PipelinedModel:
    def __init__(self, cfg: Config, model_cfg: LlamaConfig, mesh: ParallelMesh, device: torch.device) -> None:
        if cfg.precision.param == "fp16":
            raise ValueError("precision.param=fp16 with pipeline parallelism is not supported (loss scaling is "
                             "per engine); use bf16 or fp32")
        self.cfg, self.mesh, self.device = cfg, mesh, device
        p, pp = cfg.pipeline, mesh.comm("pp")
        self.pp = pp
        self.schedule = build_schedule(p.schedule, pp.size, cfg.train.grad_accum, p.virtual)
        layers = [int(v) for v in p.layers_per_stage.split(",")] if p.layers_per_stage else None
        stages = build_stages(model_cfg, self.schedule.stages_of(pp.rank), self.schedule.n_stages,
                              seed=cfg.train.seed, device=device, layers_per_stage=layers)
        loss_fns = {s: _parallelize(m, cfg, mesh) for s, m in stages.items()}
        self.engines = {s: _engine(m, cfg, mesh) for s, m in stages.items()}
        tp = mesh.size("tp")
        seq = cfg.train.seq_len // tp if cfg.parallel.sp else cfg.train.seq_len
        dtype = MixedPrecision.from_names(cfg.precision.param).param_dtype

        def shape(mb: int) -> tuple[int, int, int]:
            return (mb, seq, model_cfg.dim)

        loss_fn = loss_fns.get(self.schedule.n_stages - 1, lm_cross_entropy)
        self.runtime = PipelineRuntime(self.schedule, self.engines, pp, loss_fn, shape, dtype, device)
        self.shape, self.dtype, self.loss_fn = shape, dtype, loss_fn
        self.timeline: Timeline | None = None

    def param_groups(self) -> list[dict[str, Any]]:
        return [g for e in self.engines.values() for g in e.param_groups]

    def forward_backward(self, micro_batches: list) -> torch.Tensor:
        loss = pipeline_forward_backward(self.runtime, self.engines, [x for x, _ in micro_batches],
                                         [y for _, y in micro_batches])
        records = self.pp.all_gather_object(self.runtime.records)
        self.timeline = Timeline(records, name=f"{self.schedule.name} (measured)", n_virtual=self.schedule.n_virtual)
        return loss if loss is not None else self.pp.scalar(0.0)

    def step(self, max_norm: float | None) -> float | None:
        return step_together(list(self.engines.values()), max_norm, across=[self.pp])

    def global_loss(self, local: torch.Tensor) -> float:
        """Only the last stage has the loss: sum over pp (others add 0), mean over dp."""
        local = self.pp.scalar(local, torch.float32)
        self.pp.all_reduce(local, tag="metrics")
        self.mesh.comm("dp").all_reduce(local, tag="metrics")
        return local.item() / self.mesh.size("dp")

    def evaluate(self, data: TokenDataset) -> float:
        batches = _eval_batches(data, self.cfg, self.mesh)
        sched = forward_only(self.pp.size, len(batches), self.schedule.stage_to_rank)
        runtime = PipelineRuntime(sched, self.engines, self.pp, self.loss_fn, self.shape, self.dtype, self.device)
        loss = runtime.step([x for x, _ in batches], [y for _, y in batches])
        return self.global_loss(loss if loss is not None else self.pp.scalar(0.0))

    def model_state_bytes(self) -> int:
        return sum(model_state_bytes(e).total for e in self.engines.values())

    def timeline_files(self, run_dir: Path) -> dict[str, Any]:
        """Measured timeline of the last step: PNG + Chrome trace, and its bubble next to the formula."""
        tl, s = self.timeline, self.schedule
        formula = bubble_formula(s.name, s.n_ranks, s.n_microbatches, s.n_virtual)
        plot_timeline(tl, run_dir / "timeline.png",
                      title=f"{s.name} P={s.n_ranks} M={s.n_microbatches} V={s.n_virtual}, measured "
                            f"(formula bubble {formula:.1%})")
        to_chrome_trace(tl, run_dir / "trace.json", us_per_unit=1e6)
        return {"measured_bubble": tl.bubble_fraction, "formula_bubble": formula}
