"""Run configuration: a dataclass schema (its defaults are the `make run` job), TOML files and
``--section.field`` overrides converted to the field's type; unknown keys are rejected with the list
of valid ones, and a choice (a ``Literal`` field) outside its values when it is read, listing them
(`check_choice`). Cross-key rules are `fivefold.rules`' (docs/design.md#principles)."""

from __future__ import annotations

import dataclasses
import functools
import sys
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# The choices (a field typed by one, or ``Annotated[<one>, "how an error lists them"]``, takes only
# its values)
AttentionCore = Literal["sdpa", "eager"]  # model.attention
AttentionBias = Literal["off", "qkv", "all"]  # model.attention_bias
MoEScore = Literal["softmax", "sigmoid"]  # moe.score
MoEAuxConvention = Literal["switch", "hf"]  # moe.aux_convention
CpLayout = Literal["zigzag", "contiguous"]  # parallel.cp_layout
CpKernel = Literal["auto", "math", "flash"]  # parallel.cp_kernel
CpMode = Literal["ring", "ulysses", "hybrid"]  # parallel.cp_mode
Recompute = Literal["none", "full", "selective", "selective-op"]  # train.recompute
ZeroStage = Literal[0, 1, 2, 3]  # zero.stage
P2P = Literal["auto", "buffered", "rendezvous"]  # pipeline.p2p
Overlap = Literal["off", "on"]  # pipeline.overlap
OnError = Literal["stop", "warn"]  # checkpoint.on_error
DocumentsMode = Literal["cross", "mask"]  # data.documents
WandbMode = Literal["online", "offline", "disabled"]  # logging.wandb_mode
LayoutMode = Literal["manual", "auto"]  # parallel.layout
OptimName = Literal["adamw", "muon"]  # optim.name
MuonAdjustLr = Literal["match_rms_adamw", "original"]  # optim.muon_adjust_lr
Float8Mode = Literal["off", "tensorwise", "rowwise"]  # precision.fp8


@dataclass
class ModelSection:
    preset: str = "small"
    # A Hugging Face Llama directory (config.json + safetensors): the model's shape and initial
    # weights come from it
    init_from: str = ""
    # true: load what the model has a place for and leave the directory's other tensors unread (a
    # deliberate partial load); false: a tensor the model does not use is an error naming it
    init_from_allow_unused: bool = False
    # Any LlamaConfig field overrides the preset; None keeps the preset's value.
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    tie_embeddings: bool | None = None
    # the model families' options (docs/design.md#model-families): biases on the attention's
    # projections (off | qkv: Qwen2 | all: with o), per-head q/k RMSNorm (Qwen3), a sliding
    # window of keys (Mistral; 0: none), the channels RoPE rotates (0: all)
    attention_bias: AttentionBias | None = None
    qk_norm: bool | None = None
    sliding_window: int | None = None
    rotary_dim: int | None = None
    # the attention core: sdpa (fused where torch has a kernel: no L×L matrix kept) | eager
    # (softmax(qkᵀ)v written out; keeps the B·H·L² probabilities for backward). Context parallelism
    # replaces either with ring attention.
    attention: AttentionCore = "sdpa"


@dataclass
class MoESection:
    """Mixture of experts (`fivefold.models.moe.MoEConfig`), also written ``[model.moe]`` /
    ``--model.moe.*``. Unset keys (None) keep the preset's value (an MoE preset) or MoEConfig's
    default; ``experts`` > 0 makes a dense preset MoE, 0 makes an MoE preset dense.
    ``capacity_factor`` 0 means dropless, ``group_limit`` 0 no limit."""

    experts: int | None = None
    top_k: int | None = None
    score: MoEScore | None = None
    norm_topk: bool | None = None
    shared_experts: int | None = None
    hidden: int | None = None  # an expert's hidden size (default: model ffn_hidden)
    every: int | None = None  # MoE in every `every`-th block
    first_dense: int | None = None  # the first blocks stay dense
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None
    capacity_factor: float | None = None  # 0: dropless
    # device-limited routing: expert groups (= ep, or a multiple: a group on one rank) ...
    groups: int | None = None
    # ... and how many of them one token's experts may come from (0: no limit)
    group_limit: int | None = None
    # the shared experts' hidden width in total (default: hidden × shared_experts)
    shared_hidden: int | None = None
    shared_gate: bool | None = None  # Qwen2-MoE: the shared output × sigmoid(x · g)
    routed_scaling: float | None = None  # DeepSeek-V3: the k weights × this (default 1)
    # DeepSeek-V3's auxiliary-loss-free balancing: a bias on the scores for the choice, moved by
    # expert_bias_rate · sign(mean load − load) after every step (rate 0: fixed)
    expert_bias: bool | None = None
    expert_bias_rate: float | None = None
    # load-balancing loss: switch (per layer, summed) | hf (Hugging Face's, the layers pooled)
    aux_convention: MoEAuxConvention | None = None


