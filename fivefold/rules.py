"""The rule table: every rule across config keys and mesh dimensions that a layout must keep, as
data (docs/design.md#principles). A `Rule` says when a `Layout` breaks it, what is then wrong and
which keys to change; `check` raises the first broken rule's message.
`train.validate.validate_layout` evaluates the table before any process starts (for `train` and
`fivefold plan`), `plan.search` drops the candidate layouts it refuses; the engines keep only
one-line internal checks (`pipeline_overlap` still decides whether a pipeline overlaps,
`check_compile_supported`). A new rule is one more `Rule` in `RULES`
(docs/architecture.md#the-rule-table).

A choice key holding a value outside its choices is refused when the config is read
(`config.check_choice`), a single key out of range and what needs the model built (divisibility,
stage cuts) stay in `validate_layout`."""

from __future__ import annotations

import functools
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fivefold.config import Config, ConfigError
from fivefold.context_parallel.kernels import FUSED
from fivefold.context_parallel.ulysses import kv_repeats
from fivefold.pipeline.actions import Schedule, W
from fivefold.pipeline.builders import build_schedule

if TYPE_CHECKING:  # the model's experts and options, read by field (rules sit below the models)
    from fivefold.models.llama import LlamaConfig
    from fivefold.models.moe import MoEConfig

__all__ = [
    "GROUPS",
    "RULES",
    "Group",
    "Layout",
    "Rule",
    "broken",
    "check",
    "check_compile_supported",
    "check_pipeline_supported",
    "compile_blockers",
    "device_type_of",
    "first_error",
    "pipeline_overlap",
]


def device_type_of(device: str) -> str:
    """The device type ``run.device`` names ("auto": this machine's accelerator, else the CPU)."""
    if device != "auto":
        return device.split(":")[0]
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    return accelerator.type if accelerator else "cpu"


def _no_grid(dim: str) -> int:
    raise AssertionError(f"a rule asked for the degree of {dim} of a layout given without its grid")


@dataclass(frozen=True)
class Layout:
    """What a rule looks at: the config, each mesh dimension's degree (`ParallelDims.size`,
    `ParallelMesh.size`), the model's experts (None: dense), the device (``run.device`` or a device
    type; resolved only when a rule asks) and, under pp, the pipeline's schedule."""

    cfg: Config
    size: Callable[[str], int] = _no_grid
    moe: MoEConfig | None = None
    device: str = "auto"
    schedule: Schedule | None = None
    model: LlamaConfig | None = None  # the model's options (a sliding window), where known

    @functools.cached_property
    def device_type(self) -> str:
        return device_type_of(self.device)


def _ring_attends(l: Layout) -> bool:
    """Ring attention computes attention: cp > 1 in the ring or hybrid mode."""
    return l.size("cp") > 1 and l.cfg.parallel.cp_mode != "ulysses"


