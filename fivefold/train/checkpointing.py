"""The trainer's side of checkpoints: what a resume needs beyond the model and optimizer (the step —
which also fixes the data position and the learning rate —, every rank's RNG states, the loss
scaler), when to save (at the end, every ``checkpoint.interval`` steps, every
``checkpoint.every_minutes`` by rank 0's clock (`TimedSaves`), after ``run.exit_after`` steps, on
SIGTERM), and the run-directory rules (`check_run_dir`: a new run refuses a directory that
holds one unless told to resume or overwrite)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fivefold.checkpoint import training_state
from fivefold.checkpoint.manager import (
    Checkpointer,
    CheckpointError,
    CheckpointSaveError,
    complete_checkpoints,
    find_checkpoint,
    read_checkpoint_meta,
)
from fivefold.checkpoint.metadata import read_safe_metadata
from fivefold.checkpoint.snapshot import snapshot_for
from fivefold.config import Config
from fivefold.distributed.mesh import MESH_DIMS, ParallelMesh
from fivefold.models.llama import WEIGHT_SIZES
from fivefold.observe.profile import PROFILE_DIR, SNAPSHOT_DIR
from fivefold.train.metrics import (
    RunRecord,
    StepResult,
    TrainingClock,
    TrainObserver,
    TrainResult,
)

if TYPE_CHECKING:
    from fivefold.models.parallel_model import ParallelModel

__all__ = [
    "CheckpointSaver",
    "TimedSaves",
    "TrainCheckpoints",
    "check_run_dir",
    "checkpoint_root",
    "restart_count",
    "run_dir",
]

RUN_FILES = (
    "metrics.jsonl",
    "loss.png",
    "moe_load.png",
    "timeline.png",
    "trace.json",
    "step_trace.png",
)
# what `run.overwrite` clears besides: an earlier run's files there would mix with the new run's
# (flight_recorder/ stays: its dumps say why a restarted attempt was restarted)
RUN_DIRS = ("tensorboard", PROFILE_DIR, SNAPSHOT_DIR)


def run_dir(cfg: Config) -> Path:
    return Path(cfg.run.out_dir) / cfg.run.name


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir(cfg) / "checkpoints"


def restart_count() -> int:
    """How often torchrun (``--max-restarts``) has restarted this job's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def check_run_dir(cfg: Config) -> Path | None:
    """The checkpoint a run resumes from (None: a new run). A new run in a directory that already
    holds one (its metrics or checkpoints) is an error unless ``run.overwrite``; ``run.resume`` must
    name a complete checkpoint. A worker restarted by torchrun resumes from the latest checkpoint if
    there is one."""
    root, where = checkpoint_root(cfg), run_dir(cfg)
    # restarted by torchrun: this run's own latest checkpoint wins over where it started (a --resume
    # PATH)
    resume = "latest" if restart_count() > 0 and complete_checkpoints(root) else cfg.run.resume
    if resume:
        try:
            return find_checkpoint(resume, root)
        except CheckpointError as e:
            raise CheckpointError(f"run.resume={resume}: {e}") from None
    held = [f for f in RUN_FILES[:1] if (where / f).exists()] + (
        ["checkpoints"] if complete_checkpoints(root) else []
    )
    if held and not cfg.run.overwrite and restart_count() == 0:
        raise CheckpointError(
            f"run directory {str(where)!r} already holds a run ({', '.join(held)}): continue it "
            "with --resume, start over with --overwrite, or choose another --run.name"
        )
    return None


