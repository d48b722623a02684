"""Activation recompute: memory against step time for none / full / selective, at a sequence length where
activations dominate the model states, with torch's own full recompute (`apply_activation_checkpointing` with
`checkpoint_wrapper` around every block) as the reference.

One process (the cost is per rank and needs no peer), one model per contestant built from the same seed, the same
batches, timed in alternating blocks (paired ratios against ``none``). Per contestant: the activations the forward keeps
for backward (`fivefold.observe.memory.block_activation_bytes` on the whole model: storages it allocated that are still alive
when it returns) next to `formulas.activation_bytes_per_block` × blocks, the process's peak resident memory above its
size before a forward + backward (Linux VmHWM; large blocks come from mmap so that freed memory leaves the count), and
the median step time (forward, backward, AdamW). Both attention cores: ``eager`` keeps the L×L probabilities (the
activation formula's 5·B·L²·H term, what selective recompute is for), ``sdpa``'s fused kernel keeps none.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness import blocks, freed_blocks_returned, markdown_table, mib, resident_kib

__all__ = ["RecomputeSpec", "bench_recompute", "format_recompute_table"]

CONTESTANTS = ("none", "full", "selective", "torch-full")


@dataclass(frozen=True)
class RecomputeSpec:
    preset: str = "small"
    seq_len: int = 1024
    micro_batch: int = 2
    steps: int = 6
    warmup: int = 1
    repeats: int = 3
    cores: tuple[str, ...] = ("eager", "sdpa")
    seed: int = 0
    threads: int = 2


def _build(name: str, config: Any, core: str) -> Any:
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    from fivefold.models.llama import Llama, TransformerBlock

    model = Llama(config, seed=0).set_attention(core)
    if name == "torch-full":
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda m: isinstance(m, TransformerBlock))
    else:
        model.set_recompute(name)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _worker(spec: RecomputeSpec) -> dict:
    import gc

    import torch
    import torch.nn.functional as F

    from fivefold.formulas import MicroBatch, activation_bytes_per_block
    from fivefold.models import get_config
    from fivefold.observe.memory import block_activation_bytes

    config = get_config(spec.preset, max_seq_len=max(spec.seq_len, get_config(spec.preset).max_seq_len))
    gen = torch.Generator().manual_seed(spec.seed)
    x, y = (torch.randint(0, config.vocab_size, (spec.micro_batch, spec.seq_len), generator=gen) for _ in range(2))
    out: dict[str, Any] = {}
    for core in spec.cores:
        built = {name: _build(name, config, core) for name in CONTESTANTS}

        def step(name: str, built: dict = built) -> float:
            model, opt = built[name]
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return time.perf_counter() - t0

        kept, peak, losses = {}, {}, {}
        for name, (model, _) in built.items():
            with torch.no_grad():
                losses[name] = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
            kept[name] = sum(block_activation_bytes([model], lambda m=model: m(x)))
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")
            before = resident_kib()["VmRSS"]
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            peak[name] = (resident_kib()["VmHWM"] - before) * 1024
            model.zero_grad(set_to_none=True)
            del loss
        for name in built:
            for _ in range(spec.warmup):
                step(name)
        times: dict[str, list[tuple[int, float]]] = {name: [] for name in built}
        for rnd, size in enumerate(blocks(spec.steps, spec.repeats)):
            for name in built:
                times[name] += [(rnd, step(name)) for _ in range(size)]
        per_round = {name: [statistics.median(t for r, t in times[name] if r == rnd)
                            for rnd in range(len(blocks(spec.steps, spec.repeats)))] for name in built}
        c = config
        mb = MicroBatch(spec.micro_batch, spec.seq_len, c.dim)
        formula = {m: c.n_layers * activation_bytes_per_block(mb, c.n_heads, c.n_kv_heads, c.ffn_hidden,
                                                              attention=core, recompute=m)
                   for m in ("none", "full", "selective")}
        formula["torch-full"] = formula["full"]
        out[core] = {name: dict(
            kept_bytes=kept[name], formula_bytes=formula[name], peak_bytes=peak[name], loss=losses[name],
            median_s=statistics.median(t for _, t in times[name]),
            ratio_paired=statistics.median(a / b for a, b in zip(per_round[name], per_round["none"])))
            for name in built}
    return out


def bench_recompute(spec: RecomputeSpec | None = None, **overrides: Any) -> dict:
    """Memory and step time of every recompute mode and torch's full recompute, in one local process."""
    from fivefold.distributed.launch import launch_local
    from fivefold.models import count_params, get_config
    from fivefold.models.llama import Llama

    spec = replace(spec or RecomputeSpec(), **overrides)
    with freed_blocks_returned():  # freed blocks go back to the system: peaks are honest
        result = launch_local(_worker, 1, spec, threads=spec.threads, timeout_s=3600.0)[0]
    return {"kind": "recompute", "spec": asdict(spec), "params": count_params(Llama(get_config(spec.preset),
                                                                                    device="meta")),
            "cores": result}


def format_recompute_table(results: dict) -> str:
    spec = results["spec"]
    rows = [("core", "recompute", "activations kept MiB", "formula MiB", "peak fwd+bwd MiB", "median step ms",
             "vs none (paired)", "loss")]
    for core, by_name in results["cores"].items():
        for name, r in by_name.items():
            rows.append((core, name, mib(r["kept_bytes"]), mib(r["formula_bytes"]), mib(r["peak_bytes"]),
                         f"{r['median_s'] * 1e3:.0f}", f"{r['ratio_paired']:.3f}", f"{r['loss']:.6f}"))
    out = markdown_table(rows)
    out += ["", f"preset {spec['preset']} ({results['params']:,} params, fp32), micro-batch {spec['micro_batch']} × "
            f"{spec['seq_len']} tokens, one process, {spec['threads']} threads; {spec['steps']} timed steps per "
            f"contestant in {spec['repeats']} alternating blocks. activations kept: storages the forward allocated "
            "that are alive when it returns (formula: activation_bytes_per_block × blocks; the embedding, final norm "
            "and logits come on top); peak: resident high-water mark above the start of a forward + backward; "
            "torch-full: torch's checkpoint_wrapper around every block."]
    return "\n".join(out)
