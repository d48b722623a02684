"""Published figures of real training runs that `fivefold plan` can be set beside (issue 32).

Each `PublishedRun` holds one published row: the layout as `fivefold plan` arguments, the
published throughput (tokens/s per GPU and/or achieved TFLOP/s per GPU), MFU and peak memory,
and the source of every number (URL or repository file + commit, and the table). Only numbers
read in the source are recorded; a field the source does not give is None, and `notes` says
what is assumed, inferred or unknown (micro-batch sizes, schedules, compile, float8).

Conventions the comparison needs:
- ``hardware`` is a key of `fivefold.plan.HARDWARE`; ``hardware_differs`` says how the GPUs of
  the run differ from that preset (empty: the same GPU). torchtitan's H100 runs used Grand Teton
  H100s with 96 GB HBM2e (2.4 TB/s) at 500 W, the "h100-96gb" preset, not the 80 GB HBM3 700 W
  SXM part of "h100".
- ``mfu`` is a fraction as published, under ``mfu_convention``; torchtitan counts
  6·N + 12·L·H·Q·T FLOPs per token (the whole L×L attention square, its comment: "we follow
  the convention and do not account for sparsity in causal attention"), N without the input
  embedding from torchtitan commit 0c6ca903f (2024-04-26) on, with it before.
- Model shapes: torchtitan's llama3 "8B" / "70B" / "405B" ModelArgs (torchtitan/models/llama/
  __init__.py at 9dec370: dim 4096/8192/16384, 32/80/126 layers, 32/64/128 heads, 8 kv heads,
  ffn_dim_multiplier 1.3/1.3/1.2, multiple_of 1024/4096/4096 -> hidden 14336/28672/53248) and the
  Llama 3 paper's 405B are the presets' shapes; the MFU checks below reproduce the published
  percentages from the presets' parameter counts.
- ``float8``: the run's linear layers ran in float8 (torchao); planned with ``precision.fp8
  tensorwise`` (torchao's default recipe; whether the run all-gathered its FSDP weights in float8
  is not published: planned without ``zero.fp8_gather``), its ratios summarised apart from the
  bf16 rows'.
- ``plan_args``: "selective-op" is torchtitan's op-level selective activation checkpointing
  (save every other matmul's output and the attention's, recompute the rest), a
  ``train.recompute`` choice issue 32 adds.

Data only: nothing here imports torch or fivefold.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RUNS", "PublishedRun"]


@dataclass(frozen=True)
class PublishedRun:
    """One published training run's layout and figures, with where each number was read."""

    name: str
    source: str  # URL / repository file + commit, and the table or section
    hardware: str  # a key of fivefold.plan.HARDWARE
    gpus: int
    plan_args: tuple[str, ...]  # `fivefold plan` arguments reproducing the run's layout
    tokens_per_s_per_gpu: float | None
    mfu: float | None  # a fraction, as published
    mfu_convention: str
    memory_gib: float | None
    memory_kind: str
    notes: str
    tflops_per_gpu: float | None = None  # achieved TFLOP/s per GPU, where the source gives it
    hardware_differs: str = ""  # how the run's GPUs differ from the preset ("": the same)
    float8: bool = False


_TT = "https://github.com/pytorch/torchtitan"
_TT_2024_04 = f"{_TT}/blob/1ea476e9f/docs/performance.md (commit 1ea476e9f, 2024-04-24)"
_TT_2024_08 = f"{_TT}/blob/3faaa1a0d/docs/performance.md (commit 3faaa1a0d, 2024-08-23)"
_TT_2024_12 = (
    f"{_TT}/blob/d4c86e375/docs/performance.md (commit d4c86e375, 2025-01-30; the same tables "
    "are in benchmarks/llama3_h100_202412_torchtitan.md at HEAD b5bcd76c6); measured with "
    "torch 1963fc8, torchao eab345c, torchtitan 9dec370"
)
_TT_ASYNC_TP = (
    f"{_TT}/blob/b5bcd76c6/benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (torchtitan "
    "820504e, torch 38410cf9)"
)
_TT_H200 = (
    f"{_TT}/blob/b5bcd76c6/benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md (torchtitan "
    "e7c0cae, torch 2.8.0a0+5228986c39)"
)
_LLAMA3 = (
    "https://arxiv.org/abs/2407.21783 (The Llama 3 Herd of Models, v3), §3.3.2 Table 4 "
    '"Scaling configurations and MFU for each stage of Llama 3 405B pre-training"'
)

