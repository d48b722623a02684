"""`Checkpointer`: where checkpoints live, how one is written atomically and which one a resume reads.

A checkpoint is a directory ``<root>/step-<NNNNNNNN>`` holding DCP's files (one or more ``.distcp`` per rank and
``.metadata``) and ``fivefold.json`` (step, layout, model config: what `fivefold export` and error messages need).
Every rank writes into ``<root>/.partial-step-<N>``; once DCP's last collective has returned (all data and the
metadata are on disk) rank 0 renames it to its final name and then points ``<root>/latest`` at it (written to a
temporary file and renamed), so a directory without ``.partial`` in its name is complete and ``latest`` never names
a half-written one. Keep-last-k rotation removes older complete checkpoints after that. With ``async_save`` the
state is copied to host memory (`Pieces.snapshot`) and the same DCP save runs on a background thread over a process
group of its own (so its collectives never interleave with training's), as DCP's ``async_save`` does; at most one save
is in flight. ``fivefold.json`` lists every file with its size and SHA-256; a load checks them first.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from fivefold.checkpoint.pieces import Pieces
from fivefold.checkpoint.planner import PiecesLoadPlanner, PiecesSavePlanner

__all__ = ["CHECKPOINT_META", "Checkpointer", "CheckpointError", "find_checkpoint", "read_checkpoint_meta"]

CHECKPOINT_META = "fivefold.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete or damaged (the message says which and where)."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found) if (p / ".metadata").is_file() and (p / CHECKPOINT_META).is_file()]


def read_checkpoint_meta(path: Path) -> dict[str, Any]:
    meta = path / CHECKPOINT_META
    try:
        return json.loads(meta.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete fivefold checkpoint (no {CHECKPOINT_META}); a checkpoint "
                              "directory whose name starts with .partial- was never finished") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta} is damaged ({e})") from None


def find_checkpoint(where: str | Path, root: Path | None = None) -> Path:
    """``where``: "latest" (the newest complete checkpoint under ``root``), a checkpoint directory, or a run's
    checkpoint root (its newest)."""
    if str(where) == "latest":
        if root is None:
            raise CheckpointError("--resume latest needs a run directory")
        pointer = root / "latest"
        if pointer.is_file():
            path = root / pointer.read_text().strip()
            if (path / CHECKPOINT_META).is_file():
                return path
        done = complete_checkpoints(root)
        if not done:
            raise CheckpointError(f"no complete checkpoint under {root} to resume from")
        return done[-1]
    path = Path(where)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / CHECKPOINT_META).is_file():
        return path
    for root in (path, path / "checkpoints"):  # a checkpoint folder or a run directory: what its latest names
        if (root / "latest").is_file() and complete_checkpoints(root):
            return find_checkpoint("latest", root)
    done = complete_checkpoints(path) or complete_checkpoints(path / "checkpoints")
    if not done:
        raise CheckpointError(f"{path} holds no complete fivefold checkpoint (a step-N directory with "
                              f"{CHECKPOINT_META} and DCP's .metadata)")
    return done[-1]


def _snapshot(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state copied to host memory, so training may change it while a background save writes the copy."""
    return {k: v.snapshot() if isinstance(v, Pieces) else
            v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in state_dict.items()}


def _file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def verify_files(path: Path, meta: dict[str, Any], rank: int = 0, world: int = 1) -> list[str]:
    """Problems with the checkpoint's files against the manifest in its ``fivefold.json``: every file's size, and
    the SHA-256 of this rank's share of them (file i is checked by rank i mod world)."""
    files = meta.get("files")
    if files is None:
        return [f"{path / CHECKPOINT_META} lists no files"]
    problems = []
    for i, (name, want) in enumerate(sorted(files.items())):
        f = path / name
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"{f} has {f.stat().st_size} bytes, {want['bytes']} were written (truncated or replaced)")
        elif i % world == rank and _file_digest(f)["sha256"] != want["sha256"]:
            problems.append(f"{f} does not match its SHA-256 (damaged)")
    return problems


