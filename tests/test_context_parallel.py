"""Context parallel (docs/design.md#context-parallelism): ring attention against full attention.

One spawn per cp size (2 and 4, `multiprocess`): zig-zag and contiguous layouts, causal or not, GQA
and multi-head, either block kernel. Outputs and dQ/dK/dV, put back in sequence order, must equal
single-process SDPA on the whole sequence within tests/tolerance.py's bound; each rank's p2p volume
equals `formulas.ring_attention_p2p_elements`; saved activations fall as 1/C; cp 2, dp 2 × cp 2, cp
2 × tp 2 + SP and pp 2 × cp 2 training equals single-process training, with the ring, with Ulysses
(cp_mode ulysses) and the hybrid at cp 4 (Ulysses 2 × ring 2, zig-zag and contiguous). The layout's shard / unshard
checks run in-process."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from dist_utils import coalescing_p2p, run_workers
from tolerance import KERNELS, assert_values_close, reference, unit_roundoff

from fivefold.context_parallel.layout import SequenceLayout
from fivefold.context_parallel.ring_attention import RingAttention, ring_attention
from fivefold.distributed.comm import Comm, CommLog
from fivefold.formulas import ring_attention_p2p_elements

B, L, D_HEAD = 2, 32, 8
CASES = [dict(layout=layout, causal=causal, heads=heads, kernel=kernel) for layout, causal, heads, kernel
         in itertools.product(("zigzag", "contiguous"), (True, False), ((4, 2), (2, 2)), ("cpu_flash", "math"))]


def _case_id(c: dict) -> str:
    return f"{c['layout']}-{'causal' if c['causal'] else 'full'}-h{c['heads'][0]}kv{c['heads'][1]}-{c['kernel']}"


def _inputs(case: dict) -> tuple[torch.Tensor, ...]:
    hq, hkv = case["heads"]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, hq, L, D_HEAD, generator=g)
    k = torch.randn(B, hkv, L, D_HEAD, generator=g)
    v = torch.randn(B, hkv, L, D_HEAD, generator=g)
    grad = torch.randn(B, hq, L, D_HEAD, generator=g)
    return q, k, v, grad


def _reference(case: dict, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    q, k, v, grad = (t.to(dtype).clone().requires_grad_(i < 3) for i, t in enumerate(_inputs(case)))
    group = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         is_causal=case["causal"])
    out.backward(grad)
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _terms(case: dict) -> int:
    """Rule 1's n (tests/tolerance.py): the sequence split over cp, once per query head of a kv head (dK, dV)."""
    hq, hkv = case["heads"]
    return L * hq // hkv


def _grad_scale(ref: dict[str, torch.Tensor]) -> float:
    return max(float(ref[n].abs().max()) for n in ("dq", "dk", "dv"))


def _sent(log: CommLog) -> dict[str, int]:
    """Elements sent, by tag."""
    sends: dict[str, int] = {}
    for r in log.records:
        if r.op == "send":
            sends[r.tag] = sends.get(r.tag, 0) + r.numel
    return sends


def _worker() -> dict:
    comm = Comm(None, "cp", CommLog())
    results = {}
    for case in CASES:
        layout = SequenceLayout(case["layout"], comm.size)
        q, k, v, grad = (layout.shard(t, comm.rank, dim=2) for t in _inputs(case))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        comm.log.reset()
        out = ring_attention(q, k, v, comm, layout, causal=case["causal"], kernel=case["kernel"])
        forward = _sent(comm.log)
        out.backward(grad)
        results[_case_id(case)] = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, forward=forward,
                                       total=_sent(comm.log))
    # Under NCCL's semantics (one work per batch) and in bf16, GQA, zig-zag, both kernels.
    case = dict(layout="zigzag", causal=True, heads=(4, 2))
    layout = SequenceLayout("zigzag", comm.size)
    for kernel in ("cpu_flash", "math"):
        q, k, v, grad = (layout.shard(t, comm.rank, dim=2).bfloat16() for t in _inputs(case))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        with coalescing_p2p() as batches:
            out = ring_attention(q, k, v, comm, layout, kernel=kernel)
            out.backward(grad)
        assert batches and all(n == 2 for n in batches)  # one send + one receive per batch
        results[f"bf16-coalesced-{kernel}"] = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)
    # A sequence of another length than the core was set up for is refused, not given wrong positions.
    core = RingAttention(comm, layout, seq_len=L)
    q = torch.zeros(1, 2, L // (2 * comm.size), D_HEAD)
    try:
        core(q, q, q)
        results["wrong_length"] = None
    except ValueError as e:
        results["wrong_length"] = str(e)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda c: f"cp{c}")
