"""Whole-parameter owners: how ZeRO shards parameters for an optimizer that is not elementwise
(Muon; docs/design.md#muon-under-zero).

ZeRO cuts each flat buffer into N equal ranges, anywhere, mid-parameter included: right for an
elementwise optimizer (AdamW updates any slice of a parameter from the same slice of its gradient).
Muon orthogonalises each whole matrix, so the rank that steps a matrix must hold all of it. Here
every parameter of a *whole-parameter* flat buffer has one owner rank, and the buffer orders its
parameters by owner, so rank r's shard is the contiguous run of the parameters it owns: shards of
unequal sizes, one boundary per rank (`FlatLayout.bounds`), no padding. The stage's reduce-scatter
then delivers each owner its parameters' averaged gradients whole and the all-gather after the step
(ZeRO-1/2) or before use (ZeRO-3) sends each owner's parameters to everyone, through the uneven
forms of the collectives (`Comm.reduce_scatter(sizes=)`, `Comm.all_gather(sizes=)`).

Owners are chosen once per engine over all its whole-parameter buffers together (a buffer holds a
few matrices; an even spread per buffer is impossible, over the model it is not): largest
parameter first, each onto the rank that owns the fewest elements so far (ties: the lowest rank).
This greedy rule keeps every rank within one parameter of the mean, O_r ≤ O/N + p_max (O the
elements owned, p_max the largest parameter), `formulas.owner_bound`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_owners", "owner_bounds"]


def balance_owners(sizes: Sequence[tuple[str, int]], world: int) -> dict[str, int]:
    """The owner rank of every parameter (name, elements), balanced by elements over `world` ranks:
    largest first onto the least-loaded rank; equal sizes keep their given order and equal loads
    take the lowest rank, so every rank computes the same owners."""
    if world < 1:
        raise ValueError(f"world={world}: at least one rank owns the parameters")
    loads = [0] * world
    owners: dict[str, int] = {}
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], i))
    for i in order:
        name, numel = sizes[i]
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += numel
    return owners


def owner_bounds(owned: Sequence[int], numels: Sequence[int], world: int) -> list[int]:
    """Where each rank's shard starts in a buffer laid out by owner: `owned[i]` is the owner of the
    i-th parameter (non-decreasing) of `numels[i]` elements; returns the world + 1 offsets."""
    counts = [0] * world
    for rank, numel in zip(owned, numels):
        counts[rank] += numel
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds
