"""Tensor and sequence parallelism (docs/design.md#tensor-and-sequence-parallelism) vs one process.

One spawn per world size (every test `multiprocess`):
- world 2: every parallel layer at tp 2; the whole tiny Llama at tp 2 (without SP, with SP, tied
  embeddings) with its communication per block and its saved activations
  (docs/design.md#activation-memory); the error messages;
- world 4: every parallel layer at tp 4; five training steps at dp 2 × tp 2 with ZeRO-1 / ZeRO-3.
  The parent gathers the slices along the plan's dimension and compares them with single-process
  PyTorch (fp32) within the bound tests/tolerance.py derives."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_workers
from tolerance import KERNELS, WORKERS, assert_values_close, reference
from torch import nn

from fivefold.config import Config
from fivefold.data_parallel.zero import default_no_decay
from fivefold.distributed.comm import Comm, CommLog
from fivefold.distributed.mesh import ParallelDims, ParallelMesh
from fivefold.models import build_model, get_config
from fivefold.models.llama import RMSNorm
from fivefold.models.parallelize import apply_tensor_parallel, is_tp_sharded, parallelize, tp_loss
from fivefold.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)

pytestmark = pytest.mark.multiprocess  # every test here starts processes

SEQ = 1  # activations are [batch, sequence, hidden]

# ---------------------------------------------------------------------------------------------
# Single layers: sizes divisible by 2 and 4 (tp), the sequence too (SP).
B, L = 4, 8
D_IN, D_OUT, VOCAB = 12, 16, 24

LAYER_CASES = {
    "column": dict(kind="column", bias=False, sp=False),
    "column_bias": dict(kind="column", bias=True, sp=False),
    "column_sp": dict(kind="column", bias=True, sp=True),
    "row": dict(kind="row", bias=False, sp=False),
    "row_bias": dict(kind="row", bias=True, sp=False),
    "row_sp": dict(kind="row", bias=False, sp=True),
    "row_bias_sp": dict(kind="row", bias=True, sp=True),
    "embedding": dict(kind="embedding", bias=False, sp=False),
    "embedding_sp": dict(kind="embedding", bias=False, sp=True),
    "ce": dict(kind="ce", bias=False, sp=False),
    "ce_chunked": dict(kind="ce", bias=False, sp=False, chunk_rows=3),  # rows in chunks of 3 (the last one short)
}
CE_GRAD_SCALE = 2.5  # d(total)/d(loss) != 1: the CE backward must scale by the incoming gradient
# Rule 1's n (tests/tolerance.py): the tokens summed into a weight gradient, or an inner dimension split over tp.
LAYER_TERMS = max(B * L, D_IN, D_OUT, VOCAB)
# Bitwise the reference on the workers' kernels: the embedding's lookup on the owning rank plus zeros from the
# others, and its gradient rows summed in token order (the other ranks' tokens add zeros).
EXACT = {("embedding", "y"), ("embedding", "weight_grad")}


def _layer_inputs(case: str):
    """(full single-process module, full input, full upstream gradient, CE target) — same in every process."""
    spec = LAYER_CASES[case]
    g = torch.Generator().manual_seed(7)
    full, target = None, None
    if spec["kind"] in ("column", "row"):
        full = nn.Linear(D_IN, D_OUT, bias=spec["bias"])
        with torch.no_grad():
            full.weight.copy_(torch.randn(D_OUT, D_IN, generator=g))
            if spec["bias"]:
                full.bias.copy_(torch.randn(D_OUT, generator=g))
        x = torch.randn(B, L, D_IN, generator=g)
    elif spec["kind"] == "embedding":
        full = nn.Embedding(VOCAB, D_OUT)
        with torch.no_grad():
            full.weight.copy_(torch.randn(VOCAB, D_OUT, generator=g))
        x = torch.randint(0, VOCAB, (B, L), generator=g)
    else:  # logits and targets, some of them ignored
        x = 3 * torch.randn(B, L, VOCAB, generator=g)
        target = torch.randint(0, VOCAB, (B, L), generator=g)
        target[0, :3] = -100
        target[3, -1] = -100
    dy = torch.randn(B, L, D_OUT, generator=g)
    return full, x, dy, target


def _run_layer(case: str, comm: Comm) -> dict:
    spec = LAYER_CASES[case]
    full, x_full, dy_full, target = _layer_inputs(case)
    t, r = comm.size, comm.rank
    comm.log.reset()
    layer = None
    if spec["kind"] == "column":
        layer = ColumnParallelLinear.from_linear(full, comm, "gather" if spec["sp"] else "copy")
        x = (x_full.chunk(t, SEQ)[r] if spec["sp"] else x_full).clone().requires_grad_()
        y = layer(x)
        (y * dy_full.chunk(t, -1)[r]).sum().backward()
    elif spec["kind"] in ("row", "embedding"):
        if spec["kind"] == "row":
            layer = RowParallelLinear.from_linear(full, comm, spec["sp"])
            x = x_full.chunk(t, -1)[r].clone().requires_grad_()
        else:
            layer = VocabParallelEmbedding.from_embedding(full, comm, spec["sp"])
            x = x_full
        y = layer(x)
        (y * (dy_full.chunk(t, SEQ)[r] if spec["sp"] else dy_full)).sum().backward()
    else:
        x = x_full.chunk(t, -1)[r].clone().requires_grad_()
        y = vocab_parallel_cross_entropy(x, target, r * VOCAB // t, comm, chunk_rows=spec.get("chunk_rows"))
        (y * CE_GRAD_SCALE).backward()
    bias = getattr(layer, "bias", None)
    return dict(y=y.detach(), x_grad=x.grad if x.requires_grad else None,
                weight_grad=layer.weight.grad if layer is not None else None,
                bias_grad=bias.grad if bias is not None else None,
                records=[(rec.op, rec.tag, rec.numel) for rec in comm.log.records])


def _layer_reference(case: str) -> dict:
    spec = LAYER_CASES[case]
    full, x_full, dy, target = _layer_inputs(case)
    x = x_full if spec["kind"] == "embedding" else x_full.clone().requires_grad_()
    if spec["kind"] == "ce":
        y = F.cross_entropy(x.reshape(-1, VOCAB), target.reshape(-1), ignore_index=-100)
        (y * CE_GRAD_SCALE).backward()
    else:
        y = full(x)
        (y * dy).sum().backward()
    return dict(y=y.detach(), x_grad=x.grad if x.requires_grad else None,
                weight_grad=full.weight.grad if full is not None else None,
                bias_grad=full.bias.grad if getattr(full, "bias", None) is not None else None)


# How each result is laid out over the TP ranks: a concatenation dim, or None = every rank holds all of it.
LAYOUT = {
    "column": dict(y=-1, x_grad=None, weight_grad=0, bias_grad=0),
    "column_sp": dict(y=-1, x_grad=SEQ, weight_grad=0, bias_grad=0),
    "row": dict(y=None, x_grad=-1, weight_grad=1, bias_grad=None),
    "row_sp": dict(y=SEQ, x_grad=-1, weight_grad=1, bias_grad=None),
    "embedding": dict(y=None, x_grad=None, weight_grad=0),
    "embedding_sp": dict(y=SEQ, x_grad=None, weight_grad=0),
    "ce": dict(y=None, x_grad=-1),
}


def _layout(case: str) -> dict:
    spec = LAYER_CASES[case]
    return LAYOUT[spec["kind"] + ("_sp" if spec["sp"] else "")]


def _expected_layer_comm(case: str) -> list[tuple[str, str, int]]:
    spec = LAYER_CASES[case]
    if spec["kind"] == "ce":  # max, sum of exponentials, target logit: one value per token each
        return [("all_reduce", "vocab_ce", B * L)] * 3
    if spec["kind"] == "column":
        n = B * L * D_IN
        if spec["sp"]:
            return [("all_gather", "sp_gather", n), ("reduce_scatter", "sp_gather_bwd", n)]
        return [("all_reduce", "tp_f", n)]
    n = B * L * D_OUT
    if spec["sp"]:  # a bias added to each rank's chunk: its partial gradients are summed over TP (D_OUT)
        bias = [("all_reduce", "sp_bias_grad", D_OUT)] if spec["bias"] else []
        return [("reduce_scatter", "sp_scatter", n), *bias, ("all_gather", "sp_scatter_bwd", n)]
    return [("all_reduce", "tp_g", n)]


def _layer_worker(comm: Comm) -> dict:
    return {case: _run_layer(case, comm) for case in LAYER_CASES}


# ---------------------------------------------------------------------------------------------
# The whole model: tiny Llama with GQA (4 query heads, 2 kv heads), small enough to be fast.
MB, ML = 2, 8  # model batch and sequence length


def _model_config(**overrides):
    return get_config("tiny", **{**dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16,
                                        vocab_size=64), **overrides})


def _terms(tokens: int) -> int:
    """Rule 1's n (tests/tolerance.py): the tokens summed into a weight gradient, or the longest inner dimension
    split over tp (ffn_hidden into w2, vocab_size into the loss)."""
    c = _model_config()
    return max(tokens, c.ffn_hidden, c.vocab_size, c.dim)


MODEL_TERMS = _terms(MB * ML)


def _model_batch(batch: int = MB, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = _model_config().vocab_size
    tokens = torch.randint(0, vocab, (batch, ML), generator=g)
    target = torch.randint(0, vocab, (batch, ML), generator=g)
    return tokens, target


def _model_target() -> torch.Tensor:
    target = _model_batch()[1].clone()
    target[0, 1] = target[1, -1] = -100  # ignored positions, as in padded batches
    return target


def _shard_dim(name: str) -> int | None:
    """Where the plan must put each parameter — the independent specification the plan's declared placements are
    checked against: column-parallel rows (dim 0), row-parallel columns (dim 1), vocabulary rows of the embedding
    (dim 0); norms replicated (None)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        return 1
    return 0  # wq, wk, wv, w1, w3, output, tok_embeddings


