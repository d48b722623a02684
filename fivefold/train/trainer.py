"""The training of one rank (`Trainer`, `train`) and the launcher of all ranks (`run`, which
validates first). A step (docs/design.md#one-training-step): forward + backward per micro-batch
(reduced during backward) -> global norm and clipping -> AdamW with warmup + cosine LR; then the
observers (`metrics.TrainObserver`) see its `StepResult`."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fivefold.checkpoint.hf import load_hf_weights
from fivefold.checkpoint.manager import complete_checkpoints, read_checkpoint_meta
from fivefold.config import Config, ConfigError
from fivefold.data_parallel.mixed_precision import MixedPrecision
from fivefold.distributed.comm import (
    CommLog,
    CommTotals,
    debug_collectives_requested,
    set_debug_step,
)
from fivefold.distributed.launch import (
    Terminated,
    distributed,
    is_torchrun_env,
    launch_local,
    lost_worker_reason,
    resolve_device,
    to_device,
)
from fivefold.distributed.mesh import ParallelMesh
from fivefold.distributed.watchdog import Stalled, report_step, watch_comm_log
from fivefold.fault_tolerance.replicas import replicas_for
from fivefold.formulas import model_flops_per_token
from fivefold.models.llama import param_counts
from fivefold.models.parallel_model import Batch, ParallelModel
from fivefold.models.parallelize import parallelize
from fivefold.observe.peak import device_peak_flops
from fivefold.observe.trace import StepTracer, trace_window
from fivefold.optim.clip import NonFiniteGradient
from fivefold.optim.lr import lr_at
from fivefold.paths import one_component
from fivefold.pipeline.runtime import SIDE_THREAD
from fivefold.run_plan import RunPlan
from fivefold.train import layout_auto
from fivefold.train.checkpointing import (
    CheckpointSaver,
    TrainCheckpoints,
    checkpoint_root,
    clear_run_dir,
    restart_count,
    run_dir,
    watch_sigterm,
)
from fivefold.train.data_source import open_dataset
from fivefold.train.metrics import (
    EvalResult,
    MoELoad,
    PipelineTimelineLog,
    RunInfo,
    RunRecord,
    RunRecordLog,
    RunSummary,
    StepResult,
    StepTraceLog,
    Throughput,
    TrainingClock,
    TrainObserver,
    TrainResult,
)
from fivefold.train.profiling import MemorySnapshotLog, ProfileLog, flight_recorder_for
from fivefold.train.run_lock import RunDirLocked, RunLock
from fivefold.train.sinks import SinkLog
from fivefold.train.validate import validate

if TYPE_CHECKING:
    from fivefold.models.documents import Documents

__all__ = ["Evaluator", "Heartbeat", "TrainResult", "Trainer", "lr_at", "run", "train"]


def run(cfg: Config, given: Collection[str] | None = None) -> TrainResult:
    """Under torchrun: train this rank. Otherwise spawn cfg.run.nproc local CPU workers (gloo). The
    run directory is locked for the run's life (`RunLock`: under torchrun by rank 0). With
    ``parallel.layout = "auto"`` the planner chooses the layout first (`layout_auto`), holding the
    searched keys among ``given`` (the keys the command line and --config set; None: those that
    differ from the defaults)."""
    if cfg.ft.replica_groups > 1 and cfg.ft.group < 0 and not is_torchrun_env():
        from fivefold.fault_tolerance.launch import run_groups

        return run_groups(cfg, given)  # the groups, each back here as its own job
    if is_torchrun_env():
        one_component(cfg.run.name, "run.name")  # before the lock and the recorder make anything
        with distributed(
            resolve_device(cfg.run.device),
            timeout_s=cfg.run.collective_timeout_s,
            flight_recorder=flight_recorder_for(cfg),
        ) as device:
            world, local = dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            cfg, chosen = layout_auto.resolve_on_rank0(cfg, world, local, device.type, given)
            lock = _lock_on_rank0(cfg)
            try:
                plan = validate(cfg, world)
                _check_replica_group(cfg, plan)
                return train(cfg, layout_auto.with_choice(plan, cfg, chosen))
            finally:
                lock.release()
    if cfg.run.device not in ("auto", "cpu"):
        raise ValueError(
            f"run.device={cfg.run.device}: local spawning runs CPU workers; use torchrun for "
            "accelerators"
        )
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device="cpu"))
    cfg, chosen = layout_auto.resolve(cfg, cfg.run.nproc, cfg.run.nproc, "cpu", given)
    _check_replica_group(  # every error here, before any directory is made or process starts
        cfg, validate(cfg, cfg.run.nproc)
    )
    with RunLock(*locked_dirs(cfg)):
        return _launch(
            cfg, layout_auto.with_choice(validate(cfg, cfg.run.nproc), cfg, chosen)
        )  # (again, under the lock: what the directory holds now)


def _check_replica_group(cfg: Config, plan: RunPlan) -> None:
    """One replica group of an ft job, its own job (under torchrun, or the local launcher on one
    of several machines): ft's checks on it."""
    if cfg.ft.replica_groups <= 1:
        return
    from fivefold.fault_tolerance.launch import (
        check_group,
        check_group_plan,
        check_group_reachable,
    )

    if not 0 <= cfg.ft.group < cfg.ft.replica_groups or not cfg.ft.lighthouse:
        raise ConfigError(
            f"ft.replica_groups={cfg.ft.replica_groups} with one group per job: give each "
            f"--ft.group 0..{cfg.ft.replica_groups - 1} and --ft.lighthouse http://host:port"
        )
    check_group(cfg)
    check_group_reachable(cfg, is_torchrun_env())
    check_group_plan(cfg, plan)