@dataclass
class ParallelSection:
    dp: int = -1  # -1: the rest of the world after pp × cp × tp
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel, carved from dp × cp
    # HSDP: dp = dp_replicate × dp_shard; ZeRO shards over dp_shard × cp (consecutive ranks),
    # gradients are then all-reduced across the dp_replicate copies (1: plain ZeRO over all of dp ×
    # cp)
    dp_replicate: int = 1
    # sequence parallel inside the TP group (norms/residuals split along the sequence)
    sp: bool = False
    # how cp splits a sequence: zigzag (balanced causal work) or contiguous
    cp_layout: CpLayout = "zigzag"
    # ring attention's block kernel: auto (the device's fused SDPA kernel, else fp32 math), math
    # (the portable reference) or flash (the fused kernel; refused on a device without one)
    cp_kernel: CpKernel = "auto"
    # how cp attends: ring (K/V around the cp group), ulysses (an all-to-all over heads: each rank
    # attends the whole sequence for cp-th of the heads) or hybrid (Ulysses over cp_ulysses
    # consecutive ranks × ring across them)
    cp_mode: CpMode = "ring"
    # the hybrid's Ulysses degree U (cp = U × ring degree; none: 2); refused with another mode
    cp_ulysses: int | None = None
    # manual: the degrees above | auto (--layout auto): the planner's fastest layout that fits the
    # world and this machine, chosen before any worker starts; the keys among tp, pp, cp, dp, ep,
    # zero.stage, train.recompute given on the command line or in --config stay fixed
    # (docs/training.md#choosing-the-layout-automatically)
    layout: LayoutMode = "manual"

    def ulysses_degree(self, cp: int) -> int:
        """The Ulysses degree U of ``cp_mode`` at a cp degree: 1 (ring), cp (ulysses), cp_ulysses
        (hybrid; 2 when not given)."""
        hybrid = self.cp_ulysses if self.cp_ulysses is not None else 2
        return {"ring": 1, "ulysses": cp, "hybrid": hybrid}[self.cp_mode]


@dataclass
class TrainSection:
    steps: int = 150
    # Any two of these three derive the third (global = micro × accum × dp); else grad_accum 1
    # (micro_batch 8).
    global_batch: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    seq_len: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr × this
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # max global gradient norm; 0 disables
    # stop (every rank, before the step is applied) on a non-finite gradient norm, naming the first
    # parameter with a non-finite gradient; one host sync per step. fp16 skips such a step instead
    # (loss scaling).
    check_finite: bool = True
    seed: int = 0
    # activation recompute (docs/design.md#activation-memory): none | full (each block keeps only
    # its input and runs again in backward) | selective (the attention core runs again: its L×L or
    # fused-kernel tensors and K/V repeats are not kept) | selective-op (each block saves the
    # outputs of the ops recompute_save names, the rest runs again: torch's selective checkpoint)
    recompute: Annotated[Recompute, "none, full, selective, selective-op"] = "none"
    # selective-op's save set (fivefold/models/recompute_policy.py): matmuls-every-other (every
    # other matmul and the attention core's outputs) | all-but-attention (every matmul) | a comma
    # list of op groups saved at every call: mm, sdpa, bmm, softmax
    recompute_save: str = "matmuls-every-other"
    # torch.compile each transformer block's computation (inductor: C++ on the CPU, triton on GPUs);
    # the ZeRO-3 hooks, pipeline sends and TP / SP collectives stay outside the compiled graphs
    # (docs/layouts.md#per-block-torchcompile)
    compile: bool = False
    eval_every: int = 50  # validation loss every N steps (and at the end); 0 disables
    eval_batches: int = 8


