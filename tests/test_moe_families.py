"""MoE model families (docs/design.md#expert-parallelism): what Qwen2-MoE, Qwen3-MoE, Mixtral and
GLM-4-MoE / DeepSeek-V3 need of `MoEFeedForward`, against Hugging Face's own code.

- The layer with weights mapped from transformers' blocks (`Qwen2MoeSparseMoeBlock` with its gated
  shared expert of another width, `Qwen3MoeSparseMoeBlock`, `MixtralSparseMoeBlock`, `Glm4MoeMoE`
  with groups, shared experts, a routed scaling ≠ 1 and a hand-set score-correction bias) gives
  their outputs and gradients, fp32, within rule 1's bound (tests/tolerance.py).
- ``aux_convention`` hf: the gradient a model's layers inject equals autograd through transformers'
  `load_balancing_loss_func` on the same router logits (also under full recompute, also with
  sigmoid scores, groups and a bias, which that function ignores).
- Auxiliary-loss-free balancing: the bias after every step of 5 equals a hand-written reference
  (route by scores + bias, count, b += rate·sign(mean − c)), bitwise; a capacity's dropped
  assignments are counted, a recomputation is not, rate 0 keeps the bias; every option at once adds
  no host sync (forward, backward, recompute, the update). One spawn of 4 ranks
  (`multiprocess`): dp 4 × ep 2 with hf's pooled loss, the same under full recompute, and
  pp 2 × dp 2 × ep 2 have the bias and loads of single-process training on the global batch on every
  rank, bitwise (losses and parameters within rule 2's bound), and dp 4 × ep 2 resumed from a
  checkpoint continues bitwise.
- Bad keys are one clear line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_workers
from tolerance import assert_values_close, reference

from fivefold import ops
from fivefold.config import ConfigError, load_config
from fivefold.models import get_config
from fivefold.models.llama import Llama
from fivefold.models.moe import MoEConfig, MoEFeedForward, update_expert_bias

D, F_HIDDEN, E, K = 16, 12, 8, 2


def _moe_layers(module: torch.nn.Module) -> list[MoEFeedForward]:
    return [m for m in module.modules() if isinstance(m, MoEFeedForward)]


# ---------------------------------------------------------------------------------------------
# The layer against transformers' blocks.
def _randomise(block: torch.nn.Module, seed: int) -> None:
    """Every parameter of an HF block drawn (its routers start at zeros, its experts empty)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _shared_of(block: torch.nn.Module) -> torch.nn.Module | None:
    for name in ("shared_expert", "shared_experts"):  # Qwen2-MoE / GLM-4-MoE
        if hasattr(block, name):
            return getattr(block, name)
    return None


def _mapped(block: torch.nn.Module, cfg: MoEConfig) -> MoEFeedForward:
    """fivefold's layer holding `block`'s weights: the fused experts' [E, 2F, D] gate_up_proj is w1
    (the gate: first F rows) and w3 (up), down_proj [E, D, F] is w2; the shared expert's
    gate/up/down projections are w1/w3/w2; the shared gate and the score-correction bias as they
    are."""
    ex = block.experts
    hidden = ex.down_proj.shape[-1]
    layer = MoEFeedForward(D, hidden, cfg.replace(aux_loss_coef=0.0, z_loss_coef=0.0))
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        for e in range(cfg.experts):
            mine = layer.experts[str(e)]
            mine.w1.weight.copy_(ex.gate_up_proj[e, :hidden])
            mine.w3.weight.copy_(ex.gate_up_proj[e, hidden:])
            mine.w2.weight.copy_(ex.down_proj[e])
        shared = _shared_of(block)
        if shared is not None:
            for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                getattr(layer.shared, mine).weight.copy_(getattr(shared, theirs).weight)
        if hasattr(block, "shared_expert_gate"):
            layer.shared_gate.weight.copy_(block.shared_expert_gate.weight)
        if hasattr(block.gate, "e_score_correction_bias"):
            layer.expert_bias.copy_(block.gate.e_score_correction_bias)
    return layer


