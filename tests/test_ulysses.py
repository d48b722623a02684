"""Ulysses context parallel and the ring × Ulysses hybrid (docs/design.md#ulysses-and-the-hybrid) against
full attention.

One spawn per cp size (2 and 4, `multiprocess`): pure Ulysses at cp 2 and 4, the hybrid at cp 4 (Ulysses 2 × ring
2; at cp 2 there is no hybrid: it needs 1 < U < cp), causal, multi-head, GQA with kv heads split and repeated
(fewer kv heads than U), packed documents, a sliding window (pure Ulysses runs the model's own core: sdpa, and the
eager core with documents). Outputs and
dQ/dK/dV, put back in sequence order, equal single-process attention on the whole sequence within
tests/tolerance.py's bound; bf16 within twice bf16 SDPA's own error plus one bf16 rounding. Each rank's all-to-all
bytes equal `formulas.ulysses_all_to_all_elements` exactly, forward and backward, and (hybrid) its ring bytes
`formulas.ring_attention_p2p_elements` for the ring group. The layout and the head rule run in-process."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_workers
from tolerance import KERNELS, assert_values_close, reference, unit_roundoff

from fivefold.context_parallel.layout import SequenceLayout, UlyssesLayout
from fivefold.context_parallel.plan import UlyssesGroups
from fivefold.context_parallel.ring_attention import RingAttention
from fivefold.context_parallel.ulysses import UlyssesAttention, kv_repeats
from fivefold.distributed.comm import Comm, CommLog
from fivefold.formulas import ring_attention_p2p_elements, ulysses_all_to_all_elements
from fivefold.models.documents import document_mask, find_documents

B, L, D_HEAD, EOS = 2, 32, 8, 0
HEADS = ((4, 2), (4, 4), (8, 1))  # (query heads, kv heads): GQA, multi-head, one kv head (repeated)


def _modes(cp: int) -> list[tuple[str, int]]:
    """(mode, Ulysses degree U) at this cp size."""
    return [("ulysses", cp)] + ([("hybrid", 2)] if cp == 4 else [])


def _cases(cp: int) -> list[dict]:
    out = []
    for (mode, u), heads, docs, layout in itertools.product(_modes(cp), HEADS, (False, True),
                                                            ("zigzag", "contiguous")):
        if mode == "ulysses" and layout == "contiguous":
            continue  # (pure Ulysses has no ring: the layout kind is not used)
        for kernel in ("cpu_flash", "math") if mode == "hybrid" else ("-",):
            out.append(dict(mode=mode, u=u, heads=heads, docs=docs, layout=layout, kernel=kernel, window=None))
    out.append(dict(mode="ulysses", u=cp, heads=(4, 2), docs=False, layout="zigzag", kernel="-", window=5))
    out.append(dict(mode="ulysses", u=cp, heads=(4, 2), docs=True, layout="zigzag", kernel="eager", window=None))
    return out


def _case_id(c: dict) -> str:
    return (f"{c['mode']}{c['u']}-{c['layout']}-h{c['heads'][0]}kv{c['heads'][1]}-{c['kernel']}"
            + ("-docs" if c["docs"] else "") + (f"-window{c['window']}" if c["window"] else ""))


ALL_CASES = {cp: _cases(cp) for cp in (2, 4)}


def _rows() -> torch.Tensor:
    """Token rows with documents of several lengths, cut across chunk boundaries (EOS ends a document)."""
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(1, 9, (B, L), generator=g)
    rows[0, [3, 12, 13, 27]] = EOS
    rows[1, [20]] = EOS
    return rows


def _inputs(case: dict) -> tuple[torch.Tensor, ...]:
    hq, hkv = case["heads"]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, hq, L, D_HEAD, generator=g)
    k = torch.randn(B, hkv, L, D_HEAD, generator=g)
    v = torch.randn(B, hkv, L, D_HEAD, generator=g)
    grad = torch.randn(B, hq, L, D_HEAD, generator=g)
    return q, k, v, grad


def _reference(case: dict, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full attention on the whole sequence: SDPA with a dense mask (causal, within documents, within the window)."""
    q, k, v, grad = (t.to(dtype).clone().requires_grad_(i < 3) for i, t in enumerate(_inputs(case)))
    group = q.shape[1] // k.shape[1]
    if case["docs"]:
        ids = find_documents(_rows(), EOS).doc_ids
        mask = document_mask(ids, ids).unsqueeze(1)
    else:
        mask = torch.ones(L, L, dtype=torch.bool).tril()
    if case["window"]:
        mask = mask & torch.ones(L, L, dtype=torch.bool).triu(-(case["window"] - 1))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                         attn_mask=mask)
    out.backward(grad)
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _layout(case: dict, cp: int) -> UlyssesLayout:
    return UlyssesLayout(case["layout"], cp, case["u"])


