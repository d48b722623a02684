"""Expert parallelism (docs/design.md#expert-parallelism): the MoE layer against one process.

At ep 2 and 4 every rank builds the same layer (same seed), keeps its experts and routes its own
tokens; the single-process layer runs each rank's tokens in turn. Outputs, input gradients,
auxiliary losses, routing counts and dropped assignments equal it; replicated gradients equal that
rank's, an expert's gradient the sum over every rank's tokens, within tests/tolerance.py's bound
(bitwise where the ops agree). All-to-all payload equals the formula; dp × ep (ZeRO 0-3) and pp 2 ×
dp 2 × ep 2 training equals single-process training. One spawn per ep degree (`multiprocess`);
routing unit tests don't.

Host syncs (tests/host_syncs.py, counted on the CPU path with real values): one per MoE layer and
micro-batch, forward and backward together, with or without a capacity, under full recompute, at
ep 1 (in process, a layer and a two-layer model) and ep 2 / 4 (in the workers of the spawn above);
a control shows the count catches one added `.tolist()`. The expert strategies (grouped matmul,
padded bmm) against the loop: routing bit-equal, outputs and gradients within rule 1's bound (the
elementwise SwiGLU over all rows at once rounds a vector tail differently from per-expert slices)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_workers
from host_syncs import HostSyncs
from tolerance import KERNELS, WORKERS, assert_values_close, reference

from fivefold import ops
from fivefold.distributed.comm import Comm, CommLog
from fivefold.expert_parallel import AllToAllExperts
from fivefold.models.moe import (
    GroupedExperts,
    LocalExperts,
    LoopedExperts,
    MoEConfig,
    MoEFeedForward,
    PaddedBatchedExperts,
    default_experts,
)
from fivefold.pipeline.simulator import Timeline

D, HIDDEN, E = 16, 24, 8
CASES = {
    "softmax-top2": MoEConfig(experts=E, top_k=2),
    "sigmoid-top2-shared-zloss": MoEConfig(experts=E, top_k=2, score="sigmoid", shared_experts=1, z_loss_coef=1e-3),
    "top1-unnormalised": MoEConfig(experts=E, top_k=1, norm_topk=False),
    "capacity-1.0": MoEConfig(experts=E, top_k=2, capacity_factor=1.0),
    "device-limited": MoEConfig(experts=E, top_k=2, groups=4, group_limit=1),  # each token to one group (rank)
}


def _layer(cfg: MoEConfig) -> MoEFeedForward:
    torch.manual_seed(0)
    layer = MoEFeedForward(D, HIDDEN, cfg)
    with torch.no_grad():  # sharper routing than nn.Linear's default init, so the experts' loads differ
        layer.router.weight.mul_(4.0)
    return layer


def _tokens(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(2, 6, D, generator=g), torch.randn(2, 6, D, generator=g)


TOKENS = 2 * 6  # per rank


def _layer_terms(world: int) -> int:
    """Rule 1's n (tests/tolerance.py): an expert's gradient sums every rank's tokens routed to it."""
    return max(world * TOKENS, HIDDEN)


def _run(layer: MoEFeedForward, rank: int, recompute: bool = False) -> dict:
    """Forward and backward of `layer` on rank `rank`'s tokens (under full recompute: `ops.recompute`, as a block
    runs it), counting the host syncs of both."""
    x, upstream = _tokens(rank)
    x.requires_grad_()
    with HostSyncs(devices=("cpu",)) as syncs:
        out = ops.recompute(layer, x) if recompute else layer(x)
        out.backward(upstream)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    s = layer.stats
    return dict(out=out.detach(), dx=x.grad, grads=grads, counts=s.tokens_per_expert, dropped=int(s.dropped),
                aux=s.aux_loss, z=s.z_loss, syncs=syncs.count, where=syncs.where)