def _grads_as_hf(layer: MoEFeedForward, block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """fivefold's gradients under the HF block's parameter names and shapes."""
    experts = [layer.experts[str(e)] for e in range(layer.config.experts)]
    out = {
        "gate.weight": layer.router.weight.grad,
        "experts.gate_up_proj": torch.stack([torch.cat([m.w1.weight.grad, m.w3.weight.grad]) for m in experts]),
        "experts.down_proj": torch.stack([m.w2.weight.grad for m in experts]),
    }
    for name in ("shared_expert", "shared_experts"):
        if hasattr(block, name):
            for mine, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                out[f"{name}.{theirs}.weight"] = getattr(layer.shared, mine).weight.grad
    if hasattr(block, "shared_expert_gate"):
        out["shared_expert_gate.weight"] = layer.shared_gate.weight.grad
    return out


def _hf_block(family: str, **options: object) -> tuple[torch.nn.Module, MoEConfig]:
    """(transformers' MoE block of `family`, fp32, random weights; fivefold's config for it)."""
    common = dict(hidden_size=D, num_experts_per_tok=K, hidden_act="silu", experts_implementation="eager")
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        norm = bool(options["norm_topk"])
        hf = Qwen2MoeConfig(num_experts=E, moe_intermediate_size=F_HIDDEN, shared_expert_intermediate_size=20,
                            norm_topk_prob=norm, **common)
        block = Qwen2MoeSparseMoeBlock(hf)
        cfg = MoEConfig(experts=E, top_k=K, norm_topk=norm, shared_experts=1, shared_hidden=20, shared_gate=True)
    elif family == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(num_experts=E, moe_intermediate_size=F_HIDDEN,
                                                      norm_topk_prob=True, **common))
        cfg = MoEConfig(experts=E, top_k=K, norm_topk=True)
    elif family == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        block = MixtralSparseMoeBlock(MixtralConfig(num_local_experts=E, intermediate_size=F_HIDDEN, **common))
        cfg = MoEConfig(experts=E, top_k=K, norm_topk=True)
    elif family == "glm4_moe":
        from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

        hf = Glm4MoeConfig(n_routed_experts=E, moe_intermediate_size=F_HIDDEN, n_shared_experts=2, n_group=4,
                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, **common)
        block = Glm4MoeMoE(hf)
        cfg = MoEConfig(experts=E, top_k=K, score="sigmoid", norm_topk=True, shared_experts=2, groups=4,
                        group_limit=2, routed_scaling=2.5, expert_bias=True, expert_bias_rate=0.0)
    else:
        raise ValueError(family)
    _randomise(block, seed=len(family))
    if family == "glm4_moe":  # a bias of the scores' size, so that it moves the choice
        with torch.no_grad():
            block.gate.e_score_correction_bias.copy_(
                torch.randn(E, generator=torch.Generator().manual_seed(7)) * 0.3)
    return block.float().train(), cfg


HF_BLOCKS = {
    "qwen2_moe-norm_topk_false": ("qwen2_moe", dict(norm_topk=False)),
    "qwen2_moe-norm_topk_true": ("qwen2_moe", dict(norm_topk=True)),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", {}),
    "glm4_moe": ("glm4_moe", {}),
}


@pytest.mark.parametrize("case", HF_BLOCKS)
def test_the_layer_equals_transformers_block_forward_and_backward(case):
    family, options = HF_BLOCKS[case]
    block, cfg = _hf_block(family, **options)
    layer = _mapped(block, cfg)
    g = torch.Generator().manual_seed(1)
    x, upstream = torch.randn(2, 9, D, generator=g), torch.randn(2, 9, D, generator=g)
    tokens = x.shape[0] * x.shape[1]
    x_hf, x_ff = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = block(x_hf)
    (want * upstream).sum().backward()
    got = layer(x_ff)
    (got * upstream).sum().backward()
    assert got.shape == want.shape == x.shape
    assert_values_close(got.detach(), want.detach(), D, f"{case} out")
    grads = _grads_as_hf(layer, block)
    hf_grads = {n: p.grad for n, p in block.named_parameters()}
    assert set(grads) == set(hf_grads), (set(grads) ^ set(hf_grads))
    scale = max(float(t.abs().max()) for t in (x_hf.grad, *hf_grads.values()))
    assert_values_close(x_ff.grad, x_hf.grad, tokens, f"{case} input grad", scale=scale)
    for name, want_grad in hf_grads.items():
        assert_values_close(grads[name], want_grad, tokens, f"{case} {name}", scale=scale)
    if family == "glm4_moe":  # the bias did move the choice (else the test would not see it)
        logits = layer.router(x.reshape(-1, D)).float()
        biased = layer.route(logits)[1]
        with torch.no_grad():
            bias = layer.expert_bias.clone()
            layer.expert_bias.zero_()
            unbiased = layer.route(logits)[1]
            layer.expert_bias.copy_(bias)
        assert (biased.sort(-1).values != unbiased.sort(-1).values).any()


