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
    """One GPU and its links. Bandwidths are GB/s one GPU sends in one direction (what a ring's wire
    bytes take): an H100's NVLink 4 is 450 GB/s each way — the 900 GB/s usually quoted counts both
    directions —, InfiniBand NDR 400 Gb/s = 50 GB/s per GPU. The peak is dense bf16 (set it for fp32
    / TF32); ``compute_efficiency`` is the share of it the model's matmuls reach, an assumption to
    set from your own measurements."""

    name: str = "H100-80GB"
    memory_gb: float = 80.0
    peak_tflops: float = 989.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    gpus_per_node: int = 8
    hbm_gbps: float = 3350.0  # the optimizer step streams its states through memory
    compute_efficiency: float = 0.6

    def check(self) -> Hardware:
        """Raise a ValueError naming a value that cannot describe a machine; return self."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not value > 0:
                raise ValueError(f"hardware {f.name}={value} must be positive")
        if self.compute_efficiency > 1:
            raise ValueError(
                f"compute efficiency {self.compute_efficiency} is a fraction of the peak: at most 1"
            )
        return self


HARDWARE = {
    "h100": Hardware(),
    "h200": Hardware(name="H200-141GB", memory_gb=141.0, hbm_gbps=4800.0),
    "h800": Hardware(name="H800-80GB", intra_node_gbps=200.0),  # NVLink cut to 400 GB/s both ways
    "a100": Hardware(
        name="A100-80GB",
        peak_tflops=312.0,
        intra_node_gbps=300.0,
        inter_node_gbps=25.0,
        hbm_gbps=2039.0,
    ),
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
    a ValueError for a device the table does not know); on the CPU a peak measured once with a
    rank's one thread (`observe.peak.cpu_peak_flops`, in the compute dtype of ``compute_bytes``)
    and memory and loopback bandwidths (`observe.peak.cpu_bandwidths`), the host's memory shared by
    its ``ranks_per_node`` ranks, every rank on one node."""
    import os

    import torch

    from fivefold.observe import peak

    dtype = {4: torch.float32, 2: torch.bfloat16}[compute_bytes]
    if device_type == "cpu":
        memory, loopback = peak.cpu_bandwidths()
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return Hardware(
            name="cpu",
            memory_gb=host / ranks_per_node / GB,
            peak_tflops=peak.cpu_peak_flops(1, dtype) / 1e12,
            intra_node_gbps=loopback / GB,
            inter_node_gbps=loopback / GB,
            gpus_per_node=ranks_per_node,
            hbm_gbps=memory / GB,
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
    return Hardware(
        name=props.name, memory_gb=memory_gb, peak_tflops=table / 1e12, gpus_per_node=ranks_per_node
    ).check()
