"""The peak FLOP/s MFU is measured against (docs/design.md#flops-and-mfu): on an accelerator, the
vendor's dense peak for the compute dtype from a table of known devices (or ``run.peak_tflops``); on
the CPU, a short matmul measured with the threads this process uses, cached per machine — so "MFU"
on a laptop means the fraction of what its cores can do."""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

import torch

__all__ = [
    "DEVICE_PEAKS",
    "cpu_memory_bandwidth",
    "cpu_peak_flops",
    "device_peak_flops",
    "table_peak",
]

# Dense peak TFLOP/s by device-name fragment: (bf16 / fp16, fp32 — TF32 tensor cores where the
# device has them and fivefold enables them, `precision.tf32`). Vendors' data sheets (SXM parts;
# PCIe ones are lower: set the override). A key matches whole words of the device's name
# ("NVIDIA L40S", "NVIDIA A100-SXM4-80GB": words split at spaces and hyphens), so "L4" is not an
# L40 nor "A10" an A100; H200 and H800 compute as an H100, A800 as an A100.
DEVICE_PEAKS: dict[str, tuple[float, float]] = {
    **dict.fromkeys(("H200", "H100", "H800"), (989.0, 494.5)),
    **dict.fromkeys(("A100", "A800"), (312.0, 156.0)),
    "L40S": (362.0, 183.0),
    "L4": (121.0, 60.0),
    "A10": (125.0, 62.5),
    "RTX 4090": (165.0, 82.6),
    "V100": (125.0, 15.7),
    "MI300X": (1307.0, 653.7),
    "MI250X": (383.0, 95.7),
}

_CACHE = (
    Path(os.environ.get("FIVEFOLD_CACHE", Path.home() / ".cache" / "fivefold")) / "cpu_peak.json"
)


def _words(name: str) -> list[str]:
    return re.split(r"[\s\-_]+", name.strip().upper())


def table_peak(name: str, dtype: torch.dtype) -> float | None:
    """The table's dense peak FLOP/s for a device called `name` in `dtype` (None: not in it): the
    key whose words appear in the name in a row."""
    words = _words(name)
    for key, (half, single) in DEVICE_PEAKS.items():
        k = _words(key)
        if any(words[i : i + len(k)] == k for i in range(len(words) - len(k) + 1)):
            return (single if dtype == torch.float32 else half) * 1e12
    return None


def device_peak_flops(
    device: torch.device, dtype: torch.dtype, override_tflops: float = 0.0
) -> float | None:
    """Peak FLOP/s of one `device` in `dtype`: ``override_tflops`` if set; on the CPU
    `cpu_peak_flops`; on an accelerator the table's entry for its name (`table_peak`), or None for
    a device the table does not know: MFU is then "n/a", never an error (set
    ``run.peak_tflops``)."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cpu":
        return cpu_peak_flops(torch.get_num_threads(), dtype)
    return table_peak(getattr(torch, device.type).get_device_properties(device).name, dtype)


def cpu_peak_flops(threads: int, dtype: torch.dtype = torch.float32, seconds: float = 0.3) -> float:
    """Matmul FLOP/s of this CPU with `threads` threads in `dtype`, measured once (square matmuls of
    512, the best of a few repeats over about ``seconds``) and cached per machine, thread count,
    dtype and torch version."""
    key = (
        f"{platform.processor() or platform.machine()}|{os.cpu_count()}|"
        f"{threads}|{dtype}|{torch.__version__}"
    )
    cached = _read_cache()
    if key in cached:
        return float(cached[key])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 512
        a = torch.randn(n, n, dtype=dtype, device="cpu")
        b = torch.randn(n, n, dtype=dtype, device="cpu")
        torch.mm(a, b)  # warm-up
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(4):
                torch.mm(a, b)
            best = max(best, 4 * 2 * n**3 / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(previous)
    _write_cache({**_read_cache(), key: best})
    return best


def _read_cache() -> dict[str, float]:
    try:
        return json.loads(_CACHE.read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(values: dict[str, float]) -> None:
    try:
        _CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = _CACHE.with_name(f"{_CACHE.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(values, indent=1))
        os.replace(tmp, _CACHE)  # atomic: ranks probing at once each leave a whole file
    except OSError:
        pass  # a read-only home: measured again next time


def cpu_memory_bandwidth(seconds: float = 0.2) -> float:
    """Bytes/s one thread streams through memory (a 64 MiB tensor copied: read + write), what an
    elementwise pass moves; measured once and cached like `cpu_peak_flops`."""
    key = f"memory bandwidth|{platform.processor() or platform.machine()}|{os.cpu_count()}"
    cached = _read_cache()
    if key in cached:
        return float(cached[key])
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(16 * 2**20, device="cpu")
        dst = torch.empty_like(src)
        dst.copy_(src)
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            dst.copy_(src)
            best = max(best, 2 * src.nbytes / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(previous)
    _write_cache({**_read_cache(), key: best})
    return best
