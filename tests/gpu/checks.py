"""The GPU checks `tests/gpu/run.sh` runs, one part at a time, each writing ``OUT/<part>.json``.

    python tests/gpu/checks.py PART OUT [--dry-run]

Parts (one accelerator, world 1 on NCCL; ``--dry-run``: the same code on the CPU, gloo, tiny sizes):
- ``syncs``: steady-state steps of every single-device layout under
  ``torch.cuda.set_sync_debug_mode("error")`` (a sync raises); dry run: the simulated count
  (`bench/host_syncs.py`, meta standing in for CUDA), which must be 0 on unlogged steps.
- ``moe``: the MoE step's host syncs (``set_sync_debug_mode("warn")``, each warning counted) per
  MoE layer per micro-batch; dry run: `fivefold.observe.host_syncs` on the CPU path, over forward
  and backward.
- ``profile``: a Llama-3.2-1B bf16 step (ZeRO-1 at dp 1, seq 2048) under torch.profiler: kernels
  and synchronising runtime calls per step, step time, tokens/s and MFU; dry run: a tiny model.
- ``compile``: ``train.compile`` blocks (inductor: triton on CUDA, C++ on the CPU), a few steps;
  the loss equals eager's first-step loss to bf16 rounding.
- ``cp-kernel``: ring attention's block kernels, flash vs math at 8k tokens, cp 4 emulated by
  blocks (`python bench/run.py cp-kernel`).
- ``watch``: a short torchrun run with ``run.profile 2``, ``run.memory_snapshot`` and
  ``run.flight_recorder``: the profile holds the last two steps and CUDA kernels, the snapshot
  segments and allocator events; an out-of-memory error writes a snapshot at once; dry run: the
  CPU (no snapshot: refused there).
- ``flight-recorder``: NCCL's flight recorder armed, two all-reduces, SIGUSR1 -> this rank's dump
  holding them (``_dump_nccl_trace``); dry run: gloo's (``_dump_fr_trace``).
- ``fp8``: FP8 linears (tensorwise, rowwise; eager and compiled) against bf16 on a 1B step: step
  time and speed-up, no host sync, the first loss within e4m3's precision of bf16's.
- ``muon``: Muon against AdamW on the same step: step time, no host sync.

A part that fails writes its error to its json and exits 1; run.sh goes on with the next."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import host_syncs  # noqa: E402

# single-device layouts (world 1): each ZeRO stage, recompute, bf16 with fp32 reduce
SINGLE_DEVICE = {
    "ddp": dict(zero=0),
    "zero1-bf16": dict(zero=1, param="bf16", reduce="fp32"),
    "zero2-bf16": dict(zero=2, param="bf16", reduce="fp32"),
    "zero3-bf16": dict(zero=3, param="bf16", reduce="fp32"),
    "zero3-full-recompute": dict(zero=3, recompute="full"),
}


def _init(device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _done() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _device(dry: bool) -> torch.device:
    return torch.device("cpu") if dry else torch.device("cuda", 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def part_syncs(dry: bool) -> dict[str, Any]:
    """0 syncs in a steady-state unlogged step, per layout."""
    if dry:
        result = host_syncs.bench_syncs()
        bad = {n: r for n, r in result["layouts"].items() if r["unlogged"]}
        return dict(simulated=result["layouts"], ok=not bad)
    device, out = _device(dry), {}
    for name, o in SINGLE_DEVICE.items():
        _init(device)
        try:
            cfg, mesh, parts = host_syncs.build_rank({}, o, log_every=1000, device=str(device),
                                                     seq=256, micro_batches=4)
            trainer = host_syncs.stepping_trainer(cfg, parts, mesh, steps=1000, vocab=16)
            for step in range(3):  # warm-up: lazy state, the first log step
                trainer.train_step(step)
            _sync(device)
            error = None
            torch.cuda.set_sync_debug_mode("error")
            try:
                for step in range(3, 6):  # unlogged steps
                    trainer.train_step(step)
            except RuntimeError as e:
                error = "".join(traceback.format_exception(e)[-6:])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            _sync(device)
            out[name] = dict(ok=error is None, error=error)
        finally:
            _done()
    return dict(layouts=out, ok=all(r["ok"] for r in out.values()))


def part_moe(dry: bool) -> dict[str, Any]:
    """Host syncs of a steady-state MoE step, per MoE layer per micro-batch (declared: 1)."""
    from fivefold.models import get_config

    device = _device(dry)
    model = get_config("tiny-moe", max_seq_len=64)
    moe_layers = sum(model.is_moe_block(i) for i in range(model.n_layers))
    _init(device)
    try:
        cfg, mesh, parts = host_syncs.build_rank({}, dict(zero=1), log_every=1000,
                                                 device=str(device), model=model, seq=64,
                                                 micro_batches=2)
        trainer = host_syncs.stepping_trainer(cfg, parts, mesh, steps=1000, rows=2,
                                              vocab=model.vocab_size)
        for step in range(2):
            trainer.train_step(step)
        _sync(device)
        if dry:
            from fivefold.observe.host_syncs import HostSyncs

            batches = trainer._micro_batches(2)
            # forward and backward only: on the CPU path everything counts, torch's own CPU AdamW
            # reading its step counts too
            with HostSyncs(devices=("cpu",)) as syncs:
                parts.forward_backward(batches)
            count, where = syncs.count, sorted({w.splitlines()[0] for w in syncs.where})
        else:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    trainer.train_step(2)
                    _sync(device)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncing = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            count, where = len(syncing), sorted(set(syncing))[:10]
        per = count / (moe_layers * cfg.train.grad_accum)
        return dict(syncs=count, moe_layers=moe_layers, micro_batches=cfg.train.grad_accum,
                    per_layer_per_micro_batch=per, where=where, ok=per <= 1)
    finally:
        _done()


def part_profile(dry: bool) -> dict[str, Any]:
    """Kernels and synchronising calls per step of a 1B bf16 step; tokens/s and MFU."""
    from torch.profiler import ProfilerActivity, profile

    from fivefold.formulas import model_flops_per_token
    from fivefold.models import get_config
    from fivefold.models.llama import param_counts
    from fivefold.observe.peak import device_peak_flops

    device = _device(dry)
    preset, seq, rows, accum = ("tiny", 128, 2, 2) if dry else ("llama3.2-1b", 2048, 4, 2)
    model = get_config(preset, max_seq_len=max(seq, get_config(preset).max_seq_len))
    _, active = param_counts(model)
    peak = device_peak_flops(device, torch.bfloat16)
    _init(device)
    try:
        cfg, mesh, parts = host_syncs.build_rank(
            {}, dict(zero=1, param="bf16", reduce="fp32"), log_every=1000, device=str(device),
            model=model, seq=seq, micro_batches=accum)
        trainer = host_syncs.stepping_trainer(
            cfg, parts, mesh, steps=1000, rows=rows, vocab=model.vocab_size, peak_flops=peak,
            flops_per_token=model_flops_per_token(active, model.n_layers, seq, model.n_heads * model.head_dim))
        for step in range(3):
            trainer.train_step(step)
        _sync(device)
        steps = 3
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not dry else [])
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            for step in range(3, 3 + steps):
                trainer.train_step(step)
            _sync(device)
        step_s = (time.perf_counter() - t0) / steps
        events = prof.events()
        kernels = sum(1 for e in events if e.device_type.name == "CUDA")
        syncing = {}
        for e in events:
            if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
                          "cudaMemcpy", "cudaMemcpyAsync+sync"):
                syncing[e.name] = syncing.get(e.name, 0) + 1
        aten_ops = sum(1 for e in events if e.name.startswith("aten::"))
        tp = trainer.throughput
        return dict(model=preset, seq=seq, micro_batch=rows, grad_accum=accum,
                    step_s=step_s, tokens_per_s=tp.tokens_per_s(step_s),
                    tflops_per_device=tp.tflops_per_device(step_s), mfu=tp.mfu(step_s),
                    kernels_per_step=kernels / steps, aten_ops_per_step=aten_ops / steps,
                    synchronising_calls_per_step={k: v / steps for k, v in syncing.items()},
                    peak_memory_gib=(torch.cuda.max_memory_allocated() / 2**30 if not dry
                                     else None),
                    ok=True)
    finally:
        _done()


def part_compile(dry: bool) -> dict[str, Any]:
    """Compiled blocks train: the first step's loss equals eager's (the same weights and data)."""
    device, losses = _device(dry), {}
    for compiled in (False, True):
        _init(device)
        try:
            o = dict(zero=1, compile=compiled, **({} if dry else dict(param="bf16")))
            cfg, mesh, parts = host_syncs.build_rank({}, o, log_every=1, device=str(device),
                                                     seq=64, micro_batches=2)
            trainer = host_syncs.stepping_trainer(cfg, parts, mesh, steps=4, vocab=16)
            t0 = time.perf_counter()
            losses[compiled] = [trainer.train_step(s).loss_value for s in range(4)]
            losses[f"{compiled}_s"] = time.perf_counter() - t0
        finally:
            _done()
    rtol = 1e-5 if dry else 2 ** -7  # one bf16 rounding of the loss
    first = abs(losses[True][0] - losses[False][0]) <= rtol * abs(losses[False][0])
    return dict(eager=losses[False], compiled=losses[True], eager_s=losses["False_s"],
                compiled_s=losses["True_s"], ok=first)


def part_cp_kernel(dry: bool) -> dict[str, Any]:
    from bench.context_parallel import CPKernelSpec, bench_cp_kernels, format_cp_kernel_table

    spec = CPKernelSpec.dry_run() if dry else CPKernelSpec()
    result = bench_cp_kernels(spec)
    return dict(result=result, table=format_cp_kernel_table(result), ok=True)


def part_watch(dry: bool) -> dict[str, Any]:
    """run.profile, run.memory_snapshot and run.flight_recorder through the trainer: their files."""
    import pickle
    import subprocess
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="fivefold-watch-"))
    args = ["-m", "fivefold.train", "--preset", "tiny", "--steps", "4", "--name", "watch",
            "--run.out_dir", str(out), "--run.progress", "false", "--run.plot", "false",
            "--train.eval_every", "0", "--run.profile", "2", "--run.flight_recorder", "100"]
    if dry:
        cmd = [sys.executable, *args, "--nproc", "1", "--device", "cpu", "--train.seq_len", "64",
               "--train.global_batch", "4", "--train.micro_batch", "2"]
    else:
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node",
               "1", *args, "--run.memory_snapshot", "true"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    if done.returncode != 0:
        return dict(ok=False, error=done.stderr[-3000:])
    run = out / "watch"
    events = json.loads((run / "profile" / "rank0.json").read_text())["traceEvents"]
    marks = sorted({e["name"] for e in events if e.get("name", "").startswith("fivefold step")})
    result: dict[str, Any] = dict(
        marks=marks, kernels=sum(e.get("cat") == "kernel" for e in events),
        memory_events=sum(e.get("name") == "[memory]" for e in events),
        flight_recorder_dir=(run / "flight_recorder").is_dir(), stdout=done.stdout[-1500:])
    ok = marks == ["fivefold step 3", "fivefold step 4"] and result["memory_events"] > 0
    ok = ok and result["flight_recorder_dir"]
    if not dry:
        with open(run / "memory_snapshot" / "rank0.pickle", "rb") as f:
            snapshot = pickle.load(f)
        result.update(segments=len(snapshot["segments"]),
                      allocator_events=sum(len(t) for t in snapshot["device_traces"]))
        ok = ok and result["kernels"] > 0 and result["segments"] > 0
        ok = ok and result["allocator_events"] > 0
        # an out-of-memory error while recording writes the snapshot at once
        from fivefold.observe.profile import MemoryHistory

        history = MemoryHistory(out / "oom.pickle")
        history.start()
        try:
            torch.empty(2**50, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        result["oom_snapshot"] = history.path.exists()
        history.dump()
        ok = ok and result["oom_snapshot"]
    return dict(result, ok=ok)


def part_flight_recorder(dry: bool) -> dict[str, Any]:
    """SIGUSR1 -> this rank's flight recorder dump, holding the collectives it ran."""
    import os
    import pickle
    import signal
    import tempfile

    import torch.distributed as dist

    from fivefold.distributed.flight_recorder import FlightRecorder

    device = _device(dry)
    recorder = FlightRecorder(tempfile.mkdtemp(prefix="fivefold-fr-"), entries=100)
    recorder.arm()
    recorder.install(0, device.type)
    _init(device)
    try:
        for _ in range(2):
            dist.all_reduce(torch.ones(1024, device=device))
        _sync(device)
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 30
        while not recorder.path(0).exists() and time.time() < deadline:
            time.sleep(0.1)
        entries = pickle.loads(recorder.path(0).read_bytes())["entries"]
    finally:
        _done()
    names = [e["profiling_name"] for e in entries]
    want = "gloo:all_reduce" if dry else "nccl:all_reduce"
    return dict(names=names, ok=names.count(want) >= 2)