class _OneMoreRead:
    """An exchange that reads the counts on the host once more before the real one (the detector's control)."""

    def __init__(self, exchange) -> None:
        self.exchange = exchange

    def __call__(self, run, tokens, counts):
        counts.tolist()
        return self.exchange(run, tokens, counts)


def _worker() -> dict:
    comm = Comm(None, "ep", CommLog())
    results = {}
    for name, cfg in CASES.items():
        layer = _layer(cfg)
        per_rank = E // comm.size
        for e in range(E):
            if e // per_rank != comm.rank:
                del layer.experts[str(e)]
        layer.exchange = AllToAllExperts(comm, E)
        comm.log.reset()
        res = _run(layer, comm.rank)
        res["payload"] = {}
        for r in comm.log.records:
            res["payload"][r.tag] = res["payload"].get(r.tag, 0) + r.numel
        # the same layer under full recompute, and with each other strategy (the default is the device's)
        res["recomputed"] = _run(layer, comm.rank, recompute=True)
        for strategy in (LoopedExperts(), PaddedBatchedExperts()):
            layer.strategy = strategy
            res[type(strategy).__name__] = _run(layer, comm.rank)
        layer.exchange = _OneMoreRead(layer.exchange)
        res["control_syncs"] = _run(layer, comm.rank)["syncs"]
        results[name] = res
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"ep{n}")
def ep_results(request):
    return request.param, run_workers(_worker, request.param)


def _layer_reference(case: str, world: int) -> dict:
    """The whole layer on each rank's tokens in turn; each expert's gradient summed over them; the largest
    gradient entry of it all (rule 1's scale for every gradient)."""
    layer = _layer(CASES[case])
    per_rank = [_run(layer, r) for r in range(world)]
    expert_sum = {n: sum(w["grads"][n] for w in per_rank) for n in per_rank[0]["grads"] if ".experts." in f".{n}"}
    grads = [g for w in per_rank for g in (w["dx"], *w["grads"].values())] + list(expert_sum.values())
    return dict(per_rank=per_rank, expert_sum=expert_sum, grad_scale=max(float(g.abs().max()) for g in grads))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", CASES)
