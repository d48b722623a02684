"""`fivefold plan`: what a layout costs per GPU before any GPU is rented — the formulas of `fivefold.formulas` run
forward on the layout `fivefold train` would build.

Nothing here is allocated or computed twice: the layout is the trainer's own assembly (`parallelize`) run on the
meta device over stand-in groups (`PlanningMesh`), one pipeline rank at a time, so every flat buffer, its padding,
ZeRO-3 unit and expert shard is the one a run would hold; the bytes, the traffic and the FLOPs come from
`formulas` (seed 001 §5 model states, seed 003 §7-§12 TP/SP/PP/CP/EP volumes and activations), the bubble from the
schedule simulator. Tests (`tests/test_plan.py`) hold each figure against measurement on small layouts: model-state
bytes equal, traffic per dimension equal to `CommLog`, the transient peak bounds the one measured in backward,
activations within 15 %.

The step time is an estimate: compute at ``Hardware.compute_efficiency`` of the peak FLOP/s, every collective at
its link's bandwidth (a group within one node: intra-node; else inter-node), ring algorithms, no latency term;
TP/SP and EP traffic on the critical path (each micro-batch's share added to its stage's F and B in the schedule
simulation), ring attention's K/V only where it outlasts the attention's compute, data-parallel traffic hidden
behind the backward where fivefold overlaps it (pp = 1; ZeRO-3's gathers behind forward and backward) and exposed
after the pipeline flush (pp > 1), ZeRO-1/2's all-gather of updated parameters after the optimizer step, the
optimizer streaming its states through memory. MFU = model FLOPs (`formulas.model_flops_per_token`) / (step time ×
peak × GPUs).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from fivefold import formulas
from fivefold.comm import CommLog
from fivefold.config import Config, ConfigError
from fivefold.data_parallel.mixed_precision import MixedPrecision
from fivefold.mesh import ParallelDims
from fivefold.models.llama import Llama, LlamaConfig, count_params
from fivefold.models.parallelize import PipelinedModel, WholeModel, parallelize
from fivefold.pipeline.simulator import simulate
from fivefold.train.validate import RunPlan, validate_layout

__all__ = ["HARDWARE", "Hardware", "LayoutPlan", "PlanningMesh", "RankMemory", "candidate_layouts", "local_numels",
           "plan_layout", "rank_memory", "rank_parts", "rank_traffic", "search"]

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Defaults: an H100 SXM as seed 003 §2.2 gives it (NVLink 900 GB/s, InfiniBand NDR
    50 GB/s per GPU), bf16 dense peak 989 TFLOP/s, 80 GB."""

    name: str = "H100-80GB"
    memory_gb: float = 80.0
    peak_tflops: float = 989.0
    intra_node_gbps: float = 900.0
    inter_node_gbps: float = 50.0
    gpus_per_node: int = 8
    hbm_gbps: float = 3350.0  # the optimizer step streams its states through memory
    compute_efficiency: float = 0.6  # the fraction of peak the model's matmuls reach (an assumption: set it)


HARDWARE = {"h100": Hardware(), "h200": Hardware(name="H200-141GB", memory_gb=141.0, hbm_gbps=4800.0),
            "a100": Hardware(name="A100-80GB", peak_tflops=312.0, intra_node_gbps=300.0, inter_node_gbps=25.0,
                             hbm_gbps=2039.0),
            "h800": Hardware(name="H800-80GB", intra_node_gbps=400.0)}