def _timed_steps(o: dict[str, Any], device: torch.device, dry: bool, model: Any, seq: int, rows: int,
                 accum: int, steps: int = 5) -> dict[str, Any]:
    """One configuration (world 1): 3 warm-up steps, then `steps` timed unlogged steps under
    ``set_sync_debug_mode("error")`` on CUDA (a host sync raises); the first loss and the step time."""
    _init(device)
    try:
        cfg, mesh, parts = host_syncs.build_rank({}, o, log_every=1000, device=str(device),
                                                 model=model, seq=seq, micro_batches=accum)
        trainer = host_syncs.stepping_trainer(cfg, parts, mesh, steps=1000, rows=rows,
                                              vocab=model.vocab_size)
        first = trainer.train_step(0).loss_value
        for step in range(1, 3):
            trainer.train_step(step)
        _sync(device)
        error = None
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        t0 = time.perf_counter()
        try:
            for step in range(3, 3 + steps):
                trainer.train_step(step)
            _sync(device)
        except RuntimeError as e:
            error = "".join(traceback.format_exception(e)[-6:])
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
        step_s = (time.perf_counter() - t0) / steps
        return dict(first_loss=first, step_s=step_s, tokens_per_s=rows * seq * accum / step_s,
                    sync_error=error)
    finally:
        _done()