def clear_run_dir(cfg: Config) -> None:
    """``run.overwrite``: remove what an earlier run left (its metrics, pictures, TensorBoard
    events, profiles, memory snapshots and checkpoints; W&B and MLflow keep it as an earlier run of
    theirs)."""
    where = run_dir(cfg)
    for name in RUN_FILES:
        (where / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(where / name, ignore_errors=True)
    root = checkpoint_root(cfg)
    for path in complete_checkpoints(root):
        shutil.rmtree(path)
    if (root / "latest").is_file():  # fivefold writes it as a file only
        (root / "latest").unlink()
    for partial in root.glob(".partial-*") if root.is_dir() else ():
        shutil.rmtree(partial, ignore_errors=True)


LAYOUT_FIELDS = (
    "world",
    *MESH_DIMS,
    "ep",
    "dp_replicate",
    "zero",
    "param_dtype",
)  # what `layout` records


def check_layout_fields(path: Path, meta: dict[str, Any]) -> None:
    """A checkpoint whose layout names a field this version does not know is refused, not half
    understood."""
    unknown = sorted(set(meta.get("layout", {})) - set(LAYOUT_FIELDS))
    if unknown:
        raise CheckpointError(
            f"checkpoint {path} records layout field(s) {', '.join(unknown)} that this fivefold "
            "does not know (written by a newer version?): it cannot tell how to read them"
        )


def check_optimizer_matches(path: Path, meta: dict[str, Any], cfg: Config) -> None:
    """A checkpoint resumes with the optimizer that wrote its state (``optim.name``; a checkpoint
    from before the key was AdamW's): Muon's momentum is no AdamW moment, nor the other way."""
    saved = meta.get("config", {}).get("optim", {}).get("name", "adamw")
    if saved != cfg.optim.name:
        raise CheckpointError(
            f"checkpoint {path} holds {saved}'s optimizer state and optim.name={cfg.optim.name}: "
            f"resume with optim.name {saved}, or export its weights (fivefold export) and start "
            "a new run from them (model.init_from)"
        )


def layout(cfg: Config, mesh: ParallelMesh) -> dict[str, Any]:
    hsdp = (
        {"dp_replicate": mesh.size("dp_replicate")} if mesh.size("dp_replicate") > 1 else {}
    )  # (as before HSDP)
    return {
        "world": dist.get_world_size(),
        **{d: mesh.size(d) for d in (*MESH_DIMS, "ep")},
        **hsdp,
        "zero": cfg.zero.stage,
        "param_dtype": cfg.precision.param,
    }


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SIGTERM: dict[str, Any] = {"seen": None, "previous": {}, "installed": False}
STOP_REASONS = ("SIGTERM", "SIGINT", "exit_after")  # a checkpoint after which the run stops


def watch_sigterm() -> None:
    """From now on a SIGTERM or SIGINT to this worker is remembered
    (`TrainCheckpoints.stop_requested`), not fatal: the run stops at the end of a step with a
    checkpoint. Main thread only (elsewhere the signals keep their defaults)."""

    def on_stop(signum: int, frame: Any) -> None:
        _SIGTERM["seen"] = _SIGTERM["seen"] or signal.Signals(signum).name

    if _SIGTERM["installed"]:
        return
    try:
        _SIGTERM["previous"] = {sig: signal.signal(sig, on_stop) for sig in _STOP_SIGNALS}
        _SIGTERM["installed"] = True
    except ValueError:
        pass


def unwatch_sigterm() -> None:
    if _SIGTERM["installed"]:
        for sig, handler in _SIGTERM["previous"].items():
            signal.signal(sig, handler)
        _SIGTERM.update(seen=None, previous={}, installed=False)


class TimedSaves:
    """When a save by time is due (``checkpoint.every_minutes``; 0: never): once that much time has
    passed since the last save ended, and never sooner than `SHARE` × that save's wait, so the
    training spends at most 1/SHARE of its time waiting for saves whatever a save costs. One rank's
    clock (rank 0's) decides; the decision travels in the stop flag's all-reduce."""

    SHARE = 50  # a save's wait is at most 1/50 (2 %) of the time between two saves

    def __init__(self, every_minutes: float, clock: Any = time.monotonic) -> None:
        self.every_s, self.clock = every_minutes * 60.0, clock
        self.next_at = clock() + self.every_s
        self.asked = False  # a save asked for and not yet made (the flag arrives a step late)

    def due(self) -> bool:
        """True once when a save by time is due (again only after `saved`)."""
        if self.asked or self.every_s <= 0 or self.clock() < self.next_at:
            return False
        self.asked = True
        return True

    def saved(self, waited: float) -> None:
        """A save (of any reason; or a failed one) has ended, the training having waited
        ``waited`` seconds."""
        self.next_at = self.clock() + max(self.every_s, self.SHARE * waited)
        self.asked = False


class TrainCheckpoints:
    """One per rank, built after `parallelize` (collective: the control group)."""

    def __init__(
        self,
        cfg: Config,
        mesh: ParallelMesh,
        parts: ParallelModel,
        model_config: Any,
        device: torch.device | None = None,
        tokenizer: Any = None,
        layout_auto: dict[str, Any] | None = None,
    ) -> None:
        self.cfg, self.mesh, self.parts = cfg, mesh, parts
        self.layout_auto = layout_auto  # parallel.layout=auto's choice, kept in every fivefold.json
        self.device = device or torch.device("cpu")
        self.model_config = dataclasses.asdict(model_config)
        # the run's `TokenizerInfo`: a resume with another is refused (`train.data_source`)
        self.tokenizer = dataclasses.asdict(tokenizer) if tokenizer is not None else None
        self.ckpt = Checkpointer(
            checkpoint_root(cfg),
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
            snapshot=snapshot_for(self.device),
        )
        if self.ckpt._group is not None:
            mesh.own(self.ckpt._group)
        # Flags (SIGTERM agreed by every rank) go over a gloo group of their own: a CPU all-reduce,
        # no device sync; issued asynchronously and read one step later (`stop_requested`).
        self.control = mesh.own(dist.new_group(backend="gloo"))
        self._flag: tuple[dist.Work, torch.Tensor] | None = None  # this step's, in flight
        self.timer = TimedSaves(cfg.checkpoint.every_minutes)  # decides on rank 0 only
        self._pending_reason: str | None = None  # why the background save in flight was started
        self.warnings: list[
            str
        ] = []  # failed saves under checkpoint.on_error=warn, for the trainer to say
        watch_sigterm()

    def stop_requested(self, last: bool = False) -> str | None:
        """The signal ("SIGTERM", "SIGINT") on every rank once any rank got one, one step late
        (`flags`); None: no signal."""
        return self.flags(last)[0]

    def flags(self, last: bool = False) -> tuple[str | None, bool]:
        """(the stop signal, whether a save by time is due), the same on every rank, one step late:
        each call reads the all-reduce (MAX over the gloo control group) the previous call started
        and starts this step's with ``async_op=True``, so no step waits for the other ranks' hosts
        (docs/reliability.md#when-things-go-wrong). Every rank reads the same result at the same
        call, so all stop (or save) after the same step. The time flag is rank 0's clock's
        (`TimedSaves`), the others send 0. ``last`` (the run's last step): this step's flags are
        read now too, leaving nothing in flight."""
        seen = self._read_flag()
        if seen[0] is not None:  # every rank stops now: nothing more is started
            return seen
        here = _SIGTERM["seen"]
        code = 0 if here is None else _STOP_SIGNALS.index(getattr(signal, here)) + 1
        timed = int(dist.get_rank() == 0 and self.timer.due())
        # on the host: the gloo control group
        flag = torch.tensor([code, timed], dtype=torch.int32, device="cpu")
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control, async_op=True)
        self._flag = (work, flag)
        if last:
            now = self._read_flag()
            return now[0], seen[1] or now[1]
        return seen

    def _read_flag(self) -> tuple[str | None, bool]:
        """The stop signal and the time flag the all-reduce in flight agreed on (waiting for it);
        (None, False) when none is in flight."""
        if self._flag is None:
            return None, False
        (work, flag), self._flag = self._flag, None
        work.wait()
        code, timed = (int(v) for v in flag.tolist())  # a CPU tensor: no device sync
        return (_STOP_SIGNALS[code - 1].name if code else None), bool(timed)

    def due(self, steps_done: int, steps_this_run: int) -> str | None:
        """Why to save after ``steps_done`` steps (None: not now). Call on every rank after every
        step (collective: the stop and time flags)."""
        c, r, t = self.cfg.checkpoint, self.cfg.run, self.cfg.train
        exit_now = bool(r.exit_after) and steps_this_run >= r.exit_after
        stop, timed = self.flags(last=exit_now or steps_done >= t.steps)
        if stop is not None:
            return stop
        if exit_now and steps_done < t.steps:
            return "exit_after"
        if c.interval > 0 and (steps_done % c.interval == 0 or steps_done == t.steps):
            return "interval"
        if c.at_end and steps_done >= t.steps:
            return "end"
        return "time" if timed else None

    def save(self, steps_done: int, reason: str) -> float | None:
        """Write the checkpoint after ``steps_done`` steps; returns the seconds the training waited
        for it, or None when it failed and ``checkpoint.on_error`` is warn (`warning` says why). A
        failed save of a stop (SIGTERM, exit_after) always raises: the run cannot claim a checkpoint
        it does not have."""
        t0 = time.perf_counter()
        self._finish_pending()
        state = training_state(self.parts.engines.values(), self.mesh.comm("tp")).state_dict
        state[f"rng.rank{dist.get_rank()}"] = {
            "cpu": torch.get_rng_state(),
            "accelerator": _accelerator_rng(self.device),
        }
        scalers = [
            e.loss_scaler.state_dict()
            for e in self.parts.engines.values()
            if e.loss_scaler is not None
        ]
        if scalers:
            state["loss_scaler"] = scalers[0]
        meta = {
            "steps_done": steps_done,
            "reason": reason,
            "layout": layout(self.cfg, self.mesh),
            "model": self.model_config,
            "tokenizer": self.tokenizer,
            "preset": self.cfg.model.preset,
            "config": self.cfg.to_dict(),
            "saved_at": time.time(),
            **({"layout_auto": self.layout_auto} if self.layout_auto is not None else {}),
        }
        try:
            self.ckpt.save(steps_done, state, meta)
        except CheckpointSaveError as e:
            self.timer.saved(time.perf_counter() - t0)
            self._failed(e, reason)
            return None
        self._pending_reason = reason
        waited = time.perf_counter() - t0
        self.timer.saved(waited)
        return waited

    def _finish_pending(self) -> None:
        """Wait for a background save; its failure is handled as that save's (`_failed`)."""
        reason, self._pending_reason = self._pending_reason, None
        try:
            self.ckpt.wait()
        except CheckpointSaveError as e:
            self._failed(e, reason or "interval")

    def _failed(self, error: CheckpointSaveError, reason: str) -> None:
        if self.cfg.checkpoint.on_error == "stop" or reason in STOP_REASONS:
            raise error
        self.warnings.append(
            f"fivefold: warning: {error}; training goes on (checkpoint.on_error=warn)"
        )

    def restore(self, path: Path) -> int:
        """Load the checkpoint at ``path`` into this rank's layout; returns the steps it had
        done."""
        meta = read_checkpoint_meta(path)
        check_layout_fields(path, meta)
        check_model_matches(path, meta, self.model_config)
        Checkpointer.verify(path)  # before anything of it is read
        ours = layout(self.cfg, self.mesh)
        trust = self.cfg.checkpoint.trust
        elementwise, scalars = Checkpointer.saved_optimizer_keys(path, trust)
        ts = training_state(
            self.parts.engines.values(),
            self.mesh.comm("tp"),
            scalars,
            elementwise,
            saved=_saved_keys(path, trust),  # (Muon's keys for its matrices, AdamW's for the rest)
        )
        state = ts.state_dict
        same_layout = meta.get("layout") == ours
        rng_key = f"rng.rank{dist.get_rank()}"
        if same_layout:  # RNG streams belong to ranks: only the same layout continues them
            state[rng_key] = None
        scalers = [e.loss_scaler for e in self.parts.engines.values() if e.loss_scaler is not None]
        if scalers and "loss_scaler" in _saved_keys(path, trust):
            state["loss_scaler"] = None
        Checkpointer.load(path, state, verified=True, trust=trust)
        ts.after_load(self.parts.engines.values())
        if same_layout:
            torch.set_rng_state(state[rng_key]["cpu"])
            _set_accelerator_rng(self.device, state[rng_key]["accelerator"])
        if state.get("loss_scaler") is not None:
            for s in scalers:
                s.load_state_dict(state["loss_scaler"])
        return int(meta["steps_done"])

    def close(self) -> None:
        """Finish a background save (its failure raises, or under on_error=warn adds to
        `warnings`)."""
        try:
            self._finish_pending()
        finally:
            unwatch_sigterm()