class _StandIn:
    """A process group that is not there: its size and this rank's place in it, on the meta device. The assembly
    only reads these while building; no collective is ever issued through it."""

    def __init__(self, dim: str, size: int, rank: int = 0) -> None:
        self.dim, self.size, self.rank = dim, size, rank
        self.device = torch.device("meta")
        self.log = CommLog(enabled=False)

    def p2p_semantics(self) -> str:
        return "rendezvous"

    def scalar(self, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.tensor(value, dtype=dtype, device="meta")


class PlanningMesh:
    """`fivefold.mesh.ParallelMesh`'s sizes and ranks without processes: ``coords`` places this rank (0 elsewhere)."""

    def __init__(self, dims: ParallelDims, coords: dict[str, int] | None = None) -> None:
        self.dims, self.coords = dims, dict(coords or {})

    def size(self, dim: str) -> int:
        return self.dims.size(dim)

    def rank(self, dim: str) -> int:
        """A mesh dimension's coordinate, or this rank's place in a derived group (as `ParallelMesh` makes them: the
        dp × cp row in (dp, cp) order, cut into blocks of ep / dp_shard consecutive ranks and their columns)."""
        if dim in ("pp", "dp", "cp", "tp"):
            return self.coords.get(dim, 0)
        i = self._row_index
        d = self.dims
        return {"dp_cp": i, "ep": i % d.ep, "ep_dp": i // d.ep, "dp_shard": i % d.size("dp_shard"),
                "dp_replicate": i // d.size("dp_shard")}[dim]

    @property
    def _row_index(self) -> int:
        return self.coords.get("dp", 0) * self.dims.cp + self.coords.get("cp", 0)

    def comm(self, dim: str) -> _StandIn:
        return _StandIn(dim, self.size(dim), self.rank(dim))

    def backward_comm(self, dim: str) -> _StandIn:
        return self.comm(dim)

    def hpz_comm(self, size: int) -> _StandIn:
        return _StandIn("dp_hpz", size, self._row_index % size)

    @property
    def world(self) -> _StandIn:
        return _StandIn("world", self.dims.world_size)


def rank_parts(cfg: Config, run: RunPlan, pp_rank: int = 0,
               coords: dict[str, int] | None = None) -> WholeModel | PipelinedModel:
    """What `parallelize` builds on pipeline rank `pp_rank` (rank 0 of every other dimension unless `coords` says:
    dp rank 0 holds the most of a padded shard), on the meta device."""
    cfg = _resolved(cfg, run)
    return parallelize(cfg, run.model, PlanningMesh(run.dims, {**(coords or {}), "pp": pp_rank}), "meta")


def _resolved(cfg: Config, run: RunPlan) -> Config:
    cfg = dataclasses.replace(cfg)
    cfg.train = dataclasses.replace(cfg.train, global_batch=run.global_batch, micro_batch=run.micro_batch,
                                    grad_accum=run.grad_accum)
    return cfg


# -- memory ---------------------------------------------------------------------------------------------------------

@dataclass
class RankMemory:
    """One pipeline rank's bytes (every dp / tp / cp / ep rank of it alike, dp rank 0 holding the most)."""

    pp_rank: int
    params: int  # parameters this rank's share of the model has, before ZeRO shards them (its stages, TP slice)
    model_states: dict[str, int]  # params / grads / optimizer / total on the device; host (offloaded)
    transient: dict[str, int]  # buffers alive at the backward's peak on top of the model states
    activations: dict[str, int]  # kept for backward at the peak (blocks × micro-batches in flight, ends)
    total: int = 0

    def __post_init__(self) -> None:
        self.total = (self.model_states["total"] - self.model_states.get("host", 0) + sum(self.transient.values())
                      + sum(self.activations.values()))


def _engine_states(engine: Any, cfg: Config) -> dict[str, int]:
    mp = MixedPrecision.from_names(cfg.precision.param, cfg.precision.reduce)
    pb, gb = mp.param_dtype.itemsize, mp.grad_dtype.itemsize
    hpz = cfg.zero.hpz if engine.zero_stage == 3 and engine._zeropp_gather["secondary"] is not None else 0
    out = {"params": 0, "grads": 0, "optimizer": 0, "host": 0}
    for f in engine.flats:
        owned = sum(b - a for _, a, b in f.segments)
        part = formulas.flat_model_state_bytes(
            f.layout.padded_numel, f.shard_numel, owned, len(f.segments), stage=engine.zero_stage, param_bytes=pb,
            grad_bytes=gb, separate_master=mp.param_dtype != torch.float32, hpz=hpz, offload=f.offload)
        for k in out:
            out[k] += part[k]
    return out


def _transient(engine: Any, cfg: Config, accumulating: bool, reductions: int) -> dict[str, int]:
    """Buffers that come and go during a step, at the backward's peak: ZeRO-2/3's full gradient buffers (at most
    ``inflight_buckets`` launched and one filling; all of them while gradients accumulate unreduced: ``no_sync``
    under pp or ``defer_reduce``), ZeRO-3's gathered units (the root, the unit in use and ``prefetch`` ahead; all of
    them without ``reshard_after_forward``) and the unit's gradients before they are copied into its bucket."""
    z, stage = cfg.zero, engine.zero_stage
    mp = MixedPrecision.from_names(cfg.precision.param, cfg.precision.reduce)
    pb, gb = mp.param_dtype.itemsize, mp.grad_dtype.itemsize
    sizes = sorted((f.layout.padded_numel for f in engine.flats), reverse=True)
    out: dict[str, int] = {}
    if stage >= 2 and engine.comm.size > 1:
        n = len(sizes) if accumulating else z.inflight_buckets + 1
        out["gradient buckets"] = sum(sizes[:n]) * gb
        if reductions > 1:  # a later reduction's reduce-scatter lands in a temporary added to the shard
            shards = sorted((f.shard_numel for f in engine.flats), reverse=True)
            out["reduce-scatter outputs"] = sum(shards[:z.inflight_buckets]) * gb
    if stage in (1, 2) and engine.comm.size > 1:  # autograd's gradient before the hook copies it into its bucket
        out["parameter gradient"] = max(p.numel() for f in engine.flats for p in f.params) * pb
    if stage == 3 and engine.comm.size > 1:
        units = [(module is engine.module, f.layout.padded_numel) for module, f in engine.fsdp.units]
        root = sum(n for is_root, n in units if is_root)  # gathered around all its children
        others = sorted((n for is_root, n in units if not is_root), reverse=True)
        gathered = sum(n for _, n in units) if not z.reshard_after_forward else root + sum(others[:1 + z.prefetch])
        out["gathered units"] = gathered * pb
        out["unit gradients"] = sizes[0] * pb
    return out


def _block_bytes(cfg: Config, run: RunPlan, block: Any, recompute: str) -> int:
    """`formulas.activation_bytes_per_block` for one block of this rank (an MoE block with its feed-forward's)."""
    m, t, p = run.model, cfg.train, run.dims
    seq = t.seq_len // p.cp
    ffn = None
    moe = m.moe if getattr(block.feed_forward, "router", None) is not None else None
    if moe is not None and recompute != "full":
        hidden = moe.hidden or m.ffn_hidden
        ffn = formulas.moe_ffn_activation_bytes(run.micro_batch * seq, m.dim, moe.experts, moe.top_k, hidden,
                                                moe.shared_experts * hidden, dtype_bytes=_param_bytes(cfg))
    return formulas.activation_bytes_per_block(
        run.micro_batch, seq, m.dim, m.n_heads, m.n_kv_heads, m.ffn_hidden, dtype_bytes=_param_bytes(cfg),
        attention=cfg.model.attention if p.cp == 1 else "sdpa", recompute=recompute, tp=p.tp,
        sp=cfg.parallel.sp and p.tp > 1, ffn_bytes=ffn)


def _param_bytes(cfg: Config) -> int:
    return MixedPrecision.from_names(cfg.precision.param).param_dtype.itemsize


def _activations(cfg: Config, run: RunPlan, parts: Any, pp_rank: int) -> dict[str, int]:
    """Bytes kept for backward at the peak: every block of this rank × the micro-batches its stage has in flight
    (the simulator's count; 1 without pp), the embedding's output on the first stage (under full recompute it is
    the first block's kept input, counted there), the head and loss on the last; and, with recompute, the one
    block whose discarded part lives again while its backward runs."""
    m, t, p = run.model, cfg.train, run.dims
    s = _param_bytes(cfg)
    seq = t.seq_len // p.cp
    sp = cfg.parallel.sp and p.tp > 1
    if isinstance(parts, PipelinedModel):
        stages, n_stages = parts.stages, parts.schedule.n_stages
        in_flight, pending = _in_flight(parts.schedule, pp_rank)
    else:
        stages, in_flight, pending, n_stages = {0: parts.module}, 1, 0, 1
    blocks = [b for stage in stages.values() for b in (stage.layers.values() if stage.layers is not None else ())]
    # in flight counts (stage, micro-batch) pairs: with V chunks a rank's blocks are spread over V of them
    per_chunk = in_flight / len(stages)
    out: dict[str, int] = {"blocks": int(sum(_block_bytes(cfg, run, b, t.recompute) for b in blocks) * per_chunk)}
    if pending:  # zero-bubble: between I and W a block keeps only what its weight gradients need
        m_ffn = m.moe.top_k * (m.moe.hidden or m.ffn_hidden) if m.moe is not None else m.ffn_hidden
        w = [formulas.weight_grad_pending_bytes(
            run.micro_batch, seq, m.dim, m.n_heads, m.n_kv_heads,
            m_ffn if getattr(b.feed_forward, "router", None) is not None else m.ffn_hidden, dtype_bytes=s, tp=p.tp)
            for b in blocks]
        out["blocks awaiting W"] = int(sum(x["inputs"] for x in w) * pending / len(stages))
        out[W_GRADS] = int(sum(x["grads"] for x in w) * pending / len(stages))
    if 0 in stages and t.recompute != "full":
        out["embedding"] = int(run.micro_batch * (seq // p.tp if sp else seq) * m.dim * s * per_chunk)
    if n_stages - 1 in stages:
        out["head and loss"] = formulas.head_activation_bytes(run.micro_batch, seq, m.dim, m.vocab_size,
                                                              dtype_bytes=s, tp=p.tp, sp=sp)
    if t.recompute != "none" and blocks:
        out[RECOMPUTED] = max(_block_bytes(cfg, run, b, "none") - _block_bytes(cfg, run, b, t.recompute)
                              for b in blocks)
    return out


RECOMPUTED = "recomputed block (in its backward)"
W_GRADS = "output gradients awaiting W"  # allocated by I passes, not by forwards
BACKWARD_ALLOCATED = (RECOMPUTED, W_GRADS)


def _in_flight(schedule: Any, rank: int) -> tuple[int, int]:
    """(whole activations, activations awaiting W) of (stage, micro-batch) pairs on `rank` at the moment the
    simulated schedule holds the most, counting a pair whole from its F's start to its B's or I's end, then (I)
    pending until its W's end; the most is taken with a pending pair worth half a whole one (the block formulas'
    ratio is ~0.4), ties to more whole ones."""
    from fivefold.pipeline.actions import B, F, I, W

    changes: list[tuple[float, int, int, int]] = []
    for e in simulate(schedule).events[rank]:
        if e.kind == F:
            changes.append((e.start, 1, +1, 0))
        elif e.kind == B:
            changes.append((e.end, 0, -1, 0))
        elif e.kind == I:
            changes.append((e.end, 0, -1, +1))
        elif e.kind == W:
            changes.append((e.end, 0, 0, -1))
    whole = pending = 0
    best = (0, 0)
    for _, _, dw, dp in sorted(changes):
        whole, pending = whole + dw, pending + dp
        if 2 * whole + pending > 2 * best[0] + best[1]:
            best = (whole, pending)
    return best


def local_numels(parts: Any) -> dict[Any, dict[str, int]]:
    """Per stage (0 without pp), this rank's parameters and their element counts (its TP slice, its experts),
    read from the engines' flat layouts: under ZeRO-3 the modules' parameters are empty stand-ins."""
    stages = parts.stages if isinstance(parts, PipelinedModel) else {0: parts.module}
    engines = parts.engines.items() if isinstance(parts, PipelinedModel) else ((0, e) for e in parts.engines.values())
    out: dict[Any, dict[str, int]] = {sid: {} for sid in stages}
    for key, engine in engines:
        sid = key[0] if isinstance(key, tuple) else 0
        for f in engine.flats:
            out[sid].update({slot.name: slot.numel for slot in f.layout.slots})
    return out


def rank_memory(cfg: Config, run: RunPlan, pp_rank: int, parts: Any | None = None) -> RankMemory:
    cfg = _resolved(cfg, run)
    parts = parts if parts is not None else rank_parts(cfg, run, pp_rank)
    states = {"params": 0, "grads": 0, "optimizer": 0, "host": 0}
    transient: dict[str, int] = {}
    accumulating = run.dims.pp > 1 or (cfg.zero.defer_reduce and run.grad_accum > 1)
    reductions = 1 if accumulating else run.grad_accum
    for engine in parts.engines.values():
        for k, v in _engine_states(engine, cfg).items():
            states[k] += v
        for k, v in _transient(engine, cfg, accumulating, reductions).items():
            transient[k] = transient.get(k, 0) + v
    states["total"] = states["params"] + states["grads"] + states["optimizer"]
    # the modules' own buffers (RoPE tables; this rank's positions under cp): not model states, held all along
    transient["model buffers"] = sum(b.numel() * b.element_size() for m in parts.modules() for b in m.buffers())
    held = sum(sum(n.values()) for n in local_numels(parts).values())
    return RankMemory(pp_rank, held, states, transient, _activations(cfg, run, parts, pp_rank))


# -- traffic ------------------------------------------------------------------------------------------------------

def _add(out: dict[str, dict[str, int]], dim: str, op: str, nbytes: int) -> None:
    if nbytes:
        out.setdefault(dim, {})
        out[dim][op] = out[dim].get(op, 0) + int(nbytes)


def _engine_traffic(out: dict[str, dict[str, int]], engine: Any, cfg: Config, run: RunPlan) -> None:
    """ZeRO's collectives per step (seed 001 §5.5, seed 003 §4.3): per gradient reduction an all-reduce (stage 0) or
    reduce-scatter (1-3; qgZ: an int8 all-to-all) of every bucket, HSDP's all-reduce of the shard across replicas;
    ZeRO-1/2's all-gather of the updated parameters once per step; ZeRO-3's all-gathers of every unit in each
    forward and again in each backward (qwZ: int8; hpZ: the backward's inside ``dp_hpz``). A step reduces once under
    pp (``no_sync`` over the micro-batches) or ``defer_reduce``, else after each of the ``grad_accum`` backwards."""
    z, dim, n = cfg.zero, engine.comm.dim, engine.comm.size
    if n == 1 and engine.replicate is None:
        return
    mp = MixedPrecision.from_names(cfg.precision.param, cfg.precision.reduce)
    pb, gb = mp.param_dtype.itemsize, mp.grad_dtype.itemsize
    padded = [f.layout.padded_numel for f in engine.flats]
    reductions = 1 if run.dims.pp > 1 or z.defer_reduce else run.grad_accum
    stage = engine.zero_stage
    if n > 1:
        if stage == 0:
            _add(out, dim, "all_reduce", reductions * sum(padded) * gb)
        elif engine.qgz:
            _add(out, dim, "all_to_all", reductions * formulas.zero_grad_reduce_bytes(padded, n, gb, z.quant_block))
        else:
            _add(out, dim, "reduce_scatter", reductions * formulas.zero_grad_reduce_bytes(padded, n, gb))
    if engine.replicate is not None:
        _add(out, engine.replicate.dim, "all_reduce", reductions * sum(padded) // n * gb)
    if n > 1 and stage in (1, 2):
        _add(out, dim, "all_gather", sum(padded) * pb)
    if n > 1 and stage == 3:
        forwards = run.grad_accum
        block = z.quant_block if z.qwz else None
        _add(out, dim, "all_gather", forwards * formulas.zero3_gather_bytes(padded, n, pb, block))
        if z.reshard_after_forward:
            hpz = engine._zeropp_gather["secondary"]
            if hpz is not None:
                _add(out, "dp_hpz", "all_gather", forwards * formulas.zero3_gather_bytes(padded, hpz.size, pb))
            else:
                _add(out, dim, "all_gather", forwards * formulas.zero3_gather_bytes(padded, n, pb, block))


def _norm_traffic(out: dict[str, dict[str, int]], parts: Any, cfg: Config, run: RunPlan) -> None:
    """The global gradient norm (`optim.clip.global_grad_sq_norm`): one small fp32 all-reduce per partitioned
    dimension of size > 1, innermost first, of the 2^(k-1-i) squared sums still holding dimension i."""
    from fivefold.optim.clip import DIM_ORDER

    fp16 = cfg.precision.param == "fp16"
    if not (cfg.train.grad_clip > 0 or cfg.train.check_finite or fp16):
        return
    dims = {d for d in ("tp", "pp", "ep") if run.dims.size(d) > 1}
    dims |= {e.comm.dim for e in parts.engines.values() if e.zero_stage >= 1 and e.comm.size > 1}
    ordered = sorted(dims, key=lambda d: (DIM_ORDER.index(d) if d in DIM_ORDER else len(DIM_ORDER), d))
    k = len(ordered)
    for i, d in enumerate(ordered):
        _add(out, d, "all_reduce", 4 * 2 ** (k - 1 - i))


def _model_traffic(out: dict[str, dict[str, int]], parts: Any, cfg: Config, run: RunPlan, pp_rank: int) -> None:
    """What the model's own layers send per step on this rank: TP/SP (`formulas.tp_comm_formula` for its blocks;
    seed 003 §7.2, §8.2), ring attention's K/V (seed 003 §10.1), expert all-to-alls and the load-balancing sums
    (seed 003 §11.2), and the pipeline's activations and gradients (seed 003 §9.6)."""
    m, t, d = run.model, cfg.train, run.dims
    s = MixedPrecision.from_names(cfg.precision.param).param_dtype.itemsize
    stages = parts.stages if isinstance(parts, PipelinedModel) else {0: parts.module}
    n_stages = parts.schedule.n_stages if isinstance(parts, PipelinedModel) else 1
    M, B, seq = run.grad_accum, run.micro_batch, t.seq_len // d.cp
    again = t.recompute == "full"  # a recomputed block runs its forward collectives again
    for sid, stage in stages.items():
        blocks = list(stage.layers.values()) if stage.layers is not None else []
        if d.tp > 1:
            shape = _Shape(len(blocks), m.dim)
            tp = formulas.tp_comm_formula(shape, B, seq, cfg.parallel.sp, s, t.recompute)
            ends = _tp_ends(B, seq, m.dim, s, cfg.parallel.sp, first=sid == 0, last=sid == n_stages - 1)
            for op, nbytes in tp.items():
                _add(out, "tp", op, M * (nbytes - ends.get(op, 0)))
        if d.cp > 1:
            ring = formulas.ring_attention_p2p_elements(B, t.seq_len, m.n_kv_heads, m.head_dim, d.cp)
            per_block = (ring["forward_kv"] * (2 if again else 1) + ring["backward_kv"] + ring["backward_dkv"]) * s
            _add(out, "cp", "send", M * per_block * len(blocks))
            _add(out, "cp", "recv", M * per_block * len(blocks))
        moe_blocks = sum(1 for b in blocks if getattr(b.feed_forward, "router", None) is not None)
        if moe_blocks and m.moe is not None:
            runs = 2 if again else 1
            rows = B * seq * m.moe.top_k  # dispatched rows per micro-batch; received ones equal it on average
            if d.ep > 1:
                per_layer = runs * (m.moe.experts * 8 + 2 * rows * m.dim * s) + 2 * rows * m.dim * s
                _add(out, "ep", "all_to_all", M * moe_blocks * per_layer)
            balance = parts.loss_comm
            if balance.size > 1:
                _add(out, balance.dim, "all_reduce", M * moe_blocks * runs * (m.moe.experts + 1) * 4)
    if isinstance(parts, PipelinedModel):
        from fivefold.pipeline.actions import SEND_B, SEND_F
        from fivefold.pipeline.lowering import lower

        sends = sum(1 for a in lower(parts.schedule).actions[pp_rank] if a.kind in (SEND_F, SEND_B))
        message = B * (seq // d.tp if cfg.parallel.sp else seq) * m.dim * s
        _add(out, "pp", "send", sends * message)
        _add(out, "pp", "recv", sends * message)


@dataclass(frozen=True)
class _Shape:
    n_layers: int
    dim: int


def _tp_ends(batch: int, seq: int, dim: int, s: int, sp: bool, first: bool, last: bool) -> dict[str, int]:
    """The parts of `formulas.tp_comm_formula` that belong to the model's ends, for a pipeline stage without them:
    the embedding's exit (one B·L·D), the head's entry (one B·L·D) and the loss's 3·B·L fp32 all-reduces, the final
    norm's weight-gradient all-reduce (SP, D)."""
    bld, bl = batch * seq * dim * s, batch * seq
    missing: dict[str, int] = {}
    if not sp:
        missing["all_reduce"] = (0 if first else bld) + (0 if last else bld + 3 * bl * s)
        return missing
    missing["all_gather"] = (0 if first else bld) + (0 if last else bld)
    missing["reduce_scatter"] = (0 if first else bld) + (0 if last else bld)
    missing["all_reduce"] = 0 if last else 3 * bl * s + dim * s
    return missing


def rank_traffic(cfg: Config, run: RunPlan, pp_rank: int, parts: Any | None = None) -> dict[str, dict[str, int]]:
    """Payload bytes per step on one rank of pipeline rank `pp_rank`, by mesh dimension and collective (as
    `CommLog` records them: an all-gather's output, a reduce-scatter's or all-to-all's input, a send's tensor)."""
    cfg = _resolved(cfg, run)
    parts = parts if parts is not None else rank_parts(cfg, run, pp_rank)
    out: dict[str, dict[str, int]] = {}
    _model_traffic(out, parts, cfg, run, pp_rank)
    for engine in parts.engines.values():
        _engine_traffic(out, engine, cfg, run)
    _norm_traffic(out, parts, cfg, run)
    return out


# -- time ---------------------------------------------------------------------------------------------------------

# Where each mesh dimension's group lies with tp innermost (world = pp × dp × cp × tp, consecutive ranks in a node):
# how many consecutive ranks a group spans (`ParallelMesh`'s layout); a group spanning at most one node's GPUs is
# intra-node.
def group_span(dim: str, dims: ParallelDims, hpz: int = 1) -> int:
    d = dims
    inner = {"tp": 1, "cp": d.tp, "dp": d.tp * d.cp, "pp": d.tp * d.cp * d.dp}
    if dim in inner:
        return inner[dim] * d.size(dim) if dim != "tp" else d.tp
    row = d.tp * d.cp * d.dp  # a dp × cp row (strided by tp)
    return {"dp_cp": row, "ep": d.tp * d.ep, "ep_dp": row, "dp_shard": d.tp * d.size("dp_shard"),
            "dp_replicate": row, "dp_hpz": d.tp * hpz}.get(dim, d.world_size)


def link_gbps(dim: str, dims: ParallelDims, hw: Hardware, hpz: int = 1) -> float:
    return hw.intra_node_gbps if group_span(dim, dims, hpz) <= hw.gpus_per_node else hw.inter_node_gbps


def wire_seconds(traffic: dict[str, dict[str, int]], dims: ParallelDims, hw: Hardware, hpz: int = 1,
                 only: tuple[str, ...] | None = None) -> dict[str, float]:
    """Seconds each dimension's traffic takes on its link: ring wire bytes (`formulas.ring_wire_bytes`) over the
    group's bandwidth (a point-to-point message: its bytes)."""
    out = {}
    for dim, ops in traffic.items():
        if only is not None and dim not in only:
            continue
        size = dims.size(dim) if dim not in ("dp_hpz",) else hpz
        wire = sum(formulas.ring_wire_bytes(op, b, size) for op, b in ops.items() if op != "recv")
        out[dim] = wire / (link_gbps(dim, dims, hw, hpz) * GB)
    return out


def _stage_flops(cfg: Config, run: RunPlan, stage: Any, stage_numels: dict[str, int]) -> tuple[float, float]:
    """(forward, backward) FLOPs of one micro-batch through one stage on one rank: 2 (forward) and 4 (backward) per
    active parameter and token it computes (embeddings are lookups; an MoE block's tokens go through top_k experts),
    plus attention's 4·L·D (forward) and 8·L·D (backward) per token and block (`formulas.model_flops_per_token`'s
    split), over tp; full recompute runs the forward again in backward, selective the attention core."""
    m, t, d = run.model, cfg.train, run.dims
    tokens = run.micro_batch * t.seq_len / d.cp
    active = 0.0
    for name, numel in stage_numels.items():
        if "tok_embeddings" in name:
            continue
        if ".experts." in name:  # this rank's experts see (on average) top_k/experts-per-rank of the rows each
            active += numel * m.moe.top_k * d.ep / m.moe.experts
        else:
            active += numel
    blocks = len(stage.layers) if stage.layers is not None else 0
    attn = blocks * t.seq_len * m.dim / d.tp
    forward = 2 * active * tokens + 4 * attn * tokens
    backward = 2 * forward
    if t.recompute == "full":
        backward += forward
    elif t.recompute == "selective":
        backward += 4 * attn * tokens
    return forward, backward


def _step_time(cfg: Config, run: RunPlan, hw: Hardware, parts_by_rank: dict[int, Any],
               traffic: dict[int, dict[str, dict[str, int]]], memory: dict[int, RankMemory]) -> tuple[dict, float]:
    """Seconds of one step by part, and the simulated bubble (pp > 1)."""
    d, M = run.dims, run.grad_accum
    flops_per_s = hw.peak_tflops * 1e12 * hw.compute_efficiency
    hpz = cfg.zero.hpz if cfg.zero.hpz > 1 else 1
    stage_cost: dict[int, tuple[float, float]] = {}  # virtual stage -> (F, B) seconds per micro-batch, comm included
    stage_compute: dict[int, float] = {}  # virtual stage -> F + B seconds of compute alone
    blocking: dict[int, float] = {}
    for r, parts in parts_by_rank.items():
        wire = wire_seconds(traffic[r], d, hw, hpz, only=("tp", "cp", "ep"))
        stages = parts.stages if isinstance(parts, PipelinedModel) else {0: parts.module}
        numels = local_numels(parts)
        # ring attention sends the next K/V block while the current one is computed: only what outlasts the
        # attention's own compute waits (TP's collectives and the expert all-to-alls block)
        blocks = sum(len(st.layers) if st.layers is not None else 0 for st in stages.values())
        attention = 12 * blocks * cfg.train.seq_len * run.model.dim / d.tp * run.micro_batch * cfg.train.seq_len \
            / d.cp * M / flops_per_s
        comm = (wire.get("tp", 0.0) + wire.get("ep", 0.0) + max(0.0, wire.get("cp", 0.0) - attention)) / M
        blocking[r] = comm * M
        for sid, stage in stages.items():
            f, b = _stage_flops(cfg, run, stage, numels[sid])
            share = comm / len(stages)
            stage_cost[sid] = (f / flops_per_s + share / 3, b / flops_per_s + 2 * share / 3)
            stage_compute[sid] = (f + b) / flops_per_s
    bubble = None
    if d.pp > 1:
        schedule = next(iter(parts_by_rank.values())).schedule
        from fivefold.pipeline.actions import B, F, I, W

        def cost(a: Any) -> float:
            f, b = stage_cost.get(a.stage, max(stage_cost.values()))
            return {F: f, B: b, I: b / 2, W: b / 2}[a.kind]

        timeline = simulate(schedule, cost)
        pipeline, bubble = timeline.makespan, timeline.bubble_fraction
        compute = max(sum(stage_compute[s] for s in schedule.stages_of(r)) * M
                      for r in range(d.pp) if all(s in stage_compute for s in schedule.stages_of(r)))
    else:
        f, b = stage_cost[0]
        pipeline, compute = M * (f + b), M * stage_compute[0]
    # data-parallel traffic: hidden behind the backward where the buckets overlap it (pp = 1), after the flush (pp > 1)
    dp_dims = [dim for dim in traffic[0] if dim not in ("tp", "cp", "ep", "pp")]
    worst = max(parts_by_rank, key=lambda r: sum(wire_seconds(traffic[r], d, hw, hpz, only=tuple(dp_dims)).values()))
    dp_time = sum(wire_seconds(traffic[worst], d, hw, hpz, only=tuple(dp_dims)).values())
    z = cfg.zero
    after_step = 0.0
    if z.stage in (1, 2):  # the updated shards' all-gather runs after the optimizer
        engines = parts_by_rank[worst].engines.values()
        gathered = {e.comm.dim: sum(f.layout.padded_numel for f in e.flats) * _param_bytes(cfg) for e in engines
                    if e.comm.size > 1}
        after_step = sum(wire_seconds({k: {"all_gather": v}}, d, hw).get(k, 0.0) for k, v in gathered.items())
    overlappable = dp_time - after_step
    backward = sum(b for _, b in stage_cost.values()) * M / max(1, len(stage_cost)) * (1 if d.pp == 1 else 0)
    forward = sum(f for f, _ in stage_cost.values()) * M / max(1, len(stage_cost)) * (1 if d.pp == 1 else 0)
    window = backward + (forward if z.stage == 3 else 0.0)
    exposed = after_step + max(0.0, overlappable - window)
    states = memory[worst].model_states
    optimizer = 2 * (states["optimizer"] + states["grads"]) / (hw.hbm_gbps * GB)
    time = {"compute": compute, "pipeline (with tp/cp/ep traffic and bubble)": pipeline,
            "tp/cp/ep traffic not hidden": max(blocking.values()), "data-parallel traffic": dp_time,
            "data-parallel exposed": exposed, "optimizer": optimizer}
    time["step"] = pipeline + exposed + optimizer
    return time, bubble


# -- the plan -------------------------------------------------------------------------------------------------------

@dataclass
class LayoutPlan:
    layout: str
    world: int
    dims: ParallelDims
    model: LlamaConfig
    params: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    ranks: list[RankMemory]
    hardware: Hardware
    traffic_rank: int = 0  # the pipeline rank whose traffic `traffic` shows (the busiest)
    model_name: str = ""
    precision: str = ""
    traffic: dict[str, dict[str, Any]] = field(default_factory=dict)
    bubble: float | None = None
    time: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(r.total for r in self.ranks)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hardware.memory_gb * GB

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dims"] = dataclasses.asdict(self.dims)
        out["model"] = {k: v for k, v in dataclasses.asdict(self.model).items() if k != "rope_scaling"}
        out["peak_bytes"], out["fits"] = self.peak_bytes, self.fits
        return out


def plan_layout(cfg: Config, world: int, hardware: Hardware = Hardware(),
                pp_ranks: tuple[int, ...] | None = None, parts_cache: dict | None = None) -> LayoutPlan:
    """Predict memory per pipeline rank, traffic per dimension, bubble and step time of `cfg` on `world` GPUs; a
    `ConfigError` names what does not divide (the trainer's own checks, `validate_layout`). ``pp_ranks``: the
    pipeline ranks to lay out (default all; `search` looks at the first and the last, which hold the most)."""
    run = validate_layout(cfg, world)
    cfg = _resolved(cfg, run)
    chosen = range(run.dims.pp) if pp_ranks is None else sorted({r % run.dims.pp for r in pp_ranks})
    # the assembly does not depend on the recompute mode (only the activation formulas do): `search` reuses it
    key = repr({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "recompute": None}})
    cached = parts_cache.get(key) if parts_cache is not None else None
    parts = cached if cached is not None else {r: rank_parts(cfg, run, r) for r in chosen}
    if parts_cache is not None:
        parts_cache.clear()  # one layout at a time: the candidates come grouped
        parts_cache[key] = parts
    memory = {r: rank_memory(cfg, run, r, parts[r]) for r in chosen}
    traffic = {r: rank_traffic(cfg, run, r, parts[r]) for r in chosen}
    time, bubble = _step_time(cfg, run, hardware, parts, traffic, memory)
    model = run.model
    params = count_params(Llama(model, device="meta"))
    tokens = run.global_batch * cfg.train.seq_len
    flops = formulas.model_flops_per_token(_active_params(model), model.n_layers, cfg.train.seq_len, model.dim)
    time["tokens/s"] = tokens / time["step"]
    time["MFU"] = flops * tokens / (time["step"] * world * hardware.peak_tflops * 1e12)
    busiest = max(traffic, key=lambda r: sum(sum(ops.values()) for ops in traffic[r].values()))
    hpz = cfg.zero.hpz if cfg.zero.hpz > 1 else 1
    by_dim = {dim: {"ops": ops, "payload_bytes": sum(ops.values()),
                    "wire_bytes": sum(formulas.ring_wire_bytes(op, b, run.dims.size(dim) if dim != "dp_hpz" else hpz)
                                      for op, b in ops.items() if op != "recv"),
                    "group": run.dims.size(dim) if dim != "dp_hpz" else hpz,
                    "link": "intra-node" if group_span(dim, run.dims, hpz) <= hardware.gpus_per_node else "inter-node"}
              for dim, ops in traffic[busiest].items()}
    notes = list(run.notes)
    if run.dims.pp == 1 and run.grad_accum > 1 and not cfg.zero.defer_reduce and run.dims.size("dp_cp") > 1:
        notes.append(f"gradients are reduced after each of the {run.grad_accum} micro-batches; --zero.defer_reduce "
                     "true reduces once per step (ZeRO-2/3 then hold full gradients until the last micro-batch)")
    if cfg.zero.stage == 3 and not cfg.zero.reshard_after_forward:
        notes.append("zero.reshard_after_forward false: the units stay gathered from forward to backward (2Ψ of "
                     "gathers instead of 3Ψ, every unit's parameters held at once)")
    return LayoutPlan(_describe(cfg, run), world, run.dims, model, params, run.micro_batch, run.grad_accum,
                      run.global_batch, cfg.train.seq_len, list(memory.values()), hardware, busiest,
                      cfg.model.init_from or cfg.model.preset, f"{cfg.precision.param} params, {cfg.precision.reduce} "
                      "gradient reduction", by_dim, bubble, time, notes=notes)


def _active_params(model: LlamaConfig) -> int:
    """Parameters one token goes through, embeddings excluded (MoE: top_k of the experts)."""
    meta = Llama(model, device="meta")
    total = 0
    for name, p in meta.named_parameters():
        if name.startswith("tok_embeddings"):
            continue
        total += p.numel() * (model.moe.top_k / model.moe.experts if ".experts." in name else 1)
    return int(total)


def _describe(cfg: Config, run: RunPlan) -> str:
    d, z = run.dims, cfg.zero
    parts = [f"tp {d.tp}" + ("+SP" if cfg.parallel.sp and d.tp > 1 else ""), f"pp {d.pp}", f"cp {d.cp}",
             f"dp {d.dp}", f"ZeRO-{z.stage}"]
    if d.ep > 1:
        parts.append(f"ep {d.ep}")
    if d.dp_replicate > 1:
        parts.append(f"HSDP {d.dp_replicate}×{d.size('dp_shard')}")
    if d.pp > 1:
        parts.append(cfg.pipeline.schedule + (f" V={cfg.pipeline.virtual}" if cfg.pipeline.virtual > 1 else ""))
    if cfg.train.recompute != "none":
        parts.append(f"recompute {cfg.train.recompute}")
    return ", ".join(parts)




# -- search ---------------------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(cfg: Config, world: int, hardware: Hardware) -> list[list[str]]:
    """Every (tp, pp, cp, ZeRO stage, recompute) for `world` GPUs that the trainer's checks accept, as overrides:
    tp within a node (a divisor of its GPU count) with SP, pp up to the number of blocks (1F1B; the micro-batches
    follow from the global batch), cp up to 16, dp the rest; ZeRO 0-3 (one stage when dp = 1), recompute none /
    selective / full. MoE: ep over the dp × cp ranks as far as the experts divide."""
    model_layers = validate_layout(cfg, 1).model.n_layers if world else 0
    out = []
    for tp in (t for t in _divisors(hardware.gpus_per_node) if world % t == 0):
        for pp in (p for p in _divisors(world // tp) if p <= model_layers):
            for cp in (c for c in _divisors(world // (tp * pp)) if c <= 16):
                dp = world // (tp * pp * cp)
                for stage in ((0, 1, 2, 3) if dp * cp > 1 else (0,)):
                    for recompute in ("none", "selective", "full"):
                        out.append(["--parallel.tp", str(tp), "--parallel.sp", str(tp > 1).lower(),
                                    "--parallel.pp", str(pp), "--parallel.cp", str(cp), "--parallel.dp", str(dp),
                                    "--zero.stage", str(stage), "--train.recompute", recompute,
                                    "--pipeline.schedule", "1f1b" if pp > 1 else cfg.pipeline.schedule,
                                    "--pipeline.virtual", "1"])
    return out


def search(cfg: Config, world: int, hardware: Hardware = Hardware(), top: int = 10,
           progress: Any = None) -> tuple[list[LayoutPlan], int, int]:
    """Every valid layout (`candidate_layouts`) planned on its first and last pipeline rank, those that fit ranked by
    estimated step time; returns (the best `top`, how many were valid, how many fit)."""
    from fivefold.config import apply_overrides

    plans, valid, cache = [], 0, {}
    candidates = candidate_layouts(cfg, world, hardware)
    for i, overrides in enumerate(candidates):
        trial = apply_overrides(copy.deepcopy(cfg), overrides)
        try:
            plan = plan_layout(trial, world, hardware, pp_ranks=(0, -1), parts_cache=cache)
        except (ConfigError, ValueError):
            continue
        finally:
            if progress is not None:
                progress(i + 1, len(candidates))
        valid += 1
        if plan.fits:
            plans.append(plan)
    plans.sort(key=lambda p: (round(p.time["step"], 6), p.peak_bytes))  # equal time: less memory first
    return plans[:top], valid, len(plans)


# -- output ---------------------------------------------------------------------------------------------------------

def _gb(nbytes: float) -> str:
    for unit, size in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes:,.0f} B"


def format_plan(plan: LayoutPlan) -> str:
    """The plan as a text report: per GPU memory by part (the pipeline ranks side by side), traffic per dimension,
    bubble, step time and MFU."""
    hw = plan.hardware
    lines = [f"fivefold plan: {plan.model_name} ({plan.params / 1e9:,.2f}B parameters) on {plan.world} × {hw.name} "
             f"({hw.gpus_per_node} per node)",
             f"layout: {plan.layout}",
             f"batch: global {plan.global_batch} × {plan.seq_len} tokens = micro {plan.micro_batch} × accum "
             f"{plan.grad_accum} × dp {plan.dims.dp}; precision {plan.precision}", ""]
    ranks = plan.ranks
    if len(ranks) > 6:  # the first three, the middle and the last two pipeline ranks (--json has them all)
        shown = sorted({0, 1, 2, len(ranks) // 2, len(ranks) - 2, len(ranks) - 1})
        worst = max(ranks, key=lambda r: r.total)
        ranks = [ranks[i] for i in sorted({*shown, ranks.index(worst)})]
    head = f"{'per GPU':48s}" + "".join(f"{'pp rank ' + str(r.pp_rank):>14s}" for r in ranks)
    lines += [head, "-" * len(head)]

    def row(label: str, values: list[float], gb: bool = True) -> None:
        lines.append(f"{label:48s}" + "".join(f"{(v / GB if gb else v):>14,.2f}" for v in values))

    row("parameters held (B)", [r.params / 1e9 for r in ranks], gb=False)
    for part in ("params", "grads", "optimizer"):
        row(f"model states: {part} (GB)", [r.model_states[part] for r in ranks])
    if any(r.model_states.get("host") for r in ranks):
        row("  of which in host memory (GB)", [r.model_states["host"] for r in ranks])
    for key in sorted({k for r in ranks for k in r.transient}):
        row(f"transient: {key} (GB)", [r.transient.get(key, 0) for r in ranks])
    for key in sorted({k for r in ranks for k in r.activations}):
        row(f"activations: {key.replace(' (in its backward)', '')} (GB)", [r.activations.get(key, 0) for r in ranks])
    row("total (GB)", [r.total for r in ranks])
    fits = "fits" if plan.fits else "DOES NOT FIT"
    lines += [f"{'GPU memory (GB)':48s}{hw.memory_gb:>14,.2f}   -> {fits} (peak {_gb(plan.peak_bytes)}"
              + (f"; {len(plan.ranks)} pipeline ranks, {len(ranks)} shown, all in --json)" if len(ranks) <
                 len(plan.ranks) else ")"), ""]
    where = f" (pp rank {plan.traffic_rank}, the busiest)" if len(plan.ranks) > 1 else ""
    lines.append(f"traffic per step and GPU{where}")
    lines.append(f"{'':20s}{'group':>7s}{'link':>12s}{'payload':>14s}{'ring wire':>14s}"
                 "   collectives")
    for dim, t in plan.traffic.items():
        ops = ", ".join(f"{op} {_gb(b)}" for op, b in t["ops"].items())
        lines.append(f"  {dim:18s}{t['group']:>7d}{t['link']:>12s}{_gb(t['payload_bytes']):>14s}"
                     f"{_gb(t['wire_bytes']):>14s}   {ops}")
    lines.append("")
    if plan.bubble is not None:
        lines.append(f"pipeline bubble (simulated schedule, these stage costs): {plan.bubble:.1%}")
    tm = plan.time
    lines += [f"estimated step: {tm['step']:.3f} s = pipeline {tm['pipeline (with tp/cp/ep traffic and bubble)']:.3f} "
              f"s (compute {tm['compute']:.3f} s at {hw.compute_efficiency:.0%} of {hw.peak_tflops:g} TFLOP/s, "
              f"tp/cp/ep traffic not hidden {tm['tp/cp/ep traffic not hidden']:.3f} s) + data-parallel traffic not "
              f"hidden {tm['data-parallel exposed']:.3f} s (of {tm['data-parallel traffic']:.3f} s) + optimizer "
              f"{tm['optimizer']:.3f} s",
              f"throughput ≈ {tm['tokens/s']:,.0f} tokens/s, MFU ≈ {tm['MFU']:.1%} (links: intra-node "
              f"{hw.intra_node_gbps:g} GB/s, inter-node {hw.inter_node_gbps:g} GB/s)"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def format_search(plans: list[LayoutPlan], valid: int, fitting: int, world: int, hardware: Hardware) -> str:
    lines = [f"fivefold plan --search: {valid} valid layouts for {world} × {hardware.name}, {fitting} fit in "
             f"{hardware.memory_gb:g} GB; the fastest by estimated step time:", ""]
    head = f"{'#':>3s}  {'layout':58s}{'peak GB':>9s}{'step s':>9s}{'tokens/s':>13s}{'MFU':>7s}{'bubble':>8s}"
    lines += [head, "-" * len(head)]
    for i, p in enumerate(plans, 1):
        bubble = f"{p.bubble:.1%}" if p.bubble is not None else "-"
        lines.append(f"{i:>3d}  {p.layout:58s}{p.peak_bytes / GB:>9.1f}{p.time['step']:>9.3f}"
                     f"{p.time['tokens/s']:>13,.0f}{p.time['MFU']:>7.1%}{bubble:>8s}")
    if not plans:
        lines.append("  none fits: more GPUs, a smaller micro-batch or sequence, or a GPU with more memory")
    return "\n".join(lines)
