"""Benchmarks: fivefold's data-parallel engines timed against torch's own, in one launch.

A benchmark is a list of *contestants* — (name, build function, torch counterpart) — that share
one timing loop. Each contestant gets its own copy of the same model (same seed), its own
optimizer and the same batches; the loop alternates blocks of steps between contestants
(A B C, C B A, A B C, ...) so that machine noise and slow drift hit every contestant alike. For
every timed step it keeps the wall time of the slowest rank, the loss and the bytes the step
communicated; once, at step 1 (optimizer state exists) between backward and optimizer step, it
measures the model states every rank holds. It reports medians, tokens/s, each fivefold
contestant's step-time ratio and loss drift against its torch counterpart, and checks measured
memory and bytes against the formulas of DESIGN.md.

- `bench_ddp`: fivefold `DDP` vs `torch.nn.parallel.DistributedDataParallel`.
- `bench_zero`: fivefold `ZeroDataParallel` stages 0-3 vs torch's recipes —
  stage 0 vs DDP; stage 1 vs DDP + `ZeroRedundancyOptimizer(AdamW)` (torch's ZeRO-1: all-reduce,
  sharded optimizer step, broadcast of the updated parameters); stage 2 has no torch
  counterpart and is compared with the same ZeRO-1 recipe (labelled so); stage 3 vs FSDP2
  (`fully_shard` on every `TransformerBlock`, then the root, ``reshard_after_forward=True``).

How bytes are counted (payload per rank; ring wire = the `fivefold.comm` formulas):

- fivefold: its own `CommLog`.
- torch DDP: a comm hook that counts each bucket's ``buffer()`` and then runs torch's default
  ``allreduce_hook`` (divide by N, all-reduce — the built-in arithmetic).
- torch ZeroRedundancyOptimizer: measured by wrapping ``torch.distributed.broadcast`` during its
  ``step()`` (it broadcasts every parameter from the rank owning it).
- torch FSDP2: measured by wrapping ``torch.distributed.all_gather_single`` /
  ``reduce_scatter_single`` (the calls FSDP2's default collectives make; older torch names too)
  during the step. The wrappers are installed only around the contestant's own step.

Model states are unique storages (`fivefold.memory.model_state_bytes`): the engine reports what
it holds; torch modules are measured with their optimizer; FSDP2 through the local shards
(``to_local()``) of its DTensor parameters, gradients and optimizer state. AdamW's per-tensor
``step`` counters (4-byte scalars) are counted but reported apart from the formula check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.comm import Comm, CommLog, ring_wire_bytes
from fivefold.memory import ModelStateBytes, PeakSampler, model_state_bytes
from fivefold.mesh import launch_local
from fivefold.models import build_model, get_config

__all__ = [
    "BenchSpec",
    "CommBytes",
    "Contestant",
    "DDP_CONTESTANTS",
    "RECIPES",
    "Runner",
    "bench_ddp",
    "bench_zero",
    "expected_for",
    "format_table",
    "main",
    "run_contest",
    "zero_contestants",
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
    weight_decay: float = 0.1
    # torch optimizers get the engine's two groups (no decay for 1-D params and embeddings)
    decay_groups: bool = False
    reshard_after_forward: bool = True  # ZeRO-3 / FSDP2
    prefetch: int = 1  # fivefold ZeRO-3
    seed: int = 0
    threads: int = 1  # torch threads per rank

    @property
    def tokens_per_step(self) -> int:
        return self.world * self.micro_batch * self.seq_len


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


@dataclass
class Runner:
    """One contestant, built on one rank.

    A step is ``loss = forward_backward(x, y, during_backward)`` then ``update()`` (optimizer step and
    whatever communication belongs to it); gradients are cleared by one of the two; the backward runs
    inside the context manager ``during_backward`` (the peak sampler on the measured step).
    ``memory()``, called once between them, returns (model states, bytes of optimizer step counters
    among them). ``roots``: the objects that hold this contestant's model states (wrapper, optimizer),
    for the independent walk; ``exclude``: the model's constant buffers.
    """

    forward_backward: Callable[[torch.Tensor, torch.Tensor, contextlib.AbstractContextManager], torch.Tensor]
    update: Callable[[], None]
    reset_comm: Callable[[], None]
    comm: Callable[[], CommBytes]  # traffic since the last reset_comm()
    comm_source: str = "measured"
    notes: list[str] = field(default_factory=list)
    recipe: str = "ddp"  # key of RECIPES: the formula its memory and bytes are checked against
    padded_params: int | None = None  # Ψ as this implementation pads it (None: no padding)
    memory: Callable[[], tuple[ModelStateBytes, int]] | None = None
    roots: list[Any] = field(default_factory=list)
    exclude: list[torch.Tensor] = field(default_factory=list)


@dataclass(frozen=True)
class Contestant:
    """A named implementation: ``build(model, spec) -> Runner`` (module-level or a partial of one,
    so it pickles). ``baseline`` names the contestant its ratio and loss drift are taken against."""

    name: str
    build: Callable[[nn.Module, BenchSpec], Runner]
    baseline: str | None = None
    baseline_note: str = ""


# -- formulas (DESIGN.md, fp32 AdamW: parameters 4Ψ, gradients 4Ψ, m and v 8Ψ) ---------------------

RECIPES: dict[str, dict[str, Any]] = {
    # memory: (bytes per element, sharded?) for params, grads, optimizer; comm: op -> multiple of 4Ψ
    "ddp": dict(label="DDP", memory_formula="4Ψ+4Ψ+8Ψ = 16Ψ",
                memory=((4, False), (4, False), (8, False)), comm={"all_reduce": 1}, comm_formula="AR Ψ"),
    "zero1": dict(label="ZeRO-1", memory_formula="4Ψ+4Ψ+8Ψ/N",
                  memory=((4, False), (4, False), (8, True)), comm={"reduce_scatter": 1, "all_gather": 1},
                  comm_formula="RS Ψ + AG Ψ"),
    "zero2": dict(label="ZeRO-2", memory_formula="4Ψ+12Ψ/N",
                  memory=((4, False), (4, True), (8, True)), comm={"reduce_scatter": 1, "all_gather": 1},
                  comm_formula="RS Ψ + AG Ψ"),
    "zero3": dict(label="ZeRO-3", memory_formula="16Ψ/N",
                  memory=((4, True), (4, True), (8, True)), comm={"all_gather": 2, "reduce_scatter": 1},
                  comm_formula="AG 2Ψ + RS Ψ"),
    # torch's ZeRO-1 recipe: DDP's all-reduce, then every parameter broadcast by its owner
    "ddp+zero_optim": dict(label="ZeRO-1 (DDP+ZeroRedundancyOptimizer)", memory_formula="4Ψ+4Ψ+8Ψ/N",
                           memory=((4, False), (4, False), (8, True)), comm={"all_reduce": 1, "broadcast": 1},
                           comm_formula="AR Ψ + BC Ψ",
                           memory_note="ZeroRedundancyOptimizer partitions whole parameters, not a flat buffer: "
                                       "its shards are uneven"),
}
_COMPONENTS = ("params", "grads", "optimizer")
_OP_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC"}


def expected_for(recipe: str, padded_params: int, world: int) -> dict[str, Any]:
    """The formula's model-state bytes per rank and payload bytes per step and rank (by op)."""
    r = RECIPES[recipe]
    memory = {name: nbytes * padded_params / (world if sharded else 1)
              for name, (nbytes, sharded) in zip(_COMPONENTS, r["memory"])}
    memory["total"] = sum(memory.values())
    by_op = {op: int(k * 4 * padded_params) for op, k in r["comm"].items()}
    return dict(memory=memory, by_op=by_op, payload_bytes=sum(by_op.values()),
                wire_bytes=sum(ring_wire_bytes(op, b, world) for op, b in by_op.items()))


