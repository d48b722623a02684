"""Pictures of a run: the loss curve, pipeline timelines (PNG, Chrome trace) and step traces
(`run.trace`: Chrome / Perfetto JSON and a PNG of one step), written atomically. Reads plain data
(``metrics.jsonl`` records, `pipeline.simulator.Timeline` s, `trace.StepTracer.result` dicts) and
owns every matplotlib import of the package.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from fivefold.paths import atomic_path
from fivefold.pipeline.actions import COMPUTE_KINDS, B, F, I, W
from fivefold.pipeline.simulator import Timeline

__all__ = [
    "plot_loss",
    "plot_moe_load",
    "plot_step_trace",
    "plot_timeline",
    "step_trace_lanes",
    "to_chrome_trace",
    "write_step_trace",
]

KIND_COLORS = {F: "#4C72B0", B: "#55A868", I: "#DD8452", W: "#8172B3"}
OTHER_COLOR = "#B0B0B0"


def _atomic_write(path: str | os.PathLike, write: Callable[[str], None], suffix: str) -> None:
    with atomic_path(path, suffix=suffix) as tmp:  # the umask's mode, not mkstemp's 0600
        write(str(tmp))


def plot_timeline(timeline: Timeline, path: str | os.PathLike, title: str = "") -> None:
    """Gantt chart PNG of ``timeline``: a row per rank, a box per event coloured by kind; later
    chunks lighter."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    P = max(timeline.n_ranks, 1)
    t0, span = timeline.start, max(timeline.makespan, 1e-12)
    n_events = max((len(evs) for evs in timeline.events), default=1)
    width = min(max(8.0, 0.32 * n_events), 40.0)
    fig = Figure(figsize=(width, 1.0 + 0.55 * P), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    V = max(timeline.n_virtual, 1)
    px_per_unit = width * 0.8 * 110 / span
    for r, evs in enumerate(timeline.events):
        lanes = timeline.lanes(
            r
        )  # passes run side by side (DualPipeV's units) share the row, one above the other
        height = 0.8 / (max(lanes, default=0) + 1)
        for e, lane in zip(evs, lanes):
            color = KIND_COLORS.get(e.kind, OTHER_COLOR)
            chunk = e.stage // P if V > 1 else 0
            alpha = 1.0 - 0.45 * chunk / max(V - 1, 1)
            top = r - 0.4 + lane * height
            ax.broken_barh(
                [(e.start - t0, e.duration)],
                (top, height),
                facecolors=color,
                edgecolors="white",
                linewidth=0.6,
                alpha=alpha,
            )
            box_px = e.duration * px_per_unit
            if box_px >= 7:
                ax.text(
                    e.start - t0 + e.duration / 2,
                    top + height / 2,
                    str(e.microbatch),
                    ha="center",
                    va="center",
                    fontsize=min(9.0, max(5.0, box_px / 2.2)),
                    color="white",
                    fontweight="bold",
                )
    ax.set_ylim(P - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_yticks(range(P))
    ax.set_yticklabels([f"rank {r}" for r in range(P)])
    ax.set_xlabel("time")
    kinds = [k for k in COMPUTE_KINDS if any(e.kind == k for evs in timeline.events for e in evs)]
    others = sorted({e.kind for evs in timeline.events for e in evs} - set(COMPUTE_KINDS))
    labels = {F: "F forward", B: "B backward", I: "I input grad", W: "W weight grad"}
    handles = [Patch(color=KIND_COLORS[k], label=labels[k]) for k in kinds]
    handles += [Patch(color=OTHER_COLOR, label=", ".join(others))] if others else []
    if V > 1:
        handles.append(Patch(color="white", label=f"lighter = later chunk (V={V})"))
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
    )
    heading = title or timeline.name
    stats = (
        f"makespan {timeline.makespan:g}, bubble {timeline.bubble_fraction:.1%}, "
        f"peak in-flight {timeline.peak_in_flight}"
    )
    ax.set_title(f"{heading}\n{stats}" if heading else stats, fontsize=10)
    ax.grid(axis="x", linestyle=":", alpha=0.5)
    ax.set_axisbelow(True)
    fig.tight_layout()
    _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"), ".png")


def to_chrome_trace(timeline: Timeline, path: str | os.PathLike, us_per_unit: float = 1e6) -> None:
    """Write ``timeline`` as Chrome trace JSON (chrome://tracing, Perfetto): one "X" event per
    action, tid = rank (a pass that ran beside another: tid = rank + P·lane, "rank r (side by
    side)"), times × ``us_per_unit`` as microseconds (the default reads times as seconds)."""
    t0, P = timeline.start, timeline.n_ranks
    events: list[dict] = []
    for r, evs in enumerate(timeline.events):
        lanes = timeline.lanes(r)
        for lane in range(max(lanes, default=0) + 1):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": 0,
                    "tid": r + P * lane,
                    "args": {"name": f"rank {r}" + (" (side by side)" if lane else "")},
                }
            )
        for e, lane in zip(evs, lanes):
            events.append(
                {
                    "name": f"{e.kind}{e.microbatch}@s{e.stage}",
                    "cat": e.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": r + P * lane,
                    "ts": (e.start - t0) * us_per_unit,
                    "dur": e.duration * us_per_unit,
                    "args": {"microbatch": e.microbatch, "stage": e.stage},
                }
            )
    data = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": timeline.name},
    }

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(data, fh)

    _atomic_write(path, write, ".json")