def _one_b(dry: bool) -> tuple[Any, int, int, int]:
    """(model, seq, rows, micro-batches): Llama-3.2-1B at 2048 tokens on a GPU; a tiny model whose
    FP8 GEMM dimensions are multiples of 16 in a dry run."""
    from fivefold.models import get_config

    if dry:
        return get_config("tiny", n_layers=2, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                          max_seq_len=64, vocab_size=256), 64, 2, 2
    return get_config("llama3.2-1b"), 2048, 4, 2


def part_fp8(dry: bool) -> dict[str, Any]:
    """FP8 linears against bf16 on one GPU (Llama-3.2-1B, ZeRO-1 at dp 1, bf16 parameters): step
    time eager and compiled (torchao's FP8 is meant to run compiled: the casts fused), tensorwise and
    rowwise; no host sync in the timed steps; the first loss within e4m3's precision (2⁻⁴) of
    bf16's. Dry run: a tiny model on the CPU (FP8 slower there: emulated)."""
    device = _device(dry)
    model, seq, rows, accum = _one_b(dry)
    runs: dict[str, dict[str, Any]] = {}
    for name, o in {"bf16": dict(), "fp8-tensorwise": dict(fp8="tensorwise"),
                    "fp8-rowwise": dict(fp8="rowwise"),
                    "bf16-compiled": dict(compile=True),
                    "fp8-tensorwise-compiled": dict(fp8="tensorwise", compile=True)}.items():
        runs[name] = _timed_steps(dict(zero=1, param="bf16", reduce="fp32", **o), device, dry, model,
                                  seq, rows, accum)
    base = runs["bf16"]["first_loss"]
    speed = {name: runs[name.replace("fp8-tensorwise", "bf16").replace("fp8-rowwise", "bf16")]
             ["step_s"] / r["step_s"] for name, r in runs.items() if name.startswith("fp8")}
    ok = all(r["sync_error"] is None for r in runs.values()) and all(
        abs(r["first_loss"] - base) <= 2**-4 * base for r in runs.values())
    return dict(runs=runs, speedup_over_bf16=speed, ok=ok)