class CheckpointSaver(TrainObserver):
    """The trainer's checkpoint observer: after every step asks `TrainCheckpoints.due` (collective),
    saves, writes the "checkpoint" record (or, under ``checkpoint.on_error=warn``, an "error" record
    and the warning), leaves the save's wait out of the step time, and after a stop's checkpoint
    (`STOP_REASONS`) sets `stopped` for the trainer to end the run. At the end (or when the run
    fails) it finishes a background save."""

    def __init__(
        self,
        checkpoints: TrainCheckpoints,
        record: RunRecord,
        clock: TrainingClock,
        start_step: int,
    ) -> None:
        self.checkpoints, self.record, self.clock = checkpoints, record, clock
        self.start_step = start_step
        self.stopped: str | None = None  # why the run stops after this step (with a checkpoint)
        self.saved_at = start_step  # the steps done at the last checkpoint (or the start)

    def on_step_end(self, result: StepResult) -> None:
        step, cfg = result.step, self.checkpoints.cfg
        reason = self.checkpoints.due(step + 1, step + 1 - self.start_step)
        if reason is None:
            return
        waited = self.checkpoints.save(step + 1, reason)
        for (
            warning
        ) in self.checkpoints.warnings:  # checkpoint.on_error=warn: a failed save, said once
            self.record.write(
                {
                    "kind": "error",
                    "step": step + 1,
                    "error": "checkpoint not saved",
                    "message": warning,
                }
            )
            self.record.say(warning)
        self.checkpoints.warnings.clear()
        if waited is None:
            return
        self.record.write(
            {
                "kind": "checkpoint",
                "step": step + 1,
                "steps_done": step + 1,
                "reason": reason,
                "seconds": waited,
                "async": cfg.checkpoint.async_save,
            }
        )
        self.clock.exclude(waited)  # saving is not training time
        self.saved_at = step + 1
        if reason in STOP_REASONS:
            self.stopped = reason
            self.record.say(
                f"fivefold: {reason}: stopped after {step + 1} of {cfg.train.steps} steps with a "
                f"checkpoint in {checkpoint_root(cfg)}; continue with --resume"
            )

    def on_run_end(self, result: TrainResult) -> None:
        self.checkpoints.close()  # a background save finishes
        for warning in self.checkpoints.warnings:
            self.record.say(warning)

    def on_run_abort(self, step: int, error: BaseException) -> None:
        """A background save of a good step still completes. An error that leaves the state whole
        (``state_intact``: ft's lost quorum) first saves the steps done, so none is lost."""
        if getattr(error, "state_intact", False) and step > self.saved_at:
            waited = self.checkpoints.save(step, "abort")
            if waited is not None:
                self.record.write(
                    {
                        "kind": "checkpoint",
                        "step": step,
                        "steps_done": step,
                        "reason": "abort",
                        "seconds": waited,
                        "async": self.checkpoints.cfg.checkpoint.async_save,
                    }
                )
                self.record.say(
                    f"fivefold: the state after {step} steps is saved in "
                    f"{checkpoint_root(self.checkpoints.cfg)}; continue with --resume"
                )
        self.checkpoints.close()


