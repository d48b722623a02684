"""`validate(config, world_size)`: every check needing no process, run before any starts, so a bad input gets one
error naming what to change instead of a traceback from every worker after loading data. Workers use the `RunPlan`,
so nothing is resolved twice; only the data's largest token id is left to them (it may grow the vocabulary)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fivefold.checkpoint.hf import check_hf_weights, read_hf_config
from fivefold.checkpoint.manager import check_loadable, read_checkpoint_meta
from fivefold.comm import P2P_SEMANTICS
from fivefold.config import Config, ConfigError, resolve_batch
from fivefold.context_parallel.layout import LAYOUTS, SequenceLayout
from fivefold.data_parallel.mixed_precision import parse_dtype
from fivefold.mesh import ParallelDims
from fivefold.models import LlamaConfig, get_config
from fivefold.models.llama import ATTENTION_CORES, RECOMPUTE_MODES, check_model_bounds
from fivefold.models.moe import MoEConfig
from fivefold.models.parallelize import (
    OVERLAP_CHOICES,
    check_compile_supported,
    check_pipeline_supported,
    pipeline_overlap,
)
from fivefold.models.plans import LLAMA_TP_PLAN, llama_stage_modules
from fivefold.paths import PathOutside, one_component
from fivefold.pipeline.builders import build_schedule
from fivefold.tensor_parallel.plan import check_divisible
from fivefold.train.checkpointing import check_layout_fields, check_model_matches, check_run_dir
from fivefold.train.corpus import binary_share, check_source

__all__ = ["ON_ERROR", "RunPlan", "validate", "validate_layout"]

ON_ERROR = ("stop", "warn")  # checkpoint.on_error: what a failed save does to the run


@dataclass(frozen=True)
class RunPlan:
    """What a valid config resolves to for a world size: the grid, the batch, the model's shape."""

    dims: ParallelDims
    global_batch: int
    micro_batch: int
    grad_accum: int
    model: LlamaConfig  # preset + overrides (+ max_seq_len grown to train.seq_len); vocab may grow with the data
    resume_from: Path | None = None  # the checkpoint this run continues (None: a new run)
    notes: tuple[str, ...] = ()  # what the run changed of what it was given, to say at start-up

    def model_for(self, max_token: int) -> LlamaConfig:
        """The model for data whose largest token id is `max_token` (a larger vocabulary is rounded up to 64·k)."""
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
    """Raise a `ValueError` naming the first problem of `cfg` on `world_size` processes; return the resolved plan."""
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
            f"data: {share[0]:.0%} of the first bytes of {share[1]!r} are not text (binary or random "
            "data?); training proceeds on its bytes"
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
    if c.on_error not in ON_ERROR:
        raise ConfigError(f"checkpoint.on_error={c.on_error!r}: choose {' or '.join(ON_ERROR)}")
    if r.overwrite and r.resume:
        raise ConfigError(
            f"run.overwrite and run.resume={r.resume!r} contradict each other: --overwrite starts over "
            "(deleting the run's checkpoints), --resume continues it; give one"
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
            # the model's tensors (the vocabulary may still grow with the data: the workers check it)
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
            f"checkpoint {resume_from} has done {done} steps and train.steps={cfg.train.steps}: nothing "
            "left to train; raise train.steps to continue it"
        )
    return dataclasses.replace(plan, resume_from=resume_from, notes=tuple(notes))


