"""Benchmarks: fivefold's data-parallel wrappers timed against torch's own, in one launch.

A benchmark is a list of *contestants* — (name, build function) pairs — that share one timing
loop. Each contestant gets its own copy of the same model (same seed), its own optimizer and
the same batches; the loop alternates blocks of steps between contestants (A B, B A, A B, ...)
so that machine noise and slow drift hit every contestant alike. For every timed step it keeps
the wall time of the slowest rank, the loss and the bytes the step communicated, then reports
medians, tokens/s, bytes per step and how far the loss trajectories drift apart.

Only the DDP pair exists today (`bench_ddp`: fivefold `DDP` vs
`torch.nn.parallel.DistributedDataParallel`); ZeRO / FSDP pairs are further `Contestant`s whose
build function returns a `Runner` (and may bring its own sharded optimizer).

Communication is measured for both sides: fivefold's from its `CommLog`; torch DDP's by a comm
hook that counts each bucket's ``buffer()`` bytes and then runs torch's default all-reduce hook
(``ddp_comm_hooks.default_hooks.allreduce_hook``: divide by N, all-reduce — the same arithmetic
as the built-in path). Wire bytes are the ring formula 2(N-1)/N · payload for both.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.comm import Comm, CommLog, ring_wire_bytes
from fivefold.mesh import launch_local
from fivefold.models import build_model, get_config

__all__ = [
    "BenchSpec",
    "CommBytes",
    "Contestant",
    "DDP_CONTESTANTS",
    "Runner",
    "bench_ddp",
    "format_table",
    "main",
    "run_contest",
]


@dataclass(frozen=True)
class BenchSpec:
    """Everything a contestant needs to know about the run (picklable: sent to every rank)."""

    preset: str = "small"
    world: int = 2
    steps: int = 48  # timed steps per contestant
    warmup: int = 3  # untimed steps per contestant before the first timed block
    repeats: int = 8  # the timed steps are split into this many blocks per contestant
    micro_batch: int = 4  # sequences per rank per step
    seq_len: int = 128
    bucket_mb: float = 25.0
    lr: float = 1e-3
    seed: int = 0
    threads: int = 1  # torch threads per rank

    @property
    def tokens_per_step(self) -> int:
        return self.world * self.micro_batch * self.seq_len


@dataclass
class CommBytes:
    """Collective traffic of one step on one rank."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class Runner:
    """One contestant, built on one rank: a full training step and its communication counter."""

    step: Callable[[torch.Tensor, torch.Tensor], float]  # (x, y) -> local loss; zero_grad..opt.step
    reset_comm: Callable[[], None]
    comm: Callable[[], CommBytes]  # traffic since the last reset_comm()
    comm_source: str = "measured"
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Contestant:
    """A named implementation: ``build(model, spec) -> Runner`` (module-level, so it pickles)."""

    name: str
    build: Callable[[nn.Module, BenchSpec], Runner]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _adamw(params: Sequence[nn.Parameter], spec: BenchSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.1)


def _standard_step(model: nn.Module, opt: torch.optim.Optimizer,
                   zero_grad: Callable[[], None]) -> Callable[[torch.Tensor, torch.Tensor], float]:
    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()  # also a device sync point, so the wall time covers the whole step

    return step


# -- contestants ----------------------------------------------------------------------------------

def build_fivefold_ddp(model: nn.Module, spec: BenchSpec) -> Runner:
    from fivefold.data_parallel import DDP

    log = CommLog()
    ddp = DDP(model, Comm(None, "dp", log), bucket_mb=spec.bucket_mb)
    opt = _adamw([p for p in ddp.parameters() if p.requires_grad], spec)

    def comm() -> CommBytes:
        t = log.totals()
        return CommBytes(t.calls, t.payload_bytes, t.wire_bytes)

    return Runner(_standard_step(ddp, opt, ddp.zero_grad), log.reset, comm, "measured (CommLog)",
                  [f"fivefold DDP: bucket_mb={spec.bucket_mb}, {len(ddp.buckets)} bucket(s), "
                   "grads are bucket views, zero_grad() zeros the buckets in place"])


