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

`bench_cp_kernels` is of another kind: no processes, one device, the block kernels side by side
(`fivefold.context_parallel.kernels`: the device's fused SDPA kernel against the portable fp32
math) on the attention of one cp rank, cp emulated by blocks — the rank's queries, and the K/V
shards the ring would bring it, handed over in memory (`_LocalRing`), so the rank computes exactly
the ring's blocks and merges. At 8k tokens on a GPU (``python bench/run.py cp-kernel``), at a small
size on CPU (``--dry-run``).

`bench_cp_modes` compares the three context-parallel modes at one cp size (default 4 gloo ranks), each
contestant a whole training step like `bench_cp`'s: ``fivefold-ring`` (ring attention over all cp ranks,
zig-zag), ``fivefold-ulysses`` (Ulysses: an all-to-all turns the sequence split into a head split, the model's
own core attends the whole sequence for H/U heads, an all-to-all turns it back; U = cp) and ``fivefold-hybrid``
(Ulysses U=2 inside, ring attention over the cp/U ring groups across; `UlyssesLayout`, `UlyssesGroups` from
`ParallelDims.groups` "cp_ulysses" / "cp_ring"). Each rank's local loss is averaged over cp ranks (one scalar
all-reduce, outside the logged traffic) so the losses of modes that give a rank different tokens compare. Per
contestant, untimed at build: the activations autograd saves, and the resident peak of one forward + backward
above the resident size before it (VmHWM after resetting it; the contest runs with freed large blocks returned to
the system, `freed_blocks_returned`), both the maximum over ranks.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
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
    freed_blocks_returned,
    lm_loss,
    log_bytes,
    markdown_table,
    mib,
    ops_text,
    ratio_line,
    resident_kib,
    run_contest,
    time_rows,
)
from fivefold.context_parallel import (
    SequenceLayout,
    UlyssesGroups,
    UlyssesLayout,
    apply_context_parallel,
    ring_attention,
)
from fivefold.context_parallel.kernels import choose_kernel
from fivefold.data_parallel import ZeroDataParallel
from fivefold.distributed.comm import Comm, CommLog
from fivefold.distributed.topology import ParallelDims
from fivefold.models import build_model
from fivefold.models.plans import LLAMA_CP_PLAN
from fivefold.tensor_parallel.comm_ops import gather_from_sp

__all__ = ["CPKernelSpec", "CPModesSpec", "CPSpec", "bench_cp", "bench_cp_kernels", "bench_cp_modes",
           "format_cp_kernel_table", "format_cp_modes_table", "format_cp_table"]


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


# ---------------------------------------------------------------------------------------------------
# Ring, Ulysses and the ring × Ulysses hybrid, whole training steps at one cp size.
@dataclass(frozen=True)
class CPModesSpec(CPSpec):
    """A contest of the cp modes (picklable): ``cp`` gloo ranks, the hybrid Ulysses ``hybrid_ulysses`` × ring
    cp / ``hybrid_ulysses``. ``long_steps`` (if set): the timed steps at ``seq_len >= long_from`` (fewer where a
    step is slow)."""

    cp: int = 4
    hybrid_ulysses: int = 2
    steps: int = 12
    repeats: int = 6
    long_from: int = 8192
    long_steps: int | None = None


def _ulysses_groups(cp: int, ulysses: int, log: CommLog) -> UlyssesGroups:
    """Ulysses over U consecutive cp ranks, the ring across them (`ParallelDims.groups`); every rank creates every
    group, in the same order."""
    import torch.distributed as dist

    dims = ParallelDims(dp=1, cp=cp, cp_ulysses=ulysses).resolve(cp)
    made = {}
    for dim in ("cp_ulysses", "cp_ring"):
        for ranks in dims.groups(dim):
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                made[dim] = group
    return UlyssesGroups(Comm(made["cp_ulysses"], "cp_ulysses", log), Comm(made["cp_ring"], "cp_ring", log))


