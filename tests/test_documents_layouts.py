"""``data.documents = mask`` in every layout: packed rows train as the single-process masked model.

Two spawns (world 2 and 4, `multiprocess`) train two steps of packed rows (an end-of-document id
every few tokens, the loss not taken across a boundary: ``loss_across_documents`` false, the step's
weight rows / targets kept) with attention masked per document under DDP, ZeRO-2, ZeRO-3 with full
recompute, ZeRO-Offload, tp 2 with SP and selective recompute, pp 2 (1F1B, ZB-H1, interleaved),
cp 2 (zig-zag and contiguous: ring attention skipping and masking blocks), MoE ep 2, and at world
4 dp × tp with ZeRO-3, pp × dp, pp × tp with SP, HSDP and dp × cp with ZeRO-3; Ulysses (cp 2 alone, with a sliding
window, with MoE ep 2, with tp 2 + SP and selective recompute, with pp 2) and the hybrid (cp 4 = Ulysses 2 × ring 2,
ZeRO-3, full recompute); and the model families' options
where they meet a dimension (q/k norms under cp and tp + SP, wo's bias under SP, a sliding window under pp, a gated
shared expert with q/k/v biases under ep + ZeRO-3) — each against a
single-process reference of the same masked training held to the bound tests/tolerance.py derives. tests/test_documents.py shows the single-process
masked model equals each document run alone, so every layout here does too. The reference with
attention across documents trains differently (the comparison can fail)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_workers
from tolerance import KERNELS, reference

from fivefold.config import Config
from fivefold.distributed.comm import CommLog

SEQ, ROWS, MICRO, STEPS, EOS = 32, 8, 2, 2, 3  # (8 rows: a row per micro-batch at dp 4)
EPS = 1e-4  # as tests/test_compile.py: Adam's division by |g| + eps kept from amplifying reordered sums
TERMS = 384  # rule 1's n: the longest reordered sum (w2's inner dimension under tp; the batch's tokens)
LAYOUTS = {  # name: (world, mesh dims, preset, config: zero stage and what else the layout sets)
    "ddp": (2, dict(dp=2), "tiny", dict(zero=0)),
    "zero2": (2, dict(dp=2), "tiny", dict(zero=2)),
    "zero3-full-recompute": (2, dict(dp=2), "tiny", dict(zero=3, recompute="full")),
    "zero1-offload": (2, dict(dp=2), "tiny", dict(zero=1, offload=True)),
    "tp2-sp-selective": (2, dict(tp=2), "tiny", dict(zero=1, recompute="selective")),
    "pp2-1f1b": (2, dict(pp=2), "tiny", dict(zero=0)),
    "pp2-zb-h1": (2, dict(pp=2), "tiny", dict(zero=0, schedule="zb-h1")),
    "pp2-interleaved": (2, dict(pp=2), "tiny", dict(zero=1, schedule="interleaved", virtual=2)),
    "cp2-zigzag": (2, dict(cp=2), "tiny", dict(zero=0)),
    "cp2-contiguous": (2, dict(cp=2), "tiny", dict(zero=1, cp_layout="contiguous")),
    "moe-ep2": (2, dict(dp=2, ep=2), "tiny-moe", dict(zero=0)),
    "dp2-tp2-zero3": (4, dict(dp=2, tp=2), "tiny", dict(zero=3)),
    "pp2-dp2-zero1": (4, dict(pp=2, dp=2), "tiny", dict(zero=1)),
    "pp2-tp2-sp": (4, dict(pp=2, tp=2), "tiny", dict(zero=1)),
    "hsdp-dp4-replicate2-zero2": (4, dict(dp=4, dp_replicate=2), "tiny", dict(zero=2)),
    "dp2-cp2-zero3": (4, dict(dp=2, cp=2), "tiny", dict(zero=3)),
    # the model families' options (docs/design.md#model-families) in the layouts they touch: per-head q/k norms
    # beside ring attention and under tp with SP (their gradient summed over tp; wo's bias too), a sliding window
    # shorter than the documents through the pipeline, a gated shared expert and q/k/v biases under ep with ZeRO-3
    "qwen3-cp2": (2, dict(cp=2), "tiny-qwen3", dict(zero=1)),
    "qwen3-biased-tp2-sp": (2, dict(tp=2), "tiny-qwen3+bias", dict(zero=2)),
    "mistral-window-pp2": (2, dict(pp=2), "tiny-mistral+w6", dict(zero=1)),
    "qwen2-moe-ep2-zero3": (2, dict(dp=2, ep=2), "tiny-qwen2-moe", dict(zero=3)),
    # Ulysses (its all-to-alls around the model's own core: document spans, a window) and the hybrid (Ulysses 2 ×
    # ring 2: the ring's block plan on what the all-to-all gathered), composed with tp + SP (kv heads repeated),
    # pp, ep, ZeRO 0-3 and recompute
    "ulysses-cp2": (2, dict(cp=2, cp_ulysses=2), "tiny", dict(zero=0, cp_mode="ulysses")),
    "ulysses-cp2-window": (2, dict(cp=2, cp_ulysses=2), "tiny-mistral+w6", dict(zero=2, cp_mode="ulysses")),
    "ulysses-moe-ep2": (2, dict(cp=2, ep=2, cp_ulysses=2), "tiny-moe", dict(zero=1, cp_mode="ulysses")),
    "ulysses-cp2-tp2-sp-selective": (4, dict(cp=2, tp=2, cp_ulysses=2), "tiny",
                                     dict(zero=1, cp_mode="ulysses", recompute="selective")),
    "ulysses-cp2-selective-op": (2, dict(cp=2, cp_ulysses=2), "tiny",
                                 dict(zero=1, cp_mode="ulysses", recompute="selective-op")),
    "ulysses-pp2-cp2": (4, dict(pp=2, cp=2, cp_ulysses=2), "tiny", dict(zero=1, cp_mode="ulysses")),
    # a window as long as the rows is the whole prefix: the hybrid's ring runs it (a shorter one is refused)
    "mistral-window-hybrid-cp4": (4, dict(cp=4, cp_ulysses=2), "tiny-mistral+w32", dict(zero=0, cp_mode="hybrid")),
    "hybrid-cp4-zero3-full-recompute": (4, dict(cp=4, cp_ulysses=2), "tiny",
                                        dict(zero=3, cp_mode="hybrid", recompute="full")),
}
# a preset with options laid over it: "preset+name"
VARIANTS = {"bias": dict(attention_bias="all"), "w6": dict(sliding_window=6), "w32": dict(sliding_window=SEQ)}


def _model(preset: str):
    from fivefold.models import get_config

    name, _, variant = preset.partition("+")
    return get_config(name, **VARIANTS.get(variant, {}))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ids with an end-of-document id at random places (documents of ~1-12 tokens), the targets after
    each one ignored (-100)."""
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(4, 256, (ROWS, SEQ + 1), generator=g)
    tokens[torch.rand(ROWS, SEQ + 1, generator=g) < 0.12] = EOS
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    y[x == EOS] = -100
    return x, y