def validate_layout(cfg: Config, world_size: int, device_type: str | None = None) -> RunPlan:
    """The checks of `validate` that need neither data nor a run directory: numbers, the grid, the batch, the model
    and every dimension's divisibility (what `fivefold plan` checks a layout with); the resolved plan.
    ``device_type``: the device the layout is for (default: ``run.device``, "auto" meaning this machine's)."""
    t, z, p, r = cfg.train, cfg.zero, cfg.parallel, cfg.run
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
    if z.stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero.stage={z.stage}: choose a ZeRO stage 0 (DDP), 1, 2 or 3 (FSDP)")
    for key, name in (
        ("precision.param", cfg.precision.param),
        ("precision.reduce", cfg.precision.reduce),
    ):
        try:
            parse_dtype(name)
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None

    dims = ParallelDims(
        pp=p.pp, dp=p.dp, cp=p.cp, tp=p.tp, ep=p.ep, dp_replicate=p.dp_replicate
    ).resolve(world_size)
    _check_hsdp(dims, z.stage)
    global_batch, micro_batch, grad_accum = resolve_batch(
        t.global_batch, t.micro_batch, t.grad_accum, dims.dp
    )

    overrides = {
        k: v
        for k, v in dataclasses.asdict(cfg.model).items()
        if k not in ("preset", "init_from", "attention") and v is not None
    }
    try:
        if cfg.model.init_from:  # the shape comes with the weights
            if overrides:
                raise ConfigError(
                    f"model.init_from takes the model's shape from {cfg.model.init_from}/config.json; "
                    f"drop model.{', model.'.join(sorted(overrides))}"
                )
            model = read_hf_config(cfg.model.init_from)
        else:
            model = get_config(cfg.model.preset, **overrides)
        model = dataclasses.replace(model, moe=_moe_config(model.moe, cfg)).validate()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_moe(model, dims, cfg)
    notes = list(_check_zeropp(cfg, dims, model.moe is not None))
    if t.seq_len > model.max_seq_len:
        notes.append(
            f"model.max_seq_len raised from {model.max_seq_len} to train.seq_len={t.seq_len} (longer RoPE "
            "tables; no parameter changes)"
        )
        model = dataclasses.replace(model, max_seq_len=t.seq_len).validate()
    check_model_bounds(model)  # absurd sizes (the raised max_seq_len too) before anything is built
    if dims.tp > 1:
        check_divisible(model, LLAMA_TP_PLAN, dims.tp)
    if p.cp_layout not in LAYOUTS:
        raise ConfigError(f"parallel.cp_layout={p.cp_layout!r}: choose {' or '.join(LAYOUTS)}")
    if dims.cp > 1:
        try:
            SequenceLayout(p.cp_layout, dims.cp).check(t.seq_len)
        except ValueError as e:
            raise ConfigError(f"train.seq_len: {e}") from None
    local_seq = t.seq_len // dims.cp
    if p.sp and local_seq % dims.tp:
        raise ConfigError(
            f"sequence parallel splits the sequence over tp: train.seq_len={t.seq_len}"
            + (f" / cp={dims.cp} = {local_seq}" if dims.cp > 1 else "")
            + f" is not divisible by tp={dims.tp}; use a multiple of {_sp_multiple(p.cp_layout, dims)}"
        )
    if t.recompute not in RECOMPUTE_MODES:
        raise ConfigError(f"train.recompute={t.recompute!r}: choose {', '.join(RECOMPUTE_MODES)}")
    if cfg.model.attention not in ATTENTION_CORES:
        raise ConfigError(
            f"model.attention={cfg.model.attention!r}: choose {' or '.join(ATTENTION_CORES)}"
        )
    if cfg.model.attention != "sdpa" and dims.cp > 1:
        raise ConfigError(
            f"model.attention={cfg.model.attention}: under parallel.cp={dims.cp} attention is ring "
            "attention whatever the core; drop model.attention or use cp 1"
        )
    if cfg.pipeline.overlap not in OVERLAP_CHOICES:
        raise ConfigError(
            f"pipeline.overlap={cfg.pipeline.overlap!r}: choose {' or '.join(OVERLAP_CHOICES)}"
        )
    if cfg.pipeline.overlap == "on" and dims.pp == 1:
        raise ConfigError(
            "pipeline.overlap=on runs a pipeline's overlapped units side by side: it needs "
            "parallel.pp > 1 and pipeline.schedule dualpipev"
        )
    if dims.pp > 1:
        check_pipeline_supported(cfg)
        if cfg.pipeline.p2p not in ("auto", *P2P_SEMANTICS):
            raise ConfigError(
                f"pipeline.p2p={cfg.pipeline.p2p!r}: choose auto, {' or '.join(P2P_SEMANTICS)}"
            )
        if cfg.pipeline.p2p == "buffered" and r.device not in ("auto", "cpu"):
            raise ConfigError(
                f"pipeline.p2p=buffered relies on gloo's per-message completion; run.device="
                f"{r.device} uses a backend that completes a batch as a whole: use auto or rendezvous"
            )
        schedule = build_schedule(cfg.pipeline.schedule, dims.pp, grad_accum, cfg.pipeline.virtual)
        llama_stage_modules(
            model, schedule.n_stages, cfg.pipeline.layers()
        )  # blocks per stage, tied embeddings
        try:
            device_type = device_type or _device_type(r.device)
            pipeline_overlap(cfg, model.moe is not None, dims.size, device_type)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.train.compile:  # (the device type probes for an accelerator: only when it matters)
        try:
            check_compile_supported(
                cfg, device_type or _device_type(r.device), schedule if dims.pp > 1 else None
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None

    return RunPlan(dims, global_batch, micro_batch, grad_accum, model, None, tuple(notes))


def _check_memory(cfg: Config, plan: RunPlan, world_size: int) -> list[str]:
    """A run this machine's memory cannot hold is refused before any worker starts (`plan.fits.check_fits`); under
    torchrun every rank checks its own node or device and all raise if one does (one raising alone would leave the
    others waiting in their first collective)."""
    from fivefold.launch import is_torchrun_env
    from fivefold.plan.fits import check_fits  # (here: fivefold.plan imports this module)

    if not is_torchrun_env():  # `run` spawns world_size CPU workers on this host
        return check_fits(cfg, plan, world_size, "cpu")
    import torch.distributed as dist

    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    n_local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    device_type = _device_type(cfg.run.device)
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


def _device_type(device: str) -> str:
    """The device type ``run.device`` names ("auto": this machine's accelerator, else the CPU)."""
    if device != "auto":
        return device.split(":")[0]
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    return accelerator.type if accelerator else "cpu"


def _moe_config(preset: MoEConfig | None, cfg: Config) -> MoEConfig | None:
    """The preset's MoE settings with the keys the run sets ([model.moe] / --model.moe.*) laid over them."""
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
            f"moe.{min(given)} is set but the model is dense: set --model.moe.experts N (or use an MoE "
            "preset such as tiny-moe)"
        )
    return MoEConfig(**given).validate()