# ---------------------------------------------------------------------------------------------
# aux_convention hf: HF's pooled load-balancing loss.
AUX_MODEL = dict(n_layers=3, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16, vocab_size=32)
AUX_COEF = 0.5
HF_AUX = {
    "softmax": MoEConfig(experts=E, top_k=K, aux_convention="hf", aux_loss_coef=AUX_COEF),
    # the function ranks by the softmax's top k whatever the router chose by
    "sigmoid-groups-bias": MoEConfig(experts=E, top_k=K, score="sigmoid", groups=4, group_limit=2,
                                     expert_bias=True, aux_convention="hf", aux_loss_coef=AUX_COEF),
}


def _hf_aux_gradients(case: str, recompute: str) -> dict:
    """fivefold's injected aux gradient (the main loss × 0) over 2 micro-batches (each scaled 1/2, as
    the trainer scales them) and autograd through `load_balancing_loss_func` × coef / 2 on each
    micro-batch's router logits of the same model without its own aux."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from fivefold.models.parallelize import set_aux_grad_scale

    moe = HF_AUX[case]
    x = torch.randint(0, AUX_MODEL["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(5))
    model = Llama(get_config("tiny", moe=moe, **AUX_MODEL), seed=0).set_recompute(recompute)
    plain = Llama(get_config("tiny", moe=moe.replace(aux_loss_coef=0.0), **AUX_MODEL), seed=0)
    with torch.no_grad():  # sharper routers (the loads differ) and a bias that matters, the same in both
        for a, b in zip(_moe_layers(model), _moe_layers(plain)):
            a.router.weight.mul_(8.0)
            b.router.weight.copy_(a.router.weight)
            if a.expert_bias is not None:
                a.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))
                b.expert_bias.copy_(a.expert_bias)
    set_aux_grad_scale([model], 0.5)
    stats, per_layer = [], []
    for xs in x.chunk(2):  # micro-batches: one pooled loss each
        (model(xs) * 0).sum().backward()
        stats += [m.stats.aux_loss for m in _moe_layers(model)]
        logits = []
        hooks = [m.router.register_forward_hook(lambda mod, inp, out, logits=logits: logits.append(out))
                 for m in _moe_layers(plain)]
        out = plain(xs)
        for h in hooks:
            h.remove()
        aux = load_balancing_loss_func(tuple(logits), E, K)
        ((out * 0).sum() + AUX_COEF * aux / 2).backward()
        per_layer += [load_balancing_loss_func((lg.detach(),), E, K) for lg in logits]
    return dict(got={n: p.grad for n, p in model.named_parameters()},
                want={n: p.grad for n, p in plain.named_parameters()}, stats=stats, per_layer=per_layer)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("case", HF_AUX)
def test_hf_aux_gradient_equals_autograd_through_transformers_load_balancing_loss(case, recompute):
    r = reference(_hf_aux_gradients, case, recompute)
    tokens = 4 * 8 * AUX_MODEL["n_layers"]  # the pooled sums (both micro-batches')
    scale = max(float(g.abs().max()) for g in r["want"].values())
    assert scale > 0
    routers = [n for n in r["want"] if n.endswith("router.weight")]
    assert len(routers) == AUX_MODEL["n_layers"] and all(float(r["want"][n].abs().max()) > 0 for n in routers)
    for name, want in r["want"].items():
        assert_values_close(r["got"][name], want, tokens, f"{case} {name}", scale=scale)
    for layer, (got, want) in enumerate(zip(r["stats"], r["per_layer"])):  # each layer's own loss
        assert_values_close(got, want, 2 * 8, f"{case} layer {layer} aux")


# ---------------------------------------------------------------------------------------------
# Auxiliary-loss-free balancing, in process.
BIAS_MODEL = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16, vocab_size=32)
BIAS_MOE = MoEConfig(experts=E, top_k=K, score="sigmoid", groups=2, group_limit=1, expert_bias=True,
                     expert_bias_rate=0.01, aux_loss_coef=0.05)
SEQ, ROWS, STEPS, M, LR, CLIP, EPS = 8, 8, 5, 2, 1e-2, 0.5, 1e-4


def _bias_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    x = torch.randint(0, BIAS_MODEL["vocab_size"], (ROWS, SEQ), generator=g)
    return x, torch.randint(0, BIAS_MODEL["vocab_size"], (ROWS, SEQ), generator=g)


def _chosen_by_hand(logits: torch.Tensor, bias: torch.Tensor, c: MoEConfig) -> torch.Tensor:
    """DeepSeek-V3's selection written out: sigmoid scores + bias; groups ranked by their two best
    biased scores; the top k of the kept groups' biased scores."""
    biased = logits.float().sigmoid() + bias
    grouped = biased.view(len(logits), c.groups, -1)
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(c.group_limit, dim=-1).indices
    kept = torch.zeros(len(logits), c.groups, dtype=torch.bool).scatter(1, best, True)
    return grouped.masked_fill(~kept[..., None], float("-inf")).view_as(biased).topk(c.top_k, dim=-1).indices