def test_moe_layer_with_ep_equals_single_process(ep_results, case, kernels):
    world, results = ep_results
    want = reference(_layer_reference, case, world, kernels=kernels)
    terms, expert_sum, grad_scale = _layer_terms(world), want["expert_sum"], want["grad_scale"]
    for rank, res in enumerate(results):
        got, ref = res[case], want["per_rank"][rank]
        for key in ("aux", "z"):  # the router on this rank's tokens alone: the reference's ops in its order
            if kernels == WORKERS:
                assert torch.equal(got[key], ref[key]), f"rank {rank} {key}"
            else:
                assert_values_close(got[key], ref[key], terms, f"rank {rank} {key}")
        assert_values_close(got["out"], ref["out"], terms, f"rank {rank} out")
        assert_values_close(got["dx"], ref["dx"], terms, f"rank {rank} dx", scale=grad_scale)
        assert torch.equal(got["counts"], ref["counts"]) and got["dropped"] == ref["dropped"], rank
        assert set(got["grads"]) == {n for n in ref["grads"] if not n.startswith("experts.")
                                     or int(n.split(".")[1]) // (E // world) == rank}
        for n, g in got["grads"].items():
            expected = expert_sum[n] if n.startswith("experts.") else ref["grads"][n]
            assert_values_close(g, expected, terms, f"rank {rank} grad {n}", scale=grad_scale)
    if CASES[case].capacity_factor is not None:
        assert sum(w["dropped"] for w in want["per_rank"]) > 0, "the capacity case must drop something"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_all_to_all_payload_equals_the_formula(ep_results, case):
    world, results = ep_results
    cfg = CASES[case]
    tokens = _tokens(0)[0].shape[0] * _tokens(0)[0].shape[1]
    dispatched = [r[case]["payload"]["ep_dispatch"] for r in results]
    combined = [r[case]["payload"]["ep_combine"] for r in results]
    for rank, res in enumerate(results):
        kept = cfg.top_k * tokens - res[case]["dropped"]
        assert dispatched[rank] == kept * D, rank  # its whole send buffer, the rows for its own experts included
        assert res[case]["payload"]["ep_counts"] == E
        # backward mirrors forward: the combine's gradient goes out like a dispatch, and vice versa
        assert res[case]["payload"]["ep_combine_bwd"] == dispatched[rank]
        assert res[case]["payload"]["ep_dispatch_bwd"] == combined[rank]
    # combine sends back what arrived: every rank's kept rows routed to this rank's experts (from the reference)
    counts = [w["counts"] for w in reference(_layer_reference, case, world)["per_rank"]]
    per_rank = E // world
    for rank in range(world):
        arrived = sum(int(c[rank * per_rank:(rank + 1) * per_rank].sum()) for c in counts)
        assert combined[rank] == arrived * D, rank
    if cfg.capacity_factor is None:  # over the group: dispatch + combine = 2·k·T·D
        assert sum(dispatched) + sum(combined) == 2 * cfg.top_k * tokens * world * D


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_moe_layer_with_ep_syncs_once_and_every_strategy_agrees(ep_results, case):
    """In the workers: one host sync per forward + backward (the splits), the same under full recompute (whose
    results equal the plain run's bit for bit), one more with a `.tolist()` added; the loop and the padded bmm
    against the default strategy."""
    world, results = ep_results
    for rank, res in enumerate(results):
        got = res[case]
        assert got["syncs"] == 1, f"rank {rank}: {got['syncs']} host syncs\n" + "\n".join(got["where"])
        again = got["recomputed"]
        assert again["syncs"] == 1, f"rank {rank} recomputed: {again['syncs']}\n" + "\n".join(again["where"])
        for key in ("out", "dx", "aux", "z", "counts"):
            assert torch.equal(again[key], got[key]), (rank, key)
        assert all(torch.equal(again["grads"][n], g) for n, g in got["grads"].items()), rank
        assert got["control_syncs"] == 2, rank
        _assert_strategies_agree(got, {n: got[n] for n in ("LoopedExperts", "PaddedBatchedExperts")},
                                 _layer_terms(world), f"ep{world} rank {rank}")


def _assert_strategies_agree(want: dict, others: dict, terms: int, msg: str) -> None:
    """Routing and losses bit-equal; outputs, input and parameter gradients within rule 1's bound (scale: the
    largest gradient entry)."""
    grad_scale = max(float(g.abs().max()) for g in (want["dx"], *want["grads"].values()))
    for name, got in others.items():
        assert got["syncs"] == 1, (msg, name, got["where"])
        for key in ("counts", "aux", "z"):
            assert torch.equal(got[key], want[key]), (msg, name, key)
        assert got["dropped"] == want["dropped"], (msg, name)
        assert_values_close(got["out"], want["out"], terms, f"{msg} {name} out")
        assert_values_close(got["dx"], want["dx"], terms, f"{msg} {name} dx", scale=grad_scale)
        assert set(got["grads"]) == set(want["grads"]), (msg, name)
        for n, g in got["grads"].items():
            assert_values_close(g, want["grads"][n], terms, f"{msg} {name} grad {n}", scale=grad_scale)


# ---------------------------------------------------------------------------------------------
# One host sync per layer and micro-batch; the expert strategies against the loop (ep 1, in process).
STRATEGIES = {"grouped": GroupedExperts, "padded": PaddedBatchedExperts, "loop": LoopedExperts}


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "full-recompute"])
@pytest.mark.parametrize("case", CASES)
def test_moe_layer_syncs_once_and_its_strategies_equal_the_loop(case, recompute):
    layer = _layer(CASES[case])
    runs = {}
    for name, strategy in STRATEGIES.items():
        layer.strategy = strategy()
        runs[name] = _run(layer, 0, recompute=recompute)
        assert runs[name]["syncs"] == 1, f"{name}: {runs[name]['syncs']} host syncs\n" + "\n".join(runs[name]["where"])
    loop = runs.pop("loop")
    _assert_strategies_agree(loop, runs, _layer_terms(1), case)
    # the control: one .tolist() more is one sync more, and once more in a recomputation (nothing replays it)
    layer.exchange = _OneMoreRead(LocalExperts())
    assert _run(layer, 0, recompute=recompute)["syncs"] == 2 + recompute