def _saved_keys(path: Path, trust: bool) -> set[str]:
    return set(read_safe_metadata(path, trust).state_dict_metadata)


def _accelerator_rng(device: torch.device) -> Any:
    """The generator state of the accelerator this rank computes on (None on the CPU path: no device
    touched)."""
    if device.type == "cpu":
        return None
    return torch.get_device_module(device.type).get_rng_state(device.index or 0)


def _set_accelerator_rng(device: torch.device, state: Any) -> None:
    if state is not None and device.type != "cpu":
        torch.get_device_module(device.type).set_rng_state(state, device.index or 0)


# What the weights' shapes depend on: a checkpoint is of this model when these agree (max_seq_len,
# which grows with train.seq_len, and the MoE loss coefficients or capacity do not change a tensor;
# the shared experts' width and gate and the expert bias do: a checkpoint from before they existed
# has none of them, and is not compared on them).
SHAPE_FIELDS = (
    *WEIGHT_SIZES,
    "tie_embeddings",
    "attention_head_dim",
    # the families' options: parameters (biases, q/k norms) or the attention's math
    "attention_bias",
    "qk_norm",
    "sliding_window",
    "rotary_dim",
)
MOE_SHAPE_FIELDS = (
    "experts",
    "top_k",
    "shared_experts",
    "hidden",
    "every",
    "first_dense",
    "shared_hidden",
    "shared_gate",
    "expert_bias",
)


def check_model_matches(path: Path, meta: dict[str, Any], model: dict[str, Any]) -> None:
    """The checkpoint's model has this model's tensors (else the first field that differs, both
    values)."""
    saved = meta.get("model", {})
    pairs = [(k, saved.get(k), model.get(k)) for k in SHAPE_FIELDS if k in saved and k in model]
    saved_moe, moe = saved.get("moe") or {}, model.get("moe") or {}
    if bool(saved_moe) != bool(moe):
        pairs.append(
            ("moe", "an MoE model" if saved_moe else "dense", "an MoE model" if moe else "dense")
        )
    elif moe:
        pairs += [
            (f"moe.{k}", saved_moe.get(k), moe.get(k)) for k in MOE_SHAPE_FIELDS if k in saved_moe
        ]
    for key, there, here in pairs:
        if there != here:
            raise CheckpointError(
                f"checkpoint {path} is of another model: {key}={there!r} there, {key}={here!r} here"
            )