def ring_results(request):
    return request.param, run_workers(_worker, request.param)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ring_attention_equals_full_attention(ring_results, case, kernels):
    cp, results = ring_results
    layout = SequenceLayout(case["layout"], cp)
    want = reference(_reference, case, kernels=kernels)
    for name in ("out", "dq", "dk", "dv"):
        got = layout.unshard([r[_case_id(case)][name] for r in results], dim=2)
        assert_values_close(got, want[name], _terms(case), f"cp={cp} {name}",
                            scale=None if name == "out" else _grad_scale(want))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_each_rank_sends_the_formula_volume(ring_results, case):
    cp, results = ring_results
    hq, hkv = case["heads"]
    want = ring_attention_p2p_elements(B, L, hkv, D_HEAD, cp)
    for rank, r in enumerate(results):
        got = r[_case_id(case)]
        assert got["forward"] == {"cp_kv": want["forward_kv"]}, rank
        assert got["total"] == {"cp_kv": want["forward_kv"] + want["backward_kv"], "cp_dkv": want["backward_dkv"]}, rank


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernel", ["cpu_flash", "math"])
def test_ring_attention_in_bf16_under_nccl_semantics(ring_results, kernel):
    """bf16 inputs, batches completing as one work (NCCL): as close to fp32 attention as bf16 SDPA is — within twice
    its error, plus one bf16 rounding of the largest entry for the rounding the ring adds (the flash kernel returns
    each block's result in bf16; the ring merges them in fp32, and a weighted mean of roundings is at most one)."""
    cp, results = ring_results
    case = dict(layout="zigzag", causal=True, heads=(4, 2))
    layout = SequenceLayout("zigzag", cp)
    want = reference(_reference, case)
    bf16_grads = reference(_reference, case, torch.bfloat16)
    for name in ("out", "dq", "dk", "dv"):
        got = layout.unshard([r[f"bf16-coalesced-{kernel}"][name] for r in results], dim=2)
        assert got.dtype == torch.bfloat16
        err = (got.float() - want[name]).abs().max().item()
        sdpa_err = (bf16_grads[name].float() - want[name]).abs().max().item()
        rounding = unit_roundoff(torch.bfloat16) * want[name].abs().max().item()
        assert err <= 2 * sdpa_err + rounding, (f"{name}: ring bf16 error {err:.2e}, SDPA bf16 error {sdpa_err:.2e}, "
                                                f"one bf16 rounding {rounding:.2e}")


@pytest.mark.multiprocess
def test_a_sequence_of_another_length_is_refused(ring_results):
    _, results = ring_results
    assert all("context parallel was set up for sequences of 32 tokens" in r["wrong_length"] for r in results)


def test_layout_shard_and_unshard_are_inverse():
    x = torch.arange(2 * 24).view(2, 24)
    for kind, cp in itertools.product(("zigzag", "contiguous"), (1, 2, 3)):
        layout = SequenceLayout(kind, cp)
        parts = [layout.shard(x, r) for r in range(cp)]
        assert torch.equal(layout.unshard(parts), x)
        if kind == "zigzag":  # rank i holds chunks i and 2C-1-i: equal causal work
            chunk = 24 // (2 * cp)
            assert parts[0][0, :chunk].tolist() == list(range(chunk))
            assert parts[0][0, chunk:].tolist() == list(range(24 - chunk, 24))


def test_layout_refuses_a_sequence_it_cannot_split():
    with pytest.raises(ValueError, match="seq_len=30 is not divisible by 8"):
        SequenceLayout("zigzag", 4).positions(0, 30)


# ---------------------------------------------------------------------------------------------
# Saved activations: what ring attention keeps for backward, per rank, against single-process attention.
def _saved_bytes(fn, *args) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


MEM_SHAPE = dict(batch=1, heads=4, kv_heads=2, seq=256, d=16)


def _mem_inputs(seq: int) -> list[torch.Tensor]:
    m = MEM_SHAPE
    g = torch.Generator().manual_seed(0)
    return [torch.randn(m["batch"], h, seq, m["d"], generator=g).requires_grad_()
            for h in (m["heads"], m["kv_heads"], m["kv_heads"])]


