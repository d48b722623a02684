"""Tensor-parallel contestants: fivefold TP (and TP + SP) against torch's DTensor TP.

fivefold `apply_tensor_parallel` (Megatron f/g, vocab-parallel embedding and cross-entropy; SP:
all-gather / reduce-scatter along the sequence) vs torch DTensor TP: `parallelize_module` with a
torchtitan-like plan for the same module names —

- ``tok_embeddings``: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if SP else
  Replicate())`` (vocabulary-sharded embedding);
- ``attention`` / ``feed_forward``: ``PrepareModuleInput(input_layouts=Shard(1) if SP else Replicate(),
  desired_input_layouts=Replicate())`` — one DTensor input shared by the column-parallel layers, so
  their input gradients are summed locally (as Partial) and reduced once per region (torchtitan
  does this under SP; used without SP too, else every one of wq/wk/wv/w1/w3 would all-reduce its
  own input gradient);
- ``wq``/``wk``/``wv``, ``w1``/``w3``: ``ColwiseParallel()``; ``wo``, ``w2``:
  ``RowwiseParallel(output_layouts=Shard(1) if SP else Replicate())``;
- SP only: ``SequenceParallel()`` on ``attention_norm``, ``ffn_norm`` and ``norm``;
- ``output``: ``ColwiseParallel(input_layouts=Shard(1) if SP else Replicate(), output_layouts=Shard(-1),
  use_local_output=False)`` and the cross-entropy under ``loss_parallel()`` — the logits are never
  gathered, like fivefold's vocab-parallel loss.

Our `Attention` reads its local head count from its input/weight shapes; with ``use_local_output=True``
(the default of Colwise/Rowwise) the projections return plain local tensors, so the reshape sees
local heads and the model runs unchanged (verified: losses agree with fivefold and single-process).

Every TP rank sees the *same* batch. A step is zero_grad + forward + loss + backward + AdamW step,
all timed. Bytes per step and rank: fivefold from its `CommLog`, checked against
`fivefold.formulas.tp_comm_formula`; torch measured on its first (warmup, untimed) step with
`bench.torch_collectives.byte_counting_mode`, around forward, backward *and* the optimizer step
(DTensor reduces the SP norms' Partial gradients there).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from bench.harness import (
    CPU_LEGEND,
    OP_SHORT,
    RATIO_LEGEND,
    CommBytes,
    Contestant,
    Runner,
    blocks,
    log_bytes,
    markdown_table,
    mib,
    ops_text,
    ratio_line,
    run_contest,
    time_rows,
)
from bench.torch_collectives import byte_counting_mode
from fivefold.distributed.comm import Comm, CommLog
from fivefold.formulas import tp_comm_formula, tp_comm_formula_text
from fivefold.models import build_model, get_config

__all__ = ["TPSpec", "bench_tp", "format_tp_table", "torch_tp_plan", "tp_contestants"]


@dataclass(frozen=True)
class TPSpec:
    """A TP contest (picklable: sent to every rank). ``batch`` sequences, the same on every rank."""

    preset: str = "small"
    tp: int = 2
    sequence_parallel: tuple[bool, ...] = (False, True)
    steps: int = 24  # timed steps per contestant
    warmup: int = 2  # untimed; torch's bytes are counted on its first one
    repeats: int = 8
    batch: int = 8
    seq_len: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 1

    shard_batch: ClassVar[bool] = False  # every TP rank holds the whole batch

    @property
    def world(self) -> int:
        return self.tp

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len

    def rows(self, info: dict[str, Any]) -> int:
        return self.batch


# -- contestants --------------------------------------------------------------------------------------

def _formula_info(config: Any, spec: TPSpec, sequence_parallel: bool) -> dict[str, Any]:
    return dict(formula=tp_comm_formula(config, spec.batch, spec.seq_len, sequence_parallel),
                formula_text=tp_comm_formula_text(sequence_parallel))


def build_fivefold_tp(config: Any, spec: TPSpec, world: Comm, sequence_parallel: bool) -> Runner:
    from fivefold.models.parallelize import apply_tensor_parallel, tp_loss

    model = build_model(config, seed=spec.seed)
    log = CommLog()
    comm = Comm(None, "tp", log)
    apply_tensor_parallel(model, comm, sequence_parallel)
    loss_fn = tp_loss(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return Runner(step, reset_comm=log.reset, comm=log_bytes(log, comm.size),
                  comm_source="measured (CommLog), every step",
                  notes=[f"fivefold TP{'+SP' if sequence_parallel else ''}: apply_tensor_parallel "
                         "(LLAMA_TP_PLAN), vocab-parallel cross-entropy (tp_loss), AdamW over the local shards"],
                  info=_formula_info(config, spec, sequence_parallel))


def torch_tp_plan(n_layers: int, sequence_parallel: bool) -> dict[str, Any]:
    """The torchtitan-like DTensor plan for our module names (see module doc), as one flat dict."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(n_layers):
        p = f"layers.{i}."
        plan.update({
            # Attention.forward(x, cos, sin): only x is laid out.
            p + "attention": PrepareModuleInput(input_layouts=(seq, None, None),
                                                desired_input_layouts=(Replicate(), None, None)),
            p + "attention.wq": ColwiseParallel(),
            p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(),
            p + "attention.wo": RowwiseParallel(output_layouts=seq),
            p + "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            p + "feed_forward.w1": ColwiseParallel(),
            p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        })
        if sequence_parallel:
            plan[p + "attention_norm"] = SequenceParallel()
            plan[p + "ffn_norm"] = SequenceParallel()
    return plan


