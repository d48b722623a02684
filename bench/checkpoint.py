"""Checkpoint costs: save (sync and async) and load time and the peak memory they add per rank, for a model trained
data-parallel over gloo ranks; and `fivefold export`'s peak memory against the model's size.

Save, sync: the step waits for the whole write. Async: it waits only for the copy to host memory (``blocked``);
the write goes on in the background (``complete``: until the checkpoint is renamed into place). Peak extra memory:
the process's resident high-water mark (Linux VmHWM, reset through /proc/self/clear_refs) above its resident size
just before, per rank, the largest over ranks. Export runs in a separate process (one parameter and one shard at a
time), its peak likewise above the process's size after start-up. No torch reference: torch has no checkpointer of
its own for these layouts beyond DCP, which both sides of fivefold's save already are.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness import freed_blocks_returned, markdown_table, resident_kib

__all__ = ["CheckpointSpec", "bench_checkpoint", "format_checkpoint_table"]


@dataclass(frozen=True)
class CheckpointSpec:
    preset: str = "small"
    dp: int = 2
    zero: int = 1
    repeats: int = 3
    seq_len: int = 128
    max_shard_mb: float = 8.0  # export's shards: small, to show the peak follows the shard, not the model
    threads: int = 1


def _measure(fn: Any, *args: Any) -> tuple[float, int]:
    """(seconds, peak resident bytes above the start) of ``fn(*args)``."""
    import gc
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = resident_kib()["VmRSS"]
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0, (resident_kib()["VmHWM"] - before) * 1024


def _load(path: Path, ts: Any, engines: Any) -> None:
    from fivefold.checkpoint.manager import Checkpointer
    Checkpointer.load(path, ts.state_dict)
    ts.after_load(engines)


def _worker(spec: CheckpointSpec, root: str) -> dict:
    import torch
    import torch.distributed as dist

    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize
    from fivefold.observe.memory import model_state_bytes

    cfg = Config()
    cfg.zero.stage, cfg.train.seq_len, cfg.train.grad_accum = spec.zero, spec.seq_len, 1
    model_cfg = get_config(spec.preset)
    mesh = ParallelMesh(ParallelDims(dp=spec.dp), "cpu", CommLog())
    parts = parallelize(cfg, model_cfg, mesh, "cpu")
    x = torch.randint(0, model_cfg.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(0))
    parts.forward_backward([(x, x)])
    parts.step(1.0)  # optimizer state exists
    held = sum(model_state_bytes(e).total for e in parts.engines.values())
    out: dict[str, list] = {"sync": [], "async_blocked": [], "async_complete": [], "load": []}
    peaks: dict[str, list] = {k: [] for k in out}
    step = 0
    checkpointers = {mode: Checkpointer(Path(root) / mode, keep=1, async_save=mode == "async")
                     for mode in ("sync", "async")}
    for _ in range(spec.repeats):
        for mode, ckpt in checkpointers.items():
            step += 1
            state = training_state(parts.engines.values(), mesh.comm("tp")).state_dict
            dist.barrier()
            t0 = time.perf_counter()
            seconds, peak = _measure(ckpt.save, step, state, {"steps_done": step, "model": asdict(model_cfg)})
            if mode == "sync":
                out["sync"].append(seconds)
                peaks["sync"].append(peak)
            else:
                out["async_blocked"].append(seconds)
                peaks["async_blocked"].append(peak)
                _, peak_rest = _measure(ckpt.wait)
                out["async_complete"].append(time.perf_counter() - t0)
                peaks["async_complete"].append(max(peak, peak_rest))
        path = Path(root) / "sync" / f"step-{step - 1:08d}"
        elementwise, scalars = Checkpointer.saved_optimizer_keys(path)
        ts = training_state(parts.engines.values(), mesh.comm("tp"), scalars, elementwise)
        dist.barrier()
        seconds, peak = _measure(_load, path, ts, list(parts.engines.values()))
        out["load"].append(seconds)
        peaks["load"].append(peak)
    return {"times": out, "peaks": peaks, "held": held}


_EXPORT = """
import json, re, sys, pathlib
def kib():
    s = pathlib.Path("/proc/self/status").read_text()
    return {k: int(re.search(k + r":\\s+(\\d+)", s).group(1)) for k in ("VmRSS", "VmHWM")}
