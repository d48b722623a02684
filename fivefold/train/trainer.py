"""The training loop of one rank, and the launcher that starts all ranks.

One step (DESIGN.md data flow): for each of `grad_accum` micro-batches of this DP rank's slice
of the global batch, forward + backward (the DDP wrapper all-reduces buckets during the last
micro-step's backward only) -> clip by the global gradient norm -> AdamW step with warmup +
cosine LR -> zero the flat gradient buckets. Rank 0 logs loss, tokens/s, step time and the
measured model-state bytes per rank, evaluates periodically, and plots the loss at the end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fivefold.comm import CommLog
from fivefold.config import Config, resolve_batch
from fivefold.mesh import ParallelDims, ParallelMesh, default_device, init_distributed, is_torchrun_env, launch_local
from fivefold.models import count_params, get_config
from fivefold.models.llama import Llama
from fivefold.pipeline.builders import build_schedule
from fivefold.report import plot_loss
from fivefold.train.data import TokenDataset
from fivefold.train.metrics import MetricsWriter, Progress, read_metrics
from fivefold.train.model_parts import PipelinedModel, WholeModel


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to train.lr, then cosine decay to lr × min_lr_ratio at the last step."""
    t = cfg.train
    if t.warmup_steps > 0 and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    min_lr = t.lr * t.min_lr_ratio
    return min_lr + 0.5 * (t.lr - min_lr) * (1 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    steps: int
    first_loss: float
    final_loss: float
    final_val_loss: float | None
    params: int
    tokens_per_s: float
    run_dir: str | None
    model_state_mb: float


def _dims(cfg: Config) -> ParallelDims:
    p = cfg.parallel
    if p.zero not in (0, 1, 2, 3):
        raise ValueError(f"parallel.zero={p.zero}: choose a ZeRO stage 0 (DDP), 1, 2 or 3 (FSDP)")
    return ParallelDims(pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp)


def _resolve_device(name: str) -> torch.device:
    return default_device() if name == "auto" else torch.device(name)


def _check_supported(cfg: Config, dims: ParallelDims) -> None:
    if dims.cp != 1:
        raise NotImplementedError(f"parallel.cp={dims.cp}: context parallelism is not implemented yet; set "
                                  "parallel.cp=1")
    if cfg.ddp.inflight_buckets < 1:
        raise ValueError(f"ddp.inflight_buckets={cfg.ddp.inflight_buckets}: at least one reduce-scatter must be "
                         "allowed in flight; use 1 (least memory) or more (more overlap)")
    if cfg.parallel.sp and cfg.train.seq_len % dims.tp:
        raise ValueError(f"sequence parallel splits the sequence over tp: train.seq_len={cfg.train.seq_len} is not "
                         f"divisible by tp={dims.tp}; use a multiple of {dims.tp}")


def train(cfg: Config) -> TrainResult:
    """Train on this rank (torch.distributed already initialised); returns a summary."""
    device = _resolve_device(cfg.run.device)
    log = CommLog(enabled=True)
    mesh = ParallelMesh(_dims(cfg), device, log)
    _check_supported(cfg, mesh.dims)
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    t = cfg.train
    global_batch, micro_batch, grad_accum = resolve_batch(t.global_batch, t.micro_batch, t.grad_accum, dp)
    t = cfg.train = dataclasses.replace(t, global_batch=global_batch, micro_batch=micro_batch, grad_accum=grad_accum)
    is_main = dist.get_rank() == 0

    data = TokenDataset.from_path(cfg.data.path, t.seq_len, val_fraction=cfg.data.val_fraction, seed=t.seed,
                                  max_bytes=cfg.data.max_bytes)
    overrides = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k != "preset" and v is not None}
    max_token = int(max(data.train_tokens.max(), data.val_tokens.max() if len(data.val_tokens) else 0))
    model_cfg = get_config(cfg.model.preset, **overrides)
    if max_token >= model_cfg.vocab_size:
        # Pre-tokenized data with a larger vocabulary (e.g. GPT-2's): round up to a multiple of 64.
        model_cfg = get_config(cfg.model.preset, **overrides, vocab_size=-(-(max_token + 1) // 64) * 64)
    if t.seq_len > model_cfg.max_seq_len:
        model_cfg = get_config(cfg.model.preset, **{**overrides, "vocab_size": model_cfg.vocab_size},
                               max_seq_len=t.seq_len)
    n_params = count_params(Llama(model_cfg, device="meta"))
    parts = (PipelinedModel if mesh.size("pp") > 1 else WholeModel)(cfg, model_cfg, mesh, device)
    tp_comm = mesh.comm("tp")

    run_dir = Path(cfg.run.out_dir) / cfg.run.name if is_main else None
    writer = MetricsWriter(run_dir)
    if is_main:
        writer.write({"kind": "config", **cfg.to_dict(), "model_config": dataclasses.asdict(model_cfg),
                      "params": n_params, "world": dist.get_world_size(), "dp": dp})
    progress = Progress(t.steps, enabled=is_main and cfg.run.progress, desc=cfg.run.name)
    progress.write(f"fivefold: {cfg.model.preset} model, {n_params / 1e6:.2f}M params, "
                   f"pp={mesh.size('pp')} dp={dp} ZeRO-{cfg.parallel.zero} tp={tp_comm.size}"
                   f"{' +SP' if cfg.parallel.sp else ''}"
                   + (f" {cfg.pipeline.schedule}" if mesh.size("pp") > 1 else "") + " "
                   f"({cfg.precision.param} params, {cfg.precision.reduce} reduce), "
                   f"global batch {global_batch} × {t.seq_len} tokens (micro {micro_batch} × accum {grad_accum}), "
                   f"{data}")

    first_loss = final_loss = float("nan")
    val_loss = None
    tokens_per_step = global_batch * t.seq_len
    step_times: list[float] = []
    state_mb = 0.0
    for step in range(t.steps):
        t0 = time.perf_counter()
        log.reset()
        for group in parts.param_groups():
            group["lr"] = lr_at(step, cfg)
        micro_batches = [data.micro_batch(step, global_batch, micro, grad_accum, dp_rank, dp)
                         for micro in range(grad_accum)]
        loss_sum = parts.forward_backward(micro_batches)
        if step == min(1, t.steps - 1):  # gradients present, optimizer state allocated (after step 0)
            state_mb = parts.model_state_bytes() / 2**20
        grad_norm = parts.step(t.grad_clip if t.grad_clip > 0 else None)
        grad_bytes_comm = log.totals(dim="dp")
        step_loss = parts.global_loss(loss_sum)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        if step == 0:
            first_loss = step_loss
        final_loss = step_loss
        if is_main and (step % cfg.run.log_every == 0 or step == t.steps - 1):
            writer.write({"kind": "train", "step": step, "loss": step_loss, "lr": lr_at(step, cfg),
                          "grad_norm": grad_norm, "step_time_s": dt, "tokens_per_s": tokens_per_step / dt,
                          "model_state_mb": state_mb, "comm_calls": grad_bytes_comm.calls,
                          "comm_payload_bytes": grad_bytes_comm.payload_bytes,
                          "comm_wire_bytes": grad_bytes_comm.wire_bytes})
        if t.eval_every > 0 and (step % t.eval_every == t.eval_every - 1 or step == t.steps - 1):
            val_loss = parts.evaluate(data)
            if is_main:
                writer.write({"kind": "val", "step": step, "val_loss": val_loss})
                progress.write(f"step {step + 1}: val loss {val_loss:.3f}")
        progress.update(1, loss=f"{step_loss:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}",
                        step_ms=f"{dt * 1e3:.0f}", state_MB=f"{state_mb:.1f}")
    progress.close()
    steady = sorted(step_times[1:] or step_times)
    median = steady[len(steady) // 2]
    result = TrainResult(t.steps, first_loss, final_loss, val_loss, n_params, tokens_per_step / median,
                         str(run_dir) if run_dir else None, state_mb)
    if is_main:
        writer.write({"kind": "summary", **dataclasses.asdict(result)})
        writer.close()
        if parts.timeline is not None:
            bubble = parts.timeline_files(run_dir)
            writer_extra = {"kind": "pipeline", **bubble}
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(writer_extra) + "\n")
            print(f"fivefold: last step's pipeline timeline: measured bubble {bubble['measured_bubble']:.1%} "
                  f"(formula {bubble['formula_bubble']:.1%}); wrote {run_dir / 'timeline.png'} and "
                  f"{run_dir / 'trace.json'}")
        if cfg.run.plot:
            png = plot_loss(read_metrics(run_dir / "metrics.jsonl"), run_dir / "loss.png",
                            title=f"{cfg.model.preset} ({n_params / 1e6:.1f}M params), dp={dp}")
            print(f"fivefold: loss {first_loss:.3f} -> {final_loss:.3f}"
                  + (f" (val {val_loss:.3f})" if val_loss is not None else "")
                  + f", {tokens_per_step / median:,.0f} tokens/s; wrote {run_dir / 'metrics.jsonl'} and {png}")
    return result


def run(cfg: Config) -> TrainResult:
    """Under torchrun: train this rank. Otherwise spawn cfg.run.nproc local CPU workers (gloo)."""
    if is_torchrun_env():
        init_distributed()
        try:
            return train(cfg)
        finally:
            dist.destroy_process_group()
    if cfg.run.device not in ("auto", "cpu"):
        raise ValueError(f"run.device={cfg.run.device}: local spawning runs CPU workers; use torchrun for "
                         f"accelerators")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device="cpu"))
    # Validate what can be checked before spawning, so errors are immediate and in this process.
    dims = _dims(cfg).resolve(cfg.run.nproc)
    _, _, grad_accum = resolve_batch(cfg.train.global_batch, cfg.train.micro_batch, cfg.train.grad_accum, dims.dp)
    _check_supported(cfg, dims)
    if dims.pp > 1:  # the schedule checks M against P (and V): say so before any process starts
        build_schedule(cfg.pipeline.schedule, dims.pp, grad_accum, cfg.pipeline.virtual)
    threads = max(1, (os.cpu_count() or 1) // cfg.run.nproc)
    return launch_local(train, cfg.run.nproc, cfg, threads=threads, timeout_s=1800.0)[0]
