"""How long one rank's work takes on a machine (docs/design.md#step-time-model): matmuls by their
GEMM shape, the attention core by its kernel's efficiency, elementwise kernels by the bytes they
move over memory bandwidth, and every operator's host time — the `Hardware` fields it reads.

A stage's work is read off the layout `parallelize` builds (`assembly`): every 2-D weight of the
stage is a GEMM of the tokens it sees (m) by its local shape (n × k) — the TP slice, an expert's
rows under ep —, three times per micro-batch (forward, the input gradient, the weight gradient).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from fivefold import formulas
from fivefold.config import Config
from fivefold.models.plans import is_float8_weight
from fivefold.plan.hardware import GB, Hardware
from fivefold.run_plan import RunPlan

__all__ = [
    "Work",
    "gemm_efficiency",
    "gemm_seconds",
    "operator_counts",
    "ops_per_block",
    "stage_work",
]


def _table(points: tuple[tuple[int, float], ...], size: int) -> float:
    """The table's fraction at ``size``: linear in log size between points, flat beyond the ends."""
    pts = sorted(points)
    if size <= pts[0][0]:
        return pts[0][1]
    for (s0, e0), (s1, e1) in zip(pts, pts[1:]):
        if size <= s1:
            t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
            return e0 + t * (e1 - e0)
    return pts[-1][1]


def gemm_efficiency(m: int, n: int, k: int, hw: Hardware) -> float:
    """The fraction of the peak an (m × k) · (k × n) matmul reaches: the table's at its smallest
    dimension, times wave quantization — the output's tiles fill ``hw.sms`` multiprocessors wave
    by wave, and the last wave runs part-empty (NVIDIA's Matrix Multiplication Background guide);
    the tile laid whichever way fills the waves better."""
    e = _table(hw.gemm_efficiency, max(1, min(m, n, k)))
    if hw.sms:
        fills = []
        for tm, tn in (hw.gemm_tile, hw.gemm_tile[::-1]):  # the library may lay the tile either way
            tiles = math.ceil(m / tm) * math.ceil(n / tn)
            fills.append(tiles / (math.ceil(tiles / hw.sms) * hw.sms))
        e *= max(fills)
    return e


def gemm_seconds(
    m: int, n: int, k: int, hw: Hardware, dtype_bytes: int, fp8: bool = False
) -> float:
    """Seconds of one matmul: its 2·m·n·k FLOPs at `gemm_efficiency`, or its operands and result
    through memory if that takes longer (a skinny GEMM is bandwidth-bound). ``fp8``: FP8 operands
    (1 byte, the result in ``dtype_bytes``) at the FP8 peak where the device has one."""
    peak = hw.fp8_peak_tflops if fp8 and hw.fp8_peak_tflops else hw.peak_tflops
    compute = 2 * m * n * k / (peak * 1e12 * gemm_efficiency(m, n, k, hw))
    operands = (m * k + k * n) * (1 if fp8 else dtype_bytes)
    memory = (operands + m * n * dtype_bytes) / (hw.hbm_gbps * GB * hw.memory_efficiency)
    return max(compute, memory)


def float8_cast_bytes(rows: int, n: int, k: int, dtype_bytes: int, recipe: str) -> tuple[int, int]:
    """Bytes an FP8 linear's casts move (forward, backward) for `rows` tokens through an n × k
    weight: each cast reads its operand twice (the amax, then the scaled cast) and writes 1 byte
    per element — forward x and W; backward dy (tensorwise: once, reused for both GEMMs; rowwise:
    each operand again along the other axis, W and x included)."""
    per = 2 * dtype_bytes + 1
    forward = (rows * k + n * k) * per
    backward = rows * n * per if recipe == "tensorwise" else (2 * rows * n + n * k + rows * k) * per
    return forward, backward


@dataclass
class Work:
    """One micro-batch through one stage on one rank: seconds of the device's kernels and of the
    host's launches, forward and backward (a recompute's second forward in the backward), and the
    FLOPs they run (model FLOPs and the recomputation's)."""

    forward: float = 0.0
    backward: float = 0.0
    host_forward: float = 0.0
    host_backward: float = 0.0
    flops: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)  # device seconds by kind

    def add(self, kind: str, forward: float, backward: float) -> None:
        self.forward += forward
        self.backward += backward
        self.parts[kind] = self.parts.get(kind, 0.0) + forward + backward

    def seconds(self, hw: Hardware) -> tuple[float, float]:
        """(forward, backward) seconds: the device's and the host's overlap on a device that
        queues kernels, else they add."""
        if hw.asynchronous:
            return max(self.forward, self.host_forward), max(self.backward, self.host_backward)
        return self.forward + self.host_forward, self.backward + self.host_backward