@dataclass
class OptimSection:
    # adamw: AdamW for every parameter (train.lr, beta1, beta2, eps, weight_decay) | muon: Muon for
    # the transformer blocks' matrices (attention, feed-forward and expert weights), AdamW for the
    # rest (embedding, head, norms, biases, the MoE router) — ZeRO gives each rank whole matrices
    # (docs/design.md#muon-under-zero); train.lr, weight_decay and the schedule apply to both
    name: OptimName = "adamw"
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations per update
    # the learning rate of an A × B matrix: match_rms_adamw 0.2·√max(A, B)·lr (Moonlight: AdamW's lr
    # and weight decay carry over) | original √max(1, A/B)·lr (Keller Jordan's)
    muon_adjust_lr: MuonAdjustLr = "match_rms_adamw"


@dataclass
class DataSection:
    # a directory `fivefold prepare` wrote (index.json + token shards), a text file, folder, comma
    # list, or nanoGPT .bin / folder; None = stdlib sources
    path: str | None = None
    val_fraction: float = 0.05
    max_bytes: int | None = None
    # bytes | a tokenizer.json | a directory holding one (a Hugging Face model's) | a tiktoken BPE
    # file; "" = the prepared data's, else model.init_from's, else bytes
    # (docs/data.md#tokenizers)
    tokenizer: str = ""
    # how packed documents see each other (docs/data.md#documents): cross (attention runs across
    # the end-of-document token, positions run on) | mask (each token attends to its own document
    # only, RoPE positions restart at every document)
    documents: DocumentsMode = "cross"
    # false: no loss on the token after an end-of-document token (the next document's first token
    # is not predicted from the previous one); the end-of-document token itself is still predicted
    loss_across_documents: bool = True


@dataclass
class ZeroSection:
    # 0 (DDP), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters, FSDP)
    stage: Annotated[ZeroStage, "a ZeRO stage 0 (DDP), 1, 2 or 3 (FSDP)"] = 0
    # gradient bucket size (ZeRO-3: per unit); ZeRO-2 peaks ~2 buckets above its formula
    bucket_mb: float = 25.0
    find_unused: bool = False
    # true: accumulate unreduced gradients and reduce once per step (less traffic; ZeRO-2/3 then
    # hold full gradients until the last micro-step); false: reduce every micro-step, memory as the
    # stage's formula
    defer_reduce: bool = False
    # ZeRO-3: free each unit after its forward (false: keep until backward)
    reshard_after_forward: bool = True
    prefetch: int = 1  # ZeRO-3: units all-gathered ahead of use
    # ZeRO-2/3: reduce-scatters in flight (more: more overlap, a higher backward peak)
    inflight_buckets: int = 1
    # ZeRO++ (docs/design.md#zero-qwz-qgz-hpz): qwz: ZeRO-3 parameter all-gathers in block-wise int8
    # (the stored weights keep their dtype); qgz: ZeRO-2/3 gradient reduce-scatter as an int8
    # all-to-all, dequantised and summed in fp32; hpz: ZeRO-3 keeps a secondary copy of each unit
    # split over this many consecutive dp ranks (e.g. a node) and gathers backward weights inside
    # them (an int, not a choice: 0 or 1 mean off; it must divide dp × cp and be smaller)
    qwz: bool = False
    qgz: bool = False
    hpz: int = 0
    quant_block: int = 2048  # elements per int8 block (one fp32 scale each) for qwz / qgz
    # ZeRO-R constant buffers: gradient buckets, reduce-scatter outputs and ZeRO-3 gathers in
    # buffers allocated once (no allocation per step after two warm-up steps; the buffers are held
    # for the run, a higher resting memory)
    constant_buffers: bool = False
    # ZeRO-Offload: fp32 master shards and optimizer state in host memory, the optimizer step on the
    # host
    offload_optimizer: bool = False
    # ZeRO-3 with precision.fp8 = tensorwise: the FP8 linears' weights are all-gathered in FP8 (1
    # byte and one scale each, cast once per gather by their owner rank), half of bf16's gather
    # traffic and gathered memory; each unit's parameters then have whole-parameter owners
    # (docs/design.md#fp8-training)
    fp8_gather: bool = False