class Checkpointer:
    """Saves and finds this run's checkpoints under ``root`` (every rank constructs one, in the same order: with
    ``async_save`` it creates the background process group, a collective)."""

    def __init__(self, root: Path, keep: int = 3, async_save: bool = False) -> None:
        self.root = root
        self.keep = keep
        self.async_save = async_save
        self.rank = dist.get_rank()
        self._group = dist.new_group(backend="gloo") if async_save else None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="fivefold-ckpt") if async_save else None
        self._pending: Future | None = None

    def save(self, step: int, state_dict: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write the checkpoint of ``step`` (``state_dict``: `training_state`'s plus plain objects); ``meta`` goes
        to ``fivefold.json``. Collective. Async: returns once the state is copied to host memory."""
        self.wait()  # one save in flight at a time
        final = _step_dir(self.root, step)
        partial = self.root / f".partial-{final.name}"
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a save that died before finishing
            partial.mkdir()
        dist.barrier()
        if self._writer is not None:
            snapshot = _snapshot(state_dict)
            self._pending = self._writer.submit(self._write, snapshot, partial, final, step, meta, self._group)
        else:
            self._write(state_dict, partial, final, step, meta, None)

    def _write(self, state_dict: dict[str, Any], partial: Path, final: Path, step: int, meta: dict[str, Any],
               group: dist.ProcessGroup | None) -> None:
        dcp.save(state_dict, checkpoint_id=partial, planner=PiecesSavePlanner(), process_group=group)
        # every rank fingerprints its own files; rank 0 also DCP's metadata
        mine = {f.name: _file_digest(f) for f in sorted(partial.glob(f"__{self.rank}_*"))}
        if self.rank == 0:
            mine[".metadata"] = _file_digest(partial / ".metadata")
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        outcome: list = [None]
        if self.rank == 0:  # all data and DCP's metadata are on disk: complete the checkpoint, then point at it
            try:
                files = {name: digest for part in every for name, digest in part.items()}
                (partial / CHECKPOINT_META).write_text(json.dumps({"step": step, **meta, "files": files}, indent=1))
                stale = self.root / f".replaced-{final.name}"
                if final.exists():  # the same step again (a resume from an older checkpoint): moved, then removed
                    shutil.rmtree(stale, ignore_errors=True)
                    os.replace(final, stale)
                os.replace(partial, final)
                tmp = self.root / ".latest.tmp"
                tmp.write_text(final.name + "\n")
                os.replace(tmp, self.root / "latest")
                shutil.rmtree(stale, ignore_errors=True)
                self._rotate(keep_also=final)
            except OSError as e:
                outcome[0] = f"rank 0 could not complete checkpoint {final}: {e}"
        dist.broadcast_object_list(outcome, src=0, group=group)  # every rank learns the outcome (no one waits on)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0])

    def wait(self) -> None:
        """Finish a background save (raises its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _rotate(self, keep_also: Path) -> None:
        if self.keep <= 0:
            return
        done = complete_checkpoints(self.root)
        for old in done[:-self.keep]:
            if old != keep_also:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def verify(path: Path) -> None:
        """Check the checkpoint's files against its manifest (sizes everywhere, the SHA-256 of each file on one
        rank). Collective: every rank raises the same error if one is wrong."""
        meta = read_checkpoint_meta(path)
        mine = verify_files(path, meta, dist.get_rank(), dist.get_world_size())
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        problems = sorted({p for part in every for p in part})
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems[:5]))

    @staticmethod
    def load(path: Path, state_dict: dict[str, Any], verified: bool = False) -> None:
        """Fill ``state_dict`` (`training_state`'s, plus plain objects) from the checkpoint at ``path``; each rank
        reads only the rectangles its layout holds. Collective; `verify` first unless ``verified``."""
        if not verified:
            Checkpointer.verify(path)
        try:
            dcp.load(state_dict, checkpoint_id=path, planner=PiecesLoadPlanner())
        except CheckpointException as e:  # DCP gathers every rank's error: raise the first one, plainly
            rank, (error, _) = min(e.failures.items())
            if isinstance(error, ValueError):
                raise type(error)(f"checkpoint {path}: {error}") from None
            raise CheckpointError(f"checkpoint {path} could not be read (rank {rank}): {error!r}") from None

    @staticmethod
    def saved_optimizer_keys(path: Path) -> tuple[list[str], dict[str, torch.dtype]]:
        """(elementwise keys, scalar keys -> dtype) of the optimizer state in the checkpoint at ``path``."""
        md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        elementwise, scalars = [], {}
        for fqn, m in md.items():
            if fqn.startswith("optim."):
                key = fqn.split(".")[1]
                if len(m.size) > 0:
                    elementwise.append(key) if key not in elementwise else None
                else:
                    scalars[key] = m.properties.dtype
        return elementwise, scalars
