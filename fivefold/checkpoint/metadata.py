"""DCP's checkpoint metadata as JSON, so that loading a checkpoint executes nothing it holds.

DCP writes its `Metadata` (which tensors, their chunks, which file and byte range holds each) with
`pickle` into ``.metadata`` and reads it back with ``pickle.load``; its default planner reads every
non-tensor object with ``torch.load(weights_only=False)``. Either runs whatever code a crafted
checkpoint carries. fivefold's checkpoints carry the same metadata as JSON in ``dcp-metadata.json``
(`JsonMetadataWriter` writes it beside DCP's own file, which stays for torch's tools), and fivefold
reads only that (`SafeReader`): the loader builds DCP's `Metadata` from plain numbers and strings,
checked field by field, every file name confined to the checkpoint directory. JSON written by
fivefold was chosen over a restricted unpickler because its safety does not depend on which classes
an allow-list admits (each admitted class's constructor would run with arguments the file chose) and
because the format is fivefold's own, stable across torch versions. Objects (RNG states, the loss
scaler) are read with ``torch.load(weights_only=True)`` (`PiecesLoadPlanner.load_bytes`).

A checkpoint without ``dcp-metadata.json`` (written by another DCP user, or by fivefold before this
format) is refused unless the caller trusts it (``--trust-checkpoint``): then DCP's pickle is read,
as DCP itself does.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fivefold.paths import atomic_write_bytes

__all__ = [
    "DCP_METADATA",
    "JsonMetadataWriter",
    "SafeReader",
    "UntrustedCheckpoint",
    "metadata_from_json",
    "metadata_to_json",
    "read_safe_metadata",
]

DCP_METADATA = "dcp-metadata.json"
FORMAT = "fivefold-dcp-metadata"
VERSION = 1
_DATA_FILE = re.compile(
    r"^__\d+_\d+\.distcp$"
)  # the only files DCP's FileSystemWriter writes data into
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


class UntrustedCheckpoint(ValueError):
    """A checkpoint whose metadata only DCP's pickle holds: loading it could run code it carries."""


class DamagedMetadata(ValueError):
    """``dcp-metadata.json`` is not what fivefold writes (the message says which field)."""


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    ):
        raise DamagedMetadata(f"{what} must be a list of non-negative integers, not {value!r}")
    return value


def metadata_to_json(md: Metadata) -> dict[str, Any]:
    """DCP's `Metadata` of a fivefold save as plain JSON values (tensors: dtype, size, chunks;
    objects: names; storage: file name and byte range of every item)."""
    tensors, objects = {}, []
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            tensors[fqn] = {
                "dtype": str(m.properties.dtype).removeprefix("torch."),
                "size": list(m.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks],
            }
        elif isinstance(m, BytesStorageMetadata):
            objects.append(fqn)
        else:
            raise TypeError(f"{fqn}: DCP metadata of type {type(m).__name__} has no JSON form")
    storage = []
    for index, info in md.storage_data.items():
        if info.transform_descriptors:
            raise TypeError(
                f"{index.fqn}: stored with transforms {info.transform_descriptors}, which fivefold "
                "does not write"
            )
        storage.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "file": info.relative_path,
                "at": info.offset,
                "length": info.length,
            }
        )
    if md.planner_data not in (None, {}):
        raise TypeError(
            f"planner data {md.planner_data!r} has no JSON form (fivefold's planners write none)"
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "dcp_version": md.version,
        "tensors": tensors,
        "objects": objects,
        "storage": storage,
    }


