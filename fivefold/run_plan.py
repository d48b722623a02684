"""A layout resolved and checked: `validate_layout(config, world_size)` -> `RunPlan`, the grid, the
batch and the model a config gives on a world size, after every check that needs no data, no run
directory and no process: each number in its range, what the model must divide (tp, cp's chunks,
the stage cut), then the rule table (`fivefold.rules`, docs/architecture.md#the-rule-table).
`fivefold plan` prices the plan it returns; `train.validate.validate` adds the run's own checks
(data, run directory, memory) on top."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fivefold import rules
from fivefold.checkpoint.hf import read_hf_config
from fivefold.config import Config, ConfigError, ParallelSection, check_choices, resolve_batch
from fivefold.context_parallel.layout import layout_for
from fivefold.data_parallel.mixed_precision import parse_dtype
from fivefold.distributed.topology import ParallelDims
from fivefold.models import LlamaConfig, get_config
from fivefold.models.llama import check_model_bounds
from fivefold.models.moe import MoEConfig
from fivefold.models.plans import LLAMA_TP_PLAN, llama_stage_modules
from fivefold.models.recompute_policy import save_plan
from fivefold.pipeline.builders import build_schedule
from fivefold.tensor_parallel.plan import check_divisible

if TYPE_CHECKING:
    from fivefold.train.data_source import DataPlan

__all__ = ["RunPlan", "validate_layout"]


@dataclass(frozen=True)
class RunPlan:
    """What a valid config resolves to for a world size: the grid, the batch, the model's shape."""

    dims: ParallelDims
    global_batch: int
    micro_batch: int
    grad_accum: int
    # preset + overrides (+ max_seq_len grown to train.seq_len); `validate` sets the vocabulary
    # from the data's tokenizer (`train.data_source.resolve_data`)
    model: LlamaConfig
    resume_from: Path | None = None  # the checkpoint this run continues (None: a new run)
    notes: tuple[str, ...] = ()  # what the run changed of what it was given, to say at start-up
    data: DataPlan | None = None  # the tokenizer and the source (`validate`; None: layout only)
    # parallel.layout=auto's choice (`train.layout_auto`), for every checkpoint's fivefold.json
    layout_auto: dict[str, Any] | None = None


def check_positive(**values: float) -> None:
    for key, v in values.items():
        if v <= 0:
            raise ConfigError(f"{key}={v} must be positive")


def check_non_negative(**values: float) -> None:
    for key, v in values.items():
        if v < 0:
            raise ConfigError(f"{key}={v} must not be negative")


def validate_layout(cfg: Config, world_size: int, device_type: str | None = None) -> RunPlan:
    """The checks of `validate` that need neither data nor a run directory (what `fivefold plan`
    checks a layout with): the numbers, the grid, the batch, the model and what it divides, then the
    rule table (`fivefold.rules.RULES`); the resolved plan. ``device_type``: the device the layout
    is for (default: ``run.device``, "auto" meaning this machine's; probed only when a rule
    asks)."""
    p, t = cfg.parallel, cfg.train
    check_choices(cfg)  # (parsing checks them; a config built in code)
    if t.recompute == "selective-op":
        save_plan(t.recompute_save)  # a preset or known op groups: else one ConfigError line
    _check_numbers(cfg, world_size)
    _check_cp_mode(p)
    dims = ParallelDims.of(p).resolve(world_size)
    global_batch, micro_batch, grad_accum = resolve_batch(
        t.global_batch, t.micro_batch, t.grad_accum, dims.dp
    )
    model, notes = _model(cfg)
    if dims.tp > 1:
        check_divisible(model, LLAMA_TP_PLAN, dims.tp)
    if dims.cp > 1:
        try:
            layout_for(p, dims.cp).check(t.seq_len)
        except ValueError as e:
            raise ConfigError(f"train.seq_len: {e}") from None
    schedule = None
    if dims.pp > 1:
        schedule = build_schedule(cfg.pipeline.schedule, dims.pp, grad_accum, cfg.pipeline.virtual)
        # blocks per stage, tied embeddings
        llama_stage_modules(model, schedule.n_stages, cfg.pipeline.layers())
    rules.check(
        rules.Layout(cfg, dims.size, model.moe, device_type or cfg.run.device, schedule, model)
    )
    if cfg.precision.fp8 != "off":
        check_float8_shapes(cfg, model, dims, micro_batch, device_type or cfg.run.device)
    if (cfg.zero.qwz or cfg.zero.qgz) and dims.size("dp_shard") == 1:
        notes.insert(0, "zero.qwz / zero.qgz do nothing with one data-parallel rank (dp × cp = 1)")
    return RunPlan(dims, global_batch, micro_batch, grad_accum, model, None, tuple(notes))


def check_float8_shapes(
    cfg: Config, model: LlamaConfig, dims: ParallelDims, micro_batch: int, device: str
) -> None:
    """On CUDA, `torch._scaled_mm` takes only dimensions that are multiples of 16: every FP8
    linear's input and output features on a tp rank, and the tokens a rank's micro-batch holds (the
    weight gradient's inner dimension); the CPU takes any (docs/design.md#fp8-training)."""
    if rules.device_type_of(device) != "cuda":
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise ConfigError(
            f"precision.fp8={cfg.precision.fp8}: this GPU ({name}, compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}) has no FP8 tensor cores "
            "(8.9 and later: Ada, Hopper, Blackwell); use precision.fp8 off"
        )
    tp, head = dims.tp, model.head_dim
    features = {
        "model.dim": model.dim,
        "n_heads × head_dim / tp": model.n_heads * head // tp,
        "n_kv_heads × head_dim / tp": max(1, model.n_kv_heads // tp) * head,
        "ffn_hidden / tp": model.ffn_hidden // tp,
        "micro_batch × seq_len / cp (tokens)": micro_batch * cfg.train.seq_len // dims.cp,
    }
    moe = model.moe
    if moe is not None and moe.shared_experts:  # the shared experts' feed-forward is an FP8 linear
        shared = moe.shared_hidden or (moe.hidden or model.ffn_hidden) * moe.shared_experts
        features["moe shared experts' hidden width / tp"] = shared // tp
    for what, n in features.items():
        if n % 16:
            raise ConfigError(
                f"precision.fp8={cfg.precision.fp8} on CUDA: {what} = {n} is not a multiple of "
                "16, which torch._scaled_mm needs of every FP8 GEMM dimension; change the model, "
                "the batch or the layout, or use precision.fp8 off"
            )


def _check_cp_mode(p: ParallelSection) -> None:
    """The hybrid's Ulysses degree: a proper divisor of cp (else it is one of the pure modes)."""
    if p.cp_mode != "hybrid" or p.cp < 1:
        return
    u = p.ulysses_degree(p.cp)
    if not 1 < u < p.cp or p.cp % u:
        raise ConfigError(
            f"parallel.cp_ulysses={u} with cp_mode hybrid and cp={p.cp}: the hybrid is Ulysses "
            "over cp_ulysses ranks × ring over cp / cp_ulysses, so cp_ulysses must divide cp and "
            "lie between 1 and cp; use cp_mode ulysses (cp_ulysses = cp) or ring (1), or another "
            "degree"
        )


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
    check_positive(
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
    check_non_negative(
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
        if k not in ("preset", "init_from", "init_from_allow_unused", "attention") and v is not None
    }
    for key in ("sliding_window", "rotary_dim"):  # 0: none (the whole prefix, every channel)
        if overrides.get(key) == 0:
            overrides[key] = None
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
