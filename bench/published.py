"""`fivefold plan` beside published runs (`bench.published_runs.RUNS`, every number with its source):
each run's layout planned on its hardware preset, its throughput and memory set beside the
published ones as ratios. Planning only: nothing is trained, no GPU is needed.

Throughput is compared as tokens/s per GPU, which no FLOP convention touches (the ratio of two
MFUs of one convention is the same number); where a source gives achieved TFLOP/s per GPU instead
(Llama 3), the plan's tokens/s are turned into TFLOP/s with that source's convention, PaLM's
6·N + 12·n·L·D. Memory: the plan's peak per GPU, runtime lines included, against the published
one (torchtitan's "Memory(GiB)", most likely max reserved). float8 rows are planned with FP8
linears (``precision.fp8 tensorwise``); their ratios are summarised apart from the bf16 rows'."""

from __future__ import annotations

import shlex
import statistics
from typing import Any

from bench.harness import markdown_table
from bench.published_runs import RUNS, PublishedRun

__all__ = ["bench_published", "format_published_table"]

GIB = 2**30


def _plan(run: PublishedRun) -> Any:
    from fivefold.cli import PLAN_FLAGS
    from fivefold.config import load_config
    from fivefold.plan import HARDWARE, plan_layout

    args = list(run.plan_args) if len(run.plan_args) > 1 else shlex.split(run.plan_args[0])
    hw = HARDWARE[run.hardware]
    overrides: list[str] = []
    i = 0
    while i < len(args):
        key = args[i][2:]
        if key == "gpu-mem":
            import dataclasses

            hw = dataclasses.replace(hw, memory_gb=float(args[i + 1]))
            i += 2
        elif key == "sp":
            overrides += ["--parallel.sp", "true"]
            i += 1
        elif key == "zero":
            overrides += ["--zero.stage", args[i + 1]]
            i += 2
        elif key in PLAN_FLAGS and PLAN_FLAGS[key]:
            overrides += [f"--{PLAN_FLAGS[key]}", args[i + 1]]
            i += 2
        else:
            overrides += [args[i], args[i + 1]]
            i += 2
    cfg = load_config(None, [*overrides, "--run.nproc", str(run.gpus)])
    return plan_layout(cfg, run.gpus, hw)


def bench_published() -> dict[str, Any]:
    from fivefold.models.llama import param_counts

    rows = []
    for run in RUNS:
        try:
            plan = _plan(run)
        except Exception as e:  # noqa: BLE001 - a row the planner refuses is reported, not raised
            rows.append({"name": run.name, "error": str(e)})
            continue
        per_gpu = plan.time["tokens/s"] / plan.world
        m = plan.model
        palm = 6 * param_counts(m)[1] + 12 * m.n_layers * plan.seq_len * m.dim
        row: dict[str, Any] = {
            "name": run.name,
            "gpus": run.gpus,
            "hardware": plan.hardware.name,
            "float8": run.float8,
            "planned_tokens_per_s_per_gpu": per_gpu,
            "published_tokens_per_s_per_gpu": run.tokens_per_s_per_gpu,
            "planned_tflops_per_gpu": per_gpu * palm / 1e12,
            "published_tflops_per_gpu": run.tflops_per_gpu,
            "planned_gib": plan.peak_bytes / GIB,
            "published_gib": run.memory_gib,
            "fits": plan.fits,
            "source": run.source,
        }
        prefix = "float8_" if run.float8 else ""
        if run.tokens_per_s_per_gpu:
            row[prefix + "throughput_ratio"] = per_gpu / run.tokens_per_s_per_gpu
        elif run.tflops_per_gpu:
            row[prefix + "throughput_ratio"] = row["planned_tflops_per_gpu"] / run.tflops_per_gpu
        if run.memory_gib:
            row[prefix + "memory_ratio"] = row["planned_gib"] / run.memory_gib
        rows.append(row)
    out: dict[str, Any] = {"rows": rows}
    for key in ("throughput_ratio", "memory_ratio", "float8_throughput_ratio", "float8_memory_ratio"):
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = {"median": statistics.median(values), "range": [min(values), max(values)]}
    return out


def _ratio(row: dict[str, Any], key: str) -> str:
    value = row.get(key, row.get("float8_" + key))
    return f"{value:.2f}" if value is not None else "-"


def format_published_table(result: dict[str, Any]) -> str:
    table = [["run", "GPUs", "published tok/s/GPU (TFLOP/s)", "planned", "plan / published",
              "published GiB", "planned GiB", "plan / published", "fits"]]  # fmt: skip
    for r in result["rows"]:
        if "error" in r:
            table.append([r["name"], "", "", "planning failed: " + r["error"][:60], "", "", "", "",
                          ""])  # fmt: skip
            continue
        if r["published_tokens_per_s_per_gpu"]:
            published = f"{r['published_tokens_per_s_per_gpu']:,.0f}"
            planned = f"{r['planned_tokens_per_s_per_gpu']:,.0f}"
        elif r["published_tflops_per_gpu"]:
            published = f"({r['published_tflops_per_gpu']:.0f})"
            planned = f"({r['planned_tflops_per_gpu']:.0f})"
        else:
            published = planned = "-"
        table.append(
            [
                r["name"] + (" (float8)" if r["float8"] else ""),
                str(r["gpus"]),
                published,
                planned,
                _ratio(r, "throughput_ratio"),
                f"{r['published_gib']:.1f}" if r["published_gib"] else "-",
                f"{r['planned_gib']:.1f}",
                _ratio(r, "memory_ratio"),
                "yes" if r["fits"] else "no",
            ]
        )
    lines = markdown_table(table)
    for key, what in (("throughput_ratio", "throughput, bf16 rows"), ("memory_ratio", "memory, bf16 rows"),
                      ("float8_throughput_ratio", "throughput, float8 rows (planned in FP8)"),
                      ("float8_memory_ratio", "memory, float8 rows")):
        if key in result:
            lo, hi = result[key]["range"]
            lines.append(
                f"\nplanned / published {what}: median {result[key]['median']:.2f}, "
                f"range {lo:.2f}-{hi:.2f}"
            )
    return "\n".join(lines)