def build_torch_tp(config: Any, spec: TPSpec, world: Comm, sequence_parallel: bool) -> Runner:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    model = build_model(config, seed=spec.seed)
    mesh = init_device_mesh("cpu", (world.size,))
    parallelize_module(model, mesh, torch_tp_plan(config.n_layers, sequence_parallel))
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    counted: dict[str, tuple[int, int]] = {}
    comm_counts: dict[str, int] = {}
    n_steps = [0]

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = model(x)  # DTensor [B, L, V] sharded on the vocabulary
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        return loss

    def step(x: torch.Tensor, y: torch.Tensor, during_backward: Any) -> Any:
        n_steps[0] += 1
        if n_steps[0] > 1:
            return train_step(x, y)
        mode = byte_counting_mode()  # first (warmup) step only: the dispatch mode is slow
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the module tracker's full-backward-hook warning
            with mode:
                loss = train_step(x, y).item()
        counted.update({op: (c, b) for op, (c, b) in sorted(mode.by_op.items())})
        comm_counts.update({str(k).rpartition(".")[2]: v for k, v in mode.get_comm_counts().items()})
        return loss

    def comm() -> CommBytes:
        return CommBytes.from_ops(counted, world.size)

    return Runner(step, comm=comm,
                  comm_source="measured on the first step (CommDebugMode + payload bytes of each "
                              "functional collective), forward + backward + optimizer step",
                  notes=[f"torch DTensor TP{'+SP' if sequence_parallel else ''}: parallelize_module, "
                         "torchtitan-like plan (PrepareModuleInput per attention/MLP region"
                         + (", SequenceParallel norms" if sequence_parallel else "")
                         + "), head ColwiseParallel(output Shard(-1)) + loss_parallel() (logits not "
                         "gathered), AdamW over DTensor parameters"],
                  info=dict(comm_debug_counts=comm_counts, **_formula_info(config, spec, sequence_parallel)))


def tp_contestants(sequence_parallel: Sequence[bool] = (False, True)) -> tuple[Contestant, ...]:
    out: list[Contestant] = []
    for sp in sequence_parallel:
        tag = "TP+SP" if sp else "TP"
        out += [Contestant(f"fivefold-{tag}", functools.partial(build_fivefold_tp, sequence_parallel=sp),
                           baseline=f"torch-{tag}"),
                Contestant(f"torch-{tag}", functools.partial(build_torch_tp, sequence_parallel=sp))]
    return tuple(out)


def bench_tp(spec: TPSpec | None = None, **overrides: Any) -> dict:
    """fivefold TP (and TP+SP) vs torch DTensor TP on ``spec.tp`` gloo ranks, one launch.

    Returns ``impls`` (per contestant: median/p25/p75/min step time of the slowest rank, tokens/s,
    bytes per step by op, global losses per step; ``info["formula"]``: fivefold's plan by
    `tp_comm_formula`) and ``pairs`` (ratio fivefold/torch median, paired, of mins, CPU time; max
    |loss difference|). warmup >= 1: torch's bytes are counted on a warmup step."""
    spec = replace(spec or TPSpec(), **overrides)
    get_config(spec.preset)  # fail early on a bad preset
    return run_contest("tp", spec, tp_contestants(spec.sequence_parallel), min_warmup=1)


# -- output -----------------------------------------------------------------------------------------

def _diff_ops(got: dict[str, int], want: dict[str, int]) -> str:
    return ", ".join(f"{OP_SHORT.get(op, op)} {got.get(op, 0) - want.get(op, 0):+,} B"
                     for op in sorted(set(got) | set(want)) if got.get(op, 0) != want.get(op, 0)) or "varies"


def format_tp_table(results: dict) -> str:
    """Markdown tables of a `bench_tp` result (time, bytes against the formula) with the settings below."""
    spec = results["spec"]
    out = markdown_table(time_rows(results, cpu=True))
    out += [f"{RATIO_LEGEND}; {CPU_LEGEND}, less sensitive to other load on the machine than wall time"]
    out += ["", "communication per step and rank (payload = the collectives' full buffers; wire = ring formula):"]
    rows = [("impl", "collectives", "payload MiB", "wire MiB", "formula (fivefold's plan)", "formula MiB", "matches",
             "bytes")]
    for r in results["impls"]:
        formula = r["info"].get("formula")
        got = {op: b for op, (_, b) in r["comm_by_op"].items()}
        matches = "" if formula is None else ("yes" if got == formula and r["comm_constant"] else
                                              "NO: " + _diff_ops(got, formula))
        rows.append((r["name"], ops_text(r["comm_by_op"]), mib(r["payload_bytes"]), mib(r["wire_bytes"]),
                     r["info"].get("formula_text", ""), mib(sum(formula.values())) if formula else "",
                     matches, r["comm_source"]))
    out += markdown_table(rows)
    out.append("")
    out += [ratio_line(p, cpu=True) for p in results["pairs"]]
    c = get_config(spec["preset"])
    out += [f"preset {spec['preset']} (n={c.n_layers} layers, D={c.dim}, Ψ={results['params']:,}), tp {spec['tp']} "
            f"(gloo, {spec['threads']} thread(s)/rank), B={spec['batch']} × L={spec['seq_len']} = "
            f"{spec['batch'] * spec['seq_len']:,} tokens/step (the same batch on every TP rank), "
            f"AdamW(lr={spec['lr']}, weight_decay={spec['weight_decay']}), {spec['steps']} timed steps "
            f"(+{spec['warmup']} warmup) per impl in {len(blocks(spec['steps'], spec['repeats']))} alternating "
            "blocks; step = zero_grad + forward + loss + backward + AdamW step, time of the slowest rank"]
    for r in results["impls"]:
        out += [f"- {note}" for note in r["notes"]]
        counts = r["info"].get("comm_debug_counts")
        if counts:
            out.append(f"  CommDebugMode counts: {dict(sorted(counts.items()))}")
    return "\n".join(out)