@dataclass
class PipelineSection:
    # gpipe | 1f1b | interleaved | zb-h1 | dualpipev (micro-batches = train.grad_accum)
    schedule: str = "1f1b"
    virtual: int = 1  # virtual stages per rank (interleaved)
    # e.g. "3,3,2": blocks per (virtual) stage; empty = as even as possible
    layers_per_stage: str = ""
    # how p2p messages complete: auto (from the backend: gloo buffered, NCCL rendezvous) |
    # buffered | rendezvous
    p2p: P2P = "auto"
    # DualPipeV's (F, B) units side by side, the forward in a second thread (hides expert
    # all-to-alls; CPU/gloo, no tp / cp / ZeRO-3): off | on
    overlap: Overlap = "off"

    def layers(self) -> list[int] | None:
        """``layers_per_stage`` as block counts (None: as even as possible)."""
        try:
            return (
                [int(v) for v in self.layers_per_stage.split(",")]
                if self.layers_per_stage
                else None
            )
        except ValueError:
            raise ConfigError(
                f"pipeline.layers_per_stage={self.layers_per_stage!r}: give comma-separated block "
                "counts, one per (virtual) stage, e.g. '3,3,2'"
            ) from None


@dataclass
class PrecisionSection:
    # parameter / compute dtype: fp32 | bf16 | fp16 (fp32 master weights in the optimizer)
    param: str = "fp32"
    reduce: str = "fp32"  # gradient buckets and collectives: fp32 | bf16 | fp16
    # on an accelerator, fp32 matmuls may use TF32 (set_float32_matmul_precision "high"); CPU: none
    tf32: bool = True
    # the transformer blocks' linears (attention, dense and shared feed-forward; not the embedding,
    # head, router, norms or MoE experts) in FP8 with dynamic scaling (docs/design.md#fp8-training):
    # off | tensorwise (one scale per tensor; gradients e5m2) | rowwise (a scale per row, e4m3,
    # powers of 2) — torchao's recipes, on torch._scaled_mm
    fp8: Float8Mode = "off"


@dataclass
class RunSection:
    name: str = "default"
    out_dir: str = "runs"
    nproc: int = 2  # local CPU workers spawned when not under torchrun
    device: str = "auto"  # auto | cpu | cuda | ...
    progress: bool = True
    plot: bool = True
    log_every: int = 1
    # "latest" (--resume) or a checkpoint directory: continue that run; "" starts a new one
    resume: str = ""
    # start a new run in a run directory that already holds one (it is deleted first)
    overwrite: bool = False
    # stop cleanly, with a checkpoint, after this many steps of this invocation (0: never)
    exit_after: int = 0
    # local launcher: restart all workers from the latest checkpoint when one dies
    max_restarts: int = 0
    # local launcher: a worker silent this long is stalled (frozen); no rank finishing a step for
    # stall_timeout_s (0: 3 minutes, and at least 20 of the slowest steps) is a hang. Either stops
    # the job naming the ranks.
    heartbeat_timeout_s: float = 60.0
    stall_timeout_s: float = 0.0
    # for every process group of the run (then a collective fails)
    collective_timeout_s: float = 1800.0
    # the dense peak TFLOP/s of one device in the compute dtype, for MFU (0: a table of known
    # accelerators; on the CPU a short matmul measured with the threads each rank uses, cached in
    # ~/.cache/fivefold)
    peak_tflops: float = 0.0
    # per-rank trace of the last trace_steps steps -> <run dir>/trace.json (Chrome / Perfetto) and
    # step_trace.png: forward/backward/recompute spans per block, every collective (launch ->
    # completion), the share of communication hidden behind compute (printed and in metrics). Off:
    # no hooks, no timing.
    trace: bool = False
    trace_steps: int = 2
    # torch.profiler over this invocation's last N steps (never its first: it compiles and
    # allocates) -> <run dir>/profile/rank<R>.json per rank (Chrome / Perfetto; CPU and CUDA
    # activity, memory, shapes); 0: off
    profile: int = 0
    # CUDA only: the caching allocator's history (from the run's start, or over the profile's
    # steps) -> <run dir>/memory_snapshot/rank<R>.pickle per rank (pytorch.org/memory_viz)
    memory_snapshot: bool = False
    # torch's flight recorder: the last N collectives of each rank (0: off), dumped to <run
    # dir>/flight_recorder/rank<R> on a stall (the local watchdog), on NCCL's collective timeout
    # and on SIGUSR1
    flight_recorder: int = 0
    # before spawning, the planner's memory model predicts every local rank's peak: a run that would
    # not fit in this machine's free memory (host RAM on the CPU, device memory on accelerators) is
    # refused; false: start it anyway
    check_memory: bool = True


