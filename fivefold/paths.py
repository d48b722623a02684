"""Names that files and users give, kept inside the directory they belong to.

A checkpoint's manifest, a Hugging Face ``model.safetensors.index.json`` and a checkpoint root's
``latest`` pointer name files; a run's name names a directory under ``run.out_dir``. Each such name
is confined here: relative, without ``..``, and (once resolved, symlinks followed) inside its
directory, so a crafted file cannot make fivefold read, size or write anything elsewhere.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

__all__ = ["PathOutside", "inside", "one_component"]


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
