"""Whether a run fits this machine, said before any worker starts: `check_fits` predicts each local
rank's peak with the planner's memory model and refuses, in one line naming the figures and a layout
that would fit, a run the kernel's OOM killer would otherwise end after spawning workers (or a
device would fail in its first step).

This module owns three things. `predict_rank` is `memory.rank_memory` without its assembly:
`rank_memory` reads the flat buffers, ZeRO-3 units and stage cuts off the trainer's own
`parallelize` run on the meta device, which builds every module (seconds for a 405B shape, ~40 s for
DeepSeek-V3's, minutes for 10,000 blocks); here the same buffers come from arithmetic on the model's
shape — the bucket rule of `buckets.assign_buckets`, the padding and optimizer segments of
`FlatParam`, the units of `fsdp.find_unit_modules` — and the same functions price them (`formulas`;
`memory.activation_bytes` the activations, of the blocks by kind; `in_flight`), into the same
`RankMemory` (`tests/test_fits.py` holds it equal to `rank_memory`).
`available_memory` reads what this machine can give (host: MemAvailable and the cgroup's room; a
device: ``mem_get_info``). The advice tries the layout changes the memory model says fit.

On the CPU a worker also holds what the memory model does not count (the interpreter, torch, gloo,
the corpus): `PROCESS_BASELINE` per rank, measured; and the RoPE tables are built in fp64 at
start-up (`ROPE_BUILD_BYTES`)."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from fivefold import formulas
from fivefold.config import Config, ConfigError
from fivefold.data_parallel.flat_param import segmentation_for
from fivefold.distributed.mesh import ParallelDims
from fivefold.models.llama import PRESETS, LlamaConfig, check_model_bounds, param_counts
from fivefold.pipeline.builders import build_schedule
from fivefold.pipeline.split import split_layers
from fivefold.plan.assembly import precision_bytes, resolved
from fivefold.plan.hardware import GB
from fivefold.plan.memory import RankMemory, activation_bytes, in_flight, rank_memory
from fivefold.run_plan import RunPlan, validate_layout

__all__ = [
    "PROCESS_BASELINE",
    "ROPE_BUILD_BYTES",
    "Available",
    "available_memory",
    "check_fits",
    "predict_rank",
]

# What a CPU worker holds besides the memory model's tensors, measured on `make run`'s job (torch
# 2.13, Linux, 2 ranks): an idle process with fivefold's trainer imported is 277 MB resident (198 MB
# anonymous); a worker's peak exceeds its predicted tensors by 351 MB (small, the default) to 476 MB
# (medium) with the shared libraries counted once (PSS), 365-571 MB resident (VmHWM; tiny to
# medium): the interpreter and torch, the default corpus (8.4M uint16 tokens) and its loading, gloo,
# the autograd graph's bookkeeping. 300 MiB (315 MB) stays below all: the check must never refuse a
# run that fits, so one predicted just inside may still be 5-10 % short.
PROCESS_BASELINE = 300 * 2**20
# `llama.precompute_rope` builds the tables in fp64 on the CPU at start-up: 24 bytes per (position,
# channel) beside the fp32 tables themselves (measured: 24.05), freed before the first step.
ROPE_BUILD_BYTES = 24
# how `rank_memory`'s meta-device run cuts master shards into optimizer tensors (`FlatParam`)
_SEGMENTS = segmentation_for("meta")


# -- a rank's flat buffers, from the shape ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Flat:
    """One flat buffer as rank 0 of its group holds it (`FlatParam`): padded size, shard, real
    elements in the shard, optimizer segments, its largest parameter; ``root``: ZeRO-3's root
    unit."""

    padded: int
    shard: int
    owned: int
    segments: int
    largest: int
    root: bool = False


# a parameter: (elements, optimizer-group sort key); the key orders groups as `ZeroDataParallel`
# does: decay first, then partitioned (more mesh dims) before replicated
_Param = tuple[int, tuple]


def _key(skip_decay: bool, placement: Iterable[str]) -> tuple:
    placement = sorted(placement)
    return (skip_decay, -len(placement), tuple(placement))


def _flat(params: Sequence[_Param], world: int, root: bool = False) -> _Flat:
    """`FlatParam` of `params` over `world` ranks (1: unsharded): groups contiguous (stable sort by
    key), total padded to a multiple of world, rank 0's shard [0, padded / world), each group's part
    of it in the optimizer segments `_SEGMENTS` cuts."""
    ordered = sorted(params, key=lambda p: p[1])
    numel = sum(n for n, _ in ordered)
    padded = -(-numel // world) * world
    shard = padded // world
    segments, offset, i = 0, 0, 0
    while i < len(ordered):  # one group: [offset, end)
        key, end = ordered[i][1], offset
        while i < len(ordered) and ordered[i][1] == key:
            end += ordered[i][0]
            i += 1
        part = max(0, min(end, shard) - offset)
        segments += len(_SEGMENTS.cut(0, part)) if part > 0 else 0
        offset = end
    return _Flat(padded, shard, min(numel, shard), segments, max(n for n, _ in ordered), root)


def _buckets(params: Sequence[_Param], bucket_bytes: float, world: int) -> list[_Flat]:
    """`buckets.assign_buckets` (reverse registration order, closed once at least `bucket_bytes`;
    the stand-ins it measures are fp32, whatever the precision), each bucket a flat buffer."""
    out, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p[0] * 4
        if size >= bucket_bytes:
            out.append(_flat(current, world))
            current, size = [], 0
    if current:
        out.append(_flat(current, world))
    return out


def _uniform_flat(n: int, numel: int, world: int) -> _Flat:
    """`_flat` of `n` parameters of `numel` elements each in one optimizer group (experts), in
    closed form."""
    padded = -(-n * numel // world) * world
    shard = padded // world
    owned = min(n * numel, shard)
    return _Flat(padded, shard, owned, len(_SEGMENTS.cut(0, owned)) if owned else 0, numel)


def _uniform_buckets(
    n: int, numel: int, bucket_bytes: float, world: int
) -> list[tuple[_Flat, int]]:
    """`_buckets` of `n` parameters of `numel` elements each (the experts of a stage's MoE layers,
    one after the other): k to a bucket, as (flat, count)."""
    if n == 0:
        return []
    k = max(1, math.ceil(bucket_bytes / (numel * 4)))
    full, rest = divmod(n, k)
    out = [(_uniform_flat(k, numel, world), full)] if full else []
    return out + ([(_uniform_flat(rest, numel, world), 1)] if rest else [])


@dataclasses.dataclass(frozen=True)
class _Engine:
    """A `ZeroDataParallel` of one stage: its flats (with multiplicity), group size, stage, hpZ
    group size."""

    flats: tuple[tuple[_Flat, int], ...]
    comm: int
    stage: int
    hpz: int = 0
    replicated: bool = False  # HSDP: each shard all-reduced across replicas, waited at the end


def _stage_engines(
    m: LlamaConfig, dims: ParallelDims, zero: tuple, stage_id: int, n_stages: int, blocks: range
) -> list[_Engine]:
    """The engines `models.parallelize._engines` gives stage `stage_id` (its blocks; the embedding
    on the first, the norm and head on the last) of this rank: the dense one over dp × cp (HSDP:
    dp_shard), the experts' over ep_dp, rank 0 of every dimension."""
    stage, bucket_mb, hpz = zero
    tp, pp = dims.tp, frozenset({"pp"}) if dims.pp > 1 else frozenset()
    tp_dims = pp | ({"tp"} if tp > 1 else set())  # a TP-sliced parameter's placement
    weight, norm = _key(False, tp_dims), _key(True, pp)
    hd = m.head_dim
    bias = _key(True, tp_dims)  # a column layer's bias: sliced, not decayed
    qkv_bias = m.attention_bias != "off"
    attention = [
        (m.dim, norm),
        (m.n_heads * hd // tp * m.dim, weight),
        *([(m.n_heads * hd // tp, bias)] if qkv_bias else []),
        (m.n_kv_heads * hd // tp * m.dim, weight),
        *([(m.n_kv_heads * hd // tp, bias)] if qkv_bias else []),
        (m.n_kv_heads * hd // tp * m.dim, weight),
        *([(m.n_kv_heads * hd // tp, bias)] if qkv_bias else []),
        (m.dim * m.n_heads * hd // tp, weight),
        *([(m.dim, norm)] if m.attention_bias == "all" else []),  # wo's: replicated
        *([(hd, norm), (hd, norm)] if m.qk_norm else []),  # q_norm, k_norm: replicated
        (m.dim, norm),
    ]
    dense_block = attention + [(m.ffn_hidden // tp * m.dim, weight)] * 3
    moe_block: list[_Param] = []
    experts_per_rank = expert_numel = 0
    if m.moe is not None:  # tp is 1 with MoE (validate)
        hidden = m.moe.hidden or m.ffn_hidden
        moe_block = attention + [(m.moe.experts * m.dim, weight)]  # + the router
        shared = m.moe.shared_hidden or hidden * m.moe.shared_experts
        moe_block += [(shared * m.dim, weight)] * (3 if m.moe.shared_experts else 0)
        moe_block += [(m.dim, weight)] if m.moe.shared_gate else []  # [1, D]: decayed
        experts_per_rank, expert_numel = m.moe.experts // dims.ep, m.dim * hidden
    first, last = stage_id == 0, stage_id == n_stages - 1
    embedding = [(m.vocab_size // tp * m.dim, _key(True, tp_dims))] if first else []
    head = [(m.dim, norm)] if last else []
    output = [(m.vocab_size // tp * m.dim, weight)] if last and not m.tie_embeddings else []
    moe_ids = [i for i in blocks if m.is_moe_block(i)]
    n_moe, n_dense = len(moe_ids), len(blocks) - len(moe_ids)
    group = (
        dims.size("dp_shard") if dims.dp_replicate > 1 else dims.size("dp_cp")
    )  # the dense engine's
    world = (
        group if stage >= 1 and group > 1 else 1
    )  # ZeRO-1/2/3 shard over it; DDP holds everything
    if stage < 3:
        params = list(embedding)
        for i in blocks:
            params += moe_block if m.is_moe_block(i) else dense_block
        dense = [(f, 1) for f in _buckets(params + head + output, bucket_mb * 2**20, world)]
    else:
        # units: each block, the embedding and the head (untied), the root (the final norm; a tied
        # embedding)
        dense = [(_flat(dense_block, world), n_dense)] if n_dense else []
        dense += [(_flat(moe_block, world), n_moe)] if n_moe else []
        for unit in (embedding if not m.tie_embeddings else [], output):
            dense += [(_flat(unit, world), 1)] if unit else []
        root = head + (embedding if m.tie_embeddings else [])
        dense += [(_flat(root, world, root=True), 1)] if root else []
    engines = [
        _Engine(
            tuple(dense),
            group,
            stage,
            hpz if stage == 3 and hpz > 1 and group > 1 else 0,
            replicated=dims.dp_replicate > 1,
        )
    ]
    if m.moe is not None:
        ep_dp = dims.size("ep_dp")
        world = ep_dp if stage >= 1 and ep_dp > 1 else 1
        # every expert weight is dim × hidden, decayed, placed over pp and ep alike: one optimizer
        # group
        if stage < 3:
            flats = _uniform_buckets(
                3 * experts_per_rank * n_moe, expert_numel, bucket_mb * 2**20, world
            )
        else:  # a unit per MoE block: its experts
            flats = (
                [(_uniform_flat(3 * experts_per_rank, expert_numel, world), n_moe)] if n_moe else []
            )
        engines.append(_Engine(tuple(flats), ep_dp, stage))
    return engines


_ENGINES: dict[tuple, tuple[_Engine, ...]] = {}


def _engines_cached(
    m: LlamaConfig, dims: ParallelDims, zero: tuple, stage_id: int, n_stages: int, blocks: range
) -> tuple[_Engine, ...]:
    # the advice prices several batch sizes and recompute modes of one layout: its buffers are laid
    # out once
    key = (repr(m), dims, zero, stage_id, n_stages, blocks.start, blocks.stop)
    if key not in _ENGINES:
        if len(_ENGINES) > 64:
            _ENGINES.clear()
        _ENGINES[key] = tuple(_stage_engines(m, dims, zero, stage_id, n_stages, blocks))
    return _ENGINES[key]


def _top(flats: Iterable[tuple[int, int]], n: int) -> int:
    """The sum of the `n` largest values of (value, count) pairs."""
    total = 0
    for value, count in sorted(flats, reverse=True):
        take = min(count, n)
        total, n = total + value * take, n - take
        if n <= 0:
            break
    return total


def _states(e: _Engine, cfg: Config) -> dict[str, int]:
    """`memory._engine_states`: docs/design.md#model-state-memory per flat buffer
    (`formulas.flat_model_state_bytes`)."""
    pb, gb = precision_bytes(cfg)
    out = {"params": 0, "grads": 0, "optimizer": 0, "host": 0}
    for f, count in e.flats:
        part = formulas.flat_model_state_bytes(
            f.padded,
            f.shard,
            f.owned,
            f.segments,
            stage=e.stage,
            param_bytes=pb,
            grad_bytes=gb,
            separate_master=pb != 4,
            hpz=e.hpz,
            offload=cfg.zero.offload_optimizer,
        )
        for k in out:
            out[k] += part[k] * count
    return out


def _transient(
    e: _Engine, cfg: Config, accumulating: bool, reductions: int, deferred_w: bool
) -> dict[str, int]:
    """`memory._transient` on the flats' sizes (see there for what each buffer is)."""
    z, stage = cfg.zero, e.stage
    pb, gb = precision_bytes(cfg)
    out: dict[str, int] = {}
    if not e.flats:
        return out
    sizes = [(f.padded, n) for f, n in e.flats]
    if stage >= 2 and e.comm > 1:
        n = sum(c for _, c in sizes) if accumulating else z.inflight_buckets + 1
        out["gradient buckets"] = _top(sizes, n) * gb
        if reductions > 1:  # (`transports.*.outputs_held`: HSDP holds every bucket's)
            held = sum(c for _, c in sizes) if e.replicated else z.inflight_buckets
            out["reduce-scatter outputs"] = _top(((f.shard, c) for f, c in e.flats), held) * gb
    if stage in (1, 2) or (stage == 0 and pb != gb):
        out["parameter gradient"] = max(f.largest for f, _ in e.flats) * pb
    if stage == 3 and e.comm > 1:
        root = sum(f.padded * c for f, c in e.flats if f.root)
        others = [(f.padded, c) for f, c in e.flats if not f.root]
        every = not z.reshard_after_forward or deferred_w
        gathered = sum(v * c for v, c in others) if every else _top(others, 1 + z.prefetch)
        out["gathered units"] = (root + gathered) * pb
        out["unit gradients"] = max(f.padded for f, _ in e.flats) * pb
    return out


@lru_cache(maxsize=256)
def _in_flight(
    schedule: str, pp: int, micro_batches: int, virtual: int, rank: int
) -> tuple[int, int]:
    """`memory.in_flight` of the schedule: GPipe holds all M; the others reach their steady state
    within a few rounds (the simulation's cost grows with M), so M beyond 8·P·V is simulated at
    8·P·V (`tests/test_fits.py`)."""
    if schedule == "gpipe":
        return micro_batches, 0
    cap = 8 * pp * virtual
    return in_flight(build_schedule(schedule, pp, min(micro_batches, cap), virtual), rank)


def predict_rank(cfg: Config, run: RunPlan, pp_rank: int = 0) -> RankMemory:
    """`memory.rank_memory(cfg, run, pp_rank)` computed from the model's shape: nothing is built, a
    405B or a 10,000-block shape costs milliseconds. The same `RankMemory`, part for part. A layout
    with whole-parameter owners (Muon; ZeRO-3's FP8 gather), whose buffers follow the greedy owners
    and the optimizers' state rates, is priced by `rank_memory` itself (the meta-device assembly:
    exact, seconds for the largest shapes)."""
    if cfg.optim.name != "adamw" or cfg.zero.fp8_gather:
        return rank_memory(cfg, run, pp_rank)
    cfg = resolved(cfg, run)
    m, dims, z, p = run.model, run.dims, cfg.zero, cfg.pipeline
    if dims.pp > 1:
        schedule = build_schedule(
            p.schedule, dims.pp, min(run.grad_accum, 8 * dims.pp * p.virtual), p.virtual
        )
        stage_ids, n_stages = schedule.stages_of(pp_rank), schedule.n_stages
        whole, pending = _in_flight(p.schedule, dims.pp, run.grad_accum, p.virtual, pp_rank)
        deferred_w = any(a.kind == "W" for acts in schedule.actions for a in acts)
    else:
        stage_ids, n_stages, whole, pending, deferred_w = [0], 1, 1, 0, False
    ranges = split_layers(m.n_layers, n_stages, p.layers())
    accumulating = dims.pp > 1 or (z.defer_reduce and run.grad_accum > 1)
    reductions = 1 if accumulating else run.grad_accum
    states = {"params": 0, "grads": 0, "optimizer": 0, "host": 0}
    transient: dict[str, int] = {}
    n_moe = n_dense = 0
    for sid in stage_ids:
        for e in _engines_cached(
            m, dims, (z.stage, z.bucket_mb, z.hpz), sid, n_stages, ranges[sid]
        ):
            for k, v in _states(e, cfg).items():
                states[k] += v
            for k, v in _transient(e, cfg, accumulating, reductions, deferred_w).items():
                transient[k] = transient.get(k, 0) + v
        moe = sum(1 for i in ranges[sid] if m.is_moe_block(i))
        n_moe, n_dense = n_moe + moe, n_dense + len(ranges[sid]) - moe
    states["total"] = states["params"] + states["grads"] + states["optimizer"]
    # RoPE tables, fp32 cos and sin per stage: this rank's positions of train.seq_len under cp
    # (and the whole tables too when documents restart the positions)
    rows = cfg.train.seq_len // dims.cp if dims.cp > 1 else m.max_seq_len
    if dims.cp > 1 and cfg.data.documents == "mask":
        rows += m.max_seq_len
    transient["model buffers"] = len(stage_ids) * 2 * rows * m.rope_dim * 4
    if m.moe is not None and m.moe.expert_bias:  # the aux-loss-free bias: E fp32 per MoE layer
        transient["model buffers"] += n_moe * m.moe.experts * 4
    mask = formulas.window_mask_bytes(cfg.train.seq_len, m.sliding_window, precision_bytes(cfg)[0])
    if mask:
        transient["attention mask"] = mask
    held = _held(m, dims, stage_ids, n_stages, ranges)
    return RankMemory(
        pp_rank,
        held,
        states,
        transient,
        activation_bytes(
            cfg, run, stage_ids, n_stages, ((False, n_dense), (True, n_moe)), whole, pending
        ),
    )


def _held(
    m: LlamaConfig, dims: ParallelDims, stage_ids: list[int], n_stages: int, ranges: list[range]
) -> int:
    """The parameters of this rank's stages (its TP slice, its experts): `assembly.local_numels`'
    sum."""
    tp, hd = dims.tp, m.head_dim
    attention = 2 * m.dim + 2 * m.n_heads * hd // tp * m.dim + 2 * m.n_kv_heads * hd // tp * m.dim
    if m.attention_bias != "off":  # q, k, v's sliced with their layers; wo's replicated
        attention += (m.n_heads + 2 * m.n_kv_heads) * hd // tp
        attention += m.dim if m.attention_bias == "all" else 0
    attention += 2 * hd if m.qk_norm else 0
    dense = attention + 3 * m.ffn_hidden // tp * m.dim
    moe = 0
    if m.moe is not None:
        hidden = m.moe.hidden or m.ffn_hidden
        shared = (
            (m.moe.shared_hidden or hidden * m.moe.shared_experts) if m.moe.shared_experts else 0
        )
        moe = attention + m.dim * (
            m.moe.experts + 3 * shared + 3 * hidden * (m.moe.experts // dims.ep)
        )
        moe += m.dim if m.moe.shared_gate else 0
    total = 0
    for sid in stage_ids:
        n_moe = sum(1 for i in ranges[sid] if m.is_moe_block(i))
        total += n_moe * moe + (len(ranges[sid]) - n_moe) * dense
        total += m.vocab_size // tp * m.dim if sid == 0 else 0
        total += (
            m.dim + (0 if m.tie_embeddings else m.vocab_size // tp * m.dim)
            if sid == n_stages - 1
            else 0
        )
    return total


# -- what the machine has --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Available:
    """Bytes free for the run and where the figure comes from (for the message)."""

    bytes: int
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """The least room (limit − usage) of this process's memory cgroup and its ancestors, v2 or v1;
    None: no limit. Usage less the inactive page cache (reclaimable, as `docker stats` counts it): a
    cgroup that read many files would otherwise look full."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    dirs: list[tuple[Path, str, str, str]] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, rel = line.split(":", 2)
        rel = rel.lstrip("/")
        if controllers == "":  # v2: one unified hierarchy
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
            names = ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, names = (
                root / "memory",
                ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
            )
        else:
            continue
        here = base / rel
        while (
            True
        ):  # the cgroup and its ancestors (a namespace may show "/" for the container's own)
            dirs.append((here, *names))
            if here == base or base not in here.parents:
                break
            here = here.parent
    room = None
    for here, limit_name, usage_name, inactive in dirs:
        limit, usage = _read_int(here / limit_name), _read_int(here / usage_name)
        if limit is None or usage is None or limit >= 2**60:  # v1 writes ~2^63 for no limit
            continue
        free = limit - max(0, usage - _stat(here / "memory.stat", inactive))
        room = free if room is None else min(room, free)
    return None if room is None else max(0, room)


def _mem_available(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        # not Linux: free pages (less than what could be freed, so the check errs towards starting)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory(device_type: str = "cpu") -> Available | None:
    """What this machine can give the run: on the CPU the smaller of MemAvailable and the memory
    cgroup's room; on an accelerator the current device's free memory
    (``torch.<device_type>.mem_get_info``; torch's accelerator modules are imported only then). None
    when it cannot be told."""
    if device_type == "cpu":
        host, room = _mem_available(), _cgroup_room()
        if room is not None and (host is None or room < host):
            return Available(room, "host memory: the cgroup's limit less its use")
        return Available(host, "host memory: MemAvailable") if host is not None else None
    import torch

    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "mem_get_info") or not module.is_available():
        return None
    free, _ = module.mem_get_info()
    return Available(int(free), f"free on {device_type}:{module.current_device()}, mem_get_info")


# -- the check -------------------------------------------------------------------------------------


def _fmt(n: float) -> str:
    if n >= 0.95 * GB:
        return f"{n / GB:,.1f} GB"
    return f"{n / 1e6:,.0f} MB" if n >= 1e7 else f"{n / 1e6:,.1f} MB"


@dataclasses.dataclass(frozen=True)
class _Prediction:
    per_rank: dict[int, RankMemory]  # by pp rank
    ranks: tuple[int, ...]  # the local ranks' pp ranks
    cpu: bool
    rope_build: int  # one stage's fp64 RoPE build at start-up (host memory)
    baseline: int  # per rank: `PROCESS_BASELINE` (CPU, workers not started yet) or 0

    def rank_bytes(self, pp_rank: int) -> int:
        """What one rank needs: the device's peak; on the CPU also the host part (offload), the
        process baseline, and the start-up's RoPE build if that peak (beside the model states and
        tables) is the higher one."""
        r = self.per_rank[pp_rank]
        if not self.cpu:
            return r.total
        return max(r.total + r.model_states.get("host", 0), self.start_up(pp_rank)) + self.baseline

    def start_up(self, pp_rank: int) -> int:
        """The host's peak while the model is set up (CPU): its states and tables, and one stage's
        fp64 build."""
        r = self.per_rank[pp_rank]
        return r.model_states["total"] + r.transient["model buffers"] + self.rope_build

    @property
    def largest(self) -> int:
        return max(self.rank_bytes(r) for r in set(self.ranks))

    @property
    def total(self) -> int:
        """What is compared with the machine: the local ranks' sum on the CPU (one host), else the
        largest rank."""
        return sum(self.rank_bytes(r) for r in self.ranks) if self.cpu else self.largest

    def need(self) -> str:
        return f"{_fmt(self.total)} in total" if self.cpu else f"{_fmt(self.total)} per rank"

    def states(self, world: int) -> int:
        """Model states summed over the `world` ranks (what more ranks would share under ZeRO-3):
        the mean of the pipeline ranks priced (all of them for a local launch) times the world."""
        return (
            world
            * sum(m.model_states["total"] for m in self.per_rank.values())
            // len(self.per_rank)
        )


def _predict(
    cfg: Config, run: RunPlan, ranks: Sequence[int], cpu: bool, baseline: int
) -> _Prediction:
    per_pp = (
        run.dims.world_size // run.dims.pp
    )  # global rank = pp · (dp · cp · tp) + ...: pp outermost
    pps = tuple(r // per_pp for r in ranks)
    rope = (
        ROPE_BUILD_BYTES * run.model.max_seq_len * run.model.rope_dim
    )  # all positions, then cp's are kept
    return _Prediction(
        {p: predict_rank(cfg, run, p) for p in set(pps)}, pps, cpu, rope, baseline if cpu else 0
    )


def _fits(pred: _Prediction, available: int) -> bool:
    return pred.total <= available


def _variant(
    cfg: Config, world: int, device_type: str, vocab: int, **sections: dict
) -> tuple[Config, RunPlan] | None:
    """`cfg` with some keys changed, and its plan, with the run's vocabulary (its tokenizer's:
    `train.data_source`; rounded up to the variant's tp); None when the trainer would refuse that
    layout."""
    new = dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()}
    )
    try:
        run = validate_layout(new, world, device_type=device_type)
    except ValueError:
        return None
    rows = -(-vocab // run.dims.tp) * run.dims.tp
    return new, dataclasses.replace(run, model=dataclasses.replace(run.model, vocab_size=rows))


def _micro_batches(run: RunPlan) -> list[int]:
    """The micro-batches below the run's that keep its batch per dp rank (micro_batch × grad_accum):
    its divisors, by trial division up to √n (at most 10^5 trials: a batch beyond 10^10 gets its
    small divisors only). Under pp at most `MAX_PIPELINE_MICRO_BATCHES` micro-batches a step: a
    schedule of more is itself seconds to build."""
    n = run.micro_batch * run.grad_accum
    found: set[int] = set()
    for d in range(1, min(math.isqrt(n), 100_000) + 1):
        if n % d == 0:
            found.update((d, n // d))
    return sorted(
        d
        for d in found
        if d < run.micro_batch
        and (run.dims.pp == 1 or n // d <= max(MAX_PIPELINE_MICRO_BATCHES, run.grad_accum))
    )


MAX_PIPELINE_MICRO_BATCHES = 4096


@dataclasses.dataclass(frozen=True)
class _Machine:
    """What the advice prices a changed layout on: the local ranks (global ranks), whether they are
    CPU processes, each one's process baseline, the bytes available, the device type."""

    ranks: Sequence[int]
    cpu: bool
    baseline: int
    available: int
    device_type: str
    vocab: int  # the run's vocabulary (the tokenizer's), which a changed layout keeps

    def variant(self, cfg: Config, world: int, **sections: dict) -> tuple[Config, RunPlan] | None:
        return _variant(cfg, world, self.device_type, self.vocab, **sections)

    def price(self, variant: tuple[Config, RunPlan]) -> _Prediction:
        return _predict(*variant, self.ranks, self.cpu, self.baseline)

    def fits(self, pred: _Prediction) -> bool:
        return _fits(pred, self.available)


def _advice(cfg: Config, run: RunPlan, machine: _Machine) -> str:
    """The first change the memory model says fits: a smaller micro-batch (the global batch kept),
    ZeRO-3, full recompute, all three; else how many such machines (devices) ZeRO-3 would need, and
    a preset that fits."""
    world, t = run.dims.world_size, cfg.train
    batch = run.micro_batch * run.grad_accum  # per dp rank and step: micro_batch × grad_accum stays

    def with_micro(micro: int) -> _Prediction | None:
        v = machine.variant(
            cfg,
            world,
            train=dict(global_batch=run.global_batch, micro_batch=micro, grad_accum=batch // micro),
        )
        return machine.price(v) if v is not None else None

    # the largest that fits, by bisection: the peak grows with the micro-batch (activations ∝
    # micro-batch × micro-batches in flight, which a smaller one never raises; GPipe's stay: then
    # none fits)
    micros, best = _micro_batches(run), None
    lo, hi = 0, len(micros) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        pred = with_micro(micros[mid])
        if pred is not None and machine.fits(pred):
            best, lo = (micros[mid], pred), mid + 1
        else:
            hi = mid - 1
    if best is not None:
        micro, pred = best
        return (
            f"--train.micro_batch {micro} --train.grad_accum {batch // micro} (the same global "
            f"batch, {run.global_batch}) would need {pred.need()}"
        )
    shard = run.dims.size("dp_shard") if run.dims.dp_replicate > 1 else run.dims.size("dp_cp")
    if cfg.zero.stage != 3 and shard > 1:
        v = machine.variant(cfg, world, zero=dict(stage=3))
        if v is not None and machine.fits(pred := machine.price(v)):
            return (
                f"--zero 3 (parameters, gradients and optimizer state sharded over {shard} ranks) "
                f"would need {pred.need()}"
            )
    if t.recompute != "full":
        v = machine.variant(cfg, world, train=dict(recompute="full"))
        if v is not None and machine.fits(pred := machine.price(v)):
            return f"--train.recompute full would need {pred.need()}"
    micro = micros[0] if micros else run.micro_batch  # the smallest
    least = dict(
        train=dict(
            global_batch=run.global_batch,
            micro_batch=micro,
            grad_accum=batch // micro,
            recompute="full",
        )
    )
    if shard > 1:
        least["zero"] = dict(stage=3)
    flags = (
        f"--train.micro_batch {micro} --train.grad_accum {batch // micro}"
        + (" --zero 3" if shard > 1 else "")
        + " --train.recompute full"
    )
    v = machine.variant(cfg, world, **least)
    if v is None:  # (a layout that refuses one of them: price the current one)
        v, flags, least = (cfg, run), "its current layout", {}
    pred = machine.price(v)
    if machine.fits(pred):
        return f"{flags} together would need {pred.need()}"
    # ZeRO-3 over more ranks: each holds ~1/N of the world's model states beside its own activations
    # and buffers, which stay; a host with fewer ranks on it has room for more of the states
    states = pred.states(v[1].dims.world_size)
    beside = max(
        pred.rank_bytes(r) - pred.per_rank[r].model_states["total"] for r in set(pred.ranks)
    )
    local = len(machine.ranks) if machine.cpu else 1  # the CPU: all local ranks; else 1 a device
    per_host = next((n for n in range(local, 0, -1) if machine.available > n * beside), 0)
    if per_host:
        hosts = math.ceil(states / (machine.available - per_host * beside))
        where = (
            f"such machines ({per_host} rank{'s' * (per_host > 1)} each)"
            if machine.cpu
            else f"such {machine.device_type} devices"
        )
        more = f"ZeRO-3 would need at least {hosts:,} {where}"
    else:
        more = f"even one rank's activations and buffers ({_fmt(beside)}) exceed what is available"
    return (
        f"the model does not fit on this machine, even with {flags} ({pred.need()}): {more}, or a "
        "smaller model with them "
        f"({_smaller_model(cfg, run, machine, least)})"
    )


def _smaller_model(cfg: Config, run: RunPlan, machine: _Machine, changes: dict[str, dict]) -> str:
    """The largest preset smaller than the model that fits this layout with `changes` (the
    least-memory settings just named); else what the smallest needs."""
    mine = param_counts(run.model)[0]
    presets = sorted(((param_counts(c)[0], name) for name, c in PRESETS.items()), reverse=True)
    blank = {
        f.name: None
        for f in dataclasses.fields(cfg.model)
        if f.name not in ("preset", "init_from", "attention")
    }
    smallest = None
    for params, name in presets:
        if params >= mine:
            continue
        ep = (
            cfg.parallel.ep if PRESETS[name].moe is not None else 1
        )  # (a dense model has no experts to split)
        v = machine.variant(
            cfg,
            run.dims.world_size,
            **changes,
            model=dict(blank, preset=name, init_from=""),
            moe={f.name: None for f in dataclasses.fields(cfg.moe)},
            parallel=dict(ep=ep),
        )
        if v is None:
            continue
        pred = machine.price(v)
        if machine.fits(pred):
            return f"--model.preset {name} needs {pred.need()}"
        smallest = f"even --model.preset {name} needs {pred.need()}"
    return smallest or "none of the presets is smaller"


def check_fits(
    cfg: Config,
    plan: RunPlan,
    nproc: int,
    device_type: str = "cpu",
    *,
    ranks: Sequence[int] | None = None,
    available: int | None = None,
    workers_started: bool = False,
) -> list[str]:
    """Refuse (`ConfigError`, one line) a run whose predicted peak exceeds this machine's memory,
    naming the figures per rank and in total, what is available, the first layout change that would
    fit, and the override (``--run.check_memory false``). `plan`: `validate_layout`'s. `nproc`: the
    ranks started on this machine, global ranks ``ranks`` (default 0 .. nproc-1; the pipeline rank
    decides a rank's share). On the CPU the local ranks share the host's memory: their sum (with
    `PROCESS_BASELINE` each) against `available_memory`; on an accelerator each rank its device: the
    largest against the device's free memory. ``available``: bytes, instead of measuring (tests).
    ``workers_started`` (under torchrun the ranks run the check themselves): their processes exist,
    so their baseline is already outside the available memory. Returns notes for the start-up (the
    check skipped, and why); nothing is built, so even a 405B or 10,000-block shape takes
    milliseconds."""
    check_model_bounds(plan.model)
    ranks = tuple(ranks) if ranks is not None else tuple(range(nproc))
    cpu = device_type == "cpu"
    if not getattr(cfg.run, "check_memory", True):
        return ["memory check skipped (run.check_memory false)"]
    baseline = 0 if workers_started else PROCESS_BASELINE
    pred = _predict(cfg, plan, ranks, cpu, baseline)
    if available is not None:
        have = Available(available, "host memory" if cpu else f"free on {device_type}")
    else:
        have = available_memory(device_type)
        if have is None:
            return [
                f"memory check skipped: this machine's free {'host' if cpu else device_type} "
                "memory cannot be read"
            ]
    if _fits(pred, have.bytes):
        return []
    worst = max(set(pred.ranks), key=pred.rank_bytes)
    r = pred.per_rank[worst]
    parts = (
        f"model states {_fmt(r.model_states['total'])}, activations "
        f"{_fmt(sum(r.activations.values()))}, buffers {_fmt(sum(r.transient.values()))}"
        + (f", process {_fmt(baseline)}" if cpu and baseline else "")
    )
    if cpu and pred.start_up(worst) > r.total + r.model_states.get("host", 0):
        parts += f"; at start-up the RoPE tables' fp64 build, {_fmt(pred.rope_build)}, is the peak"
    if cpu:
        need = (
            f"about {_fmt(pred.largest)} per rank ({parts}) × {len(ranks)} local "
            f"rank{'s' * (len(ranks) > 1)} = {_fmt(pred.total)}"
        )
    else:
        need = f"about {_fmt(pred.largest)} per rank ({parts})"
    machine = _Machine(ranks, cpu, baseline, have.bytes, device_type, plan.model.vocab_size)
    advice = _advice(cfg, plan, machine)
    raise ConfigError(
        f"memory: this run needs {need}, more than the {_fmt(have.bytes)} available "
        f"({have.source}); {advice}; or --run.check_memory false to start it anyway"
    )
