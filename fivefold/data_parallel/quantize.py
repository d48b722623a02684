"""Block-wise symmetric int8 quantisation for ZeRO++'s quantised collectives qwZ and qgZ
(docs/design.md#zero-qwz-qgz-hpz).

Rows of ``n`` elements (one rank's shard of a flat buffer, or one destination's chunk of a gradient
bucket) are cut into blocks of ``block`` elements, the last block of a row maybe shorter: a block
never straddles two ranks' shards, so nothing is padded for it. Each block keeps an fp32 scale
``max|x| / 127`` and int8 values ``round(x / scale)``; dequantising gives ``q · scale``, off by at
most half a step (``scale / 2``) per element. An all-zero block has scale 0 and dequantises to
zeros; a block holding inf or nan dequantises to non-finite values (its scale is), so an overflow
still shows after the collective.

A row travels as one int8 *packed chunk*: its scales' bytes first (4 per block: fp32 viewed as
int8), then the int8 values, padded to a multiple of 4 bytes so that the next chunk's scales stay
fp32-aligned. One collective (an all-gather for weights, an all-to-all for gradients) then carries
values and scales together: `formulas.quantized_chunk_bytes` is its size. Pure torch, any device;
math in fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from fivefold.formulas import quantized_chunk_bytes

__all__ = [
    "QMAX",
    "blocks_of",
    "dequantize_packed",
    "dequantize_rows",
    "dequantize_sum",
    "packed_bytes",
    "quantize_rows",
    "quantize_rows_into",
    "unpack_rows",
]

QMAX = 127  # symmetric int8: -127..127 (-128 unused, so the range is symmetric)


def blocks_of(n: int, block: int) -> int:
    """Blocks of a row of `n` elements (the last one maybe shorter)."""
    return -(-n // block)


# Bytes of one packed chunk of `n` elements: fp32 scales, int8 values, padded to a multiple of 4
# (the formula itself).
packed_bytes = quantized_chunk_bytes


def _blocked(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x` [rows, n] as fp32 [rows, blocks, block], the last block zero-padded (a copy only where
    padding is needed, or for the dtype conversion)."""
    rows, n = x.shape
    nb = blocks_of(n, block)
    x = x.float()
    if nb * block != n:
        x = torch.nn.functional.pad(x, (0, nb * block - n))
    return x.reshape(rows, nb, block)


def quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [rows, n] (any float dtype) -> int8 values [rows, n] and fp32 scales [rows, blocks]."""
    rows, n = x.shape
    xb = _blocked(x, block)
    scales = xb.abs().amax(dim=2) / QMAX  # nan / inf propagate into the scale
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(xb / safe.unsqueeze(2)).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.reshape(rows, -1)[:, :n], scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """int8 [rows, n] and fp32 scales [rows, blocks] -> fp32 [rows, n]."""
    rows, n = q.shape
    qb = _blocked(q, block)
    return (qb * scales.unsqueeze(2)).reshape(rows, -1)[:, :n]


def _split(packed: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed int8 [rows, packed_bytes(n, block)] as views: fp32 scales [rows, blocks], int8
    values [rows, n]."""
    head = 4 * blocks_of(n, block)
    scales = packed[:, :head].view(
        torch.float32
    )  # (each row starts 4-byte aligned: chunks are multiples of 4)
    return scales, packed[:, head : head + n]


def quantize_rows_into(x: torch.Tensor, block: int, out: torch.Tensor) -> torch.Tensor:
    """Quantise `x` [rows, n] into the packed int8 buffer `out` [rows, packed_bytes(n, block)];
    returns `out`."""
    rows, n = x.shape
    if out.dtype != torch.int8 or tuple(out.shape) != (rows, packed_bytes(n, block)):
        raise ValueError(
            f"packed buffer {tuple(out.shape)} {out.dtype}: expected ({rows}, "
            f"{packed_bytes(n, block)}) int8 for rows of {n} elements in blocks of {block}"
        )
    q, scales = quantize_rows(x, block)
    s_view, q_view = _split(out, n, block)
    s_view.copy_(scales)
    q_view.copy_(q)
    out[:, 4 * blocks_of(n, block) + n :].zero_()  # alignment padding: defined bytes on the wire
    return out


def unpack_rows(packed: torch.Tensor, n: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 values [rows, n] and fp32 scales [rows, blocks] of a packed buffer (views)."""
    scales, q = _split(packed, n, block)
    return q, scales


def dequantize_packed(packed: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """Packed int8 [rows, packed_bytes(n, block)] -> fp32 [rows, n]."""
    q, scales = unpack_rows(packed, n, block)
    return dequantize_rows(q, scales, block)


def dequantize_sum(packed: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """qgZ's reduction: rows received from every source rank, each dequantised, summed in fp32 ->
    fp32 [n]. Unlike a quantised SUM on the wire, errors do not compound: the sum is off by at most
    Σ_rows scale/2 per element."""
    return dequantize_packed(packed, n, block).sum(dim=0)
