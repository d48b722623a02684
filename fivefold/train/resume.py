"""`--resume RUN` with nothing else: the run's stored config (the checkpoint's ``fivefold.json``
"config", written by `TrainCheckpoints.save`) is the base, what the user gives now (``--config``,
``--profile``, ``--section.key`` overrides) is laid over it, so only the keys given change. RUN is
a run directory, its checkpoints folder, a checkpoint, or "latest" (of the run the command line
names). The run's name and directory come from the stored config, so the run continues in place.
What may change is what a checkpoint allows (steps, the schedule, the layout: a reshard); a changed
model is refused by `validate` naming the field (`check_model_matches`)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from fivefold.checkpoint.manager import CheckpointError, find_checkpoint, read_checkpoint_meta
from fivefold.config import Config, load_config
from fivefold.train.checkpointing import checkpoint_root

__all__ = ["PER_INVOCATION", "resume_base", "resumed_config"]

# What belongs to one invocation, not to the run: never taken from the stored config (a resume
# stops after run.exit_after steps only if told again; trusting a pickle is asked for each time)
PER_INVOCATION = {"run": ("resume", "overwrite", "exit_after"), "checkpoint": ("trust",)}
BATCH_KEYS = ("global_batch", "micro_batch", "grad_accum")


def resume_base(cfg: Config) -> dict[str, Any] | None:
    """The stored config of the checkpoint ``cfg.run.resume`` names, less `PER_INVOCATION`'s keys;
    None when ``cfg`` is no resume or the checkpoint stores no config (an older fivefold's)."""
    if not cfg.run.resume or cfg.run.overwrite:  # (both: `validate` says they contradict)
        return None
    try:
        path = find_checkpoint(cfg.run.resume, checkpoint_root(cfg))
        stored = read_checkpoint_meta(path).get("config")
    except CheckpointError as e:
        raise CheckpointError(f"run.resume={cfg.run.resume}: {e}") from None
    if not isinstance(stored, dict):
        return None
    base = copy.deepcopy(stored)
    for section, keys in PER_INVOCATION.items():
        for key in keys:
            (base.get(section) or {}).pop(key, None)
    return base


def settle_batch(cfg: Config, base: dict[str, Any]) -> None:
    """The stored config holds all three batch numbers (resolved for its layout); under another
    layout they would contradict. Keep the ones the user gave (those that differ from the stored
    ones), fill up to two from the stored global batch, then micro-batch, and derive the third, so
    the global batch — the data each step reads — stays unless the user changes it."""
    t, stored = cfg.train, base.get("train") or {}
    keep = {k for k in BATCH_KEYS if getattr(t, k) != stored.get(k)}
    for key in ("global_batch", "micro_batch"):
        if len(keep) < 2:
            keep.add(key)
    if len(keep) < 3:
        for key in set(BATCH_KEYS) - keep:
            setattr(t, key, None)


def resumed_config(
    path: str | Path | None, overrides: list[str], profile: str | Path | None = None
) -> Config:
    """`load_config`'s result, over the stored config of the run it resumes (`resume_base`)."""
    cfg = load_config(path, overrides, profile=profile)
    base = resume_base(cfg)
    if base is None:
        return cfg
    cfg = load_config(path, overrides, profile=profile, base=base)
    settle_batch(cfg, base)
    return cfg
