"""What one rank holds of a global tensor, as boxes of global coordinates: the unit checkpoints are
written in.

A rank holds a parameter (or its optimizer state) as a flat range [a, b) of its TP-local tensor (a
ZeRO shard cuts the flat buffer anywhere, mid-row included), and the TP-local tensor is itself a
slice of the global one along one dimension. `row_major_boxes` cuts such a range into at most
2·ndim-1 boxes, each a contiguous run of the flat storage and a rectangle of the tensor; shifted by
the TP offset they are rectangles of the global tensor, which is what a DCP chunk is. So a
checkpoint stores every parameter under its global name and shape, and any other layout reads back
the rectangles it needs (`fivefold.checkpoint.planner`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Box", "Pieces", "row_major_boxes"]


@dataclass(frozen=True)
class Box:
    """A rectangle of a tensor (``offsets``, ``sizes`` per dimension) that is also the contiguous
    flat range [``flat_start``, ``flat_start`` + numel) of its row-major storage."""

    flat_start: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def row_major_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Boxes covering the flat range [start, stop) of a row-major tensor of ``shape``, in flat
    order: a partial leading row, whole rows, a partial trailing row (each partial row cut the same
    way one dimension down)."""
    shape = tuple(shape)
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {shape}")
    if start == stop:
        return []
    if len(shape) == 0:
        return [Box(0, (), ())]
    if len(shape) == 1:
        return [Box(start, (start,), (stop - start,))]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = start // inner, (stop - 1) // inner

    def within(row: int, a: int, b: int) -> list[Box]:  # [a, b) of one row, row-relative
        return [
            Box(row * inner + box.flat_start, (row, *box.offsets), (1, *box.sizes))
            for box in row_major_boxes(shape[1:], a, b)
        ]

    if first == last and (start % inner or stop - first * inner < inner):
        return within(first, start - first * inner, stop - first * inner)
    out: list[Box] = []
    full_from, full_to = first, last + 1
    if start % inner:
        out += within(first, start % inner, inner)
        full_from = first + 1
    tail = stop - last * inner
    if tail < inner:
        full_to = last
    if full_to > full_from:
        out.append(
            Box(
                full_from * inner,
                (full_from, *[0] * (len(shape) - 1)),
                (full_to - full_from, *shape[1:]),
            )
        )
    if tail < inner:
        out += within(last, 0, tail)
    return out


@dataclass
class Pieces:
    """This rank's share of the global tensor ``size`` (``dtype``): rectangles at global
    ``offsets``, each with the tensor that holds (save) or receives (load) its values, shaped like
    the rectangle. A share may be empty."""

    size: torch.Size
    dtype: torch.dtype
    boxes: dict[tuple[int, ...], torch.Tensor] = field(
        default_factory=dict
    )  # global offsets -> values

    def add(self, offsets: Sequence[int], values: torch.Tensor) -> None:
        key = tuple(offsets)
        if len(key) != len(self.size) or any(
            o + s > n for o, s, n in zip(key, values.shape, self.size)
        ):
            raise ValueError(
                f"box at {key} of shape {tuple(values.shape)} outside a tensor of size "
                f"{tuple(self.size)}"
            )
        self.boxes[key] = values

    def add_flat_range(
        self,
        flat: torch.Tensor,
        local_shape: Sequence[int],
        start: int,
        local_offset: Sequence[int],
    ) -> None:
        """The values ``flat`` (1-D) of the local tensor's flat range [start, start + len(flat)) —
        the local tensor being the slice of shape ``local_shape`` at ``local_offset`` of the global
        one."""
        for box in row_major_boxes(local_shape, start, start + flat.numel()):
            a = box.flat_start - start
            values = flat[a : a + box.numel].view(box.sizes)
            self.add([o + lo for o, lo in zip(box.offsets, local_offset)], values)

    @property
    def numel(self) -> int:
        return sum(v.numel() for v in self.boxes.values())
