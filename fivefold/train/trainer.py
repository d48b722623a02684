"""The training loop of one rank (`train`) and the launcher of all ranks (`run`, which validates first). A step
(docs/design.md#one-training-step): forward + backward per micro-batch (reduced during backward) -> global norm and
clipping -> AdamW with warmup + cosine LR."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.checkpoint.hf import load_hf_weights
from fivefold.checkpoint.manager import complete_checkpoints, read_checkpoint_meta
from fivefold.comm import CommLog, debug_collectives_requested, set_debug_step
from fivefold.config import Config
from fivefold.data_parallel.mixed_precision import MixedPrecision
from fivefold.formulas import bubble_formula, model_flops_per_token
from fivefold.launch import (
    Terminated,
    distributed,
    is_torchrun_env,
    launch_local,
    lost_worker_reason,
    resolve_device,
    to_device,
)
from fivefold.mesh import ParallelMesh
from fivefold.models.llama import param_counts
from fivefold.models.parallelize import parallelize
from fivefold.optim.clip import NonFiniteGradient
from fivefold.optim.lr import lr_at
from fivefold.peak import device_peak_flops
from fivefold.pipeline.runtime import SIDE_THREAD
from fivefold.trace import StepTracer, trace_window
from fivefold.train.checkpointing import (
    TrainCheckpoints,
    checkpoint_root,
    clear_run_dir,
    restart_count,
    run_dir,
    watch_sigterm,
)
from fivefold.train.data import TokenDataset
from fivefold.train.metrics import RunRecord
from fivefold.train.run_lock import RunDirLocked, RunLock
from fivefold.train.validate import RunPlan, validate
from fivefold.watchdog import Stalled, report_step, watch_comm_log

__all__ = ["TrainResult", "lr_at", "run", "train"]


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
    comm_hidden_fraction: float | None = (
        None  # run.trace: mean over ranks of the communication hidden behind compute
    )
    mfu: float | None = None  # model FLOPs per second at the median step over the devices' peak
    stopped: str | None = (
        None  # why the run stopped before train.steps with a checkpoint (SIGTERM, exit_after...)
    )


def run(cfg: Config) -> TrainResult:
    """Under torchrun: train this rank. Otherwise spawn cfg.run.nproc local CPU workers (gloo). The run directory
    is locked for the run's life (`RunLock`: under torchrun by rank 0)."""
    if is_torchrun_env():
        with distributed(resolve_device(cfg.run.device), timeout_s=cfg.run.collective_timeout_s):
            lock = _lock_on_rank0(cfg)
            try:
                return train(cfg, validate(cfg, dist.get_world_size()))
            finally:
                lock.release()
    if cfg.run.device not in ("auto", "cpu"):
        raise ValueError(
            f"run.device={cfg.run.device}: local spawning runs CPU workers; use torchrun for accelerators"
        )
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device="cpu"))
    validate(
        cfg, cfg.run.nproc
    )  # every error here, before any directory is made or any process starts
    with RunLock(*locked_dirs(cfg)):
        return _launch(
            cfg, validate(cfg, cfg.run.nproc)
        )  # (again, under the lock: what the directory holds now)


def locked_dirs(cfg: Config) -> list[Path]:
    """The directories a run writes: its run directory, and its checkpoint directory when that is elsewhere."""
    return [run_dir(cfg), checkpoint_root(cfg)] if cfg.checkpoint.dir else [run_dir(cfg)]


def _lock_on_rank0(cfg: Config) -> RunLock:
    """Rank 0 takes the run's lock; every rank raises `RunDirLocked` if it could not (collective)."""
    lock, problem = RunLock(*locked_dirs(cfg)), [None]
    if dist.get_rank() == 0:
        try:
            lock.acquire()
        except (RunDirLocked, OSError) as e:
            problem[0] = str(e)
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise RunDirLocked(problem[0])
    return lock