def test_an_moe_model_syncs_once_per_moe_layer_and_micro_batch():
    """A two-block Llama-MoE (capacity, z-loss) under full recompute, two micro-batches through forward and
    backward: 2 × 2 syncs (the recomputations read none)."""
    from fivefold.models.llama import Llama

    model = Llama(_moe_model_config(capacity_factor=1.0), seed=0).set_recompute("full")
    x, y = _moe_batch(0)
    with HostSyncs(devices=("cpu",)) as syncs:
        for xi, yi in zip(x.chunk(2), y.chunk(2)):
            torch.nn.functional.cross_entropy(model(xi).flatten(0, 1), yi.flatten()).backward()
    assert syncs.count == MOE_MODEL["n_layers"] * 2, "\n".join(syncs.where)


def test_batched_experts_defer_weight_gradients_under_zero_bubble():
    """Under `ops.recording_weight_grads` the grouped and padded experts leave their weight gradients to the store
    (none before its W pass), which then hands over what the plain loop computes."""
    want = _run(_layer(CASES["capacity-1.0"]), 0)
    for strategy in (GroupedExperts, PaddedBatchedExperts):
        layer = _layer(CASES["capacity-1.0"])
        layer.strategy = strategy()
        store = ops.WeightGradStore()
        x, upstream = _tokens(0)
        x.requires_grad_()
        with ops.recording_weight_grads(store):
            layer(x).backward(upstream)
        assert all(p.grad is None for n, p in layer.named_parameters() if n.startswith("experts.")), strategy
        assert store.pending() >= 3 * E
        store.run(None)
        grad_scale = max(float(g.abs().max()) for g in want["grads"].values())
        for n, p in layer.named_parameters():
            assert_values_close(p.grad, want["grads"][n], _layer_terms(1), f"{strategy.__name__} {n}",
                                scale=grad_scale)