def _check_moe(model: LlamaConfig, dims: ParallelDims, cfg: Config) -> None:
    if model.moe is None:
        if dims.ep > 1:
            raise ConfigError(
                f"parallel.ep={dims.ep} splits the experts of an MoE model, but the model is dense: set "
                "--model.moe.experts N (or an MoE preset such as tiny-moe), or parallel.ep=1"
            )
        return
    if model.moe.experts % dims.ep:
        raise ConfigError(
            f"moe.experts={model.moe.experts} is not divisible by parallel.ep={dims.ep}: every ep rank "
            "holds the same number of experts"
        )
    if model.moe.group_limit is not None and model.moe.groups % dims.ep:
        raise ConfigError(
            f"moe.groups={model.moe.groups} is not a multiple of parallel.ep={dims.ep}: device-limited "
            "routing bounds the ranks a token reaches only when every expert group lives on one rank"
        )
    if dims.tp > 1:
        raise ConfigError(
            f"an MoE model with parallel.tp={dims.tp} is not supported (experts are not "
            "tensor-parallel); use ep over dp × cp instead (DeepSeek-V3 trains without TP)"
        )
    if cfg.precision.param == "fp16":
        raise ConfigError(
            "precision.param=fp16 with an MoE model is not supported (the auxiliary loss's gradient is "
            "not loss-scaled); use bf16"
        )


