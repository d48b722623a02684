"""ZeRO++ contestants (docs/design.md#zero-qwz-qgz-hpz): fivefold ZeRO-3 with qwZ / qgZ / hpZ against plain ZeRO-3.

Every contestant is `ZeroDataParallel(zero_stage=3)` on the same model, data and AdamW; they differ only in the
ZeRO++ switches. Bytes per step and rank come from each contestant's `CommLog`, by op *and* mesh dimension (hpZ's
backward all-gathers run over ``dp_hpz``), and are checked against `fivefold.formulas` (`zero3_gather_bytes`,
`zero_grad_reduce_bytes`); hpZ's extra parameter memory against `hpz_secondary_bytes`.

What the times mean here: gloo on one machine moves bytes by memory copies, so a 2-4× smaller payload saves little
time while quantising and dequantising costs compute; the time ratios measure that overhead, not ZeRO++'s benefit on
a network-bound cluster (the paper's setting). The bytes are what carries over.

DeepSpeed's own ZeRO++ (``zero_quantized_weights``, ``zero_quantized_gradients``, ``zero_hpz_partition_size``) is not
a contestant: see `DEEPSPEED_NOTE`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from bench.harness import (
    RATIO_LEGEND,
    CommBytes,
    Contestant,
    Runner,
    blocks,
    lm_loss,
    markdown_table,
    mib,
    ops_text,
    ratio_line,
    run_contest,
    time_rows,
)
from fivefold.distributed.comm import Comm, CommLog
from fivefold.formulas import hpz_secondary_bytes, zero3_gather_bytes, zero_grad_reduce_bytes
from fivefold.models import build_model
from fivefold.observe.memory import model_state_bytes

__all__ = ["DEEPSPEED_NOTE", "ZeroPPSpec", "bench_zeropp", "format_zeropp_table", "zeropp_contestants"]

# What was found when trying DeepSpeed's ZeRO++ as a counterpart on this CPU/gloo machine (see
# docs/layouts.md#zero-qwz-qgz-hpz).
DEEPSPEED_NOTE = (
    "DeepSpeed's ZeRO++ is not a contestant: with deepspeed 0.19.8 on this CPU/gloo machine (DS_ACCELERATOR=cpu), "
    "zero_quantized_weights and zero_quantized_gradients fail at start-up ('This op had not been implemented on CPU "
    "backend': its quantiser is a CUDA op), and zero_hpz_partition_size 2 of 4 ranks runs but every all-gather we "
    "counted still spanned all 4 ranks (no secondary-group gather to compare with)")


@dataclass(frozen=True)
class ZeroPPSpec:
    """A ZeRO++ contest (picklable: sent to every rank)."""

    preset: str = "small"
    world: int = 4  # hpZ needs a group smaller than dp: hpz 2 of 4
    steps: int = 16  # timed steps per contestant
    warmup: int = 2
    repeats: int = 4
    micro_batch: int = 2  # sequences per rank per step
    seq_len: int = 128
    dtype: str = "bf16"  # parameters and gradients (ZeRO++'s setting: 16-bit collectives become int8)
    quant_block: int = 2048
    hpz: int = 2  # 0: no hpZ contestants
    lr: float = 1e-3
    seed: int = 0
    threads: int = 1

    shard_batch: ClassVar[bool] = True

    @property
    def tokens_per_step(self) -> int:
        return self.world * self.micro_batch * self.seq_len

    def rows(self, info: dict[str, Any]) -> int:
        return self.world * self.micro_batch


def _log_bytes_by_dim(log: CommLog):
    """A step's traffic keyed by ``op`` (over dp) or ``op@dim`` (other dimensions), wire bytes per record."""
    def comm() -> CommBytes:
        by: dict[str, tuple[int, int]] = {}
        for r in log.records:
            key = r.op if r.dim == "dp" else f"{r.op}@{r.dim}"
            calls, payload = by.get(key, (0, 0))
            by[key] = (calls + 1, payload + r.payload_bytes)
        return CommBytes(len(log.records), sum(r.payload_bytes for r in log.records),
                         sum(r.wire_bytes for r in log.records), dict(sorted(by.items())))
    return comm


def expected_bytes(units: list[int], world: int, width: int, block: int, qwz: bool, qgz: bool,
                   hpz: bool) -> dict[str, int]:
    """The formula's bytes per step by the keys `_log_bytes_by_dim` uses."""
    forward = zero3_gather_bytes(units, world, width, block if qwz else None)
    out = {"all_gather": forward + (0 if hpz else forward)}  # backward: again over dp, or inside the hpZ group
    if hpz:
        out["all_gather@dp_hpz"] = zero3_gather_bytes(units, world, width)  # unquantised, as in ZeRO++
    out["all_to_all" if qgz else "reduce_scatter"] = zero_grad_reduce_bytes(units, world, width, block if qgz else None)
    return out


