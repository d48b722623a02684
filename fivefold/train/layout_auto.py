"""``parallel.layout = "auto"`` (`fivefold train --layout auto`): the layout the planner chooses,
before any worker starts. `choose` runs `fivefold.plan.search` for the world size on the machine at
hand (`plan.hardware.local_hardware`), the keys the user gave among the searched ones held
(`fixed_keys`) and the global batch and micro-batch held as the config's own layout resolves them
(`held_batch`: every candidate is priced for the same step of data, the accumulation takes up what
its dp changes), and takes the fastest layout that fits and this device accepts. `resolve` applies
it (the config trained then names a manual layout: a ``--resume`` continues it without a new search
unless --layout auto is given again) and prints it with its two runners-up; `with_choice` puts it
in the `RunPlan` (a start-up note, ``layout_auto`` in every checkpoint's fivefold.json; a resume of
the layout keeps the entry). Under torchrun rank 0 searches and the others take its choice
(`resolve_on_rank0`). Every failure is one `ConfigError` line."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, TextIO

from fivefold.config import (
    ALIASES,
    Config,
    ConfigError,
    apply_overrides,
    resolve_batch,
    tomllib,
)
from fivefold.distributed.topology import ParallelDims
from fivefold.plan.hardware import GB, Hardware, local_hardware
from fivefold.plan.layout import LayoutPlan
from fivefold.plan.report import SearchProgress, format_bytes, format_ranking, format_seconds
from fivefold.plan.search import SEARCHED, search
from fivefold.run_plan import RunPlan, validate_layout

__all__ = [
    "LayoutChoice",
    "choose",
    "fixed_keys",
    "given_keys",
    "held_batch",
    "resolve",
    "resolve_on_rank0",
    "with_choice",
]

RUNNERS_UP = 2  # shown and recorded beside the chosen layout
PIPELINE_KEYS = ("pipeline.schedule", "pipeline.virtual")  # a given one keeps the user's schedule
WHAT = "fivefold train --layout auto"


def given_keys(path: str | Path | None, overrides: list[str]) -> set[str]:
    """The dotted keys a TOML file (``--config``) and the command line's overrides set, short
    flags resolved (`config.ALIASES`); a TOML file that cannot be read sets none here
    (`load_config` says why)."""
    keys: set[str] = set()
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            data = {}
        for section, values in data.items():
            if not isinstance(values, dict):
                keys.add(ALIASES.get(section, section))
                continue
            for key, value in values.items():
                subs = value if isinstance(value, dict) else {None: value}
                keys |= {f"{section}.{key}" + (f".{s}" if s else "") for s in subs}
    for arg in overrides:
        if arg.startswith("--"):
            key = arg[2:].split("=", 1)[0]
            keys.add(ALIASES.get(key, key))
    return keys


def _value(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".", 1)
    return getattr(getattr(cfg, section), key)


def fixed_keys(cfg: Config, given: Collection[str] | None) -> set[str]:
    """The searched keys (`plan.search.SEARCHED`) the user chose, which the search holds: those of
    ``given`` (the command line's and --config's, `given_keys`), or without it (a config built in
    code) those that differ from the defaults; "pipeline.schedule" when the schedule or its virtual
    stages were chosen. ``parallel.dp = -1`` ("the rest") holds nothing."""
    if given is None:
        default = Config()
        given = {k for k in (*SEARCHED, *PIPELINE_KEYS) if _value(cfg, k) != _value(default, k)}
    fixed = set(given) & set(SEARCHED)
    if cfg.parallel.dp == -1:
        fixed.discard("parallel.dp")
    if set(given) & set(PIPELINE_KEYS):
        fixed.add("pipeline.schedule")
    return fixed


def held_batch(cfg: Config, world: int) -> list[str]:
    """The overrides that hold `cfg`'s global batch and micro-batch as its own layout resolves
    them on `world` ranks; the accumulation is then derived per layout. A config that gives the
    accumulation and no micro-batch holds the accumulation instead; one whose own layout does not
    resolve (its degrees or batch do not fit that world) holds none: each candidate resolves the
    batch keys as given."""
    t, p = cfg.train, cfg.parallel
    try:
        dims = ParallelDims.of(p).resolve(world)
        global_batch, micro, accum = resolve_batch(
            t.global_batch, t.micro_batch, t.grad_accum, dims.dp
        )
    except ValueError:
        return []
    if t.grad_accum is not None and t.micro_batch is None:
        return ["--train.global_batch", str(global_batch), "--train.micro_batch", "none",
                "--train.grad_accum", str(accum)]  # fmt: skip
    return ["--train.global_batch", str(global_batch), "--train.micro_batch", str(micro),
            "--train.grad_accum", "none"]  # fmt: skip


@dataclasses.dataclass
class LayoutChoice:
    """What `choose` found: the chosen plan first, then its runners-up; the search's counts."""

    plans: list[LayoutPlan]
    hardware: Hardware
    world: int
    fixed: list[str]
    batch: list[str]  # `held_batch`'s overrides, applied before the layout's
    valid: int
    fitting: int

    def record(self) -> dict[str, Any]:
        """``layout_auto`` of fivefold.json: the chosen layout's overrides, predicted peak memory
        per GPU and step time, the hardware, the runners-up."""

        def entry(p: LayoutPlan) -> dict[str, Any]:
            return {
                "layout": p.layout,
                "overrides": list(p.overrides),
                "peak_bytes": p.peak_bytes,
                "step_s": p.time["step"],
                "tokens_per_s": p.time["tokens/s"],
            }

        return {
            "chosen": entry(self.plans[0]),
            "runners_up": [entry(p) for p in self.plans[1:]],
            "batch_overrides": list(self.batch),
            "hardware": json.loads(json.dumps(dataclasses.asdict(self.hardware))),  # as stored
            "world": self.world,
            "fixed": list(self.fixed),
            "valid": self.valid,
            "fitting": self.fitting,
        }

    def table(self) -> str:
        """The short table rank 0 prints before the workers start."""
        hw, p = self.hardware, self.plans[0]
        held = f"; kept as given: {', '.join(self.fixed)}" if self.fixed else ""
        return "\n".join(
            [
                f"{WHAT}: {self.fitting} of {self.valid} valid layouts fit on {self.world} × "
                f"{hw.name} ({hw.memory_gb:,.1f} GB, {hw.peak_tflops:.3g} TFLOP/s each); global "
                f"batch {p.global_batch} × {p.seq_len} tokens{held}; training #1:",
                *format_ranking(self.plans),
            ]
        )