def part_muon(dry: bool) -> dict[str, Any]:
    """Muon (the blocks' matrices, Newton-Schulz in bf16) against AdamW on one GPU (Llama-3.2-1B,
    ZeRO-1 at dp 1): step time, and no host sync (a non-finite step skipped on the device)."""
    device = _device(dry)
    model, seq, rows, accum = _one_b(dry)
    runs = {name: _timed_steps(dict(zero=1, param="bf16", reduce="fp32", optim=name), device, dry,
                               model, seq, rows, accum) for name in ("adamw", "muon")}
    return dict(runs=runs, muon_over_adamw=runs["muon"]["step_s"] / runs["adamw"]["step_s"],
                ok=all(r["sync_error"] is None for r in runs.values()))


PARTS = {"syncs": part_syncs, "moe": part_moe, "profile": part_profile, "compile": part_compile,
         "watch": part_watch, "flight-recorder": part_flight_recorder,
         "cp-kernel": part_cp_kernel, "fp8": part_fp8, "muon": part_muon}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU, tiny sizes")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        result = PARTS[args.part](args.dry_run)
    except Exception as e:  # the part failed: say so in its file, and let the script go on
        result = dict(ok=False, error="".join(traceback.format_exception(e)[-12:]))
    result.update(part=args.part, dry_run=args.dry_run, wall_s=time.perf_counter() - t0,
                  torch=torch.__version__,
                  device=(torch.cuda.get_device_name(0) if not args.dry_run else "cpu"))
    (args.out / f"{args.part}.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"{args.part}: {'ok' if result['ok'] else 'FAILED'} ({result['wall_s']:.0f} s)"
          + ("" if result["ok"] else "\n" + str(result.get("error", ""))[-2000:]), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
