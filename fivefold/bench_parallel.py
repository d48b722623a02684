"""Benchmarks: fivefold's tensor and pipeline parallelism timed against torch's own, in one launch each.

Same harness style as `fivefold.bench` (contestants built on every rank from the same seed, fed
the same batches, timed in alternating blocks A B C, C B A, ... so noise and drift hit everyone
alike; step time = the slowest rank's; medians, a paired ratio per alternating round and the
ratio of best steps), but with model-parallel data: every TP rank sees the *same* batch, and a
pipeline step is M micro-batches through all stages.

TP (`bench_tp`): fivefold `apply_tensor_parallel` (Megatron f/g, vocab-parallel embedding and
cross-entropy; SP: all-gather / reduce-scatter along the sequence) vs torch DTensor TP:
`parallelize_module` with a torchtitan-like plan for the same module names —

- ``tok_embeddings``: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if SP else
  Replicate())`` (vocabulary-sharded embedding);
- ``attention`` / ``feed_forward``: ``PrepareModuleInput(input_layouts=Shard(1) if SP else Replicate(),
  desired_input_layouts=Replicate())`` — one DTensor input shared by the column-parallel layers, so
  their input gradients are summed locally (as Partial) and reduced once per region (torchtitan
  does this under SP; used without SP too, else every one of wq/wk/wv/w1/w3 would all-reduce its
  own input gradient);
- ``wq``/``wk``/``wv``, ``w1``/``w3``: ``ColwiseParallel()``; ``wo``, ``w2``:
  ``RowwiseParallel(output_layouts=Shard(1) if SP else Replicate())``;
- SP only: ``SequenceParallel()`` on ``attention_norm``, ``ffn_norm`` and ``norm``;
- ``output``: ``ColwiseParallel(input_layouts=Shard(1) if SP else Replicate(), output_layouts=Shard(-1),
  use_local_output=False)`` and the cross-entropy under ``loss_parallel()`` — the logits are never
  gathered, like fivefold's vocab-parallel loss.

Our `Attention` reads its local head count from its input/weight shapes; with ``use_local_output=True``
(the default of Colwise/Rowwise) the projections return plain local tensors, so the reshape sees
local heads and the model runs unchanged (verified: losses agree with fivefold and single-process).

Bytes per step and rank: fivefold from its `CommLog`, checked against `tp_comm_formula`; torch
measured on its first (warmup, untimed) step with a `CommDebugMode` subclass that also sums the
payload of each functional collective (all-reduce: the buffer, all-gather: the gathered output,
reduce-scatter: the full input), around forward, backward *and* the optimizer step (DTensor
reduces the SP norms' Partial gradients there).

PP (`bench_pp`): fivefold `PipelineRuntime` on `build_schedule(name, P, M, V)` vs
``torch.distributed.pipelining`` schedules on `PipelineStage` s wrapping the very same stage modules
(`build_stages`: identical split and weights): gpipe ↔ ScheduleGPipe, 1f1b ↔ Schedule1F1B,
interleaved (V=2) ↔ ScheduleInterleaved1F1B, zb-h1 ↔ ScheduleInterleavedZeroBubble with one stage
per rank (torch's ZB1P; ScheduleZBVZeroBubble needs the V-shaped 2-stages-per-rank placement, a
different schedule). Both sides compute loss/M per micro-batch (torch: ``scale_grads=False`` and a
loss_fn divided by M, the same arithmetic as our runtime). Timed: the pipeline step alone; the
AdamW step and zero_grad run untimed after it, identically on both sides. Measured bubble: the
compute intervals of every rank (ours: `PipelineRuntime.records`; torch: the stage's
``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` wrapped with timers)
gathered into a `simulator.Timeline`: 1 - busy / (P · makespan), median over the timed steps. (Ours
counts the last stage's loss inside its F; torch computes the loss outside ``forward_one_chunk``, so
its busy time leaves out the - small - loss computation.) Communication wait counts as idle on both.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fivefold.bench import _OP_SHORT, CommBytes, Contestant, _blocks, _mb, _ops, _paired_ratio, _table, lm_loss
from fivefold.comm import Comm, CommLog
from fivefold.mesh import launch_local
from fivefold.models import build_model, get_config

__all__ = [
    "PPSpec",
    "PP_PAIRS",
    "TPSpec",
    "StepRunner",
    "bench_pp",
    "bench_tp",
    "format_pp_table",
    "format_tp_table",
    "main",
    "pp_contestants",
    "tp_comm_formula",
    "tp_contestants",
]


@dataclass(frozen=True)
class TPSpec:
    """A TP contest (picklable: sent to every rank). ``batch`` sequences, the same on every rank."""

    preset: str = "small"
    tp: int = 2
    sequence_parallel: tuple[bool, ...] = (False, True)
    steps: int = 24  # timed steps per contestant
    warmup: int = 2  # untimed; torch's bytes are counted on its first one
    repeats: int = 8
    batch: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 1

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


@dataclass(frozen=True)
class PPSpec:
    """A PP contest: P ranks, every (schedule pair, M) a contestant; ``micro_batch`` sequences each."""

    preset: str = "tiny"
    pp: int = 2
    microbatches: tuple[int, ...] = (4, 8)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")
    virtual: int = 2  # stages per rank of the interleaved schedules
    steps: int = 16
    warmup: int = 2
    repeats: int = 8
    micro_batch: int = 4
    seq_len: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 1


@dataclass
class StepRunner:
    """One contestant on one rank. ``step(x, y)`` is the timed part and returns this rank's loss of
    the step (None where the rank has none: pipeline ranks without the last stage); ``after()`` runs
    untimed right after it. ``records()`` returns the compute intervals of the last step (pipeline)."""

    step: Callable[[torch.Tensor, torch.Tensor], float | None]
    after: Callable[[], None] = lambda: None
    reset_comm: Callable[[], None] = lambda: None
    comm: Callable[[], CommBytes] = CommBytes
    comm_source: str = ""
    notes: list[str] = field(default_factory=list)
    records: Callable[[], list[tuple[str, int, int, float, float]]] | None = None
    info: dict[str, Any] = field(default_factory=dict)  # anything else to report (formula, schedule ...)


# -- TP: formula -----------------------------------------------------------------------------------

def tp_comm_formula(config: Any, batch: int, seq_len: int, sequence_parallel: bool,
                    dtype_bytes: int = 4) -> dict[str, int]:
    """Payload bytes per step and rank of fivefold's TP plan, by op (DESIGN.md / seed 003 §7-8).

    Per block 4 collectives of B·L·D (2 exits forward, 2 entries backward): all-reduces, or under
    SP all-gather + reduce-scatter pairs of the same B·L·D each (4 AG + 4 RS). Plus the embedding's
    exit (forward AR; SP: RS forward + AG backward), the head's entry (backward AR; SP: AG forward
    + RS backward), 3 all-reduces of B·L fp32 values in the vocab-parallel cross-entropy, and under
    SP one all-reduce of D per norm weight gradient (2 per block + the final norm).
    """
    n, bld, bl, d = config.n_layers, batch * seq_len * config.dim, batch * seq_len, config.dim
    if not sequence_parallel:
        return {"all_reduce": ((4 * n + 2) * bld + 3 * bl) * dtype_bytes}
    return {"all_gather": (4 * n + 2) * bld * dtype_bytes,
            "all_reduce": (3 * bl + (2 * n + 1) * d) * dtype_bytes,
            "reduce_scatter": (4 * n + 2) * bld * dtype_bytes}


def _tp_formula_text(sp: bool) -> str:
    if not sp:
        return "AR (4n+2)·BLD + 3·BL"
    return "AG (4n+2)·BLD + RS (4n+2)·BLD + AR 3·BL + (2n+1)·D"


# -- TP: contestants --------------------------------------------------------------------------------

def _fivefold_comm(log: CommLog, world: int) -> Callable[[], CommBytes]:
    def comm() -> CommBytes:
        return CommBytes.from_ops({op: (t.calls, t.payload_bytes) for (op, _), t in log.summary().items()}, world)

    return comm


def build_fivefold_tp(model: nn.Module, spec: TPSpec, sequence_parallel: bool) -> StepRunner:
    from fivefold.models.parallelize import apply_tensor_parallel, tp_loss

    log = CommLog()
    comm = Comm(None, "tp", log)
    apply_tensor_parallel(model, comm, sequence_parallel)
    loss_fn = tp_loss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    formula = tp_comm_formula(model.config, spec.batch, spec.seq_len, sequence_parallel)
    return StepRunner(step, reset_comm=log.reset, comm=_fivefold_comm(log, comm.size),
                      comm_source="measured (CommLog), every step",
                      notes=[f"fivefold TP{'+SP' if sequence_parallel else ''}: apply_tensor_parallel "
                             "(LLAMA_TP_PLAN), vocab-parallel cross-entropy (tp_loss), AdamW over the local shards"],
                      info=dict(formula=formula, formula_text=_tp_formula_text(sequence_parallel)))


# functional collective -> (op, payload bytes from its arguments)
def _funcol_payloads() -> dict[Any, tuple[str, Callable[..., int]]]:
    ops = torch.ops._c10d_functional

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def tensors(x: Any) -> list[torch.Tensor]:
        return list(x) if isinstance(x, list | tuple) else [x]

    table: dict[Any, tuple[str, Callable[..., int]]] = {
        ops.all_reduce: ("all_reduce", lambda a: nbytes(a[0])),
        ops.all_reduce_coalesced: ("all_reduce", lambda a: sum(map(nbytes, tensors(a[0])))),
        ops.all_gather_into_tensor: ("all_gather", lambda a: nbytes(a[0]) * a[1]),
        ops.all_gather_into_tensor_coalesced: ("all_gather", lambda a: sum(map(nbytes, tensors(a[0]))) * a[1]),
        ops.reduce_scatter_tensor: ("reduce_scatter", lambda a: nbytes(a[0])),
        ops.reduce_scatter_tensor_coalesced: ("reduce_scatter", lambda a: sum(map(nbytes, tensors(a[0])))),
        ops.all_to_all_single: ("all_to_all", lambda a: nbytes(a[0])),
        ops.broadcast: ("broadcast", lambda a: nbytes(a[0])),
    }
    return table


def _byte_counting_mode() -> Any:
    """A `CommDebugMode` that also sums the payload bytes of every functional collective."""
    from torch.distributed.tensor.debug import CommDebugMode

    payloads = _funcol_payloads()

    class ByteCountingCommMode(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.by_op: dict[str, list[int]] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented:
                entry = payloads.get(getattr(func, "_overloadpacket", None))
                if entry is not None:
                    c = self.by_op.setdefault(entry[0], [0, 0])
                    c[0] += 1
                    c[1] += entry[1](args)
            return out

    return ByteCountingCommMode()


def torch_tp_plan(n_layers: int, sequence_parallel: bool) -> dict[str, Any]:
    """The torchtitan-like DTensor plan for our module names (see module doc), as one flat dict."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(n_layers):
        p = f"layers.{i}."
        plan.update({
            # Attention.forward(x, cos, sin): only x is laid out.
            p + "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
            p + "attention.wq": ColwiseParallel(),
            p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(),
            p + "attention.wo": RowwiseParallel(output_layouts=seq),
            p + "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            p + "feed_forward.w1": ColwiseParallel(),
            p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        })
        if sequence_parallel:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return plan


