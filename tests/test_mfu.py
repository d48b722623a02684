"""MFU's arithmetic (docs/design.md#flops-and-mfu): FLOPs per token counted by hand, and the peaks.

Model FLOPs per token by fivefold's convention (attention's causal half), counted by hand from the shapes for two presets; the CPU
peak probe the trainer divides by (positive, bounded, cached; marked `multiprocess` because
`platform.processor()` runs `uname`) and accelerator peaks from the table or an override: a
table key matches whole words of a device's name, an unknown device gives MFU None, never an error."""

from __future__ import annotations

import time

import pytest
import torch

from fivefold.formulas import model_flops_per_token
from fivefold.models.llama import get_config, param_counts
from fivefold.observe import peak


def _by_hand_8b(seq_len: int) -> int:
    """Llama-3 8B: D 4096, 32 blocks, 32 heads of 128, 8 kv heads, SwiGLU hidden 14336, vocabulary 128256."""
    d, kv, f, v, n = 4096, 8 * 128, 14336, 128256, 32
    block = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d  # wq, wk, wv, wo, w1 w2 w3, two norms
    active = n * block + d + v * d  # + final norm + head (the embedding is a lookup)
    return 6 * active + 6 * n * seq_len * d  # causal: half of PaLM's 12·n·L·D


def _by_hand_tiny_moe(seq_len: int) -> int:
    """tiny-moe: D 128, 4 blocks, 4 heads of 32, 2 kv heads, 8 experts of hidden 256 in every block, top 2."""
    d, kv, e, k, h, v, n = 128, 2 * 32, 8, 2, 256, 256, 4
    attention = 2 * d * d + 2 * d * kv + 2 * d
    moe = d * e + k * 3 * d * h  # the router, and the top-2 experts a token goes through
    return 6 * (n * (attention + moe) + d + v * d) + 6 * n * seq_len * d


@pytest.mark.parametrize("preset, by_hand", [("llama3-8b", _by_hand_8b), ("tiny-moe", _by_hand_tiny_moe)])
def test_flops_per_token_by_hand(preset, by_hand):
    config = get_config(preset)
    _, active = param_counts(config)
    for seq_len in (128, 8192):
        assert model_flops_per_token(active, config.n_layers, seq_len, config.dim) == by_hand(seq_len)


@pytest.mark.multiprocess
def test_cpu_peak_probe_is_positive_bounded_and_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(peak, "_CACHE", tmp_path / "cpu_peak.json")
    start = time.perf_counter()
    measured = peak.cpu_peak_flops(1, torch.float32, seconds=0.2)
    assert 1e8 < measured < 1e13 and time.perf_counter() - start < 5.0
    assert (tmp_path / "cpu_peak.json").exists()
    start = time.perf_counter()
    assert peak.cpu_peak_flops(1, torch.float32) == measured and time.perf_counter() - start < 0.1  # cached
    assert peak.device_peak_flops(torch.device("cpu"), torch.float32, override_tflops=2.5) == 2.5e12


def test_accelerator_peaks_come_from_the_table_or_an_override():
    assert peak.DEVICE_PEAKS["H100"] == (989.0, 494.5)
    assert peak.device_peak_flops(torch.device("meta"), torch.bfloat16, override_tflops=312.0) == 312e12


@pytest.mark.parametrize(
    "name, half_tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA GeForce RTX 4090", 165.0),
        ("AMD Instinct MI300X", 1307.0),
        # not in the table: MFU is n/a, never an error, and never a neighbour's figure
        ("NVIDIA L40", None),
        ("NVIDIA B200", None),
        ("NVIDIA GB200", None),
        ("NVIDIA H20", None),
        ("NVIDIA A1000", None),
    ],
)
def test_device_names_match_whole_words_of_the_table(name, half_tflops):
    got = peak.table_peak(name, torch.bfloat16)
    assert got == (None if half_tflops is None else half_tflops * 1e12)


def test_an_unknown_peak_gives_no_mfu():
    from fivefold.train.metrics import Throughput

    assert Throughput(1024, 6e6, None, 8).mfu(0.5) is None
    assert Throughput(1024, 6e6, 1e12, 1).mfu(1.0) == pytest.approx(1024 * 6e6 / 1e12)