import warnings, torch
from fivefold.checkpoint.hf import export_checkpoint
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load
import safetensors.torch
from fivefold.checkpoint.hf import _llama_config, model_tensors
from fivefold.checkpoint.manager import read_checkpoint_meta
model_tensors(_llama_config(read_checkpoint_meta(pathlib.Path(sys.argv[1]))["model"]))  # imports the model code (~30 MiB, once)
with warnings.catch_warnings():  # and DCP's first load: both before the baseline
    warnings.simplefilter("ignore")
    probe = FileSystemReader(sys.argv[1]).read_metadata().state_dict_metadata["model.norm.weight"]
    load({"model.norm.weight": torch.empty(tuple(probe.size))}, storage_reader=FileSystemReader(sys.argv[1]),
         no_dist=True)
pathlib.Path("/proc/self/clear_refs").write_text("5")
base = kib()["VmRSS"]
summary = export_checkpoint(sys.argv[1], sys.argv[2], max_shard_bytes=int(float(sys.argv[3]) * 2**20))
summary["peak_extra_bytes"] = (kib()["VmHWM"] - base) * 1024
print(json.dumps(summary))
"""


def _export(root: str, spec: CheckpointSpec) -> dict:
    """`export_checkpoint` of the last sync checkpoint in a process of its own; its summary and peak."""
    latest = sorted((Path(root) / "sync").glob("step-*"))[-1]
    done = subprocess.run([sys.executable, "-c", _EXPORT, str(latest), str(Path(root) / "hf"), str(spec.max_shard_mb)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_checkpoint(spec: CheckpointSpec | None = None, **overrides: Any) -> dict:
    """Save/load/export costs of ``spec.preset`` at dp ``spec.dp`` (one local launch plus one export process)."""
    from fivefold.distributed.launch import launch_local
    from fivefold.models import count_params, get_config
    from fivefold.models.llama import Llama

    spec = replace(spec or CheckpointSpec(), **overrides)
    with freed_blocks_returned(), tempfile.TemporaryDirectory(prefix="fivefold-ckpt-bench-") as root:
        ranks = launch_local(_worker, spec.dp, spec, root, threads=spec.threads, timeout_s=1800.0)
        export = _export(root, spec)
    n_params = count_params(Llama(get_config(spec.preset), device="meta"))
    times = {k: [max(r["times"][k][i] for r in ranks) for i in range(spec.repeats)] for k in ranks[0]["times"]}
    peaks = {k: max(max(r["peaks"][k]) for r in ranks) for k in ranks[0]["peaks"]}
    return {"kind": "checkpoint", "spec": asdict(spec), "params": n_params, "held_bytes": max(r["held"] for r in ranks),
            "times": times, "median_s": {k: statistics.median(v) for k, v in times.items()}, "peak_extra_bytes": peaks,
            "export": export, "model_fp32_bytes": 4 * n_params}


def format_checkpoint_table(results: dict) -> str:
    spec, mib = results["spec"], 2**20
    rows = [("operation", "median s (slowest rank)", "peak extra MiB per rank")]
    names = {"sync": "save, sync", "async_blocked": "save, async: training blocked", "async_complete":
             "save, async: until complete", "load": "load (+ refresh of the compute copies)"}
    for k, label in names.items():
        rows.append((label, f"{results['median_s'][k]:.3f}", f"{results['peak_extra_bytes'][k] / mib:.1f}"))
    out = markdown_table(rows)
    e = results["export"]
    out += ["", f"preset {spec['preset']} ({results['params']:,} params), dp={spec['dp']} ZeRO-{spec['zero']} gloo "
            f"ranks, each holding {results['held_bytes'] / mib:.1f} MiB of model states; {spec['repeats']} repeats. "
            f"Export ({len(e['files'])} safetensors files of at most {spec['max_shard_mb']:g} MiB): peak "
            f"{e['peak_extra_bytes'] / mib:.1f} MiB above the process's start-up size for a "
            f"{results['model_fp32_bytes'] / mib:.1f} MiB fp32 model (largest shard held "
            f"{e['peak_held_bytes'] / mib:.1f} MiB)."]
    return "\n".join(out)


@dataclass(frozen=True)
class SaveShareSpec:
    """Training runs (`fivefold.train.trainer.run`) with the default saves: at the end, and by time. ``every_minutes``:
    the time intervals tried; the default's, and one so short that the 50-waits rule (`TimedSaves`) sets the pace."""
    preset: str = "small"
    steps: int = 60
    nproc: int = 2
    zero: int = 1
    seq_len: int = 128
    every_minutes: tuple[float, ...] = (10.0, 0.001)