# -- helpers shared by contestants ------------------------------------------------------------------

def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _param_groups(module: nn.Module, spec: BenchSpec) -> list[dict[str, Any]]:
    """One AdamW group, or (decay_groups) the ZeRO engine's: no decay for 1-D params and embeddings."""
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not spec.decay_groups:
        return [{"params": [p for _, p in params], "weight_decay": spec.weight_decay}]
    from fivefold.data_parallel.zero import default_no_decay

    no_decay = [default_no_decay(n, p, module) for n, p in params]
    groups = [{"params": [p for (_, p), nd in zip(params, no_decay) if not nd], "weight_decay": spec.weight_decay},
              {"params": [p for (_, p), nd in zip(params, no_decay) if nd], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _adamw(module: nn.Module, spec: BenchSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_param_groups(module, spec), lr=spec.lr)


def _scalar_state_bytes(optimizer: Any) -> int:
    """Bytes of the 0-dim tensors (AdamW's ``step``) in an optimizer's state."""
    scalars = [_local(v) for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.ndim == 0]
    return model_state_bytes(_Held([], [], scalars)).optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


class _Held:
    """Explicit tensor lists for `model_state_bytes` (its ``model_state_tensors`` protocol)."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], optimizer: list[torch.Tensor]):
        self._held = {"params": params, "grads": grads, "optimizer": optimizer}

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self._held


class _OpCounter:
    """Per-op collective counts of a torch contestant (fivefold has its CommLog)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.ops: dict[str, list[int]] = {}

    def reset(self) -> None:
        self.ops = {}

    def add(self, op: str, tensor: torch.Tensor) -> None:
        c = self.ops.setdefault(op, [0, 0])
        c[0] += 1
        c[1] += tensor.numel() * tensor.element_size()

    def totals(self) -> CommBytes:
        return CommBytes.from_ops({op: (c, b) for op, (c, b) in self.ops.items()}, self.world)


def _counting_wrapper(fn: Callable, counter: _OpCounter, op: str, arg: int, kwarg: str) -> Callable:
    """`fn` that first counts the tensor passed as positional ``arg`` or keyword ``kwarg``."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        counter.add(op, kwargs[kwarg] if kwarg in kwargs else args[arg])
        return fn(*args, **kwargs)

    return wrapper


# torch.distributed attribute -> (op, index and keyword of the tensor that is the payload)
_PATCHABLE = {
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather_single": ("all_gather", 0, "output_tensor"),  # torch >= 2.13
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),  # torch >= 2.13
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
}


@contextlib.contextmanager
def _counting(counter: _OpCounter, *attrs: str) -> Iterator[None]:
    """Count calls of ``torch.distributed.<attr>`` (those present) while the block runs.

    Only the package attributes are replaced: torch's own code that calls them as ``dist.<attr>``
    (FSDP2's collectives, ZeroRedundancyOptimizer) is counted; fivefold's `Comm` bound its
    functions at import and is not. The deprecated names call the new ones inside c10d, not
    through the package, so nothing is counted twice.
    """
    saved = {a: getattr(dist, a) for a in attrs if hasattr(dist, a)}
    for a, fn in saved.items():
        setattr(dist, a, _counting_wrapper(fn, counter, *_PATCHABLE[a]))
    try:
        yield
    finally:
        for a, fn in saved.items():
            setattr(dist, a, fn)


def _fivefold_comm(log: CommLog, world: int) -> Callable[[], CommBytes]:
    def comm() -> CommBytes:
        return CommBytes.from_ops({op: (t.calls, t.payload_bytes) for (op, _), t in log.summary().items()}, world)

    return comm


# -- contestants ----------------------------------------------------------------------------------

def build_fivefold_ddp(model: nn.Module, spec: BenchSpec) -> Runner:
    from fivefold.data_parallel import DDP

    log = CommLog()
    ddp = DDP(model, Comm(None, "dp", log), bucket_mb=spec.bucket_mb)
    opt = _adamw(ddp.module, spec)

    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        ddp.zero_grad()
        loss = lm_loss(ddp(x), y)
        with during_backward:
            loss.backward()
        return loss

    return Runner(forward_backward, opt.step, log.reset, _fivefold_comm(log, dist.get_world_size()),
                  "measured (CommLog)",
                  [f"fivefold DDP: bucket_mb={spec.bucket_mb}, {len(ddp.buckets)} bucket(s), "
                   "grads are bucket views, zero_grad() zeros the buckets in place"],
                  recipe="ddp",
                  memory=lambda: (model_state_bytes(ddp.module, opt), _scalar_state_bytes(opt)),
                  roots=[ddp, opt], exclude=list(model.buffers()))


def build_fivefold_zero(model: nn.Module, spec: BenchSpec, stage: int = 0) -> Runner:
    from fivefold.data_parallel import ZeroDataParallel

    log = CommLog()
    engine = ZeroDataParallel(model, Comm(None, "dp", log), zero_stage=stage, bucket_mb=spec.bucket_mb,
                              lr=spec.lr, weight_decay=spec.weight_decay,
                              reshard_after_forward=spec.reshard_after_forward, prefetch=spec.prefetch)

    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        loss = lm_loss(engine(x), y)
        with during_backward:
            engine.backward(loss)
        return loss

    def update() -> None:
        engine.step(None)  # also clears the gradients

    what = f"{len(engine.flats)} unit(s)" if stage == 3 else f"{len(engine.flats)} bucket(s)"
    extra = f", reshard_after_forward={spec.reshard_after_forward}, prefetch={spec.prefetch}" if stage == 3 else ""
    return Runner(forward_backward, update, log.reset, _fivefold_comm(log, dist.get_world_size()),
                  "measured (CommLog)",
                  [f"fivefold ZeroDataParallel stage {stage}: bucket_mb={spec.bucket_mb}, {what}{extra}, "
                   "AdamW on flat fp32 shards, no clipping; the step clears the gradients"],
                  recipe=("ddp", "zero1", "zero2", "zero3")[stage],
                  padded_params=sum(f.layout.padded_numel for f in engine.flats),
                  memory=lambda: (model_state_bytes(engine), _scalar_state_bytes(engine.optimizer)),
                  roots=[engine], exclude=list(model.buffers()))


def _counting_allreduce_hook(state, bucket):  # unannotated: torch checks hook annotations literally
    """Count ``bucket``'s bytes (a `dist.GradBucket`), then torch's default all-reduce hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    state.add("all_reduce", bucket.buffer())
    return default_hooks.allreduce_hook(None, bucket)


def _torch_ddp(model: nn.Module, spec: BenchSpec, counter: _OpCounter) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    kwargs: dict[str, Any] = dict(bucket_cap_mb=spec.bucket_mb, gradient_as_bucket_view=True)
    # No per-forward buffer broadcast (fivefold has none; the RoPE tables are identical anyway).
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = False
    else:
        kwargs["broadcast_buffers"] = False
    ddp = DistributedDataParallel(model, **kwargs)
    ddp.register_comm_hook(counter, _counting_allreduce_hook)
    return ddp


_DDP_NOTE = ("bucket_cap_mb={mb}, gradient_as_bucket_view=True, no per-forward buffer sync, counting comm hook "
             "wrapping default allreduce_hook, zero_grad(set_to_none=False)")


def build_torch_ddp(model: nn.Module, spec: BenchSpec) -> Runner:
    counter = _OpCounter(dist.get_world_size())
    ddp = _torch_ddp(model, spec, counter)
    opt = _adamw(ddp.module, spec)

    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)  # keep the bucket views, like fivefold's in-place zeroing
        loss = lm_loss(ddp(x), y)
        with during_backward:
            loss.backward()
        return loss

    return Runner(forward_backward, opt.step, counter.reset, counter.totals,
                  "measured (comm hook: bucket.buffer() bytes)",
                  ["torch DDP: " + _DDP_NOTE.format(mb=spec.bucket_mb)], recipe="ddp",
                  memory=lambda: (model_state_bytes(ddp.module, opt), _scalar_state_bytes(opt)),
                  roots=[ddp, opt], exclude=list(model.buffers()))


def build_torch_zero1(model: nn.Module, spec: BenchSpec) -> Runner:
    """torch's ZeRO-1 recipe: DDP (all-reduce) + ZeroRedundancyOptimizer(AdamW) (step + broadcast)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    world = dist.get_world_size()
    counter = _OpCounter(world)
    ddp = _torch_ddp(model, spec, counter)
    opt = ZeroRedundancyOptimizer(_param_groups(ddp.module, spec), optimizer_class=torch.optim.AdamW, lr=spec.lr)

    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = lm_loss(ddp(x), y)
        with during_backward:
            loss.backward()
        return loss

    def update() -> None:
        with _counting(counter, "broadcast"):
            opt.step()

    sizes = [sum(p.numel() for g in groups for p in g["params"]) for groups in opt._partition_parameters()]
    return Runner(forward_backward, update, counter.reset, counter.totals,
                  "measured (DDP comm hook + wrapped dist.broadcast)",
                  ["torch ZeRO-1 = DDP (" + _DDP_NOTE.format(mb=spec.bucket_mb) + ") + ZeroRedundancyOptimizer("
                   "AdamW, parameters_as_bucket_view=False): partitions whole parameters, elements per rank "
                   f"{sizes}"],
                  recipe="ddp+zero_optim",
                  memory=lambda: (model_state_bytes(ddp.module, opt.optim), _scalar_state_bytes(opt.optim)),
                  roots=[ddp, opt], exclude=list(model.buffers()))


def build_torch_fsdp2(model: nn.Module, spec: BenchSpec) -> Runner:
    """torch FSDP2: ``fully_shard`` on the units fivefold's ZeRO-3 uses by default (every
    TransformerBlock, the embedding and the output head, as torchtitan wraps them), then the root;
    AdamW over DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fivefold.data_parallel.fsdp import find_unit_modules

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    buffers = list(model.buffers())
    units = [(name, m) for name, m in find_unit_modules(model) if name]
    # Ψ as FSDP2 pads it: every parameter's dim 0 to a multiple of N.
    padded = sum(-(-p.shape[0] // world) * world * (p.numel() // max(p.shape[0], 1)) if p.ndim else p.numel()
                 for p in model.parameters() if p.requires_grad)
    for _, unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=spec.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=spec.reshard_after_forward)
    opt = _adamw(model, spec)
    counter = _OpCounter(world)
    ops = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")

    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        opt.zero_grad()
        with _counting(counter, *ops):
            loss = lm_loss(model(x), y)
            with during_backward:
                loss.backward()
        return loss

    def update() -> None:
        with _counting(counter, *ops):
            opt.step()

    def memory() -> tuple[ModelStateBytes, int]:
        params = list(model.parameters())
        held = _Held([_local(p) for p in params], [_local(p.grad) for p in params if p.grad is not None],
                     [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
        return model_state_bytes(held), _scalar_state_bytes(opt)

    return Runner(forward_backward, update, counter.reset, counter.totals,
                  "measured (wrapped dist.all_gather_single / reduce_scatter_single)",
                  [f"torch FSDP2: fully_shard on the {len(units)} units of fivefold's ZeRO-3 "
                   f"({', '.join(n for n, _ in units[:2])}, ..., {units[-1][0]}) then the root, "
                   f"reshard_after_forward={spec.reshard_after_forward}, gloo CPU mesh, AdamW over DTensor "
                   "params, zero_grad(set_to_none=True); memory from to_local() shards"],
                  recipe="zero3", padded_params=padded, memory=memory, roots=[model, opt], exclude=buffers)


DDP_CONTESTANTS = (Contestant("fivefold", build_fivefold_ddp, baseline="torch"),
                   Contestant("torch", build_torch_ddp))


def zero_contestants(stages: Sequence[int] = (0, 1, 2, 3)) -> tuple[Contestant, ...]:
    """fivefold stages with their torch counterparts, each counterpart once."""
    out: list[Contestant] = []
    for stage in stages:
        build = functools.partial(build_fivefold_zero, stage=stage)
        if stage == 0:
            out += [Contestant("fivefold-z0", build, "torch-DDP"), Contestant("torch-DDP", build_torch_ddp)]
        elif stage in (1, 2):
            note = "" if stage == 1 else "no torch ZeRO-2: compared with torch's ZeRO-1 recipe"
            out.append(Contestant(f"fivefold-z{stage}", build, "torch-ZeRO1", note))
            if not any(c.name == "torch-ZeRO1" for c in out):
                out.append(Contestant("torch-ZeRO1", build_torch_zero1))
        elif stage == 3:
            out += [Contestant("fivefold-z3", build, "torch-FSDP2"), Contestant("torch-FSDP2", build_torch_fsdp2)]
        else:
            raise ValueError(f"ZeRO stage {stage}: choose from 0, 1, 2, 3")
    return tuple(out)


# -- the shared timing loop -------------------------------------------------------------------------

def _blocks(steps: int, repeats: int) -> list[int]:
    repeats = max(1, min(repeats, steps))
    base, extra = divmod(steps, repeats)
    return [base + (1 if i < extra else 0) for i in range(repeats)]


def _paired_ratio(t_a: torch.Tensor, t_b: torch.Tensor, block_a: list[int], block_b: list[int]) -> float:
    """Median over alternating rounds of (a's block median / b's block median): each round's two
    blocks ran back to back, so load from outside the benchmark mostly cancels in their ratio."""
    rounds = sorted({b for b in block_a if b >= 0} & {b for b in block_b if b >= 0})
    per_round = []
    for r in rounds:
        a = [t for t, b in zip(t_a.tolist(), block_a) if b == r]
        b = [t for t, bb in zip(t_b.tolist(), block_b) if bb == r]
        per_round.append(statistics.median(a) / statistics.median(b))
    return statistics.median(per_round) if per_round else float("nan")


def _check(impl: dict, world: int) -> list[str]:
    """Mismatches between measured and formula (memory up to padding: no m, v for padding elements)."""
    problems = []
    exp = impl["expected"]
    pad = impl["padded_params"] - impl["params"]
    for rank, mem in enumerate(impl["memory_per_rank"]):
        if mem is None:
            problems.append(f"rank {rank}: memory not measured")
            continue
        for comp in _COMPONENTS:
            measured = mem[comp] - (mem["step_counters"] if comp == "optimizer" else 0)
            want = exp["memory"][comp]
            slack = 8 * pad if comp == "optimizer" else 0
            if not want - slack <= measured <= want:
                why = RECIPES[impl["recipe"]].get("memory_note")
                problems.append(f"rank {rank} {comp}: measured {measured:,} B, formula {want:,.0f} B"
                                + (f" (- up to {slack:,} B of padding)" if slack else "")
                                + (f" — {why}" if why else ""))
    got = {op: b for op, (_, b) in impl["comm_by_op"].items()}
    if got != exp["by_op"]:
        problems.append(f"bytes per step {got} != formula {exp['by_op']}")
    if not impl["comm_constant"]:
        problems.append("bytes per step vary between steps")
    return problems


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
    memory: list[dict | None] = [None] * n
    memory_step = min(1, total - 1)  # step 1: the optimizer state exists
    done = [0] * n
    block_of = [[-1] * total for _ in range(n)]  # the alternating round each timed step ran in

    def run(i: int, count: int, block: int = -1) -> None:
        runner = runners[i]
        for _ in range(count):
            s = done[i]
            x, y = batches[s]
            dist.barrier()  # everyone starts the step together; barrier traffic is not logged
            runner.reset_comm()
            # The peak of the backward is sampled on the memory step when that step is untimed (warmup):
            # the sampler walks the model states after every operator, which is slow.
            sample = s == memory_step and s < spec.warmup and runner.roots
            sampler = PeakSampler(runner.roots, runner.exclude) if sample else contextlib.nullcontext()
            t0 = time.perf_counter()
            loss = runner.forward_backward(x, y, sampler)
            elapsed = time.perf_counter() - t0
            if s == memory_step and runner.memory is not None:  # not timed; ranks realign after it
                states, counters = runner.memory()
                memory[i] = dict(params=states.params, grads=states.grads, optimizer=states.optimizer,
                                 total=states.total, step_counters=counters,
                                 peak_backward=sampler.peak if sample else None)
                dist.barrier()
            t1 = time.perf_counter()
            runner.update()
            losses[i, s] = loss.item()  # also a device sync point, so the wall time covers the whole step
            times[i, s] = elapsed + time.perf_counter() - t1
            comm[i][s] = runner.comm()
            block_of[i][s] = block
            done[i] += 1

    for i in range(n):
        run(i, spec.warmup)
    for r, count in enumerate(_blocks(spec.steps, spec.repeats)):
        order = range(n) if r % 2 == 0 else reversed(range(n))  # A B C, C B A, ...: no order bias
        for i in order:
            run(i, count, r)

    # Step time = the slowest rank's; loss curves compared rank by rank and reported as global means.
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    index = {c.name: i for i, c in enumerate(contestants)}
    diffs = torch.zeros(n, dtype=torch.float64)
    for i, c in enumerate(contestants):
        if c.baseline is not None:
            diffs[i] = (losses[i] - losses[index[c.baseline]]).abs().amax()
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    mean_losses = losses.clone()
    dist.all_reduce(mean_losses)
    mean_losses /= world
    memory_per_rank: list[list[dict | None]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(memory_per_rank, memory)
    # Free the wrappers (their hooks, reducers and work handles) while the process group is alive:
    # left to interpreter exit, their teardown after destroy_process_group can abort the process.
    described = [(r.comm_source, r.notes, r.recipe, r.padded_params) for r in runners]
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
        source, notes, recipe, padded = described[i]
        padded = n_params if padded is None else padded
        per_rank = [m[i] for m in memory_per_rank]
        measured = [m for m in per_rank if m is not None]
        impl = dict(
            name=c.name,
            baseline=c.baseline,
            baseline_note=c.baseline_note,
            recipe=recipe,
            params=n_params,
            padded_params=padded,
            median_s=statistics.median(timed),
            p25_s=q[0], p75_s=q[2], min_s=min(timed),
            tokens_per_s=tokens / statistics.median(timed),
            times_s=timed,
            comm_calls=last.calls,
            payload_bytes=last.payload_bytes,
            wire_bytes=last.wire_bytes,
            comm_by_op=last.by_op,
            comm_constant=all(asdict(b) == asdict(last) for b in step_comm),
            comm_source=source,
            memory_per_rank=per_rank,
            memory={k: max((m[k] for m in measured if m[k] is not None), default=None) for k in measured[0]}
            if measured else None,
            expected=expected_for(recipe, padded, world),
            losses=mean_losses[i].tolist(),
            notes=notes,
        )
        impl["mismatches"] = _check(impl, world)
        impls.append(impl)
    pairs = []
    for i, c in enumerate(contestants):
        if c.baseline is not None:
            ref = impls[index[c.baseline]]
            j = index[c.baseline]
            ratios = dict(ratio=impls[i]["median_s"] / ref["median_s"], ratio_min=impls[i]["min_s"] / ref["min_s"],
                          ratio_paired=_paired_ratio(times[i], times[j], block_of[i], block_of[j]))
            impls[i].update(ratios, max_abs_loss_diff=float(diffs[i]))
            pairs.append(dict(name=c.name, baseline=c.baseline, note=c.baseline_note, **ratios,
                              max_abs_loss_diff=float(diffs[i])))
    first = pairs[0] if pairs else dict(name=impls[0]["name"], baseline=impls[0]["name"], ratio=1.0,
                                        max_abs_loss_diff=0.0)
    return dict(
        spec=asdict(spec),
        params=n_params,
        tokens_per_step=tokens,
        impls=impls,
        pairs=pairs,
        memory_step=memory_step,
        # the first pair, and DDP's formula (kept for callers of bench_ddp)
        ratio=first["ratio"],
        ratio_label=f"{first['name']}/{first['baseline']}",
        max_abs_loss_diff=first["max_abs_loss_diff"],
        expected_payload_bytes=4 * n_params,
        expected_wire_bytes=ring_wire_bytes("all_reduce", 4 * n_params, world),
    )


def run_contest(spec: BenchSpec, contestants: Sequence[Contestant], timeout_s: float = 3600.0) -> dict:
    """Time `contestants` against each other in one `launch_local` run of ``spec.world`` gloo ranks."""
    if spec.steps < 1 or spec.warmup < 0 or spec.world < 1:
        raise ValueError(f"need steps >= 1, warmup >= 0 and world >= 1, got {spec}")
    names = [c.name for c in contestants]
    missing = [c.baseline for c in contestants if c.baseline is not None and c.baseline not in names]
    if len(set(names)) != len(names) or missing:
        raise ValueError(f"contestant names must be unique and baselines among them: {names}, missing {missing}")
    results = launch_local(_contest_worker, spec.world, spec, tuple(contestants),
                           threads=spec.threads, timeout_s=timeout_s)
    return results[0]


def bench_ddp(preset: str = "small", world: int = 2, steps: int = 48, warmup: int = 3,
              micro_batch: int = 4, seq_len: int = 128, bucket_mb: float = 25.0, repeats: int = 8,
              threads: int = 1, lr: float = 1e-3, seed: int = 0) -> dict:
    """fivefold `DDP` vs torch `DistributedDataParallel`: same model, data and AdamW; see module doc.

    Returns a dict with ``impls`` (per implementation: median/p25/p75 step time of the slowest
    rank, tokens/s, measured all-reduce payload and ring-wire bytes per step and rank, model-state
    bytes per rank, the global-mean loss of every step), ``ratio`` (fivefold / torch median step
    time), ``max_abs_loss_diff`` (over steps and ranks), ``params`` (Ψ) and
    ``expected_payload_bytes`` (4Ψ for fp32 gradients).
    """
    spec = BenchSpec(preset=preset, world=world, steps=steps, warmup=warmup, repeats=repeats,
                     micro_batch=micro_batch, seq_len=seq_len, bucket_mb=bucket_mb, lr=lr, seed=seed,
                     threads=threads)
    return run_contest(spec, DDP_CONTESTANTS)


def bench_zero(preset: str = "small", world: int = 2, steps: int = 48, warmup: int = 3,
               micro_batch: int = 4, seq_len: int = 128, bucket_mb: float = 25.0, repeats: int = 16,
               threads: int = 1, lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0,
               stages: Sequence[int] = (0, 1, 2, 3), reshard_after_forward: bool = True,
               prefetch: int = 1) -> dict:
    """fivefold `ZeroDataParallel` stages 0-3 vs torch DDP / DDP+ZeroRedundancyOptimizer / FSDP2.

    One launch, all contestants interleaved (see module doc). Both sides use AdamW with the
    engine's parameter groups (no decay for 1-D params and embeddings; ``weight_decay`` 0 by
    default) and no clipping. Per implementation the result adds to `bench_ddp`'s: ``memory``
    (model-state bytes, max over ranks; ``memory_per_rank``), ``comm_by_op``, ``expected``
    (the formula's memory and bytes for its ``recipe`` at its padded Ψ), ``mismatches``
    (empty when measured == formula), and for fivefold contestants ``ratio`` and
    ``max_abs_loss_diff`` against the torch counterpart (``pairs`` lists them).
    """
    spec = BenchSpec(preset=preset, world=world, steps=steps, warmup=warmup, repeats=repeats,
                     micro_batch=micro_batch, seq_len=seq_len, bucket_mb=bucket_mb, lr=lr,
                     weight_decay=weight_decay, decay_groups=True, reshard_after_forward=reshard_after_forward,
                     prefetch=prefetch, seed=seed, threads=threads)
    return run_contest(spec, zero_contestants(stages))


# -- output -----------------------------------------------------------------------------------------

def _mb(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _table(rows: list[Sequence[str]]) -> list[str]:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |"

    return [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]]


def _ops(by_op: dict[str, Any]) -> str:
    return " + ".join(f"{_OP_SHORT.get(op, op)}×{v[0] if isinstance(v, list | tuple) else v}"
                      for op, v in by_op.items()) or "none"


def format_table(results: dict) -> str:
    """Markdown tables of a `run_contest` result (time, model states, bytes) with the settings below."""
    spec, world = results["spec"], results["spec"]["world"]
    impls = results["impls"]
    rows = [("impl", "vs", "median step ms", "p25–p75 ms", "min ms", "ratio", "ratio paired", "ratio of mins",
             "tokens/s", "max |Δloss|")]
    for r in impls:
        paired = r.get("ratio_paired")
        rows.append((r["name"], r["baseline"] or "", f"{r['median_s'] * 1e3:.1f}",
                     f"{r['p25_s'] * 1e3:.1f}–{r['p75_s'] * 1e3:.1f}", f"{r['min_s'] * 1e3:.1f}",
                     f"{r['ratio']:.3f}" if "ratio" in r else "", f"{paired:.3f}" if paired is not None else "",
                     f"{r['ratio_min']:.3f}" if "ratio_min" in r else "", f"{r['tokens_per_s']:,.0f}",
                     f"{r['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in r else ""))
    out = _table(rows)
    out += ["ratio = median / median of the counterpart; paired = median over rounds of the ratio of the two "
            "back-to-back block medians; ratio of mins = best step / best step (outside load only adds time)"]

    out += ["", f"model states per rank, MiB (max over ranks, step {results['memory_step']} between backward "
                "and optimizer step; optimizer includes AdamW step counters; peak = the most held at any "
                "operator of that step's backward, every storage reachable from the wrapper and optimizer "
                "and the running hooks' locals, counted by fivefold.memory.PeakSampler for every contestant):"]
    rows = [("impl", "layout", "params", "grads", "optimizer", "total", "formula", "formula total", "Ψ padded",
             "matches", "peak in backward", "peak / formula")]
    for r in impls:
        m, e, rec = r["memory"], r["expected"]["memory"], RECIPES[r["recipe"]]
        cells = [_mb(m[k]) for k in (*_COMPONENTS, "total")] if m else ["-"] * 4
        peak = m.get("peak_backward") if m else None
        mem_ok = not any(p.startswith("rank") for p in r["mismatches"])
        rows.append((r["name"], rec["label"], *cells, rec["memory_formula"], _mb(e["total"]),
                     f"{r['padded_params']:,}", "yes" if mem_ok else "NO",
                     _mb(peak) if peak is not None else "-", f"{peak / e['total']:.3f}" if peak is not None else "-"))
    out += _table(rows)

    out += ["", "communication per step and rank (payload = the collectives' full buffers; wire = ring formula):"]
    rows = [("impl", "collectives", "payload MiB", "wire MiB", "formula", "formula payload", "formula wire",
             "matches", "bytes")]
    for r in impls:
        e, rec = r["expected"], RECIPES[r["recipe"]]
        comm_ok = not any(p.startswith("bytes") for p in r["mismatches"])
        rows.append((r["name"], _ops(r["comm_by_op"]), _mb(r["payload_bytes"]), _mb(r["wire_bytes"]),
                     rec["comm_formula"], _mb(e["payload_bytes"]), _mb(e["wire_bytes"]),
                     "yes" if comm_ok else "NO", r["comm_source"]))
    out += _table(rows)

    psi = results["params"]
    out.append("")
    for p in results["pairs"]:
        note = f" ({p['note']})" if p.get("note") else ""
        out.append(f"ratio {p['name']}/{p['baseline']} (median step time): {p['ratio']:.3f} "
                   f"(paired {p['ratio_paired']:.3f}, of mins {p['ratio_min']:.3f}){note}; "
                   f"max |loss difference| over steps and ranks: {p['max_abs_loss_diff']:.2e}")
    out += [
        f"Ψ = {psi:,} parameters, N = {world}; fp32 AdamW: DDP 16Ψ, ZeRO-1 4Ψ+4Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N, "
        "ZeRO-3 16Ψ/N; formulas at each implementation's padded Ψ",
        f"preset {spec['preset']}, world {world} (gloo, {spec['threads']} thread(s)/rank), "
        f"micro_batch {spec['micro_batch']} × seq_len {spec['seq_len']} = "
        f"{results['tokens_per_step']:,} tokens/step, AdamW(lr={spec['lr']}, weight_decay={spec['weight_decay']}"
        f"{', no decay for 1-D params and embeddings' if spec['decay_groups'] else ''}), "
        f"{spec['steps']} timed steps (+{spec['warmup']} warmup) per impl in "
        f"{len(_blocks(spec['steps'], spec['repeats']))} alternating blocks; step = zero_grad + forward + "
        "backward + optimizer step (+ its collectives), time of the slowest rank",
    ]
    for r in impls:
        out += [f"- {note}" for note in r["notes"]]
    problems = [f"- {r['name']}: {p}" for r in impls for p in r["mismatches"]]
    if problems:
        out += ["mismatches against the formulas:", *problems]
    else:
        out.append("every implementation's measured memory and bytes match its formula")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """``fivefold bench {ddp,zero,all} [options]`` / ``python bench/run.py ...``: print the tables."""
    parser = argparse.ArgumentParser(prog="fivefold bench",
                                     description="Time fivefold against torch's reference implementations "
                                                 "on local gloo CPU ranks (one launch, interleaved blocks).")
    common = argparse.ArgumentParser(add_help=False)
    d = BenchSpec()
    common.add_argument("--preset", default=d.preset)
    common.add_argument("--world", type=int, default=d.world, help="number of gloo ranks")
    common.add_argument("--steps", type=int, default=d.steps, help="timed steps per implementation")
    common.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps per implementation")
    common.add_argument("--repeats", type=int, default=None,
                        help=f"alternating blocks the timed steps are split into (ddp {d.repeats}, zero 16)")
    common.add_argument("--micro-batch", type=int, default=d.micro_batch, help="sequences per rank per step")
    common.add_argument("--seq-len", type=int, default=d.seq_len)
    common.add_argument("--bucket-mb", type=float, default=d.bucket_mb)
    common.add_argument("--threads", type=int, default=d.threads, help="torch threads per rank")
    common.add_argument("--json", metavar="PATH", help="also write the full result(s) (every step) as JSON")
    zero_opts = argparse.ArgumentParser(add_help=False)
    zero_opts.add_argument("--stages", default="0,1,2,3", help="comma-separated ZeRO stages to run")
    zero_opts.add_argument("--prefetch", type=int, default=d.prefetch, help="fivefold ZeRO-3 prefetch depth")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("ddp", parents=[common], help="fivefold DDP vs torch DistributedDataParallel")
    sub.add_parser("zero", parents=[common, zero_opts],
                   help="fivefold ZeRO 0/1/2/3 vs torch DDP / ZeroRedundancyOptimizer / FSDP2")
    sub.add_parser("all", parents=[common, zero_opts], help="ddp, then zero")
    args = parser.parse_args(argv)

    kwargs: dict[str, Any] = dict(preset=args.preset, world=args.world, steps=args.steps, warmup=args.warmup,
                                  micro_batch=args.micro_batch, seq_len=args.seq_len, bucket_mb=args.bucket_mb,
                                  threads=args.threads)
    if args.repeats is not None:
        kwargs["repeats"] = args.repeats
    runs: dict[str, Callable[[], dict]] = {}
    if args.what in ("ddp", "all"):
        runs["ddp"] = lambda: bench_ddp(**kwargs)
    if args.what in ("zero", "all"):
        stages = tuple(int(s) for s in args.stages.split(",") if s.strip())
        runs["zero"] = lambda: bench_zero(**kwargs, stages=stages, prefetch=args.prefetch)
    results = {}
    for name, fn in runs.items():
        t0 = time.perf_counter()
        results[name] = fn()
        if len(runs) > 1:
            print(f"## {name}\n")
        print(format_table(results[name]))
        print(f"(wall time {time.perf_counter() - t0:.0f} s)\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results if len(results) > 1 else next(iter(results.values())), fh, indent=1)
    return 0
