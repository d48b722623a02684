"""`search`: every layout of a GPU count the trainer accepts, planned and ranked by estimated step
time among those that fit; the candidates the rule table (`fivefold.rules.RULES`) refuses are
dropped before they are planned."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Collection

from fivefold import rules
from fivefold.config import Config, ConfigError, apply_overrides, resolve_batch
from fivefold.distributed.mesh import ParallelDims
from fivefold.models.llama import RECOMPUTE_MODES, LlamaConfig
from fivefold.pipeline.builders import build_schedule
from fivefold.plan.hardware import HARDWARE, Hardware
from fivefold.plan.layout import TARGET_DEVICE, LayoutPlan, plan_layout
from fivefold.run_plan import validate_layout

__all__ = ["SEARCHED", "SearchResult", "candidate_layouts", "search"]

# The keys `search` chooses; a user's own value of one of them (`fixed`) holds it there
SEARCHED = (
    "parallel.tp",
    "parallel.pp",
    "parallel.cp",
    "parallel.cp_mode",
    "parallel.dp",
    "parallel.ep",
    "zero.stage",
    "train.recompute",
)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _model(cfg: Config) -> LlamaConfig:
    """`cfg`'s model, whatever its layout."""
    alone = copy.deepcopy(cfg)
    alone.parallel = dataclasses.replace(
        cfg.parallel, tp=1, pp=1, cp=1, dp=1, ep=1, dp_replicate=1, sp=False
    )
    alone.train = dataclasses.replace(cfg.train, global_batch=None, grad_accum=None, micro_batch=1)
    return validate_layout(alone, 1, device_type=TARGET_DEVICE).model


def _kept(cfg: Config, overrides: list[str], world: int, model: LlamaConfig) -> bool:
    """Whether the layout `overrides` make of `cfg` keeps every rule of the table (as
    `validate_layout` would find it; False also where its grid, batch or schedule cannot be
    resolved: the trainer refuses those too)."""
    trial = apply_overrides(copy.deepcopy(cfg), overrides)
    p, t = trial.parallel, trial.train
    try:
        dims = ParallelDims.of(p).resolve(world)
        schedule = None
        if dims.pp > 1:
            accum = resolve_batch(t.global_batch, t.micro_batch, t.grad_accum, dims.dp)[2]
            schedule = build_schedule(
                trial.pipeline.schedule, dims.pp, accum, trial.pipeline.virtual
            )
    except ValueError:
        return False
    layout = rules.Layout(trial, dims.size, model.moe, TARGET_DEVICE, schedule, model)
    return rules.first_error(layout) is None