# torchtitan's MFU: torchtitan/utils.py get_num_flop_per_token at the commit that measured
_TT_MFU_EXCL = (
    "torchtitan: 6·N + 12·L·H·Q·T per token (whole L×L square, causal sparsity not counted), N "
    "without the input embedding (get_num_params(model, exclude_embedding=True)); peak: "
    "H100 SXM 989 TFLOP/s bf16 (get_peak_flops) although the GPUs were lower-TDP HBM2e parts"
)
_TT_MFU_INCL = (
    "torchtitan at 1ea476e9f: 6·N + 12·L·H·Q·T per token (whole L×L square), N = every "
    "parameter including the embedding and output weights (exclude_embedding came in 0c6ca903f, "
    "2024-04-26); peak A100 312 TFLOP/s bf16. Checked: 6·8.03e9 + 12·32·4096·8192 = 61.1e9 "
    "FLOP/token × 2973 / 312e12 = 58.2 %"
)
_TT_MEM = (
    "'Memory(GiB)' column, kind not named in the table; torchtitan's log line at 9dec370 "
    "(train.py) prints max_reserved_gib = torch.cuda.memory_stats()['reserved_bytes.all.peak'] "
    "(so most likely max reserved); 'maximum across all GPUs' (footnote 1)"
)
_GRAND_TETON = (
    "H100 with 96 GB HBM2e, 2.4 TB/s, 500 W power limit (docs: 'Each H100 GPU is equipped with "
    "96GB HBM2e with 2.4 TB/sec peak memory bandwidth', 'We used the default 500W power limit'); "
    "the preset is 80 GB HBM3, 3.35 TB/s, 700 W; peak 'between SXM and NVL, and we don't know "
    "its exact value'; 400 Gb/s RDMA per GPU"
)
_A100_64 = (
    "'64 A100 (80GB)' in the source; SXM or PCIe not stated (the preset is A100-80GB SXM, 312 "
    "TFLOP/s, 2039 GB/s); interconnect not stated"
)


def _args(line: str) -> tuple[str, ...]:
    """`fivefold plan` arguments written as one command line."""
    return tuple(line.split())