def test_experts_strategy_by_device_and_alignment(monkeypatch):
    assert isinstance(default_experts(torch.device("cpu"), torch.float32), GroupedExperts)
    assert isinstance(default_experts(torch.device("cpu"), torch.float16), PaddedBatchedExperts)
    assert isinstance(default_experts(torch.device("meta"), torch.bfloat16), PaddedBatchedExperts)
    for capability, kind in (((9, 0), GroupedExperts), ((8, 0), PaddedBatchedExperts)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert isinstance(default_experts(torch.device("cuda"), torch.bfloat16), kind), capability
        assert isinstance(default_experts(torch.device("cuda"), torch.float32), PaddedBatchedExperts)
    # widths whose rows are not 16-byte aligned (10 fp32 values): the grouped strategy falls back to its fallback
    torch.manual_seed(0)
    layer, calls = MoEFeedForward(10, 12, MoEConfig(experts=4, top_k=2)), []

    class Watched(PaddedBatchedExperts):
        def __call__(self, *args):
            calls.append(1)
            return super().__call__(*args)

    x = torch.randn(6, 10)
    layer.strategy = GroupedExperts(fallback=Watched())
    got = layer(x)
    layer.strategy = LoopedExperts()
    assert calls and got.shape == x.shape
    assert_values_close(got, layer(x), 12, "fallback")


# ---------------------------------------------------------------------------------------------
# The single-process layer: routing rules, the auxiliary losses' value and gradient.
def _aux_losses_both_ways() -> dict:
    """The layer's injected aux gradients, and the same losses written out and added to the loss."""
    cfg = MoEConfig(experts=E, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01)
    x, upstream = _tokens(0)
    with_aux = _layer(cfg)
    (with_aux(x) * upstream).sum().backward()
    plain = _layer(cfg.replace(aux_loss_coef=0.0, z_loss_coef=0.0))
    out = plain(x)
    logits = plain.router(x.reshape(-1, D)).float()
    probs = logits.softmax(-1)
    f = torch.bincount(probs.topk(2, dim=-1).indices.reshape(-1), minlength=E).float() / (2 * logits.shape[0])
    aux = E * (f * probs.mean(0)).sum()
    z = logits.logsumexp(-1).pow(2).mean()
    ((out * upstream).sum() + 0.1 * aux + 0.01 * z).backward()
    return dict(aux=(with_aux.stats.aux_loss, aux.detach()), z=(with_aux.stats.z_loss, z.detach()),
                grads={n: (p.grad, q.grad) for (n, p), q in zip(with_aux.named_parameters(), plain.parameters())})


def test_aux_losses_join_the_gradient_as_if_added_to_the_loss():
    both = reference(_aux_losses_both_ways)
    for key in ("aux", "z"):  # a sum over the tokens, then divided, against a mean
        assert_values_close(*both[key], TOKENS, key)
    grad_scale = max(float(want.abs().max()) for _, want in both["grads"].values())
    for n, (got, want) in both["grads"].items():
        if n.startswith("router."):  # the aux losses' gradients join the router's in another order
            assert_values_close(got, want, TOKENS, n, scale=grad_scale)
        else:  # untouched by them: the same ops in the same order
            assert torch.equal(got, want), n


def test_capacity_keeps_first_choices_before_second_choices():
    layer = MoEFeedForward(D, HIDDEN, MoEConfig(experts=2, top_k=2, capacity_factor=0.5))
    # 4 tokens × 2 slots = 8 assignments over 2 experts, capacity ceil(0.5·8/2) = 2 per expert
    experts = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    kept = layer.capacity_mask(experts)
    # expert 0: first choices of tokens 0 and 1 fill it; expert 1: token 3's first choice, then token 0's second
    assert kept.tolist() == [[True, True], [True, False], [False, False], [True, False]]


def test_bad_moe_configs_are_named():
    with pytest.raises(ValueError, match="moe.top_k=3 exceeds moe.experts=2"):
        MoEConfig(experts=2, top_k=3).validate()
    with pytest.raises(ValueError, match="moe.score='relu'"):
        MoEConfig(score="relu").validate()

    class _ThreeRanks:
        size = 3

    with pytest.raises(ValueError, match="moe.experts=8 is not divisible by ep=3"):
        AllToAllExperts(_ThreeRanks(), 8)


# ---------------------------------------------------------------------------------------------
# Whole-model training of a Llama-MoE with ep composed with dp, ZeRO and pp, against single-process training.
MOE_MODEL = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16, vocab_size=32)
MOE = MoEConfig(experts=4, top_k=2, aux_loss_coef=0.05, z_loss_coef=1e-3)
SEQ, ROWS, STEPS, LR, WD, EPS, CLIP, M = 8, 8, 5, 1e-2, 0.1, 1e-4, 0.5, 2
# Rule 1's n (tests/tolerance.py): the global batch's tokens summed into a weight gradient (split over dp, ep and
# micro-batches), longer than every inner dimension. tests/test_hsdp.py uses it too (`moe_training_reference`).
MOE_TERMS = max(ROWS * SEQ, MOE_MODEL["ffn_hidden"], MOE_MODEL["vocab_size"])
TRAIN_RUNS = {  # world: [(name, mesh dims, config overrides)]
    2: [("dp2-ep2", dict(dp=2, ep=2), dict(zero=0))],
    4: [("dp4-ep2-zero1", dict(dp=4, ep=2), dict(zero=1)),
        ("dp4-ep4-zero3", dict(dp=4, ep=4), dict(zero=3)),
        ("pp2-dp2-ep2", dict(pp=2, dp=2, ep=2), dict(zero=1, pp=2)),
        # DualPipeV with its (F, B) units side by side: each unit's forward all-to-alls beside another's backward
        ("pp2-dp2-ep2-dualpipev-overlap", dict(pp=2, dp=2, ep=2),
         dict(zero=1, pp=2, schedule="dualpipev", overlap="on", M=4, model=dict(n_layers=4))),
        # sigmoid scores, a shared expert, device-limited routing: the routing variants under global balancing
        ("dp4-ep4-sigmoid-shared-limited", dict(dp=4, ep=4), dict(zero=2, moe=dict(
            score="sigmoid", shared_experts=1, groups=4, group_limit=2)))],
}


