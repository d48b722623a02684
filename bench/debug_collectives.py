"""What `--debug.collectives` costs: the same all-reduces timed with and without fingerprints on gloo ranks.

Each call in debug mode first all-gathers an 8-byte fingerprint hash over a gloo side group (and computes the call
site); off, a collective checks one attribute. Reported per call, for a small and a bucket-sized payload, side by
side in one launch (alternating blocks)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.harness import markdown_table

__all__ = ["DebugSpec", "bench_debug", "format_debug_table"]


@dataclass(frozen=True)
class DebugSpec:
    world: int = 2
    calls: int = 200
    repeats: int = 5
    sizes: tuple[int, ...] = (1, 2**20)  # fp32 elements: a scalar (norms, flags) and a 4 MiB bucket
    threads: int = 1


def _worker(spec: DebugSpec) -> dict:
    import torch

    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh

    comms = {mode: ParallelMesh(ParallelDims(dp=spec.world), "cpu", CommLog(enabled=False),
                                debug_collectives=mode == "debug").comm("dp") for mode in ("off", "debug")}
    out: dict[str, dict[int, list[float]]] = {m: {n: [] for n in spec.sizes} for m in comms}
    for _ in range(spec.repeats):
        for n in spec.sizes:
            t = torch.ones(n)
            for mode, comm in comms.items():
                comm.barrier()
                t0 = time.perf_counter()
                for _ in range(spec.calls):
                    comm.all_reduce(t)
                out[mode][n].append((time.perf_counter() - t0) / spec.calls)
    return out


def bench_debug(spec: DebugSpec | None = None, **overrides: Any) -> dict:
    from fivefold.distributed.launch import launch_local

    spec = replace(spec or DebugSpec(), **overrides)
    ranks = launch_local(_worker, spec.world, spec, threads=spec.threads, timeout_s=600.0)
    med = {m: {n: statistics.median(max(r[m][n][i] for r in ranks) for i in range(spec.repeats))
               for n in spec.sizes} for m in ("off", "debug")}
    return {"kind": "debug", "spec": asdict(spec), "median_s_per_call": med}


def format_debug_table(results: dict) -> str:
    spec, med = results["spec"], results["median_s_per_call"]
    rows = [("all_reduce payload", "off µs/call", "debug µs/call", "ratio")]
    for n in spec["sizes"]:
        off, dbg = med["off"][n], med["debug"][n]
        rows.append((f"{n * 4:,} B", f"{off * 1e6:.1f}", f"{dbg * 1e6:.1f}", f"{dbg / off:.2f}"))
    return "\n".join(markdown_table(rows) + [
        "", f"{spec['world']} gloo ranks, {spec['calls']} calls × {spec['repeats']} blocks per cell, slowest rank, "
        "median over blocks; debug = fingerprint all-gather on a gloo side group first"])