RUNS: tuple[PublishedRun, ...] = (
    # --- torchtitan, Dec 2024, Llama 3.1 8B, FSDP, bf16 (Table 1: 8 GPUs, Table 3: 128 GPUs) ---
    PublishedRun(
        name="torchtitan-8b-8xh100-fsdp-sac-op",
        source=_TT_2024_12 + ", Table 1 row 'FSDP' (5,762 TPS/GPU, 82.4 GiB)",
        hardware="h100-96gb",
        gpus=8,
        plan_args=_args(
            "--model llama3-8b --seq 8192 --micro-batch 2 --global-batch 16 --zero 3 "
            "--recompute selective-op --precision.param bf16 --precision.reduce fp32 "
            "--gpu-mem 96"
        ),
        tokens_per_s_per_gpu=5762.0,
        mfu=0.33,
        mfu_convention=_TT_MFU_EXCL,
        memory_gib=82.4,
        memory_kind=_TT_MEM,
        notes=(
            "Table 1: '1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, "
            "global batch size 16. Selective activation checkpointing.' selective_ac_option "
            "'op' in train_configs/llama3_8b.toml at 9dec370 (mode 'selective'). No compile, no "
            "float8, bf16 params / fp32 reduce (torchtitan defaults). MFU: the text says 'the 1D "
            "Llama 3.1 8B model training on 8 or 128 H100 GPUs without Float8 achieves 33% to 39% "
            "MFU (with or without torch.compile, respectively)'; by TPS and torchtitan's formula "
            "(57.9e9 FLOP/token) this row is 33.7 % and the compile row 39.0 %, so 33 % is "
            "assigned here (the word 'respectively' reads the other way round). TPS read at the "
            "90th iteration."
        ),
        hardware_differs=_GRAND_TETON,
    ),
    PublishedRun(
        name="torchtitan-8b-8xh100-fsdp-compile-sac-op",
        source=_TT_2024_12 + ", Table 1 row 'FSDP + torch.compile' (6,667 TPS/GPU, 77.0 GiB)",
        hardware="h100-96gb",
        gpus=8,
        plan_args=_args(
            "--model llama3-8b --seq 8192 --micro-batch 2 --global-batch 16 --zero 3 "
            "--recompute selective-op --precision.param bf16 --precision.reduce fp32 "
            "--gpu-mem 96"
        ),
        tokens_per_s_per_gpu=6667.0,
        mfu=0.39,
        mfu_convention=_TT_MFU_EXCL,
        memory_gib=77.0,
        memory_kind=_TT_MEM,
        notes=(
            "As torchtitan-8b-8xh100-fsdp-sac-op with torch.compile (per transformer block). "
            "MFU 39 % from the text's '33% to 39%' range (this row computes to 39.0 %)."
        ),
        hardware_differs=_GRAND_TETON,
    ),
    PublishedRun(
        name="torchtitan-8b-128xh100-fsdp-sac-op",
        source=_TT_2024_12 + ", Table 3 row 'FSDP' (5,605 TPS/GPU, 67.0 GiB)",
        hardware="h100-96gb",
        gpus=128,
        plan_args=_args(
            "--model llama3-8b --seq 8192 --micro-batch 2 --global-batch 256 --zero 3 "
            "--recompute selective-op --precision.param bf16 --precision.reduce fp32 "
            "--gpu-mem 96"
        ),
        tokens_per_s_per_gpu=5605.0,
        mfu=None,
        mfu_convention=_TT_MFU_EXCL,
        memory_gib=67.0,
        memory_kind=_TT_MEM,
        notes=(
            "Table 3: '1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch size 2, "
            "global batch size 256. Selective activation checkpointing.' No compile, no float8. "
            "No per-row MFU published (only the '33% to 39%' range for 8 or 128 GPUs); "
            "torchtitan's formula gives 32.8 %."
        ),
        hardware_differs=_GRAND_TETON,
    ),
    PublishedRun(
        name="torchtitan-8b-128xh100-fsdp-compile-sac-op",
        source=_TT_2024_12 + ", Table 3 row 'FSDP + torch.compile' (6,514 TPS/GPU, 62.0 GiB)",
        hardware="h100-96gb",
        gpus=128,
        plan_args=_args(
            "--model llama3-8b --seq 8192 --micro-batch 2 --global-batch 256 --zero 3 "
            "--recompute selective-op --precision.param bf16 --precision.reduce fp32 "
            "--gpu-mem 96"
        ),
        tokens_per_s_per_gpu=6514.0,
        mfu=None,
        mfu_convention=_TT_MFU_EXCL,
        memory_gib=62.0,
        memory_kind=_TT_MEM,
        notes=(
            "As torchtitan-8b-128xh100-fsdp-sac-op with torch.compile. No per-row MFU published; "
            "torchtitan's formula gives 38.1 %."
        ),
        hardware_differs=_GRAND_TETON,
    ),
    # --- torchtitan, June 2025 async-TP benchmark, bf16 rows (no memory published) ---
    PublishedRun(
        name="torchtitan-8b-64xh100-fsdp8-tp8-compile-sac-op",
        source=_TT_ASYNC_TP + ", table 'Llama3 8b on 64 H100s with FSDP=8, TP=8, torch.compile, "
        "per op SAC, local batch size 12', row 'None (bfloat16)': vanilla TP 4378, async TP 4809.4",
        hardware="h100-96gb",
        gpus=64,
        plan_args=_args(
            "--model llama3-8b --seq 8192 --micro-batch 12 --global-batch 96 --zero 3 "
            "--tp 8 --sp --recompute selective-op --precision.param bf16 "
            "--precision.reduce fp32 --gpu-mem 96"
        ),
        tokens_per_s_per_gpu=4378.0,
        mfu=None,
        mfu_convention="not published for this benchmark",
        memory_gib=None,
        memory_kind="not published",
        notes=(
            "Vanilla TP; with async TP the same layout ran 4809.4 tokens/s (x1.10). The column "
            "says 'tokens/sec'; per GPU by comparison with the Dec 2024 tables (70B float8 2D: "
            "829 TPS/GPU there, 809.8 here). Global batch 96 = local 12 × FSDP 8 (not stated). "
            "torch.compile on, bf16, torchtitan's TP is sequence parallel (SequenceParallel on "
            "the norms in llama3/infra/parallelize.py at 820504e)."
        ),
        hardware_differs=_GRAND_TETON,
    ),
    PublishedRun(
        name="torchtitan-70b-256xh100-fsdp32-tp8-compile-full",
        source=_TT_ASYNC_TP + ", table 'Llama3 70b on 256 H100s with FSDP=32, TP=8, "
        "torch.compile, full AC, local batch size 16', row 'None (bfloat16)': vanilla TP 597.3, "
        "async TP 652.4",
        hardware="h100-96gb",
        gpus=256,
        plan_args=_args(
            "--model llama3-70b --seq 8192 --micro-batch 16 --global-batch 512 --zero 3 "
            "--tp 8 --sp --recompute full --precision.param bf16 --precision.reduce "
            "fp32 --gpu-mem 96"
        ),
        tokens_per_s_per_gpu=597.3,
        mfu=None,
        mfu_convention="not published for this benchmark",
        memory_gib=None,
        memory_kind="not published",
        notes=(
            "Vanilla TP; async TP 652.4 tokens/s (x1.09). Global batch 512 = 16 × 32 (the Dec 2024 "
            "Table 4 states global batch size 512 for the same layout). seq 8192 from "
            "train_configs/llama3_70b.toml. bf16, torch.compile on, sequence-parallel TP."
        ),
        hardware_differs=_GRAND_TETON,
    ),
    # --- torchtitan, Aug 2024: Llama 3.1 405B on 128 H100, 2D, bf16 ---
    PublishedRun(
        name="torchtitan-405b-128xh100-fsdp16-tp8-full",
        source=_TT_2024_08 + ", 'Llama 3.1 performance numbers' row '405B | 2 | full | 109 | "
        "29.0% | None'",
        hardware="h100-96gb",
        gpus=128,
        plan_args=_args(
            "--model llama3-405b --seq 8192 --micro-batch 2 --global-batch 32 --zero 3 "
            "--tp 8 --sp --recompute full --precision.param bf16 --precision.reduce "
            "fp32 --gpu-mem 94"
        ),
        tokens_per_s_per_gpu=109.0,
        mfu=0.29,
        mfu_convention=_TT_MFU_EXCL,
        memory_gib=None,
        memory_kind="not published",
        notes=(
            "'we use local batch size 2 (global batch size = local batch size 2 * number of FSDP "
            "ranks 16 = 32)'; FSDP2 + TP 8, full AC, seq 8192 (train_configs/llama3_405b.toml). "
            "Optimizations 'None' (no float8, no async TP); that toml has compile = true, whether "
            "this row compiled is not stated. The first version (9515a140b) said 118 WPS / 37.1 %, "
            "corrected in 3faaa1a0d ('We have updated the peak FLOPs for H100'). Float8 rows of "
            "that table: 177 WPS / 23.46 % and 185 / 24.52 % (float8 + async TP), their MFU "
            "evidently against the 1979 TFLOP/s fp8 peak. 6·403.75e9 + 12·126·16384·8192 = "
            "2625e9 FLOP/token × 109 / 989e12 = 28.9 %."
        ),
        hardware_differs=(
            "'128 H100 (94GB memory)', footnote: 'HBM2e based lower TDP SXM H100(95GB) ... the "
            "actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value'"
        ),
    ),
    # --- torchtitan, Apr 2024: Llama 3 on 64 A100 80GB, FSDP ---
    PublishedRun(
        name="torchtitan-8b-64xa100-fsdp-sac-op",
        source=_TT_2024_04 + ", 'Llama 3 performance numbers' row '8B | 1 | selective op | 2973 "
        "| 58.2%'",
        hardware="a100",
        gpus=64,
        plan_args=_args(
            "--model llama3-8b --seq 8192 --micro-batch 1 --global-batch 64 --zero 3 "
            "--recompute selective-op --precision.param bf16 --precision.reduce fp32"
        ),
        tokens_per_s_per_gpu=2973.0,
        mfu=0.582,
        mfu_convention=_TT_MFU_INCL,
        memory_gib=None,
        memory_kind="not published",
        notes=(
            "'We use local batch size 1 (global batch size = local batch size 1 * number of FSDP "
            "ranks 64 = 64)'. FSDP2, seq 8192, compile false, fp8_linear off "
            "(train_configs/llama3_8b.toml at 1ea476e9f); param bf16 / reduce fp32 "
            "(parallelize_llama.py: MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
            "reduce_dtype=torch.float32)). SAC 'op' at that commit saves aten.mm (except every "
            "second mm), sdpa flash/efficient and reduce_scatter outputs. The same table's "
            "'selective layer' row (2904 WPS, 56.8 %) has no fivefold equivalent (checkpoint "
            "every N-th block, N not stated) and is left out."
        ),
        hardware_differs=_A100_64,
    ),
    PublishedRun(
        name="torchtitan-70b-64xa100-fsdp-full",
        source=_TT_2024_04 + ", 'Llama 3 performance numbers' row '70B | 1 | full | 331 | 51.7%'",
        hardware="a100",
        gpus=64,
        plan_args=_args(
            "--model llama3-70b --seq 8192 --micro-batch 1 --global-batch 64 --zero 3 "
            "--recompute full --precision.param bf16 --precision.reduce fp32"
        ),
        tokens_per_s_per_gpu=331.0,
        mfu=0.517,
        mfu_convention=_TT_MFU_INCL.split(". Checked")[0]
        + ". Checked: (6·70.55e9 + 12·80·8192·8192) × 331 / 312e12 = 51.7 %",
        memory_gib=None,
        memory_kind="not published",
        notes=(
            "FSDP2 only ('Llama 3 models with FSDP2 on 64 A100 (80GB) GPUs'; the 70B toml's "
            "tensor_parallel_degree 8 is not this row), local batch 1, global 64, full AC, seq "
            "8192, bf16 / fp32 reduce, no compile, no float8."
        ),
        hardware_differs=_A100_64,
    ),
    # --- Llama 3 405B pre-training (Meta), H100 80GB HBM3 700 W ---
    PublishedRun(
        name="llama3-405b-8192xh100-tp8-pp16-dp64",
        source=_LLAMA3 + ", row '8,192 | 8 | 1 | 16 | 64 | 8,192 | 32 | 16M | 430 | 43%'",
        hardware="h100",
        gpus=8192,
        plan_args=_args(
            "--model llama3-405b --seq 8192 --tp 8 --pp 16 --dp 64 --sp --micro-batch 1 "
            "--global-batch 2048 --zero 3 --zero.reshard_after_forward false "
            "--recompute none --precision.param bf16 --precision.reduce fp32"
        ),
        tokens_per_s_per_gpu=None,
        mfu=0.43,
        mfu_convention=(
            "'BF16 Model FLOPs Utilization (MFU; Chowdhery et al. (2023))' i.e. PaLM's; the "
            "paper does not give its FLOP count or peak (430/989 = 43.5 %)"
        ),
        memory_gib=None,
        memory_kind="not published",
        tflops_per_gpu=430.0,
        notes=(
            "Batch size/DP 32 sequences × DP 64 = 2048 × 8192 = 16M tokens. Micro-batch size not "
            "published (1 here is an assumption). Pipeline: 'an interleaved schedule ... with V "
            "pipeline stages on one pipeline rank', V and the number of micro-batches N not "
            "published; one Transformer layer fewer on the first and last stages. FSDP: 'shards "
            "optimizer states and gradients, but for model shards we do not reshard after forward "
            "computation'. '8K tokens without activation checkpointing'. 'FP32 gradient "
            "accumulation ... and also reduce-scatter gradients in FP32'. SP is assumed (TP cites "
            "Korthikanti et al. 2023). NCCLX, RoCE 400 Gbps. tokens/s not published: 430e12 / "
            "(6·405.85e9 + 12·126·16384·8192) = 163 tokens/s/GPU under torchtitan's count."
        ),
    ),
    PublishedRun(
        name="llama3-405b-16384xh100-tp8-pp16-dp128",
        source=_LLAMA3 + ", row '16,384 | 8 | 1 | 16 | 128 | 8,192 | 16 | 16M | 400 | 41%'",
        hardware="h100",
        gpus=16384,
        plan_args=_args(
            "--model llama3-405b --seq 8192 --tp 8 --pp 16 --dp 128 --sp --micro-batch "
            "1 --global-batch 2048 --zero 3 --zero.reshard_after_forward false "
            "--recompute none --precision.param bf16 --precision.reduce fp32"
        ),
        tokens_per_s_per_gpu=None,
        mfu=0.41,
        mfu_convention=(
            "PaLM's (cited), FLOP count and peak not given; 400/989 = 40.4 % although 41 % is "
            "published"
        ),
        memory_gib=None,
        memory_kind="not published",
        tflops_per_gpu=400.0,
        notes=(
            "As the 8,192-GPU row with DP 128 and 16 sequences per DP group (16 × 128 × 8192 = "
            "16M tokens). 'The slight drop in MFU to 41% on 16K GPUs with DP=128 compared to 43% "
            "on 8K GPUs with DP=64 is due to the lower batch size per DP group'."
        ),
    ),
    PublishedRun(
        name="llama3-405b-16384xh100-tp8-cp16-pp16-dp8-128k",
        source=_LLAMA3 + ", row '16,384 | 8 | 16 | 16 | 8 | 131,072 | 16 | 16M | 380 | 38%'",
        hardware="h100",
        gpus=16384,
        plan_args=_args(
            "--model llama3-405b --seq 131072 --tp 8 --cp 16 --pp 16 --dp 8 --sp "
            "--micro-batch 1 --global-batch 128 --zero 3 --zero.reshard_after_forward "
            "false --precision.param bf16 --precision.reduce fp32"
        ),
        tokens_per_s_per_gpu=None,
        mfu=0.38,
        mfu_convention="PaLM's (cited), FLOP count and peak not given; 380/989 = 38.4 %",
        memory_gib=None,
        memory_kind="not published",
        tflops_per_gpu=380.0,
        notes=(
            "DP 8 = 16384 / (8·16·16) and 16 × 8 × 131072 = 16M tokens (one transcription of the "
            "table reads DP 4, which fits neither). Recompute at 128K not stated (left at the "
            "default). CP is all-gather based ('we first all-gather the key (K) and value (V) "
            "tensors'), the sequence in 2 × CP chunks (zigzag); fivefold's cp layout may differ. "
            "The preset's 8K RoPE settings do not matter for the plan."
        ),
    ),
    # --- float8 runs: planned with FP8 linears (tensorwise), summarised apart ---
    PublishedRun(
        name="torchtitan-8b-8xh100-fsdp8-cp1-32k-full-float8",
        source=_TT_2024_12 + ", Table 2 row 'FSDP 8, CP 1 | 32768 | 3,890 | 83.9'",
        hardware="h100-96gb",
        gpus=8,
        plan_args=_args(
            "--model llama3-8b --seq 32768 --micro-batch 1 --global-batch 8 --zero 3 "
            "--recompute full --precision.param bf16 --precision.reduce fp32 --precision.fp8 tensorwise --gpu-mem "
            "96"
        ),
        tokens_per_s_per_gpu=3890.0,
        mfu=None,
        mfu_convention="not published ('We do not report Model FLOPS Utilization (MFU)')",
        memory_gib=83.9,
        memory_kind=_TT_MEM,
        notes=(
            "Table 2: 'FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch "
            "size 1. Full activation checkpointing.' Other rows: FSDP 4 CP 2 65536: 2,540 / 84.2; "
            "FSDP 2 CP 4 131072: 1,071 / 84.0; FSDP 1 CP 8 262144: 548 / 84.5 (see the 256K row). "
            "Global batch 8 = local 1 × FSDP 8 (not stated). Float8 linears (torchao)."
        ),
        hardware_differs=_GRAND_TETON,
        float8=True,
    ),
    PublishedRun(
        name="torchtitan-8b-8xh100-cp8-256k-full-float8",
        source=_TT_2024_12 + ", Table 2 row 'FSDP 1, CP 8 | 262144 | 548 | 84.5'",
        hardware="h100-96gb",
        gpus=8,
        plan_args=_args(
            "--model llama3-8b --seq 262144 --cp 8 --micro-batch 1 --global-batch 1 "
            "--zero 3 --recompute full --precision.param bf16 --precision.reduce fp32 --precision.fp8 tensorwise "
            "--gpu-mem 96"
        ),
        tokens_per_s_per_gpu=548.0,
        mfu=None,
        mfu_convention="not published ('We do not report Model FLOPS Utilization (MFU)')",
        memory_gib=84.5,
        memory_kind=_TT_MEM,
        notes=(
            "As the 32K row with FSDP 1 × CP 8 (ZeRO-3 shards over dp × cp in both), one "
            "262144-token sequence per step across the 8 GPUs. compile + float8 on; torchtitan's "
            "CP is ring attention (PyTorch context_parallel)."
        ),
        hardware_differs=_GRAND_TETON,
        float8=True,
    ),
    PublishedRun(
        name="torchtitan-8b-32xh200-fsdp-compile-sac-op-float8",
        source=_TT_H200 + ", Results table row 'NUM_NODES 4 | 10938 | 47.96'",
        hardware="h200",
        gpus=32,
        plan_args=_args(
            "--model llama3-8b --seq 8192 --micro-batch 2 --global-batch 64 --zero 3 "
            "--recompute selective-op --precision.param bf16 --precision.reduce fp32 --precision.fp8 tensorwise"
        ),
        tokens_per_s_per_gpu=10938.0,
        mfu=None,
        mfu_convention="not published",
        memory_gib=47.96,
        memory_kind=(
            "'Memory(GiB)', kind not named ('arbitrarily sampled at the 100th iteration'); "
            "torchtitan's log line prints max reserved"
        ),
        notes=(
            "Trainy on WhiteFiber, June 2025: 8 H200 per host, 400Gb/s CX-7 per GPU; "
            "torchtitan/models/llama3/train_configs/llama3_8b.toml at e7c0cae (seq 8192, SAC mode 'selective' option 'op', FSDP over all GPUs) "
            "with --training.local_batch_size=2 --training.compile, float8 linears with fp8 "
            "all-gather, precompute scales, force_recompute_fp8_weight_in_bwd. 8 nodes (64 GPUs): "
            "10753 TPS/GPU, 46.97 GiB. Global batch 64 = 2 × 32 (not stated)."
        ),
        float8=True,
    ),
)