def _memory_worker() -> int:
    comm = Comm(None, "cp", CommLog())
    layout = SequenceLayout("zigzag", comm.size)
    q, k, v = _mem_inputs(MEM_SHAPE["seq"] // comm.size)
    return _saved_bytes(ring_attention, q, k, v, comm, layout)


@pytest.mark.multiprocess
def test_saved_activations_fall_as_one_over_cp():
    from fivefold.models.llama import causal_attention

    full = _saved_bytes(causal_attention, *_mem_inputs(MEM_SHAPE["seq"]))
    per_rank = {cp: max(run_workers(_memory_worker, cp)) for cp in (2, 4)}
    print(f"attention saved for backward per rank: single-process {full / 1024:.1f} KiB, ring cp=2 "
          f"{per_rank[2] / 1024:.1f} KiB ({per_rank[2] / full:.3f}), cp=4 {per_rank[4] / 1024:.1f} KiB "
          f"({per_rank[4] / full:.3f})")
    assert per_rank[4] * 2 == per_rank[2]  # q, k, v, out, lse: all proportional to L/C
    assert per_rank[2] <= full / 2 and per_rank[4] <= full / 4


# ---------------------------------------------------------------------------------------------
# Whole-model training with cp composed with dp, tp (+ SP), pp and ZeRO, against single-process training.
MODEL_CFG = dict(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32, vocab_size=32)
SEQ, ROWS, STEPS, LR, WD, EPS, CLIP = 16, 8, 5, 1e-2, 0.1, 1e-4, 0.5
# Rule 1's n (tests/tolerance.py): the global batch's tokens summed into a weight gradient (split over dp, cp and
# micro-batches), longer than the sequence cp splits and the inner dimensions tp splits.
TRAIN_TERMS = max(ROWS * SEQ, MODEL_CFG["ffn_hidden"], MODEL_CFG["vocab_size"])
MODEL_RUNS = {  # world: [(name, mesh dims, config overrides)]
    2: [("cp2-zero0", dict(cp=2, dp=1), dict(zero=0)),
        ("cp2-zero2-contiguous", dict(cp=2, dp=1), dict(zero=2, layout="contiguous")),
        ("cp2-ulysses-zero0", dict(cp=2, dp=1, cp_ulysses=2), dict(zero=0, mode="ulysses"))],
    4: [("dp2-cp2-zero3", dict(dp=2, cp=2), dict(zero=3)),
        ("cp2-tp2-sp-zero1", dict(cp=2, tp=2, dp=1), dict(zero=1, tp=2, sp=True)),
        ("pp2-cp2-1f1b", dict(pp=2, cp=2, dp=1), dict(zero=1, pp=2)),
        # the same layouts with Ulysses (cp_mode ulysses: U = cp) and the hybrid (Ulysses 2 × ring 2)
        ("dp2-cp2-ulysses-zero3", dict(dp=2, cp=2, cp_ulysses=2), dict(zero=3, mode="ulysses")),
        ("cp2-tp2-sp-ulysses-zero1", dict(cp=2, tp=2, dp=1, cp_ulysses=2), dict(zero=1, tp=2, sp=True,
                                                                                  mode="ulysses")),
        ("pp2-cp2-ulysses-1f1b", dict(pp=2, cp=2, dp=1, cp_ulysses=2), dict(zero=1, pp=2, mode="ulysses")),
        ("cp4-hybrid-zero0", dict(cp=4, dp=1, cp_ulysses=2), dict(zero=0, mode="hybrid")),
        ("cp4-hybrid-contiguous-zero2", dict(cp=4, dp=1, cp_ulysses=2), dict(zero=2, mode="hybrid",
                                                                              layout="contiguous"))],
}


def _model_config():
    from fivefold.models import get_config
    return get_config("tiny", **MODEL_CFG)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randint(0, MODEL_CFG["vocab_size"], (ROWS, SEQ), generator=g)
    return x, torch.randint(0, MODEL_CFG["vocab_size"], (ROWS, SEQ), generator=g)


def _train_worker(world: int) -> dict:
    from fivefold.config import Config
    from fivefold.distributed.mesh import ParallelDims, ParallelMesh
    from fivefold.models.parallelize import parallelize

    out = {}
    for name, dims, o in MODEL_RUNS[world]:
        cfg = Config()
        cfg.parallel.cp, cfg.parallel.tp, cfg.parallel.pp = dims["cp"], o.get("tp", 1), o.get("pp", 1)
        cfg.parallel.sp, cfg.parallel.cp_layout = o.get("sp", False), o.get("layout", "zigzag")
        cfg.parallel.cp_mode = o.get("mode", "ring")
        cfg.parallel.cp_ulysses = dims["cp_ulysses"] if cfg.parallel.cp_mode == "hybrid" else None
        cfg.zero.stage = o["zero"]
        cfg.train.lr, cfg.train.weight_decay, cfg.train.beta2, cfg.train.eps = LR, WD, 0.999, EPS
        cfg.train.grad_accum, cfg.train.seq_len, cfg.train.seed, cfg.train.warmup_steps = 2, SEQ, 0, 0
        mesh = ParallelMesh(ParallelDims(**dims), "cpu", CommLog())
        parts = parallelize(cfg, _model_config(), mesh, "cpu")
        dp = mesh.comm("dp")
        history, losses = [], []
        for step in range(STEPS):
            x, y = (t.chunk(dp.size)[dp.rank] for t in _batch(step))
            loss = parts.forward_backward(list(zip(x.chunk(2), y.chunk(2))))
            parts.step(CLIP)
            losses.append(parts.global_loss(loss).item())
            history.append(parts.full_state_dict())
        tp_dims = {n: pl.tp_dim for e in parts.engines.values() for n, pl in getattr(e.module, "tp_placements",
                                                                                     {}).items()}
        out[name] = dict(history=history, losses=losses, tp_rank=mesh.rank("tp"), tp_dims=tp_dims)
    return out


@pytest.fixture(scope="module")
def model_results():
    return {world: run_workers(_train_worker, world, world) for world in MODEL_RUNS}


def _reference_training() -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    from fivefold.models.llama import Llama

    model = Llama(_model_config(), seed=0)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in model.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=EPS)
    losses, history = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, history


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("name", [n for runs in MODEL_RUNS.values() for n, _, _ in runs])
def test_training_with_cp_equals_single_process(model_results, name, kernels):
    world = next(w for w, runs in MODEL_RUNS.items() if any(n == name for n, _, _ in runs))
    (want_losses, want_history), (loss_bounds, history_bounds) = reference(_reference_training, kernels=kernels,
                                                                           terms=TRAIN_TERMS)
    for rank, res in enumerate(model_results[world]):
        run = res[name]
        assert len(run["losses"]) == len(want_losses), f"rank {rank}"
        for step, (got, want) in enumerate(zip(run["losses"], want_losses)):
            loss_bounds[step].assert_holds(got, want, f"rank {rank} step {step} loss")
        for step, (got, want) in enumerate(zip(run["history"], want_history)):
            assert got, f"rank {rank} holds no parameters"
            for pname, value in got.items():
                full = want[pname]
                dim = run["tp_dims"].get(pname)
                expected = full if dim is None else full.chunk(2, dim)[run["tp_rank"]]
                history_bounds[step][pname].assert_holds(value, expected, f"rank {rank} step {step} {pname}")