def plot_moe_load(records: list[dict], out_png: str | Path) -> Path:
    """MoE expert load from metrics records: the last logged step's tokens per expert in each layer
    (bars), and over steps each layer's imbalance, the busiest expert's load over the mean (1 =
    balanced), with drops noted."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    moe = [r for r in records if r.get("kind") == "moe"]
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    bars, lines = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    last = moe[-1]["layers"]
    width = 0.8 / max(len(last), 1)
    for i, (name, layer) in enumerate(last.items()):
        counts = layer["tokens_per_expert"]
        bars.bar([e + i * width for e in range(len(counts))], counts, width=width, label=name)
    bars.set_xlabel("expert")
    bars.set_ylabel("assignments kept (last micro-batch, all ranks)")
    bars.set_title(f"step {moe[-1]['step']}: tokens per expert")
    bars.legend(fontsize=7)
    for name in last:
        steps = [r["step"] for r in moe if name in r["layers"]]
        loads = [r["layers"][name]["tokens_per_expert"] for r in moe if name in r["layers"]]
        lines.plot(steps, [max(c) / max(sum(c) / len(c), 1e-9) for c in loads], label=name, lw=1.2)
    dropped = sum(layer["dropped"] for r in moe for layer in r["layers"].values())
    lines.axhline(1.0, color="grey", lw=0.8, ls="--")
    lines.set_xlabel("step")
    lines.set_ylabel("max / mean tokens per expert")
    lines.set_title(f"load imbalance ({dropped:,} dropped in logged steps)", fontsize=10)
    lines.grid(alpha=0.3)
    fig.tight_layout()
    _atomic_write(out_png, lambda tmp: fig.savefig(tmp, format="png"), ".png")
    return Path(out_png)


def plot_loss(records: list[dict], out_png: str | Path, title: str = "") -> Path:
    """Train (and validation, if logged) loss against step from metrics records, as PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # x = steps done (a record's step), as the console counts them ("step 50: val loss ...")
    train = [
        (r["step"], r["loss"])
        for r in records
        if r.get("kind") == "train" and r.get("loss") is not None
    ]
    val = [
        (r["step"], r["val_loss"])
        for r in records
        if r.get("kind") == "val" and r.get("val_loss") is not None
    ]
    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.2)
    ax.set_xlabel("steps done")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title or "fivefold training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _atomic_write(out_png, lambda tmp: fig.savefig(tmp, format="png"), ".png")
    return Path(out_png)