@dataclass
class CheckpointSection:
    # a checkpoint every N steps and at the end (0: none by step count)
    interval: int = 0
    # a checkpoint after the run's last step (false: only by interval, time, SIGTERM, exit_after)
    at_end: bool = True
    # a checkpoint by time: one when this many minutes have passed since the last save (rank 0's
    # clock, agreed one step late), and never sooner than 50 × the last save's wait, so saving
    # stays under 2 % of the run's time (0: none by time)
    every_minutes: float = 10.0
    keep: int = 3  # complete checkpoints kept, older ones removed (0: keep all)
    async_save: bool = False  # copy the state to host memory and write it in the background
    dir: str = ""  # where checkpoints go (default: <run directory>/checkpoints)
    on_error: OnError = "stop"  # a failed save (disk full, ...): stop the run, or warn and train on
    # load a checkpoint whose metadata only DCP's pickle holds (another DCP program's, or an older
    # fivefold's): reading a pickle can run code the file carries, so only a checkpoint from a
    # source you trust (--trust-checkpoint)
    trust: bool = False


@dataclass
class FtSection:
    """Replica fault tolerance with torchft (`fivefold.fault_tolerance`, docs/reliability.md#
    keeping-training-when-a-replica-dies): the world splits into replica groups, each its own job;
    HSDP's replica all-reduce goes through torchft's per-step quorum, so a dead group is dropped
    and the others go on."""

    # replica groups (1: off); each has world / R ranks and shards inside itself
    replica_groups: int = 1
    # the torchft lighthouse, http://host:port ("": the local launcher starts one on 127.0.0.1)
    lighthouse: str = ""
    # the fewest live groups a step may commit with (the lighthouse waits for that many)
    min_replicas: int = 1
    # this process's group, 0..R-1: set by the local launcher; under torchrun give it per job
    group: int = -1
    # how long a step waits for a silent peer (its all-reduce) or for a quorum (then the group
    # stops with a checkpoint), and how long the lighthouse awaits a dead group's heartbeat
    timeout_s: float = 30.0
    heartbeat_timeout_s: float = 2.0
    # how long a group's first quorum waits for every group to come up
    join_timeout_s: float = 60.0


@dataclass
class DebugSection:
    # every collective's fingerprint (op, dim, shapes, dtypes, call number, step, call site)
    # compared across the group before it is issued: a mismatch is an error on every rank, not a
    # hang (also FIVEFOLD_DEBUG_COLLECTIVES=1)
    collectives: bool = False


