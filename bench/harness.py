"""The benchmark harness: contestants timed against each other in one launch of local gloo ranks.

A contest is a list of *contestants* — (name, build function, the contestant its ratio is taken
against) — that share one timing loop. On every rank each contestant is built from the same seed
and fed the same batches; the loop alternates blocks of steps between contestants (A B C, C B A,
A B C, ...) so that machine noise and slow drift hit every contestant alike. For every step it
keeps the wall time of the slowest rank, the process CPU time summed over ranks, the loss and the
bytes the step communicated; once (step 1: the optimizer state exists), between backward and
optimizer step, it measures the model states of the contestants that can report them, and the
peak during that step's backward (`fivefold.observe.memory.PeakSampler`) when the step is untimed. It
reports medians, quartiles, best steps, a paired ratio per alternating round, the ratio of best
steps, the CPU-time ratio and the loss drift of each contestant against its baseline: a dict
(JSON-ready) and markdown tables.

The dimensions (`bench.data_parallel`, `bench.tensor_parallel`, `bench.pipeline`) supply the
contestants, a spec (settings, and how a step's batch is laid out) and what they add to the result
(formulas, bubbles). The harness's own cross-rank traffic (barriers, gathering times, losses and
memory) goes through `fivefold.distributed.comm.Comm`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch.distributed import ReduceOp

from fivefold.distributed.comm import Comm, CommLog
from fivefold.distributed.launch import launch_local
from fivefold.formulas import ring_wire_bytes
from fivefold.models import build_model, get_config
from fivefold.observe.memory import ModelStateBytes, PeakSampler

__all__ = [
    "CPU_LEGEND",
    "OP_SHORT",
    "RATIO_LEGEND",
    "CommBytes",
    "Contestant",
    "Runner",
    "Spec",
    "blocks",
    "contest_config",
    "log_bytes",
    "lm_loss",
    "markdown_table",
    "mib",
    "ops_text",
    "paired_ratio",
    "ratio_line",
    "run_contest",
    "time_rows",
]


class Spec(Protocol):
    """The settings every contest has (each dimension's spec is a frozen, picklable dataclass)."""

    preset: str
    steps: int  # timed steps per contestant
    warmup: int  # untimed steps per contestant before the first timed block
    repeats: int  # the timed steps are split into this many alternating blocks per contestant
    seq_len: int
    seed: int
    threads: int  # torch threads per rank
    shard_batch: ClassVar[bool]  # True: each rank takes its 1/world of the rows (data parallel)

    @property
    def world(self) -> int: ...

    def rows(self, info: dict[str, Any]) -> int:
        """Sequences in one step's global batch of the contestant that reported ``info``."""
        ...


@dataclass
class CommBytes:
    """Collective traffic of one step on one rank; ``by_op``: op -> (calls, payload bytes)."""

    calls: int = 0
    payload_bytes: int = 0
    wire_bytes: float = 0.0
    by_op: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def from_ops(cls, by_op: dict[str, tuple[int, int]], world: int) -> CommBytes:
        by_op = {op: (int(c), int(b)) for op, (c, b) in sorted(by_op.items())}
        return cls(sum(c for c, _ in by_op.values()), sum(b for _, b in by_op.values()),
                   sum(ring_wire_bytes(op, b, world) for op, (_, b) in by_op.items()), by_op)


def log_bytes(log: CommLog, world: int) -> Callable[[], CommBytes]:
    """A fivefold contestant's traffic: what its `CommLog` recorded since the last reset."""
    def comm() -> CommBytes:
        return CommBytes.from_ops({op: (t.calls, t.payload_bytes) for (op, _), t in log.summary().items()}, world)

    return comm


def _nothing() -> None:
    return None


@dataclass
class Runner:
    """One contestant, built on one rank.

    A timed step is ``loss = forward_backward(x, y, during_backward)``, then ``update()`` (optimizer
    step and the communication that belongs to it), then reading the loss (a sync point); gradients
    are cleared by one of the two. The backward runs inside the context manager ``during_backward``
    (the peak sampler on the memory step). ``loss`` is a tensor, a float, or None where the rank has
    none (pipeline ranks without the last stage). ``after()`` runs untimed right after the step.

    ``memory()`` (optional) is called once, untimed, between ``forward_backward`` and ``update`` on
    the memory step and returns (model states, bytes of optimizer step counters among them);
    ``roots``: the objects that hold the model states (wrapper, optimizer), for the peak sampler's
    independent walk; ``exclude``: the model's constant buffers. ``comm()``: the traffic since
    ``reset_comm()``. ``records()`` (optional): the compute intervals (kind, micro-batch, stage,
    start, end) of the last step. ``info``: anything the dimension reports (recipe, formula, schedule).
    """

    forward_backward: Callable[[torch.Tensor, torch.Tensor, contextlib.AbstractContextManager], Any]
    update: Callable[[], None] = _nothing
    after: Callable[[], None] = _nothing
    reset_comm: Callable[[], None] = _nothing
    comm: Callable[[], CommBytes] = CommBytes
    comm_source: str = ""
    notes: list[str] = field(default_factory=list)
    memory: Callable[[], tuple[ModelStateBytes, int]] | None = None
    roots: list[Any] = field(default_factory=list)
    exclude: list[torch.Tensor] = field(default_factory=list)
    records: Callable[[], list[tuple[str, int, int, float, float]]] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Contestant:
    """A named implementation: ``build(config, spec, world) -> Runner`` on every rank, ``world`` the
    `Comm` over all ranks (module-level or a partial of one, so it pickles). ``baseline`` names the
    contestant its ratios and loss drift are taken against."""

    name: str
    build: Callable[[Any, Any, Comm], Runner]
    baseline: str | None = None
    baseline_note: str = ""


def contest_config(spec: Spec):
    """The preset's model, its RoPE tables long enough for ``spec.seq_len`` (long-context contests)."""
    config = get_config(spec.preset)
    return get_config(spec.preset, max_seq_len=spec.seq_len) if spec.seq_len > config.max_seq_len else config


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` [B, L, V] against ``y`` [B, L] (every contestant's loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# -- the timing loop -----------------------------------------------------------------------------------

def _minor_faults() -> int:
    """Minor page faults of this process so far (fresh pages mapped in: what a freed-and-reallocated large buffer
    costs on the CPU); 0 where ``resource`` is missing."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def blocks(steps: int, repeats: int) -> list[int]:
    """Sizes of the alternating blocks ``steps`` timed steps are split into."""
    repeats = max(1, min(repeats, steps))
    base, extra = divmod(steps, repeats)
    return [base + (1 if i < extra else 0) for i in range(repeats)]


def paired_ratio(t_a: torch.Tensor, t_b: torch.Tensor, block_a: list[int], block_b: list[int]) -> float:
    """Median over alternating rounds of (a's block median / b's block median): each round's two
    blocks ran back to back, so load from outside the benchmark mostly cancels in their ratio."""
    rounds = sorted({b for b in block_a if b >= 0} & {b for b in block_b if b >= 0})
    per_round = []
    for r in rounds:
        a = [t for t, b in zip(t_a.tolist(), block_a) if b == r]
        b = [t for t, bb in zip(t_b.tolist(), block_b) if bb == r]
        per_round.append(statistics.median(a) / statistics.median(b))
    return statistics.median(per_round) if per_round else float("nan")


def _contest_worker(spec: Spec, contestants: Sequence[Contestant], reference: str | None = None) -> dict | None:
    from fivefold.train.corpus import load_tokens
    from fivefold.train.data import TokenDataset

    world_comm = Comm(None, "world")
    rank, world = world_comm.rank, world_comm.size
    config = contest_config(spec)
    total = spec.warmup + spec.steps
    data = TokenDataset(load_tokens(None), spec.seq_len, seed=spec.seed)
    runners = [c.build(config, spec, world_comm) for c in contestants]
    by_rows: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for r in runners:
        rows = spec.rows(r.info)
        if rows not in by_rows:
            by_rows[rows] = [data.micro_batch(s, rows, 0, 1, rank, world) if spec.shard_batch
                             else data.global_batch(s, rows) for s in range(total)]
    batches = [by_rows[spec.rows(r.info)] for r in runners]

    n = len(runners)
    times = torch.zeros(n, total, dtype=torch.float64)
    cpu = torch.zeros(n, total, dtype=torch.float64)  # process CPU time of the step (all threads)
    kernel = torch.zeros(n, total, dtype=torch.float64)  # the part of it spent in the kernel (gloo's TCP transport)
    faults = torch.zeros(n, total, dtype=torch.float64)  # minor page faults (fresh pages mapped in) during the step
    losses = torch.zeros(n, total, dtype=torch.float64)
    has_loss = torch.zeros(n, total, dtype=torch.float64)
    comm: list[list[CommBytes]] = [[CommBytes() for _ in range(total)] for _ in range(n)]
    records: list[list[list]] = [[[] for _ in range(total)] for _ in range(n)]
    memory: list[dict | None] = [None] * n
    # step 1: the optimizer state exists (a spec may ask for a later one, e.g. after buffers settled)
    memory_step = min(getattr(spec, "memory_step", 1), total - 1)
    done = [0] * n
    block_of = [[-1] * total for _ in range(n)]  # the alternating round each timed step ran in

    def run(i: int, count: int, block: int = -1) -> None:
        runner = runners[i]
        for _ in range(count):
            s = done[i]
            x, y = batches[i][s]
            world_comm.barrier()  # everyone starts the step together
            runner.reset_comm()
            # The peak of the backward is sampled on the memory step when that step is untimed (warmup):
            # the sampler walks the model states after every operator, which is slow.
            sample = s == memory_step and s < spec.warmup and bool(runner.roots)
            sampler = PeakSampler(runner.roots, runner.exclude) if sample else contextlib.nullcontext()
            t0, c0, k0, f0 = time.perf_counter(), time.process_time(), os.times().system, _minor_faults()
            loss = runner.forward_backward(x, y, sampler)
            elapsed, cpu_elapsed = time.perf_counter() - t0, time.process_time() - c0
            kernel_elapsed = os.times().system - k0
            if s == memory_step and runner.memory is not None:  # not timed; ranks realign after it
                states, counters = runner.memory()
                memory[i] = dict(params=states.params, grads=states.grads, optimizer=states.optimizer,
                                 total=states.total, buffers=states.buffers, host=states.host,
                                 device=states.device, step_counters=counters,
                                 peak_backward=sampler.peak if sample else None)
                world_comm.barrier()
            t1, c1, k1 = time.perf_counter(), time.process_time(), os.times().system
            runner.update()
            if loss is not None:  # reading it is also a device sync point: the time covers the whole step
                losses[i, s] = loss.item() if isinstance(loss, torch.Tensor) else float(loss)
                has_loss[i, s] = 1.0
            times[i, s] = elapsed + time.perf_counter() - t1
            cpu[i, s] = cpu_elapsed + time.process_time() - c1
            kernel[i, s] = kernel_elapsed + os.times().system - k1
            faults[i, s] = _minor_faults() - f0  # (includes the untimed memory measurement on that step)
            runner.after()
            comm[i][s] = runner.comm()
            if runner.records is not None:
                records[i][s] = runner.records()
            block_of[i][s] = block
            done[i] += 1

    for i in range(n):
        run(i, spec.warmup)
    for r, count in enumerate(blocks(spec.steps, spec.repeats)):
        order = range(n) if r % 2 == 0 else reversed(range(n))  # A B C, C B A, ...: no order bias
        for i in order:
            run(i, count, r)

    # Step time = the slowest rank's; losses compared rank by rank (ranks without a loss compare 0 with 0),
    # reported as the mean over the ranks that have one.
    world_comm.all_reduce(times, op=ReduceOp.MAX)
    index = {c.name: i for i, c in enumerate(contestants)}
    diffs = torch.zeros(n, dtype=torch.float64)
    for i, c in enumerate(contestants):
        if c.baseline is not None:
            diffs[i] = (losses[i] - losses[index[c.baseline]]).abs().amax()
    world_comm.all_reduce(diffs, op=ReduceOp.MAX)
    world_comm.all_reduce(cpu)
    world_comm.all_reduce(kernel)
    world_comm.all_reduce(faults)
    world_comm.all_reduce(losses)
    world_comm.all_reduce(has_loss)
    mean_losses = losses / has_loss.clamp(min=1)
    memory_per_rank = world_comm.all_gather_object(memory)
    records_per_rank = world_comm.all_gather_object(records)
    described = [(r.comm_source, r.notes, r.info, r.memory is not None, r.records is not None) for r in runners]
    del run
    runners.clear()
    gc.collect()  # free the contestants (their hooks, reducers, work handles) while the process group exists
    world_comm.barrier()
    if rank != 0:
        return None

    impls = []
    for i, c in enumerate(contestants):
        timed = times[i, spec.warmup:].tolist()
        q = statistics.quantiles(timed, n=4) if len(timed) >= 2 else [timed[0]] * 3
        step_comm = comm[i][spec.warmup:] or comm[i]
        last = step_comm[-1]
        source, notes, info, has_memory, has_records = described[i]
        median = statistics.median(timed)
        impl: dict[str, Any] = dict(
            name=c.name, baseline=c.baseline, baseline_note=c.baseline_note,
            median_s=median, p25_s=q[0], p75_s=q[2], min_s=min(timed),
            tokens_per_s=spec.rows(info) * spec.seq_len / median, times_s=timed,
            cpu_median_s=statistics.median(cpu[i, spec.warmup:].tolist()),
            kernel_median_s=statistics.median(kernel[i, spec.warmup:].tolist()),
            minor_faults=statistics.median(faults[i, spec.warmup:].tolist()),
            comm_calls=last.calls, payload_bytes=last.payload_bytes, wire_bytes=last.wire_bytes,
            comm_by_op=last.by_op, comm_constant=all(asdict(b) == asdict(last) for b in step_comm),
            comm_source=source, losses=mean_losses[i].tolist(), notes=notes, info=info)
        if has_memory:
            per_rank = [m[i] for m in memory_per_rank]
            measured = [m for m in per_rank if m is not None]
            impl.update(memory_per_rank=per_rank,
                        memory={k: max((m[k] for m in measured if m[k] is not None), default=None)
                                for k in measured[0]} if measured else None)
        if has_records:  # step -> rank -> intervals
            impl["records"] = [[records_per_rank[r][i][s] for r in range(world)] for s in range(total)]
        impls.append(impl)
    pairs = []
    for i, c in enumerate(contestants):
        if c.baseline is None:
            continue
        j = index[c.baseline]
        a, b = impls[i], impls[j]
        ratios = dict(ratio=a["median_s"] / b["median_s"], ratio_min=a["min_s"] / b["min_s"],
                      ratio_paired=paired_ratio(times[i], times[j], block_of[i], block_of[j]),
                      ratio_cpu=a["cpu_median_s"] / b["cpu_median_s"] if b["cpu_median_s"] else float("nan"))
        a.update(ratios, max_abs_loss_diff=float(diffs[i]))
        pairs.append(dict(name=c.name, baseline=c.baseline, note=c.baseline_note, **ratios,
                          max_abs_loss_diff=float(diffs[i])))
    if reference is not None:  # every contestant's step time over the reference's (the no-communication limit)
        j = index[reference]
        for i, impl in enumerate(impls):
            if i != j:
                impl["vs_reference"] = dict(name=reference, ratio=impl["median_s"] / impls[j]["median_s"],
                                            ratio_paired=paired_ratio(times[i], times[j], block_of[i], block_of[j]),
                                            cpu_ratio=impl["cpu_median_s"] / impls[j]["cpu_median_s"])
    out: dict[str, Any] = dict(impls=impls, pairs=pairs)
    if any(d[3] for d in described):
        out["memory_step"] = memory_step
    return out


def run_contest(kind: str, spec: Spec, contestants: Sequence[Contestant], min_warmup: int = 0,
                timeout_s: float = 3600.0, reference: str | None = None) -> dict:
    """Time `contestants` against each other in one `launch_local` run of ``spec.world`` gloo ranks.

    Returns ``kind``, ``spec`` (as a dict), ``params`` (Ψ of the preset's model), ``impls`` (per
    contestant: median/p25/p75/min step time of the slowest rank, every timed step, CPU time, tokens/s,
    bytes per step by op, the global mean loss of every step, notes, info; ``memory`` and
    ``memory_per_rank`` where measured, ``records`` where reported; against its baseline ``ratio``,
    ``ratio_paired``, ``ratio_min``, ``ratio_cpu``, ``max_abs_loss_diff``), ``pairs`` (those ratios per
    contestant with a baseline) and ``memory_step`` where memory was measured. With ``reference`` (a contestant's
    name, e.g. the data-parallel "ideal"), every other impl also gets ``vs_reference``: its median step time over
    the reference's (``ratio``), the paired ratio of alternating rounds (``ratio_paired``) and its median CPU time
    over the reference's (``cpu_ratio``).
    """
    if spec.steps < 1 or spec.warmup < min_warmup or spec.world < 1:
        raise ValueError(f"need steps >= 1, warmup >= {min_warmup} and world >= 1, got {spec}")
    names = [c.name for c in contestants]
    missing = [c.baseline for c in contestants if c.baseline is not None and c.baseline not in names]
    if reference is not None and reference not in names:
        missing.append(reference)
    if len(set(names)) != len(names) or missing:
        raise ValueError(f"contestant names must be unique and baselines among them: {names}, missing {missing}")
    config = contest_config(spec)
    result = launch_local(_contest_worker, spec.world, spec, tuple(contestants), reference, threads=spec.threads,
                          timeout_s=timeout_s)[0]
    params = sum(p.numel() for p in build_model(config, device="meta").parameters() if p.requires_grad)
    return dict(kind=kind, spec=asdict(spec), params=params, **result)


# -- tables ------------------------------------------------------------------------------------------------

OP_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC"}
RATIO_LEGEND = ("ratio = median / median of the counterpart; paired = median over rounds of the ratio of the two "
                "back-to-back block medians; ratio of mins = best step / best step")
CPU_LEGEND = ("CPU = median process CPU time of a step (all threads) summed over ranks, in brackets the part spent in "
              "the kernel (gloo's TCP loopback transport, and mapping in fresh pages); page faults = the median minor "
              "page faults of a step summed over ranks (freed large buffers allocated again)")


def mib(b: float) -> str:
    """Bytes as MiB with two decimals."""
    return f"{b / 2**20:.2f}"


def markdown_table(rows: list[Sequence[str]]) -> list[str]:
    """Lines of a markdown table; ``rows[0]`` is the header."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |"

    return [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]]


def ops_text(by_op: dict[str, Any]) -> str:
    """``AR×3 + RS×2``: calls per op."""
    return " + ".join(f"{OP_SHORT.get(op, op)}×{v[0] if isinstance(v, list | tuple) else v}"
                      for op, v in by_op.items()) or "none"


def time_rows(results: dict, cpu: bool) -> list[tuple[str, ...]]:
    """The step-time table (header first), with the CPU-time columns when ``cpu``."""
    def opt(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else ""

    head = ("impl", "vs", "median step ms", "p25–p75 ms", "min ms", "ratio", "ratio paired", "ratio of mins")
    tail = ("tokens/s", "max |Δloss|")
    reference = next((r["vs_reference"]["name"] for r in results["impls"] if "vs_reference" in r), None)
    ref_head = (f"step / {reference} (paired)", "efficiency", f"{reference} CPU / CPU") if reference else ()
    faults = cpu and any(r.get("minor_faults") is not None for r in results["impls"])
    rows = [(*head, *(("CPU ms", "CPU ratio") if cpu else ()), *(("page faults",) if faults else ()), *tail,
             *ref_head)]
    for r in results["impls"]:
        vs = r.get("vs_reference")
        ref_cells = ((f"{vs['ratio_paired']:.3f}", f"{1 / vs['ratio_paired']:.3f}", f"{1 / vs['cpu_ratio']:.3f}")
                     if vs else ("", "", ""))
        cells = (r["name"], r["baseline"] or "", f"{r['median_s'] * 1e3:.1f}",
                 f"{r['p25_s'] * 1e3:.1f}–{r['p75_s'] * 1e3:.1f}", f"{r['min_s'] * 1e3:.1f}",
                 opt(r, "ratio", ".3f"), opt(r, "ratio_paired", ".3f"), opt(r, "ratio_min", ".3f"))
        cpu_text = f"{r['cpu_median_s'] * 1e3:.0f}" + (f" ({r['kernel_median_s'] * 1e3:.0f})"
                                                        if r.get("kernel_median_s") is not None else "")
        cpu_cells = (cpu_text, opt(r, "ratio_cpu", ".3f")) if cpu else ()
        fault_cells = (f"{r['minor_faults']:,.0f}" if r.get("minor_faults") is not None else "",) if faults else ()
        rows.append((*cells, *cpu_cells, *fault_cells, f"{r['tokens_per_s']:,.0f}", opt(r, "max_abs_loss_diff", ".1e"),
                     *(ref_cells if reference else ())))
    return rows


def ratio_line(p: dict, what: str = " (median step time)", cpu: bool = False, loss_over: str = "steps") -> str:
    """One pair's ratios in words (with its note, if any)."""
    cpu_text = f", CPU time {p['ratio_cpu']:.3f}" if cpu else ""
    note = f" ({p['note']})" if p.get("note") else ""
    return (f"ratio {p['name']}/{p['baseline']}{what}: {p['ratio']:.3f} (paired {p['ratio_paired']:.3f}, "
            f"of mins {p['ratio_min']:.3f}{cpu_text}){note}; max |loss difference| over {loss_over}: "
            f"{p['max_abs_loss_diff']:.2e}")


# -- resident memory (Linux) -------------------------------------------------------------------------------

def resident_kib() -> dict[str, int]:
    """This process's resident size and high-water mark, KiB (VmRSS, VmHWM; reset the mark by writing "5" to
    /proc/self/clear_refs)."""
    status = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", status).group(1)) for k in ("VmRSS", "VmHWM")}


@contextlib.contextmanager
def freed_blocks_returned() -> Iterator[None]:
    """Large blocks from mmap, returned to the system when freed (workers spawned inside inherit it): a resident peak
    then shows what an operation holds, not what glibc's heap kept from the one before."""
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