MODEL_CASES = {"tp": dict(sp=False, tie=False), "tp_sp": dict(sp=True, tie=False),
               "tp_tied": dict(sp=False, tie=True), "tp_sp_tied": dict(sp=True, tie=True)}
INSTRUMENTED = ("tok_embeddings", "layers.0", "layers.1", "norm", "output")


def _instrument(model: nn.Module, log: CommLog):
    """Marks on the comm log's clock: forward start/end of each top-level module, and the moment the
    gradient of a module's output is ready (its backward starts next)."""
    marks: list = []

    def mark(label) -> None:
        marks.append((log.next_seq(), label))

    for name in INSTRUMENTED:
        module = model.get_submodule(name)

        def pre(mod, args, name=name) -> None:
            mark(("fwd_start", name))

        def post(mod, args, out, name=name) -> None:
            mark(("fwd_end", name))
            if name.startswith(("layers.", "tok_embeddings")):
                out.register_hook(lambda grad: mark(("bwd", name)))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    return marks, mark


def _run_model(comm: Comm, sp: bool, tie: bool) -> dict:
    model = apply_tensor_parallel(build_model(_model_config(tie_embeddings=tie), seed=0), comm,
                                  sequence_parallel=sp)
    tokens, target = _model_batch()[0], _model_target()
    log = comm.log
    marks, mark = _instrument(model, log)
    log.reset()
    logits = model(tokens)
    loss = tp_loss(model)(logits, target)
    mark("backward")
    loss.backward()
    mark("end")
    return dict(logits=logits.detach(), loss=loss.detach(),
                grads={n: p.grad.clone() for n, p in model.named_parameters()},
                shapes={n: tuple(p.shape) for n, p in model.named_parameters()},
                sharded={n: is_tp_sharded(n, p, model) for n, p in model.named_parameters()},
                tp_dims={n: model.tp_placements[n].tp_dim for n, _ in model.named_parameters()},
                records=[(rec.seq, rec.op, rec.tag, rec.numel, rec.wire_bytes) for rec in log.records], marks=marks)


