"""Data-parallel contestants: fivefold's DDP and ZeRO 0-3 against torch's own, and their formula checks.

- `bench_ddp`: fivefold `DDP` vs `torch.nn.parallel.DistributedDataParallel`.
- `bench_zero`: fivefold `ZeroDataParallel` stages 0-3 vs torch's recipes —
  stage 0 vs DDP; stage 1 vs DDP + `ZeroRedundancyOptimizer(AdamW)` (torch's ZeRO-1: all-reduce,
  sharded optimizer step, broadcast of the updated parameters); stage 2 has no torch
  counterpart and is compared with the same ZeRO-1 recipe (labelled so); stage 3 vs FSDP2
  (`fully_shard` on the units fivefold's ZeRO-3 uses by default, then the root,
  ``reshard_after_forward=True``).
- both also run "ideal": each rank trains its own batch alone (plain model, torch AdamW, no communication), the
  limit data parallelism approaches; every row reports step time / ideal (paired rounds) and its inverse, the
  DP efficiency.
- `bench_optimizer`: the optimizer step alone on the CPU, master shards cut into 1 MiB segments or whole; and
  `optimizer_step_ops`: the operations one step dispatches on the accelerator path (meta device, fake group).
- `bench_offload`: fivefold ZeRO-2/3 with ZeRO-Offload (fp32 masters, Adam state and step on the host) and with
  ZeRO-R constant buffers against the same stage without: step time, device- and host-resident bytes.

Every rank takes its own rows of the global batch. A step is zero_grad + forward + backward +
optimizer step (+ its collectives), all timed. Bytes: fivefold from its `CommLog`, torch as
`bench.torch_collectives` counts them; both checked against `fivefold.formulas.expected_for`.

Model states are unique storages (`fivefold.observe.memory.model_state_bytes`): the engine reports what
it holds; torch modules are measured with their optimizer; FSDP2 through the local shards
(``to_local()``) of its DTensor parameters, gradients and optimizer state. AdamW's per-tensor
``step`` counters (4-byte scalars) are counted but reported apart from the formula check.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness import (
    CPU_LEGEND,
    RATIO_LEGEND,
    Contestant,
    Runner,
    blocks,
    lm_loss,
    log_bytes,
    markdown_table,
    mib,
    ops_text,
    ratio_line,
    run_contest,
    time_rows,
)
from bench.torch_collectives import OpCounter, counting_allreduce_hook, counting_dist_calls
from fivefold.distributed.comm import Comm, CommLog
from fivefold.formulas import MODEL_STATES, RECIPES, expected_for, ring_wire_bytes
from fivefold.models import build_model
from fivefold.observe.memory import ModelStateBytes, model_state_bytes

__all__ = [
    "DDP_CONTESTANTS",
    "IDEAL",
    "DPSpec",
    "bench_ddp",
    "bench_offload",
    "bench_optimizer",
    "bench_zero",
    "format_offload_table",
    "format_optimizer_ops_table",
    "format_optimizer_table",
    "format_table",
    "optimizer_ops",
    "optimizer_step_ops",
    "run_dp_contest",
    "zero_contestants",
    "zero_keep_contestants",
]


@dataclass(frozen=True)
class DPSpec:
    """A data-parallel contest (picklable: sent to every rank)."""

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
    memory_step: int = 1  # the (untimed when < warmup) step whose model states and backward peak are measured

    shard_batch: ClassVar[bool] = True  # each rank its micro_batch rows of the global batch

    @property
    def tokens_per_step(self) -> int:
        return self.world * self.micro_batch * self.seq_len

    def rows(self, info: dict[str, Any]) -> int:
        return self.world * self.micro_batch


# -- helpers shared by contestants ------------------------------------------------------------------

def _param_groups(module: nn.Module, spec: DPSpec) -> list[dict[str, Any]]:
    """One AdamW group, or (decay_groups) the ZeRO engine's: no decay for 1-D params and embeddings."""
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not spec.decay_groups:
        return [{"params": [p for _, p in params], "weight_decay": spec.weight_decay}]
    from fivefold.data_parallel.zero import default_no_decay

    no_decay = [default_no_decay(n, p, module) for n, p in params]
    groups = [{"params": [p for (_, p), nd in zip(params, no_decay) if not nd], "weight_decay": spec.weight_decay},
              {"params": [p for (_, p), nd in zip(params, no_decay) if nd], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _adamw(module: nn.Module, spec: DPSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(_param_groups(module, spec), lr=spec.lr)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


class _Held:
    """Explicit tensor lists for `model_state_bytes` (its ``model_state_tensors`` protocol)."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], optimizer: list[torch.Tensor]):
        self._held = {"params": params, "grads": grads, "optimizer": optimizer}

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self._held


def _scalar_state_bytes(optimizer: Any) -> int:
    """Bytes of the 0-dim tensors (AdamW's ``step``) in an optimizer's state."""
    scalars = [_local(v) for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.ndim == 0]
    return model_state_bytes(_Held([], [], scalars)).optimizer


def _plain_step(wrapped: nn.Module, zero_grad: Any) -> Any:
    """forward_backward of a torch wrapper: ``zero_grad()``, forward, loss, backward under ``during_backward``."""
    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        zero_grad()
        loss = lm_loss(wrapped(x), y)
        with during_backward:
            loss.backward()
        return loss

    return forward_backward


# -- contestants ----------------------------------------------------------------------------------

def build_fivefold_ddp(config: Any, spec: DPSpec, world: Comm) -> Runner:
    from fivefold.data_parallel import DDP

    model = build_model(config, seed=spec.seed)
    log = CommLog()
    ddp = DDP(model, Comm(None, "dp", log), bucket_mb=spec.bucket_mb)
    opt = _adamw(ddp.module, spec)
    return Runner(_plain_step(ddp, ddp.zero_grad), opt.step, reset_comm=log.reset,
                  comm=log_bytes(log, world.size), comm_source="measured (CommLog)",
                  notes=[f"fivefold DDP: bucket_mb={spec.bucket_mb}, {len(ddp.buckets)} bucket(s), "
                         "grads are bucket views, zero_grad() zeros the buckets in place"],
                  memory=lambda: (model_state_bytes(ddp.module, opt), _scalar_state_bytes(opt)),
                  roots=[ddp, opt], exclude=list(model.buffers()), info=dict(recipe="ddp"))


def build_fivefold_zero(config: Any, spec: DPSpec, world: Comm, stage: int = 0, offload: bool = False,
                        constant_buffers: bool = False, reshard_after_forward: bool | None = None) -> Runner:
    """``reshard_after_forward``: ZeRO-3's, overriding the spec's (None: the spec's)."""
    from fivefold.data_parallel import ZeroDataParallel

    reshard = spec.reshard_after_forward if reshard_after_forward is None else reshard_after_forward
    model = build_model(config, seed=spec.seed)
    log = CommLog()
    engine = ZeroDataParallel(model, Comm(None, "dp", log), zero_stage=stage, bucket_mb=spec.bucket_mb,
                              lr=spec.lr, weight_decay=spec.weight_decay,
                              reshard_after_forward=reshard, prefetch=spec.prefetch,
                              offload_optimizer=offload, constant_buffers=constant_buffers)

    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        loss = lm_loss(engine(x), y)
        with during_backward:
            engine.backward(loss)
        return loss

    def update() -> None:
        engine.step(None)  # also clears the gradients

    what = f"{len(engine.flats)} unit(s)" if stage == 3 else f"{len(engine.flats)} bucket(s)"
    extra = f", reshard_after_forward={reshard}, prefetch={spec.prefetch}" if stage == 3 else ""
    extra += ", optimizer offloaded to the host" if offload else ""
    extra += ", constant buffers" if constant_buffers else ""
    return Runner(forward_backward, update, reset_comm=log.reset, comm=log_bytes(log, world.size),
                  comm_source="measured (CommLog)",
                  notes=[f"fivefold ZeroDataParallel stage {stage}: bucket_mb={spec.bucket_mb}, {what}{extra}, "
                         "AdamW on flat fp32 shards, no clipping; the step clears the gradients"],
                  memory=lambda: (model_state_bytes(engine), _scalar_state_bytes(engine.optimizer)),
                  roots=[engine], exclude=list(model.buffers()),
                  info=dict(recipe=("ddp", "zero1", "zero2", "zero3" if reshard else "zero3-keep")[stage],
                            padded_params=sum(f.layout.padded_numel for f in engine.flats)))


def _torch_ddp(model: nn.Module, spec: DPSpec, counter: OpCounter) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    kwargs: dict[str, Any] = dict(bucket_cap_mb=spec.bucket_mb, gradient_as_bucket_view=True)
    # No per-forward buffer broadcast (fivefold has none; the RoPE tables are identical anyway).
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        kwargs["forward_sync_buffers"] = False
    else:
        kwargs["broadcast_buffers"] = False
    ddp = DistributedDataParallel(model, **kwargs)
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    return ddp


_DDP_NOTE = ("bucket_cap_mb={mb}, gradient_as_bucket_view=True, no per-forward buffer sync, counting comm hook "
             "wrapping default allreduce_hook, zero_grad(set_to_none=False)")


def build_torch_ddp(config: Any, spec: DPSpec, world: Comm) -> Runner:
    model = build_model(config, seed=spec.seed)
    counter = OpCounter(world.size)
    ddp = _torch_ddp(model, spec, counter)
    opt = _adamw(ddp.module, spec)
    # zero_grad(set_to_none=False): keep the bucket views, like fivefold's in-place zeroing
    return Runner(_plain_step(ddp, lambda: opt.zero_grad(set_to_none=False)), opt.step,
                  reset_comm=counter.reset, comm=counter.totals,
                  comm_source="measured (comm hook: bucket.buffer() bytes)",
                  notes=["torch DDP: " + _DDP_NOTE.format(mb=spec.bucket_mb)],
                  memory=lambda: (model_state_bytes(ddp.module, opt), _scalar_state_bytes(opt)),
                  roots=[ddp, opt], exclude=list(model.buffers()), info=dict(recipe="ddp"))


def build_torch_zero1(config: Any, spec: DPSpec, world: Comm) -> Runner:
    """torch's ZeRO-1 recipe: DDP (all-reduce) + ZeroRedundancyOptimizer(AdamW) (step + broadcast)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = build_model(config, seed=spec.seed)
    counter = OpCounter(world.size)
    ddp = _torch_ddp(model, spec, counter)
    opt = ZeroRedundancyOptimizer(_param_groups(ddp.module, spec), optimizer_class=torch.optim.AdamW, lr=spec.lr)

    def update() -> None:
        with counting_dist_calls(counter, "broadcast"):
            opt.step()

    sizes = [sum(p.numel() for g in groups for p in g["params"]) for groups in opt._partition_parameters()]
    return Runner(_plain_step(ddp, lambda: opt.zero_grad(set_to_none=False)), update,
                  reset_comm=counter.reset, comm=counter.totals,
                  comm_source="measured (DDP comm hook + wrapped dist.broadcast)",
                  notes=["torch ZeRO-1 = DDP (" + _DDP_NOTE.format(mb=spec.bucket_mb) + ") + ZeroRedundancyOptimizer("
                         "AdamW, parameters_as_bucket_view=False): partitions whole parameters, elements per rank "
                         f"{sizes}"],
                  memory=lambda: (model_state_bytes(ddp.module, opt.optim), _scalar_state_bytes(opt.optim)),
                  roots=[ddp, opt], exclude=list(model.buffers()), info=dict(recipe="ddp+zero_optim"))


def build_torch_fsdp2(config: Any, spec: DPSpec, world: Comm, reshard_after_forward: bool | None = None) -> Runner:
    """torch FSDP2: ``fully_shard`` on the units fivefold's ZeRO-3 uses by default (every
    TransformerBlock, the embedding and the output head, as torchtitan wraps them), then the root;
    AdamW over DTensors. ``reshard_after_forward`` overrides the spec's (None: the spec's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fivefold.data_parallel.fsdp import find_unit_modules

    reshard = spec.reshard_after_forward if reshard_after_forward is None else reshard_after_forward

    model = build_model(config, seed=spec.seed)
    n = world.size
    mesh = init_device_mesh("cpu", (n,))
    buffers = list(model.buffers())
    units = [(name, m) for name, m in find_unit_modules(model) if name]
    # Ψ as FSDP2 pads it: every parameter's dim 0 to a multiple of N.
    padded = sum(-(-p.shape[0] // n) * n * (p.numel() // max(p.shape[0], 1)) if p.ndim else p.numel()
                 for p in model.parameters() if p.requires_grad)
    for _, unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    opt = _adamw(model, spec)
    counter = OpCounter(n)
    ops = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")

    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        opt.zero_grad()
        with counting_dist_calls(counter, *ops):
            loss = lm_loss(model(x), y)
            with during_backward:
                loss.backward()
        return loss

    def update() -> None:
        with counting_dist_calls(counter, *ops):
            opt.step()

    def memory() -> tuple[ModelStateBytes, int]:
        params = list(model.parameters())
        held = _Held([_local(p) for p in params], [_local(p.grad) for p in params if p.grad is not None],
                     [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
        return model_state_bytes(held), _scalar_state_bytes(opt)

    return Runner(forward_backward, update, reset_comm=counter.reset, comm=counter.totals,
                  comm_source="measured (wrapped dist.all_gather_single / reduce_scatter_single)",
                  notes=[f"torch FSDP2: fully_shard on the {len(units)} units of fivefold's ZeRO-3 "
                         f"({', '.join(n for n, _ in units[:2])}, ..., {units[-1][0]}) then the root, "
                         f"reshard_after_forward={reshard}, gloo CPU mesh, AdamW over DTensor "
                         "params, zero_grad(set_to_none=True); memory from to_local() shards"],
                  memory=memory, roots=[model, opt], exclude=buffers,
                  info=dict(recipe="zero3" if reshard else "zero3-keep", padded_params=padded))


def build_ideal(config: Any, spec: DPSpec, world: Comm) -> Runner:
    """The limit data parallelism approaches: this rank's batch through a plain local model and torch AdamW, no
    communication at all (each rank trains alone: losses drift apart after step 0, so no loss comparison)."""
    model = build_model(config, seed=spec.seed)
    opt = _adamw(model, spec)
    return Runner(_plain_step(model, opt.zero_grad), opt.step,
                  notes=["ideal: one process computing one rank's batch (plain model, torch AdamW, "
                         "zero_grad(set_to_none=True)), no communication; every rank runs it at once, as in the "
                         "data-parallel rows, so both see the same cores and memory bandwidth"],
                  info=dict(recipe=None))


IDEAL = Contestant("ideal", build_ideal)

DDP_CONTESTANTS = (Contestant("fivefold", build_fivefold_ddp, baseline="torch"),
                   Contestant("torch", build_torch_ddp), IDEAL)


def zero_keep_contestants() -> tuple[Contestant, ...]:
    """ZeRO-3 keeping every unit gathered from its forward to its backward (``reshard_after_forward=False``: one
    all-gather per step, 2Ψ of traffic instead of 3Ψ), fivefold's and FSDP2's."""
    return (Contestant("fivefold-z3-keep", functools.partial(build_fivefold_zero, stage=3, reshard_after_forward=False),
                       "torch-FSDP2-keep"),
            Contestant("torch-FSDP2-keep", functools.partial(build_torch_fsdp2, reshard_after_forward=False)))


def zero_contestants(stages: Sequence[int] = (0, 1, 2, 3), keep: bool = False) -> tuple[Contestant, ...]:
    """fivefold stages with their torch counterparts, each counterpart once; ``keep``: also ZeRO-3 with the gathered
    units kept for backward (`zero_keep_contestants`)."""
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
    if keep:
        out += zero_keep_contestants()
    return (*out, IDEAL)


def offload_contestants(stages: Sequence[int] = (2, 3)) -> tuple[Contestant, ...]:
    """Per stage: fivefold ZeRO as is, with the optimizer offloaded, and with constant buffers (against the first)."""
    out: list[Contestant] = []
    for stage in stages:
        base = f"fivefold-z{stage}"
        out += [Contestant(base, functools.partial(build_fivefold_zero, stage=stage)),
                Contestant(f"{base}-offload", functools.partial(build_fivefold_zero, stage=stage, offload=True), base),
                Contestant(f"{base}-constbuf",
                           functools.partial(build_fivefold_zero, stage=stage, constant_buffers=True), base)]
    return tuple(out)


# -- running and checking against the formulas ---------------------------------------------------------

def _check(impl: dict, world: int) -> list[str]:
    """Mismatches between measured and formula (memory up to padding: no m, v for padding elements)."""
    problems = []
    exp = impl["expected"]
    pad = impl["padded_params"] - impl["params"]
    for rank, mem in enumerate(impl["memory_per_rank"]):
        if mem is None:
            problems.append(f"rank {rank}: memory not measured")
            continue
        for comp in MODEL_STATES:
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


def run_dp_contest(spec: DPSpec, contestants: Sequence[Contestant], kind: str = "dp") -> dict:
    """`run_contest`, then every contestant's formula (its recipe at its padded Ψ) and mismatches."""
    reference = IDEAL.name if any(c.name == IDEAL.name for c in contestants) else None
    results = run_contest(kind, spec, contestants, reference=reference)
    n_params, world = results["params"], spec.world
    for impl in results["impls"]:
        impl["recipe"] = impl["info"]["recipe"]
        if impl["recipe"] is None:  # the ideal: no formula
            impl.update(params=n_params, padded_params=n_params, expected=None, mismatches=[])
            continue
        impl["params"] = n_params
        padded = impl["info"].get("padded_params")
        impl["padded_params"] = n_params if padded is None else padded
        impl["expected"] = expected_for(impl["recipe"], impl["padded_params"], world)
        impl["mismatches"] = _check(impl, world)
    pairs = results["pairs"]
    for impl in results["impls"]:  # DP efficiency: the share of the no-communication limit a layout reaches
        if "vs_reference" in impl:
            impl["dp_efficiency"] = 1 / impl["vs_reference"]["ratio_paired"]
    first = pairs[0] if pairs else dict(name=results["impls"][0]["name"], baseline=results["impls"][0]["name"],
                                        ratio=1.0, max_abs_loss_diff=0.0)
    results.update(
        tokens_per_step=spec.tokens_per_step,
        # the first pair, and DDP's formula (kept for callers of bench_ddp)
        ratio=first["ratio"], ratio_label=f"{first['name']}/{first['baseline']}",
        max_abs_loss_diff=first["max_abs_loss_diff"],
        expected_payload_bytes=4 * n_params,
        expected_wire_bytes=ring_wire_bytes("all_reduce", 4 * n_params, world),
    )
    return results


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
    spec = DPSpec(preset=preset, world=world, steps=steps, warmup=warmup, repeats=repeats,
                  micro_batch=micro_batch, seq_len=seq_len, bucket_mb=bucket_mb, lr=lr, seed=seed,
                  threads=threads)
    return run_dp_contest(spec, DDP_CONTESTANTS, "ddp")


def bench_zero(preset: str = "small", world: int = 2, steps: int = 48, warmup: int = 3,
               micro_batch: int = 4, seq_len: int = 128, bucket_mb: float = 25.0, repeats: int = 16,
               threads: int = 1, lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0,
               stages: Sequence[int] = (0, 1, 2, 3), reshard_after_forward: bool = True,
               prefetch: int = 1, keep: bool = False, only: Sequence[str] | None = None) -> dict:
    """fivefold `ZeroDataParallel` stages 0-3 vs torch DDP / DDP+ZeroRedundancyOptimizer / FSDP2.

    One launch, all contestants interleaved. Both sides use AdamW with the engine's parameter
    groups (no decay for 1-D params and embeddings; ``weight_decay`` 0 by default) and no clipping.
    Per implementation the result adds to `bench_ddp`'s: ``memory`` (model-state bytes, max over
    ranks; ``memory_per_rank``), ``comm_by_op``, ``expected`` (the formula's memory and bytes for its
    ``recipe`` at its padded Ψ), ``mismatches`` (empty when measured == formula), and for fivefold
    contestants ``ratio`` and ``max_abs_loss_diff`` against the torch counterpart (``pairs`` lists them).
    ``only``: run just these contestants (by name; one alone: its own processes, no other model's memory around —
    a baseline not among them is dropped).
    """
    spec = DPSpec(preset=preset, world=world, steps=steps, warmup=warmup, repeats=repeats,
                  micro_batch=micro_batch, seq_len=seq_len, bucket_mb=bucket_mb, lr=lr,
                  weight_decay=weight_decay, decay_groups=True, reshard_after_forward=reshard_after_forward,
                  prefetch=prefetch, seed=seed, threads=threads)
    contestants = zero_contestants(stages, keep)
    if only:
        unknown = sorted(set(only) - {c.name for c in contestants})
        if unknown:
            raise ValueError(f"--only {', '.join(unknown)}: not among {', '.join(c.name for c in contestants)} "
                             "(--stages and --keep choose those)")
        contestants = tuple(replace(c, baseline=c.baseline if c.baseline in only else None)
                            for c in contestants if c.name in only)
    return run_dp_contest(spec, contestants, "zero")


def bench_offload(preset: str = "small", world: int = 2, steps: int = 24, warmup: int = 3,
                  micro_batch: int = 4, seq_len: int = 128, bucket_mb: float = 25.0, repeats: int = 8,
                  threads: int = 1, lr: float = 1e-3, seed: int = 0, stages: Sequence[int] = (2, 3)) -> dict:
    """ZeRO-Offload and constant buffers against the plain engine, per stage: ``impls`` as `bench_zero`'s (memory
    with ``device``, ``host`` and ``buffers`` bytes), ``pairs`` the step-time ratios and loss differences (0: the
    same math)."""
    # memory at step 2: ZeRO-3's gather slots exist from the third step on (two steps are watched)
    spec = DPSpec(preset=preset, world=world, steps=steps, warmup=warmup, repeats=repeats, micro_batch=micro_batch,
                  seq_len=seq_len, bucket_mb=bucket_mb, lr=lr, seed=seed, threads=threads, memory_step=2)
    return run_contest("offload", spec, offload_contestants(stages), min_warmup=3)


# -- output -----------------------------------------------------------------------------------------

def format_table(results: dict) -> str:
    """Markdown tables of a `bench_ddp` / `bench_zero` result (time, model states, bytes) with the settings below."""
    spec, world = results["spec"], results["spec"]["world"]
    impls = results["impls"]
    out = markdown_table(time_rows(results, cpu=True))
    out += [RATIO_LEGEND + " (outside load only adds time)", CPU_LEGEND]
    if any("dp_efficiency" in r for r in impls):
        out += ["step / ideal = paired ratio to the no-communication limit (each rank trains its own batch alone); "
                "efficiency = ideal / step, the DP efficiency; ideal CPU / CPU = the efficiency a layout could reach "
                "if all its communication were hidden but its CPU work (gloo's reductions and copies, the kernel's "
                "TCP transport, hooks) still had to fit on cores the ranks keep busy: the bound on a machine with no "
                "idle core"]

    if not any(r["recipe"] is not None for r in impls):  # the ideal alone: no model states or bytes to check
        return "\n".join(out)
    out += ["", f"model states per rank, MiB (max over ranks, step {results['memory_step']} between backward "
                "and optimizer step; optimizer includes AdamW step counters; peak = the most held at any "
                "operator of that step's backward, every storage reachable from the wrapper and optimizer "
                "and the running hooks' locals, counted by fivefold.observe.memory.PeakSampler for every contestant):"]
    rows = [("impl", "layout", "params", "grads", "optimizer", "total", "formula", "formula total", "Ψ padded",
             "matches", "peak in backward", "peak / formula")]
    formula_impls = [r for r in impls if r["recipe"] is not None]  # the ideal has no formula
    for r in formula_impls:
        m, e, rec = r["memory"], r["expected"]["memory"], RECIPES[r["recipe"]]
        cells = [mib(m[k]) for k in (*MODEL_STATES, "total")] if m else ["-"] * 4
        peak = m.get("peak_backward") if m else None
        mem_ok = not any(p.startswith("rank") for p in r["mismatches"])
        rows.append((r["name"], rec["label"], *cells, rec["memory_formula"], mib(e["total"]),
                     f"{r['padded_params']:,}", "yes" if mem_ok else "NO",
                     mib(peak) if peak is not None else "-", f"{peak / e['total']:.3f}" if peak is not None else "-"))
    out += markdown_table(rows)

    out += ["", "communication per step and rank (payload = the collectives' full buffers; wire = ring formula):"]
    rows = [("impl", "collectives", "payload MiB", "wire MiB", "formula", "formula payload", "formula wire",
             "matches", "bytes")]
    for r in formula_impls:
        e, rec = r["expected"], RECIPES[r["recipe"]]
        comm_ok = not any(p.startswith("bytes") for p in r["mismatches"])
        rows.append((r["name"], ops_text(r["comm_by_op"]), mib(r["payload_bytes"]), mib(r["wire_bytes"]),
                     rec["comm_formula"], mib(e["payload_bytes"]), mib(e["wire_bytes"]),
                     "yes" if comm_ok else "NO", r["comm_source"]))
    out += markdown_table(rows)

    psi = results["params"]
    out.append("")
    out += [ratio_line(p, loss_over="steps and ranks") for p in results["pairs"]]
    out += [
        f"Ψ = {psi:,} parameters, N = {world}; fp32 AdamW: DDP 16Ψ, ZeRO-1 4Ψ+4Ψ+8Ψ/N, ZeRO-2 4Ψ+12Ψ/N, "
        "ZeRO-3 16Ψ/N; formulas at each implementation's padded Ψ",
        f"preset {spec['preset']}, world {world} (gloo, {spec['threads']} thread(s)/rank), "
        f"micro_batch {spec['micro_batch']} × seq_len {spec['seq_len']} = "
        f"{results['tokens_per_step']:,} tokens/step, AdamW(lr={spec['lr']}, weight_decay={spec['weight_decay']}"
        f"{', no decay for 1-D params and embeddings' if spec['decay_groups'] else ''}), "
        f"{spec['steps']} timed steps (+{spec['warmup']} warmup) per impl in "
        f"{len(blocks(spec['steps'], spec['repeats']))} alternating blocks; step = zero_grad + forward + "
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


def format_offload_table(results: dict) -> str:
    """Step time and where the bytes live, for `bench_offload`."""
    spec = results["spec"]
    out = markdown_table(time_rows(results, cpu=False)) + [RATIO_LEGEND]
    rows = [("impl", "device MiB", "host MiB", "constant buffers MiB (on the device)", "device / plain",
             "peak in backward MiB (device + host)")]
    plain = {r["name"]: r["memory"]["device"] for r in results["impls"] if not r["baseline"]}
    for r in results["impls"]:
        m = r["memory"]
        base = plain[r["baseline"] or r["name"]]
        rows.append((r["name"], mib(m["device"]), mib(m["host"]), mib(m["buffers"]), f"{m['device'] / base:.3f}",
                     mib(m["peak_backward"]) if m.get("peak_backward") is not None else "-"))
    out += ["", f"model states per rank at step {results['memory_step']} (between backward and optimizer step; "
                "max over ranks): on the device, on the host (offloaded masters, Adam m and v, the fp32 gradient "
                "copy), constant buffers (pools and ZeRO-3 gather slots); the peak walks every storage reachable "
                "from the engine after each operator of that step's backward (fivefold.observe.memory.PeakSampler):"]
    out += markdown_table(rows)
    out += ["", *[ratio_line(p, loss_over="steps and ranks") for p in results["pairs"]],
            f"Ψ = {results['params']:,}, preset {spec['preset']}, world {spec['world']} (gloo, {spec['threads']} "
            f"thread(s)/rank), micro_batch {spec['micro_batch']} × seq_len {spec['seq_len']}, AdamW, "
            f"{spec['steps']} timed steps (+{spec['warmup']} warmup) per impl; on the CPU \"host\" and \"device\" "
            "are the same memory: the split shows what an accelerator would hold, the time what the extra copies "
            "cost here (no PCIe)"]
    return "\n".join(out)


# -- the optimizer step: dispatched operations on the accelerator path, time on the CPU ------------

class _OneRank:
    """A group of one rank (`Comm`'s attributes the optimizer reads): nothing is ever issued."""

    size, rank, dim = 1, 0, "dp"

    def __init__(self, device: torch.device) -> None:
        self.device = device


class AtenCount(TorchDispatchMode):
    """Counts every operation dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@contextlib.contextmanager
def _fused_on_meta():
    """Admit the meta device to torch's fused optimizer kernels (which have meta implementations), so
    a meta rank steps as a CUDA one does: what the count is of."""
    from torch.optim import optimizer as torch_optimizer
    supported = torch_optimizer._get_fused_kernels_supported_devices
    torch_optimizer._get_fused_kernels_supported_devices = lambda: [*supported(), "meta"]
    try:
        yield
    finally:
        torch_optimizer._get_fused_kernels_supported_devices = supported


def optimizer_step_ops(preset: str = "llama3.2-1b", stage: int = 0, world: int = 8, fused: bool = True,
                       bucket_mb: float = 25.0, steps: int = 2, watch: Any = None, **model_overrides: Any) -> dict:
    """Operations one optimizer step dispatches (`model.step(1.0)`: the norm, clipping, the update, the write-back
    and ZeRO-1/2's gathers) on rank 0 of `world`, built by the trainer's `parallelize` on the `meta` device with
    torch's fake process group (bf16 parameters, fp32 reduction, AdamW), after a forward and backward of one
    sequence of 8 tokens. ``fused``: torch's fused kernels admitted on meta, as on CUDA (else the multi-tensor
    ones meta has). In this process: the fake group is created and destroyed here. Returns the last step's
    ``total``, ``flats``, ``per_flat``, ``ops`` by name and ``optimizer_tensors``; ``watch`` (a context manager
    factory, e.g. a host-sync detector) is entered around each step, and ``watched`` lists what it returned."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fivefold.config import Config
    from fivefold.distributed import launch
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models import get_config
    from fivefold.models.parallelize import parallelize

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=0, world_size=world)
    try:
        cfg = Config()
        cfg.zero.stage, cfg.zero.bucket_mb = stage, bucket_mb
        cfg.precision.param, cfg.precision.reduce = "bf16", "fp32"
        cfg.train.grad_accum, cfg.train.seq_len, cfg.train.micro_batch = 1, 8, 1
        model = get_config(preset, max_seq_len=8, **model_overrides)
        mesh = ParallelMesh(ParallelDims(dp=world), "meta", CommLog())
        x = torch.zeros(1, 8, dtype=torch.long)
        batch = (launch.to_device(x, mesh.device), launch.to_device(x, mesh.device))
        with _fused_on_meta() if fused else contextlib.nullcontext():
            parts = parallelize(cfg, model, mesh, "meta")
            engines = list(parts.engines.values())
            watched = []
            for _ in range(steps):
                parts.forward_backward([batch])
                with watch() if watch is not None else contextlib.nullcontext() as seen, AtenCount() as count:
                    parts.step(1.0)
                watched.append(seen)
                with AtenCount() as cleared:  # what the step's own zero_grad (the reducer's buffers) adds
                    for e in engines:
                        e.zero_grad()
        flats = sum(len(e.flats) for e in engines)
        kernels = sorted({k for e in engines for g in e.optimizer.param_groups for k in ("fused", "foreach")
                          if g.get(k)})
        optimizer = count.total - cleared.total
        ops = {k: v - cleared.ops.get(k, 0) for k, v in sorted(count.ops.items()) if v - cleared.ops.get(k, 0)}
        return dict(total=optimizer, flats=flats, per_flat=optimizer / flats, ops=ops, zero_grad=cleared.total,
                    optimizer_tensors=sum(len(f.master_params) for e in engines for f in e.flats),
                    kernels=kernels, preset=preset, stage=stage, world=world, watched=watched)
    finally:
        dist.destroy_process_group()


def _flats_of(model: nn.Module, bucket_mb: float, segmentation: Any) -> list:
    """The model's parameters in `bucket_mb` flat buffers (reverse order, as the reducer's buckets) of one rank
    holding everything, with AdamW's two groups (decay: matrices), cut by `segmentation`."""
    from fivefold.data_parallel.buckets import assign_buckets
    from fivefold.data_parallel.flat_param import FlatParam
    one = _OneRank(torch.device("cpu"))
    named = [(n, p) for n, p in model.named_parameters()]
    return [FlatParam(i, bucket, one, group_of=lambda n, p: int(p.ndim < 2), param_dtype=torch.float32,
                      sharded=False, segmentation=segmentation)
            for i, bucket in enumerate(assign_buckets(named, bucket_mb * 2**20))]


def bench_optimizer(preset: str = "bench-120m", steps: int = 24, warmup: int = 2, repeats: int = 6,
                    threads: int = 1, bucket_mb: float = 25.0, seed: int = 0) -> dict:
    """The optimizer step alone on the CPU (clipping norm, clip, AdamW, write-back) of `preset` on one rank, its
    flat buffers cut into cache-sized segments (the CPU's choice) or whole shards (the accelerator's), each
    stepped by torch's per-tensor CPU loop or by its fused CPU kernel: ms per step per contestant,
    in alternating blocks (side by side); ``ratio`` each one's median over the segments' median."""
    import time

    from fivefold.data_parallel.flat_param import CacheSizedSegments, WholeShards
    from fivefold.data_parallel.sharded_optimizer import ShardedOptimizer
    from fivefold.models import get_config

    torch.set_num_threads(threads)
    contestants = {"segments (1 MiB), per-tensor": (CacheSizedSegments(), {}),
                   "whole shards, per-tensor": (WholeShards(), {}),
                   "segments (1 MiB), fused": (CacheSizedSegments(), {"fused": True}),
                   "whole shards, fused": (WholeShards(), {"fused": True})}
    runs = {}
    gen = torch.Generator().manual_seed(seed)
    for name, (segmentation, options) in contestants.items():
        model = build_model(get_config(preset), seed=seed)
        flats = _flats_of(model, bucket_mb, segmentation)
        opt = ShardedOptimizer.for_flat_params(flats, torch.optim.AdamW, [{"weight_decay": 0.1},
                                                                          {"weight_decay": 0.0}],
                                               _OneRank(torch.device("cpu")), lr=1e-4, **options)
        grads = [torch.randn(f.shard_numel, generator=gen) * 1e-3 for f in flats]
        runs[name] = dict(opt=opt, flats=flats, grads=grads, times=[],
                          tensors=sum(len(f.master_params) for f in flats))

    def one_step(run: dict) -> float:
        for f, g in zip(run["flats"], run["grads"]):
            f.grad_shard = g.clone()
        t0 = time.perf_counter()
        run["opt"].step(max_norm=1.0)
        return time.perf_counter() - t0

    for run in runs.values():
        for _ in range(warmup):
            one_step(run)
    for block in blocks(steps, repeats):
        for run in runs.values():
            run["times"] += [one_step(run) for _ in range(block)]
    params = sum(f.layout.numel for f in next(iter(runs.values()))["flats"])
    base = float(torch.tensor(next(iter(runs.values()))["times"]).median())
    out = []
    for name, run in runs.items():
        median = float(torch.tensor(run["times"]).median())
        out.append(dict(name=name, ms=median * 1e3, ratio=median / base, tensors=run["tensors"],
                        flats=len(run["flats"])))
    return dict(impls=out, params=params, spec=dict(preset=preset, steps=steps, warmup=warmup, repeats=repeats,
                                                    threads=threads, bucket_mb=bucket_mb))


def format_optimizer_table(results: dict) -> str:
    """`bench_optimizer`'s rows."""
    spec = results["spec"]
    rows = [("optimizer tensors", "contestant", "ms / step (median)", "/ segments")]
    rows += [(str(r["tensors"]), r["name"], f"{r['ms']:.1f}", f"{r['ratio']:.2f}") for r in results["impls"]]
    flats = results["impls"][0]["flats"]
    return "\n".join(markdown_table(rows) + [
        "", f"Ψ = {results['params']:,} (preset {spec['preset']}) on one rank in {flats} flat buffers of "
            f"{spec['bucket_mb']:g} MiB, fp32 AdamW (2 groups), norm + clip + step + write-back; {spec['threads']} "
            f"thread(s), {spec['steps']} timed steps (+{spec['warmup']} warmup) each in {spec['repeats']} "
            "alternating blocks"])


def optimizer_ops(preset: str = "llama3.2-1b", world: int = 8, stages: Sequence[int] = (0, 3), fused: bool = True,
                  bucket_mb: float = 25.0) -> dict:
    """`optimizer_step_ops` for each ZeRO stage of `stages` (0: DDP)."""
    return dict(rows=[optimizer_step_ops(preset, stage=s, world=world, fused=fused, bucket_mb=bucket_mb)
                      for s in stages])


def format_optimizer_ops_table(results: dict) -> str:
    """`optimizer_ops`'s rows."""
    rows = [("layout", "flat buffers", "optimizer tensors", "kernels", "ops per step", "per flat buffer",
             "+ zero_grad")]
    for r in results["rows"]:
        layout = "DDP" if r["stage"] == 0 else f"ZeRO-{r['stage']}"
        rows.append((f"{layout} world {r['world']}", str(r["flats"]), str(r["optimizer_tensors"]), ",".join(r["kernels"]),
                     str(r["total"]), f"{r['per_flat']:.2f}", str(r["zero_grad"])))
    first = results["rows"][0]
    return "\n".join(markdown_table(rows) + ["", f"preset {first['preset']}, rank 0 on the meta device with the fake "
                                              "process group, bf16 parameters, fp32 reduction, AdamW; the second of "
                                              "two steps; model.step(1.0) (norm, clip, step, write-back, gathers) "
                                              "without the engines' zero_grad, counted apart"])