def _moe_model_config(model: dict | None = None, **moe: object):
    from fivefold.models import get_config
    return get_config("tiny", moe=MOE.replace(**moe), **{**MOE_MODEL, **(model or {})})


def _moe_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(0, MOE_MODEL["vocab_size"], (ROWS, SEQ), generator=g)
    return x, torch.randint(0, MOE_MODEL["vocab_size"], (ROWS, SEQ), generator=g)


def _moe_train_worker(world: int) -> dict:
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    out = {}
    for name, dims, o in TRAIN_RUNS[world]:
        cfg = Config()
        cfg.parallel.ep, cfg.parallel.pp, cfg.zero.stage = dims["ep"], o.get("pp", 1), o["zero"]
        cfg.train.lr, cfg.train.weight_decay, cfg.train.beta2, cfg.train.eps = LR, WD, 0.999, EPS
        m = o.get("M", M)
        cfg.train.grad_accum, cfg.train.seq_len, cfg.train.seed, cfg.train.warmup_steps = m, SEQ, 0, 0
        cfg.pipeline.schedule, cfg.pipeline.overlap = o.get("schedule", "1f1b"), o.get("overlap", "off")
        mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
        parts = parallelize(cfg, _moe_model_config(o.get("model"), **o.get("moe", {})), mesh, "cpu")
        dp = mesh.comm("dp")
        history, losses = [], []
        for step in range(STEPS):
            x, y = (t.chunk(dp.size)[dp.rank] for t in _moe_batch(step))
            loss = parts.forward_backward(list(zip(x.chunk(m), y.chunk(m))))
            parts.step(CLIP)
            losses.append(parts.global_loss(loss).item())
            history.append(parts.full_state_dict())
        out[name] = dict(history=history, losses=losses)
        if "overlap" in o:  # the last step's measured timeline: which passes ran at the same time
            out[name]["overlapped"] = [(str(a.kind), str(b.kind)) for a, b in
                                       Timeline([parts.runtime.records]).overlapped(0)]
            out[name]["units"] = len(parts.schedule.side_by_side[mesh.rank("pp")])
    return out


@pytest.fixture(scope="module")
def moe_training():
    return {world: run_workers(_moe_train_worker, world, world) for world in TRAIN_RUNS}


def _moe_reference(dp: int, M: int = M, model: dict | None = None, **moe: object,
                   ) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    from fivefold.models.llama import Llama
    from fivefold.models.parallelize import set_aux_grad_scale

    model = Llama(_moe_model_config(model, **moe), seed=0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=EPS)
    set_aux_grad_scale([model], 1.0 / M)
    losses, history = [], []
    for step in range(STEPS):
        x, y = _moe_batch(step)
        opt.zero_grad()
        total = 0.0
        for i in range(M):  # the global micro-batch i: every dp rank's i-th micro-batch
            xi = torch.cat([xr.chunk(M)[i] for xr in x.chunk(dp)])
            yi = torch.cat([yr.chunk(M)[i] for yr in y.chunk(dp)])
            loss = torch.nn.functional.cross_entropy(model(xi).flatten(0, 1), yi.flatten()) / M
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(total)
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, history