@dataclass
class LoggingSection:
    """Where rank 0's scalars go besides ``metrics.jsonl``, which is always written
    (`fivefold.train.sinks`, docs/training.md#watching-a-run)."""

    # a comma list of jsonl, tensorboard (<run dir>/tensorboard/), wandb, mlflow
    sinks: str = "jsonl"
    wandb_project: str = "fivefold"
    # None: the environment's WANDB_MODE, else offline (no network: `wandb sync` uploads later)
    wandb_mode: WandbMode | None = None
    # "": a local file store <run dir>/mlruns (MLFLOW_ALLOW_FILE_STORE=true is set for it)
    mlflow_uri: str = ""
    mlflow_experiment: str = "fivefold"

    def sink_names(self) -> tuple[str, ...]:
        """The sinks asked for, metrics.jsonl's own left out; an unknown name is a `ConfigError`."""
        names = [n.strip() for n in self.sinks.split(",") if n.strip()]
        unknown = [n for n in names if n not in SINKS]
        if unknown:
            raise ConfigError(
                f"logging.sinks={self.sinks!r}: unknown sink {', '.join(map(repr, unknown))}; "
                f"choose a comma list of {', '.join(SINKS)}"
            )
        return tuple(dict.fromkeys(n for n in names if n != "jsonl"))


SINKS = ("jsonl", "tensorboard", "wandb", "mlflow")  # logging.sinks


@dataclass
class Config:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    data: DataSection = field(default_factory=DataSection)
    zero: ZeroSection = field(default_factory=ZeroSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    run: RunSection = field(default_factory=RunSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    debug: DebugSection = field(default_factory=DebugSection)
    moe: MoESection = field(default_factory=MoESection)  # written [model.moe] / --model.moe.* too
    logging: LoggingSection = field(default_factory=LoggingSection)
    ft: FtSection = field(default_factory=FtSection)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ALIASES = {
    "zero": "zero.stage",
    "nproc": "run.nproc",
    "data": "data.path",
    "name": "run.name",
    "steps": "train.steps",
    "preset": "model.preset",
    "device": "run.device",
    "resume": "run.resume",
    "overwrite": "run.overwrite",
    "init-from": "model.init_from",
    "init-from-allow-unused": "model.init_from_allow_unused",
    "tokenizer": "data.tokenizer",
    "trust-checkpoint": "checkpoint.trust",
    "layout": "parallel.layout",
}
# short flags that may stand without a value: their value then
FLAGS = {
    "resume": "latest",
    "overwrite": "true",
    "trust-checkpoint": "true",
    "init-from-allow-unused": "true",
}


class ConfigError(ValueError):
    pass


# Keys that moved: a clear pointer instead of "unknown key".
MOVED = {
    "parallel.zero": "zero.stage",
    **{
        f"ddp.{k}": f"zero.{k}"
        for k in (
            "bucket_mb",
            "find_unused",
            "defer_reduce",
            "reshard_after_forward",
            "prefetch",
            "inflight_buckets",
        )
    },
}


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(Config)}


@functools.cache
def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


_BOOLS = {
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
}


def _peel(tp: Any) -> tuple[Any, bool, str | None]:
    """(the base type, whether None is allowed, how an error lists the choices) of a field
    annotation: ``Annotated[T, "wording"]`` and ``T | None`` taken off."""
    wording = None
    if typing.get_origin(tp) is Annotated:
        tp, *extras = typing.get_args(tp)
        wording = next((e for e in extras if isinstance(e, str)), None)
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    base = next((a for a in args if a is not type(None)), tp) if optional else tp
    return base, optional, wording


def choices(tp: Any) -> tuple[Any, ...] | None:
    """The values a choice annotation (a ``Literal``, maybe Optional or Annotated) allows; None: not
    a choice."""
    base = _peel(tp)[0]
    return typing.get_args(base) if typing.get_origin(base) is Literal else None


def check_choice(key: str, value: Any, tp: Any) -> Any:
    """`value` if `tp` is no choice, or one of its values (None where it is Optional); else a
    `ConfigError` that lists them: ``pipeline.overlap='x': choose off or on``."""
    values = choices(tp)
    if values is None or value in values or (value is None and _peel(tp)[1]):
        return value
    wording = _peel(tp)[2] or ", ".join(map(str, values[:-1])) + f" or {values[-1]}"
    raise ConfigError(f"{key}={value!r}: choose {wording}")


def check_choices(cfg: Config) -> None:
    """Every choice field of `cfg` holds one of its values (`check_choice`): a config built in code,
    not parsed."""
    for section, cls in _sections().items():
        for key, tp in _field_types(cls).items():
            if choices(tp) is not None and hasattr(part := getattr(cfg, section), key):
                check_choice(f"{section}.{key}", getattr(part, key), tp)


def _convert(key: str, value: Any, tp: Any) -> Any:
    """Convert a TOML or command-line value to the field type `tp` (which may be Optional, Annotated
    or a choice)."""
    base, optional, _ = _peel(tp)
    if isinstance(value, str) and optional and base is str and value == "":
        raise ConfigError(f"{key} is empty: give a value, or leave {key} out for its default")
    if isinstance(value, str) and optional and value.lower() in ("none", "null", ""):
        return None
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} cannot be empty")
    if (values := choices(tp)) is not None:  # a choice: read as its values' type, then one of them
        return check_choice(key, _convert(key, value, type(values[0])), tp)
    try:
        if base is bool:
            return value if isinstance(value, bool) else _BOOLS[str(value).lower()]
        if base is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if base is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError, KeyError):
        raise ConfigError(
            f"{key}={value!r} is not a valid {getattr(base, '__name__', base)}"
            + (": choose true or false" if base is bool else "")
        ) from None


