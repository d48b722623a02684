"""`fivefold plan`'s step time against measured steps on this CPU: the small layouts
`tests/test_plan.py` runs (its `plan_layouts.LAYOUTS`, 4 gloo ranks), each timed here and planned
for this machine (`fivefold.plan.hardware.local_hardware`: the peak, matmul efficiency by size,
bandwidths, host time per operator and gloo latency measured once).

One launch of 4 ranks; per layout, after `warmup` steps, `steps` steps of forward + backward +
optimizer step (`parts.forward_backward`, `parts.step`, as the trainer's step runs them), each the
slowest rank's wall time between two barriers; the median is set beside the plan's step, as the
ratio planned / measured, with the plan's parts (compute, traffic not hidden, after the
micro-batches). A band on the ratio is this benchmark's to report, never a test's to assert."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' layouts
import plan_layouts  # noqa: E402

__all__ = ["PlanSpec", "bench_plan", "format_plan_table"]


@dataclass(frozen=True)
class PlanSpec:
    steps: int = 6
    warmup: int = 2
    layouts: tuple[str, ...] | None = None  # default: every one of plan_layouts.LAYOUTS
    # the band planned / measured is held to here (reported, never a test's assertion): on this
    # CPU the plan is optimistic — it leaves out the engine's Python and gloo's threads competing
    # with the compute for the cores (docs/benchmarks.md#the-planner-against-measured-cpu-steps) —
    # but within about 6×
    band: tuple[float, float] = (0.15, 1.0)


def _time_layouts(names: list[str], steps: int, warmup: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist

    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelMesh
    from fivefold.models.parallelize import parallelize
    from fivefold.run_plan import validate_layout

    torch.manual_seed(0)
    out: dict[str, list[float]] = {}
    for name in names:
        cfg = plan_layouts.config_of(name)
        run = validate_layout(cfg, plan_layouts.WORLD)
        cfg.train = dataclasses.replace(
            cfg.train,
            global_batch=run.global_batch,
            micro_batch=run.micro_batch,
            grad_accum=run.grad_accum,
        )
        mesh = ParallelMesh(run.dims, "cpu", CommLog(enabled=False))
        parts = parallelize(cfg, run.model, mesh, "cpu")
        g = torch.Generator().manual_seed(7 + mesh.rank("dp"))
        vocab, shape = run.model.vocab_size, (run.micro_batch, cfg.train.seq_len)
        times = []
        for step in range(warmup + steps):
            batches = [
                (torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
                for _ in range(run.grad_accum)
            ]
            dist.barrier()
            start = time.perf_counter()
            parts.forward_backward(batches)
            parts.step(cfg.train.grad_clip, cfg.train.check_finite)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if step >= warmup:
                times.append(took.item())
        out[name] = times
    return out


def bench_plan(spec: PlanSpec = PlanSpec()) -> dict[str, Any]:
    from fivefold.distributed.launch import launch_local
    from fivefold.plan import plan_layout
    from fivefold.plan.assembly import precision_bytes
    from fivefold.plan.hardware import local_hardware

    names = list(spec.layouts or plan_layouts.LAYOUTS)
    planned = {}
    for name in names:
        cfg = plan_layouts.config_of(name)
        hw = local_hardware("cpu", precision_bytes(cfg)[0], plan_layouts.WORLD)
        plan = plan_layout(cfg, plan_layouts.WORLD, hw)
        planned[name] = plan.time
    measured = launch_local(_time_layouts, plan_layouts.WORLD, names, spec.steps, spec.warmup)[0]
    rows = []
    for name in names:
        step = statistics.median(measured[name])
        tm = planned[name]
        rows.append(
            {
                "layout": name,
                "measured_s": step,
                "quartiles_s": statistics.quantiles(measured[name], n=4)
                if len(measured[name]) > 1
                else [step] * 3,
                "planned_s": tm["step"],
                "ratio": tm["step"] / step,
                "planned": {k: v for k, v in tm.items() if k not in ("tokens/s", "MFU")},
            }
        )
    ratios = [r["ratio"] for r in rows]
    hw = local_hardware("cpu", 4, plan_layouts.WORLD)
    return {
        "spec": dataclasses.asdict(spec),
        "hardware": dataclasses.asdict(hw),
        "rows": rows,
        "ratio_median": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "outside_band": [r["layout"] for r in rows if not spec.band[0] <= r["ratio"] <= spec.band[1]],
    }


def format_plan_table(result: dict[str, Any]) -> str:
    hw = result["hardware"]
    lines = [
        f"### `fivefold plan` vs measured steps, {hw['name']} "
        f"(peak {hw['peak_tflops'] * 1e3:.1f} GFLOP/s per rank, memory {hw['hbm_gbps']:.1f} GB/s, "
        f"gloo {hw['intra_node_gbps']:.2f} GB/s, {hw['op_overhead_us']:.1f} µs per operator, "
        f"{hw['collective_latency_us']:.0f} µs per collective)",
        "",
    ]
    table = [["layout", "measured ms", "planned ms", "planned / measured", "compute ms",
              "traffic not hidden ms", "after ms"]]  # fmt: skip
    for r in result["rows"]:
        p = r["planned"]
        table.append(
            [
                r["layout"],
                f"{r['measured_s'] * 1e3:.1f}",
                f"{r['planned_s'] * 1e3:.1f}",
                f"{r['ratio']:.2f}",
                f"{p['compute'] * 1e3:.1f}",
                f"{p['model traffic not hidden'] * 1e3:.1f}",
                f"{p['after the micro-batches'] * 1e3:.1f}",
            ]
        )
    lines += markdown_table(table)
    lo, hi = result["ratio_range"]
    lines.append(
        f"\nplanned / measured: median {result['ratio_median']:.2f}, range {lo:.2f}-{hi:.2f} "
        f"over {len(result['rows'])} layouts"
    )
    lo, hi = result["spec"]["band"]
    outside = result["outside_band"]
    lines.append(
        f"band {lo:g}-{hi:g}: "
        + (f"OUTSIDE it: {', '.join(outside)}" if outside else f"all {len(result['rows'])} inside")
    )
    return "\n".join(lines)
