"""How the cost grows with the work (docs/benchmarks.md#scaling-10m-40m-and-125m-parameters): fivefold against torch,
and against the machine, at three model sizes.

Per size (presets ``small`` ≈10M, ``bench-40m`` ≈40M, ``bench-120m`` ≈125M parameters), one launch each of:

- DDP at every world in ``worlds`` (fivefold DDP, torch DDP; at world 2 also the "ideal": each rank trains its own
  batch alone, no communication);
- ZeRO-3 at world 2: fivefold and FSDP2 resharding after forward (3Ψ of traffic per step) and keeping the gathered
  units for backward (``reshard_after_forward`` false: 2Ψ), and the ideal;
- TP 2 (no SP): fivefold against torch's DTensor TP, both ranks the same ``tp_batch`` sequences.

Every row gives the median step time (slowest rank), fivefold / torch (paired rounds), the step / ideal where there
is one, the bytes a rank sends per step, and MFU: the model FLOPs of the step (`formulas.model_flops_per_token` ×
tokens: 6·N + 6·n_layers·L·D per token, causal attention's half) over the step time and the peak of the cores the
ranks run on, each core's peak the 1-thread matmul probe of `fivefold.observe.peak.cpu_peak_flops` — with 4 ranks on 2 cores the peak is that of 2.
Data-parallel rows are checked against their formulas by `bench.data_parallel` (mismatches are listed).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from bench.data_parallel import DDP_CONTESTANTS, IDEAL, DPSpec, run_dp_contest, zero_contestants
from bench.harness import markdown_table
from bench.tensor_parallel import TPSpec, bench_tp
from fivefold.formulas import model_flops_per_token
from fivefold.models import get_config
from fivefold.models.llama import param_counts
from fivefold.observe.peak import cpu_peak_flops

__all__ = ["ScaleSpec", "bench_scaling", "format_scaling_table"]


@dataclass(frozen=True)
class ScaleSpec:
    presets: tuple[str, ...] = ("small", "bench-40m", "bench-120m")
    worlds: tuple[int, ...] = (2, 4)  # DDP's; ZeRO-3 and TP run at 2
    steps: int = 8  # timed steps per contestant
    warmup: int = 1  # untimed (1: the backward's peak is not sampled, which is slow on large models)
    repeats: int = 4  # alternating blocks
    micro_batch: int = 4  # sequences per rank per step (DDP, ZeRO-3)
    tp_batch: int = 8  # sequences per step on both TP ranks: the same global batch as data parallel at world 2
    seq_len: int = 128
    threads: int = 1  # torch threads per rank
    seed: int = 0


def _flops_per_token(preset: str, seq_len: int) -> int:
    config = get_config(preset)
    return model_flops_per_token(param_counts(config)[1], config.n_layers, seq_len, config.n_heads * config.head_dim)


def _rows(result: dict, layout: str, world: int, tokens_per_step: int, flops_per_token: int,
          core_peak: float, threads: int) -> list[dict[str, Any]]:
    """One row per contestant: step time, ratios, bytes, MFU against the cores the ranks share."""
    cores = min(world * threads, os.cpu_count() or 1)
    rows = []
    for impl in result["impls"]:
        vs = impl.get("vs_reference")
        rows.append(dict(
            layout=layout, world=world, name=impl["name"], baseline=impl.get("baseline"), median_s=impl["median_s"],
            ratio_paired=impl.get("ratio_paired"), vs_ideal=vs["ratio_paired"] if vs else None,
            payload_bytes=impl["payload_bytes"], mismatches=impl.get("mismatches", []),
            mfu=tokens_per_step * flops_per_token / impl["median_s"] / (cores * core_peak),
            oversubscribed=world * threads > (os.cpu_count() or 1)))
    return rows


def bench_scaling(spec: ScaleSpec | None = None) -> dict:
    """Every size's DDP (per world), ZeRO-3 (+ kept) and TP 2 contests; ``rows`` per contestant (see module doc)."""
    spec = spec or ScaleSpec()
    for preset in spec.presets:
        get_config(preset)  # fail early on a bad preset
    core_peak = cpu_peak_flops(spec.threads)
    sizes = []
    for preset in spec.presets:
        flops = _flops_per_token(preset, spec.seq_len)
        dp_spec = dict(preset=preset, steps=spec.steps, warmup=spec.warmup, repeats=spec.repeats,
                       micro_batch=spec.micro_batch, seq_len=spec.seq_len, threads=spec.threads, seed=spec.seed)
        rows: list[dict[str, Any]] = []
        for world in spec.worlds:
            # the ideal at world 2 only: oversubscribed ranks make it as slow as the cores' sharing, and at the
            # largest size a third model per rank would not fit 4 ranks in memory
            contestants = (*DDP_CONTESTANTS[:2], IDEAL) if world == 2 else DDP_CONTESTANTS[:2]
            result = run_dp_contest(DPSpec(world=world, **dp_spec), contestants, "ddp")
            rows += _rows(result, "DDP", world, world * spec.micro_batch * spec.seq_len, flops, core_peak,
                          spec.threads)
        result = run_dp_contest(DPSpec(world=2, decay_groups=True, **dp_spec), zero_contestants((3,), keep=True),
                                "zero")
        rows += [r for r in _rows(result, "ZeRO-3", 2, 2 * spec.micro_batch * spec.seq_len, flops, core_peak,
                                  spec.threads) if r["name"] != IDEAL.name]
        result = bench_tp(TPSpec(preset=preset, tp=2, sequence_parallel=(False,), steps=spec.steps,
                                 warmup=spec.warmup, repeats=spec.repeats, batch=spec.tp_batch, seq_len=spec.seq_len,
                                 threads=spec.threads, seed=spec.seed))
        rows += _rows(result, "TP 2", 2, spec.tp_batch * spec.seq_len, flops, core_peak, spec.threads)
        sizes.append(dict(preset=preset, params=param_counts(get_config(preset))[0], flops_per_token=flops,
                          rows=rows))
    return dict(kind="scaling", spec=asdict(spec), core_peak_flops=core_peak, cpu_count=os.cpu_count(), sizes=sizes)


