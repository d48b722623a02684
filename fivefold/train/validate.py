"""`validate(config, world_size)`: every check needing no process, run before any starts, so a bad
input gets one error naming what to change instead of a traceback from every worker after loading
data. Workers use the `RunPlan`, so nothing is resolved twice; only the data's largest token id is
left to them (it may grow the vocabulary). The rules across keys and dimensions are the table in
`fivefold.rules` (docs/architecture.md#the-rule-table)."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass
from pathlib import Path

from fivefold import rules
from fivefold.checkpoint.hf import check_hf_weights, read_hf_config
from fivefold.checkpoint.manager import check_loadable, read_checkpoint_meta
from fivefold.config import Config, ConfigError, OnError, check_choices, resolve_batch
from fivefold.context_parallel.layout import SequenceLayout
from fivefold.data_parallel.mixed_precision import parse_dtype
from fivefold.mesh import ParallelDims
from fivefold.models import LlamaConfig, get_config
from fivefold.models.llama import check_model_bounds
from fivefold.models.moe import MoEConfig
from fivefold.models.plans import LLAMA_TP_PLAN, llama_stage_modules
from fivefold.paths import PathOutside, one_component
from fivefold.pipeline.builders import build_schedule
from fivefold.rules import device_type_of
from fivefold.tensor_parallel.plan import check_divisible
from fivefold.train.checkpointing import check_layout_fields, check_model_matches, check_run_dir
from fivefold.train.corpus import binary_share, check_source

__all__ = ["ON_ERROR", "RunPlan", "validate", "validate_layout"]

ON_ERROR = typing.get_args(OnError)  # checkpoint.on_error: what a failed save does to the run


@dataclass(frozen=True)
class RunPlan:
    """What a valid config resolves to for a world size: the grid, the batch, the model's shape."""

    dims: ParallelDims
    global_batch: int
    micro_batch: int
    grad_accum: int
    # preset + overrides (+ max_seq_len grown to train.seq_len); vocab may grow with the data
    model: LlamaConfig
    resume_from: Path | None = None  # the checkpoint this run continues (None: a new run)
    notes: tuple[str, ...] = ()  # what the run changed of what it was given, to say at start-up

    def model_for(self, max_token: int) -> LlamaConfig:
        """The model for data whose largest token id is `max_token` (a larger vocabulary is rounded
        up to 64·k)."""
        if max_token < self.model.vocab_size:
            return self.model
        return dataclasses.replace(self.model, vocab_size=-(-(max_token + 1) // 64) * 64).validate()


def _positive(**values: float) -> None:
    for key, v in values.items():
        if v <= 0:
            raise ConfigError(f"{key}={v} must be positive")


def _non_negative(**values: float) -> None:
    for key, v in values.items():
        if v < 0:
            raise ConfigError(f"{key}={v} must not be negative")


def validate(cfg: Config, world_size: int) -> RunPlan:
    """Raise a `ValueError` naming the first problem of `cfg` on `world_size` processes; return the
    resolved plan."""
    plan = validate_layout(cfg, world_size)
    r = cfg.run
    try:
        _check_data(cfg)
        share = binary_share(cfg.data.path)
    except FileNotFoundError as e:  # a ValueError like every other config problem
        raise ConfigError(f"data.path: {e}") from None
    except OSError as e:  # unreadable: a permission, a directory where a file was expected
        raise ConfigError(
            f"data.path={cfg.data.path!r} cannot be read: {e.strerror or e}"
            + (f" ({e.filename})" if e.filename else "")
        ) from None
    notes = list(plan.notes)
    notes += _check_memory(cfg, plan, world_size)
    if share is not None and share[0] > 0.1:
        notes.append(
            f"data: {share[0]:.0%} of the first bytes of {share[1]!r} are not text (binary or "
            "random data?); training proceeds on its bytes"
        )
    if cfg.model.init_from:
        try:
            check_hf_weights(cfg.model.init_from, plan.model)
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
    _non_negative(
        **{
            "checkpoint.interval": c.interval,
            "checkpoint.keep": c.keep,
            "run.exit_after": r.exit_after,
            "run.max_restarts": r.max_restarts,
            "run.stall_timeout_s": r.stall_timeout_s,
        }
    )
    _positive(
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
            # the model's tensors (the vocabulary may still grow with the data: the workers check
            # it)
            check_model_matches(
                resume_from,
                meta,
                {k: v for k, v in dataclasses.asdict(plan.model).items() if k != "vocab_size"},
            )
        done = meta.get("steps_done", 0)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if done >= cfg.train.steps:
        raise ConfigError(
            f"checkpoint {resume_from} has done {done} steps and train.steps={cfg.train.steps}: "
            "nothing left to train; raise train.steps to continue it"
        )
    return dataclasses.replace(plan, resume_from=resume_from, notes=tuple(notes))


def validate_layout(cfg: Config, world_size: int, device_type: str | None = None) -> RunPlan:
    """The checks of `validate` that need neither data nor a run directory (what `fivefold plan`
    checks a layout with): the numbers, the grid, the batch, the model and what it divides, then the
    rule table (`fivefold.rules.RULES`); the resolved plan. ``device_type``: the device the layout
    is for (default: ``run.device``, "auto" meaning this machine's; probed only when a rule
    asks)."""
    p, t = cfg.parallel, cfg.train
    check_choices(cfg)  # (parsing checks them; a config built in code)
    _check_numbers(cfg, world_size)
    dims = ParallelDims(
        pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, dp_replicate=p.dp_replicate
    ).resolve(world_size)
    global_batch, micro_batch, grad_accum = resolve_batch(
        t.global_batch, t.micro_batch, t.grad_accum, dims.dp
    )
    model, notes = _model(cfg)
    if dims.tp > 1:
        check_divisible(model, LLAMA_TP_PLAN, dims.tp)
    if dims.cp > 1:
        try:
            SequenceLayout(p.cp_layout, dims.cp).check(t.seq_len)
        except ValueError as e:
            raise ConfigError(f"train.seq_len: {e}") from None
    schedule = None
    if dims.pp > 1:
        schedule = build_schedule(cfg.pipeline.schedule, dims.pp, grad_accum, cfg.pipeline.virtual)
        # blocks per stage, tied embeddings
        llama_stage_modules(model, schedule.n_stages, cfg.pipeline.layers())
    rules.check(rules.Layout(cfg, dims.size, model.moe, device_type or cfg.run.device, schedule))
    if (cfg.zero.qwz or cfg.zero.qgz) and dims.size("dp_shard") == 1:
        notes.insert(0, "zero.qwz / zero.qgz do nothing with one data-parallel rank (dp × cp = 1)")
    return RunPlan(dims, global_batch, micro_batch, grad_accum, model, None, tuple(notes))


def _check_numbers(cfg: Config, world_size: int) -> None:
    """Each number in its range: finite, positive, not negative, a fraction."""
    t, z, r = cfg.train, cfg.zero, cfg.run
    for (
        section,
        values,
    ) in cfg.to_dict().items():  # inf or nan reach a float field from TOML or the command line
        for key, value in (values or {}).items() if isinstance(values, dict) else ():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{section}.{key}={value} must be a finite number")
    _positive(
        **{
            "run.nproc / world size": world_size,
            "train.steps": t.steps,
            "run.log_every": r.log_every,
            "train.seq_len": t.seq_len,
            "train.lr": t.lr,
            "train.eps": t.eps,
            "train.eval_batches": t.eval_batches,
            "zero.bucket_mb": z.bucket_mb,
            "zero.inflight_buckets": z.inflight_buckets,
            "run.trace_steps": r.trace_steps,
        }
    )
    _non_negative(
        **{
            "train.warmup_steps": t.warmup_steps,
            "train.weight_decay": t.weight_decay,
            "train.grad_clip": t.grad_clip,
            "train.eval_every": t.eval_every,
            "zero.prefetch": z.prefetch,
        }
    )
    for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"{key}={beta} must lie in [0, 1) (AdamW's moment decay)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must lie in [0, 1]")
    if not 0 <= cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={cfg.data.val_fraction} must lie in [0, 1)")
    for key, name in (
        ("precision.param", cfg.precision.param),
        ("precision.reduce", cfg.precision.reduce),
    ):
        try:
            parse_dtype(name)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None


def _model(cfg: Config) -> tuple[LlamaConfig, list[str]]:
    """The model the run trains (a preset with overrides, or a Hugging Face directory's shape, with
    [model.moe] laid over it; max_seq_len grown to train.seq_len), and what was changed of it."""
    overrides = {
        k: v
        for k, v in dataclasses.asdict(cfg.model).items()
        if k not in ("preset", "init_from", "attention") and v is not None
    }
    try:
        if cfg.model.init_from:  # the shape comes with the weights
            if overrides:
                raise ConfigError(
                    "model.init_from takes the model's shape from "
                    f"{cfg.model.init_from}/config.json; drop "
                    f"model.{', model.'.join(sorted(overrides))}"
                )
            model = read_hf_config(cfg.model.init_from)
        else:
            model = get_config(cfg.model.preset, **overrides)
        model = dataclasses.replace(model, moe=_moe_config(model.moe, cfg)).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    notes, seq_len = [], cfg.train.seq_len
    if seq_len > model.max_seq_len:
        notes.append(
            f"model.max_seq_len raised from {model.max_seq_len} to train.seq_len={seq_len} (longer "
            "RoPE tables; no parameter changes)"
        )
        model = dataclasses.replace(model, max_seq_len=seq_len).validate()
    check_model_bounds(model)  # absurd sizes (the raised max_seq_len too) before anything is built
    return model, notes


def _check_memory(cfg: Config, plan: RunPlan, world_size: int) -> list[str]:
    """A run this machine's memory cannot hold is refused before any worker starts
    (`plan.fits.check_fits`); under torchrun every rank checks its own node or device and all raise
    if one does (one raising alone would leave the others waiting in their first collective)."""
    from fivefold.launch import is_torchrun_env
    from fivefold.plan.fits import check_fits  # (here: fivefold.plan imports this module)

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


def _moe_config(preset: MoEConfig | None, cfg: Config) -> MoEConfig | None:
    """The preset's MoE settings with the keys the run sets ([model.moe] / --model.moe.*) laid over
    them."""
    given = {k: v for k, v in dataclasses.asdict(cfg.moe).items() if v is not None}
    if given.get("capacity_factor") == 0:
        given["capacity_factor"] = None  # dropless
    if given.get("group_limit") == 0:
        given["group_limit"] = None  # no limit
    if given.get("experts") == 0:
        return None  # a dense model
    if preset is not None:
        return preset.replace(**given)
    if not given:
        return None
    if "experts" not in given:
        raise ConfigError(
            f"moe.{min(given)} is set but the model is dense: set --model.moe.experts N (or use an "
            "MoE preset such as tiny-moe)"
        )
    return MoEConfig(**given).validate()


def _check_data(cfg: Config) -> None:
    """The corpus exists and is long enough for the windows training and evaluation draw (as
    `TokenDataset`)."""
    tokens, own_val = check_source(cfg.data.path, cfg.data.max_bytes)
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