@functools.lru_cache(maxsize=64)
def operator_counts(
    experts: tuple[int, int, int] | None, attention: str, recompute: str, save: str = ""
) -> dict[str, tuple[int, int]]:
    """(forward, backward) operators dispatched by one block ("block") and by the model's ends
    ("ends": the embedding, final norm, head and loss), counted once on a tiny CPU model with a
    dispatch mode — the counts do not depend on the widths; a recomputation's forward is in the
    backward's count. ``experts``: an MoE block's (experts, top_k, shared experts), with enough
    tokens that every expert gets rows (its operators grow with the experts it runs); ``save``:
    selective-op's save set."""
    import dataclasses

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fivefold.models.llama import Llama, get_config
    from fivefold.models.loss import lm_cross_entropy

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    rows = 1
    moe: dict[str, Any] = {}
    if experts is not None:
        n, k, shared = experts
        base = get_config("tiny-moe").moe
        moe = {"moe": dataclasses.replace(base, experts=n, top_k=k, shared_experts=shared)}
        rows = max(1, -(-4 * n // (8 * k)))  # sequences of 8 tokens: 4 rows per expert on average

    def count(n_layers: int) -> tuple[int, int]:
        shape = dict(dim=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, ffn_hidden=16)
        config = get_config("tiny-moe" if moe else "tiny", max_seq_len=8, **shape, **moe)
        model = Llama(config).set_attention(attention)
        model.set_recompute(recompute, save) if save else model.set_recompute(recompute)
        x = torch.randint(0, config.vocab_size, (rows, 8), device="cpu",
                          generator=torch.Generator().manual_seed(0))  # fmt: skip
        Count.n = 0
        with Count():
            loss = lm_cross_entropy(model(x), x)
        forward = Count.n
        Count.n = 0
        with Count():
            loss.backward()
        return forward, Count.n

    one, two = count(1), count(2)
    block = (two[0] - one[0], two[1] - one[1])
    return {"block": block, "ends": (one[0] - block[0], one[1] - block[1])}


def ops_per_block(
    experts: tuple[int, int, int] | None, attention: str, recompute: str, save: str = ""
) -> tuple[int, int]:
    """(forward, backward) operators of one block (`operator_counts`)."""
    return operator_counts(experts, attention, recompute, save)["block"]


# a dense block's linear weights (an MoE block's experts, router and shared experts are not)
_BLOCK_LINEAR = re.compile(
    r"layers\.\d+\.(?:attention\.(wq|wk|wv|wo)|feed_forward\.(w1|w2|w3))\.weight"
)


def _tokens_per_weight(name: str, run: RunPlan, tokens: int) -> float:
    """Rows a weight's GEMM multiplies: every token of the micro-batch, or an expert's share of the
    routed rows (top_k per token, spread over E experts; ep ranks each receive from all)."""
    moe = run.model.moe
    if ".experts." in name and moe is not None:
        return tokens * moe.top_k * run.dims.ep / moe.experts
    return tokens


def stage_work(
    cfg: Config, run: RunPlan, stage: Any, shapes: dict[str, tuple[int, ...]], hw: Hardware
) -> Work:
    """`Work` of one micro-batch through one stage (`shapes`: its local weights' shapes).

    Matmuls: each 2-D weight but the embedding, as `gemm_seconds` of its tokens × its shape,
    forward, input gradient and weight gradient. Attention: the causal half of the scores and
    weighted values (`attention_flops_per_token`) at ``hw.attention_efficiency``. Elementwise:
    `formulas.elementwise_bytes_per_block` per block (and the head's loss) over memory bandwidth.
    Host: `ops_per_block` operators per block at ``hw.op_overhead_us``. Full recompute runs the
    block's forward again in its backward; selective the attention core; selective-op the block's
    linears and core whose outputs its save set does not keep (`formulas.saved_linears`; an MoE
    block's experts and router are priced as saved, as its bytes are)."""
    from fivefold.plan.memory import micro_batch

    m, d, t = run.model, run.dims, cfg.train
    mb = micro_batch(cfg, run)
    s = mb.dtype_bytes
    tokens = mb.batch * mb.seq_len
    work = Work()
    # the block linears a recompute runs again: full all but w2 — torch's checkpoint stops once
    # the backward has what it saved, and nothing saves w2's output —, selective-op those its save
    # set does not keep (but w2); the attention core unless kept
    again_linears: set[str] = set()
    core_again = t.recompute in ("full", "selective")
    attention_core = cfg.model.attention if d.cp == 1 else "sdpa"
    if t.recompute in ("full", "selective-op"):
        from fivefold.models.recompute_policy import save_plan

        save = save_plan(t.recompute_save) if t.recompute == "selective-op" else formulas.SavePlan()
        kept = formulas.saved_linears(save)
        again_linears = {n for n, k in zip(formulas.BLOCK_LINEARS, kept) if not k} - {"w2"}
        core_again = not save.saves("sdpa" if attention_core == "sdpa" else "bmm")
    blocks = list(stage.layers.values()) if stage.layers is not None else []
    # a tied head's matmul runs through the embedding's weight
    tied_head = getattr(stage, "output", None) is not None and "output.weight" not in shapes
    for name, shape in shapes.items():
        if len(shape) != 2 or (name.startswith("tok_embeddings") and not tied_head):
            continue
        rows = _tokens_per_weight(name, run, tokens)
        if rows < 1:
            continue
        n, k = shape
        fp8 = cfg.precision.fp8 != "off" and is_float8_weight(name)
        one = gemm_seconds(int(rows), n, k, hw, s, fp8)
        dgrad = gemm_seconds(int(rows), k, n, hw, s, fp8)
        wgrad = gemm_seconds(n, k, int(rows), hw, s, fp8)
        block_linear = _BLOCK_LINEAR.fullmatch(name)  # an MoE feed-forward's: priced as saved
        linear = block_linear and (block_linear.group(1) or block_linear.group(2))
        again = one if linear in again_linears else 0.0
        work.add("matmuls", one, dgrad + wgrad + again)
        if fp8:  # the casts: amax and scaled cast of each operand, elementwise
            f_bytes, b_bytes = float8_cast_bytes(int(rows), n, k, s, cfg.precision.fp8)
            bw = hw.hbm_gbps * GB * hw.memory_efficiency
            work.add("elementwise", f_bytes / bw, (b_bytes + (f_bytes if again else 0)) / bw)
            # the scales' amax all-reduces (docs/design.md#fp8-training): 2 over tp where the
            # linear is split, 2 over cp; one each way, a latency each on the critical path
            calls = (2 if d.tp > 1 else 0) + (2 if d.cp > 1 else 0)
            latency = hw.collective_latency_us * 1e-6
            work.add(
                "fp8 amax all-reduces",
                calls / 2 * latency,
                (calls / 2 + (calls / 2 if again else 0)) * latency,
            )
        work.flops += 6 * rows * n * k + (2 * rows * n * k if again else 0)
    attention = attention_flops_per_token(run, cfg, len(blocks)) * tokens
    # the eager core computes the whole L × L square and masks half: twice the causal FLOPs
    seconds = attention * (2 if attention_core == "eager" else 1)
    seconds /= hw.peak_tflops * 1e12 * hw.attention_efficiency
    again = seconds / 3 if core_again else 0.0
    work.add("attention", seconds / 3, 2 * seconds / 3 + again)
    work.flops += attention * (4 / 3 if again else 1)
    memory_bw = hw.hbm_gbps * GB * hw.memory_efficiency
    # what a recomputation's forward moves again outside its matmuls (selective-op keeps only the
    # matmuls' and the core's outputs: every norm, RoPE, SwiGLU runs again)
    elementwise_again = t.recompute in ("full", "selective-op")
    for block in blocks:
        moe = getattr(block.feed_forward, "router", None) is not None
        hidden = m.ffn_hidden
        if moe and m.moe is not None:
            routed = m.moe.hidden or m.ffn_hidden
            shared = m.moe.shared_hidden or routed * m.moe.shared_experts
            hidden = m.moe.top_k * routed + (shared if m.moe.shared_experts else 0)
        fwd = formulas.elementwise_bytes_per_block(mb, m.n_heads, m.n_kv_heads, hidden) / memory_bw
        if attention_core == "eager":  # its scale, mask and softmax over B·H·L² scores
            fwd += formulas.eager_softmax_bytes(mb, m.n_heads) / memory_bw
        work.add("elementwise", fwd, 2 * fwd + (fwd if elementwise_again else 0.0))
        experts = (m.moe.experts, m.moe.top_k, m.moe.shared_experts) if moe and m.moe else None
        save = t.recompute_save if t.recompute == "selective-op" else ""
        f_ops, b_ops = ops_per_block(experts, attention_core, t.recompute, save)
        work.host_forward += f_ops * hw.op_overhead_us * 1e-6
        work.host_backward += b_ops * hw.op_overhead_us * 1e-6
    if getattr(stage, "output", None) is not None:  # the head's loss over the vocabulary
        fwd = formulas.loss_elementwise_bytes(mb, m.vocab_size) / memory_bw
        work.add("elementwise", fwd, 2 * fwd)
    ends = operator_counts(None, attention_core, t.recompute)["ends"]
    has_ends = (getattr(stage, "output", None) is not None) + (
        getattr(stage, "tok_embeddings", None) is not None
    )
    work.host_forward += ends[0] * has_ends / 2 * hw.op_overhead_us * 1e-6
    work.host_backward += ends[1] * has_ends / 2 * hw.op_overhead_us * 1e-6
    return work


def attention_flops_per_token(run: RunPlan, cfg: Config, blocks: int) -> float:
    """Forward + backward FLOPs of attention's scores and weighted values per token of one rank,
    for `blocks` blocks: the causal half of the L × L square, 6·L·D per block
    (`formulas.attention_flops_per_token`, the convention MFU uses too), over tp."""
    per_block = formulas.attention_flops_per_token(
        1, cfg.train.seq_len, run.model.n_heads * run.model.head_dim
    )
    return blocks * per_block / run.dims.tp