def _nothing(
    found: Any, world: int, hw: Hardware, cfg: Config, fixed: list[str], refusal: str | None
) -> str:
    """The one line `choose` raises when no layout is left."""
    lead = "parallel.layout=auto: "
    held = (
        " with " + ", ".join(f"{k}={_value(cfg, k)}" for k in fixed) + " kept as given"
        if fixed
        else ""
    )
    drop = f"; or leave out {', '.join(fixed)} for the search to choose" if fixed else ""
    if found.valid == 0:
        return (
            f"{lead}no valid layout of {world} ranks for this model{held} ({found.total} "
            "candidates passed the rule table); change the number of ranks (run.nproc, or "
            f"torchrun's){drop}"
        )
    if found.fitting == 0:
        return (
            f"{lead}none of the {found.valid} valid layouts of {world} × {hw.name} fits in "
            f"{format_bytes(hw.memory_gb * GB)} per GPU{held}; use more ranks (run.nproc, or "
            f"torchrun's), a smaller train.micro_batch or train.seq_len, or a smaller model{drop}"
        )
    return (
        f"{lead}none of the {found.fitting} layouts that fit is accepted on this device: "
        f"{refusal}{drop}"
    )


def choose(
    cfg: Config,
    world: int,
    hardware: Hardware,
    given: Collection[str] | None = None,
    progress: Callable[[int, int, LayoutPlan | None], None] | None = None,
    device_type: str = "cpu",
) -> LayoutChoice:
    """The fastest layout of `world` ranks on `hardware` that fits and ``device_type`` accepts
    (`validate_layout` there: the search prices layouts for an accelerator), and the next
    `RUNNERS_UP`; a `ConfigError` line when none is left or the search was stopped (Ctrl-C)."""
    fixed = sorted(fixed_keys(cfg, given))
    batch = held_batch(cfg, world)
    base = apply_overrides(copy.deepcopy(cfg), batch)
    found = search(base, world, hardware, top=sys.maxsize, progress=progress, fixed=fixed)
    if found.stopped:
        raise ConfigError(
            f"parallel.layout=auto: the search was stopped after {found.tried} of {found.total} "
            "layouts (Ctrl-C); nothing was started"
        )
    chosen: list[LayoutPlan] = []
    refusal = None
    for plan in found.plans:
        try:
            validate_layout(
                apply_overrides(copy.deepcopy(base), plan.overrides), world, device_type
            )
        except ValueError as e:
            refusal = refusal or str(e)
            continue
        chosen.append(plan)
        if len(chosen) > RUNNERS_UP:
            break
    if not chosen:
        raise ConfigError(_nothing(found, world, hardware, cfg, fixed, refusal))
    return LayoutChoice(chosen, hardware, world, fixed, batch, found.valid, found.fitting)


