"""Start-up's drawing cost: every initial value of a model (`Llama.initial_value`, one seeded generator per
parameter) drawn on the CPU with one torch thread (what torchrun leaves each rank) and, where this machine has an
accelerator, drawn on it (its own generator: other values), in one process, alternating blocks.

The model is built on meta (nothing allocated but the value being drawn); a block draws every parameter once and
drops it. Reported: seconds per whole draw (median over blocks), values per second, and with an accelerator the
paired ratio (each block's CPU time over the same block's accelerator time, median).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from bench.harness import markdown_table

__all__ = ["InitSpec", "bench_init", "format_init_table"]


@dataclass(frozen=True)
class InitSpec:
    preset: str = "medium"
    repeats: int = 3  # alternating blocks per side
    threads: int = 1  # the CPU side's torch threads


def _draw_all(model: Any, device: Any) -> tuple[float, int]:
    """(seconds, values) of drawing every parameter's initial value on ``device``."""
    import torch

    values, t0 = 0, time.perf_counter()
    for name in model.full_shapes():
        values += model.initial_value(name, 0, device).numel()
    if device.type != "cpu":
        torch.accelerator.synchronize()
    return time.perf_counter() - t0, values


def bench_init(spec: InitSpec = InitSpec()) -> dict[str, Any]:
    import torch

    from fivefold.models import get_config
    from fivefold.models.llama import Llama

    model = Llama(get_config(spec.preset), device="meta")
    sides = [torch.device("cpu")]
    if torch.accelerator.is_available():
        sides.append(torch.accelerator.current_accelerator())
    before = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    times: dict[str, list[float]] = {str(d): [] for d in sides}
    try:
        for _ in range(spec.repeats):
            for device in sides:
                seconds, values = _draw_all(model, device)
                times[str(device)].append(seconds)
    finally:
        torch.set_num_threads(before)
    ratio = None
    if len(sides) > 1:
        ratio = statistics.median(a / b for a, b in zip(times["cpu"], times[str(sides[1])]))
    return {"kind": "init", "spec": asdict(spec), "values": values, "seconds": times, "ratio": ratio}


def format_init_table(results: dict[str, Any]) -> str:
    values, spec = results["values"], results["spec"]
    rows = [["device", "seconds per draw (median)", "M values/s"]]
    for device, seconds in results["seconds"].items():
        s = statistics.median(seconds)
        rows.append([device + (f" ({spec['threads']} thread)" if device == "cpu" else ""), f"{s:.2f}",
                     f"{values / s / 1e6:.0f}"])
    out = [f"preset {spec['preset']} ({values:,} values), {spec['repeats']} alternating blocks", ""]
    out += markdown_table(rows)
    if results["ratio"] is not None:
        out += ["", f"paired ratio CPU / accelerator: {results['ratio']:.1f}"]
    else:
        out += ["", "no accelerator here: the CPU side only"]
    return "\n".join(out)