def _core(case: dict, groups: UlyssesGroups, layout: UlyssesLayout):
    from fivefold.models.llama import causal_attention, eager_attention

    ring = layout.ring
    model_core = eager_attention if case["kernel"] == "eager" else causal_attention  # pure Ulysses: the model's
    inner = model_core if ring.cp == 1 else RingAttention(groups.ring, ring, L, kernel=case["kernel"])
    return UlyssesAttention(groups.ulysses, inner, L, L // layout.cp)


def _groups(cp: int, u: int) -> UlyssesGroups:
    """Ulysses over consecutive ranks, the ring across: the groups `ParallelDims.groups` cuts from a cp group."""
    import torch.distributed as dist

    from fivefold.distributed.topology import ParallelDims

    dims = ParallelDims(dp=1, cp=cp, cp_ulysses=u).resolve(cp)
    made = {}
    for dim in ("cp_ulysses", "cp_ring"):
        for ranks in dims.groups(dim):  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                made[dim] = group
    log = CommLog()
    return UlyssesGroups(Comm(made["cp_ulysses"], "cp_ulysses", log), Comm(made["cp_ring"], "cp_ring", log))


def _volumes(log: CommLog) -> dict[str, int]:
    """Elements this rank put into all-to-alls (by tag) and sent on the ring (by tag)."""
    out: dict[str, int] = {}
    for r in log.records:
        if r.op in ("all_to_all", "send"):
            out[r.tag] = out.get(r.tag, 0) + r.numel
    return out


def _worker(cp: int) -> dict:
    results = {}
    groups = {u: _groups(cp, u) for u in {u for _, u in _modes(cp)}}
    for case in ALL_CASES[cp]:
        g = groups[case["u"]]
        layout = _layout(case, cp)
        rank = g.rank
        q, k, v, grad = (layout.shard(t, rank, dim=2) for t in _inputs(case))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        core = _core(case, g, layout)
        docs = find_documents(_rows(), EOS, layout, rank) if case["docs"] else None
        g.ulysses.log.reset()
        args = (q, k, v) if docs is None else (q, k, v, docs)
        out = core(*args, window=case["window"]) if case["window"] else core(*args)
        forward = _volumes(g.ulysses.log)
        out.backward(grad)
        results[_case_id(case)] = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, forward=forward,
                                       total=_volumes(g.ulysses.log), rank=rank)
    # bf16: GQA, pure Ulysses (and the hybrid at cp 4)
    for mode, u in _modes(cp):
        case = dict(mode=mode, u=u, heads=(4, 2), docs=False, layout="zigzag", kernel="cpu_flash", window=None)
        layout, g = _layout(case, cp), groups[u]
        q, k, v, grad = (layout.shard(t, g.rank, dim=2).bfloat16() for t in _inputs(case))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = _core(case, g, layout)(q, k, v)
        out.backward(grad)
        results[f"bf16-{mode}"] = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, rank=g.rank)
    # A sequence of another length than the core was set up for is refused.
    case = dict(mode="ulysses", u=cp, heads=(4, 2), docs=False, layout="zigzag", kernel="-", window=None)
    q = torch.zeros(1, 4, L // cp // 2, D_HEAD)
    try:
        _core(case, groups[cp], _layout(case, cp))(q, q[:, :2], q[:, :2])
        results["wrong_length"] = None
    except ValueError as e:
        results["wrong_length"] = str(e)
    return results


@pytest.fixture(scope="module")
def spawned():
    """cp -> every rank's results: one spawn per cp size, made when a test first asks."""
    cache: dict[int, list[dict]] = {}

    def results(cp: int) -> list[dict]:
        if cp not in cache:
            cache[cp] = run_workers(_worker, cp, cp)
        return cache[cp]

    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda c: f"cp{c}")
def ulysses_results(request, spawned):
    return request.param, spawned(request.param)


def _terms(case: dict) -> int:
    hq, hkv = case["heads"]
    return L * hq // hkv


def _grad_scale(ref: dict[str, torch.Tensor]) -> float:
    return max(float(ref[n].abs().max()) for n in ("dq", "dk", "dv"))


def _gathered(results: list[dict], key: str, name: str, layout: UlyssesLayout) -> torch.Tensor:
    parts = sorted((r[key]["rank"], r[key][name]) for r in results)
    return layout.unshard([p for _, p in parts], dim=2)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize(("cp", "case"), [(cp, c) for cp, cases in ALL_CASES.items() for c in cases],
                         ids=[f"cp{cp}-{_case_id(c)}" for cp, cases in ALL_CASES.items() for c in cases])
def test_ulysses_attention_equals_full_attention(spawned, cp, case, kernels):
    results = spawned(cp)
    want = reference(_reference, case, kernels=kernels)
    layout = _layout(case, cp)
    for name in ("out", "dq", "dk", "dv"):
        got = _gathered(results, _case_id(case), name, layout)
        assert_values_close(got, want[name], _terms(case), f"cp={cp} {_case_id(case)} {name}",
                            scale=None if name == "out" else _grad_scale(want))