def apply(cfg: Config, record: dict[str, Any]) -> Config:
    """`cfg` with a `LayoutChoice.record`'s batch and layout applied: a manual layout from now."""
    out = apply_overrides(
        copy.deepcopy(cfg), [*record["batch_overrides"], *record["chosen"]["overrides"]]
    )
    out.parallel.layout = "manual"
    return out


def resolve(
    cfg: Config,
    world: int,
    ranks_per_node: int,
    device_type: str,
    given: Collection[str] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> tuple[Config, dict[str, Any] | None]:
    """(the config to train, the choice's record): with ``parallel.layout = "auto"`` the search on
    this machine (`local_hardware` in the compute dtype), its progress on ``err`` and the table on
    ``out``; otherwise `cfg` as it is and None."""
    if cfg.parallel.layout != "auto":
        return cfg, None
    from fivefold.plan.assembly import precision_bytes

    try:  # (on the CPU measured once per machine: a short local launch of its own)
        hardware = local_hardware(device_type, precision_bytes(cfg)[0], ranks_per_node)
    except (OSError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"parallel.layout=auto could not measure this machine ({first}); give the layout "
            "(parallel.tp, pp, cp, dp, ep, zero.stage) yourself"
        ) from e
    progress = SearchProgress(
        err or sys.stderr, prefix=WHAT, on_stop="Ctrl-C stops it; nothing is trained"
    )
    try:
        choice = choose(cfg, world, hardware, given, progress, device_type)
    finally:
        progress.close()
    print(choice.table(), file=out or sys.stdout, flush=True)
    record = choice.record()
    return apply(cfg, record), record


def resolve_on_rank0(
    cfg: Config, world: int, ranks_per_node: int, device_type: str, given: Collection[str] | None
) -> tuple[Config, dict[str, Any] | None]:
    """`resolve` under torchrun (collective): rank 0 searches (the CPU's measured peak may differ
    between ranks, so the choice is made once), every rank takes its choice or raises its error."""
    if cfg.parallel.layout != "auto":
        return cfg, None
    import torch.distributed as dist

    shared: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            shared[0] = ("chosen", resolve(cfg, world, ranks_per_node, device_type, given)[1])
        except Exception as e:  # every rank stops: none waits for a choice that never comes
            failure = e
            shared[0] = ("error", str(e) if isinstance(e, ValueError) else repr(e))
    dist.broadcast_object_list(shared, src=0)
    kind, value = shared[0]
    if failure is not None:
        raise failure
    if kind == "error":
        raise ConfigError(value)
    return apply(cfg, value), value


def note(record: dict[str, Any], kept: bool = False) -> str:
    """The start-up line of a choice (``kept``: a resume's, made at the run's start)."""
    c, hw = record["chosen"], record["hardware"]
    again = " at the run's start (resumed without --layout auto: the layout kept)" if kept else ""
    return (
        f"parallel.layout=auto chose {c['layout']}{again}: predicted peak "
        f"{format_bytes(c['peak_bytes'])} per GPU, step {format_seconds(c['step_s'])} on "
        f"{record['world']} × {hw['name']}, the fastest of {record['fitting']} that fit "
        "(runners-up: layout_auto in fivefold.json)"
    )


def _still(cfg: Config, record: dict[str, Any]) -> bool:
    """Whether `cfg` is the layout `record` chose (every key its overrides set holds the value)."""
    try:
        trial = apply_overrides(copy.deepcopy(cfg), list(record["chosen"]["overrides"]))
        keys = [a[2:] for a in record["chosen"]["overrides"] if a.startswith("--")]
    except (ConfigError, KeyError, TypeError):
        return False
    return all(_value(trial, k) == _value(cfg, k) for k in keys)


def with_choice(plan: RunPlan, cfg: Config, record: dict[str, Any] | None) -> RunPlan:
    """`plan` with the choice `record` (`resolve`'s) as its start-up note and ``layout_auto``; with
    none, a resume's stored choice while `cfg` keeps its layout (a resume without --layout auto
    continues the layout it chose)."""
    kept = False
    if record is None and plan.resume_from is not None:
        from fivefold.checkpoint.manager import read_checkpoint_meta

        stored = read_checkpoint_meta(plan.resume_from).get("layout_auto")
        if isinstance(stored, dict) and _still(cfg, stored):
            record, kept = stored, True
    if record is None:
        return plan
    return dataclasses.replace(plan, layout_auto=record, notes=(*plan.notes, note(record, kept)))
