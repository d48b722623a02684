"""`validate(config, world_size)`: every check needing no process, run before any starts, so a bad
input gets one error naming what to change instead of a traceback from every worker after loading
data. Workers use the `RunPlan`, so nothing is resolved twice: the tokenizer and the vocabulary
too (`train.data_source.resolve_data`). The rules across keys and dimensions are the table in
`fivefold.rules` (docs/architecture.md#the-rule-table)."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path

from fivefold.checkpoint.hf import check_hf_weights
from fivefold.checkpoint.manager import check_loadable, read_checkpoint_meta
from fivefold.config import Config, ConfigError, OnError
from fivefold.observe.profile import describe_steps, profile_window
from fivefold.observe.trace import trace_window
from fivefold.paths import PathOutside, one_component
from fivefold.plan.fits import check_fits
from fivefold.rules import device_type_of
from fivefold.run_plan import RunPlan, check_non_negative, check_positive, validate_layout
from fivefold.train.checkpointing import (
    check_layout_fields,
    check_model_matches,
    check_optimizer_matches,
    check_run_dir,
)
from fivefold.train.corpus import binary_share, check_source
from fivefold.train.data_source import DataPlan, data_tokens, is_prepared, resolve_data
from fivefold.train.sinks import check_sink_packages

__all__ = ["ON_ERROR", "RunPlan", "validate", "validate_layout"]

ON_ERROR = typing.get_args(OnError)  # checkpoint.on_error: what a failed save does to the run


def validate(cfg: Config, world_size: int) -> RunPlan:
    """Raise a `ValueError` naming the first problem of `cfg` on `world_size` processes; return the
    resolved plan."""
    plan = validate_layout(cfg, world_size)
    check_sink_packages(cfg)  # logging.sinks: known names, their packages installed
    r = cfg.run
    try:
        if not is_prepared(cfg.data.path):
            check_source(cfg.data.path, cfg.data.max_bytes)  # it exists, it can be read
        share = None if is_prepared(cfg.data.path) else binary_share(cfg.data.path)
    except FileNotFoundError as e:  # a ValueError like every other config problem
        raise ConfigError(f"data.path: {e}") from None
    except OSError as e:  # unreadable: a permission, a directory where a file was expected
        raise ConfigError(
            f"data.path={cfg.data.path!r} cannot be read: {e.strerror or e}"
            + (f" ({e.filename})" if e.filename else "")
        ) from None
    notes = list(plan.notes)
    if share is not None and share[0] > 0.1:
        notes.append(
            f"data: {share[0]:.0%} of the first bytes of {share[1]!r} are not text (binary or "
            "random data?); training proceeds on its bytes"
        )
    if cfg.model.init_from:
        try:
            notes += check_hf_weights(
                cfg.model.init_from, plan.model, cfg.model.init_from_allow_unused
            )
        except ValueError as e:
            raise ConfigError(f"model.init_from: {e}") from None
    try:
        one_component(r.name, "run.name")
    except PathOutside as e:
        raise ConfigError(str(e)) from None
    _check_out_dir(Path(r.out_dir) / r.name)
    c = cfg.checkpoint
    if c.dir:
        _check_out_dir(Path(c.dir), "checkpoint.dir")
    if r.overwrite and r.resume:
        raise ConfigError(
            f"run.overwrite and run.resume={r.resume!r} contradict each other: --overwrite starts "
            "over (deleting the run's checkpoints), --resume continues it; give one"
        )
    check_non_negative(
        **{
            "checkpoint.interval": c.interval,
            "checkpoint.keep": c.keep,
            "checkpoint.every_minutes": c.every_minutes,
            "run.exit_after": r.exit_after,
            "run.max_restarts": r.max_restarts,
            "run.stall_timeout_s": r.stall_timeout_s,
            "run.profile": r.profile,
            "run.flight_recorder": r.flight_recorder,
        }
    )
    if r.memory_snapshot and (device := device_type_of(r.device)) != "cuda":
        raise ConfigError(
            f"run.memory_snapshot records CUDA's caching allocator: this run is on {device}"
        )
    check_positive(
        **{
            "run.heartbeat_timeout_s": r.heartbeat_timeout_s,
            "run.collective_timeout_s": r.collective_timeout_s,
        }
    )
    try:
        resume_from = check_run_dir(cfg)
        meta = read_checkpoint_meta(resume_from) if resume_from is not None else {}
        if resume_from is not None:
            check_loadable(
                resume_from, c.trust
            )  # its metadata readable without running anything it holds
            check_layout_fields(resume_from, meta)
            check_optimizer_matches(resume_from, meta, cfg)
        # the tokenizer, the vocabulary and the source (docs/data.md): before the model is priced
        data, model, data_notes = resolve_data(cfg, plan.model, plan.dims.tp, meta or None)
        plan = dataclasses.replace(plan, model=model, data=data)
        notes += data_notes
        if resume_from is not None:  # the model's tensors, the vocabulary's rows among them
            check_model_matches(resume_from, meta, dataclasses.asdict(plan.model))
        done = meta.get("steps_done", 0)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_data(cfg, plan.data)
    notes += _check_profile(cfg, done)
    notes += _check_memory(cfg, plan, world_size)
    if done >= cfg.train.steps:
        raise ConfigError(
            f"checkpoint {resume_from} has done {done} steps and train.steps={cfg.train.steps}: "
            "nothing left to train; raise train.steps to continue it"
        )
    return dataclasses.replace(plan, resume_from=resume_from, notes=tuple(notes))


def _check_profile(cfg: Config, done: int) -> list[str]:
    """``run.profile``'s steps are an invocation's last ones, leaving out its first (which compiles
    and allocates: not the steady state): a config whose new run cannot hold them is refused. A
    resumed invocation (``--resume``, a restart after a lost worker) profiles those it has left
    after its first, said in a note: a restart must not fail on it."""
    r, steps = cfg.run, cfg.train.steps
    if r.profile <= 0:
        return []
    fresh = trace_window(0, steps, r.profile, r.exit_after)  # what a new run would profile
    if fresh.start == 0:
        needed = r.profile + 1
        if r.exit_after > 0 and r.exit_after < steps:
            fix = f"raise run.exit_after to {needed}"
        else:
            fix = f"raise train.steps to {needed}"
        lower = f"lower run.profile to {len(fresh) - 1} or " if len(fresh) > 1 else ""
        raise ConfigError(
            f"run.profile={r.profile} would profile steps {fresh.start + 1}-{fresh.stop}, this "
            f"run's steps 1-{fresh.stop} (its first among them: it compiles and allocates, not the "
            f"steady state); {lower}{fix}"
        )
    window = profile_window(done, steps, r.profile, r.exit_after)
    if done == 0 or len(window) == r.profile or done >= steps:
        return []
    return [
        f"run.profile={r.profile}: this invocation resumes after step {done}, so it profiles "
        f"{describe_steps(window)} (its first step left out)"
    ]


def _check_memory(cfg: Config, plan: RunPlan, world_size: int) -> list[str]:
    """A run this machine's memory cannot hold is refused before any worker starts
    (`plan.fits.check_fits`); under torchrun every rank checks its own node or device and all raise
    if one does (one raising alone would leave the others waiting in their first collective)."""
    from fivefold.distributed.launch import is_torchrun_env

    if not is_torchrun_env():  # `run` spawns world_size CPU workers on this host
        return check_fits(cfg, plan, world_size, "cpu")
    import torch.distributed as dist

    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    n_local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device_type = device_type_of(cfg.run.device)
    problem, notes = None, []
    try:
        notes = (
            check_fits(cfg, plan, 1, device_type, ranks=[rank], workers_started=True)
            if device_type != "cpu"
            else check_fits(
                cfg,
                plan,
                n_local,
                "cpu",
                ranks=range(rank - local, rank - local + n_local),
                workers_started=True,
            )
        )
    except ConfigError as e:
        problem = str(e)
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    if any(problems):
        raise ConfigError(next(p for p in problems if p))
    return notes


def _check_data(cfg: Config, data: DataPlan) -> None:
    """The corpus is long enough for the windows training and evaluation draw (as
    `TokenDataset`), counted in the tokenizer's tokens."""
    tokens, own_val = data_tokens(cfg, data)
    need, where = (
        cfg.train.seq_len + 1,
        f"data.path={cfg.data.path!r}"
        + (
            f" capped at data.max_bytes={cfg.data.max_bytes}"
            if cfg.data.max_bytes is not None
            else ""
        ),
    )
    val = own_val if own_val is not None else int(tokens * cfg.data.val_fraction)
    train = tokens if own_val is not None else tokens - val
    if train < need:
        raise ConfigError(
            f"{where} holds {train} training tokens, too few for train.seq_len={cfg.train.seq_len} "
            f"(need at least {need}); use more data or a shorter sequence"
        )
    short_val = 0 < val < need if own_val is not None else cfg.data.val_fraction > 0 and val < need
    if data.kind == "prepared" and (short_val or cfg.train.eval_every > 0 and val < need):
        raise ConfigError(
            f"{where} holds {val} validation tokens, too few for train.seq_len="
            f"{cfg.train.seq_len} (need {need}): prepare it again with a larger --val-fraction"
            + (" or set train.eval_every 0" if cfg.train.eval_every > 0 and not short_val else "")
        )
    if (own_val is None and cfg.data.val_fraction > 0 or cfg.train.eval_every > 0) and val < need:
        raise ConfigError(
            f"{where} leaves {val} validation tokens (data.val_fraction={cfg.data.val_fraction}), "
            f"too few for train.seq_len={cfg.train.seq_len} (need {need}); raise data.val_fraction"
            + (" or set train.eval_every 0" if cfg.train.eval_every > 0 else "")
        )


def _check_out_dir(run_dir: Path, key: str = "run.out_dir") -> None:
    what = "run directory" if key == "run.out_dir" else key
    for parent in [run_dir, *run_dir.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(
                    f"{what} {str(run_dir)!r} cannot be created: {str(parent)!r} is a file; "
                    f"choose another {key}" + (" or run.name" if key == "run.out_dir" else "")
                )
            if not os.access(parent, os.W_OK):
                raise ConfigError(
                    f"{what} {str(run_dir)!r} cannot be created: {str(parent)!r} is not "
                    f"writable; choose another {key}"
                )
            return