def test_expert_bias_after_every_step_equals_a_hand_written_reference():
    c = BIAS_MOE
    model = Llama(get_config("tiny", moe=c, **BIAS_MODEL), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    layers = _moe_layers(model)
    logits: list[list[torch.Tensor]] = [[] for _ in layers]
    for i, m in enumerate(layers):
        m.router.register_forward_hook(lambda mod, inp, out, i=i: logits[i].append(out.detach()))
    biases = [torch.zeros(E) for _ in layers]
    moved = False
    for step in range(STEPS):
        for lg in logits:
            lg.clear()
        x, y = _bias_batch(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            (F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()) / M).backward()
        opt.step()
        counts = []
        for i in range(len(layers)):
            counts.append(sum(torch.bincount(_chosen_by_hand(lg, biases[i], c).flatten(), minlength=E)
                              for lg in logits[i]))
            assert counts[i].sum() == ROWS * SEQ * K
            moved |= any(not torch.equal(_chosen_by_hand(lg, biases[i], c), _chosen_by_hand(lg, 0 * biases[i], c))
                         for lg in logits[i])
            biases[i] = biases[i] + c.expert_bias_rate * torch.sign(counts[i].float().mean() - counts[i].float())
        update_expert_bias(layers)
        for i, m in enumerate(layers):
            assert torch.equal(m.step_load, counts[i]), (step, i)
            assert torch.equal(m.expert_bias, biases[i]), (step, i, m.expert_bias, biases[i])
            assert m.expert_load is None  # counted afresh from the next step
    assert moved, "the bias never changed a token's experts: the test would not see it"
    assert all(b.abs().sum() > 0 for b in biases)
    assert "layers.0.feed_forward.expert_bias" in model.state_dict()


def test_expert_load_counts_dropped_assignments_once_and_rate_zero_keeps_the_bias():
    torch.manual_seed(0)
    layer = MoEFeedForward(D, F_HIDDEN, BIAS_MOE.replace(groups=1, group_limit=None, capacity_factor=0.5))
    with torch.no_grad():
        layer.router.weight.mul_(4.0)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(3), requires_grad=True)
    layer(x).sum().backward()
    once = layer.expert_load.clone()
    assert int(layer.stats.dropped) > 0 and int(once.sum()) == 2 * 6 * K  # the selection, dropped too
    assert torch.equal(once, torch.bincount(layer.route(layer.router(x.reshape(-1, D)).float())[1].flatten(),
                                            minlength=E))
    layer.expert_load = None
    ops.recompute(layer, x).sum().backward()  # the forward runs again in backward: counted once
    assert torch.equal(layer.expert_load, once)
    with torch.no_grad():
        layer(x)  # evaluation: not a step's load
    assert torch.equal(layer.expert_load, once)
    fixed = MoEFeedForward(D, F_HIDDEN, BIAS_MOE.replace(expert_bias_rate=0.0))
    with torch.no_grad():
        fixed.expert_bias.copy_(torch.linspace(-1, 1, E))
    fixed(x).sum().backward()
    update_expert_bias([fixed])
    assert fixed.expert_load is None and torch.equal(fixed.expert_bias, torch.linspace(-1, 1, E))


