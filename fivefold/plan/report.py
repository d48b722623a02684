"""`fivefold plan`'s text: one layout's report, or `search`'s ranking."""

from __future__ import annotations

import time
from typing import Any, TextIO

from fivefold import formulas
from fivefold.plan.hardware import GB, Hardware
from fivefold.plan.layout import LayoutPlan
from fivefold.plan.search import SearchResult

__all__ = [
    "SearchProgress",
    "format_bytes",
    "format_plan",
    "format_ranking",
    "format_search",
    "format_seconds",
]


def _bytes(nbytes: float) -> str:
    for unit, size in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes:,.0f} B"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"


# public spellings (the trainer's --layout auto lines)
format_bytes, format_seconds = _bytes, _seconds


def format_plan(plan: LayoutPlan) -> str:
    """Per GPU memory by part (pipeline ranks side by side; more than 6: the first three, the
    middle, the last two and the fullest), traffic per dimension, bubble, step time and MFU."""
    hw = plan.hardware
    lines = [
        f"fivefold plan: {plan.model_name} ({plan.params / 1e9:,.2f}B parameters) on {plan.world} "
        f"× {hw.name} ({hw.gpus_per_node} per node)",
        f"layout: {plan.layout}",
        f"batch: global {plan.global_batch} × {plan.seq_len} tokens = micro {plan.micro_batch} × "
        f"accum {plan.grad_accum} × dp {plan.dims.dp}; precision {plan.precision}",
        "",
    ]
    ranks = plan.ranks
    if len(ranks) > 6:
        shown = {0, 1, 2, len(ranks) // 2, len(ranks) - 2, len(ranks) - 1}
        fullest = max(range(len(ranks)), key=lambda i: ranks[i].total)
        ranks = [ranks[i] for i in sorted({*shown, fullest})]
    head = f"{'per GPU':56s}" + "".join(f"{'pp rank ' + str(r.pp_rank):>13s}" for r in ranks)
    lines += [head, "-" * len(head)]

    def row(label: str, values: list[float]) -> None:
        lines.append(f"{label:56s}" + "".join(f"{v:>13,.2f}" for v in values))

    row("parameters held (B)", [r.params / 1e9 for r in ranks])
    for part in ("params", "grads", "optimizer"):
        row(f"model states: {part} (GB)", [r.model_states[part] / GB for r in ranks])
    if any(r.model_states.get("host") for r in ranks):
        row("  of which in host memory (GB)", [r.model_states["host"] / GB for r in ranks])
    for key in sorted({k for r in ranks for k in r.transient}):
        row(f"transient: {key} (GB)", [r.transient.get(key, 0) / GB for r in ranks])
    for key in sorted({k for r in ranks for k in r.activations}):
        row(f"activations: {key} (GB)", [r.activations.get(key, 0) / GB for r in ranks])
    for key in sorted({k for r in ranks for k in r.runtime}):
        row(f"runtime: {key} (GB)", [r.runtime.get(key, 0) / GB for r in ranks])
    row("total on the GPU (GB)", [r.total / GB for r in ranks])
    m, d = plan.model, plan.dims
    seed = formulas.korthikanti_block_bytes(
        plan.micro_batch, plan.seq_len // d.cp, m.dim, m.n_heads
    )
    lines.append(
        f"{'one block keeps (GB)':56s}{plan.block_bytes / GB:>13,.2f}   (the GPT block of "
        "docs/design.md#activation-memory, 34·B·L·D + 5·B·L²·H in fp16, unsplit, no flash "
        f"attention: {seed / GB:,.2f} GB)"
    )
    fits = "fits" if plan.fits else "DOES NOT FIT"
    more = (
        f"; {len(plan.ranks)} pipeline ranks, {len(ranks)} shown, all in --json"
        if len(ranks) < len(plan.ranks)
        else ""
    )
    lines += [
        f"{'GPU memory (GB)':56s}{hw.memory_gb:>13,.2f}   -> {fits} (peak "
        f"{_bytes(plan.peak_bytes)}{more})",
        "",
    ]
    where = f" (pp rank {plan.traffic_rank}, the busiest)" if len(plan.ranks) > 1 else ""
    lines += [
        f"traffic per step and GPU{where}",
        f"  {'dim':16s}{'group':>7s}{'link':>12s}{'payload':>14s}{'ring wire':>14s}   collectives",
    ]
    for dim, t in plan.traffic.items():
        ops = ", ".join(f"{op} {_bytes(b)}" for op, b in t["ops"].items())
        lines.append(
            f"  {dim:16s}{t['group']:>7d}{t['link']:>12s}{_bytes(t['payload_bytes']):>14s}"
            f"{_bytes(t['wire_bytes']):>14s}   {ops}"
        )
    lines.append("")
    if plan.bubble is not None:
        lines.append(
            f"pipeline bubble (the schedule simulated with these stage costs): {plan.bubble:.1%}"
        )
    tm = plan.time
    lines += [
        f"estimated step: {_seconds(tm['step'])} = micro-batches {_seconds(tm['pipeline'])} "
        f"(compute {_seconds(tm['compute'])}: {_compute_parts(tm)}, of {hw.peak_tflops:g} "
        f"TFLOP/s; tp/cp/ep traffic not hidden {_seconds(tm['model traffic not hidden'])}; "
        f"data-parallel traffic beside the passes {_seconds(tm['data-parallel during passes'])}) + "
        f"after them {_seconds(tm['after the micro-batches'])} + optimizer "
        f"{_seconds(tm['optimizer'])}",
        f"throughput ≈ {tm['tokens/s']:,.0f} tokens/s, MFU ≈ {tm['MFU']:.1%} (links one way per "
        f"GPU: intra-node {hw.intra_node_gbps:g} GB/s, inter-node {hw.inter_node_gbps:g} GB/s; an "
        "estimate, see docs/plan.md)",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _compute_parts(tm: dict[str, float]) -> str:
    """The busiest rank's device seconds of compute by kind (matmuls, attention, elementwise)."""
    parts = {k.split(": ", 1)[1]: v for k, v in tm.items() if k.startswith("compute: ")}
    return ", ".join(f"{kind} {_seconds(v)}" for kind, v in parts.items()) or "none"


def format_search(result: SearchResult, world: int, hardware: Hardware) -> str:
    """`search`'s ranking: one line per layout (after a Ctrl-C: the best of those planned)."""
    plans, valid, fitting = result.plans, result.valid, result.fitting
    scope = (
        f"stopped after {result.tried} of {result.total} candidates (Ctrl-C): the best so far; "
        if result.stopped
        else ""
    )
    lines = [
        f"fivefold plan --search: {scope}{valid} valid layouts for {world} × {hardware.name}, "
        f"{fitting} fit in {hardware.memory_gb:g} GB; the fastest by estimated step time:",
        "",
    ]
    w = max([60, *(len(p.layout) + 1 for p in plans)])  # the layouts' column fits the longest
    head = (
        f"{'#':>3s}  "
        f"{'layout':{w}s}{'peak GB':>9s}{'step':>11s}{'tokens/s':>13s}{'MFU':>7s}{'bubble':>8s}"
    )
    lines += [head, "-" * len(head)]
    for i, p in enumerate(plans, 1):
        bubble = f"{p.bubble:.1%}" if p.bubble is not None else "-"
        lines.append(
            f"{i:>3d}  {p.layout:{w}s}{p.peak_bytes / GB:>9.1f}{_seconds(p.time['step']):>11s}"
            f"{p.time['tokens/s']:>13,.0f}{p.time['MFU']:>7.1%}{bubble:>8s}"
        )
    if not plans:
        lines.append(
            "  none fits: more GPUs, a smaller micro-batch or sequence, or a GPU with more memory"
        )
    return "\n".join(lines)


def format_ranking(plans: list[LayoutPlan]) -> list[str]:
    """The first of ``plans`` and its runners-up, one row each: the layout, its predicted peak
    memory per GPU and step time, tokens/s (`fivefold train --layout auto`'s table)."""
    w = max([56, *(len(p.layout) + 1 for p in plans)])
    head = f"  {'#':>2s}  {'layout':{w}s}{'peak per GPU':>14s}{'step':>12s}{'tokens/s':>12s}"
    lines = [head, "  " + "-" * (len(head) - 2)]
    for i, p in enumerate(plans, 1):
        lines.append(
            f"  {i:>2d}  {p.layout:{w}s}{_bytes(p.peak_bytes):>14s}{_seconds(p.time['step']):>12s}"
            f"{p.time['tokens/s']:>12,.0f}"
        )
    return lines


class SearchProgress:
    """`search`'s progress on stderr: a bar of layouts planned / total on a terminal; elsewhere (a
    batch job's log) a line when the candidates are known and then every ``every_s`` seconds, each
    with the best layout so far. Ctrl-C stops the search with that best (`search`). ``prefix``:
    the command the lines name; ``on_stop``: what its Ctrl-C does."""

    def __init__(
        self,
        stream: TextIO,
        every_s: float = 15.0,
        prefix: str = "fivefold plan --search",
        on_stop: str = "Ctrl-C stops with the best so far",
    ) -> None:
        self.stream, self.every_s, self.prefix, self.on_stop = stream, every_s, prefix, on_stop
        self.tty = stream.isatty()
        self.bar: Any = None
        self.t0 = self.last = time.perf_counter()

    def __call__(self, done: int, total: int, best: LayoutPlan | None) -> None:
        now = time.perf_counter()
        if total == 0:  # the candidates are being enumerated
            print(
                f"{self.prefix}: listing the layouts the rules allow ... ({self.on_stop})",
                file=self.stream,
                flush=True,
            )
            return
        lead = best and f"best {best.layout.strip()}, {_seconds(best.time['step']).strip()}"
        if self.tty:
            if self.bar is None:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc="layouts", file=self.stream, leave=False)
            self.bar.set_postfix_str(lead or "none fits yet", refresh=False)
            self.bar.update(done - self.bar.n)
            if done == total:
                self.bar.close()
            return
        if done == 1 or done == total or now - self.last >= self.every_s:
            self.last = now
            print(
                f"{self.prefix}: {done}/{total} layouts planned in {now - self.t0:.0f} s"
                + (f"; {lead}" if lead else "; none fits yet"),
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
