"""This CPU as `fivefold plan` models a machine (docs/design.md#step-time-model): the efficiency
model's inputs measured once and cached per machine and torch version beside the CPU's peak
(`observe.peak`): matmul efficiency by size, and for a job of n ranks on this host gloo's latency
and bandwidth between them and the host time of one operator while they all compute.
`plan.hardware.local_hardware` builds the CPU's `Hardware` from them; `python bench/run.py plan`
sets its plans beside measured steps."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from fivefold.observe import peak

__all__ = ["GEMM_SIZES", "gemm_curve", "job_costs"]

GEMM_SIZES = (8, 16, 32, 64, 128, 256, 512)


def _key(what: str) -> str:
    machine = platform.processor() or platform.machine()
    return f"{what}|{machine}|{os.cpu_count()}|{torch.__version__}"


def _cached(what: str, measure):  # noqa: ANN001, ANN202 - a measurement and its JSON value
    key = _key(what)
    values = peak._read_cache()
    if key not in values:
        values = {**peak._read_cache(), key: measure()}
        peak._write_cache(values)
    return values[key]


def _best(fn, seconds: float = 0.05, inner: int = 8) -> float:  # noqa: ANN001
    """The best time of one ``fn()`` over about ``seconds``, in groups of ``inner`` calls."""
    fn()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline or best == float("inf"):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def gemm_curve(dtype: torch.dtype = torch.float32) -> tuple[tuple[int, float], ...]:
    """(size, fraction of the peak) of square matmuls of `GEMM_SIZES` on one thread: the time of
    one less that of a 1 × 1 matmul (the operator's own cost, which the plan charges as
    ``op_overhead_us``), over the 512³ matmul's FLOP/s (`observe.peak.cpu_peak_flops`)."""

    def measure() -> list[list[float]]:
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            tiny = torch.ones(1, 1, dtype=dtype, device="cpu")
            floor = _best(lambda: torch.mm(tiny, tiny), inner=64)
            top = peak.cpu_peak_flops(1, dtype)
            out = []
            for n in GEMM_SIZES:
                a = torch.randn(n, n, dtype=dtype, device="cpu")
                took = max(_best(lambda a=a: torch.mm(a, a)) - floor, 1e-9)
                out.append([n, min(1.0, 2 * n**3 / took / top)])
            return out
        finally:
            torch.set_num_threads(previous)

    return tuple((int(n), float(e)) for n, e in _cached(f"gemm {dtype}", measure))


def _block_seconds_per_operator() -> float:
    """Host seconds per operator of a width-8 block's eager forward and backward (its kernels cost
    next to nothing), on this process's threads: its best time over `efficiency.ops_per_block`'s
    count."""
    from fivefold.models.llama import Llama, get_config
    from fivefold.plan.efficiency import ops_per_block

    shape = dict(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_hidden=8, max_seq_len=4)
    model = Llama(get_config("tiny", **shape))
    block, cos, sin = model.layers[0], model.rope_cos, model.rope_sin
    x = torch.randn(1, 4, 8, requires_grad=True, device="cpu")

    def step() -> None:
        block(x, cos, sin).sum().backward()

    return _best(step, seconds=0.2, inner=4) / sum(ops_per_block(None, "sdpa", "none"))


def _probe(small: int, large_bytes: int) -> tuple[float, float, float]:
    """On each rank of a local launch: seconds of a 4-byte all-reduce (the best of three tries'
    means over ``small`` calls), of one of ``large_bytes`` (the best of five), and the host seconds
    per operator of a tiny block while every rank runs it at once."""
    import torch.distributed as dist

    t = torch.zeros(1, device="cpu")
    for _ in range(10):
        dist.all_reduce(t)
    tiny = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(small):
            dist.all_reduce(t)
        tiny.append((time.perf_counter() - start) / small)
    big = torch.zeros(large_bytes // 4, device="cpu")
    dist.all_reduce(big)
    took = []
    for _ in range(5):
        start = time.perf_counter()
        dist.all_reduce(big)
        took.append(time.perf_counter() - start)
    dist.barrier()
    per_op = _block_seconds_per_operator()
    return min(tiny), min(took), per_op


def job_costs(ranks: int) -> tuple[float, float, float]:
    """(collective latency s, link bandwidth bytes/s, host s per operator) of ``ranks`` processes
    of this host, each on one thread as the trainer runs them — a local launch of its own, a few
    seconds, once: the latency a 4-byte gloo all-reduce's time; the bandwidth a 4 MiB one's ring
    wire bytes (2·(n-1)/n of it) over its time less that latency; the host time per operator of a
    tiny block's forward and backward while every rank runs one (so ranks sharing cores share
    them here too)."""
    from fivefold.distributed.launch import launch_local

    large = 4 * 2**20

    def measure() -> list[float]:
        if ranks < 2:
            previous = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return [0.0, 1e15, _block_seconds_per_operator()]
            finally:
                torch.set_num_threads(previous)
        results = launch_local(_probe, ranks, 100, large)
        latency = max(r[0] for r in results)
        took = max(r[1] for r in results)
        wire = 2 * (ranks - 1) / ranks * large
        per_op = statistics.median(r[2] for r in results)
        return [latency, wire / max(took - latency, 1e-9), per_op]

    latency, bandwidth, per_op = _cached(f"job of {ranks} ranks", measure)
    return float(latency), float(bandwidth), float(per_op)