def build_torch_tp(model: nn.Module, spec: TPSpec, sequence_parallel: bool) -> StepRunner:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(model, mesh, torch_tp_plan(model.config.n_layers, sequence_parallel))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    counted: dict[str, tuple[int, int]] = {}
    comm_counts: dict[str, int] = {}
    n_steps = [0]

    def train_step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = model(x)  # DTensor [B, L, V] sharded on the vocabulary
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        return loss.item()

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        n_steps[0] += 1
        if n_steps[0] > 1:
            return train_step(x, y)
        mode = _byte_counting_mode()  # first (warmup) step only: the dispatch mode is slow
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the module tracker's full-backward-hook warning
            with mode:
                loss = train_step(x, y)
        counted.update({op: (c, b) for op, (c, b) in sorted(mode.by_op.items())})
        comm_counts.update({str(k).rpartition(".")[2]: v for k, v in mode.get_comm_counts().items()})
        return loss

    def comm() -> CommBytes:
        return CommBytes.from_ops(counted, world)

    return StepRunner(step, comm=comm,
                      comm_source="measured on the first step (CommDebugMode + payload bytes of each "
                                  "functional collective), forward + backward + optimizer step",
                      notes=[f"torch DTensor TP{'+SP' if sequence_parallel else ''}: parallelize_module, "
                             "torchtitan-like plan (PrepareModuleInput per attention/MLP region"
                             + (", SequenceParallel norms" if sequence_parallel else "")
                             + "), head ColwiseParallel(output Shard(-1)) + loss_parallel() (logits not "
                             "gathered), AdamW over DTensor parameters"],
                      info=dict(comm_debug_counts=comm_counts,
                                formula=tp_comm_formula(model.config, spec.batch, spec.seq_len, sequence_parallel),
                                formula_text=_tp_formula_text(sequence_parallel)))