def _resident_peak_bytes(run: Any) -> int:
    """Resident high-water mark of ``run()`` above the resident size before it (Linux; 0 elsewhere)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = resident_kib()["VmRSS"]
    except OSError:
        return 0
    run()
    return (resident_kib()["VmHWM"] - before) * 1024


def build_cp_mode(config: Any, spec: CPModesSpec, world: Comm, mode: str) -> Runner:
    log = CommLog()
    cp = spec.cp
    if mode == "ring":
        comm: Comm | UlyssesGroups = Comm(None, "cp_ring", log)
        layout: SequenceLayout | UlyssesLayout = SequenceLayout("zigzag", cp)
    else:
        ulysses = cp if mode == "ulysses" else spec.hybrid_ulysses
        comm, layout = _ulysses_groups(cp, ulysses, log), UlyssesLayout("zigzag", cp, ulysses)
    rank = comm.rank
    model = build_model(config, seed=spec.seed)
    apply_context_parallel(model, comm, layout, spec.seq_len, LLAMA_CP_PLAN)
    engine = ZeroDataParallel(model, Comm(None, "cp_grads", CommLog(enabled=False)), zero_stage=0,
                              optimizer_class=torch.optim.AdamW, lr=spec.lr, weight_decay=spec.weight_decay)
    probe = layout.shard(torch.zeros(spec.batch, spec.seq_len, dtype=torch.long), rank)
    saved = _saved_activation_bytes(model, probe)

    def forward_backward() -> None:
        engine.backward(lm_loss(engine(probe), probe))

    peak = _resident_peak_bytes(forward_backward)
    engine.zero_grad()
    measured = torch.tensor([saved, peak], dtype=torch.float64)
    world.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
    log.reset()

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        x, y = layout.shard(x, rank), layout.shard(y, rank)
        loss = lm_loss(engine(x), y)
        with during_backward:
            engine.backward(loss)
        total = loss.detach().clone()
        world.all_reduce(total)  # the mean over cp ranks: the modes give a rank different tokens
        return total / world.size

    name = {"ring": f"ring attention over {cp} ranks (zig-zag, blocks above the diagonal skipped)",
            "ulysses": f"Ulysses {cp}: all-to-all of Q/K/V to whole sequences of H/{cp} heads, the model's own core "
                       "(SDPA), all-to-all back",
            "hybrid": f"Ulysses {spec.hybrid_ulysses} × ring {cp // spec.hybrid_ulysses} (zig-zag): all-to-all "
                      f"within groups of {spec.hybrid_ulysses} consecutive ranks, ring attention across them"}[mode]
    return Runner(step, update=lambda: engine.step(), reset_comm=log.reset, comm=log_bytes(log, cp),
                  comm_source="measured (CommLog): the attention's traffic only (gradient all-reduce excluded)",
                  notes=[f"{name}; gradients averaged over cp by a fivefold ZeRO-0 engine, AdamW"],
                  info=dict(saved_activation_bytes=int(measured[0]), peak_fwd_bwd_bytes=int(measured[1]),
                            layout=layout.describe() if isinstance(layout, UlyssesLayout) else f"ring {cp} zigzag"))


def cp_mode_contestants() -> tuple[Contestant, ...]:
    return (Contestant("fivefold-ring", functools.partial(build_cp_mode, mode="ring")),
            Contestant("fivefold-ulysses", functools.partial(build_cp_mode, mode="ulysses"),
                       baseline="fivefold-ring"),
            Contestant("fivefold-hybrid", functools.partial(build_cp_mode, mode="hybrid"),
                       baseline="fivefold-ring"))


def bench_cp_modes(spec: CPModesSpec | None = None, **overrides: Any) -> dict:
    """Ring attention, Ulysses and the hybrid at each of ``spec.seq_lens``, one launch of ``spec.cp`` gloo ranks
    per length. Returns ``runs``: the `run_contest` result per sequence length."""
    spec = replace(spec or CPModesSpec(), **overrides)
    u = spec.hybrid_ulysses
    if not 1 < u < spec.cp or spec.cp % u:
        raise ValueError(f"the hybrid needs 1 < Ulysses degree < cp and dividing it, got {u} at cp {spec.cp}")
    runs = []
    for seq_len in spec.seq_lens:
        for layout in (SequenceLayout("zigzag", spec.cp), UlyssesLayout("zigzag", spec.cp, spec.cp),
                       UlyssesLayout("zigzag", spec.cp, u)):
            layout.check(seq_len)
        steps = spec.long_steps if spec.long_steps and seq_len >= spec.long_from else spec.steps
        with freed_blocks_returned():  # resident peaks show what a step holds, not what the heap kept
            runs.append(run_contest("cp-modes", replace(spec, seq_len=seq_len, steps=steps),
                                    cp_mode_contestants(), min_warmup=0))
    return dict(kind="cp-modes", spec=asdict(spec), runs=runs)


_OP_NAMES = {"all_to_all": "A2A", "send": "send", "recv": "recv"}


def _traffic_text(by_op: dict[str, Any]) -> str:
    """``A2A×32 8.00 + send×16 4.00 + recv×16 4.00``: calls and MiB per op."""
    return " + ".join(f"{_OP_NAMES.get(op, op)}×{v[0]} {mib(v[1])}" for op, v in by_op.items()) or "none"


def format_cp_modes_table(results: dict) -> str:
    """One row per (sequence length, mode): step time, ratio against ring, attention traffic by op, saved
    activations and the resident peak of a forward + backward."""
    spec = results["spec"]
    rows = [("seq_len", "impl", "median step s", "ratio / ring (paired)", "attention traffic per step and rank: "
             "calls MiB by op", "sent KiB per local token", "activations saved by forward, MiB per rank",
             "peak fwd+bwd MiB per rank")]
    for run in results["runs"]:
        seq_len = run["spec"]["seq_len"]
        for r in run["impls"]:
            sent = sum(b for op, (_, b) in r["comm_by_op"].items() if op != "recv")
            rows.append((str(seq_len), r["name"], f"{r['median_s']:.2f}",
                         f"{r['ratio']:.3f} ({r['ratio_paired']:.3f})" if r.get("ratio") is not None else "1",
                         _traffic_text(r["comm_by_op"]), f"{sent / 1024 / (seq_len * spec['batch'] / spec['cp']):.1f}",
                         mib(r["info"]["saved_activation_bytes"]), mib(r["info"]["peak_fwd_bwd_bytes"])))
    out = markdown_table(rows)
    out += [RATIO_LEGEND, CPU_LEGEND, ""]
    for run in results["runs"]:
        out.append(f"seq_len {run['spec']['seq_len']}, {run['spec']['steps']} timed steps:")
        out += [ratio_line(p, cpu=True) for p in run["pairs"]]
        out += markdown_table(time_rows(run, cpu=True))
        out.append("")
    c = contest_config(replace(CPSpec(), preset=spec["preset"]))
    long = (f" ({spec['long_steps']} at seq_len >= {spec['long_from']})" if spec.get("long_steps") else "")
    out.append(f"preset {spec['preset']} (n={c.n_layers} layers, D={c.dim}, heads {c.n_heads}/{c.n_kv_heads} kv), "
               f"cp {spec['cp']} (gloo, {spec['threads']} thread(s)/rank), B={spec['batch']}, {spec['steps']} timed "
               f"steps{long} (+{spec['warmup']} warmup) per impl in alternating blocks ({spec['repeats']} per impl); "
               "step = forward + loss + backward + gradient all-reduce + AdamW, slowest rank; loss = the mean over "
               "cp ranks")
    out.append("traffic: payload bytes as logged (an all-to-all counts its whole input, the 1/U kept local "
               "included); sent = all-to-all + send. activations saved: unique storages autograd saves in one forward; "
               "peak: resident high-water mark of one forward + backward above the size before it (freed large blocks "
               "returned to the system); both the max over ranks")
    for r in results["runs"][0]["impls"]:
        out += [f"- {r['name']}: {note}" for note in r["notes"]]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------
# The block kernels side by side, one device, cp emulated by blocks.
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class CPKernelSpec:
    """One cp rank's ring attention (forward + backward) at ``seq_len`` tokens split over ``cp``
    (zig-zag), per kernel choice (``parallel.cp_kernel``: flash = the device's fused kernel, math).
    Defaults: a Llama-3-8B attention layer (32 query heads, 8 kv heads, head dim 128) in bf16."""

    seq_len: int = 8192
    cp: int = 4
    rank: int = 0  # zig-zag gives every rank the same causal work
    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    device: str = "auto"  # the accelerator if there is one, else the CPU
    kernels: tuple[str, ...] = ("flash", "math")
    steps: int = 5
    warmup: int = 1
    seed: int = 0
    threads: int | None = None  # CPU: torch threads (None: torch's default)

    @classmethod
    def dry_run(cls, **overrides: Any) -> CPKernelSpec:
        """A size that runs in seconds on a CPU: 1k tokens, 4/2 heads of 64, fp32."""
        small = dict(seq_len=1024, heads=4, kv_heads=2, head_dim=64, dtype="fp32", steps=3, warmup=1)
        return cls(**{**small, **overrides})


@dataclass
class _LocalRing:
    """The comm `ring_attention` asks for, without processes: rank `rank` of `size`, whose received
    K/V shard at ring step i is rank (rank - i - 1)'s, copied from `shards` (every rank's, in this
    device's memory); a travelling dK/dV accumulator arrives as zeros (this rank's part is computed
    alike, the other ranks' parts are not). Sends go nowhere."""

    rank: int
    size: int
    shards: list[torch.Tensor]  # per rank: stack([k, v]) of its positions
    _kv_calls: int = field(default=0, init=False)

    def batch_p2p(self, ops: Any, tag: str = "") -> Any:
        for kind, tensor, _peer in ops:
            if kind != "recv":
                continue
            if tag == "cp_kv":
                step = self._kv_calls % (self.size - 1)
                self._kv_calls += 1
                tensor.copy_(self.shards[(self.rank - step - 1) % self.size])
            else:
                tensor.zero_()
        return _Done()


class _Done:
    def wait(self) -> None:
        return None


def _device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return torch.device(accelerator or "cpu")


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _block_area(layout: SequenceLayout, rank: int, chunk: int) -> float:
    """Query×key pairs one rank's causal blocks cover (a diagonal block: its lower half)."""
    area = 0.0
    for src in range(layout.cp):
        for qc in layout.chunks_of(rank):
            for kc in layout.chunks_of(src):
                area += chunk * chunk if kc < qc else (chunk * chunk / 2 if kc == qc else 0)
    return area


def bench_cp_kernels(spec: CPKernelSpec | None = None, **overrides: Any) -> dict:
    """Per kernel choice: the median forward and backward time of one cp rank's ring attention,
    the achieved attention TFLOP/s, the accelerator's peak memory during them (None on CPU), and the
    output's and dQ's largest difference from the math kernel's (the first choice's without one)."""
    spec = replace(spec or CPKernelSpec(), **overrides)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    device, dtype = _device(spec.device), _DTYPES[spec.dtype]
    layout = SequenceLayout("zigzag", spec.cp)
    layout.check(spec.seq_len)
    g = torch.Generator().manual_seed(spec.seed)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(spec.batch, heads, spec.seq_len, spec.head_dim, generator=g).to(device, dtype)

    q, k, v, grad = draw(spec.heads), draw(spec.kv_heads), draw(spec.kv_heads), draw(spec.heads)
    shards = [torch.stack([layout.shard(t, r, dim=2) for t in (k, v)]) for r in range(spec.cp)]
    q_r, grad_r = (layout.shard(t, spec.rank, dim=2) for t in (q, grad))
    chunk = spec.seq_len // (2 * spec.cp)
    fwd_flops = 4 * spec.batch * spec.heads * spec.head_dim * _block_area(layout, spec.rank, chunk)
    accelerator = device.type != "cpu"

    def one_step(kernel: str, measure_peak: bool) -> tuple[float, float, int | None, tuple]:
        qq = q_r.clone().requires_grad_()
        kk, vv = (shards[spec.rank][j].clone().requires_grad_() for j in (0, 1))
        comm = _LocalRing(spec.rank, spec.cp, shards)
        if measure_peak:
            torch.accelerator.reset_peak_memory_stats(device)
            base = torch.accelerator.memory_allocated(device)
        _sync(device)
        t0 = time.perf_counter()
        out = ring_attention(qq, kk, vv, comm, layout, True, kernel)
        _sync(device)
        t1 = time.perf_counter()
        out.backward(grad_r)
        _sync(device)
        t2 = time.perf_counter()
        peak = torch.accelerator.max_memory_allocated(device) - base if measure_peak else None
        return t1 - t0, t2 - t1, peak, (out.detach().float(), qq.grad.float())

    # Alternating rounds (A B, B A, ...) so that drift and noise hit every kernel alike.
    chosen = {c: choose_kernel(c, device.type, dtype, spec.head_dim) for c in spec.kernels}
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in spec.kernels}
    peaks: dict[str, int | None] = {c: None for c in spec.kernels}
    outputs: dict[str, tuple] = {}
    for i in range(spec.warmup + spec.steps):
        for choice in spec.kernels if i % 2 == 0 else reversed(spec.kernels):
            fwd, bwd, peak, outputs[choice] = one_step(chosen[choice], accelerator and i == spec.warmup)
            if peak is not None:
                peaks[choice] = peak
            if i >= spec.warmup:
                times[choice].append((fwd, bwd))
    rows = []
    for choice in spec.kernels:
        fwd = statistics.median([f for f, _ in times[choice]])
        bwd = statistics.median([b for _, b in times[choice]])
        rows.append(dict(choice=choice, kernel=chosen[choice], forward_s=fwd, backward_s=bwd, step_s=fwd + bwd,
                         tflops=3.5 * fwd_flops / (fwd + bwd) / 1e12, peak_bytes=peaks[choice]))
    ref = "math" if "math" in outputs else spec.kernels[0]
    for row in rows:
        out, dq = outputs[row["choice"]]
        row["max_abs_diff_out"] = float((out - outputs[ref][0]).abs().max())
        row["max_abs_diff_dq"] = float((dq - outputs[ref][1]).abs().max())
        row["step_ratio"] = row["step_s"] / next(r["step_s"] for r in rows if r["choice"] == ref)
        row["step_ratio_paired"] = statistics.median(
            [(f + b) / (fr + br) for (f, b), (fr, br) in zip(times[row["choice"]], times[ref])])
    return dict(kind="cp-kernel", spec=asdict(spec), device=str(device), reference=ref,
                scale=dict(out=float(outputs[ref][0].abs().max()), dq=float(outputs[ref][1].abs().max())),
                rows=rows)