class _HookCounter:
    """State of the counting comm hook: bytes of every bucket torch DDP all-reduces."""

    def __init__(self) -> None:
        self.calls = 0
        self.payload_bytes = 0

    def reset(self) -> None:
        self.calls = 0
        self.payload_bytes = 0


def _counting_allreduce_hook(state, bucket):  # unannotated: torch checks hook annotations literally
    """Count ``bucket``'s bytes (a `dist.GradBucket`), then torch's default all-reduce hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.calls += 1
    state.payload_bytes += buf.numel() * buf.element_size()
    return default_hooks.allreduce_hook(None, bucket)


def build_torch_ddp(model: nn.Module, spec: BenchSpec) -> Runner:
    from torch.nn.parallel import DistributedDataParallel

    kwargs: dict[str, Any] = dict(bucket_cap_mb=spec.bucket_mb, gradient_as_bucket_view=True)
    # No per-forward buffer broadcast (fivefold DDP has none; the RoPE tables are identical anyway).
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = False
    else:
        kwargs["broadcast_buffers"] = False
    ddp = DistributedDataParallel(model, **kwargs)
    counter = _HookCounter()
    ddp.register_comm_hook(counter, _counting_allreduce_hook)
    opt = _adamw([p for p in ddp.parameters() if p.requires_grad], spec)
    world = dist.get_world_size()

    def comm() -> CommBytes:
        return CommBytes(counter.calls, counter.payload_bytes,
                         ring_wire_bytes("all_reduce", counter.payload_bytes, world))

    def zero_grad() -> None:
        opt.zero_grad(set_to_none=False)  # keep the bucket views, like fivefold's in-place zeroing

    return Runner(_standard_step(ddp, opt, zero_grad), counter.reset, comm,
                  "measured (comm hook: bucket.buffer() bytes)",
                  [f"torch DDP: bucket_cap_mb={spec.bucket_mb}, gradient_as_bucket_view=True, "
                   "no per-forward buffer sync, counting comm hook wrapping default allreduce_hook, "
                   "optimizer.zero_grad(set_to_none=False)"])


DDP_CONTESTANTS = (Contestant("fivefold", build_fivefold_ddp), Contestant("torch", build_torch_ddp))


# -- the shared timing loop -------------------------------------------------------------------------

def _blocks(steps: int, repeats: int) -> list[int]:
    repeats = max(1, min(repeats, steps))
    base, extra = divmod(steps, repeats)
    return [base + (1 if i < extra else 0) for i in range(repeats)]


def _contest_worker(spec: BenchSpec, contestants: Sequence[Contestant]) -> dict | None:
    from fivefold.train.data import TokenDataset, load_tokens

    rank, world = dist.get_rank(), dist.get_world_size()
    config = get_config(spec.preset)
    if spec.seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={spec.seq_len} exceeds preset {spec.preset!r} "
                         f"max_seq_len={config.max_seq_len}")
    total = spec.warmup + spec.steps
    data = TokenDataset(load_tokens(None), spec.seq_len, seed=spec.seed)
    batches = [data.micro_batch(s, spec.micro_batch * world, 0, 1, rank, world) for s in range(total)]

    n_params = 0
    runners: list[Runner] = []
    for c in contestants:
        model = build_model(config, seed=spec.seed)
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        runners.append(c.build(model, spec))
    n = len(runners)
    times = torch.zeros(n, total, dtype=torch.float64)
    losses = torch.zeros(n, total, dtype=torch.float64)
    comm: list[list[CommBytes]] = [[CommBytes() for _ in range(total)] for _ in range(n)]
    done = [0] * n

    def run(i: int, count: int) -> None:
        runner = runners[i]
        for _ in range(count):
            s = done[i]
            x, y = batches[s]
            dist.barrier()  # everyone starts the step together; barrier traffic is not logged
            runner.reset_comm()
            t0 = time.perf_counter()
            loss = runner.step(x, y)
            times[i, s] = time.perf_counter() - t0
            losses[i, s] = loss
            comm[i][s] = runner.comm()
            done[i] += 1

    for i in range(n):
        run(i, spec.warmup)
    for r, count in enumerate(_blocks(spec.steps, spec.repeats)):
        order = range(n) if r % 2 == 0 else reversed(range(n))  # A B, B A, ...: no order bias
        for i in order:
            run(i, count)

    # Step time = the slowest rank's; loss curves compared rank by rank and reported as global means.
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    local_diff = (losses - losses[:1]).abs().amax().reshape(1)
    dist.all_reduce(local_diff, op=dist.ReduceOp.MAX)
    mean_losses = losses.clone()
    dist.all_reduce(mean_losses)
    mean_losses /= world
    # Free the wrappers (their hooks, reducers and work handles) while the process group is alive:
    # left to interpreter exit, their teardown after destroy_process_group can abort the process.
    described = [(r.comm_source, r.notes) for r in runners]
    del run
    runners.clear()
    gc.collect()
    dist.barrier()
    if rank != 0:
        return None

    tokens = spec.tokens_per_step
    impls = []
    for i, c in enumerate(contestants):
        timed = times[i, spec.warmup:].tolist()
        q = statistics.quantiles(timed, n=4) if len(timed) >= 2 else [timed[0]] * 3
        step_comm = comm[i][spec.warmup:] or comm[i]
        last = step_comm[-1]
        impls.append(dict(
            name=c.name,
            median_s=statistics.median(timed),
            p25_s=q[0], p75_s=q[2], min_s=min(timed),
            tokens_per_s=tokens / statistics.median(timed),
            times_s=timed,
            comm_calls=last.calls,
            payload_bytes=last.payload_bytes,
            wire_bytes=last.wire_bytes,
            comm_constant=all(asdict(b) == asdict(last) for b in step_comm),
            comm_source=described[i][0],
            losses=mean_losses[i].tolist(),
            notes=described[i][1],
        ))
    ref = impls[-1]
    return dict(
        spec=asdict(spec),
        params=n_params,
        expected_payload_bytes=4 * n_params,
        expected_wire_bytes=ring_wire_bytes("all_reduce", 4 * n_params, world),
        tokens_per_step=tokens,
        impls=impls,
        ratio=impls[0]["median_s"] / ref["median_s"],
        ratio_label=f"{impls[0]['name']}/{ref['name']}",
        max_abs_loss_diff=float(local_diff.item()),
    )


def run_contest(spec: BenchSpec, contestants: Sequence[Contestant], timeout_s: float = 3600.0) -> dict:
    """Time `contestants` against each other in one `launch_local` run of ``spec.world`` gloo ranks."""
    if spec.steps < 1 or spec.warmup < 0 or spec.world < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0 and world >= 1, got {spec}")
    results = launch_local(_contest_worker, spec.world, spec, tuple(contestants),
                           threads=spec.threads, timeout_s=timeout_s)
    return results[0]


def bench_ddp(preset: str = "small", world: int = 2, steps: int = 48, warmup: int = 3,
              micro_batch: int = 4, seq_len: int = 128, bucket_mb: float = 25.0, repeats: int = 8,
              threads: int = 1, lr: float = 1e-3, seed: int = 0) -> dict:
    """fivefold `DDP` vs torch `DistributedDataParallel`: same model, data and AdamW; see module doc.

    Returns a dict with ``impls`` (per implementation: median/p25/p75 step time of the slowest
    rank, tokens/s, measured all-reduce payload and ring-wire bytes per step and rank, the
    global-mean loss of every step), ``ratio`` (fivefold / torch median step time),
    ``max_abs_loss_diff`` (over steps and ranks), ``params`` (Ψ) and ``expected_payload_bytes``
    (4Ψ for fp32 gradients).
    """
    spec = BenchSpec(preset=preset, world=world, steps=steps, warmup=warmup, repeats=repeats,
                     micro_batch=micro_batch, seq_len=seq_len, bucket_mb=bucket_mb, lr=lr, seed=seed,
                     threads=threads)
    return run_contest(spec, DDP_CONTESTANTS)


# -- output -----------------------------------------------------------------------------------------

def _mb(b: float) -> str:
    return f"{b / 2**20:.2f}"


def format_table(results: dict) -> str:
    """A markdown table of a `run_contest` / `bench_ddp` result, with the settings and checks below it."""
    spec = results["spec"]
    rows = [("impl", "median step ms", "p25–p75 ms", "tokens/s", "all-reduce calls",
             "payload MiB/step", "wire MiB/step", "bytes")]
    for r in results["impls"]:
        spread = f"{r['p25_s'] * 1e3:.1f}–{r['p75_s'] * 1e3:.1f}"
        rows.append((r["name"], f"{r['median_s'] * 1e3:.1f}", spread,
                     f"{r['tokens_per_s']:,.0f}", str(r["comm_calls"]), _mb(r["payload_bytes"]),
                     _mb(r["wire_bytes"]), r["comm_source"] + ("" if r["comm_constant"] else ", varies")))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |"

    out = [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(row) for row in rows[1:]]
    psi = results["params"]
    out += [
        "",
        f"ratio {results['ratio_label']} (median step time): {results['ratio']:.3f}",
        f"max |loss difference| over steps and ranks: {results['max_abs_loss_diff']:.2e}",
        f"expected per step and rank: payload 4Ψ = {_mb(results['expected_payload_bytes'])} MiB, "
        f"ring wire 2(N-1)/N·4Ψ = {_mb(results['expected_wire_bytes'])} MiB (Ψ = {psi:,})",
        f"preset {spec['preset']}, world {spec['world']} (gloo, {spec['threads']} thread(s)/rank), "
        f"micro_batch {spec['micro_batch']} × seq_len {spec['seq_len']} = "
        f"{results['tokens_per_step']:,} tokens/step, AdamW, {spec['steps']} timed steps "
        f"(+{spec['warmup']} warmup) per impl in {len(_blocks(spec['steps'], spec['repeats']))} "
        "alternating blocks; step = zero_grad + forward + backward + optimizer step, "
        "time of the slowest rank",
    ]
    for r in results["impls"]:
        out += [f"- {note}" for note in r["notes"]]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``fivefold bench ddp [options]`` / ``python bench/run.py ddp [options]``: print the table."""
    parser = argparse.ArgumentParser(prog="fivefold bench",
                                     description="Time fivefold against torch's reference implementations "
                                                 "on local gloo CPU ranks (one launch, interleaved blocks).")
    sub = parser.add_subparsers(dest="what", required=True)
    ddp = sub.add_parser("ddp", help="fivefold DDP vs torch DistributedDataParallel")
    d = BenchSpec()
    ddp.add_argument("--preset", default=d.preset)
    ddp.add_argument("--world", type=int, default=d.world, help="number of gloo ranks")
    ddp.add_argument("--steps", type=int, default=d.steps, help="timed steps per implementation")
    ddp.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per implementation")
    ddp.add_argument("--repeats", type=int, default=d.repeats,
                     help="alternating blocks the timed steps are split into")
    ddp.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per rank per step")
    ddp.add_argument("--seq-len", type=int, default=d.seq_len)
    ddp.add_argument("--bucket-mb", type=float, default=d.bucket_mb)
    ddp.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    ddp.add_argument("--json", metavar="PATH", help="also write the full result (every step) as JSON")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    results = bench_ddp(preset=args.preset, world=args.world, steps=args.steps, warmup=args.warmup,
                        repeats=args.repeats, micro_batch=args.micro_batch, seq_len=args.seq_len,
                        bucket_mb=args.bucket_mb, threads=args.threads)
    print(format_table(results))
    print(f"(wall time {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0
