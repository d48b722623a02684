"""Names that files and users give, kept inside the directory they belong to; and how fivefold
replaces a file atomically with the mode the user's umask gives (`atomic_path`).

A checkpoint's manifest, a Hugging Face ``model.safetensors.index.json`` and a checkpoint root's
``latest`` pointer name files; a run's name names a directory under ``run.out_dir``. Each such name
is confined here: relative, without ``..``, and (once resolved, symlinks followed) inside its
directory, so a crafted file cannot make fivefold read, size or write anything elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

__all__ = [
    "PathOutside",
    "atomic_path",
    "atomic_write_bytes",
    "inside",
    "one_component",
    "user_file_mode",
]


class PathOutside(ValueError):
    """A name that leads out of the directory it must stay in."""


def inside(directory: str | Path, name: object, what: str) -> Path:
    """``directory / name`` if ``name`` is a relative path without ``..`` that resolves (symlinks
    followed) inside ``directory``; else `PathOutside` naming ``what`` the name is (the file that
    gave it)."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise PathOutside(f"{what} is named {name!r}, not a file name")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if PurePosixPath(name).is_absolute() or name.startswith(("/", "\\")) or ".." in parts:
        raise PathOutside(
            f"{what} is named {name!r}, outside {directory}: only names inside it are read"
        )
    base = Path(directory)
    path = base / name
    root = base.resolve()
    if not path.resolve().is_relative_to(root):
        raise PathOutside(
            f"{what}, {name!r}, is a symlink out of {directory}: only files inside it are read"
        )
    return path


def one_component(name: str, key: str) -> str:
    """``name`` if it is one non-empty path component (not ``.`` or ``..``, no separator); else
    `PathOutside`."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise PathOutside(
            f"{key}={name!r} must be one directory name (not empty, no '/', not '.' or '..'): it "
            "names the run's directory inside run.out_dir"
        )
    return name


def _umask() -> int:
    """This process's umask, read without changing it where the system says it (Linux: another
    thread, a background checkpoint writer, may be creating files meanwhile)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def user_file_mode() -> int:
    """The mode ``open()`` gives a new file: 0o666 less the umask (0644 under 022)."""
    return 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, suffix: str = ".tmp", fsync: bool = False
) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; when the block ends without an error it gets
    `user_file_mode` (a temporary file is created 0600, as tempfile and safetensors do), is fsynced
    if asked, and replaces ``path`` in one rename; on an error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # ".tmp-" in the name: what prepare clears of a stopped run
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-", suffix=suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, user_file_mode())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = False) -> None:
    """``data`` as the new content of ``path``, atomically (`atomic_path`)."""
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(data)