def _weight(y: torch.Tensor) -> float:
    return y.numel() / int((y != -100).sum())


def _reference(preset: str, dp: int, masked: bool = True) -> dict:
    """Single-process training as every layout trains (tests/dist_utils.trainer_reference's optimizer and
    micro-batches), attention masked per document (or not), the loss weighted as the trainer weighs it."""
    from fivefold.models.documents import find_documents
    from fivefold.models.llama import Llama
    from fivefold.models.parallelize import set_aux_grad_scale
    from fivefold.tensor_parallel.loss import row_mean_cross_entropy

    t = Config().train
    net = Llama(_model(preset), seed=t.seed)
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in net.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=t.lr, betas=(t.beta1, t.beta2), eps=EPS)
    set_aux_grad_scale([net], 1.0 / MICRO)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        w = _weight(y)
        opt.zero_grad()
        total = 0.0
        for i in range(MICRO):
            xi = torch.cat([xr.chunk(MICRO)[i] for xr in x.chunk(dp)])
            yi = torch.cat([yr.chunk(MICRO)[i] for yr in y.chunk(dp)])
            out = net(xi, find_documents(xi, EOS)) if masked else net(xi)
            loss = row_mean_cross_entropy(out, yi) * w / MICRO
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return dict(losses=losses, state={n: p.detach().clone() for n, p in net.named_parameters()})