def test_the_families_add_no_host_sync_forward_backward_or_in_the_update():
    """Every option at once (gated shared experts of their own width, routed scaling, the bias with
    groups, hf's pooled loss) under full recompute, two micro-batches and the bias update: still one
    sync per MoE layer and micro-batch (the exchange's sizes)."""
    from host_syncs import HostSyncs

    moe = BIAS_MOE.replace(shared_experts=1, shared_hidden=20, shared_gate=True, routed_scaling=2.5,
                           aux_convention="hf", z_loss_coef=1e-3)
    model = Llama(get_config("tiny", moe=moe, **BIAS_MODEL), seed=0).set_recompute("full")
    x, y = _bias_batch(0)
    with HostSyncs(devices=("cpu",)) as syncs:
        for xi, yi in zip(x.chunk(2), y.chunk(2)):
            F.cross_entropy(model(xi).flatten(0, 1), yi.flatten()).backward()
        update_expert_bias(_moe_layers(model))
    assert syncs.count == BIAS_MODEL["n_layers"] * 2, "\n".join(syncs.where)
    assert all(int(m.step_load.sum()) == ROWS * SEQ * K for m in _moe_layers(model))


# ---------------------------------------------------------------------------------------------
# Under dp × ep (× pp): one spawn of 4 ranks.
K_SAVE = 2
TERMS = max(ROWS * SEQ, BIAS_MODEL["ffn_hidden"], BIAS_MODEL["vocab_size"])
MOES = {"hf": BIAS_MOE.replace(aux_convention="hf"), "switch": BIAS_MOE}
LAYOUTS = {  # name: (mesh dims, moe, train.recompute)
    "dp4-ep2-hf": (dict(dp=4, ep=2), "hf", "none"),
    "dp4-ep2-hf-recompute": (dict(dp=4, ep=2), "hf", "full"),
    "pp2-dp2-ep2-switch": (dict(pp=2, dp=2, ep=2), "switch", "none"),
}


def _bias_parts(dims: dict, moe: str, recompute: str):
    from fivefold.config import Config
    from fivefold.distributed.comm import CommLog
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    cfg = Config()
    cfg.parallel.ep, cfg.parallel.pp, cfg.zero.stage = dims["ep"], dims.get("pp", 1), 1
    cfg.train.lr, cfg.train.weight_decay, cfg.train.beta2, cfg.train.eps = LR, 0.1, 0.999, EPS
    cfg.train.grad_accum, cfg.train.seq_len, cfg.train.seed, cfg.train.warmup_steps = M, SEQ, 0, 0
    cfg.train.recompute = recompute
    mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
    return parallelize(cfg, get_config("tiny", moe=MOES[moe], **BIAS_MODEL), mesh, "cpu"), mesh


def _named_moe_layers(parts) -> dict[str, MoEFeedForward]:
    return {n: m for module in parts.modules() for n, m in module.named_modules() if isinstance(m, MoEFeedForward)}


def _train_bias(parts, mesh, first: int, last: int, save_to: Path | None = None) -> dict:
    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer

    dp = mesh.comm("dp")
    losses, biases, loads = [], [], []
    for step in range(first, last):
        x, y = (t.chunk(dp.size)[dp.rank] for t in _bias_batch(step))
        loss = parts.forward_backward(list(zip(x.chunk(M), y.chunk(M))))
        parts.step(CLIP)
        losses.append(parts.global_loss(loss).item())
        layers = _named_moe_layers(parts)
        biases.append({n: m.expert_bias.clone() for n, m in layers.items()})
        loads.append({n: m.step_load.clone() for n, m in layers.items()})
        if save_to is not None and step + 1 == K_SAVE:
            state = training_state(parts.engines.values(), mesh.comm("tp")).state_dict
            Checkpointer(save_to, keep=0).save(step + 1, state, {"steps_done": step + 1})
    state = training_state(parts.engines.values(), mesh.comm("tp")).state_dict
    kinds = {k: type(v).__name__ for k, v in state.items() if k.startswith("model.")}
    return dict(losses=losses, biases=biases, loads=loads, final=parts.full_state_dict(), kinds=kinds)


