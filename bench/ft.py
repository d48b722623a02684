"""What replica fault tolerance (``ft.replica_groups``, torchft) costs and buys, on the local
launcher: the step time with ft off (HSDP, ``parallel.dp_replicate R``; at one rank per group,
plain data parallelism, the same arithmetic) against ft on (R replica groups, the replica reduce
through torchft's Manager) over the same ranks, nothing failing; then
the time from a group's death to the live group's next completed step — SIGKILL (the peer's
sockets close) and SIGSTOP (a stall: only ``ft.timeout_s`` ends the step's wait) — and to the dead
group's return (its launcher restarts it; it heals from the live group).

Each run is the ``fivefold train`` command in a fresh interpreter. Step times are the median of
the logged ``step_time_s`` of group 0 (HSDP: the run's) past the first ``warmup`` steps, each
layout run ``repeats`` times alternating; the death timings watch group 0's metrics.jsonl every
10 ms, so they are good to about that.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import markdown_table

__all__ = ["FtSpec", "bench_ft", "format_ft_table"]


@dataclass(frozen=True)
class FtSpec:
    preset: str = "small"
    nproc: int = 2
    groups: int = 2
    steps: int = 30
    warmup: int = 5
    repeats: int = 2
    seq_len: int = 256
    global_batch: int = 8
    zero_stage: int = 1
    timeout_s: float = 2.0  # ft.timeout_s: how long a step waits for a silent peer
    heartbeat_timeout_s: float = 1.0  # ft.heartbeat_timeout_s: the lighthouse drops a silent group


def _command(spec: FtSpec, out: Path, name: str, *more: str) -> list[str]:
    return [sys.executable, "-m", "fivefold.cli", "train", "--model.preset", spec.preset,
            "--nproc", str(spec.nproc), "--zero.stage", str(spec.zero_stage),
            "--train.seq_len", str(spec.seq_len), "--train.global_batch", str(spec.global_batch),
            "--run.log_every", "1", "--checkpoint.every_minutes", "0", "--checkpoint.at_end",
            "false", "--train.eval_every", "0", "--run.plot", "false", "--run.progress", "false",
            "--run.out_dir", str(out), "--run.name", name, "--overwrite", *more]  # fmt: skip


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # a line still being written
            continue
        if row.get("kind") == "train":
            rows.append(row)
    return rows


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def _ft_args(spec: FtSpec) -> list[str]:
    return ["--ft.replica_groups", str(spec.groups), "--ft.timeout_s", str(spec.timeout_s),
            "--ft.heartbeat_timeout_s", str(spec.heartbeat_timeout_s)]  # fmt: skip


def _step_times(spec: FtSpec, tmp: Path) -> dict[str, Any]:
    per_group = spec.nproc // spec.groups
    off = (  # the same ranks without ft: HSDP, or plain data parallelism at one rank per group
        (f"ft off (HSDP, dp_replicate {spec.groups})", ["--parallel.dp_replicate", str(spec.groups)])
        if per_group > 1 else (f"ft off (ZeRO-{spec.zero_stage}, dp {spec.nproc})", []))
    layouts = {
        off[0]: (off[1], Path("off")),
        f"ft on ({spec.groups} replica groups of {per_group})": (
            _ft_args(spec), Path("ft") / "replica0"),
    }  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for r in range(spec.repeats):
        for name in list(layouts) if r % 2 == 0 else list(reversed(layouts)):
            more, metrics = layouts[name]
            run = metrics.parts[0]
            subprocess.run(_command(spec, tmp, run, "--train.steps", str(spec.steps), *more),
                           check=True, env=_env(), stdout=subprocess.DEVNULL)  # fmt: skip
            rows = _rows(tmp / metrics / "metrics.jsonl")[spec.warmup :]
            times[name].append(statistics.median(row["step_time_s"] for row in rows))
    base = statistics.median(times[next(iter(layouts))])
    return {name: {"median_step_s": statistics.median(t), "runs_s": t,
                   "vs_off": statistics.median(t) / base} for name, t in times.items()}  # fmt: skip


def _group_workers(run_dir: Path) -> list[int]:
    """The training workers of a group's launcher (the pid its run lock names)."""
    try:
        pid = json.loads((run_dir / ".lock").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return []
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and b"spawn_main" in (stat.parent / "cmdline").read_bytes():
                kids.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def _death(spec: FtSpec, tmp: Path, how: str) -> dict[str, Any]:
    """Kill (or stop) every worker of group 1 once it logged step 10; watch group 0."""
    steps = 400
    name = f"death-{how}"
    cmd = _command(spec, tmp, name, "--train.steps", str(steps), "--run.max_restarts", "1",
                   "--run.stall_timeout_s", str(3 * spec.timeout_s), *_ft_args(spec))
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    live = tmp / name / "replica0" / "metrics.jsonl"
    dead = tmp / name / "replica1"
    killed_at = back_at = next_at = None
    before: list[dict[str, Any]] = []
    try:
        while proc.poll() is None:
            time.sleep(0.01)
            if killed_at is None:
                workers = _group_workers(dead)
                if workers and len(_rows(dead / "metrics.jsonl")) >= 10:
                    before = _rows(live)
                    for pid in workers:
                        os.kill(pid, getattr(signal, how))
                    killed_at = time.perf_counter()
                continue
            rows = _rows(live)
            if next_at is None and len(rows) > len(before) + 1:  # one step past the one running
                next_at = time.perf_counter()
            if next_at is not None and rows and rows[-1].get("replicas") == spec.groups:
                if rows[-1]["step"] > before[-1]["step"] + 1:
                    back_at = time.perf_counter()
                    break
    finally:
        proc.kill()
        proc.wait()
    if killed_at is None or next_at is None:
        raise RuntimeError(f"{how}: the run ended before the death could be timed")
    step_s = statistics.median(r["step_time_s"] for r in before[spec.warmup :])
    return {"signal": how, "to_next_step_s": next_at - killed_at, "step_s": step_s,
            "to_rejoin_s": None if back_at is None else back_at - killed_at}  # fmt: skip


def bench_ft(spec: FtSpec = FtSpec()) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-ft-"))
    try:
        return {"spec": asdict(spec), "cpus": os.cpu_count(), "steps": _step_times(spec, tmp),
                "deaths": [_death(spec, tmp, how) for how in ("SIGKILL", "SIGSTOP")]}  # fmt: skip
    finally:
        subprocess.run(["rm", "-rf", str(tmp)], check=False)


def format_ft_table(result: dict[str, Any]) -> str:
    s = result["spec"]
    head = (f"replica fault tolerance: preset {s['preset']}, {s['nproc']} ranks, ZeRO-"
            f"{s['zero_stage']}, global batch {s['global_batch']} x {s['seq_len']}, "
            f"{result['cpus']} CPUs; median step past {s['warmup']} of {s['steps']}, "
            f"{s['repeats']} runs each")  # fmt: skip
    rows = [["layout", "median step ms", "vs ft off"]]
    for name, r in result["steps"].items():
        rows.append([name, f"{r['median_step_s'] * 1e3:.1f}", f"{r['vs_off']:.2f}x"])
    deaths = [["group 1's workers", "to group 0's next step s", "(its step s)",
               "to group 1 back in the quorum s"]]  # fmt: skip
    for d in result["deaths"]:
        back = d["to_rejoin_s"]
        deaths.append([d["signal"], f"{d['to_next_step_s']:.2f}", f"{d['step_s']:.3f}",
                       f"{back:.1f}" if back is not None else "not seen"])  # fmt: skip
    tail = (f"ft.timeout_s {s['timeout_s']:g}, ft.heartbeat_timeout_s "
            f"{s['heartbeat_timeout_s']:g}, run.stall_timeout_s {3 * s['timeout_s']:g}")
    return "\n".join([head, "", *markdown_table(rows), "", tail, "", *markdown_table(deaths)])