def build_zero3(config: Any, spec: ZeroPPSpec, world: Comm, qwz: bool = False, qgz: bool = False,
                hpz: bool = False) -> Runner:
    from fivefold.data_parallel import MixedPrecision, ZeroDataParallel
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh

    log = CommLog()
    mesh = ParallelMesh(ParallelDims(dp=world.size), comm_log=log) if hpz else None
    comm = mesh.comm("dp") if mesh is not None else Comm(None, "dp", log)
    engine = ZeroDataParallel(build_model(config, seed=spec.seed), comm, zero_stage=3, lr=spec.lr,
                              mixed_precision=MixedPrecision.from_names(spec.dtype, spec.dtype),
                              qwz=qwz, qgz=qgz, quant_block=spec.quant_block,
                              hpz_comm=mesh.hpz_comm(spec.hpz) if mesh is not None else None)

    def forward_backward(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        loss = lm_loss(engine(x).float(), y)
        with during_backward:
            engine.backward(loss)
        return loss

    units = [f.layout.padded_numel for f in engine.flats]
    width = torch.empty(0, dtype=engine.mp.param_dtype).element_size()
    switches = [name for name, on in (("qwZ", qwz), ("qgZ", qgz), (f"hpZ({spec.hpz})", hpz)) if on]
    return Runner(forward_backward, lambda: engine.step(None), reset_comm=log.reset, comm=_log_bytes_by_dim(log),
                  comm_source="measured (CommLog)",
                  notes=[f"ZeRO-3{'+' + '+'.join(switches) if switches else ''}: {len(units)} units, "
                         f"{spec.dtype} params and reduce, quant_block {spec.quant_block}"],
                  memory=lambda: (model_state_bytes(engine), 0), roots=[engine],
                  info=dict(units=units, width=width, qwz=qwz, qgz=qgz, hpz=hpz,
                            expected=expected_bytes(units, world.size, width, spec.quant_block, qwz, qgz, hpz),
                            secondary_bytes=hpz_secondary_bytes(units, spec.hpz, width) if hpz else 0))


def zeropp_contestants(hpz: bool = True) -> tuple[Contestant, ...]:
    """Plain ZeRO-3 (the baseline) and each switch, alone and together."""
    variants = {"qwZ": dict(qwz=True), "qgZ": dict(qgz=True), "qwZ+qgZ": dict(qwz=True, qgz=True)}
    if hpz:
        variants.update({"hpZ": dict(hpz=True), "qwZ+qgZ+hpZ": dict(qwz=True, qgz=True, hpz=True)})
    return (Contestant("zero3", build_zero3),
            *(Contestant(name, functools.partial(build_zero3, **kw), "zero3") for name, kw in variants.items()))


def bench_zeropp(spec: ZeroPPSpec | None = None) -> dict:
    """Time and count every contestant of `zeropp_contestants` in one launch; adds to each impl ``expected`` (the
    formula's bytes by op@dim), ``bytes_ratio`` (plain ZeRO-3's payload / this one's), ``mismatches``, and for hpZ the
    measured extra parameter bytes against ``secondary_bytes``."""
    spec = spec or ZeroPPSpec()
    use_hpz = spec.hpz > 1 and spec.world % spec.hpz == 0 and spec.hpz < spec.world
    results = run_contest("zeropp", spec, zeropp_contestants(use_hpz))
    base = results["impls"][0]
    for impl in results["impls"]:
        info = impl["info"]
        got = {key: payload for key, (_, payload) in impl["comm_by_op"].items()}
        problems = [] if got == info["expected"] else [f"bytes per step {got} != formula {info['expected']}"]
        if not impl["comm_constant"]:
            problems.append("bytes per step vary between steps")
        if impl.get("memory") and base.get("memory"):
            extra = impl["memory"]["params"] - base["memory"]["params"]
            impl["extra_param_bytes"] = extra
            if extra != info["secondary_bytes"]:
                problems.append(f"extra parameter bytes {extra:,} != hpZ formula {info['secondary_bytes']:,}")
        impl["bytes_ratio"] = base["payload_bytes"] / impl["payload_bytes"]
        impl["mismatches"] = problems
    results["deepspeed"] = DEEPSPEED_NOTE
    return results


def format_zeropp_table(results: dict) -> str:
    spec = results["spec"]
    out = markdown_table(time_rows(results, cpu=True))
    out += [RATIO_LEGEND]
    rows = [("impl", "collectives", "payload MiB", "wire MiB", "bytes vs zero3", "formula MiB", "matches",
             "params MiB (max rank)", "hpZ copy MiB")]
    for r in results["impls"]:
        exp = sum(r["info"]["expected"].values())
        mem = r.get("memory") or {}
        rows.append((r["name"], ops_text(r["comm_by_op"]), mib(r["payload_bytes"]), mib(r["wire_bytes"]),
                     f"{r['bytes_ratio']:.2f}×", mib(exp), "yes" if not r["mismatches"] else "NO",
                     mib(mem["params"]) if mem else "-", mib(r["info"]["secondary_bytes"])))
    out += ["", "communication per step and rank (payload = the collectives' full buffers; @dp_hpz: inside the hpZ "
                "group) and parameter memory:"]
    out += markdown_table(rows)
    out += ["", *[ratio_line(p, cpu=True, loss_over="steps") for p in results["pairs"]]]
    out += [f"Ψ = {results['params']:,}, preset {spec['preset']}, world {spec['world']} (gloo, {spec['threads']} "
            f"thread(s)/rank), {spec['dtype']}, quant_block {spec['quant_block']}, hpz {spec['hpz']}, micro_batch "
            f"{spec['micro_batch']} × seq_len {spec['seq_len']} per rank, {spec['steps']} timed steps (+"
            f"{spec['warmup']}) per impl in {len(blocks(spec['steps'], spec['repeats']))} alternating blocks",
            "On one machine gloo moves bytes by memory copies: the time ratios show the cost of quantising, not the "
            "saving of a slower network.", results["deepspeed"]]
    problems = [f"- {r['name']}: {p}" for r in results["impls"] for p in r["mismatches"]]
    out += ["mismatches against the formulas:", *problems] if problems else [
        "every contestant's bytes (and hpZ's extra memory) match the formulas"]
    return "\n".join(out)
