"""DCP planners that write and read `Pieces`: every rectangle a rank holds is one DCP chunk of the
global tensor.

Saving, each rectangle becomes a ``WriteItem`` at its global offsets; DCP's coordinator drops the
copies that replicas (dp under ZeRO-0, tp for replicated weights, ep_dp for experts, dp_replicate
under HSDP) write at the same offsets and checks that the chunks neither overlap nor leave a hole.
Loading, each rectangle asks DCP for its overlap with whatever chunks the writer's layout left
(`create_read_items_for_chunk_list`), so any layout reads any other's checkpoint, each rank reading
only its slices. Plain tensors in the state dict keep DCP's default handling; objects are read with
``torch.load(weights_only=True)``, never DCP's full unpickling.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from fivefold.checkpoint.pieces import Pieces

__all__ = ["CheckpointMismatch", "PiecesLoadPlanner", "PiecesSavePlanner"]


class CheckpointMismatch(ValueError):
    """The checkpoint does not hold what this run needs (a missing tensor, another shape or
    dtype)."""


class _PiecesPlanner:
    """What both planners share: flat state dicts (with ``_flags``, the planner's own); its
    `Pieces` values kept in ``self.pieces`` (DCP's own walk skips them), DCP's planner set up with
    the rest; ``self.caller_state_dict`` the whole dict."""

    _flags: dict[str, bool]

    def __init__(self) -> None:
        super().__init__(  # type: ignore[call-arg]
            flatten_state_dict=False, flatten_sharded_tensors=False, **self._flags
        )

    def _set_up(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self.pieces = {k: v for k, v in state_dict.items() if isinstance(v, Pieces)}
        self.caller_state_dict = state_dict
        rest = {k: v for k, v in state_dict.items() if k not in self.pieces}
        super().set_up_planner(rest, *args, **kwargs)  # type: ignore[misc]


def _box(pieces: Pieces, index: MetadataIndex) -> torch.Tensor:
    key = tuple(index.offset) if index.offset is not None else ()
    try:
        return pieces.boxes[key]
    except KeyError:
        raise KeyError(f"{index.fqn}: this rank holds no box at offsets {key}") from None


class PiecesSavePlanner(_PiecesPlanner, DefaultSavePlanner):
    """`DefaultSavePlanner` that also writes `Pieces` values as their rectangles. Flat state dicts
    only."""

    # replicas' copies of a tensor are written once, by the rank that has written least so far (not
    # all by rank 0)
    _flags = {"dedup_save_to_lowest_rank": False}

    # DCP reads this signature (it warns, once per save, about a planner without storage_meta)
    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: Any = None,
        is_coordinator: bool = False,
    ) -> None:
        self._set_up(state_dict, storage_meta=storage_meta, is_coordinator=is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for fqn, pieces in self.pieces.items():
            for offsets, values in pieces.boxes.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=values.shape)
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=chunk,
                            properties=TensorProperties(dtype=pieces.dtype),
                            size=pieces.size,
                        ),
                    )
                )
        self.plan = SavePlan(
            list(plan.items) + items, planner_data=plan.planner_data, storage_data=plan.storage_data
        )
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.pieces:
            return _box(self.pieces[index.fqn], index)
        return super().lookup_object(index)


class PiecesLoadPlanner(_PiecesPlanner, DefaultLoadPlanner):
    """`DefaultLoadPlanner` that fills `Pieces` values from whichever saved chunks overlap their
    rectangles."""

    _flags = {"allow_partial_load": False}

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Any = None,
        is_coordinator: bool = False,
    ) -> None:
        self._set_up(state_dict, metadata=metadata, is_coordinator=is_coordinator)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # DCP's default unpickles objects with weights_only=False (any code the file carries would
        # run): tensors, numbers and plain containers only. An object is replaced, not filled: hand
        # it to the caller's dict too.
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointMismatch(
                f"object {read_item.dest_index.fqn!r} holds more than tensors, numbers and "
                "plain containers, which fivefold never saves; refused unread "
                f"({str(e).splitlines()[0]})"
            ) from None
        self.state_dict[read_item.dest_index.fqn] = self.caller_state_dict[
            read_item.dest_index.fqn
        ] = obj

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved_md = self.metadata.state_dict_metadata
        for fqn in self.state_dict:
            if fqn not in saved_md:
                raise CheckpointMismatch(
                    f"the checkpoint has no {fqn!r}: it was written for another model"
                )
        plan = super().create_local_plan()
        requests = list(plan.items)
        for fqn, pieces in self.pieces.items():
            md = saved_md.get(fqn)
            if md is None:
                raise CheckpointMismatch(
                    f"the checkpoint has no {fqn!r}: it was written for another model"
                )
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(pieces.size):
                size = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "an object"
                raise CheckpointMismatch(
                    f"{fqn!r} is {size} in the checkpoint but {tuple(pieces.size)} in this "
                    "model: it was written for another model shape"
                )
            if md.properties.dtype != pieces.dtype:
                raise CheckpointMismatch(
                    f"{fqn!r} is {md.properties.dtype} in the checkpoint, {pieces.dtype} here"
                )
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape)
                for o, v in pieces.boxes.items()
            ]
            requests += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(requests, planner_data=plan.planner_data, storage_data=plan.storage_data)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.pieces:
            return _box(self.pieces[index.fqn], index)
        return super().lookup_tensor(index)