def tp_contestants(sequence_parallel: Sequence[bool] = (False, True)) -> tuple[Contestant, ...]:
    out: list[Contestant] = []
    for sp in sequence_parallel:
        tag = "TP+SP" if sp else "TP"
        out += [Contestant(f"fivefold-{tag}", functools.partial(build_fivefold_tp, sequence_parallel=sp),
                           baseline=f"torch-{tag}"),
                Contestant(f"torch-{tag}", functools.partial(build_torch_tp, sequence_parallel=sp))]
    return tuple(out)


# -- PP: contestants --------------------------------------------------------------------------------

# fivefold schedule -> the torch.distributed.pipelining schedule class it is timed against
PP_PAIRS: dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",  # one stage per rank: torch's ZB1P
}


def _virtual(name: str, spec: PPSpec) -> int:
    return spec.virtual if name == "interleaved" else 1


def build_fivefold_pp(config: Any, spec: PPSpec, name: str, M: int) -> StepRunner:
    from fivefold.pipeline.runtime import PipelineRuntime
    from fivefold.pipeline.schedules import build_schedule
    from fivefold.pipeline.stage import build_stages

    log = CommLog()
    comm = Comm(None, "pp", log)
    V = _virtual(name, spec)
    schedule = build_schedule(name, comm.size, M, V)
    stages = build_stages(config, schedule.stages_of(comm.rank), schedule.n_stages, seed=spec.seed)
    runtime = PipelineRuntime(schedule, stages, comm, lm_loss, lambda mb: (mb, spec.seq_len, config.dim),
                              torch.float32)
    params = [p for s in stages.values() for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        loss = runtime.step(list(x.chunk(M)), list(y.chunk(M)))
        return None if loss is None else loss.item()

    def after() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return StepRunner(step, after, log.reset, _fivefold_comm(log, comm.size), "measured (CommLog)",
                      [f"fivefold {name}: PipelineRuntime(build_schedule({name!r}, P={comm.size}, M={M}, V={V}))"],
                      records=lambda: list(runtime.records),
                      info=dict(schedule=name, M=M, V=V, n_stages=schedule.n_stages, P=comm.size))


def build_torch_pp(config: Any, spec: PPSpec, name: str, M: int) -> StepRunner:
    from torch.distributed import pipelining

    from fivefold.pipeline.stage import build_stages

    rank, P = dist.get_rank(), dist.get_world_size()
    V = _virtual(name, spec)
    n_stages = P * V
    stage_ids = [v * P + rank for v in range(V)]  # torch's "loop" placement = our interleaved placement
    modules = build_stages(config, stage_ids, n_stages, seed=spec.seed)
    mb, L, D = spec.micro_batch, spec.seq_len, config.dim
    records: list[tuple[str, int, int, float, float]] = []
    t0 = [0.0]

    def timed(fn: Callable, stage_id: int, kind: Callable[..., str]) -> Callable:
        @functools.wraps(fn)
        def wrapper(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter() - t0[0]
            out = fn(chunk_id, *args, **kwargs)
            records.append((kind(*args, **kwargs), chunk_id, stage_id, start, time.perf_counter() - t0[0]))
            return out
        return wrapper

    def backward_kind(*args: Any, full_backward: bool = True, **kwargs: Any) -> str:
        if len(args) >= 2:
            full_backward = args[1]
        return "B" if full_backward else "I"

    stages = []
    for s in stage_ids:
        # Static shapes; requires_grad marks what has a gradient (torch derives the grad buffers from it).
        example_in = (torch.zeros(mb, L, dtype=torch.long) if s == 0
                      else torch.empty(mb, L, D, requires_grad=True))
        example_out = torch.empty(mb, L, config.vocab_size if s == n_stages - 1 else D, requires_grad=True)
        stage = pipelining.PipelineStage(modules[s], s, n_stages, torch.device("cpu"),
                                         input_args=(example_in,), output_args=(example_out,))
        stage.forward_one_chunk = timed(stage.forward_one_chunk, s, lambda *a, **k: "F")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, s, backward_kind)
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, s, lambda *a, **k: "W")
        stages.append(stage)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, target) / M  # as our runtime: gradients of the mean loss, no rescaling pass

    cls = getattr(pipelining, PP_PAIRS[name])
    schedule = (cls(stages[0], M, loss_fn=loss_fn, scale_grads=False) if V == 1 and name != "zb-h1"
                else cls(stages, M, loss_fn=loss_fn, scale_grads=False))
    has_first, has_last = 0 in stage_ids, n_stages - 1 in stage_ids
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)

    def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
        records.clear()
        t0[0] = time.perf_counter()
        losses: list[torch.Tensor] = []
        args = (x,) if has_first else ()
        schedule.step(*args, target=y if has_last else None, losses=losses if has_last else None,
                      return_outputs=False)
        return float(sum(v.item() for v in losses)) if has_last else None

    def after() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return StepRunner(step, after, comm_source="not measured",
                      notes=[f"torch {PP_PAIRS[name]}: {len(stages)} PipelineStage(s) per rank (static shapes) "
                             f"on fivefold's build_stages modules, M={M}, loss/M with scale_grads=False"],
                      records=lambda: list(records),
                      info=dict(schedule=name, M=M, V=V, n_stages=n_stages, P=P))