def _model_reference(tie: bool) -> dict:
    model = build_model(_model_config(tie_embeddings=tie), seed=0)
    tokens, target = _model_batch()[0], _model_target()
    logits = model(tokens)
    # the model's loss (`row_mean_cross_entropy`): the kept targets' sum over ALL rows (an ignored one counts 0; the
    # trainer's step weight makes it the mean over those kept, docs/data.md#the-loss-across-documents)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                           reduction="sum") / target.numel()
    loss.backward()
    return dict(logits=logits.detach(), loss=loss.detach(), grads={n: p.grad for n, p in model.named_parameters()})


# ---------------------------------------------------------------------------------------------
# Saved activations of one forward, split into the norms (A_out, outside the TP regions) and the rest.
def _saved_activation_bytes(model: nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, tuple[str, int]] = {}
    in_norm = [False]
    handles = []
    for m in model.modules():
        if isinstance(m, RMSNorm):
            handles.append(m.register_forward_pre_hook(lambda *a: in_norm.__setitem__(0, True)))
            handles.append(m.register_forward_hook(lambda *a: in_norm.__setitem__(0, False)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() not in seen:  # saved storages stay alive
            seen[storage.data_ptr()] = ("norm" if in_norm[0] else "other", storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens)
    for h in handles:
        h.remove()
    del logits
    return {part: sum(n for p, n in seen.values() if p == part) for part in ("norm", "other")}


def _activation_worker(comm: Comm) -> dict:
    tokens = _model_batch()[0]
    out = {"single": _saved_activation_bytes(build_model(_model_config(), seed=0), tokens)}
    for sp in (False, True):
        model = apply_tensor_parallel(build_model(_model_config(), seed=0), comm, sequence_parallel=sp)
        out["tp_sp" if sp else "tp"] = _saved_activation_bytes(model, tokens)
    return out


# ---------------------------------------------------------------------------------------------
# Errors: each number the plan needs divisible, one at a time (tp = 2, or tp = 4 for the GQA case).
ERROR_CASES = {
    2: {"n_heads": (dict(dim=48, n_heads=3, n_kv_heads=3), 3),
        "n_kv_heads": (dict(n_kv_heads=1), 1),
        "ffn_hidden": (dict(ffn_hidden=33), 33),
        "vocab_size": (dict(vocab_size=65), 65)},
    4: {"n_kv_heads": ({}, 2)},  # the test model itself: 4 query heads fit tp 4, its 2 kv heads do not
}
BAD_SEQ = 7


def _error_worker(comm: Comm) -> dict:
    out = {}
    for what, (overrides, _) in ERROR_CASES[comm.size].items():
        model = build_model(_model_config(**overrides), seed=0)
        try:
            apply_tensor_parallel(model, comm)
        except ValueError as e:
            out[what] = str(e)
    if comm.size == 2:
        model = apply_tensor_parallel(build_model(_model_config(), seed=0), comm, sequence_parallel=True)
        try:
            model(torch.zeros(1, BAD_SEQ, dtype=torch.long))
        except ValueError as e:
            out["seq"] = str(e)
    return out


# ---------------------------------------------------------------------------------------------
# Training at dp 2 × tp 2 with ZeRO.
STEPS = 5
LR, WD = 1e-2, 0.1
CLIP = 0.2  # well below the model's gradient norm (≈1.5-2, checked below): clipping is active every step
GLOBAL_BATCH = 4
SMALL_BUCKET_MB = 2048 * 4 / 2**20  # several buckets
EPS = 1e-4  # as tests/test_zero.py; Adam's amplification of a gradient error is in the bound (tests/tolerance.py)
TRAIN_TERMS = _terms(GLOBAL_BATCH * ML)
TRAIN_CONFIGS = {"zero1": dict(stage=1, sp=False), "zero3": dict(stage=3, sp=False),
                 "zero1_sp": dict(stage=1, sp=True), "zero3_sp": dict(stage=3, sp=True)}


def _train_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _model_batch(GLOBAL_BATCH, seed=100 + step)


def _no_decay_flags(model: nn.Module) -> dict[str, bool]:
    return {n: default_no_decay(n, p, model) for n, p in model.named_parameters()}


def _train(mesh: ParallelMesh, stage: int, sp: bool) -> dict:
    cfg = Config()  # the trainer's config for this layout: the parts come from the one assembly
    cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.sp = mesh.size("dp"), mesh.size("tp"), sp
    cfg.zero.stage, cfg.zero.bucket_mb = stage, SMALL_BUCKET_MB
    cfg.train.lr, cfg.train.weight_decay, cfg.train.beta2, cfg.train.eps, cfg.train.seed = LR, WD, 0.999, EPS, 0
    parts = parallelize(cfg, _model_config(), mesh, "cpu")
    engine, loss_fn = parts.engine, parts.loss_fn
    dp, dp_rank = mesh.size("dp"), mesh.rank("dp")
    losses, norms, history = [], [], []
    for step in range(STEPS):
        x, y = _train_batch(step)
        loss = loss_fn(engine(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank])  # tp peers: the same slice
        engine.backward(loss)
        norms.append(parts.step(CLIP))
        losses.append(loss.item())
        history.append({k: v.clone() for k, v in engine.full_state_dict().items()})
    return dict(losses=losses, norms=norms, history=history)


def _train_reference() -> tuple[list[float], list[float], list[dict[str, torch.Tensor]]]:
    model = build_model(_model_config(), seed=0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, eps=EPS)
    losses, norms, history = [], [], []
    for step in range(STEPS):
        x, y = _train_batch(step)
        opt.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, norms, history


# ---------------------------------------------------------------------------------------------
def _world2_worker() -> dict:
    comm = Comm(None, "tp", CommLog())
    return dict(layers=_layer_worker(comm),
                models={case: _run_model(comm, **kw) for case, kw in MODEL_CASES.items()},
                activations=_activation_worker(comm), errors=_error_worker(comm),
                no_decay=_no_decay_flags(apply_tensor_parallel(build_model(_model_config(), seed=0), comm)))


def _world4_worker() -> dict:
    comm = Comm(None, "tp", CommLog())
    out = dict(layers=_layer_worker(comm), errors=_error_worker(comm))
    mesh = ParallelMesh(ParallelDims(dp=2, tp=2), "cpu", CommLog())
    out.update(dp_rank=mesh.rank("dp"), tp_rank=mesh.rank("tp"),
               train={name: _train(mesh, **cfg) for name, cfg in TRAIN_CONFIGS.items()})
    return out


@pytest.fixture(scope="module")
def world2():
    return run_workers(_world2_worker, 2)


@pytest.fixture(scope="module")
def world4():
    return run_workers(_world4_worker, 4)


@pytest.fixture(params=[2, 4], ids=lambda t: f"tp{t}")
def layer_results(request):
    return request.param, request.getfixturevalue(f"world{request.param}")


def _grad_scale(grads) -> float:
    """Rule 1's scale for every gradient: the largest gradient entry of the whole reference."""
    return max(float(g.abs().max()) for g in grads if g is not None)


def _check_layout(ranks: list[torch.Tensor], want: torch.Tensor, dim: int | None, what: str, terms: int,
                  scale: float | None = None, exact: bool = False) -> None:
    def check(got: torch.Tensor, msg: str) -> None:
        if exact:
            assert torch.equal(got, want), msg
        else:
            assert_values_close(got, want, terms, msg, scale=scale)

    if dim is None:  # every rank holds the whole thing
        for r, got in enumerate(ranks):
            check(got, f"{what} on tp rank {r}")
    else:
        assert all(got.shape[dim] * len(ranks) == want.shape[dim] for got in ranks), what
        check(torch.cat(ranks, dim), f"{what} (gathered along dim {dim})")


# ---------------------------------------------------------------------------------------------
# 1. Layers
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_matches_single_process(layer_results, case, kernels):
    tp, results = layer_results
    ranks = [res["layers"][case] for res in results]
    ref = reference(_layer_reference, case, kernels=kernels)
    grad_scale = _grad_scale(v for k, v in ref.items() if k.endswith("_grad"))
    for key, dim in _layout(case).items():
        if key == "bias_grad" and LAYER_CASES[case]["kind"] == "row":
            continue  # the replicated bias of a row-parallel layer: its own test below
        if ref[key] is None:
            assert all(r[key] is None for r in ranks), f"{case} {key}"
            continue
        _check_layout([r[key] for r in ranks], ref[key], dim, f"{case} tp={tp} {key}", LAYER_TERMS,
                      scale=grad_scale if key.endswith("_grad") else None,
                      exact=kernels == WORKERS and (LAYER_CASES[case]["kind"], key) in EXACT)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", [c for c, s in LAYER_CASES.items() if s["kind"] == "row" and s["bias"]])
def test_row_parallel_bias_gradient_is_full_on_every_rank(layer_results, case, kernels):
    """The bias is replicated (added once after the exit): every rank needs the whole gradient."""
    tp, results = layer_results
    ref = reference(_layer_reference, case, kernels=kernels)
    grad_scale = _grad_scale(v for k, v in ref.items() if k.endswith("_grad"))
    for r, res in enumerate(results):
        assert_values_close(res["layers"][case]["bias_grad"], ref["bias_grad"], LAYER_TERMS,
                            f"{case} tp={tp} bias grad on rank {r}", scale=grad_scale)


@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_communication(layer_results, case):
    tp, results = layer_results
    for r, res in enumerate(results):
        assert res["layers"][case]["records"] == _expected_layer_comm(case), f"{case} tp={tp} rank {r}"


# ---------------------------------------------------------------------------------------------
# 2. Whole model at tp 2
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_matches_single_process(world2, case, kernels):
    ranks = [res["models"][case] for res in world2]
    ref = reference(_model_reference, MODEL_CASES[case]["tie"], kernels=kernels)
    grad_scale = _grad_scale(ref["grads"].values())
    assert_values_close(torch.cat([r["logits"] for r in ranks], -1), ref["logits"], MODEL_TERMS,
                        f"{case} logits (vocab slices gathered)")
    for r, res in enumerate(ranks):
        assert_values_close(res["loss"], ref["loss"], MODEL_TERMS, f"{case} loss on rank {r}")
    assert set(ranks[0]["grads"]) == set(ref["grads"])
    for name, want in ref["grads"].items():
        dim = _shard_dim(name)
        for r, res in enumerate(ranks):
            assert res["sharded"][name] == (dim is not None), f"is_tp_sharded({name}) on rank {r}"
            assert res["tp_dims"][name] == dim, f"declared placement of {name} on rank {r}"
            expected_shape = list(want.shape)
            if dim is not None:
                expected_shape[dim] //= len(ranks)
            assert list(res["shapes"][name]) == expected_shape, f"{case} {name} local shape on rank {r}"
        _check_layout([r["grads"][name] for r in ranks], want, dim, f"{case} grad {name}", MODEL_TERMS,
                      scale=grad_scale)
        if dim is None:  # replicated: bitwise the same on every TP rank, or the copies drift apart
            assert all(torch.equal(r["grads"][name], ranks[0]["grads"][name]) for r in ranks), name


# ---------------------------------------------------------------------------------------------
# 3. Training at dp 2 × tp 2 with ZeRO
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", list(TRAIN_CONFIGS))
def test_zero_dp2_tp2_training_matches_single_process(world4, name, kernels):
    (ref_losses, ref_norms, ref_history), (loss_bounds, norm_bounds, history_bounds) = reference(
        _train_reference, kernels=kernels, terms=TRAIN_TERMS)
    assert all(n > CLIP for n in ref_norms), f"clipping must be active: norms {ref_norms}"
    for res in world4:
        run, tp_rank = res["train"][name], res["tp_rank"]
        where = f"{name} rank dp{res['dp_rank']} tp{tp_rank}"
        # The global norm over dp shards and tp slices (replicated norms counted once) is torch's.
        assert len(run["norms"]) == len(ref_norms), where
        for step, (got, want) in enumerate(zip(run["norms"], ref_norms)):
            norm_bounds[step].assert_holds(got, want, f"{where} step {step} gradient norm")
        for step, (got, want) in enumerate(zip(run["history"], ref_history)):
            assert got.keys() == want.keys()
            for key, full in want.items():
                dim = _shard_dim(key)
                expected = full if dim is None else full.chunk(2, dim)[tp_rank]
                history_bounds[step][key].assert_holds(got[key], expected, f"{where} step {step} {key}")
    for step in range(STEPS):  # each dp rank's loss is its slice's mean: the mean over dp is the global loss
        by_dp = {res["dp_rank"]: res["train"][name]["losses"][step] for res in world4}
        loss_bounds[step].assert_holds(sum(by_dp.values()) / len(by_dp), ref_losses[step], f"{name} step {step} loss")


def test_default_no_decay_under_tp(world2):
    """The engine's default groups must not change when the model is tensor-parallel."""
    plain = _no_decay_flags(build_model(_model_config(), seed=0))
    for r, res in enumerate(world2):
        assert res["no_decay"] == plain, f"rank {r}: " + ", ".join(
            f"{n}: plain {plain[n]}, tp {res['no_decay'][n]}" for n in plain if plain[n] != res["no_decay"][n])


# ---------------------------------------------------------------------------------------------
# 4. Communication per block (CommLog)
def _segments(run: dict, n_layers: int) -> dict[str, list[tuple]]:
    """Split this rank's records by module, forward and backward, using the marks on the same clock."""
    at = {label: seq for seq, label in run["marks"]}
    bwd = [("bwd", f"layers.{i}") for i in range(n_layers)]

    def between(a: int, b: int) -> list[tuple]:
        return [rec[1:] for rec in run["records"] if a < rec[0] < b]

    seg = {f"fwd {m}": between(at[("fwd_start", m)], at[("fwd_end", m)]) for m in INSTRUMENTED}
    seg["fwd loss"] = between(at[("fwd_end", "output")], at["backward"])
    seg["bwd head+norm"] = between(at["backward"], at[bwd[-1]])
    for i in range(n_layers):
        seg[f"bwd layers.{i}"] = between(at[bwd[i]], at[bwd[i - 1] if i else ("bwd", "tok_embeddings")])
    seg["bwd tok_embeddings"] = between(at[("bwd", "tok_embeddings")], at["end"])
    return seg


def _ops(records: list[tuple]) -> Counter:
    return Counter((op, tag, numel) for op, tag, numel, _ in records)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_communication_per_block(world2, sp):
    c = _model_config()
    t = len(world2)
    bld, bl, d = MB * ML * c.dim, MB * ML, c.dim
    for r, res in enumerate(world2):
        run = res["models"]["tp_sp" if sp else "tp"]
        seg = _segments(run, c.n_layers)
        assert sum(len(v) for v in seg.values()) == len(run["records"]), "a collective outside every segment"
        ce = Counter({("all_reduce", "vocab_ce", bl): 3})
        if not sp:  # per block: f and g twice each (4 all-reduces of B·L·D); the embedding's g, the head's f
            block_fwd, block_bwd = Counter({("all_reduce", "tp_g", bld): 2}), Counter({("all_reduce", "tp_f", bld): 2})
            expected = {"fwd tok_embeddings": Counter({("all_reduce", "tp_g", bld): 1}),
                        "bwd tok_embeddings": Counter(), "fwd output": Counter(),
                        "bwd head+norm": Counter({("all_reduce", "tp_f", bld): 1})}
        else:  # the same volume as all-gather + reduce-scatter pairs; norm weight gradients all-reduced (D each)
            block_fwd = Counter({("all_gather", "sp_gather", bld): 2, ("reduce_scatter", "sp_scatter", bld): 2})
            block_bwd = Counter({("all_gather", "sp_scatter_bwd", bld): 2, ("reduce_scatter", "sp_gather_bwd", bld): 2,
                                 ("all_reduce", "sp_norm_grad", d): 2})
            expected = {"fwd tok_embeddings": Counter({("reduce_scatter", "sp_scatter", bld): 1}),
                        "bwd tok_embeddings": Counter({("all_gather", "sp_scatter_bwd", bld): 1}),
                        "fwd output": Counter({("all_gather", "sp_gather", bld): 1}),
                        "bwd head+norm": Counter({("reduce_scatter", "sp_gather_bwd", bld): 1,
                                                  ("all_reduce", "sp_norm_grad", d): 1})}
        expected.update({"fwd norm": Counter(), "fwd loss": ce})
        for i in range(c.n_layers):
            expected[f"fwd layers.{i}"], expected[f"bwd layers.{i}"] = block_fwd, block_bwd
        got = {k: _ops(v) for k, v in seg.items()}
        assert got == expected, f"rank {r} sp={sp}"
    # Wire traffic per block is the same with and without SP (all-reduce = reduce-scatter + all-gather).
    plain, seq = (_segments(world2[0]["models"][k], c.n_layers) for k in ("tp", "tp_sp"))

    def wire(recs: list[tuple]) -> float:
        return sum(w for _, tag, _, w in recs if tag != "sp_norm_grad")

    ring = 2 * (t - 1) / t * bld * 4
    for i in range(c.n_layers):
        per_block = [wire(s[f"fwd layers.{i}"] + s[f"bwd layers.{i}"]) for s in (plain, seq)]
        assert per_block == pytest.approx([4 * ring, 4 * ring]), f"block {i} wire bytes (tp, tp+sp)"
    assert sum(map(wire, plain.values())) == pytest.approx(sum(map(wire, seq.values())))


# ---------------------------------------------------------------------------------------------
# 5. Activation memory (docs/design.md#activation-memory)
def _activation_info(r: int, a: dict) -> str:
    return (f"rank {r} saved-activation bytes of one forward: single process {a['single']}, tp {a['tp']}, "
            f"tp+sp {a['tp_sp']}; A_out(tp) = {a['tp']['norm']}, A_out(tp+sp) = {a['tp_sp']['norm']}")


def test_sequence_parallel_splits_the_norm_activations(world2):
    t = len(world2)
    for r, res in enumerate(world2):
        single, tp, sp = (res["activations"][k] for k in ("single", "tp", "tp_sp"))
        info = _activation_info(r, res["activations"])
        assert tp["norm"] > 0 and tp["other"] > 0, info
        assert tp["norm"] == single["norm"], "TP alone keeps full copies of what the norms save: " + info
        assert sp["norm"] * t == tp["norm"], "SP must split A_out by T: " + info


def test_sequence_parallel_total_activation_drop(world2):
    """docs/design.md#activation-memory: A_in/T is untouched and the total drops by A_out·(T-1)/T."""
    t = len(world2)
    for r, res in enumerate(world2):
        tp, sp = res["activations"]["tp"], res["activations"]["tp_sp"]
        info = _activation_info(r, res["activations"])
        assert sp["other"] == tp["other"], "SP must not change what the TP regions save: " + info
        drop = (tp["norm"] + tp["other"]) - (sp["norm"] + sp["other"])
        assert drop == tp["norm"] * (t - 1) // t, f"total must drop by A_out·(T-1)/T: dropped {drop}; " + info


# ---------------------------------------------------------------------------------------------
# 6. Errors
@pytest.mark.parametrize("tp", [2, 4])
def test_indivisible_sizes_raise_naming_the_numbers(world2, world4, tp):
    results = world2 if tp == 2 else world4
    for res in results:
        errors = res["errors"]
        for what, (_, value) in ERROR_CASES[tp].items():
            assert what in errors, f"tp={tp}: no ValueError for {what}={value}"
            assert f"{what}={value} is not divisible by tp={tp}" in errors[what], errors[what]


def test_sequence_parallel_rejects_indivisible_sequence(world2):
    for res in world2:
        assert "seq" in res["errors"], "no ValueError for a sequence length not divisible by tp"
        msg = res["errors"]["seq"]
        assert f"sequence length {BAD_SEQ}" in msg and "tp=2" in msg, msg