def format_scaling_table(results: dict) -> str:
    """One markdown table over sizes and layouts, then the settings."""
    spec = results["spec"]
    table = [("size", "layout", "world", "impl", "vs", "median step ms", "fivefold / torch (paired)",
              "step / ideal (paired)", "MFU", "payload MiB/step/rank")]
    problems = []
    for size in results["sizes"]:
        label = f"{size['preset']} ({size['params'] / 1e6:.1f}M)"
        for r in size["rows"]:
            world = f"{r['world']}" + (" (oversubscribed)" if r["oversubscribed"] else "")
            table.append((label, r["layout"], world, r["name"], r["baseline"] or "", f"{r['median_s'] * 1e3:.1f}",
                          f"{r['ratio_paired']:.3f}" if r["ratio_paired"] is not None else "",
                          f"{r['vs_ideal']:.3f}" if r["vs_ideal"] is not None else "", f"{r['mfu']:.3f}",
                          f"{r['payload_bytes'] / 2**20:.1f}"))
            problems += [f"- {label} {r['name']}: {p}" for p in r["mismatches"]]
    out = markdown_table(table)
    out += ["", f"MFU = model FLOPs of the step (6·N + 6·n_layers·L·D per token: causal attention's half, N without embeddings) / (step time × "
                f"peak of the cores in use); a core's peak: {results['core_peak_flops'] / 1e9:.1f} GFLOP/s "
                f"(fivefold.observe.peak's fp32 matmul probe, {spec['threads']} thread); {results['cpu_count']} cores, so "
                "4 ranks share 2 cores and their MFU is against the peak of 2",
            "fivefold-z3 / torch-FSDP2 reshard after forward (AG 2Ψ + RS Ψ); the -keep rows keep every unit gathered "
            "from its forward to its backward (AG Ψ + RS Ψ; the whole model's full parameters, 4Ψ, are held at the "
            "end of the forward)",
            f"DDP and ZeRO-3: {spec['micro_batch']} × {spec['seq_len']} tokens per rank and step; TP 2: "
            f"{spec['tp_batch']} × {spec['seq_len']} on both ranks (no SP); fp32, AdamW, gloo, {spec['threads']} "
            f"thread(s) per rank; {spec['steps']} timed steps (+{spec['warmup']} warmup) per impl in "
            f"{spec['repeats']} alternating blocks"]
    out.append("mismatches against the formulas:\n" + "\n".join(problems) if problems
               else "every data-parallel row's measured bytes and model states match its formula")
    return "\n".join(out)