def format_cp_kernel_table(results: dict) -> str:
    """One row per kernel choice: forward, backward, ratio to the reference, TFLOP/s, peak memory,
    the largest differences from the reference."""
    s, ref = results["spec"], results["reference"]
    head = ("cp_kernel", "block kernel", "forward ms", "backward ms", f"step / {ref} (paired)", "attention TFLOP/s",
            "peak MiB", f"max |Δ out| vs {ref}", f"max |Δ dQ| vs {ref}")
    rows = [head] + [(r["choice"], r["kernel"], f"{1e3 * r['forward_s']:.2f}", f"{1e3 * r['backward_s']:.2f}",
                      f"{r['step_ratio']:.3f} ({r['step_ratio_paired']:.3f})", f"{r['tflops']:.3g}",
                      "n/a (CPU)" if r["peak_bytes"] is None else mib(r["peak_bytes"]),
                      f"{r['max_abs_diff_out']:.2e}", f"{r['max_abs_diff_dq']:.2e}") for r in results["rows"]]
    out = markdown_table(rows)
    out.append(f"one cp rank ({s['rank']} of {s['cp']}, zig-zag) of ring attention at {s['seq_len']} tokens on "
               f"{results['device']}, cp emulated by blocks (the ring's K/V handed over in memory); B={s['batch']}, "
               f"{s['heads']}/{s['kv_heads']} heads of {s['head_dim']}, {s['dtype']}; median of {s['steps']} steps "
               f"(+{s['warmup']} warmup) per kernel in alternating rounds; paired: the median of each round's ratio; TFLOP/s = 3.5 × 4·B·H·d·(causal block area) / (forward + backward); "
               f"peak: memory allocated above the inputs during one forward + backward; |out| ≤ "
               f"{results['scale']['out']:.2f}, |dQ| ≤ {results['scale']['dq']:.2f} ({ref})")
    return "\n".join(out)