def _check_hsdp(dims: ParallelDims, stage: int) -> None:
    """HSDP shards inside groups of dp/dp_replicate × cp ranks and all-reduces across the dp_replicate copies."""
    if dims.dp_replicate == 1:
        return
    if stage == 0:
        raise ConfigError(
            f"parallel.dp_replicate={dims.dp_replicate} with zero.stage=0: nothing is sharded, so every "
            "rank is a replica and that is plain DDP; set zero.stage 1, 2 or 3 to shard inside groups "
            f"of dp/dp_replicate × cp = {dims.size('dp_shard')} ranks (HSDP), or parallel.dp_replicate 1"
        )
    if dims.size("dp_shard") == 1:
        raise ConfigError(
            f"parallel.dp_replicate={dims.dp_replicate} = dp × cp leaves one rank per shard group: "
            "nothing would be sharded (that is DDP); choose a dp_replicate that leaves dp/dp_replicate "
            "× cp ≥ 2, or use zero.stage 0 with parallel.dp_replicate 1"
        )


def _check_zeropp(cfg: Config, dims: ParallelDims, moe: bool) -> list[str]:
    """ZeRO++'s switches against the stage and the grid; returns notes for switches that do nothing here."""
    z, group = (
        cfg.zero,
        dims.size("dp_shard"),
    )  # the engines' data-parallel group: dp × cp (HSDP: a shard group)
    if z.qgz and dims.dp_replicate > 1:
        raise ConfigError(
            f"zero.qgz with parallel.dp_replicate={dims.dp_replicate}: HSDP's all-reduce across the "
            "replicas would follow qgZ's dequantised sum, which is not built; drop zero.qgz (qwZ and hpZ "
            "work with HSDP) or use parallel.dp_replicate 1"
        )
    if z.qwz and z.stage != 3:
        raise ConfigError(
            f"zero.qwz quantises ZeRO-3's parameter all-gathers: set zero.stage 3 (not {z.stage}) or "
            "drop zero.qwz"
        )
    if z.qgz and z.stage not in (2, 3):
        raise ConfigError(
            f"zero.qgz replaces the gradient reduce-scatter of ZeRO-2/3 by a quantised all-to-all: set "
            f"zero.stage 2 or 3 (not {z.stage}) or drop zero.qgz"
        )
    if z.constant_buffers and (z.qwz or z.qgz):
        raise ConfigError(
            "zero.constant_buffers with zero.qwz / zero.qgz: their int8 staging buffers are allocated "
            "per collective, not pooled; drop one or the other"
        )
    if (z.qwz or z.qgz) and z.quant_block < 16:
        raise ConfigError(
            f"zero.quant_block={z.quant_block}: use at least 16 elements per block (each block carries "
            "a 4-byte scale; ZeRO++ uses 256-4096)"
        )
    if z.hpz < 0:
        raise ConfigError(f"zero.hpz={z.hpz} must not be negative (0 or 1: off)")
    if z.hpz > 1:
        if z.stage != 3 or not z.reshard_after_forward:
            raise ConfigError(
                "zero.hpz keeps a secondary copy for ZeRO-3's backward all-gathers: it needs zero.stage "
                "3 with zero.reshard_after_forward true"
            )
        if moe:
            raise ConfigError(
                "zero.hpz with an MoE model is not supported (the experts' engine reduces over ep_dp, "
                "not dp × cp); drop zero.hpz"
            )
        if group % z.hpz or z.hpz >= group:
            what = "a shard group (dp × cp / dp_replicate)" if dims.dp_replicate > 1 else "dp × cp"
            raise ConfigError(
                f"zero.hpz={z.hpz} must divide the data-parallel group, {what} = {group}, and be "
                "smaller than it (e.g. the dp ranks of one node)"
            )
    if (z.qwz or z.qgz) and group == 1:
        return [f"zero.qwz / zero.qgz do nothing with one data-parallel rank (dp × cp = {group})"]
    return []


def _sp_multiple(layout: str, dims: ParallelDims) -> int:
    """The sequence lengths SP (over tp) and the cp layout can both split: cp·tp, and zig-zag's 2·cp chunks."""
    return dims.cp * (math.lcm(2, dims.tp) if layout == "zigzag" and dims.cp > 1 else dims.tp)


def _check_data(cfg: Config) -> None:
    """The corpus exists and is long enough for the windows training and evaluation draw (as `TokenDataset`)."""
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