def pp_contestants(spec: PPSpec) -> tuple[Contestant, ...]:
    out: list[Contestant] = []
    for M in spec.microbatches:
        for name in spec.schedules:
            torch_name = f"torch-{PP_PAIRS[name]}-M{M}"
            out += [Contestant(f"fivefold-{name}-M{M}", functools.partial(build_fivefold_pp, name=name, M=M),
                               baseline=torch_name),
                    Contestant(torch_name, functools.partial(build_torch_pp, name=name, M=M))]
    return tuple(out)


# -- the shared timing loop -------------------------------------------------------------------------

def _contest_worker(kind: str, spec: TPSpec | PPSpec, contestants: Sequence[Contestant]) -> dict | None:
    from fivefold.pipeline.simulator import Timeline, bubble_formula
    from fivefold.train.data import TokenDataset, load_tokens

    rank, world = dist.get_rank(), dist.get_world_size()
    config = get_config(spec.preset)
    if spec.seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={spec.seq_len} exceeds preset {spec.preset!r} max_seq_len={config.max_seq_len}")
    total = spec.warmup + spec.steps
    data = TokenDataset(load_tokens(None), spec.seq_len, seed=spec.seed)
    runners: list[StepRunner] = []
    batches: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    for c in contestants:
        if kind == "tp":  # every TP rank holds the whole batch
            runners.append(c.build(build_model(config, seed=spec.seed), spec))
            rows = spec.batch
        else:
            runners.append(c.build(config, spec))
            rows = runners[-1].info["M"] * spec.micro_batch
        batches.append([data.global_batch(s, rows) for s in range(total)])
    n = len(runners)
    times = torch.zeros(n, total, dtype=torch.float64)
    cpu = torch.zeros(n, total, dtype=torch.float64)  # process CPU time of the step (all threads), summed over ranks
    losses = torch.zeros(n, total, dtype=torch.float64)
    has_loss = torch.zeros(n, total, dtype=torch.float64)
    comm: list[list[CommBytes]] = [[CommBytes() for _ in range(total)] for _ in range(n)]
    records: list[list[list]] = [[[] for _ in range(total)] for _ in range(n)]
    done = [0] * n
    block_of = [[-1] * total for _ in range(n)]

    def run(i: int, count: int, block: int = -1) -> None:
        runner = runners[i]
        for _ in range(count):
            s = done[i]
            x, y = batches[i][s]
            dist.barrier()  # everyone starts the step together
            runner.reset_comm()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = runner.step(x, y)
            times[i, s] = time.perf_counter() - t0
            cpu[i, s] = time.process_time() - c0
            runner.after()
            if loss is not None:
                losses[i, s], has_loss[i, s] = loss, 1.0
            comm[i][s] = runner.comm()
            if runner.records is not None:
                records[i][s] = runner.records()
            block_of[i][s] = block
            done[i] += 1

    for i in range(n):
        run(i, spec.warmup)
    for r, count in enumerate(_blocks(spec.steps, spec.repeats)):
        for i in (range(n) if r % 2 == 0 else reversed(range(n))):
            run(i, count, r)

    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # step time = the slowest rank's
    dist.all_reduce(cpu)
    dist.all_reduce(losses)
    dist.all_reduce(has_loss)
    mean_losses = losses / has_loss.clamp(min=1)  # TP: every rank's (equal) loss; PP: the last stage's
    all_records: list = [None] * world
    dist.all_gather_object(all_records, records)
    described = [(r.comm_source, r.notes, r.info) for r in runners]
    del run
    runners.clear()
    gc.collect()
    dist.barrier()
    if rank != 0:
        return None

    impls = []
    index = {c.name: i for i, c in enumerate(contestants)}
    for i, c in enumerate(contestants):
        timed = times[i, spec.warmup:].tolist()
        q = statistics.quantiles(timed, n=4) if len(timed) >= 2 else [timed[0]] * 3
        source, notes, info = described[i]
        last = comm[i][-1]
        impl: dict[str, Any] = dict(
            name=c.name, baseline=c.baseline, baseline_note=c.baseline_note,
            median_s=statistics.median(timed), p25_s=q[0], p75_s=q[2], min_s=min(timed), times_s=timed,
            cpu_median_s=statistics.median(cpu[i, spec.warmup:].tolist()),
            comm_calls=last.calls, payload_bytes=last.payload_bytes, wire_bytes=last.wire_bytes,
            comm_by_op=last.by_op, comm_source=source,
            comm_constant=all(asdict(b) == asdict(last) for b in comm[i][spec.warmup:]),
            losses=mean_losses[i].tolist(), notes=notes, info=info)
        if kind == "tp":
            impl["tokens_per_s"] = spec.tokens_per_step / impl["median_s"]
        else:
            P, M, V = info["P"], info["M"], info["V"]
            impl["tokens_per_s"] = M * spec.micro_batch * spec.seq_len / impl["median_s"]
            bubbles = [Timeline([all_records[r][i][s] for r in range(world)]).bubble_fraction
                       for s in range(spec.warmup, total)]
            impl.update(bubble_measured=statistics.median(bubbles), bubble_min=min(bubbles),
                        bubble_formula=bubble_formula(info["schedule"], P, M, V),
                        records_last_step=[all_records[r][i][-1] for r in range(world)])
        impls.append(impl)
    pairs = []
    for i, c in enumerate(contestants):
        if c.baseline is None:
            continue
        j = index[c.baseline]
        a, b = impls[i], impls[j]
        ratios = dict(ratio=a["median_s"] / b["median_s"], ratio_min=a["min_s"] / b["min_s"],
                      ratio_paired=_paired_ratio(times[i], times[j], block_of[i], block_of[j]),
                      ratio_cpu=a["cpu_median_s"] / b["cpu_median_s"])
        diff = float((mean_losses[i] - mean_losses[j]).abs().max())
        a.update(ratios, max_abs_loss_diff=diff)
        pairs.append(dict(name=c.name, baseline=c.baseline, **ratios, max_abs_loss_diff=diff))
    return dict(kind=kind, spec=asdict(spec), params=sum(p.numel() for p in build_model(config).parameters()),
                impls=impls, pairs=pairs)