# --------------------------------------------------------------------------------------------------
# Step traces (`run.trace`): every rank's events of the traced steps, from `trace.StepTracer.result`

SPAN_COLORS = {
    "forward": "#4C72B0",
    "backward": "#55A868",
    "recompute": "#DD8452",
    "wait": "#C44E52",
    "step": "#DDDDDD",
}
OP_COLORS = {
    "all_reduce": "#8172B3",
    "reduce_scatter": "#937860",
    "all_gather": "#DA8BC3",
    "all_to_all": "#8C8C00",
    "broadcast": "#64B5CD",
    "send": "#999999",
    "recv": "#666666",
}
_LANE_ORDER = ("step", "compute", "compute (side thread)", "pipeline")


def _event_color(e: dict) -> str:
    if e["cat"] == "collective":
        return OP_COLORS.get(e["args"]["op"], OTHER_COLOR)
    if e["cat"] == "pipeline":
        return KIND_COLORS.get(e["args"]["kind"], OTHER_COLOR)
    return SPAN_COLORS.get(e["cat"], OTHER_COLOR)


def step_trace_lanes(events: list[dict]) -> list[tuple[str, list[dict]]]:
    """One rank's events by display lane, in order: step, compute, side thread, pipeline, then one
    lane per mesh dim of collectives ("comm dp", ...) in order of first use. Collectives of one dim
    that partly overlap (buckets or prefetched gathers in flight together) go to further lanes
    ("comm dp #2"): a Chrome trace lane must nest."""
    by_lane: dict[str, list[dict]] = {}
    for e in sorted(events, key=lambda e: (e["start"], -e["end"])):
        by_lane.setdefault(e["lane"], []).append(e)
    fixed = [lane for lane in _LANE_ORDER if lane in by_lane]
    out = [(lane, by_lane[lane]) for lane in fixed]
    for lane, evs in by_lane.items():
        if lane in fixed:
            continue
        rows: list[list[dict]] = []
        for e in evs:  # first row whose last event ended before this one starts
            row = next((r for r in rows if r[-1]["end"] <= e["start"]), None)
            if row is None:
                rows.append(row := [])
            row.append(e)
        out += [(lane if i == 0 else f"{lane} #{i + 1}", row) for i, row in enumerate(rows)]
    return out


def _rank_label(r: dict) -> str:
    coords = " ".join(f"{d}{i}" for d, i in r.get("coords", {}).items())
    return f"rank {r['rank']}" + (f" ({coords})" if coords else "")


def write_step_trace(ranks: list[dict], path: str | os.PathLike, other: dict | None = None) -> None:
    """Chrome trace JSON (Perfetto, chrome://tracing) of every rank's traced steps: pid = rank,
    tid = lane (see `step_trace_lanes`), "X" events with ts / dur in µs from the earliest event;
    collectives carry op, dim, tag and bytes in args. ``other``: run-level figures for
    ``otherData``."""
    t0 = min((e["start"] for r in ranks for s in r["steps"] for e in s["events"]), default=0)
    events: list[dict] = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        pid = r["rank"]
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": _rank_label(r)}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
        for tid, (lane, evs) in enumerate(
            step_trace_lanes([e for s in r["steps"] for e in s["events"]])
        ):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}}
            )
            events.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
            for e in evs:
                events.append(
                    {
                        "name": e["name"],
                        "cat": e["cat"],
                        "ph": "X",
                        "pid": pid,
                        "tid": tid,
                        "ts": (e["start"] - t0) / 1e3,
                        "dur": (e["end"] - e["start"]) / 1e3,
                        "args": e["args"],
                    }
                )
    data = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"clock": sorted({r.get("clock", "") for r in ranks}), **(other or {})},
    }

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(data, fh)

    _atomic_write(path, write, ".json")