def locked_dirs(cfg: Config) -> list[Path]:
    """The directories a run writes: its run directory, and its checkpoint directory when that is
    elsewhere."""
    return [run_dir(cfg), checkpoint_root(cfg)] if cfg.checkpoint.dir else [run_dir(cfg)]


def _lock_on_rank0(cfg: Config) -> RunLock:
    """Rank 0 takes the run's lock; every rank raises `RunDirLocked` if it could not
    (collective)."""
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


def _usable_cores() -> int:
    """The cores this process may run on (a replica group's share of the host, see
    fault_tolerance/launch.py), else the host's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _launch(cfg: Config, plan: RunPlan) -> TrainResult:
    """Spawn the workers (restarting them after a lost one, `run.max_restarts` times); the run
    directory is locked."""
    if (
        cfg.run.overwrite and plan.resume_from is None
    ):  # here, once: a restart must not find the old run's files
        clear_run_dir(cfg)
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, overwrite=False))
    threads = max(1, _usable_cores() // cfg.run.nproc)
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
                flight_recorder=flight_recorder_for(cfg),
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
            if cfg.ft.group >= 0:  # one of an ft job's groups, side by side with the others
                why = f"replica group {cfg.ft.group}: {why}"
            # this run's own latest checkpoint, else where it started from (a --resume PATH), else
            # the start
            latest = complete_checkpoints(checkpoint_root(cfg))
            resume = "latest" if latest else first_resume
            if latest and read_checkpoint_meta(latest[-1]).get("steps_done", 0) >= cfg.train.steps:
                print(
                    f"fivefold: {why} after the last checkpoint ({latest[-1]}, all "
                    f"{cfg.train.steps} steps); nothing left to restart",
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
            plan = layout_auto.with_choice(validate(cfg, cfg.run.nproc), cfg, plan.layout_auto)
    raise AssertionError("unreachable")


def train(cfg: Config, plan: RunPlan) -> TrainResult:
    """Train on this rank (torch.distributed initialised, `plan` from `validate`); returns a
    summary."""
    return Trainer(cfg, plan).run()


class Trainer:
    """One rank's training run. It owns the mesh and its `CommLog`, the data, this rank's
    `ParallelModel`, the checkpoints, the `TrainingClock` and the observers, which see the run at
    fixed points (`metrics.TrainObserver`), in this order: the MoE load read once per step
    (`MoELoad`), the run record (`RunRecordLog`), rank 0's metric sinks (`sinks.SinkLog`, with
    ``logging.sinks``), the summary (`RunSummary`), the step trace (`StepTraceLog`, with
    ``run.trace``), the pipeline timeline (`PipelineTimelineLog`), the profiler and allocator
    history (`ProfileLog`, `MemorySnapshotLog`, with ``run.profile`` / ``run.memory_snapshot``),
    the `Evaluator`, the watchdog's `Heartbeat` and the `CheckpointSaver`. Building it builds the
    model and restores a checkpoint (collective); `run` trains, one `train_step` per step; an
    exception in a step is every observer's ``on_run_abort``, then raised."""

    def __init__(self, cfg: Config, plan: RunPlan) -> None:
        # from the start: a SIGTERM while the model is built still stops at the first step's end
        watch_sigterm()
        self.cfg, self.plan = cfg, plan
        if (recorder := flight_recorder_for(cfg)) is not None:
            recorder.make_directory()  # validated: where torch's dump on a timeout writes
        self.device = device = resolve_device(cfg.run.device)
        if device.type != "cpu" and cfg.precision.tf32:
            torch.set_float32_matmul_precision("high")
        self.log = CommLog(enabled=True)
        watch_comm_log(self.log)  # the heartbeat names the last collective
        self.mesh = mesh = ParallelMesh(
            plan.dims,
            device,
            self.log,
            debug_collectives=debug_collectives_requested(cfg.debug.collectives),
            collective_timeout_s=cfg.run.collective_timeout_s,
        )
        t = cfg.train = dataclasses.replace(
            cfg.train,
            global_batch=plan.global_batch,
            micro_batch=plan.micro_batch,
            grad_accum=plan.grad_accum,
        )
        self.dp, self.dp_rank = mesh.size("dp"), mesh.rank("dp")
        # ft: the other replica groups (`fault_tolerance.replicas`); the training rows split over
        # every group's dp ranks
        self.replicas = replicas_for(cfg, device, self.log)
        self.data_dp, self.data_rank, self.data_batch = self.replicas.data_share(
            self.dp, self.dp_rank, t.global_batch
        )
        self.data = open_dataset(cfg, plan.data)
        self.model_cfg = plan.model  # its vocabulary the tokenizer's (`validate`)
        self.n_params, active = param_counts(self.model_cfg)
        self.throughput = self._throughput(active)
        masked = plan.data.documents == "mask"
        self.model: ParallelModel = parallelize(
            cfg,
            self.model_cfg,
            self.replicas.wrap_mesh(mesh),
            device,
            plan.data.eos_id if masked else None,
        )
        self.replicas.attach(self.model.engines.values())
        self.checkpoints = TrainCheckpoints(
            cfg, mesh, self.model, self.model_cfg, device, plan.data.tokenizer, plan.layout_auto
        )
        self.start = self._restore_or_start()
        self.replicas.set_start(self.start)
        dist.barrier()
        self.record = RunRecord(
            Path(cfg.run.out_dir) / cfg.run.name if dist.get_rank() == 0 else None,
            t.steps,
            cfg.run.progress,
            cfg.run.name,
            resume_at=self.start if plan.resume_from is not None else None,
        )
        self.model_state_mb = 0.0
        self.clock = TrainingClock(self.start)
        self.summary = RunSummary()
        self.checkpoint_saver = CheckpointSaver(
            self.checkpoints, self.record, self.clock, self.start
        )
        self.observers: list[TrainObserver] = self._observers()

    def _data_line(self) -> str:
        """The data as the start-up says it: the dataset, its tokenizer and where that came from,
        how documents meet."""
        d = self.plan.data
        documents = (
            "attention within documents" if d.documents == "mask" else "attention across documents"
        ) + ("" if d.loss_across_documents else ", no loss across a boundary")
        return f"{self.data}, tokenizer {d.tokenizer.describe()} ({d.tokenizer_from}), {documents}"

    def _throughput(self, active_params: int) -> Throughput:
        """MFU's terms (docs/design.md#flops-and-mfu): model FLOPs per token, 6·N +
        6·n_layers·L·D (causal attention's half), against every rank's device peak."""
        cfg, m, world = self.cfg, self.model_cfg, dist.get_world_size()
        param_dtype = MixedPrecision.from_names(cfg.precision.param).param_dtype
        peak = device_peak_flops(self.device, param_dtype, cfg.run.peak_tflops)
        self.peak_note = (  # said at start-up; the run goes on without MFU
            None
            if peak is not None
            else f"MFU n/a: no known peak FLOP/s for this {self.device.type} device; set "
            "run.peak_tflops to its dense TFLOP/s in the compute dtype (the data sheet's)"
        )
        return Throughput(
            cfg.train.global_batch * cfg.train.seq_len,
            model_flops_per_token(
                active_params, m.n_layers, cfg.train.seq_len, m.n_heads * m.head_dim
            ),
            None if peak is None else peak * world,
            world,
        )

    def _restore_or_start(self) -> int:
        """The steps done: a resume's checkpoint loaded, or a new run's weights (Hugging Face's with
        ``model.init_from``, each rank reading its own rectangles) and, with ``run.overwrite`` under
        torchrun, the old run's files removed (a local launcher did it before spawning)."""
        cfg, plan = self.cfg, self.plan
        if plan.resume_from is not None:
            return self.checkpoints.restore(plan.resume_from)
        if cfg.model.init_from:
            load_hf_weights(cfg.model.init_from, self.model.engines.values(), self.mesh.comm("tp"))
        if cfg.run.overwrite and dist.get_rank() == 0 and restart_count() == 0:
            clear_run_dir(cfg)
        return 0

    def _observers(self) -> list[TrainObserver]:
        cfg, t, model, record = self.cfg, self.cfg.train, self.model, self.record
        dp = self.dp
        plot_title = (
            f"{cfg.model.preset} ({self.n_params / 1e6:.1f}M params), dp={dp}"
            if cfg.run.plot
            else None
        )
        moe = MoELoad(model)
        observers: list[TrainObserver] = [
            moe,
            RunRecordLog(record, moe, self.throughput, plot_title),
        ]
        if record.run_dir is not None and cfg.logging.sink_names():  # rank 0
            observers.append(SinkLog(record.run_dir, self.throughput, moe, record.say))
        observers.append(self.summary)
        n_eval = max(dp, t.eval_batches - t.eval_batches % dp)
        eval_batches = self.data.val_batches(
            n_eval, t.micro_batch, dp_rank=self.dp_rank, dp_size=dp
        )
        tracer = make_tracer(cfg, model, self.log, self.mesh, self.device)
        if tracer is not None:
            window = trace_window(self.start, t.steps, cfg.run.trace_steps, cfg.run.exit_after)
            title = f"{cfg.model.preset}, {model.describe_layout()}"
            observers.append(StepTraceLog(tracer, window, model, self.mesh.world, record, title))
        # with run.trace, trace.json is the step trace (the pipeline's actions in it)
        observers.append(PipelineTimelineLog(model, record, chrome_trace=tracer is None))
        observers += self._profilers()
        if t.eval_every > 0:
            observers.append(
                Evaluator(
                    model,
                    eval_batches,
                    t.eval_every,
                    t.steps,
                    self.clock,
                    self._announce_eval,
                    self.data.val_loss_weight(n_eval, t.micro_batch),
                )
            )
        observers += [Heartbeat(), self.checkpoint_saver]
        return observers

    def _profilers(self) -> list[TrainObserver]:
        """``run.profile``'s `ProfileLog` and ``run.memory_snapshot``'s `MemorySnapshotLog` (CUDA;
        over the profiled steps when both are on)."""
        cfg, rank = self.cfg, dist.get_rank()
        profile = ProfileLog.for_run(cfg, self.start, rank, self.device, self.record)
        observers: list[TrainObserver] = [profile] if profile is not None else []
        if cfg.run.memory_snapshot and self.device.type == "cuda":
            window = profile.profiler.window if profile is not None else None
            observers.append(MemorySnapshotLog(run_dir(cfg), rank, self.record, window))
        return observers

    def run(self) -> TrainResult:
        """Train from `start` to ``train.steps`` (or a stop's checkpoint); returns the summary."""
        info = RunInfo(
            self.cfg,
            self.model_cfg,
            self.n_params,
            dist.get_world_size(),
            self.dp,
            self.start,
            self.plan.resume_from,
            (*self.plan.notes, *([self.peak_note] if self.peak_note else [])),
            self.model.describe_layout(),
            self._data_line(),
        )
        for observer in self.observers:
            observer.on_run_start(info)
        self.clock.restart(self.start)
        steps = self.cfg.train.steps
        step = self.start
        try:
            while step < steps:
                try:
                    # ft: the quorum, maybe healing this group to the live groups' step
                    step = self.replicas.start_step(step)
                    if step >= steps:
                        break
                    committed = self.train_step(step) is not None
                except Exception as e:  # any: every observer closes what it holds (files, sinks)
                    self._abort(step, e)
                    if isinstance(e, NonFiniteGradient):
                        raise NonFiniteGradient(f"step {step + 1}: {e}") from None
                    raise
                if self.checkpoint_saver.stopped is not None:
                    break
                step += committed  # a step ft did not commit is trained again with a new quorum
        finally:
            self.replicas.close()
        stopped = self.checkpoint_saver.stopped
        result = self.summary.result(
            step + 1 if stopped else steps,
            self.n_params,
            self.throughput,
            self.record.run_dir,
            stopped,
        )
        for observer in reversed(self.observers):
            observer.on_run_end(result)
        return result

    def _abort(self, step: int, error: Exception) -> None:
        """Every observer's ``on_run_abort``, the last built first; one failing does not keep the
        others from theirs (the run's own error is the one raised)."""
        for observer in reversed(self.observers):
            try:
                observer.on_run_abort(step, error)
            except Exception as e:
                said = f"fivefold: {type(observer).__name__} failed while the run stopped: {e}"
                if self.record.run_dir is not None:  # rank 0: above its progress bar
                    self.record.say(said)
                else:
                    print(said, file=sys.stderr, flush=True)

    def train_step(self, step: int) -> StepResult | None:
        """One step: this rank's micro-batches forward and backward (gradients reduced), the
        optimizer step over every engine, the loss averaged; then every observer's ``on_step_end``.
        No host sync but on log steps. Under ft, None when the live groups did not commit the step
        (its gradients dropped, nothing stepped)."""
        self.log.reset()
        for observer in self.observers:
            observer.on_step_start(step)
        set_debug_step(step + 1)  # numbered as everywhere: from 1
        lr = self._set_lr(step)
        batches, documents = self._micro_batches(step)
        weight = self.data.loss_weight(step, self.data_batch)
        loss_sum = self.model.forward_backward(batches, documents, weight)
        if not self.replicas.commit():
            for engine in self.model.engines.values():
                engine.zero_grad()
            return None
        self._meter_model_state(step)
        grad_norm = self.model.step(self._max_norm, self.cfg.train.check_finite)
        # before the metrics' collectives
        traffic = self.log.totals(dims=self.model.step_traffic_dims)
        by_dim = self.log.by_dim()
        loss = self.replicas.mean_loss(self.model.global_loss(loss_sum))
        result = self._result(step, lr, loss, grad_norm, traffic, by_dim)
        for observer in self.observers:
            observer.on_step_end(result)
        return result

    @property
    def _max_norm(self) -> float | None:
        return self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else None

    def _set_lr(self, step: int) -> float:
        lr = lr_at(step, self.cfg)
        for group in self.model.param_groups():
            group["lr"] = lr
        return lr

    def _micro_batches(self, step: int) -> tuple[list[Batch], list[Documents | None]]:
        """This rank's rows of the step's global batch, one pair per accumulation micro-step, on the
        device, and their documents (read from the rows on the host, before they are copied)."""
        t = self.cfg.train
        host = [
            self.data.micro_batch(
                step, self.data_batch, micro, t.grad_accum, self.data_rank, self.data_dp
            )
            for micro in range(t.grad_accum)
        ]
        documents = [self.model.documents_of(x) for x, _ in host]
        return [(to_device(x, self.device), to_device(y, self.device)) for x, y in host], documents

    def _meter_model_state(self, step: int) -> None:
        """The model-state memory, read once the optimizer state is allocated (the second step, or a
        resume's first)."""
        start, steps = self.start, self.cfg.train.steps
        if step == min(start + 1, steps - 1) or (step == start and start > 0):
            self.model_state_mb = self.model.model_state_bytes() / 2**20

    def _result(
        self,
        step: int,
        lr: float,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None,
        traffic: CommTotals,
        traffic_by_dim: dict[str, CommTotals] | None = None,
    ) -> StepResult:
        """The step's `StepResult`; on a log step the loss is fetched (the one wait per log
        interval: otherwise the host queues the next step while the device runs this one) and the
        step time read."""
        logged = step % self.cfg.run.log_every == 0 or step == self.cfg.train.steps - 1
        loss_value = norm_value = step_time = peak = None
        if logged:
            loss_value, norm_value = self._fetch(loss, grad_norm)
            step_time = self.clock.lap(step)
            peak = peak_memory_mb(self.device)
        return StepResult(
            step,
            lr,
            self.throughput.tokens_per_step,
            loss,
            grad_norm,
            traffic,
            self.model_state_mb,
            logged,
            loss_value,
            step_time,
            norm_value,
            traffic_by_dim or {},
            peak,
            self.replicas.live,
        )

    def _fetch(
        self, loss: torch.Tensor, grad_norm: torch.Tensor | None
    ) -> tuple[float, float | None]:
        """A log step's one wait for the device: the loss, the norm and the count of steps skipped
        for a non-finite gradient since the last log, in one copy to the host; a skipped step stops
        the run here (`NonFiniteWatch.confirm`)."""
        watch = self.model.finite_watch
        skipped = watch.skipped if self.cfg.train.check_finite else None
        values = torch.stack(
            [t.detach().reshape(()).float() for t in (loss, grad_norm, skipped) if t is not None]
        ).tolist()  # waits for this step
        if skipped is not None:
            watch.confirm(int(values[-1]))
        return values[0], values[1] if grad_norm is not None else None

    def _announce_eval(self, result: EvalResult) -> None:
        for observer in self.observers:
            observer.on_eval(result)