def candidate_layouts(
    cfg: Config, world: int, hardware: Hardware, fixed: Collection[str] = ()
) -> list[list[str]]:
    """Every (tp, pp, cp, cp mode, ep, ZeRO stage, recompute) for `world` GPUs that the rule table
    allows, as overrides: tp a divisor of a node's GPU count (with SP), pp up to the number of
    blocks (1F1B), cp up to 16 (over 1: the ring, Ulysses, and the hybrid at each proper divisor of
    cp as its Ulysses degree; that degree alone when ``parallel.cp_ulysses`` is set), dp the rest,
    ep a divisor of dp × cp (MoE), ZeRO 0-3 (stage 0 alone when dp × cp = 1), recompute none /
    full / selective / selective-op (its save set as the config has it: `train.recompute_save`).
    A key in `fixed` (one of `SEARCHED`) keeps `cfg`'s value. The trainer's other checks (what the
    model divides) then drop the rest."""
    model = _model(cfg)
    blocks = model.n_layers
    p, z, t = cfg.parallel, cfg.zero, cfg.train

    def choices(key: str, values: list) -> list:
        return (
            [
                dict(
                    tp=p.tp,
                    pp=p.pp,
                    cp=p.cp,
                    dp=p.dp,
                    ep=p.ep,
                    stage=z.stage,
                    recompute=t.recompute,
                )[key]
            ]
            if any(f.endswith("." + key) for f in fixed)
            else values
        )

    out = []
    for tp in choices("tp", [k for k in _divisors(hardware.gpus_per_node) if world % k == 0]):
        for pp in choices(
            "pp", [k for k in _divisors(world // tp) if k <= blocks] if world % tp == 0 else []
        ):
            for cp in choices(
                "cp",
                [k for k in _divisors(world // (tp * pp)) if k <= 16]
                if world % (tp * pp) == 0
                else [],
            ):
                if world % (tp * pp * cp):
                    continue
                dp = world // (tp * pp * cp)
                if "parallel.dp" in fixed and dp != p.dp:
                    continue
                # how cp attends: the ring, Ulysses, the hybrid at every proper Ulysses degree
                # (the table drops what the heads do not divide)
                modes = [["--parallel.cp_mode", "ring"]]
                if cp > 1:
                    modes.append(["--parallel.cp_mode", "ulysses"])
                    modes += [
                        ["--parallel.cp_mode", "hybrid", "--parallel.cp_ulysses", str(u)]
                        for u in _divisors(cp)
                        if 1 < u < cp
                    ]
                if "parallel.cp_mode" in fixed:
                    modes = [m for m in modes if m[1] == p.cp_mode]
                if p.cp_ulysses is not None:  # a hybrid degree was chosen: that hybrid only
                    modes = [m for m in modes if m[1] == "hybrid" and m[3] == str(p.cp_ulysses)]
                # (a dense model has no experts to split: ep 1; the table drops what the experts do
                # not divide)
                for ep, mode in itertools.product(
                    choices("ep", _divisors(dp * cp) if model.moe is not None else [1]), modes
                ):
                    for stage in choices("stage", [0, 1, 2, 3] if dp * cp > 1 else [0]):
                        for recompute in choices("recompute", list(RECOMPUTE_MODES)):
                            overrides = [
                                "--parallel.tp",
                                str(tp),
                                "--parallel.sp",
                                str(tp > 1).lower(),
                                "--parallel.pp",
                                str(pp),
                                "--parallel.cp",
                                str(cp),
                                *mode,
                                "--parallel.dp",
                                str(dp),
                                "--parallel.ep",
                                str(ep),
                                "--zero.stage",
                                str(stage),
                                "--train.recompute",
                                recompute,
                                *(
                                    ["--pipeline.schedule", "1f1b", "--pipeline.virtual", "1"]
                                    if pp > 1 and "pipeline.schedule" not in fixed
                                    else []
                                ),
                            ]
                            if _kept(cfg, overrides, world, model):
                                out.append(overrides)
    return out


@dataclasses.dataclass
class SearchResult:
    """What `search` found: the best layouts that fit, ranked; how many candidates were valid and
    fit; how many of the ``total`` were planned (fewer when ``stopped``: by Ctrl-C, the best so
    far)."""

    plans: list[LayoutPlan]
    valid: int
    fitting: int
    tried: int
    total: int
    stopped: bool = False


def search(
    cfg: Config,
    world: int,
    hardware: Hardware = HARDWARE["h100"],
    top: int = 10,
    progress: Callable[[int, int, LayoutPlan | None], None] | None = None,
    fixed: Collection[str] = (),
) -> SearchResult:
    """Every candidate (`candidate_layouts`) planned on its first and last pipeline rank (which hold
    the most; the stages between are costed as the heavier end, so a full `plan_layout` may differ
    slightly), those that fit ranked by estimated step time, less memory first on a tie; returns
    the best `top` and the counts. ``progress(done, total, best)`` is told after each candidate
    (``total`` 0 while the candidates are enumerated). A KeyboardInterrupt during the search ends it
    with the best so far (``stopped``)."""
    if top < 1:
        raise ValueError(f"top={top}: show at least one layout")
    hardware.check()
    plans: list[LayoutPlan] = []
    valid, cache, tried, candidates = 0, {}, 0, []
    stopped = False

    def rank(p: LayoutPlan) -> tuple[float, int]:
        return (round(p.time["step"], 6), p.peak_bytes)

    try:
        if progress is not None:
            progress(0, 0, None)
        candidates = candidate_layouts(cfg, world, hardware, fixed)
        best = None
        for overrides in candidates:
            trial = apply_overrides(copy.deepcopy(cfg), overrides)
            try:
                plan = plan_layout(trial, world, hardware, pp_ranks=(0, -1), parts_cache=cache)
                plan.overrides = overrides
            except (ConfigError, ValueError):
                plan = None
            tried += 1
            if plan is not None:
                valid += 1
                if plan.fits:
                    plans.append(plan)
                    best = plan if best is None or rank(plan) < rank(best) else best
            if progress is not None:
                progress(tried, len(candidates), best)
    except KeyboardInterrupt:
        stopped = True
    plans.sort(key=rank)
    return SearchResult(plans[:top], valid, len(plans), tried, len(candidates), stopped)
