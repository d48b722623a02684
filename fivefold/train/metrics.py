"""What a run shows and leaves behind: the progress bar, and `RunRecord`, sole owner of the run directory (written on
rank 0): ``metrics.jsonl``, then the loss curve and, for pipelines, the measured timeline (via `fivefold.report`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fivefold.pipeline.simulator import Timeline
from fivefold.report import plot_loss, plot_moe_load, plot_timeline, to_chrome_trace

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

    def __init__(self, run_dir: Path | None, steps: int, progress: bool, name: str,
                 resume_at: int | None = None) -> None:
        """``resume_at``: the run continues after that many steps: the records of later steps (written after the
        checkpoint, by the attempt that stopped) and its summary are dropped, the rest kept, new ones appended."""
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl" if run_dir is not None else None
        self._f = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_at is not None and self.path.exists():
                kept = [r for r in _read_lenient(self.path)
                        if r.get("kind") != "summary" and r.get("step", -1) < resume_at]
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

    def pipeline(self, timeline: Timeline, formula: float | None, title: str) -> None:
        """The last step's measured timeline: PNG + Chrome trace, and its bubble next to the formula (if any)."""
        if self.run_dir is None:
            return
        versus = f"formula {formula:.1%}" if formula is not None else "no textbook formula"
        plot_timeline(timeline, self.run_dir / "timeline.png", title=f"{title}, measured ({versus})")
        to_chrome_trace(timeline, self.run_dir / "trace.json", us_per_unit=1e6)
        self.write({"kind": "pipeline", "measured_bubble": timeline.bubble_fraction, "formula_bubble": formula})
        print(f"fivefold: last step's pipeline timeline: measured bubble {timeline.bubble_fraction:.1%} ({versus}); "
              f"wrote {self.run_dir / 'timeline.png'} and {self.run_dir / 'trace.json'}")

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
            if any(r.get("kind") == "moe" for r in records):  # the loss plot's companion: how the experts were used
                print(f"fivefold: expert load in {plot_moe_load(records, self.run_dir / 'moe_load.png')}")
            val = summary.get("final_val_loss")
            print(f"fivefold: loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
                  + (f" (val {val:.3f})" if val is not None else "")
                  + f", {summary['tokens_per_s']:,.0f} tokens/s; wrote {self.path} and {png}")