def _run(kind: str, spec: TPSpec | PPSpec, contestants: Sequence[Contestant], world: int,
         timeout_s: float = 3600.0) -> dict:
    if spec.steps < 1 or spec.warmup < 1:
        raise ValueError(f"need steps >= 1 and warmup >= 1 (torch's TP bytes are counted on a warmup step), "
                         f"got {spec}")
    return launch_local(_contest_worker, world, kind, spec, tuple(contestants), threads=spec.threads,
                        timeout_s=timeout_s)[0]


def bench_tp(spec: TPSpec | None = None, **overrides: Any) -> dict:
    """fivefold TP (and TP+SP) vs torch DTensor TP on ``spec.tp`` gloo ranks, one launch.

    Returns ``impls`` (per contestant: median/p25/p75/min step time of the slowest rank, tokens/s,
    bytes per step by op, global losses per step; fivefold's ``info["formula"]``) and ``pairs``
    (ratio fivefold/torch median, paired, of mins; max |loss difference|)."""
    spec = replace(spec or TPSpec(), **overrides)
    get_config(spec.preset)  # fail early on a bad preset
    return _run("tp", spec, tp_contestants(spec.sequence_parallel), spec.tp)


def bench_pp(spec: PPSpec | None = None, **overrides: Any) -> dict:
    """fivefold pipeline schedules vs torch.distributed.pipelining on ``spec.pp`` gloo ranks, one launch.

    Per contestant adds to `bench_tp`'s: ``bubble_measured`` (median over timed steps of the
    measured timeline's idle share), ``bubble_formula`` and the last step's compute records."""
    spec = replace(spec or PPSpec(), **overrides)
    config = get_config(spec.preset)
    unknown = [s for s in spec.schedules if s not in PP_PAIRS]
    if unknown:
        raise ValueError(f"unknown schedule(s) {unknown}; choose from {sorted(PP_PAIRS)}")
    if "interleaved" in spec.schedules and config.n_layers < spec.pp * spec.virtual:
        raise ValueError(f"interleaved needs n_layers >= P·V = {spec.pp * spec.virtual}, preset {spec.preset!r} "
                         f"has {config.n_layers}")
    return _run("pp", spec, pp_contestants(spec), spec.pp)


