"""`Checkpointer`: where checkpoints live, how one is written atomically and which one a resume
reads.

A checkpoint is a directory ``<root>/step-<NNNNNNNN>`` holding DCP's files (one or more ``.distcp``
per rank and ``.metadata``) and ``fivefold.json`` (step, layout, model config: what
`fivefold export` and error messages need). Every rank writes into ``<root>/.partial-step-<N>``;
once DCP's last collective has returned (all data and the metadata are on disk) rank 0 renames it to
its final name and then points ``<root>/latest`` at it (written to a temporary file and renamed), so
a directory without ``.partial`` in its name is complete and ``latest`` never names a half-written
one. Keep-last-k rotation removes older complete checkpoints after that. With ``async_save`` the
state is copied to host memory (`fivefold.checkpoint.snapshot`: on an accelerator into pinned
buffers reused across saves, copies asynchronous and one wait) and the same DCP save runs on a
background thread over a process group of its own (so its collectives never interleave with
training's), as DCP's ``async_save`` does; at most one save is in flight. ``fivefold.json`` lists
every file with its size and SHA-256; a load checks them first.

Loading executes nothing the checkpoint holds: DCP's metadata is read from ``dcp-metadata.json``
(`fivefold.checkpoint.metadata`), objects with ``torch.load(weights_only=True)``, and every name a
file gives — the ``latest`` pointer, the manifest's file names, DCP's data files — must be a plain
entry of its own directory, not a symlink out of it. Before a save rank 0 checks the file system has
room for it; a save that fails anyway removes its ``.partial`` directory and says why in one line
(`CheckpointSaveError`; no space left: ENOSPC, the path, the sizes).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
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

from fivefold.checkpoint.metadata import (
    DCP_METADATA,
    DamagedMetadata,
    JsonMetadataWriter,
    SafeReader,
    UntrustedCheckpoint,
    read_safe_metadata,
)
from fivefold.checkpoint.pieces import Pieces
from fivefold.checkpoint.planner import PiecesLoadPlanner, PiecesSavePlanner
from fivefold.checkpoint.snapshot import HostCopy, Snapshot
from fivefold.paths import PathOutside, atomic_write_bytes, inside

__all__ = [
    "CHECKPOINT_META",
    "Checkpointer",
    "CheckpointError",
    "CheckpointSaveError",
    "UntrustedCheckpoint",
    "check_loadable",
    "find_checkpoint",
    "read_checkpoint_meta",
]

CHECKPOINT_META = "fivefold.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, incomplete or damaged (the message says which and
    where)."""


class CheckpointSaveError(CheckpointError):
    """A save that failed (its ``.partial`` directory removed; the last complete checkpoint
    stays)."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()
    ]  # (a symlink leads elsewhere)
    return [
        p
        for _, p in sorted(found)
        if (p / ".metadata").is_file() and (p / CHECKPOINT_META).is_file()
    ]


def read_checkpoint_meta(path: Path) -> dict[str, Any]:
    meta = path / CHECKPOINT_META
    try:
        out = json.loads(meta.read_text())
        if not isinstance(out, dict):
            raise json.JSONDecodeError("not a JSON object", "", 0)
        return out
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a complete fivefold checkpoint (no {CHECKPOINT_META}); a checkpoint "
            "directory whose name starts with .partial- was never finished"
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta} is damaged ({e})") from None


def find_checkpoint(where: str | Path, root: Path | None = None) -> Path:
    """``where``: "latest" (the newest complete checkpoint under ``root``), a checkpoint directory,
    or a run's checkpoint root (its newest)."""
    if str(where) == "latest":
        if root is None:
            raise CheckpointError("--resume latest needs a run directory")
        pointer = root / "latest"
        if pointer.is_file():
            name = pointer.read_text().strip()
            if (
                not _STEP_DIR.fullmatch(name) or (root / name).is_symlink()
            ):  # a step directory of this root only
                raise CheckpointError(
                    f"{pointer} names {name[:80]!r}, which is not a step-N directory of {root}: "
                    "fivefold writes only those there; delete the file to resume from the newest "
                    "complete checkpoint"
                )
            path = root / name
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
    for root in (
        path,
        path / "checkpoints",
    ):  # a checkpoint folder or a run directory: what its latest names
        if (root / "latest").is_file() and complete_checkpoints(root):
            return find_checkpoint("latest", root)
    done = complete_checkpoints(path) or complete_checkpoints(path / "checkpoints")
    if not done:
        raise CheckpointError(
            f"{path} holds no complete fivefold checkpoint (a step-N directory with "
            f"{CHECKPOINT_META} and DCP's .metadata)"
        )
    return done[-1]