def _launch(cfg: Config, plan: RunPlan) -> TrainResult:
    """Spawn the workers (restarting them after a lost one, `run.max_restarts` times); the run directory is
    locked."""
    if (
        cfg.run.overwrite and plan.resume_from is None
    ):  # here, once: a restart must not find the old run's files
        clear_run_dir(cfg)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, overwrite=False))
    threads = max(1, (os.cpu_count() or 1) // cfg.run.nproc)
    first_resume = cfg.run.resume
    for attempt in range(cfg.run.max_restarts + 1):
        try:
            return launch_local(
                train,
                cfg.run.nproc,
                cfg,
                plan,
                threads=threads,
                timeout_s=cfg.run.collective_timeout_s,
                watch=(cfg.run.heartbeat_timeout_s, cfg.run.stall_timeout_s),
            )[0]
        except Terminated:  # the launcher itself was told to stop
            raise
        except (
            mp.ProcessExitedException,
            Stalled,
        ) as e:  # a worker lost (killed, crashed) or stuck: no Python error
            if attempt == cfg.run.max_restarts:
                raise
            why = lost_worker_reason(e) if isinstance(e, mp.ProcessExitedException) else str(e)
            # this run's own latest checkpoint, else where it started from (a --resume PATH), else the start
            latest = complete_checkpoints(checkpoint_root(cfg))
            resume = "latest" if latest else first_resume
            if latest and read_checkpoint_meta(latest[-1]).get("steps_done", 0) >= cfg.train.steps:
                print(
                    f"fivefold: {why} after the last checkpoint ({latest[-1]}, all {cfg.train.steps} steps); "
                    "nothing left to restart",
                    flush=True,
                )
                raise
            print(
                f"fivefold: {why}; restart {attempt + 1} of {cfg.run.max_restarts} from "
                f"{latest[-1] if latest else resume or 'the start (no checkpoint yet)'}",
                flush=True,
            )
            cfg = dataclasses.replace(
                cfg, run=dataclasses.replace(cfg.run, resume=resume, overwrite=not resume)
            )
            plan = validate(cfg, cfg.run.nproc)
    raise AssertionError("unreachable")


def train(cfg: Config, plan: RunPlan) -> TrainResult:
    """Train on this rank (torch.distributed initialised, `plan` from `validate`); returns a summary."""
    watch_sigterm()  # from the start: a SIGTERM while the model is built still stops at the first step's end
    device = resolve_device(cfg.run.device)
    if device.type != "cpu" and cfg.precision.tf32:
        torch.set_float32_matmul_precision("high")
    log = CommLog(enabled=True)
    watch_comm_log(log)  # the heartbeat names the last collective
    mesh = ParallelMesh(
        plan.dims,
        device,
        log,
        debug_collectives=debug_collectives_requested(cfg.debug.collectives),
        collective_timeout_s=cfg.run.collective_timeout_s,
    )
    t = cfg.train = dataclasses.replace(
        cfg.train,
        global_batch=plan.global_batch,
        micro_batch=plan.micro_batch,
        grad_accum=plan.grad_accum,
    )
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    data = TokenDataset.from_path(
        cfg.data.path,
        t.seq_len,
        val_fraction=cfg.data.val_fraction,
        seed=t.seed,
        max_bytes=cfg.data.max_bytes,
    )
    model_cfg = plan.model_for(
        int(max(data.train_tokens.max(), data.val_tokens.max() if len(data.val_tokens) else 0))
    )
    n_params, active = param_counts(model_cfg)
    # MFU (docs/design.md#flops-and-mfu): model FLOPs per token, PaLM's 6·N + 12·n_layers·L·D, against every rank's
    # device peak
    flops_per_token = model_flops_per_token(active, model_cfg.n_layers, t.seq_len, model_cfg.dim)
    peak = (
        device_peak_flops(
            device, MixedPrecision.from_names(cfg.precision.param).param_dtype, cfg.run.peak_tflops
        )
        * dist.get_world_size()
    )
    parts = parallelize(cfg, model_cfg, mesh, device)
    is_main = dist.get_rank() == 0
    checkpoints = TrainCheckpoints(cfg, mesh, parts, model_cfg, device)
    start = 0
    if plan.resume_from is not None:
        start = checkpoints.restore(plan.resume_from)
    else:
        if cfg.model.init_from:  # Hugging Face weights, each rank reading its own rectangles
            load_hf_weights(cfg.model.init_from, parts.engines.values(), mesh.comm("tp"))
        if (
            cfg.run.overwrite and is_main and restart_count() == 0
        ):  # under torchrun (the launcher did it above)
            clear_run_dir(cfg)
    dist.barrier()
    record = RunRecord(
        Path(cfg.run.out_dir) / cfg.run.name if is_main else None,
        t.steps,
        cfg.run.progress,
        cfg.run.name,
        resume_at=start if plan.resume_from is not None else None,
    )
    record.write(
        {
            "kind": "config",
            **cfg.to_dict(),
            "model_config": dataclasses.asdict(model_cfg),
            "params": n_params,
            "world": dist.get_world_size(),
            "dp": dp,
            "resumed_from": str(plan.resume_from) if plan.resume_from else None,
            "start_step": start,
        }
    )
    for note in plan.notes:
        record.say(f"fivefold: note: {note}")
    if plan.resume_from is not None:
        record.say(f"fivefold: resumed from {plan.resume_from} after {start} steps")
    record.say(
        f"fivefold: {cfg.model.preset} model, {n_params / 1e6:.2f}M params, {_layout(cfg, mesh, parts)}, "
        f"global batch {t.global_batch} × {t.seq_len} tokens (micro {t.micro_batch} × accum {t.grad_accum}), "
        f"{data}"
    )
    eval_batches = data.val_batches(
        max(dp, t.eval_batches - t.eval_batches % dp), t.micro_batch, dp_rank=dp_rank, dp_size=dp
    )
    tokens_per_step = t.global_batch * t.seq_len
    # No host sync on a step that is not logged: loss and norm stay on the device until a log step fetches them
    # (the one wait per log interval), so the host queues the next step while the device runs this one.
    losses, intervals, val_loss, state_mb = [], [], None, 0.0
    since, since_step = time.perf_counter(), start
    stopped = None
    tracer = make_tracer(cfg, parts, log, mesh, device)
    traced = (
        trace_window(start, t.steps, cfg.run.trace_steps, cfg.run.exit_after)
        if tracer
        else range(0)
    )
    for step in range(start, t.steps):
        log.reset()
        if step in traced:
            tracer.begin_step(step)
        set_debug_step(step)
        for group in parts.param_groups():
            group["lr"] = lr_at(step, cfg)
        batches = [
            data.micro_batch(step, t.global_batch, micro, t.grad_accum, dp_rank, dp)
            for micro in range(t.grad_accum)
        ]
        loss_sum = parts.forward_backward(
            [(to_device(x, device), to_device(y, device)) for x, y in batches]
        )
        if step == min(start + 1, t.steps - 1) or (
            step == start and start > 0
        ):  # optimizer state allocated
            state_mb = parts.model_state_bytes() / 2**20
        try:
            grad_norm = parts.step(t.grad_clip if t.grad_clip > 0 else None, t.check_finite)
        except NonFiniteGradient as e:
            checkpoints.close()  # a background save of a good step still completes
            record.write(
                {"kind": "error", "step": step, "error": "non-finite gradient", "message": str(e)}
            )
            record.abort()
            raise NonFiniteGradient(f"step {step + 1}: {e}") from None
        # the step's data-parallel traffic (gradients over dp or dp_cp, HSDP: dp_shard and dp_replicate, hpZ's backward
        # gathers: dp_hpz; MoE: experts over ep_dp, all-to-alls over ep), read before the metrics' own collectives
        traffic = log.totals(
            dims=(parts.loss_comm.dim, "ep", "ep_dp", "dp_shard", "dp_replicate", "dp_hpz")
        )
        loss = parts.global_loss(loss_sum)
        if step % cfg.run.log_every == 0 or step == t.steps - 1:
            losses.append(loss.item())  # waits for this step
            now = time.perf_counter()
            intervals.append(
                dt := (now - since) / (step + 1 - since_step)
            )  # seconds per step since the last log
            since, since_step = now, step + 1
            record.write(
                {
                    "kind": "train",
                    "step": step,
                    "loss": losses[-1],
                    "lr": lr_at(step, cfg),
                    "grad_norm": None if grad_norm is None else grad_norm.item(),
                    "step_time_s": dt,
                    "tokens_per_s": tokens_per_step / dt,
                    "model_state_mb": state_mb,
                    "flops_per_token": flops_per_token,
                    "achieved_tflops_per_device": tokens_per_step
                    * flops_per_token
                    / dt
                    / dist.get_world_size()
                    / 1e12,
                    "mfu": tokens_per_step * flops_per_token / dt / peak,
                    "comm_calls": traffic.calls,
                    "comm_payload_bytes": traffic.payload_bytes,
                    "comm_wire_bytes": traffic.wire_bytes,
                }
            )
            moe = parts.moe_load()  # expert load of the step's last micro-batch (MoE models)
            if moe is not None:
                record.write({"kind": "moe", "step": step, "layers": moe})
            record.progress.update(
                step + 1 - record.progress.done,
                loss=f"{losses[-1]:.3f}",
                tok_s=f"{tokens_per_step / dt:,.0f}",
                step_ms=f"{dt * 1e3:.0f}",
                mfu=f"{tokens_per_step * flops_per_token / dt / peak:.1%}",
                state_MB=f"{state_mb:.1f}",
            )
        if step in traced:  # (before evaluation and checkpoints: the trace holds training steps)
            tracer.end_step(parts.action_marks())
        if t.eval_every > 0 and (step % t.eval_every == t.eval_every - 1 or step == t.steps - 1):
            val_loss = parts.evaluate(eval_batches)
            record.write({"kind": "val", "step": step, "val_loss": val_loss})
            record.say(f"step {step + 1}: val loss {val_loss:.3f}")
            since, since_step = time.perf_counter(), step + 1  # evaluation is not training time
        report_step(step + 1)
        reason = checkpoints.due(step + 1, step + 1 - start)
        if reason is not None:
            waited = checkpoints.save(step + 1, reason)
            for (
                warning
            ) in checkpoints.warnings:  # checkpoint.on_error=warn: a failed save, said once
                record.write(
                    {
                        "kind": "error",
                        "step": step,
                        "error": "checkpoint not saved",
                        "message": warning,
                    }
                )
                record.say(warning)
            checkpoints.warnings.clear()
            if waited is None:
                continue
            record.write(
                {
                    "kind": "checkpoint",
                    "step": step,
                    "steps_done": step + 1,
                    "reason": reason,
                    "seconds": waited,
                    "async": cfg.checkpoint.async_save,
                }
            )
            since += waited  # saving is not training time
            if reason in ("SIGTERM", "SIGINT", "exit_after"):
                stopped = reason
                record.say(
                    f"fivefold: {reason}: stopped after {step + 1} of {t.steps} steps with a checkpoint in "
                    f"{checkpoint_root(cfg)}; continue with --resume"
                )
                break
    checkpoints.close()  # a background save finishes
    for warning in checkpoints.warnings:
        record.say(warning)
    steady = sorted(intervals[1:] or intervals) or [
        float("nan")
    ]  # (a run stopped before its first log step)
    losses = losses or [float("nan")]
    result = TrainResult(
        step + 1 if stopped else t.steps,
        losses[0],
        losses[-1],
        val_loss,
        n_params,
        tokens_per_step / steady[len(steady) // 2],
        str(record.run_dir) if record.run_dir else None,
        state_mb,
        mfu=tokens_per_step * flops_per_token / steady[len(steady) // 2] / peak,
        stopped=stopped,
    )
    parts.gather_timeline()  # the pipeline's measured timings, gathered once
    if parts.timeline is not None:
        s = parts.schedule
        try:
            formula = bubble_formula(s.name, s.n_ranks, s.n_microbatches, s.n_virtual)
        except ValueError:  # a schedule without a textbook formula: the measured bubble alone
            formula = None
        record.pipeline(
            parts.timeline,
            formula,
            f"{s.name} P={s.n_ranks} M={s.n_microbatches} V={s.n_virtual}",
            chrome_trace=tracer is None,
        )  # with run.trace, trace.json is the step trace (actions in it)
    if tracer is not None:  # every rank's traced steps, gathered once on rank 0
        tracer.close()
        traces = mesh.world.gather_object(tracer.result())
        figures = record.trace(traces, f"{cfg.model.preset}, {_layout(cfg, mesh, parts)}")
        if figures is not None:
            result.comm_hidden_fraction = figures["comm_hidden_fraction"]
    record.close(
        dataclasses.asdict(result),
        f"{cfg.model.preset} ({n_params / 1e6:.1f}M params), dp={dp}" if cfg.run.plot else None,
    )
    return result


def make_tracer(
    cfg: Config, parts: object, log: CommLog, mesh: ParallelMesh, device: torch.device
) -> StepTracer | None:
    """With ``run.trace``, a `StepTracer` on this rank's embedding, blocks, norm and head (hooks installed now, idle
    outside the traced steps); otherwise None: no hook, and the log never times a collective."""
    if not cfg.run.trace:
        return None
    coords = {d: mesh.rank(d) for d in ("pp", "dp", "cp", "tp") if mesh.size(d) > 1}
    return StepTracer(
        parts.traced_modules(),
        log,
        device,
        rank=dist.get_rank(),
        coords=coords,
        side_threads=(SIDE_THREAD,),
    )


def _layout(cfg: Config, mesh: ParallelMesh, parts: object = None) -> str:
    pp = mesh.size("pp")
    cp = mesh.size("cp")
    units = getattr(parts, "schedule", None) is not None and any(parts.schedule.side_by_side)
    hsdp = mesh.size("dp_replicate")
    z = cfg.zero
    zeropp = "".join(
        f"+{name}"
        for name, on in (("qwZ", z.qwz), ("qgZ", z.qgz), (f"hpZ({z.hpz})", z.hpz > 1))
        if on
    )
    return (
        f"pp={pp} dp={mesh.size('dp')} ZeRO-{cfg.zero.stage}{zeropp} tp={mesh.size('tp')}"
        + (f" HSDP {hsdp} replicas × {mesh.size('dp_shard')} shards" if hsdp > 1 else "")
        + (" +SP" if cfg.parallel.sp else "")
        + (f" cp={cp} {cfg.parallel.cp_layout}" if cp > 1 else "")
        + (f" ep={mesh.size('ep')}" if mesh.size("ep") > 1 else "")
        + (f" {cfg.pipeline.schedule}" if pp > 1 else "")
        + (
            (
                f" ({parts.overlap_reason})"
                if parts.overlap
                else f" (F&B one after the other: {parts.overlap_reason})"
            )
            if units
            else ""
        )
        + (f" recompute {cfg.train.recompute}" if cfg.train.recompute != "none" else "")
        + f" ({cfg.precision.param} params, {cfg.precision.reduce} reduce)"
    )