def _bias_worker(root: str) -> dict:
    from fivefold.checkpoint import training_state
    from fivefold.checkpoint.manager import Checkpointer

    root = Path(root)
    out = {}
    for name, (dims, moe, recompute) in LAYOUTS.items():
        parts, mesh = _bias_parts(dims, moe, recompute)
        out[name] = _train_bias(parts, mesh, 0, STEPS, root / "ckpt" if name == "dp4-ep2-hf" else None)
    parts, mesh = _bias_parts(*LAYOUTS["dp4-ep2-hf"])
    path = root / "ckpt" / f"step-{K_SAVE:08d}"
    elementwise, scalars = Checkpointer.saved_optimizer_keys(path)
    ts = training_state(parts.engines.values(), mesh.comm("tp"), scalars, elementwise)
    Checkpointer.load(path, ts.state_dict)
    ts.after_load(parts.engines.values())
    out["loaded_bias"] = {n: m.expert_bias.clone() for n, m in _named_moe_layers(parts).items()}
    out["resumed"] = _train_bias(parts, mesh, K_SAVE, STEPS)
    return out


@pytest.fixture(scope="module")
def bias_runs(tmp_path_factory):
    return run_workers(_bias_worker, 4, str(tmp_path_factory.mktemp("bias")))


def _bias_reference(moe: str, dp: int) -> dict:
    """Single-process training as `parallelize` configures it, global micro-batch i = every dp rank's
    i-th; the expert bias updated after every optimizer step."""
    model = Llama(get_config("tiny", moe=MOES[moe], **BIAS_MODEL), seed=0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=EPS)
    from fivefold.models.parallelize import set_aux_grad_scale

    set_aux_grad_scale([model], 1.0 / M)
    named = {n: m for n, m in model.named_modules() if isinstance(m, MoEFeedForward)}
    losses, biases, loads = [], [], []
    for step in range(STEPS):
        x, y = _bias_batch(step)
        opt.zero_grad()
        total = 0.0
        for i in range(M):
            xi = torch.cat([xr.chunk(M)[i] for xr in x.chunk(dp)])
            yi = torch.cat([yr.chunk(M)[i] for yr in y.chunk(dp)])
            loss = F.cross_entropy(model(xi).flatten(0, 1), yi.flatten()) / M
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        update_expert_bias(named.values())
        losses.append(total)
        biases.append({n: m.expert_bias.clone() for n, m in named.items()})
        loads.append({n: m.step_load.clone() for n, m in named.items()})
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, biases=biases, loads=loads, final=final)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_bias_under_dp_ep_and_pp_equals_single_process_on_every_rank(bias_runs, name):
    dims, moe, _ = LAYOUTS[name]
    want, bounds = reference(_bias_reference, moe, dims["dp"], terms=TERMS)
    held = set()
    for rank, res in enumerate(bias_runs):
        run = res[name]
        for step in range(STEPS):  # bitwise: the same counts, the same signs
            for layer, bias in run["biases"][step].items():
                assert torch.equal(run["loads"][step][layer], want["loads"][step][layer]), (rank, step, layer)
                assert torch.equal(bias, want["biases"][step][layer]), (rank, step, layer)
                held.add(layer)
        if rank == len(bias_runs) - 1 or "pp" not in dims:  # pp: the last stage has the loss
            for step, got in enumerate(run["losses"]):
                bounds["losses"][step].assert_holds(got, want["losses"][step], f"rank {rank} step {step} loss")
        for pname, value in run["final"].items():  # (the buffers: compared bitwise above)
            if not pname.endswith("expert_bias"):
                bounds["final"][pname].assert_holds(value, want["final"][pname], f"rank {rank} {pname}")
        buffers = {k: v for k, v in run["kinds"].items() if k.endswith("expert_bias")}
        assert buffers and set(buffers.values()) == {"Tensor"}, run["kinds"]  # buffers: plain tensors
        assert set(run["kinds"].values()) == {"Tensor", "Pieces"}
    assert held == set(want["biases"][0]), held  # every layer on some rank (each stage its own)
    assert any(b.abs().sum() > 0 for b in want["biases"][-1].values())