def _wrapped_after_cp_worker() -> dict:
    """A model given to context parallel first and to a data-parallel wrapper after (the order a user may pick):
    the wrapper's initial broadcast must leave each rank's RoPE rows, the positions it holds, alone."""
    from fivefold.context_parallel import apply_context_parallel
    from fivefold.data_parallel import DDP, ZeroDataParallel
    from fivefold.models import build_model
    from fivefold.models.plans import LLAMA_CP_PLAN

    comm = Comm(None, "cp", CommLog())
    layout, seq = SequenceLayout("zigzag", comm.size), 16
    out = {}
    for name, wrap in (("zero0", lambda m: ZeroDataParallel(m, comm, zero_stage=0)), ("ddp", lambda m: DDP(m, comm))):
        model = build_model(_model_config(), seed=0)
        full = model.rope_cos.clone()
        apply_context_parallel(model, comm, layout, seq, LLAMA_CP_PLAN)
        wrap(model)
        out[name] = torch.equal(model.rope_cos, full.index_select(0, layout.positions(comm.rank, seq, full.device)))
    return out


@pytest.mark.multiprocess
def test_a_data_parallel_wrapper_keeps_each_ranks_rope_rows():
    for rank, res in enumerate(run_workers(_wrapped_after_cp_worker, 2)):
        assert res == {"zero0": True, "ddp": True}, rank