def _set(cfg: Config, dotted: str, value: Any) -> None:
    sections = _sections()
    if dotted.startswith(
        "model.moe."
    ):  # [model.moe] in TOML, --model.moe.experts on the command line
        dotted = dotted[len("model.") :]
    if dotted in MOVED:
        raise ConfigError(
            f"'{dotted}' is now '{MOVED[dotted]}' (ZeRO's stage and knobs live in [zero])"
        )
    if "." not in dotted:
        raise ConfigError(
            f"'{dotted}' is not a section.key; valid sections: {', '.join(sections)}; "
            f"short flags: {', '.join('--' + a for a in ALIASES)}"
        )
    section, key = dotted.split(".", 1)
    if section not in sections:
        raise ConfigError(
            f"unknown config section '{section}'; valid sections: {', '.join(sections)}"
        )
    types_ = _field_types(sections[section])
    if key not in types_:
        raise ConfigError(f"unknown key '{dotted}'; valid keys in [{section}]: {', '.join(types_)}")
    setattr(getattr(cfg, section), key, _convert(dotted, value, types_[key]))


def describe_keys(width: int = 100) -> str:
    """Every section's keys with their defaults, one block per section (``fivefold train
    --help``): read from the schema, so it lists what `apply_overrides` accepts."""
    defaults = Config()
    blocks = []
    for section in _sections():
        part = getattr(defaults, section)
        keys = [
            f"{key}={getattr(part, key)!r}"
            if isinstance(getattr(part, key), str)
            else f"{key}={getattr(part, key)}"
            for key in _field_types(type(part))
        ]
        name = section if section != "moe" else "model.moe"
        blocks.append(
            textwrap.fill(
                f"[{name}] " + ", ".join(keys),
                width=width,
                initial_indent="  ",
                subsequent_indent="      ",
                break_on_hyphens=False,
            )
        )
    return "\n".join(blocks)


