"""Context-parallel contestants: fivefold ring attention against an all-gather-K/V baseline, at long sequences.

Both split every sequence over the cp ranks (zig-zag: rank i holds chunks i and 2C-1-i of 2C) and replicate the
model (gradients averaged over cp by a fivefold ZeRO-0 engine, the same for both); they differ only in the
attention core:

- ``fivefold-ring``: `fivefold.context_parallel.RingAttention` — K/V shards travel around the ring (C-1 p2p
  transfers per layer, the next in flight while a block is computed), blocks merged by online softmax, blocks
  above the causal diagonal skipped; backward blockwise, dK/dV travelling home.
- ``allgather-kv``: every rank all-gathers K and V of the whole sequence (backward: reduce-scatter of their
  gradients) and runs SDPA of its queries against them with a causal mask by global position — simple, but the
  whole K/V and a [L/C, L] score matrix per head exist on every rank.

torch's own context parallel (`torch.distributed.tensor.experimental.context_parallel`) does not run here: on
CPU its SDPA dispatch fails with "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not
have a sharding strategy registered" (torch 2.13, gloo; it targets the CUDA flash / efficient kernels), so it is
not a contestant.

Every cp rank sees the same batch and keeps its positions. Per contestant, one untimed forward measures the
activations autograd saves (unique storages, MiB per rank): what the backward must keep, which ring attention
cuts to O(L/C) per layer.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from bench.harness import (
    CPU_LEGEND,
    RATIO_LEGEND,
    Contestant,
    Runner,
    blocks,
    contest_config,
    lm_loss,
    log_bytes,
    markdown_table,
    mib,
    ops_text,
    ratio_line,
    run_contest,
    time_rows,
)
from fivefold.context_parallel import SequenceLayout, apply_context_parallel
from fivefold.data_parallel import ZeroDataParallel
from fivefold.distributed.comm import Comm, CommLog
from fivefold.models import build_model
from fivefold.models.plans import LLAMA_CP_PLAN
from fivefold.tensor_parallel.comm_ops import gather_from_sp

__all__ = ["CPSpec", "bench_cp", "format_cp_table"]


@dataclass(frozen=True)
class CPSpec:
    """A CP contest (picklable). ``batch`` sequences of ``seq_len`` tokens, the same on every rank."""

    preset: str = "tiny"
    cp: int = 2
    seq_lens: tuple[int, ...] = (2048, 4096, 8192)
    steps: int = 4
    warmup: int = 1
    repeats: int = 2
    batch: int = 1
    seq_len: int = 2048  # the contest being run (one of seq_lens)
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 1

    shard_batch: ClassVar[bool] = False  # every cp rank reads the whole batch and keeps its positions

    @property
    def world(self) -> int:
        return self.cp

    def rows(self, info: dict[str, Any]) -> int:
        return self.batch


@dataclass
class AllGatherKV:
    """Attention core: all-gather K and V over `comm`, attend with a causal mask by global position."""

    comm: Comm
    layout: SequenceLayout
    seq_len: int

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [B, H, L/C, d] -> [B, L/C, H, d] so the sequence is dim 1 for the gather (backward: reduce-scatter)
        k, v = (gather_from_sp(t.transpose(1, 2), self.comm).transpose(1, 2) for t in (k, v))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q_pos = self.layout.positions(self.comm.rank, self.seq_len, q.device)
        k_pos = torch.cat([self.layout.positions(r, self.seq_len, q.device) for r in range(self.comm.size)])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))


def _saved_activation_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(b for ptr, b in seen.items() if ptr not in params)


def build_cp(config: Any, spec: CPSpec, world: Comm, core: str) -> Runner:
    log = CommLog()
    comm = Comm(None, "cp", log)
    layout = SequenceLayout("zigzag", comm.size)
    model = build_model(config, seed=spec.seed)
    apply_context_parallel(model, comm, layout, spec.seq_len, LLAMA_CP_PLAN)  # ring cores, RoPE rows by position
    if core == "allgather":
        for block in model.layers:
            block.attention.core = AllGatherKV(comm, layout, spec.seq_len)
    engine = ZeroDataParallel(model, Comm(None, "cp_grads", CommLog(enabled=False)), zero_stage=0,
                              optimizer_class=torch.optim.AdamW, lr=spec.lr, weight_decay=spec.weight_decay)
    probe = layout.shard(torch.zeros(spec.batch, spec.seq_len, dtype=torch.long), comm.rank)
    saved = _saved_activation_bytes(model, probe)

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        x, y = layout.shard(x, comm.rank), layout.shard(y, comm.rank)
        loss = lm_loss(engine(x), y)
        with during_backward:
            engine.backward(loss)
        return loss

    name = ("fivefold ring attention (zig-zag, blocks above the diagonal skipped)" if core == "ring" else
            "all-gather K/V + SDPA with a positional causal mask (backward: reduce-scatter)")
    return Runner(step, update=lambda: engine.step(), reset_comm=log.reset, comm=log_bytes(log, comm.size),
                  comm_source="measured (CommLog): the attention's traffic only (gradient all-reduce excluded)",
                  notes=[f"{name}; gradients averaged over cp by a fivefold ZeRO-0 engine, AdamW"],
                  info=dict(saved_activation_bytes=saved))


def cp_contestants() -> tuple[Contestant, ...]:
    return (Contestant("fivefold-ring", functools.partial(build_cp, core="ring"), baseline="allgather-kv"),
            Contestant("allgather-kv", functools.partial(build_cp, core="allgather")))


def bench_cp(spec: CPSpec | None = None, **overrides: Any) -> dict:
    """fivefold ring attention vs all-gather K/V at each of ``spec.seq_lens``, one launch of ``spec.cp`` gloo
    ranks per length. Returns ``runs``: the `run_contest` result per sequence length."""
    spec = replace(spec or CPSpec(), **overrides)
    runs = []
    for seq_len in spec.seq_lens:
        if seq_len % (2 * spec.cp):
            raise ValueError(f"seq_len={seq_len} is not divisible by 2·cp={2 * spec.cp} (zig-zag chunks)")
        runs.append(run_contest("cp", replace(spec, seq_len=seq_len), cp_contestants(), min_warmup=0))
    return dict(kind="cp", spec=asdict(spec), runs=runs)


def format_cp_table(results: dict) -> str:
    """One row per (sequence length, contestant): step time, ratio, attention traffic, saved activations."""
    spec = results["spec"]
    rows = [("seq_len", "impl", "median step s", "ratio ring / all-gather (paired)", "attention p2p / collectives "
             "per step and rank", "activations saved by forward, MiB per rank")]
    for run in results["runs"]:
        ratio = {p["name"]: p for p in run["pairs"]}
        for r in run["impls"]:
            p = ratio.get(r["name"])
            rows.append((str(run["spec"]["seq_len"]), r["name"], f"{r['median_s']:.2f}",
                         f"{p['ratio']:.3f} ({p['ratio_paired']:.3f})" if p else "",
                         f"{ops_text(r['comm_by_op'])} = {mib(r['payload_bytes'])} MiB",
                         mib(r["info"]["saved_activation_bytes"])))
    out = markdown_table(rows)
    out += [RATIO_LEGEND, CPU_LEGEND, ""]
    for run in results["runs"]:
        out += [ratio_line(p, cpu=True) for p in run["pairs"]]
        out += markdown_table(time_rows(run, cpu=True))
        out.append("")
    c = contest_config(replace(CPSpec(), preset=spec["preset"]))
    out.append(f"preset {spec['preset']} (n={c.n_layers} layers, D={c.dim}, heads {c.n_heads}/{c.n_kv_heads} kv), "
               f"cp {spec['cp']} (gloo, {spec['threads']} thread(s)/rank), B={spec['batch']}, {spec['steps']} timed "
               f"steps (+{spec['warmup']} warmup) per impl in {len(blocks(spec['steps'], spec['repeats']))} "
               "alternating blocks; step = forward + loss + backward + gradient all-reduce + AdamW, slowest rank")
    for r in results["runs"][0]["impls"]:
        out += [f"- {note}" for note in r["notes"]]
    out.append("- torch context_parallel: not run — on CPU it fails (no sharding strategy for "
               "aten._scaled_dot_product_flash_attention_for_cpu); see bench/context_parallel.py")
    return "\n".join(out)