def plot_step_trace(
    ranks: list[dict],
    path: str | os.PathLike,
    step: int | None = None,
    title: str = "",
    max_ranks: int = 8,
) -> int:
    """PNG of one traced step (default: the last) on each rank (the first ``max_ranks``; trace.json
    has them all): a row per lane — compute spans coloured forward / backward / recompute with waits
    for collectives in red, pipeline actions, then collectives per mesh dim coloured by op. Returns
    the step drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    steps = sorted({s["step"] for r in ranks for s in r["steps"]})
    step = steps[-1] if step is None else step
    per_rank = []
    shown = sorted(ranks, key=lambda r: r["rank"])[:max_ranks]
    if len(shown) < len(ranks):
        title = f"{title} (ranks {shown[0]['rank']}-{shown[-1]['rank']} of {len(ranks)})"
    for r in shown:
        evs = [
            e for s in r["steps"] if s["step"] == step for e in s["events"] if e["cat"] != "step"
        ]
        lanes: dict[str, list[dict]] = {}
        for lane, row in step_trace_lanes(
            evs
        ):  # the sub-lanes of a dim share its row here (drawn translucent)
            lanes.setdefault(lane.split(" #")[0], []).extend(row)
        per_rank.append((r, list(lanes.items())))
    starts = [s["start"] for r in ranks for s in r["steps"] if s["step"] == step]
    ends = [s["end"] for r in ranks for s in r["steps"] if s["step"] == step]
    t0, span_ms = min(starts), max(max(ends) - min(starts), 1) / 1e6
    n_rows = sum(len(lanes) for _, lanes in per_rank) + len(per_rank) - 1
    fig = Figure(figsize=(14, 1.2 + 0.32 * n_rows), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    y, ticks, labels, px_per_ms = 0, [], [], 14 * 0.75 * 110 / span_ms
    for r, lanes in per_rank:
        for lane, evs in lanes:
            for e in evs:
                x, w = (e["start"] - t0) / 1e6, (e["end"] - e["start"]) / 1e6
                translucent = e["cat"] == "collective"
                ax.broken_barh(
                    [(x, max(w, span_ms * 1e-4))],
                    (y - 0.4, 0.8),
                    facecolors=_event_color(e),
                    edgecolors="none",
                    alpha=0.75 if translucent else 1.0,
                )
                if w * px_per_ms > 30 and e["cat"] in ("forward", "backward", "recompute"):
                    ax.text(
                        x + w / 2,
                        y,
                        e["name"].replace("layers.", "L"),
                        ha="center",
                        va="center",
                        fontsize=6,
                        color="white",
                    )
            ticks.append(y)
            labels.append(f"{_rank_label(r)}  {lane}" if lane == lanes[0][0] else lane)
            y += 1
        y += 1  # a gap between ranks
    ax.set_ylim(y - 1.5, -0.7)
    ax.set_xlim(0, span_ms)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("ms since the step began (earliest rank)")
    drawn = [e for _, lanes in per_rank for _, evs in lanes for e in evs]
    present = {e["cat"] for e in drawn}
    ops = sorted({e["args"]["op"] for e in drawn if e["cat"] == "collective"})
    handles = [
        Patch(color=SPAN_COLORS[c], label=c)
        for c in ("forward", "backward", "recompute", "wait")
        if c in present
    ]
    if "pipeline" in present:
        handles.append(Patch(color=KIND_COLORS[F], label="pipeline action (F/B/I/W)"))
    handles += [Patch(color=OP_COLORS.get(op, OTHER_COLOR), label=op) for op in ops]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False
    )
    heading = f"step {step} (numbered as in metrics.jsonl)"
    ax.set_title(f"{title}\n{heading}" if title else heading, fontsize=10)
    ax.grid(axis="x", linestyle=":", alpha=0.5)
    ax.set_axisbelow(True)
    fig.tight_layout()
    _atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"), ".png")
    return step