def apply_overrides(cfg: Config, args: list[str]) -> Config:
    """Apply ``--section.key value`` / ``--section.key=value`` / ``--alias value`` pairs."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument '{arg}': overrides look like --section.key value"
            )
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif key in FLAGS and (
            i + 1 >= len(args) or args[i + 1].startswith("--")
        ):  # a flag given alone
            value = FLAGS[key]
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"{arg} needs a value")
            value = args[i + 1]
            i += 2
        _set(cfg, ALIASES.get(key, key), value)
    return cfg


# `--profile NAME`: configs/NAME.toml of the checkout (next to the package), a layer of defaults
PROFILES_DIR = Path(__file__).resolve().parent.parent / "configs"


def profile_path(profile: str | Path) -> Path:
    """The TOML file of ``profile``: a name (``gpu`` -> `PROFILES_DIR`/gpu.toml) or a path."""
    text = str(profile)
    if text.endswith(".toml") or "/" in text:
        return Path(profile)
    path = PROFILES_DIR / f"{text}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.toml")) if PROFILES_DIR.is_dir() else []
        raise ConfigError(
            f"--profile {text}: no {path}"
            + (f"; profiles: {', '.join(known)}" if known else " (profiles ship with the checkout)")
        )
    return path


def apply_toml(cfg: Config, path: str | Path, flag: str = "--config") -> Config:
    """Set every key the TOML file at ``path`` names (``flag``: which option named it, for
    errors)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(
            f"{flag} {path}: {e.strerror or e}"
            + (" (a directory, not a TOML file)" if isinstance(e, IsADirectoryError) else "")
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{flag} {path} is not UTF-8 text (byte {e.start}): TOML files are UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{flag} {path} is not valid TOML: {e}") from None
    for section, values in data.items():
        if not isinstance(values, dict):
            _set(cfg, ALIASES.get(section, section), values)
            continue
        for key, value in values.items():
            if isinstance(value, dict):  # a nested table such as [model.moe]
                for sub, v in value.items():
                    _set(cfg, f"{section}.{key}.{sub}", v)
            else:
                _set(cfg, f"{section}.{key}", value)
    return cfg


def apply_dict(cfg: Config, values: dict[str, Any]) -> Config:
    """Set every known key of ``values`` (`Config.to_dict`'s shape: a checkpoint's stored config);
    keys this version does not know (a config another version wrote) are passed over."""
    for section, keys in values.items():
        known = _field_types(_sections()[section]) if section in _sections() else {}
        for key, value in (keys or {}).items() if isinstance(keys, dict) else ():
            if key in known:
                _set(cfg, f"{section}.{key}", value)
    return cfg


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    profile: str | Path | None = None,
    base: dict[str, Any] | None = None,
) -> Config:
    """Defaults (or ``base``: a stored config, `apply_dict`), then the profile (``--profile``:
    defaults for a kind of machine, e.g. ``gpu``), then the TOML file (if any), then command-line
    overrides: each layer wins over the ones before."""
    cfg = apply_dict(Config(), base) if base else Config()
    if profile is not None:
        apply_toml(cfg, profile_path(profile), "--profile")
    if path is not None:
        apply_toml(cfg, path)
    return apply_overrides(cfg, overrides or [])


DEFAULT_MICRO_BATCH = 8


def resolve_batch(
    global_batch: int | None, micro_batch: int | None, grad_accum: int | None, dp: int
) -> tuple[int, int, int]:
    """(global_batch, micro_batch, grad_accum) with global = micro × accum × dp: any two derive the
    third."""
    given = {
        k: v
        for k, v in (
            ("global_batch", global_batch),
            ("micro_batch", micro_batch),
            ("grad_accum", grad_accum),
        )
        if v is not None
    }
    for k, v in given.items():
        if v <= 0:
            raise ConfigError(f"train.{k}={v} must be positive")
    if len(given) < 2:
        if grad_accum is None:
            grad_accum = 1
        elif micro_batch is None:
            micro_batch = DEFAULT_MICRO_BATCH
        if global_batch is None and micro_batch is None:
            micro_batch = DEFAULT_MICRO_BATCH
    if global_batch is None:
        return micro_batch * grad_accum * dp, micro_batch, grad_accum
    if micro_batch is None or grad_accum is None:  # derive the missing one from the global batch
        name, known = (
            ("grad_accum", grad_accum) if micro_batch is None else ("micro_batch", micro_batch)
        )
        if global_batch % (known * dp):
            raise ConfigError(
                f"train.global_batch={global_batch} is not divisible by {name}({known}) × dp({dp}) "
                f"= {known * dp}; change global_batch to a multiple of {known * dp}"
            )
        derived = global_batch // (known * dp)
        return (
            (global_batch, derived, grad_accum)
            if micro_batch is None
            else (global_batch, micro_batch, derived)
        )
    if micro_batch * grad_accum * dp != global_batch:
        raise ConfigError(
            f"train.global_batch={global_batch} but micro_batch({micro_batch}) × "
            f"grad_accum({grad_accum}) × dp({dp}) = {micro_batch * grad_accum * dp}; set one of "
            "the three to none (e.g. --train.grad_accum none) to derive it, or make them agree"
        )
    return global_batch, micro_batch, grad_accum