def _train(name: str) -> dict:
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    _, dims, preset, o = LAYOUTS[name]
    cfg = Config()
    cfg.zero.stage, cfg.zero.offload_optimizer = o["zero"], o.get("offload", False)
    cfg.train.recompute, cfg.data.documents = o.get("recompute", "none"), "mask"
    cfg.train.grad_accum, cfg.train.seq_len, cfg.train.warmup_steps, cfg.train.eps = MICRO, SEQ, 0, EPS
    cfg.parallel.cp, cfg.parallel.ep = dims.get("cp", 1), dims.get("ep", 1)
    cfg.parallel.tp, cfg.parallel.pp = dims.get("tp", 1), dims.get("pp", 1)
    cfg.parallel.dp_replicate = dims.get("dp_replicate", 1)
    cfg.parallel.cp_layout, cfg.parallel.sp = o.get("cp_layout", "zigzag"), dims.get("tp", 1) > 1
    cfg.parallel.cp_mode = o.get("cp_mode", "ring")
    cfg.parallel.cp_ulysses = dims["cp_ulysses"] if cfg.parallel.cp_mode == "hybrid" else None
    cfg.pipeline.schedule, cfg.pipeline.virtual = o.get("schedule", "1f1b"), o.get("virtual", 1)
    mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
    parts = parallelize(cfg, _model(preset), mesh, "cpu", documents_eos=EOS)
    dp = mesh.comm("dp")
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        w = _weight(y)  # over the global batch: the same on every rank
        x, y = x.chunk(dp.size)[dp.rank], y.chunk(dp.size)[dp.rank]
        micro = list(zip(x.chunk(MICRO), y.chunk(MICRO)))
        loss = parts.forward_backward(micro, [parts.documents_of(xm) for xm, _ in micro], w)
        parts.step(1.0)
        losses.append(parts.global_loss(loss).item())
    sliced_by = "tp" if dims.get("tp", 1) > 1 else "ep"  # whose shards a slice of a parameter is
    return dict(losses=losses, state=parts.full_state_dict(), shard=mesh.rank(sliced_by))


def _worker(world: int) -> dict:
    return {name: _train(name) for name, (w, *_) in LAYOUTS.items() if w == world}


@pytest.fixture(scope="module")
def results():
    """Every layout's result per rank: one spawn of world 2, one of world 4."""
    by_world = {w: run_workers(_worker, w, w) for w in sorted({w for w, *_ in LAYOUTS.values()})}
    return {name: [ranks[name] for ranks in by_world[w]] for name, (w, *_) in LAYOUTS.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_masked_documents_train_like_one_process_in_every_layout(results, name, kernels):
    _, dims, preset, _ = LAYOUTS[name]
    want, bounds = reference(_reference, preset, dims.get("dp", 1), kernels=kernels, terms=TERMS)
    for rank, res in enumerate(results[name]):
        for step, got in enumerate(res["losses"]):
            bounds["losses"][step].assert_holds(got, want["losses"][step], f"rank {rank} {name} loss {step}")
        assert res["state"], f"rank {rank} {name}: no parameters"
        for pname, got in res["state"].items():  # this rank's share of the parameters
            full = want["state"][pname]
            if got.shape != full.shape:  # a tp or ep shard: its contiguous part of the reference
                d = next(i for i, (a, b) in enumerate(zip(got.shape, full.shape)) if a != b)
                full = full.chunk(full.shape[d] // got.shape[d], dim=d)[res["shard"]]
            bounds["state"][pname].assert_holds(got, full, f"rank {rank} {name} {pname}")


@pytest.mark.multiprocess
def test_the_reference_across_documents_trains_differently():
    masked = reference(_reference, "tiny", 1)
    across = reference(_reference, "tiny", 1, masked=False)
    assert abs(masked["losses"][1] - across["losses"][1]) > 1e-3
