"""What a run shows and leaves behind: the progress bar, and `RunRecord`, sole owner of the run directory (written on
rank 0): ``metrics.jsonl``, then the loss curve, for pipelines the measured timeline and, with ``run.trace``, the
step trace and its hidden-communication figure (via `fivefold.report`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fivefold.pipeline.simulator import Timeline
from fivefold.report import (
    plot_loss,
    plot_moe_load,
    plot_step_trace,
    plot_timeline,
    to_chrome_trace,
    write_step_trace,
)
from fivefold.trace import hidden_summary

__all__ = ["Progress", "RunRecord", "read_metrics"]


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _read_lenient(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file a killed run may have cut mid-line (that line is dropped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Progress:
    """tqdm bar on rank 0 (disabled elsewhere or when asked)."""

    def __init__(self, total: int, enabled: bool, desc: str = "train") -> None:
        self.bar = None
        self.done = 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, dynamic_ncols=True)

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.done += n
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class RunRecord:
    """Rank 0 writes; other ranks hold a silent record (every method is a no-op for them)."""

    def __init__(
        self,
        run_dir: Path | None,
        steps: int,
        progress: bool,
        name: str,
        resume_at: int | None = None,
    ) -> None:
        """``resume_at``: the run continues after that many steps: the records of later steps (written after the
        checkpoint, by the attempt that stopped) and its summary are dropped, the rest kept, new ones appended."""
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl" if run_dir is not None else None
        self._f = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_at is not None and self.path.exists():
                kept = [
                    r
                    for r in _read_lenient(self.path)
                    if r.get("kind") != "summary" and r.get("step", -1) < resume_at
                ]
                tmp = self.path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                tmp.replace(self.path)
            self._f = open(self.path, "a" if resume_at is not None else "w", buffering=1)
        self.progress = Progress(steps, enabled=run_dir is not None and progress, desc=name)
        if resume_at:
            self.progress.update(resume_at)

    def write(self, record: dict[str, Any]) -> None:
        if self._f is not None:  # strict JSON: a NaN or infinite value is written as null
            self._f.write(json.dumps(_finite(record), allow_nan=False) + "\n")

    def abort(self) -> None:
        """The run fails: close the file (what was written stays valid JSON lines) and the progress bar."""
        self.progress.close()
        if self._f is not None:
            self._f.close()
            self._f = None

    def say(self, msg: str) -> None:
        """A line for the user on rank 0: above the progress bar, or printed when there is none."""
        if self.progress.bar is not None:
            self.progress.write(msg)
        elif self.run_dir is not None:
            print(msg, flush=True)

    def pipeline(
        self, timeline: Timeline, formula: float | None, title: str, chrome_trace: bool = True
    ) -> None:
        """The last step's measured timeline: PNG + Chrome trace (unless the step trace, which holds the same actions,
        is written instead), and its bubble next to the formula (if any)."""
        if self.run_dir is None:
            return
        versus = f"formula {formula:.1%}" if formula is not None else "no textbook formula"
        plot_timeline(
            timeline, self.run_dir / "timeline.png", title=f"{title}, measured ({versus})"
        )
        if chrome_trace:
            to_chrome_trace(timeline, self.run_dir / "trace.json", us_per_unit=1e6)
        self.write(
            {
                "kind": "pipeline",
                "measured_bubble": timeline.bubble_fraction,
                "formula_bubble": formula,
            }
        )
        also = f" and {self.run_dir / 'trace.json'}" if chrome_trace else ""
        print(
            f"fivefold: last step's pipeline timeline: measured bubble {timeline.bubble_fraction:.1%} ({versus}); "
            f"wrote {self.run_dir / 'timeline.png'}{also}"
        )

    def trace(self, ranks: list[dict[str, Any]] | None, title: str) -> dict[str, Any] | None:
        """Every rank's traced steps (`trace.StepTracer.result`, gathered on rank 0): ``trace.json`` (Chrome /
        Perfetto), ``step_trace.png`` (the last traced step), a "trace" record and the hidden-communication line.
        Returns the run's figures (None elsewhere than rank 0, or when nothing was traced)."""
        if self.run_dir is None or not ranks:
            return None
        if not any(r["steps"] for r in ranks):
            self.say(
                "fivefold: run.trace: no step of the trace window ran (the run stopped before its last steps)"
            )
            return None
        summary = hidden_summary(ranks)
        write_step_trace(ranks, self.run_dir / "trace.json", other=summary)
        step = plot_step_trace(
            ranks,
            self.run_dir / "step_trace.png",
            title=title
            + (f", communication hidden {summary['comm_hidden_fraction']:.0%}" if summary else ""),
        )
        self.write(
            {
                "kind": "trace",
                **(
                    summary
                    or {"traced_steps": sorted({s["step"] for r in ranks for s in r["steps"]})}
                ),
            }
        )
        if summary is None:
            print(
                f"fivefold: no communication in the traced steps; wrote {self.run_dir / 'trace.json'} and "
                f"{self.run_dir / 'step_trace.png'} (step {step} as numbered in metrics.jsonl)"
            )
        else:
            print(
                f"fivefold: communication hidden behind compute: {summary['comm_hidden_fraction']:.0%} (ranks "
                f"{summary['comm_hidden_min']:.0%}-{summary['comm_hidden_max']:.0%}; exposed "
                f"{summary['exposed_comm_ms_per_step']:.1f} of {summary['comm_ms_per_step']:.1f} ms communication "
                f"per step) over the last {len(summary['traced_steps'])} steps; wrote {self.run_dir / 'trace.json'} "
                f"and {self.run_dir / 'step_trace.png'} (step {step} as numbered in metrics.jsonl)"
            )
        return summary

    def close(self, summary: dict[str, Any], plot_title: str | None) -> None:
        """Write the summary; draw the loss curve (unless `plot_title` is None)."""
        self.progress.close()
        if self._f is None:
            return
        self.write({"kind": "summary", **summary})
        self._f.close()
        self._f = None
        if plot_title is not None:
            records = read_metrics(self.path)
            png = plot_loss(records, self.run_dir / "loss.png", title=plot_title)
            if any(
                r.get("kind") == "moe" for r in records
            ):  # the loss plot's companion: how the experts were used
                print(
                    f"fivefold: expert load in {plot_moe_load(records, self.run_dir / 'moe_load.png')}"
                )
            val = summary.get("final_val_loss")
            print(
                f"fivefold: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
                + (f" (val {val:.3f})" if val is not None else "")
                + f", {summary['tokens_per_s']:,.0f} tokens/s; wrote {self.path} and {png}"
            )