def moe_training_reference(dp: int, M: int = M, model: dict | None = None, kernels: str = WORKERS, **moe: object):
    """`_moe_reference` through `tolerance.reference`: ((losses, history), (their bounds)), cached per session."""
    return reference(_moe_reference, dp, M, model, kernels=kernels, terms=MOE_TERMS, **moe)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", [n for runs in TRAIN_RUNS.values() for n, _, _ in runs])
def test_moe_training_with_ep_equals_single_process(moe_training, name, kernels):
    world, dims, o = next((w, d, o) for w, runs in TRAIN_RUNS.items() for n, d, o in runs if n == name)
    (want_losses, want_history), (loss_bounds, history_bounds) = moe_training_reference(
        dims["dp"], o.get("M", M), o.get("model"), kernels=kernels, **o.get("moe", {}))
    for rank, res in enumerate(moe_training[world]):
        run = res[name]
        assert len(run["losses"]) == len(want_losses), f"rank {rank}"
        for step, (got, want) in enumerate(zip(run["losses"], want_losses)):
            loss_bounds[step].assert_holds(got, want, f"rank {rank} step {step} loss")
        for step, (got, want) in enumerate(zip(run["history"], want_history)):
            experts = {n for n in got if ".experts." in n}
            assert experts and len(experts) < len([n for n in want if ".experts." in n]), "experts are split"
            for pname, value in got.items():
                history_bounds[step][pname].assert_holds(value, want[pname], f"rank {rank} step {step} {pname}")
        if "overlap" in o:  # only units' passes overlap on the measured clock
            assert len(run["overlapped"]) <= run["units"], (rank, run["overlapped"])
            assert all(kinds == ("F", "B") or kinds == ("B", "F") for kinds in run["overlapped"]), run["overlapped"]
    if "overlap" in o:  # and some did: the all-to-alls keep a unit's passes waiting long enough to meet
        assert sum(len(res[name]["overlapped"]) for res in moe_training[world]) >= 1


def test_device_limited_routing_keeps_each_token_within_its_best_groups():
    """4 experts per group: a group's rank is the sum of its two best scores (not its total, not its best)."""
    layer = MoEFeedForward(D, HIDDEN, MoEConfig(experts=16, top_k=3, groups=4, group_limit=2))
    logits = torch.randn(256, 16, generator=torch.Generator().manual_seed(3)) * 3
    weights, experts, _ = layer.route(logits)
    scores = logits.softmax(-1)
    by_group = scores.view(256, 4, 4)
    best_groups = by_group.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    differs = 0
    for t in range(256):
        allowed = torch.cat([torch.arange(4 * g, 4 * g + 4) for g in best_groups[t].tolist()])
        assert set(experts[t].tolist()) == set(allowed[scores[t, allowed].topk(3).indices].tolist())
        by_total = set(by_group[t].sum(-1).topk(2).indices.tolist())
        differs += by_total != set(best_groups[t].tolist())
    assert differs > 0, "the data never tells the top-2 rule from ranking groups by their total"
    assert_values_close(weights.sum(-1), torch.ones(256), 3, "top-3 weights")  # renormalised over the chosen ones


def test_the_experts_bench_runs_every_strategy_on_one_layer():
    """`fivefold bench experts` at a toy size: every strategy timed, its table, the strategies' results close."""
    from bench.expert_parallel import EXPERT_STRATEGIES, bench_experts, format_experts_table

    result = bench_experts(sizes=((16, 32, 4, 32),), steps=2, warmup=0, repeats=2, threads=1)
    (row,) = result["sizes"]
    assert set(row["impls"]) == set(EXPERT_STRATEGIES) and row["impls"]["loop"]["ratio_paired"] == 1.0
    assert all(r["max_abs_diff"] < 1e-4 for r in row["impls"].values())
    assert "grouped / loop paired (min)" in format_experts_table(result)