class Evaluator(TrainObserver):
    """Every ``train.eval_every`` steps and after the last: the loss on the held-out batches (this
    rank's share), announced to every observer's ``on_eval``; evaluation is not training time (the
    clock restarts after it)."""

    def __init__(
        self,
        model: ParallelModel,
        batches: list[Batch],
        every: int,
        steps: int,
        clock: TrainingClock,
        announce: Callable[[EvalResult], None],
        loss_weight: float = 1.0,
    ) -> None:
        self.model, self.batches, self.clock, self.announce = model, batches, clock, announce
        self.every, self.steps, self.loss_weight = every, steps, loss_weight

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == self.every - 1 or step == self.steps - 1)

    def on_step_end(self, result: StepResult) -> None:
        if self.due(result.step):
            # the documents made for this evaluation only: held between them, their masks would
            # stay on the device for the run
            documents = [self.model.documents_of(x) for x, _ in self.batches]
            loss = self.model.evaluate(self.batches, documents, self.loss_weight)
            self.announce(EvalResult(result.step, loss))
            self.clock.restart(result.step + 1)


class Heartbeat(TrainObserver):
    """Tells the watchdog's heartbeat each finished step (`watchdog.report_step`: the stall
    detector's progress)."""

    def on_step_end(self, result: StepResult) -> None:
        report_step(result.step + 1)


def peak_memory_mb(device: torch.device) -> float | None:
    """The accelerator's peak allocated memory so far, in MiB: its allocator's host counter (no
    device sync); None on the CPU, on meta and where the device module has no such counter."""
    if device.type in ("cpu", "meta"):
        return None
    try:
        counter = getattr(torch.get_device_module(device.type), "max_memory_allocated", None)
    except RuntimeError:  # no device module registered for this type
        return None
    return counter(device) / 2**20 if counter is not None else None


def make_tracer(
    cfg: Config, parts: ParallelModel, log: CommLog, mesh: ParallelMesh, device: torch.device
) -> StepTracer | None:
    """With ``run.trace``, a `StepTracer` on this rank's embedding, blocks, norm and head (hooks
    installed now, idle outside the traced steps); otherwise None: no hook, and the log never times
    a collective."""
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
