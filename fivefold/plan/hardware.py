"""The machine a plan is for: one GPU's memory and peak FLOP/s, and its links
(docs/design.md#hardware-and-links)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.distributed.topology import ParallelDims

__all__ = ["GB", "HARDWARE", "Hardware", "link", "local_hardware"]

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links, and how fast its kernels run (docs/design.md#hardware-and-links).

    Bandwidths are GB/s one GPU sends in one direction (what a ring's wire bytes take): an H100's
    NVLink 4 is 450 GB/s each way — the 900 GB/s usually quoted counts both directions —,
    InfiniBand NDR 400 Gb/s = 50 GB/s per GPU. The peak is dense bf16 (set it for fp32 / TF32).

    The efficiency model (`plan.efficiency`): a matmul runs at ``gemm_efficiency`` of the peak
    (points (smallest of m, n, k; fraction), interpolated in log size, flat beyond the ends: one
    point is a constant), times the share of the last wave of ``sms`` multiprocessors its
    ``gemm_tile`` output tiles fill (wave quantization; ``sms`` 0: none), and never faster than
    its operands stream through memory; the attention core at ``attention_efficiency`` of the
    peak; elementwise kernels move their bytes at ``memory_efficiency`` of ``hbm_gbps``; every
    operator costs ``op_overhead_us`` of host time and every collective
    ``collective_latency_us``. An ``asynchronous`` device (a GPU: kernels queue, collectives run
    on their own streams) hides the host's launches behind its kernels and overlaps the
    data-parallel collectives with compute; on the CPU every operator and collective takes the
    cores in turn, so they add.

    Memory besides tensors (`plan.memory.runtime_bytes`): ``context_gb`` per process (the CUDA
    context and its kernels), ``comm_buffer_mb`` per communicator a rank is in (NCCL's channel
    buffers), and the caching allocator's reserve, ``allocator_reserve`` of what the tensors
    take. The sources of each preset's numbers are in `SOURCES`."""

    name: str = "H100-80GB"
    memory_gb: float = 80.0
    peak_tflops: float = 989.0
    # dense FP8 (e4m3) tensor-core peak; 0: no FP8 tensor cores (precision.fp8 is refused)
    fp8_peak_tflops: float = 1979.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    gpus_per_node: int = 8
    hbm_gbps: float = 3350.0
    gemm_efficiency: tuple[tuple[int, float], ...] = ((1, 0.803),)
    sms: int = 132
    gemm_tile: tuple[int, int] = (128, 256)
    attention_efficiency: float = 0.30
    memory_efficiency: float = 0.8
    op_overhead_us: float = 5.0
    asynchronous: bool = True
    collective_latency_us: float = 20.0
    context_gb: float = 1.2
    comm_buffer_mb: float = 600.0
    allocator_reserve: float = 0.05

    def check(self) -> Hardware:
        """Raise a ValueError naming a value that cannot describe a machine; return self."""
        may_be_zero = {"sms", "op_overhead_us", "collective_latency_us", "context_gb",
                       "comm_buffer_mb", "allocator_reserve", "fp8_peak_tflops"}  # fmt: skip
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "asynchronous", "gemm_efficiency", "gemm_tile"):
                continue  # (checked below)
            if not (value >= 0 if f.name in may_be_zero else value > 0):
                raise ValueError(f"hardware {f.name}={value} must be positive")
        if not self.gemm_efficiency or any(
            size < 1 or not 0 < e <= 1 for size, e in self.gemm_efficiency
        ):
            raise ValueError(
                f"hardware gemm_efficiency={self.gemm_efficiency}: (size >= 1, fraction in (0, 1]) "
                "points"
            )
        if len(self.gemm_tile) != 2 or min(self.gemm_tile) < 1:
            raise ValueError(f"hardware gemm_tile={self.gemm_tile}: two positive sizes (m, n)")
        for name in ("attention_efficiency", "memory_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"hardware {name}={getattr(self, name)}: a fraction, at most 1")
        return self

    @property
    def compute_efficiency(self) -> float:
        """The largest matmuls' share of the peak (the table's top)."""
        return max(e for _, e in self.gemm_efficiency)

    def with_efficiency(self, fraction: float) -> Hardware:
        """Every matmul at ``fraction`` of the peak whatever its shape (``--efficiency``)."""
        if not 0 < fraction <= 1:
            raise ValueError(f"efficiency {fraction}: a fraction of the peak in (0, 1]")
        return dataclasses.replace(self, gemm_efficiency=((1, fraction),), sms=0)


H100 = Hardware()
HARDWARE = {
    "h100": H100,
    # Meta's Grand Teton H100 (torchtitan's published H100 runs): 96 GB HBM2e, 2.4 TB/s, 500 W
    "h100-96gb": dataclasses.replace(
        H100, name="H100-96GB (HBM2e, 500 W)", memory_gb=96.0, hbm_gbps=2400.0
    ),
    "h200": dataclasses.replace(
        H100, name="H200-141GB", memory_gb=141.0, hbm_gbps=4800.0, memory_efficiency=0.79
    ),
    # NVLink cut to 400 GB/s both ways
    "h800": dataclasses.replace(H100, name="H800-80GB", intra_node_gbps=200.0),
    "a100": Hardware(
        name="A100-80GB",
        peak_tflops=312.0,
        fp8_peak_tflops=0.0,  # Ampere: no FP8 tensor cores
        intra_node_gbps=300.0,
        inter_node_gbps=25.0,
        hbm_gbps=2039.0,
        gemm_efficiency=((1, 0.869),),
        sms=108,
        attention_efficiency=0.56,
        memory_efficiency=0.88,
        context_gb=1.2,
        comm_buffer_mb=600.0,
    ),
}

# Where the presets' numbers come from (docs/plan.md#calibration has the quotes)
SOURCES = {
    "fp8_peak_tflops": "NVIDIA's H100 / H200 data sheets: dense FP8 1979 TFLOP/s (3958 with "
    "sparsity) on the SXM parts; the A100 has none. The FP8 GEMMs are taken at the bf16 matmul "
    "efficiency of the same shape (an assumption: no FP8 MAMF table was found)",
    "peak_tflops, memory_gb, hbm_gbps, links": "vendors' data sheets (SXM parts; dense bf16); "
    "the H100-96GB: torchtitan's docs/performance.md (Grand Teton, 96 GB HBM2e, 2.4 TB/s, 500 W)",
    "gemm_efficiency": "the best achievable bf16 matmul (MAMF) over the peak: H100 SXM 794.5 / 989 "
    "TFLOP/s = 80.3 % (H200 the same), A100 SXM 271.2 / 312 = 86.9 % — stas00/ml-engineering "
    "compute/accelerator/README.md at 744d01e",
    "sms, gemm_tile": "132 SMs (H100 / H200), 108 (A100), 128 × 256 output tiles: NVIDIA's Matrix "
    "Multiplication Background User's Guide (tile and wave quantization), ml-engineering "
    "training/performance/README.md",
    "attention_efficiency": "FlashAttention-2 (PyTorch's sdpa flash kernel), in the plan's FLOP "
    "convention (backward 2 × forward; FlashAttention's papers count it 2.5 ×, so e = 3 / (1 / "
    "e_forward + 2.5 / e_backward)): on an A100 up to 73 % forward and 63 % backward (arXiv "
    "2307.08691) -> 56 %; on an H100 35 % (FlashAttention-3, arXiv 2407.08608), taken for both "
    "passes -> 30 %",
    "memory_efficiency": "STREAM triad over the data sheet's bandwidth: A100 80 GB 1794 / 2039 "
    "GB/s = 88 %, H200 ≈ 79 % (RRZE-HPC/gpu-benches at 1038c5d); no H100 SXM measurement found: "
    "80 %, between them",
    "op_overhead_us, collective_latency_us": "assumptions (a GPU hides the host's launches behind "
    "its kernels; NCCL's small-message latency is tens of µs)",
    "context_gb": "the CUDA context before any tensor, 0.71 GiB, and about 0.5 GB of kernels "
    "loaded by the first operators (ml-engineering debug/pytorch.md; pytorch/pytorch#107667)",
    "comm_buffer_mb": "NCCL's buffers per channel and peer: Simple 4 MiB (DEFAULT_BUFFSIZE) + LL "
    "512 KiB + LL128 about 4.7 MiB (NVIDIA/nccl src/init.cc at 5067397c), 9.2 MiB; a ring channel "
    "has 2 peers, so 32 channels hold about 590 MB — measured 544-688 MB per communicator on "
    "A100s (NVIDIA/nccl#964), 388 MiB per extra group (sgl-project/sglang#35538): 600 MB",
    "allocator_reserve": "an assumption: 5 % of the tensors' peak reserved but unallocated (one "
    "published reading: 1.83 of 77.1 GiB, 2.4 %, vllm-project/compressed-tensors#587)",
}


def link(dim: str, dims: ParallelDims, hw: Hardware, hpz: int = 1) -> tuple[str, float]:
    """("intra-node" | "inter-node", GB/s) of `dim`'s groups: intra-node when a group's ranks lie
    within one node's GPUs (`ParallelDims.group_span`, over `ParallelDims.groups`); ``hpz``: the
    size of "dp_hpz"'s groups."""
    if dims.group_span(dim, hpz) <= hw.gpus_per_node:
        return "intra-node", hw.intra_node_gbps
    return "inter-node", hw.inter_node_gbps


def _preset_for(name: str) -> Hardware | None:
    """The preset whose key is a word of a device's name ("NVIDIA H100 80GB HBM3" -> h100)."""
    words = name.upper().replace("-", " ").split()
    return next((hw for key, hw in HARDWARE.items() if key.upper() in words), None)


def local_hardware(device_type: str, compute_bytes: int, ranks_per_node: int) -> Hardware:
    """The machine this process runs on, as a plan takes it (what `fivefold train --layout auto`
    searches for): on an accelerator the preset its name matches (H100, H200, H800, A100) with the
    memory the device reports, else its name, memory and table peak (`observe.peak.table_peak`;
    a ValueError for a device the table does not know). On the CPU, measured once and cached
    (`plan.calibrate`, `observe.peak`): a rank's one thread's matmul peak and efficiency by size,
    memory bandwidth, the host time per operator, gloo's latency and bandwidth among
    ``ranks_per_node`` ranks; ``ranks_per_node``
    ranks share the host's memory, and its cores when there are more ranks than cores (each rank
    then computes at cores / ranks of a core); no CUDA context, communicator buffers or allocator
    reserve."""
    import os

    import torch

    from fivefold.observe import peak

    dtype = {4: torch.float32, 2: torch.bfloat16}[compute_bytes]
    if device_type == "cpu":
        from fivefold.plan import calibrate

        memory = peak.cpu_memory_bandwidth()
        latency, link_bytes, per_op = calibrate.job_costs(ranks_per_node)
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        share = min(1.0, (os.cpu_count() or 1) / ranks_per_node)
        return Hardware(
            name=f"cpu ({ranks_per_node} ranks on {os.cpu_count()} cores)",
            memory_gb=host / ranks_per_node / GB,
            peak_tflops=peak.cpu_peak_flops(1, dtype) * share / 1e12,
            intra_node_gbps=min(link_bytes / GB, 1e6),
            inter_node_gbps=min(link_bytes / GB, 1e6),
            gpus_per_node=ranks_per_node,
            hbm_gbps=memory * share / GB,
            gemm_efficiency=calibrate.gemm_curve(dtype),
            sms=0,
            attention_efficiency=dict(calibrate.gemm_curve(dtype))[calibrate.GEMM_SIZES[-1]],
            memory_efficiency=1.0,
            op_overhead_us=per_op * 1e6,
            asynchronous=False,
            collective_latency_us=latency * 1e6,
            context_gb=0.0,
            comm_buffer_mb=0.0,
            allocator_reserve=0.0,
            fp8_peak_tflops=0.0,  # (FP8 GEMMs are emulated on the CPU: priced at its own peak)
        ).check()
    module = getattr(torch, device_type)
    props = module.get_device_properties(module.current_device())
    memory_gb = props.total_memory / GB
    preset = _preset_for(props.name)
    if preset is not None:
        return dataclasses.replace(preset, memory_gb=memory_gb, gpus_per_node=ranks_per_node)
    table = peak.table_peak(props.name, dtype)
    if table is None:
        raise ValueError(
            f"no hardware preset or peak for {props.name!r}: plan with fivefold plan --hardware "
            "and --peak-tflops, then give the layout to fivefold train"
        )
    # FP8 tensor cores (NVIDIA's compute capability 8.9 and later; AMD's MI300) run dense FP8 at
    # twice the bf16 rate
    nvidia_fp8 = torch.version.hip is None and (props.major, props.minor) >= (8, 9)
    fp8 = 2 * table / 1e12 if nvidia_fp8 or "MI3" in props.name else 0.0
    return Hardware(
        name=props.name,
        memory_gb=memory_gb,
        peak_tflops=table / 1e12,
        fp8_peak_tflops=fp8,
        gpus_per_node=ranks_per_node,
    ).check()