def _ulysses_heads_error(l: Layout) -> str | None:
    """Why Ulysses cannot split this model's heads per tp rank (None: it can, or no Ulysses)."""
    u = l.size("cp_ulysses") if l.size("cp") > 1 else 1
    if u == 1 or l.model is None:
        return None
    tp = l.size("tp")
    try:
        kv_repeats(l.model.n_heads // tp, max(l.model.n_kv_heads // tp, 1), u)
    except ValueError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Rule:
    """``applies(layout)``: the layout breaks the rule; ``message``: what is wrong and how to change
    it (a text, or one made from the layout); ``fix``: the keys the message says to change;
    ``group``: a `GROUPS` key, whose broken rules are said together in one error."""

    applies: Callable[[Layout], bool]
    message: str | Callable[[Layout], str]
    fix: tuple[str, ...]
    group: str = ""

    def text(self, layout: Layout) -> str:
        return self.message if isinstance(self.message, str) else self.message(layout)


@dataclass(frozen=True)
class Group:
    """Rules that only hold ``when`` the layout asks for something (pipeline.overlap on,
    train.compile), their broken ones joined as ``head`` + "; ".join(messages) + ``tail``."""

    when: Callable[[Layout], bool]
    head: str
    tail: str


GROUPS = {
    "overlap": Group(
        lambda l: l.cfg.pipeline.overlap == "on" and l.size("pp") > 1,
        "pipeline.overlap=on cannot run the overlapped units side by side: ",
        "; use pipeline.overlap off",
    ),
    "compile": Group(
        lambda l: l.cfg.train.compile, "train.compile=true: ", "; or set train.compile false"
    ),
}


def _sp_multiple(layout: str, cp: int, tp: int) -> int:
    """The sequence lengths SP (over tp) and the cp layout can both split: cp·tp, and zig-zag's 2·cp
    chunks."""
    return cp * (math.lcm(2, tp) if layout == "zigzag" and cp > 1 else tp)


def _sp_message(l: Layout) -> str:
    seq, cp, tp = l.cfg.train.seq_len, l.size("cp"), l.size("tp")
    return (
        f"sequence parallel splits the sequence over tp: train.seq_len={seq}"
        + (f" / cp={cp} = {seq // cp}" if cp > 1 else "")
        + f" is not divisible by tp={tp}; use a multiple of "
        f"{_sp_multiple(l.cfg.parallel.cp_layout, cp, tp)}"
    )


def _hpz_message(l: Layout) -> str:
    z, group = l.cfg.zero, l.size("dp_shard")
    what = "a shard group (dp × cp / dp_replicate)" if l.size("dp_replicate") > 1 else "dp × cp"
    return (
        f"zero.hpz={z.hpz} must divide the data-parallel group, {what} = {group}, and be "
        "smaller than it (e.g. the dp ranks of one node)"
    )


def _has_w(schedule: Schedule | None) -> bool:
    return schedule is not None and any(a.kind == W for acts in schedule.actions for a in acts)


def _no_cxx(l: Layout) -> bool:
    return l.device_type == "cpu" and shutil.which(os.environ.get("CXX", "g++")) is None


def _no_cc(l: Layout) -> bool:
    cc = os.environ.get("CC")
    found = shutil.which(cc) if cc else any(shutil.which(c) for c in ("cc", "gcc", "clang"))
    return l.device_type == "cuda" and not found


PIPELINE_FP16 = Rule(
    lambda l: l.size("pp") > 1 and l.cfg.precision.param == "fp16",
    "precision.param=fp16 with pipeline parallelism is not supported (loss scaling is per engine); "
    "use bf16 or fp32",
    ("precision.param", "parallel.pp"),
)

# In the order `validate_layout` reports them; a group's rules are said where its first broken one
# stands.
RULES: tuple[Rule, ...] = (
    # HSDP (docs/design.md#hsdp): dp = dp_replicate × dp_shard
    Rule(
        lambda l: l.size("dp_replicate") > 1 and l.cfg.zero.stage == 0,
        lambda l: (
            f"parallel.dp_replicate={l.size('dp_replicate')} with zero.stage=0: nothing is "
            "sharded, so every rank is a replica and that is plain DDP; set zero.stage 1, 2 or 3 "
            f"to shard inside groups of dp/dp_replicate × cp = {l.size('dp_shard')} ranks (HSDP), "
            "or parallel.dp_replicate 1"
        ),
        ("zero.stage", "parallel.dp_replicate"),
    ),
    Rule(
        lambda l: l.size("dp_replicate") > 1 and l.size("dp_shard") == 1,
        lambda l: (
            f"parallel.dp_replicate={l.size('dp_replicate')} = dp × cp leaves one rank per shard "
            "group: nothing would be sharded (that is DDP); choose a dp_replicate that leaves "
            "dp/dp_replicate × cp ≥ 2, or use zero.stage 0 with parallel.dp_replicate 1"
        ),
        ("parallel.dp_replicate", "zero.stage"),
    ),
    # expert parallelism (docs/design.md#expert-parallelism)
    Rule(
        lambda l: l.moe is None and l.size("ep") > 1,
        lambda l: (
            f"parallel.ep={l.size('ep')} splits the experts of an MoE model, but the model is "
            "dense: set --model.moe.experts N (or an MoE preset such as tiny-moe), or parallel.ep=1"
        ),
        ("parallel.ep", "model.moe.experts"),
    ),
    Rule(
        lambda l: l.moe is not None and l.moe.experts % l.size("ep") != 0,
        lambda l: (
            f"moe.experts={l.moe.experts} is not divisible by parallel.ep={l.size('ep')}: every ep "
            "rank holds the same number of experts"
        ),
        ("model.moe.experts", "parallel.ep"),
    ),
    Rule(
        lambda l: (
            l.moe is not None
            and l.moe.group_limit is not None
            and l.moe.groups % l.size("ep") != 0
            and not (l.moe.groups > 1 and l.size("ep") % l.moe.groups == 0)
        ),
        lambda l: (
            f"moe.groups={l.moe.groups} is not a multiple of parallel.ep={l.size('ep')} (every "
            "expert group on one rank: device-limited) nor a divisor > 1 of it (every group on "
            "ep / groups ranks, a node: DeepSeek-V3's node-limited routing): group-limited routing "
            "bounds the ranks a token reaches only then"
        ),
        ("model.moe.groups", "parallel.ep"),
    ),
    Rule(
        lambda l: l.moe is not None and l.size("tp") > 1,
        lambda l: (
            f"an MoE model with parallel.tp={l.size('tp')} is not supported (experts are not "
            "tensor-parallel); use ep over dp × cp instead (DeepSeek-V3 trains without TP)"
        ),
        ("parallel.tp", "parallel.ep"),
    ),
    Rule(
        lambda l: l.moe is not None and l.moe.aux_convention == "hf" and l.size("pp") > 1,
        lambda l: (
            f"moe.aux_convention=hf with parallel.pp={l.size('pp')}: Hugging Face's load-balancing "
            "loss pools every MoE layer of the model, which would span the pipeline stages; use "
            "moe.aux_convention switch (per layer) or parallel.pp 1"
        ),
        ("model.moe.aux_convention", "parallel.pp"),
    ),
    Rule(
        lambda l: l.moe is not None and l.cfg.precision.param == "fp16",
        "precision.param=fp16 with an MoE model is not supported (the auxiliary loss's gradient is "
        "not loss-scaled); use bf16",
        ("precision.param",),
    ),
    # Muon (docs/design.md#muon-under-zero): whole matrices, owned whole
    Rule(
        lambda l: l.cfg.optim.name == "muon" and not hasattr(torch.optim, "Muon"),
        lambda l: (
            f"optim.name=muon needs torch.optim.Muon (torch 2.9 or later; this is torch "
            f"{torch.__version__}): upgrade torch or use optim.name adamw"
        ),
        ("optim.name",),
    ),
    Rule(
        lambda l: l.cfg.optim.name == "muon" and l.size("tp") > 1,
        lambda l: (
            f"optim.name=muon with parallel.tp={l.size('tp')}: Muon orthogonalises each whole "
            "matrix, and a tp rank holds a slice of it (gathering the matrices over tp for the "
            "step is not built); use parallel.tp 1 (shard with zero.stage 1-3 instead) or "
            "optim.name adamw"
        ),
        ("optim.name", "parallel.tp"),
    ),
    Rule(
        lambda l: (
            l.cfg.optim.name == "muon" and (l.cfg.zero.qwz or l.cfg.zero.qgz or l.cfg.zero.hpz > 1)
        ),
        "optim.name=muon gives each rank whole matrices, so ZeRO shards differ in size; zero.qwz, "
        "zero.qgz and zero.hpz assume equal shards: drop them or use optim.name adamw",
        ("optim.name", "zero.qwz", "zero.qgz", "zero.hpz"),
    ),
    Rule(
        lambda l: l.cfg.optim.name == "muon" and l.cfg.optim.muon_ns_steps not in range(1, 100),
        lambda l: (
            f"optim.muon_ns_steps={l.cfg.optim.muon_ns_steps}: Muon runs 1 to 99 Newton-Schulz "
            "iterations (5 is the usual)"
        ),
        ("optim.muon_ns_steps",),
    ),
    # FP8 (docs/design.md#fp8-training)
    Rule(
        lambda l: l.cfg.precision.fp8 != "off" and l.cfg.precision.param == "fp16",
        lambda l: (
            f"precision.fp8={l.cfg.precision.fp8} with precision.param=fp16: the FP8 recipes take "
            "bf16 (or fp32) activations and need no loss scaling; use precision.param bf16"
        ),
        ("precision.fp8", "precision.param"),
    ),
    Rule(
        lambda l: l.cfg.zero.fp8_gather and l.cfg.precision.fp8 != "tensorwise",
        lambda l: (
            "zero.fp8_gather all-gathers each FP8 linear's weight cast once with one scale, which "
            f"only the tensorwise recipe uses (precision.fp8={l.cfg.precision.fp8}; rowwise casts "
            "the weight twice, by rows and by columns): set precision.fp8 tensorwise or drop "
            "zero.fp8_gather"
        ),
        ("precision.fp8", "zero.fp8_gather"),
    ),
    Rule(
        lambda l: l.cfg.zero.fp8_gather and l.cfg.zero.stage != 3,
        lambda l: (
            "zero.fp8_gather casts ZeRO-3's parameter all-gathers to FP8: set zero.stage 3 (not "
            f"{l.cfg.zero.stage}) or drop zero.fp8_gather (ZeRO 0-2 hold the weights gathered; the "
            "FP8 linears cast them at each use)"
        ),
        ("zero.stage", "zero.fp8_gather"),
    ),
    Rule(
        lambda l: l.cfg.zero.fp8_gather and (l.cfg.zero.qwz or l.cfg.zero.hpz > 1),
        "zero.fp8_gather replaces ZeRO-3's gather as qwZ's int8 gather does (and hpZ's secondary "
        "copy would hold the weights in another dtype): use one of zero.fp8_gather, zero.qwz, "
        "zero.hpz",
        ("zero.fp8_gather", "zero.qwz", "zero.hpz"),
    ),
    Rule(
        lambda l: l.cfg.zero.fp8_gather and l.cfg.zero.qgz,
        "zero.fp8_gather gives each FP8 weight one owner, so ZeRO-3's shards differ in size, and "
        "zero.qgz's int8 all-to-all assumes equal ones: drop one of them",
        ("zero.fp8_gather", "zero.qgz"),
    ),
    Rule(
        lambda l: l.cfg.zero.fp8_gather and l.cfg.zero.constant_buffers,
        "zero.fp8_gather with zero.constant_buffers: an FP8 unit gathers into a byte buffer of its "
        "own, not a shared gather slot; drop one or the other",
        ("zero.fp8_gather", "zero.constant_buffers"),
    ),
    # ZeRO++ (docs/design.md#zero-qwz-qgz-hpz)
    Rule(
        lambda l: l.cfg.zero.qgz and l.size("dp_replicate") > 1,
        lambda l: (
            f"zero.qgz with parallel.dp_replicate={l.size('dp_replicate')}: HSDP's all-reduce "
            "across the replicas would follow qgZ's dequantised sum, which is not built; drop "
            "zero.qgz (qwZ and hpZ work with HSDP) or use parallel.dp_replicate 1"
        ),
        ("zero.qgz", "parallel.dp_replicate"),
    ),
    Rule(
        lambda l: l.cfg.zero.qwz and l.cfg.zero.stage != 3,
        lambda l: (
            "zero.qwz quantises ZeRO-3's parameter all-gathers: set zero.stage 3 (not "
            f"{l.cfg.zero.stage}) or drop zero.qwz"
        ),
        ("zero.stage", "zero.qwz"),
    ),
    Rule(
        lambda l: l.cfg.zero.qgz and l.cfg.zero.stage not in (2, 3),
        lambda l: (
            "zero.qgz replaces the gradient reduce-scatter of ZeRO-2/3 by a quantised all-to-all: "
            f"set zero.stage 2 or 3 (not {l.cfg.zero.stage}) or drop zero.qgz"
        ),
        ("zero.stage", "zero.qgz"),
    ),
    Rule(
        lambda l: l.cfg.zero.constant_buffers and (l.cfg.zero.qwz or l.cfg.zero.qgz),
        "zero.constant_buffers with zero.qwz / zero.qgz: their int8 staging buffers are allocated "
        "per collective, not pooled; drop one or the other",
        ("zero.constant_buffers", "zero.qwz", "zero.qgz"),
    ),
    Rule(
        lambda l: (l.cfg.zero.qwz or l.cfg.zero.qgz) and l.cfg.zero.quant_block < 16,
        lambda l: (
            f"zero.quant_block={l.cfg.zero.quant_block}: use at least 16 elements per block (each "
            "block carries a 4-byte scale; ZeRO++ uses 256-4096)"
        ),
        ("zero.quant_block",),
    ),
    Rule(
        lambda l: l.cfg.zero.hpz < 0,
        lambda l: f"zero.hpz={l.cfg.zero.hpz} must not be negative (0 or 1: off)",
        ("zero.hpz",),
    ),
    Rule(
        lambda l: (
            l.cfg.zero.hpz > 1 and (l.cfg.zero.stage != 3 or not l.cfg.zero.reshard_after_forward)
        ),
        "zero.hpz keeps a secondary copy for ZeRO-3's backward all-gathers: it needs zero.stage 3 "
        "with zero.reshard_after_forward true",
        ("zero.stage", "zero.reshard_after_forward", "zero.hpz"),
    ),
    Rule(
        lambda l: l.cfg.zero.hpz > 1 and l.moe is not None,
        "zero.hpz with an MoE model is not supported (the experts' engine reduces over ep_dp, not "
        "dp × cp); drop zero.hpz",
        ("zero.hpz",),
    ),
    Rule(
        lambda l: (
            l.cfg.zero.hpz > 1
            and (l.size("dp_shard") % l.cfg.zero.hpz != 0 or l.cfg.zero.hpz >= l.size("dp_shard"))
        ),
        _hpz_message,
        ("zero.hpz",),
    ),
    # sequence parallelism inside the tp group, after cp's split
    # (docs/design.md#tensor-and-sequence-parallelism)
    Rule(
        lambda l: l.cfg.parallel.sp and (l.cfg.train.seq_len // l.size("cp")) % l.size("tp") != 0,
        _sp_message,
        ("train.seq_len", "parallel.tp"),
    ),
    # context parallelism (docs/design.md#context-parallelism): pure Ulysses runs the model's own
    # core on whole sequences; the ring and the hybrid run ring attention
    Rule(
        lambda l: l.cfg.model.attention != "sdpa" and l.size("cp") > 1,
        lambda l: (
            f"model.attention={l.cfg.model.attention}: under parallel.cp={l.size('cp')} "
            f"(cp_mode {l.cfg.parallel.cp_mode}) attention is "
            + ("sdpa on whole sequences" if not _ring_attends(l) else "ring attention")
            + " whatever the core (the eager core keeps L×L scores, which context parallelism "
            "is there to avoid); drop model.attention or use cp 1"
        ),
        ("model.attention", "parallel.cp"),
    ),
    Rule(
        lambda l: l.cfg.parallel.cp_ulysses is not None and l.cfg.parallel.cp_mode != "hybrid",
        lambda l: (
            f"parallel.cp_ulysses={l.cfg.parallel.cp_ulysses} is the hybrid's Ulysses degree, "
            f"but parallel.cp_mode={l.cfg.parallel.cp_mode}; set cp_mode hybrid or drop "
            "cp_ulysses"
        ),
        ("parallel.cp_ulysses", "parallel.cp_mode"),
    ),
    Rule(
        lambda l: (
            l.model is not None
            and l.model.sliding_window is not None
            and l.model.sliding_window < l.cfg.train.seq_len
            and _ring_attends(l)
        ),
        lambda l: (
            f"a sliding window of {l.model.sliding_window} keys (Mistral's) under "
            f"parallel.cp={l.size('cp')} (cp_mode {l.cfg.parallel.cp_mode}): ring attention "
            "attends to the whole prefix; use cp_mode ulysses (it runs the model's windowed core) "
            f"or cp 1 (or train.seq_len ≤ {l.model.sliding_window}, where the window is the whole "
            "prefix)"
        ),
        ("parallel.cp_mode", "parallel.cp", "train.seq_len"),
    ),
    Rule(
        lambda l: _ulysses_heads_error(l) is not None,
        lambda l: (
            f"parallel.cp_mode={l.cfg.parallel.cp_mode} (Ulysses over "
            f"{l.size('cp_ulysses')} ranks) with parallel.tp={l.size('tp')}: "
            f"{_ulysses_heads_error(l)}; choose a Ulysses degree (parallel.cp, or cp_ulysses for "
            "the hybrid) that divides the heads per tp rank, or cp_mode ring"
        ),
        ("parallel.cp_mode", "parallel.cp_ulysses", "parallel.cp"),
    ),
    Rule(
        lambda l: (
            l.cfg.parallel.cp_kernel == "flash" and _ring_attends(l) and l.device_type not in FUSED
        ),
        lambda l: (
            f"parallel.cp_kernel=flash: ring attention has no fused block kernel on "
            f"{l.device_type} (only on {' and '.join(FUSED)}); use auto or math"
        ),
        ("parallel.cp_kernel",),
    ),
    # pipelines (docs/design.md#pipeline-schedules)
    Rule(
        lambda l: l.cfg.pipeline.overlap == "on" and l.size("pp") == 1,
        "pipeline.overlap=on runs a pipeline's overlapped units side by side: it needs "
        "parallel.pp > 1 and pipeline.schedule dualpipev",
        ("pipeline.overlap", "parallel.pp"),
    ),
    PIPELINE_FP16,
    Rule(
        lambda l: (
            l.size("pp") > 1
            and l.cfg.pipeline.p2p == "buffered"
            and l.cfg.run.device not in ("auto", "cpu")
        ),
        lambda l: (
            "pipeline.p2p=buffered relies on gloo's per-message completion; run.device="
            f"{l.cfg.run.device} uses a backend that completes a batch as a whole: use auto or "
            "rendezvous"
        ),
        ("pipeline.p2p",),
    ),
    # A unit's forward runs in a second thread beside the backward: safe only when the two passes
    # never call one process group at once (`pipeline_overlap`).
    Rule(
        lambda l: not any(l.schedule.side_by_side),
        lambda l: f"schedule {l.schedule.name} has no overlapped units (dualpipev has)",
        ("pipeline.schedule",),
        "overlap",
    ),
    Rule(
        lambda l: l.size("tp") > 1,
        lambda l: f"parallel.tp={l.size('tp')}: both passes would call the tp group",
        ("parallel.tp",),
        "overlap",
    ),
    Rule(
        lambda l: l.size("cp") > 1,
        lambda l: (
            f"parallel.cp={l.size('cp')}: both passes would exchange context-parallel messages "
            "(the ring's, Ulysses' all-to-alls)"
        ),
        ("parallel.cp",),
        "overlap",
    ),
    Rule(
        lambda l: l.cfg.zero.stage == 3,
        "zero.stage=3: both passes would gather and free the same units",
        ("zero.stage",),
        "overlap",
    ),
    Rule(
        lambda l: l.moe is not None and l.cfg.train.recompute == "full",
        "train.recompute=full: the backward would run the MoE layers' forward collectives again "
        "beside the other pass's",
        ("train.recompute",),
        "overlap",
    ),
    Rule(
        lambda l: l.device_type != "cpu",
        lambda l: (
            f"the device is {l.device_type}: the passes would share one stream, and NCCL "
            "communicators used from two threads at once may deadlock (CPU/gloo only)"
        ),
        ("pipeline.overlap",),
        "overlap",
    ),
    # train.compile (docs/layouts.md#per-block-torchcompile): TP / SP, ring attention and expert
    # exchanges are graph breaks (`comm.eager_region`), ZeRO-3's hooks and pipeline sends sit
    # outside the blocks, full recompute wraps the compiled block; what is left:
    Rule(
        lambda l: l.cfg.train.recompute == "selective",
        "train.recompute=selective recomputes the attention core inside the block, and "
        "torch.compile cannot trace fivefold's checkpoint there: use train.recompute full (the "
        "compiled block is recomputed whole) or none",
        ("train.recompute",),
        "compile",
    ),
    Rule(
        lambda l: l.cfg.train.recompute == "selective-op",
        "train.recompute=selective-op picks the ops to save with a dispatch mode around the "
        "block's eager ops, which a compiled block does not run: use train.recompute full (the "
        "compiled block is recomputed whole) or none",
        ("train.recompute",),
        "compile",
    ),
    Rule(
        lambda l: _has_w(l.schedule),
        lambda l: (
            f"pipeline.schedule={l.schedule.name} defers weight gradients (W) past the input "
            "gradients, but a compiled block's backward computes both at once: use "
            "pipeline.schedule 1f1b, gpipe or interleaved"
        ),
        ("pipeline.schedule",),
        "compile",
    ),
    Rule(
        lambda l: l.cfg.data.documents == "mask",
        "data.documents=mask slices each packed document by its boundaries, read on the host per "
        "micro-batch, which a compiled block would specialise on (a recompile per micro-batch): "
        "use data.documents cross",
        ("data.documents",),
        "compile",
    ),
    Rule(
        _no_cxx,
        lambda l: (
            f"on the CPU torch's inductor compiles C++ with {os.environ.get('CXX', 'g++')}, which "
            "is not on PATH: install it or set CXX to a C++ compiler"
        ),
        ("train.compile",),
        "compile",
    ),
    Rule(
        _no_cc,
        lambda l: (
            "on GPUs triton builds its kernel launchers with a C compiler "
            f"({os.environ.get('CC') or 'cc, gcc or clang'}), which is not on PATH: install one or "
            "set CC"
        ),
        ("train.compile",),
        "compile",
    ),
)


def broken(layout: Layout, rules: Sequence[Rule] = RULES) -> list[Rule]:
    """The rules `layout` breaks, in table order (a group's only when its ``when`` holds)."""
    active = {name: GROUPS[name].when(layout) for name in {r.group for r in rules if r.group}}
    return [r for r in rules if (not r.group or active[r.group]) and r.applies(layout)]


def _errors(layout: Layout, rules: Sequence[Rule]) -> list[str]:
    """One message per broken standalone rule and per group with a broken rule, in table order."""
    out, said = [], set()
    bad = broken(layout, rules)
    for rule in bad:
        if not rule.group:
            out.append(rule.text(layout))
        elif rule.group not in said:
            said.add(rule.group)
            g = GROUPS[rule.group]
            texts = [r.text(layout) for r in bad if r.group == rule.group]
            out.append(g.head + "; ".join(texts) + g.tail)
    return out


def first_error(layout: Layout, rules: Sequence[Rule] = RULES) -> str | None:
    """The message `check` would raise for `layout`; None: it keeps every rule."""
    errors = _errors(layout, rules)
    return errors[0] if errors else None


def check(layout: Layout, rules: Sequence[Rule] = RULES) -> None:
    """A `ConfigError` with the first broken rule's message (a group's: all its broken rules)."""
    if (error := first_error(layout, rules)) is not None:
        raise ConfigError(error)


def pipeline_overlap(
    cfg: Config, moe: MoEConfig | None, size: Callable[[str], int], device_type: str
) -> tuple[bool, str]:
    """Whether the pipeline runs its schedule's overlapped units side by side (`PipelineRuntime`
    ``overlap``), and why (not). A unit's forward runs in a second thread beside the backward; that
    is safe only when the two passes never call one process group at once (the "overlap" rules):
    expert all-to-alls (the backward's get their own group) and the dp × cp load-balancing sum
    (forward only; the engines' backward hooks issue nothing during a pipeline step, which runs
    under `no_sync`) are; TP's collectives, ring attention's messages and ZeRO-3's gathers are not.
    Off by default: the second thread needs a core of its own to gain anything
    (docs/benchmarks.md#expert-parallelism). ``moe`` (the model's experts, None: dense) says
    whether there are expert all-to-alls to hide. `validate_layout` refuses a broken rule first;
    here it is raised again."""
    if cfg.pipeline.overlap == "off":
        return False, "pipeline.overlap off"
    schedule = build_schedule(
        cfg.pipeline.schedule, size("pp"), cfg.train.grad_accum, cfg.pipeline.virtual
    )
    layout = Layout(cfg, size, moe, device_type, schedule)
    check(layout, [r for r in RULES if r.group == "overlap"])
    hides = (
        "expert all-to-alls"
        if moe is not None and size("ep") > 1
        else "nothing but compute (no expert all-to-all)"
    )
    return True, f"each unit's forward beside its backward, hiding {hides}"


def check_pipeline_supported(cfg: Config) -> None:
    """What a pipeline refuses (`validate_layout` refuses it first: the rule `PIPELINE_FP16`)."""
    if cfg.precision.param == "fp16":
        raise ConfigError(PIPELINE_FP16.text(Layout(cfg)))


def compile_blockers(cfg: Config, device_type: str, schedule: Schedule | None = None) -> list[str]:
    """Why ``train.compile`` cannot compile this layout's blocks (empty: it can): the "compile"
    rules' messages; ``schedule``: the pipeline's (pp > 1)."""
    layout = Layout(cfg, device=device_type, schedule=schedule)
    return [r.text(layout) for r in RULES if r.group == "compile" and r.applies(layout)]


def check_compile_supported(
    cfg: Config, device_type: str, schedule: Schedule | None = None
) -> None:
    """`compile_blockers` as one error (`validate_layout` refuses it first)."""
    check(
        Layout(cfg, device=device_type, schedule=schedule),
        [r for r in RULES if r.group == "compile"],
    )
