"""The layouts `tests/test_plan.py` measures, and the measuring itself (no tests here).

One spawn of 4 gloo ranks runs them all. Per layout: step 1's traffic by (op, dim) from `CommLog`,
the model-state bytes after its backward, the peak during its backward (`memory.PeakSampler` over
the engines) and the activations one forward keeps (`memory.block_activation_bytes` over the whole
model and loss)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fivefold.config import load_config
from fivefold.distributed.comm import CommLog
from fivefold.distributed.mesh import ParallelMesh
from fivefold.models.parallelize import PipelinedModel, parallelize
from fivefold.observe.memory import (
    PeakSampler,
    block_activation_bytes,
    model_state_bytes,
    peak_activation_bytes,
)
from fivefold.run_plan import validate_layout

WORLD = 4
MODEL = ["--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.ffn_hidden", "96", "--train.seq_len", "32", "--train.micro_batch", "2",
         "--zero.bucket_mb", "0.1"]
MOE = ["--preset", "tiny-moe", "--model.dim", "64", "--model.ffn_hidden", "64", "--model.n_layers", "2",
       "--train.seq_len", "32", "--train.micro_batch", "2", "--zero.bucket_mb", "0.1"]

LAYOUTS: dict[str, list[str]] = {
    "dp4 z0": ["--zero", "0", "--train.grad_accum", "2"],
    "dp4 z0 bf16": ["--zero", "0", "--precision.param", "bf16"],  # fp32 buckets: autograd's bf16 gradient first
    "dp4 z1": ["--zero", "1"],
    "dp4 z2 accum2": ["--zero", "2", "--train.grad_accum", "2"],
    "dp4 z3": ["--zero", "3"],
    "dp4 z3 bf16": ["--zero", "3", "--precision.param", "bf16", "--precision.reduce", "bf16"],
    "dp4 z2 defer": ["--zero", "2", "--train.grad_accum", "2", "--zero.defer_reduce", "true"],
    "tp2 dp2 z1": ["--parallel.tp", "2", "--zero", "1"],
    "tp2 sp dp2 z1 bf16": ["--parallel.tp", "2", "--parallel.sp", "true", "--zero", "1", "--precision.param", "bf16",
                           "--precision.reduce", "bf16"],
    "tp2 sp dp2 z3 full": ["--parallel.tp", "2", "--parallel.sp", "true", "--zero", "3",
                           "--train.recompute", "full"],
    "pp2 dp2 1f1b z2": ["--parallel.pp", "2", "--zero", "2", "--train.grad_accum", "4"],
    "pp2 tp2 gpipe z0": ["--parallel.pp", "2", "--parallel.tp", "2", "--train.grad_accum", "4",
                         "--pipeline.schedule", "gpipe"],
    "pp2 dp2 dualpipev z1": ["--parallel.pp", "2", "--zero", "1", "--train.grad_accum", "4",
                             "--pipeline.schedule", "dualpipev"],
    "pp2 dp2 interleaved z1": ["--parallel.pp", "2", "--zero", "1", "--train.grad_accum", "4",
                               "--pipeline.schedule", "interleaved", "--pipeline.virtual", "2"],
    "pp2 dp2 zb-h1 z3": ["--parallel.pp", "2", "--zero", "3", "--train.grad_accum", "2",
                         "--pipeline.schedule", "zb-h1"],
    "cp2 dp2 z2": ["--parallel.cp", "2", "--zero", "2"],
    "cp2 tp2 z1 selective": ["--parallel.cp", "2", "--parallel.tp", "2", "--zero", "1",
                             "--train.recompute", "selective"],  # the ring's forward again in backward
    "cp2 ulysses dp2 z1 selective": ["--parallel.cp", "2", "--parallel.cp_mode", "ulysses", "--zero", "1",
                                     "--train.recompute", "selective"],  # the all-to-alls once
    "cp4 hybrid2 z1 selective-op": ["--parallel.cp", "4", "--parallel.cp_mode", "hybrid", "--zero", "1",
                                    "--train.recompute", "selective-op"],  # received buffers kept to backward
    "cp4 hybrid2 z3 full": ["--parallel.cp", "4", "--parallel.cp_mode", "hybrid", "--parallel.cp_ulysses", "2",
                            "--zero", "3", "--train.recompute", "full"],
    "hsdp 2x2 z3": ["--parallel.dp_replicate", "2", "--zero", "3"],
    "dp4 z3 hpz2 qwz": ["--zero", "3", "--zero.hpz", "2", "--zero.qwz", "true", "--zero.quant_block", "64"],
    "dp4 z2 bf16 offload qgz": ["--zero", "2", "--precision.param", "bf16", "--zero.offload_optimizer", "true",
                                "--zero.qgz", "true", "--zero.quant_block", "64"],
    "moe ep2 dp4 z1": ["--parallel.ep", "2", "--zero", "1"],
    "moe ep4 dp4 z3 selective": ["--parallel.ep", "4", "--zero", "3", "--train.recompute", "selective"],
}


# Layouts whose whole memory (every storage alive, model states to activations) is also measured over a third step.
# Not "pp2 dp2 zb-h1 z3": zero-bubble under ZeRO-3 measured up to 15 % above its plan on the last stage (docs/plan.md).
WHOLE = ("dp4 z0 bf16", "dp4 z3", "tp2 sp dp2 z3 full", "cp2 dp2 z2", "pp2 tp2 gpipe z0", "pp2 dp2 1f1b z2",
         "pp2 dp2 dualpipev z1", "moe ep4 dp4 z3 selective", "cp2 ulysses dp2 z1 selective")


def config_of(name: str):
    base = MOE if name.startswith("moe") else MODEL
    return load_config(None, [*base, *LAYOUTS[name], "--run.nproc", str(WORLD)])


def measure(name: str) -> dict[str, Any]:
    cfg = config_of(name)
    run = validate_layout(cfg, WORLD)
    cfg.train = dataclasses.replace(cfg.train, global_batch=run.global_batch, micro_batch=run.micro_batch,
                                    grad_accum=run.grad_accum)
    log = CommLog()
    mesh = ParallelMesh(run.dims, "cpu", log)
    parts = parallelize(cfg, run.model, mesh, "cpu")
    dp_rank = mesh.rank("dp")
    g = torch.Generator().manual_seed(7 + dp_rank)

    def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.randint(0, run.model.vocab_size, (run.micro_batch, cfg.train.seq_len), generator=g),
                 torch.randint(0, run.model.vocab_size, (run.micro_batch, cfg.train.seq_len), generator=g))
                for _ in range(run.grad_accum)]

    engines = list(parts.engines.values())
    out: dict[str, Any] = {"coords": {d: mesh.rank(d) for d in ("pp", "dp", "cp", "tp")}}
    for step in range(2):
        batches = micro_batches()
        log.reset()
        if step == 1:
            # what the engines hold (model states and their buffers in flight), after every operator of the step
            sampler = PeakSampler(engines, frames=False)
            with sampler:
                parts.forward_backward(batches)
            out["peak"] = sampler.peak
            out["states"] = [dataclasses.asdict(model_state_bytes(e)) for e in engines]
        elif isinstance(parts, PipelinedModel):  # the micro-batches' activations in flight, at their most
            out["activations"] = peak_activation_bytes(parts.stages.values(),
                                                       lambda b=batches: parts.forward_backward(b))
        else:
            parts.forward_backward(batches)
        parts.step(cfg.train.grad_clip, cfg.train.check_finite)
        if step == 1:
            out["traffic"] = {f"{op} {dim}": (t.calls, t.payload_bytes) for (op, dim), t in log.summary().items()}
    if name in WHOLE:  # the peak of everything alive during a step: what the GPU would have to hold
        sampler = PeakSampler(engines, frames=False, allocations=True)
        batches = micro_batches()
        with sampler:
            parts.forward_backward(batches)
        parts.step(cfg.train.grad_clip, cfg.train.check_finite)
        out["whole"] = sampler.peak
    if not isinstance(parts, PipelinedModel):
        out["activations"] = _activations(parts, micro_batches()[0])
    return out


class _ForwardAndLoss(nn.Module):
    def __init__(self, module: nn.Module, loss_fn: Any) -> None:
        super().__init__()
        self.inner, self.loss_fn = module, loss_fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.inner(x), y)


def _activations(parts: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> int | None:
    """pp = 1: what one micro-batch's forward and loss keep for backward (then the backward runs, freeing it)."""
    if isinstance(parts, PipelinedModel):
        return None
    whole = _ForwardAndLoss(parts.module, parts.loss_fn)
    x, y = (parts.local(t) for t in batch)
    kept: dict[str, torch.Tensor] = {}

    def run() -> torch.Tensor:
        kept["loss"] = whole(x, y)
        return kept["loss"]

    measured = block_activation_bytes([whole], run)[0]
    parts.engine.backward(kept.pop("loss"))  # (ZeRO-3 frees its units; the gradients are dropped below)
    for e in parts.engines.values():
        e.zero_grad()
    return measured


def worker() -> dict[str, Any]:
    torch.manual_seed(0)
    return {name: measure(name) for name in LAYOUTS}


__all__ = ["LAYOUTS", "WHOLE", "WORLD", "config_of", "measure", "worker"]