def bench_save_share(spec: SaveShareSpec | None = None, **overrides: Any) -> dict:
    """The share of a run's time its saves take: the training's waits for saves (the "checkpoint" records' seconds)
    over those plus the steps' times (`metrics.jsonl`; steps exclude saves), per ``every_minutes``."""
    from fivefold.config import load_config
    from fivefold.train.trainer import run

    spec = replace(spec or SaveShareSpec(), **overrides)
    runs = []
    with tempfile.TemporaryDirectory(prefix="fivefold-ckpt-share-") as root:
        for every in spec.every_minutes:
            name = f"every-{every:g}"
            run(load_config(None, [
                "--preset", spec.preset, "--steps", str(spec.steps), "--nproc", str(spec.nproc), "--zero",
                str(spec.zero), "--train.seq_len", str(spec.seq_len), "--train.eval_every", "0", "--run.out_dir",
                root, "--run.name", name, "--run.progress", "false", "--run.plot", "false",
                "--checkpoint.every_minutes", str(every)]))
            records = [json.loads(line) for line in (Path(root) / name / "metrics.jsonl").read_text().splitlines()]
            steps_s = sum(r["step_time_s"] for r in records if r["kind"] == "train")
            saves = [(r["reason"], r["seconds"]) for r in records if r["kind"] == "checkpoint"]
            saving = sum(s for _, s in saves)
            runs.append({"every_minutes": every, "steps_s": steps_s, "saves": saves, "saving_s": saving,
                         "share": saving / (steps_s + saving)})
    return {"kind": "checkpoint-share", "spec": asdict(spec), "runs": runs}


def format_save_share_table(results: dict) -> str:
    spec = results["spec"]
    rows = [("checkpoint.every_minutes", "saves (by reason)", "training s", "waiting for saves s",
             "share, saves by time", "share, all saves")]
    for r in results["runs"]:
        reasons: dict[str, int] = {}
        for reason, _ in r["saves"]:
            reasons[reason] = reasons.get(reason, 0) + 1
        timed = sum(s for reason, s in r["saves"] if reason == "time")
        rows.append((f"{r['every_minutes']:g}", ", ".join(f"{n} {k}" for k, n in reasons.items()),
                     f"{r['steps_s']:.2f}", f"{r['saving_s']:.3f}",
                     f"{100 * timed / (r['steps_s'] + r['saving_s']):.2f} %", f"{100 * r['share']:.2f} %"))
    return "\n".join(markdown_table(rows) + [
        "", f"preset {spec['preset']}, {spec['steps']} steps, {spec['nproc']} gloo ranks, ZeRO-{spec['zero']}, "
        f"seq {spec['seq_len']}; checkpoint.at_end on (the defaults). Share: the training's waits for saves over "
        "those plus the steps' times."])