@pytest.mark.multiprocess
def test_each_rank_sends_the_formula_volume(ulysses_results):
    """Exactly: the all-to-alls' elements per rank (q, k, v packed; the output; the same two backward), and the
    hybrid's ring over its R ranks with the heads a rank holds after the all-to-all."""
    cp, results = ulysses_results
    for case in ALL_CASES[cp]:
        hq, hkv = case["heads"]
        u = case["u"]
        want = ulysses_all_to_all_elements(B, L, hq, hkv, D_HEAD, cp, u)
        ring = cp // u
        for r in results:
            got = r[_case_id(case)]
            forward = {"cp_heads": want["forward_qkv"], "cp_sequence": want["forward_out"]}
            backward = {"cp_sequence_grad": want["backward_out"], "cp_heads_grad": want["backward_qkv"]}
            if ring > 1:
                p2p = ring_attention_p2p_elements(B, L, max(hkv // u, 1), D_HEAD, ring)
                forward["cp_kv"] = p2p["forward_kv"]
                backward.update(cp_kv=p2p["backward_kv"], cp_dkv=p2p["backward_dkv"])
            total = {t: forward.get(t, 0) + backward.get(t, 0) for t in {*forward, *backward}}
            assert got["forward"] == forward, _case_id(case)
            assert got["total"] == total, _case_id(case)


@pytest.mark.multiprocess
def test_ulysses_in_bf16(ulysses_results):
    """bf16 inputs: as close to fp32 attention as bf16 SDPA is — within twice its error, plus one bf16 rounding of
    the largest entry (the hybrid's ring merges bf16 block results in fp32; the all-to-alls move values exactly)."""
    cp, results = ulysses_results
    for mode, u in _modes(cp):
        case = dict(mode=mode, u=u, heads=(4, 2), docs=False, layout="zigzag", kernel="cpu_flash", window=None)
        layout = _layout(case, cp)
        want = reference(_reference, case)
        bf16 = reference(_reference, case, torch.bfloat16)
        for name in ("out", "dq", "dk", "dv"):
            got = _gathered(results, f"bf16-{mode}", name, layout)
            assert got.dtype == torch.bfloat16
            err = (got.float() - want[name]).abs().max().item()
            sdpa_err = (bf16[name].float() - want[name]).abs().max().item()
            rounding = unit_roundoff(torch.bfloat16) * want[name].abs().max().item()
            assert err <= 2 * sdpa_err + rounding, f"{mode} {name}: {err:.2e} vs SDPA bf16 {sdpa_err:.2e}"


@pytest.mark.multiprocess
def test_a_sequence_of_another_length_is_refused(ulysses_results):
    _, results = ulysses_results
    assert all("set up for sequences of 32 tokens" in r["wrong_length"] for r in results)


def test_ulysses_layout_is_the_ring_layout_cut_into_consecutive_slices():
    x = torch.arange(2 * 48).view(2, 48)
    for kind, cp, u in [("zigzag", 4, 2), ("contiguous", 4, 2), ("zigzag", 6, 3), ("zigzag", 4, 4), ("zigzag", 2, 1)]:
        layout = UlyssesLayout(kind, cp, u)
        parts = [layout.shard(x, r) for r in range(cp)]
        assert torch.equal(layout.unshard(parts), x)
        ring = layout.ring
        for j in range(ring.cp):  # what a Ulysses group gathers = its ring rank's part, in the ring's order
            group = torch.cat(parts[j * u:(j + 1) * u], dim=1)
            assert torch.equal(group, ring.shard(x, j))
    assert UlyssesLayout("zigzag", 4, 4).ring == SequenceLayout("contiguous", 1)  # pure Ulysses: in order
    with pytest.raises(ValueError, match="seq_len=8 is not divisible by 6"):
        UlyssesLayout("contiguous", 6, 3).positions(0, 8)
    with pytest.raises(ValueError, match="must divide cp=4"):
        UlyssesLayout("zigzag", 4, 3)


def test_the_head_rule_splits_repeats_or_refuses():
    assert kv_repeats(8, 4, 4) == 1 and kv_repeats(8, 2, 4) == 2 and kv_repeats(8, 1, 8) == 8
    with pytest.raises(ValueError, match="query heads: 6"):
        kv_repeats(6, 2, 4)
    with pytest.raises(ValueError, match="6 kv heads"):
        kv_repeats(12, 6, 4)


def test_ring_attention_refuses_a_window_shorter_than_the_sequence():
    """(A window as long as the sequence is the whole prefix: the hybrid runs it, tests/test_documents_layouts.py.)"""
    q = torch.zeros(1, 2, L // 2, D_HEAD)
    with pytest.raises(ValueError, match="a sliding window of 8 keys is shorter than the 32-token sequence"):
        RingAttention(None, SequenceLayout("zigzag", 2), L)(q, q, q, window=8)