@pytest.mark.multiprocess
def test_expert_bias_is_counted_once_under_full_recompute(bias_runs):
    for res in bias_runs:
        plain, recomputed = res["dp4-ep2-hf"], res["dp4-ep2-hf-recompute"]
        for step in range(STEPS):
            for layer, load in plain["loads"][step].items():
                assert torch.equal(recomputed["loads"][step][layer], load)
                assert int(load.sum()) == ROWS * SEQ * K  # the global batch's assignments, once
                assert torch.equal(recomputed["biases"][step][layer], plain["biases"][step][layer])


@pytest.mark.multiprocess
def test_expert_bias_survives_a_checkpoint_bitwise(bias_runs):
    for rank, res in enumerate(bias_runs):
        run, resumed = res["dp4-ep2-hf"], res["resumed"]
        for layer, bias in res["loaded_bias"].items():
            assert torch.equal(bias, run["biases"][K_SAVE - 1][layer]), (rank, layer)
        assert resumed["losses"] == run["losses"][K_SAVE:]
        for i, step in enumerate(range(K_SAVE, STEPS)):
            for layer, bias in resumed["biases"][i].items():
                assert torch.equal(bias, run["biases"][step][layer]), (rank, step, layer)
        for pname, value in resumed["final"].items():
            assert torch.equal(value, run["final"][pname]), (rank, pname)


# ---------------------------------------------------------------------------------------------
# Bad keys.
def test_bad_moe_family_keys_are_one_clear_line():
    bad = [
        (dict(shared_gate=True), "moe.shared_gate=true gates the shared experts, but moe.shared_experts=0"),
        (dict(shared_hidden=20), "moe.shared_hidden=20 needs moe.shared_experts > 0"),
        (dict(shared_experts=1, shared_hidden=0), "moe.shared_hidden=0 needs"),
        (dict(routed_scaling=0.0), "moe.routed_scaling=0.0 must be a positive number"),
        (dict(routed_scaling=-1.0), "moe.routed_scaling=-1.0 must be a positive number"),
        (dict(expert_bias_rate=-1e-3), "moe.expert_bias_rate=-0.001 must not be negative"),
        (dict(aux_convention="deepseek"), "moe.aux_convention='deepseek': choose switch or hf"),
    ]
    for changes, message in bad:
        with pytest.raises(ValueError, match=None) as err:
            dataclasses.replace(MoEConfig(), **changes).validate()
        assert message in str(err.value) and "\n" not in str(err.value), (changes, str(err.value))


@pytest.fixture
def _elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # validation looks at runs/<name>: never the checkout's


def test_the_keys_are_config_keys_and_hf_aux_with_pp_is_refused_before_spawning(_elsewhere):
    from fivefold.train.validate import validate

    moe = validate(load_config(None, [
        "--preset", "tiny-moe", "--model.moe.shared_experts", "1", "--model.moe.shared_hidden", "40",
        "--model.moe.shared_gate", "true", "--model.moe.routed_scaling", "2.5", "--model.moe.expert_bias", "true",
        "--model.moe.expert_bias_rate", "0.002", "--model.moe.aux_convention", "hf"]), 2).model.moe
    assert (moe.shared_hidden, moe.shared_gate, moe.routed_scaling, moe.expert_bias, moe.expert_bias_rate,
            moe.aux_convention) == (40, True, 2.5, True, 0.002, "hf")
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, ["--preset", "tiny-moe", "--model.moe.aux_convention", "hf",
                                    "--parallel.pp", "2", "--train.grad_accum", "2"]), 2)
    assert "moe.aux_convention=hf with parallel.pp=2" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="moe.aux_convention='pooled': choose switch or hf"):
        load_config(None, ["--preset", "tiny-moe", "--model.moe.aux_convention", "pooled"])
    with pytest.raises(ConfigError, match="moe.shared_gate=true gates the shared experts"):
        validate(load_config(None, ["--preset", "tiny-moe", "--model.moe.shared_gate", "true"]), 2)