def metadata_from_json(d: Any) -> Metadata:
    """The inverse of `metadata_to_json`, checking every field's type; data files must be DCP's own
    ``__<rank>_<n>.distcp`` names inside the checkpoint directory."""
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise DamagedMetadata(f"not a {FORMAT} file")
    if d.get("version") != VERSION:
        raise DamagedMetadata(
            f"format version {d.get('version')!r}; this fivefold reads version {VERSION} "
            "(written by a newer fivefold?)"
        )
    tensors, objects, storage = d.get("tensors"), d.get("objects"), d.get("storage")
    if (
        not isinstance(tensors, dict)
        or not isinstance(objects, list)
        or not isinstance(storage, list)
    ):
        raise DamagedMetadata("tensors, objects and storage must be an object and two lists")
    state: dict[str, Any] = {}
    for fqn, t in tensors.items():
        if (
            not isinstance(t, dict)
            or t.get("dtype") not in _DTYPES
            or not isinstance(t.get("chunks"), list)
        ):
            raise DamagedMetadata(f"tensor {fqn!r}: {t!r}")
        chunks = []
        for c in t["chunks"]:
            if not isinstance(c, list) or len(c) != 2:
                raise DamagedMetadata(f"tensor {fqn!r}: chunk {c!r}")
            chunks.append(
                ChunkStorageMetadata(
                    offsets=torch.Size(_ints(c[0], f"{fqn} chunk offsets")),
                    sizes=torch.Size(_ints(c[1], f"{fqn} chunk sizes")),
                )
            )
        state[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=_DTYPES[t["dtype"]]),
            size=torch.Size(_ints(t.get("size"), f"{fqn} size")),
            chunks=chunks,
        )
    for fqn in objects:
        if not isinstance(fqn, str) or fqn in state:
            raise DamagedMetadata(f"object name {fqn!r}")
        state[fqn] = BytesStorageMetadata()
    data: dict[MetadataIndex, _StorageInfo] = {}
    for s in storage:
        if not isinstance(s, dict) or s.get("fqn") not in state:
            raise DamagedMetadata(f"storage entry {s!r} names no saved tensor or object")
        name = s.get("file")
        if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
            raise DamagedMetadata(
                f"storage of {s['fqn']!r} names the file {name!r}: only DCP's __<rank>_<n>.distcp "
                "files in the checkpoint directory are read"
            )
        offset = (
            None
            if s.get("offset") is None
            else torch.Size(_ints(s["offset"], f"{s['fqn']} offset"))
        )
        index = s.get("index")
        if index is not None and (
            not isinstance(index, int) or isinstance(index, bool) or index < 0
        ):
            raise DamagedMetadata(f"storage of {s['fqn']!r}: index {index!r}")
        at, length = _ints([s.get("at"), s.get("length")], f"{s['fqn']} byte range")
        data[MetadataIndex(s["fqn"], offset, index)] = _StorageInfo(
            relative_path=name, offset=at, length=length
        )
    return Metadata(
        state_dict_metadata=state,
        planner_data=None,
        storage_data=data,
        storage_meta=StorageMeta(),
        version=d.get("dcp_version") if isinstance(d.get("dcp_version"), str) else None,
    )


def read_safe_metadata(path: Path, trust: bool = False) -> Metadata:
    """The checkpoint's DCP metadata from its JSON; without one, DCP's pickle only when
    ``trust``."""
    src = Path(path) / DCP_METADATA
    try:
        text = src.read_text()
    except FileNotFoundError:
        if not trust:
            raise UntrustedCheckpoint(
                f"checkpoint {path} has no {DCP_METADATA}: its metadata is a pickle (DCP's "
                ".metadata, written by another DCP program or by a fivefold older than this "
                "format), and reading it can run any code the file carries. Load it only if you "
                "trust where it came from, with --trust-checkpoint (a fivefold checkpoint saved "
                "after that is in the safe format)"
            ) from None
        return FileSystemReader(path).read_metadata()
    try:
        return metadata_from_json(json.loads(text))
    except (json.JSONDecodeError, DamagedMetadata) as e:
        raise DamagedMetadata(f"checkpoint {path}: {src.name} is damaged ({e})") from None


class JsonMetadataWriter(FileSystemWriter):
    """DCP's `FileSystemWriter`, also writing the metadata as ``dcp-metadata.json`` (atomically,
    fsynced)."""

    def finish(self, metadata: Metadata, results: list) -> None:
        super().finish(metadata, results)  # fills metadata.storage_data, writes DCP's .metadata
        data = json.dumps(metadata_to_json(metadata)).encode()
        atomic_write_bytes(Path(self.path) / DCP_METADATA, data, fsync=True)


class SafeReader(FileSystemReader):
    """DCP's `FileSystemReader` reading the metadata from ``dcp-metadata.json``
    (`read_safe_metadata`)."""

    def __init__(self, path: str | os.PathLike, trust: bool = False) -> None:
        super().__init__(path)
        self.trust = trust

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_safe_metadata(Path(self.path), self.trust)
        md.storage_meta = md.storage_meta or StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