# -- output -----------------------------------------------------------------------------------------

def _time_rows(results: dict) -> list[tuple[str, ...]]:
    rows = [("impl", "vs", "median step ms", "p25–p75 ms", "min ms", "ratio", "ratio paired", "ratio of mins",
             "CPU ms", "CPU ratio", "tokens/s", "max |Δloss|")]
    for r in results["impls"]:
        rows.append((r["name"], r["baseline"] or "", f"{r['median_s'] * 1e3:.1f}",
                     f"{r['p25_s'] * 1e3:.1f}–{r['p75_s'] * 1e3:.1f}", f"{r['min_s'] * 1e3:.1f}",
                     f"{r['ratio']:.3f}" if "ratio" in r else "",
                     f"{r['ratio_paired']:.3f}" if "ratio_paired" in r else "",
                     f"{r['ratio_min']:.3f}" if "ratio_min" in r else "", f"{r['cpu_median_s'] * 1e3:.0f}",
                     f"{r['ratio_cpu']:.3f}" if "ratio_cpu" in r else "", f"{r['tokens_per_s']:,.0f}",
                     f"{r['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in r else ""))
    return rows


def _diff_ops(got: dict[str, int], want: dict[str, int]) -> str:
    return ", ".join(f"{_OP_SHORT.get(op, op)} {got.get(op, 0) - want.get(op, 0):+,} B"
                     for op in sorted(set(got) | set(want)) if got.get(op, 0) != want.get(op, 0)) or "varies"


def format_tp_table(results: dict) -> str:
    spec = results["spec"]
    out = _table(_time_rows(results))
    out += ["ratio = median / median of the counterpart; paired = median over rounds of the ratio of the two "
            "back-to-back block medians; ratio of mins = best step / best step; CPU = median process CPU time of a "
            "step (all threads) summed over ranks, less sensitive to other load on the machine than wall time"]
    out += ["", "communication per step and rank (payload = the collectives' full buffers; wire = ring formula):"]
    rows = [("impl", "collectives", "payload MiB", "wire MiB", "formula (fivefold's plan)", "formula MiB", "matches",
             "bytes")]
    for r in results["impls"]:
        formula = r["info"].get("formula")
        got = {op: b for op, (_, b) in r["comm_by_op"].items()}
        matches = "" if formula is None else ("yes" if got == formula and r["comm_constant"] else
                                              "NO: " + _diff_ops(got, formula))
        rows.append((r["name"], _ops(r["comm_by_op"]), _mb(r["payload_bytes"]), _mb(r["wire_bytes"]),
                     r["info"].get("formula_text", ""), _mb(sum(formula.values())) if formula else "",
                     matches, r["comm_source"]))
    out += _table(rows)
    out.append("")
    for p in results["pairs"]:
        out.append(f"ratio {p['name']}/{p['baseline']} (median step time): {p['ratio']:.3f} "
                   f"(paired {p['ratio_paired']:.3f}, of mins {p['ratio_min']:.3f}, CPU time {p['ratio_cpu']:.3f}); "
                   f"max |loss difference| over steps: {p['max_abs_loss_diff']:.2e}")
    c = get_config(spec["preset"])
    out += [f"preset {spec['preset']} (n={c.n_layers} layers, D={c.dim}, Ψ={results['params']:,}), tp {spec['tp']} "
            f"(gloo, {spec['threads']} thread(s)/rank), B={spec['batch']} × L={spec['seq_len']} = "
            f"{spec['batch'] * spec['seq_len']:,} tokens/step (the same batch on every TP rank), "
            f"AdamW(lr={spec['lr']}, weight_decay={spec['weight_decay']}), {spec['steps']} timed steps "
            f"(+{spec['warmup']} warmup) per impl in {len(_blocks(spec['steps'], spec['repeats']))} alternating "
            "blocks; step = zero_grad + forward + loss + backward + AdamW step, time of the slowest rank"]
    for r in results["impls"]:
        out += [f"- {note}" for note in r["notes"]]
        counts = r["info"].get("comm_debug_counts")
        if counts:
            out.append(f"  CommDebugMode counts: {dict(sorted(counts.items()))}")
    return "\n".join(out)


def format_pp_table(results: dict) -> str:
    spec = results["spec"]
    rows = _time_rows(results)
    rows[0] = (*rows[0], "bubble measured", "bubble formula")
    for k, r in enumerate(results["impls"], start=1):
        rows[k] = (*rows[k], f"{r['bubble_measured']:.3f}", f"{r['bubble_formula']:.3f}")
    out = _table(rows)
    out += ["ratio = median / median of the counterpart; paired = median over rounds of the ratio of the two "
            "back-to-back block medians; ratio of mins = best step / best step; CPU = median process CPU time of a "
            "step (all threads) summed over ranks; bubble measured = median over "
            "timed steps of 1 - Σ compute time / (P · makespan) from every rank's F/B/I/W intervals; formula: "
            "gpipe, 1f1b (P-1)/(M+P-1), interleaved (P-1)/(V·M+P-1), zb-h1 (P-1)/(3M+P-1)"]
    out.append("")
    for p in results["pairs"]:
        out.append(f"ratio {p['name']}/{p['baseline']}: {p['ratio']:.3f} (paired {p['ratio_paired']:.3f}, "
                   f"of mins {p['ratio_min']:.3f}, CPU time {p['ratio_cpu']:.3f}); max |loss difference| over steps: "
                   f"{p['max_abs_loss_diff']:.2e}")
    c = get_config(spec["preset"])
    out += [f"preset {spec['preset']} (n={c.n_layers} layers, D={c.dim}, Ψ={results['params']:,}), P={spec['pp']} "
            f"(gloo, {spec['threads']} thread(s)/rank), micro-batch {spec['micro_batch']} × L={spec['seq_len']}, "
            f"V={spec['virtual']} for interleaved, {spec['steps']} timed steps (+{spec['warmup']} warmup) per impl "
            f"in {len(_blocks(spec['steps'], spec['repeats']))} alternating blocks; timed = the pipeline step "
            "(all micro-batches forward + backward + p2p), AdamW step and zero_grad untimed after it on both sides"]
    seen = set()
    for r in results["impls"]:
        for note in r["notes"]:
            if note not in seen:
                seen.add(note)
                out.append(f"- {note}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fivefold.bench_parallel {tp,pp,all} [options]``: print the tables."""
    parser = argparse.ArgumentParser(prog="fivefold bench",
                                     description="Time fivefold's TP / PP against torch's DTensor TP / pipelining "
                                                 "on local gloo CPU ranks (one launch each, interleaved blocks).")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", default=None, help="model preset (tp: small, pp: tiny)")
    common.add_argument("--steps", type=int, default=None, help="timed steps per implementation")
    common.add_argument("--warmup", type=int, default=None, help="untimed steps per implementation (>= 1)")
    common.add_argument("--repeats", type=int, default=None, help="alternating blocks")
    common.add_argument("--seq-len", type=int, default=None)
    common.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    common.add_argument("--json", metavar="PATH", help="also write the full result(s) as JSON")
    tp_opts = argparse.ArgumentParser(add_help=False)
    tp_opts.add_argument("--tp", type=int, default=None, help="tensor-parallel degree = gloo ranks (2)")
    tp_opts.add_argument("--batch", type=int, default=None, help="sequences per step, every TP rank (8)")
    tp_opts.add_argument("--sp", default=None, choices=("both", "off", "on"), help="sequence parallel variants")
    pp_opts = argparse.ArgumentParser(add_help=False)
    pp_opts.add_argument("--pp", type=int, default=None, help="pipeline ranks (2)")
    pp_opts.add_argument("--microbatches", default=None, help="comma-separated M values (4,8)")
    pp_opts.add_argument("--schedules", default=None, help="comma-separated: gpipe,1f1b,interleaved,zb-h1")
    pp_opts.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (4)")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("tp", parents=[common, tp_opts], help="fivefold TP/SP vs torch DTensor TP")
    sub.add_parser("pp", parents=[common, pp_opts], help="fivefold schedules vs torch.distributed.pipelining")
    sub.add_parser("all", parents=[common, tp_opts, pp_opts], help="tp, then pp (--preset applies to both)")
    args = parser.parse_args(argv)

    def given(**kw: Any) -> dict[str, Any]:
        return {k: v for k, v in kw.items() if v is not None}

    common_kw = given(preset=args.preset, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                      seq_len=args.seq_len, threads=args.threads)
    runs: dict[str, Callable[[], dict]] = {}
    if args.what in ("tp", "all"):
        sp = {"both": (False, True), "off": (False,), "on": (True,), None: None}[args.sp]
        tp_kw = given(tp=args.tp, batch=args.batch, sequence_parallel=sp)
        runs["tp"] = lambda: bench_tp(TPSpec(**common_kw, **tp_kw))
    if args.what in ("pp", "all"):
        pp_kw = given(pp=args.pp, micro_batch=args.micro_batch,
                      microbatches=tuple(int(m) for m in args.microbatches.split(",")) if args.microbatches else None,
                      schedules=tuple(s.strip() for s in args.schedules.split(",")) if args.schedules else None)
        runs["pp"] = lambda: bench_pp(PPSpec(**common_kw, **pp_kw))
    results = {}
    for name, fn in runs.items():
        t0 = time.perf_counter()
        results[name] = fn()
        if len(runs) > 1:
            print(f"## {name}\n")
        print(format_tp_table(results[name]) if name == "tp" else format_pp_table(results[name]))
        print(f"(wall time {time.perf_counter() - t0:.0f} s)\n", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results if len(results) > 1 else next(iter(results.values())), fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