def _file_digest(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def verify_files(path: Path, meta: dict[str, Any], rank: int = 0, world: int = 1) -> list[str]:
    """Problems with the checkpoint's files against the manifest in its ``fivefold.json``: every
    file's size, and the SHA-256 of this rank's share of them (file i is checked by rank i mod
    world)."""
    files = meta.get("files")
    if files is None:
        return [f"{path / CHECKPOINT_META} lists no files"]
    if not isinstance(files, dict):
        return [f"{path / CHECKPOINT_META}: its file list is damaged"]
    problems = []
    for i, (name, want) in enumerate(sorted(files.items())):
        try:
            f = inside(path, name, f"a file that {path / CHECKPOINT_META} lists")
        except PathOutside as e:
            problems.append(str(e))
            continue
        if not isinstance(want, dict) or not isinstance(want.get("bytes"), int):
            problems.append(f"{path / CHECKPOINT_META}: the entry of {name} is damaged")
        elif not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(
                f"{f} has {f.stat().st_size} bytes, {want['bytes']} were written (truncated or "
                "replaced)"
            )
        elif i % world == rank and _file_digest(f)["sha256"] != want["sha256"]:
            problems.append(f"{f} does not match its SHA-256 (damaged)")
    return problems


class Checkpointer:
    """Saves and finds this run's checkpoints under ``root`` (every rank constructs one, in the same
    order: with ``async_save`` it creates the background process group, a collective)."""

    def __init__(
        self,
        root: Path,
        keep: int = 3,
        async_save: bool = False,
        snapshot: Snapshot | None = None,
    ) -> None:
        self.root = root
        self.keep = keep
        self.async_save = async_save
        # how a background save's host copy is taken (`snapshot_for(device)`: pinned, reused
        # buffers on an accelerator)
        self.snapshot = snapshot if snapshot is not None else HostCopy()
        self.rank = dist.get_rank()
        self._group = dist.new_group(backend="gloo") if async_save else None
        self._writer = (
            ThreadPoolExecutor(1, thread_name_prefix="fivefold-ckpt") if async_save else None
        )
        self._pending: Future | None = None

    def save(self, step: int, state_dict: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write the checkpoint of ``step`` (``state_dict``: `training_state`'s plus plain objects);
        ``meta`` goes to ``fivefold.json``. Collective. Async: returns once the state is copied to
        host memory. Raises `CheckpointSaveError` (on every rank) when the file system lacks room or
        the write fails."""
        self.wait()  # one save in flight at a time
        final = _step_dir(self.root, step)
        partial = self.root / f".partial-{final.name}"
        need = _checkpoint_bytes(state_dict)
        problem: list = [None]
        if self.rank == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)  # a save that died before finishing
                free = shutil.disk_usage(self.root).free
                if free < need:
                    problem[0] = (
                        f"no space for checkpoint {final}: it needs {_mib(need)}, {self.root} has "
                        f"{_mib(free)} free (ENOSPC ahead); free space there or set checkpoint.dir "
                        "to a larger disk"
                    )
                else:
                    partial.mkdir()
            except OSError as e:
                problem[0] = f"cannot create checkpoint {final}: {_os_error(e)}"
        dist.broadcast_object_list(
            problem, src=0
        )  # every rank learns it (and none starts writing before)
        if problem[0] is not None:
            raise CheckpointSaveError(problem[0])
        if self._writer is not None:
            snapshot = self.snapshot.take(state_dict)
            self._pending = self._writer.submit(
                self._write, snapshot, partial, final, step, meta, self._group, need
            )
        else:
            self._write(state_dict, partial, final, step, meta, None, need)

    def _write(
        self,
        state_dict: dict[str, Any],
        partial: Path,
        final: Path,
        step: int,
        meta: dict[str, Any],
        group: dist.ProcessGroup | None,
        need: int,
    ) -> None:
        try:
            dcp.save(
                state_dict,
                storage_writer=JsonMetadataWriter(partial),
                planner=PiecesSavePlanner(),
                process_group=group,
            )
        except (
            CheckpointException,
            OSError,
            RuntimeError,
        ) as e:  # DCP raises on every rank when one fails
            dist.barrier(group=group)  # no rank still writing into it
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointSaveError(_save_failure(final, self.root, e, need)) from None
        # every rank fingerprints its own files; rank 0 also DCP's metadata
        mine = {f.name: _file_digest(f) for f in sorted(partial.glob(f"__{self.rank}_*"))}
        if self.rank == 0:
            for name in (".metadata", DCP_METADATA):
                mine[name] = _file_digest(partial / name)
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        outcome: list = [None]
        if (
            self.rank == 0
        ):  # all data and DCP's metadata are on disk: complete the checkpoint, then point at it
            try:
                files = {name: digest for part in every for name, digest in part.items()}
                _write_durably(
                    partial / CHECKPOINT_META,
                    json.dumps({"step": step, **meta, "files": files}, indent=1),
                )
                _fsync_dir(partial)
                stale = self.root / f".replaced-{final.name}"
                if (
                    final.exists()
                ):  # the same step again (a resume from an older checkpoint): moved, then removed
                    shutil.rmtree(stale, ignore_errors=True)
                    os.replace(final, stale)
                os.replace(partial, final)
                atomic_write_bytes(self.root / "latest", f"{final.name}\n".encode(), fsync=True)
                _fsync_dir(self.root)  # the renames survive a power loss once "saved" is said
                shutil.rmtree(stale, ignore_errors=True)
                self._rotate(keep_also=final)
            except OSError as e:
                shutil.rmtree(partial, ignore_errors=True)
                outcome[0] = _save_failure(final, self.root, e, need)
        dist.broadcast_object_list(
            outcome, src=0, group=group
        )  # every rank learns the outcome (no one waits on)
        if outcome[0] is not None:
            raise CheckpointSaveError(outcome[0])

    def wait(self) -> None:
        """Finish a background save (raises its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _rotate(self, keep_also: Path) -> None:
        if self.keep <= 0:
            return
        done = complete_checkpoints(self.root)
        for old in done[: -self.keep]:
            if old != keep_also:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def verify(path: Path) -> None:
        """Check the checkpoint's files against its manifest (sizes everywhere, the SHA-256 of each
        file on one rank). Collective: every rank raises the same error if one is wrong."""
        meta = read_checkpoint_meta(path)
        mine = verify_files(path, meta, dist.get_rank(), dist.get_world_size())
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        problems = sorted({p for part in every for p in part})
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems[:5]))

    @staticmethod
    def load(
        path: Path, state_dict: dict[str, Any], verified: bool = False, trust: bool = False
    ) -> None:
        """Fill ``state_dict`` (`training_state`'s, plus plain objects) from the checkpoint at
        ``path``; each rank reads only the rectangles its layout holds. Collective; `verify` first
        unless ``verified``. The metadata is read from its JSON; a checkpoint with only DCP's pickle
        needs ``trust`` (`UntrustedCheckpoint`)."""
        if not verified:
            Checkpointer.verify(path)
        try:
            dcp.load(
                state_dict, storage_reader=SafeReader(path, trust), planner=PiecesLoadPlanner()
            )
        except (
            CheckpointException
        ) as e:  # DCP gathers every rank's error: raise the first one, plainly
            rank, (error, _) = min(e.failures.items())
            if isinstance(error, ValueError):
                raise type(error)(f"checkpoint {path}: {error}") from None
            raise CheckpointError(
                f"checkpoint {path} could not be read (rank {rank}): {error!r}"
            ) from None

    @staticmethod
    def saved_optimizer_keys(
        path: Path, trust: bool = False
    ) -> tuple[list[str], dict[str, torch.dtype]]:
        """(elementwise keys, scalar keys -> dtype) of the optimizer state in the checkpoint at
        ``path``."""
        md = read_safe_metadata(path, trust).state_dict_metadata
        elementwise, scalars = [], {}
        for fqn, m in md.items():
            if fqn.startswith("optim."):
                key = fqn.split(".")[1]
                if len(m.size) > 0:
                    elementwise.append(key) if key not in elementwise else None
                else:
                    scalars[key] = m.properties.dtype
        return elementwise, scalars


def check_loadable(path: Path, trust: bool = False) -> None:
    """The checkpoint's metadata can be read without executing anything (or ``trust`` says so): its
    JSON parses and names only its own data files. Raises `UntrustedCheckpoint` or
    `CheckpointError`."""
    try:
        read_safe_metadata(path, trust)
    except DamagedMetadata as e:
        raise CheckpointError(str(e)) from None


def _checkpoint_bytes(state_dict: dict[str, Any]) -> int:
    """What the checkpoint of ``state_dict`` takes on disk: every global tensor once (replicas write
    one copy) plus DCP's per-item framing; every rank's names are gathered (pipeline stages hold
    different ones). Collective."""
    mine: dict[str, int] = {}
    for fqn, v in state_dict.items():
        if isinstance(v, Pieces):
            mine[fqn] = math.prod(v.size) * v.dtype.itemsize + (1 + len(v.boxes)) * _ITEM_OVERHEAD
        elif isinstance(v, torch.Tensor):
            mine[fqn] = v.numel() * v.element_size() + _ITEM_OVERHEAD
        else:
            mine[fqn] = 64 << 10  # an object: RNG states, the loss scaler
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    union = {k: v for part in every for k, v in part.items()}
    return sum(union.values()) + _ITEM_OVERHEAD * len(union)  # (+ both metadata files)


# torch.save's zip framing of one item, and its metadata entries (measured: ~1.6 KB)


_ITEM_OVERHEAD = 2048


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _os_error(e: OSError) -> str:
    name = errno.errorcode.get(e.errno or 0, "")
    return (
        f"{e.strerror or e}"
        + (f" ({name})" if name else "")
        + (f": {e.filename}" if e.filename else "")
    )


def _save_failure(final: Path, root: Path, error: BaseException, need: int) -> str:
    """One line for a failed save: ENOSPC with the path and the sizes when the disk is full (DCP's
    zip writer reports a short write as ``unexpected pos``; the free space tells), else the first
    error."""
    causes = list(getattr(error, "failures", {}).values()) or [(error, None)]
    first = causes[0][0] if isinstance(causes[0], tuple) else causes[0]
    chain = [first]
    while chain[-1].__cause__ or chain[-1].__context__:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    full = any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in chain) or (
        free is not None and free < max(need // 100, 4 << 20)
    )
    if full:
        return (
            f"checkpoint {final} was not saved: no space left on device (ENOSPC) on {root} "
            f"({_mib(free or 0)} free, the checkpoint needs {_mib(need)}); its partial files were "
            "removed and the last complete checkpoint stays. Free space there or set "
            "checkpoint.dir to a larger disk"
        )
    what = _os_error(first) if isinstance(first, OSError) else f"{type(first).__name__}: {first}"
    return f"checkpoint {final} was not saved ({what}); its partial files were removed"


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """A rename is durable once its directory is synced (POSIX); where a directory cannot be opened,
    nothing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
