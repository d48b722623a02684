"""`plan_layout`: one layout's plan — memory per pipeline rank, traffic per dimension, bubble, step
time, MFU."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fivefold import formulas
from fivefold.config import Config
from fivefold.context_parallel.layout import layout_for
from fivefold.distributed.mesh import ParallelDims
from fivefold.models.llama import LlamaConfig, param_counts
from fivefold.plan.assembly import Parts, precision_bytes, rank_parts, resolved, stages_of
from fivefold.plan.hardware import GB, HARDWARE, Hardware, link
from fivefold.plan.memory import RankMemory, block_bytes, rank_memory, runtime_bytes
from fivefold.plan.timing import step_time
from fivefold.plan.traffic import Transfer, by_dim, rank_transfers
from fivefold.run_plan import RunPlan, validate_layout

__all__ = ["LayoutPlan", "plan_layout"]

# The device a plan is for: `validate_layout` checks what it would refuse there (e.g. DualPipeV's
# overlap is CPU-only)
TARGET_DEVICE = "cuda"


@dataclass
class LayoutPlan:
    layout: str
    world: int
    dims: ParallelDims
    model: LlamaConfig
    model_name: str
    params: int
    precision: str
    micro_batch: int
    grad_accum: int
    global_batch: int
    seq_len: int
    ranks: list[
        RankMemory
    ]  # the pipeline ranks laid out (all, or the first and last under `search`)
    hardware: Hardware
    block_bytes: int  # what one block of the first stage keeps for backward
    traffic_rank: int  # the pipeline rank whose traffic `traffic` shows (the busiest)
    traffic: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # dim -> ops, payload, wire, group, link
    bubble: float | None = None
    time: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # `search`'s candidate as the overrides that make it (`--parallel.tp 2 ...`; [] for a layout
    # planned as given)
    overrides: list[str] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return max(r.total for r in self.ranks)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.hardware.memory_gb * GB

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dims"] = dataclasses.asdict(self.dims)
        out["model"] = {
            k: v for k, v in dataclasses.asdict(self.model).items() if k != "rope_scaling"
        }
        out["peak_bytes"], out["fits"] = self.peak_bytes, self.fits
        return out


def _dims_table(transfers: list[Transfer], run: RunPlan, hw: Hardware) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dim, ops in by_dim(transfers).items():
        mine = [t for t in transfers if t.dim == dim]
        where, _ = link(dim, run.dims, hw, mine[0].group)
        out[dim] = {
            "ops": ops,
            "payload_bytes": sum(ops.values()),
            "wire_bytes": sum(t.wire_bytes for t in mine),
            "group": mine[0].group,
            "link": where,
        }
    return out


def plan_layout(
    cfg: Config,
    world: int,
    hardware: Hardware = HARDWARE["h100"],
    pp_ranks: tuple[int, ...] | None = None,
    parts_cache: dict[str, dict[int, Parts]] | None = None,
) -> LayoutPlan:
    """Predict memory per pipeline rank, traffic per dimension, bubble and step time of `cfg` on
    `world` GPUs; the trainer's own checks name what does not divide (`validate_layout`, a
    ValueError). ``pp_ranks``: the pipeline ranks to lay out (default all; `search` takes the first
    and the last, which hold the most). ``parts_cache``: reuse the assembly across plans that differ
    only in the recompute mode."""
    hardware.check()
    if cfg.precision.fp8 != "off" and hardware.asynchronous and not hardware.fp8_peak_tflops:
        raise ValueError(
            f"precision.fp8={cfg.precision.fp8} on {hardware.name}: it has no FP8 tensor cores "
            "(Hopper or later have them); plan it on --hardware h100 / h200 / h800, or without "
            "precision.fp8"
        )
    run = validate_layout(cfg, world, device_type=TARGET_DEVICE)
    cfg = resolved(cfg, run)
    chosen = range(run.dims.pp) if pp_ranks is None else sorted({r % run.dims.pp for r in pp_ranks})
    key = repr({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "recompute": None}})
    parts = (parts_cache or {}).get(key) or {r: rank_parts(cfg, run, r) for r in chosen}
    if parts_cache is not None:
        parts_cache.clear()  # one layout at a time: `search` sends them grouped
        parts_cache[key] = parts
    memory = {r: rank_memory(cfg, run, r, parts[r]) for r in chosen}
    memory = {
        r: dataclasses.replace(m, runtime=runtime_bytes(m, run, cfg, hardware))
        for r, m in memory.items()
    }
    transfers = {r: rank_transfers(cfg, run, r, parts[r]) for r in chosen}
    time, bubble = step_time(cfg, run, hardware, parts, transfers, memory)
    model = run.model
    params, active = param_counts(model)
    tokens = run.global_batch * cfg.train.seq_len
    flops = formulas.model_flops_per_token(
        active, model.n_layers, cfg.train.seq_len, model.n_heads * model.head_dim
    )
    time["tokens/s"] = tokens / time["step"]
    time["MFU"] = flops * tokens / (time["step"] * world * hardware.peak_tflops * 1e12)
    busiest = max(transfers, key=lambda r: sum(t.nbytes for t in transfers[r]))
    first = next(iter(stages_of(parts[chosen[0]]).values()))
    one_block = (
        block_bytes(cfg, run, next(iter(first.layers.values())), cfg.train.recompute)
        if first.layers is not None and len(first.layers)
        else 0
    )
    return LayoutPlan(
        _describe(cfg, run),
        world,
        run.dims,
        model,
        cfg.model.init_from or cfg.model.preset,
        params,
        f"{cfg.precision.param} params, {cfg.precision.reduce} gradient reduction"
        + (f", FP8 {cfg.precision.fp8} linears" if cfg.precision.fp8 != "off" else "")
        + (", FP8 unit gathers" if cfg.zero.fp8_gather else "")
        + (", Muon on the matrices (whole-matrix owners)" if cfg.optim.name == "muon" else ""),
        run.micro_batch,
        run.grad_accum,
        run.global_batch,
        cfg.train.seq_len,
        list(memory.values()),
        hardware,
        one_block,
        busiest,
        _dims_table(transfers[busiest], run, hardware),
        bubble,
        time,
        notes=[*run.notes, *_advice(cfg, run, memory, transfers, hardware)],
    )


def _advice(
    cfg: Config,
    run: RunPlan,
    memory: dict[int, RankMemory],
    transfers: dict[int, list[Transfer]],
    hw: Hardware,
) -> list[str]:
    """What the plan suggests changing: reducing once per step; keeping ZeRO-3's units gathered from
    forward to backward (DeepSpeed's default, FSDP's reshard_after_forward=False) when every unit
    fits beside the rest in a device's memory (with the runtime's bytes, the allocator's reserve on
    the larger tensors)."""
    notes = []
    z = cfg.zero
    if z.stage == 3 and z.reshard_after_forward and run.dims.size("dp_shard") > 1:
        tensors = {
            r: m.tensors - m.transient.get("gathered units", 0) + _all_units_bytes(m, cfg)
            for r, m in memory.items()
        }
        kept = {
            r: t
            + int(t * hw.allocator_reserve)
            + int(hw.context_gb * 1e9)
            + sum(v for k, v in memory[r].runtime.items() if k.startswith("communicator"))
            for r, t in tensors.items()
        }
        device_bytes = hw.memory_gb * GB
        saved = max(
            sum(t.nbytes for t in moved if t.op == "all_gather" and t.phase == "backward")
            for moved in transfers.values()
        )
        if max(kept.values()) <= device_bytes and saved:
            notes.append(
                f"--zero.reshard_after_forward false fits (peak {max(kept.values()) / GB:,.1f} GB: "
                "every unit stays gathered from its forward to its backward) and saves the "
                f"backward's all-gathers, {saved / GB:,.2f} GB per step and GPU (2Ψ of gathers "
                "instead of 3Ψ)"
            )
    if (
        run.dims.pp == 1
        and run.grad_accum > 1
        and not cfg.zero.defer_reduce
        and run.dims.size("dp_cp") > 1
    ):
        notes.append(
            f"gradients are reduced after each of the {run.grad_accum} micro-batches; "
            "--zero.defer_reduce true reduces once per step (ZeRO-2/3 then hold full gradients "
            "until the last micro-batch)"
        )
    if cfg.train.recompute == "selective-op" and run.dims.cp > 1:
        notes.append(
            "recompute selective-op under cp: torch's selective checkpoint also keeps ring "
            "attention's per-step kernel outputs and the received K/V shards, which the blocks' "
            "bytes above do not price: this rank's activations are an underestimate"
        )
    if cfg.zero.stage == 3 and not cfg.zero.reshard_after_forward:
        notes.append(
            "zero.reshard_after_forward false: the units stay gathered from forward to backward "
            "(2Ψ of gathers instead of 3Ψ, every unit's parameters held at once)"
        )
    return notes


def _all_units_bytes(memory: RankMemory, cfg: Config) -> int:
    """Every ZeRO-3 unit of the rank gathered at once: all its parameters in the compute dtype
    (without padding)."""
    return memory.params * precision_bytes(cfg)[0]


def _describe(cfg: Config, run: RunPlan) -> str:
    d, z = run.dims, cfg.zero
    parts = [
        f"tp {d.tp}" + ("+SP" if cfg.parallel.sp and d.tp > 1 else ""),
        f"pp {d.pp}",
        f"cp {d.cp}" + (f" {layout_for(cfg.parallel, d.cp).describe()}" if d.cp > 1 else ""),
        f"dp {d.dp}",
        f"ZeRO-{z.stage}",
    ]
    if d.ep > 1:
        parts.append(f"ep {d.ep}")
    if d.dp_replicate > 1:
        parts.append(f"HSDP {d.dp_replicate}×{d.size('dp_shard')}")
    if d.pp > 1:
        parts.append(
            cfg.pipeline.schedule
            + (f" V={cfg.pipeline.virtual}" if cfg.pipeline.virtual > 1 else "")
        )
    if cfg.train.recompute != "none":
        parts.append(f"recompute {cfg.train.recompute}")
    if cfg.train.recompute == "selective-op":
        parts[-1] += f" (saves {cfg.train.recompute_save})"
    return ", ".join(parts)
