"""Documents in attention (fivefold/models/documents.py): boundaries, positions, and packed rows
equal to their documents run alone, single-process and under ring attention.

- `find_documents` on hand-made rows: boundaries after each EOS, in-document positions, a row cut
  mid-document, no EOS, EOS last; the host-side block plan (`pair_kind`) against a brute-force
  mask.
- Single process: a packed row of four documents of uneven lengths gives the logits and parameter
  gradients of its documents run alone (same per-token loss weights), with the sdpa and eager cores
  and recompute none / full / selective; without documents (cross attention) it does not.
- One spawn of 4 gloo ranks (`multiprocess`): cp 2 (two groups of 2) and cp 4, zig-zag and
  contiguous. Ring attention with documents — outputs and dQ/dK/dV — and a whole small Llama under
  `apply_context_parallel` — logits and gradients — equal the single-process masked reference, for
  rows whose boundaries fall on and off chunk edges and for a row that is one document; the blocks
  each rank computes (counted at the kernels) are exactly those a brute-force mask says have an
  allowed pair, masked exactly where it says some pairs are hidden.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_workers
from tolerance import assert_values_close

from fivefold.context_parallel import kernels
from fivefold.context_parallel.kernels import KERNELS
from fivefold.context_parallel.layout import SequenceLayout
from fivefold.models.documents import CAUSAL, FULL, MASKED, SKIP, find_documents

EOS = 1
VOCAB = 32
MODEL_CFG = dict(
    n_layers=2, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64, vocab_size=VOCAB
)


def _model(seed: int = 0):
    from fivefold.models import Llama, get_config

    return Llama(get_config("tiny", **MODEL_CFG), seed=seed)


def _document(length: int, g: torch.Generator, ends: bool = True) -> torch.Tensor:
    body = torch.randint(2, VOCAB, (length,), generator=g)
    if ends:
        body[-1] = EOS
    return body


# -- find_documents --------------------------------------------------------------------------------
def test_boundaries_follow_each_eos():
    rows = torch.tensor(
        [
            [5, 1, 2, 1, 1, 7, 8, 9],  # mid-document start, an EOS right after an EOS, no final EOS
            [3, 3, 3, 3, 3, 3, 3, 3],  # no EOS: one document
            [4, 4, 4, 1, 4, 4, 4, 1],  # EOS at the last position
        ]
    )
    d = find_documents(rows, EOS)
    assert d.doc_ids.tolist() == [
        [0, 0, 1, 1, 2, 3, 3, 3],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1],
    ]
    assert d.positions.tolist() == [
        [0, 1, 0, 1, 0, 0, 1, 2],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 0, 1, 2, 3],
    ]
    ids = d.doc_ids
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    assert torch.equal(d.mask[:, 0], (ids[:, :, None] == ids[:, None, :]) & causal)
    assert d.layout is None and d.seq_len == 8 and not d.chunk_kinds


def test_a_ranks_positions_and_plan_under_context_parallel():
    rows = torch.tensor([[5, 1, 2, 1, 1, 7, 8, 9], [3, 3, 3, 3, 3, 3, 3, 1]])
    layout = SequenceLayout("zigzag", 2)
    whole = find_documents(rows, EOS)
    d = find_documents(rows, EOS, layout, cp_rank=1)
    assert torch.equal(d.positions, layout.shard(whole.positions, 1))
    assert torch.equal(d.doc_ids, whole.doc_ids) and d.mask is None
    assert set(d.chunk_kinds) == {(q, k) for q in range(4) for k in range(q + 1)}
    assert set(d.block_masks) == {
        p for p, kind in d.chunk_kinds.items() if kind == MASKED and p[0] in (1, 2)
    }
    with pytest.raises(ValueError, match="on the CPU|not a meta tensor"):
        find_documents(rows.to("meta"), EOS)


def _brute_kind(mask: torch.Tensor, qc: int, kc: int, chunk: int) -> str:
    """The kind of block (qc, kc) read off the whole [B, L, L] mask."""
    block = mask[:, qc * chunk : (qc + 1) * chunk, kc * chunk : (kc + 1) * chunk]
    if not block.any():
        return SKIP
    allowed_shape = torch.ones(chunk, chunk, dtype=torch.bool)
    if qc == kc:
        allowed_shape = allowed_shape.tril()
        return CAUSAL if torch.equal(block, allowed_shape.expand_as(block)) else MASKED
    return FULL if block.all() else MASKED


def _rows(kind: str) -> torch.Tensor:
    """[B, 32] rows: "packed" — two rows whose boundaries fall on and off chunk edges of every
    layout used (chunks of 4, 8 and 16 tokens); "one" — a single row, one document."""
    g = torch.Generator().manual_seed(7)
    if kind == "one":
        return _document(32, g, ends=False)[None]
    row0 = torch.cat([_document(n, g) for n in (8, 3, 13, 8)])  # ends at 7, 10, 23, 31
    row1 = torch.cat([_document(n, g) for n in (5, 11, 16)])  # ends at 4, 15 (edge), 31
    return torch.stack([row0, row1])


@pytest.mark.parametrize("kind,cp", list(itertools.product(("packed", "one"), (2, 4))))
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_the_block_plan_matches_a_brute_force_mask(kind, cp, layout):
    rows = _rows(kind)
    lay = SequenceLayout(layout, cp)
    d = find_documents(rows, EOS, lay, cp_rank=0)
    mask = find_documents(rows, EOS).mask[:, 0]
    chunk = rows.shape[1] // lay.n_chunks
    for (qc, kc), got in d.chunk_kinds.items():
        assert got == _brute_kind(mask, qc, kc, chunk), (qc, kc)
    kinds = set(d.chunk_kinds.values())
    if kind == "one":
        assert kinds == {FULL, CAUSAL}
    else:  # chunks of 16 tokens (contiguous cp 2): every key chunk shares a document
        assert MASKED in kinds and (SKIP in kinds) == (lay.n_chunks >= 4)


# -- single process: packed equals alone ------------------------------------------------------------
LENGTHS = (7, 13, 3, 9)  # four documents, 32 tokens


def _packed_vs_alone(core: str, recompute: str, with_documents: bool) -> dict:
    g = torch.Generator().manual_seed(3)
    docs = [_document(n, g) for n in LENGTHS]
    row = torch.cat(docs)[None]
    weights = torch.randn(1, row.shape[1], VOCAB, generator=g)  # per-token loss weights

    packed = _model().set_attention(core).set_recompute(recompute)
    documents = find_documents(row, EOS) if with_documents else None
    logits = packed(row, documents)
    (logits * weights).sum().backward()

    alone = _model().set_attention(core).set_recompute(recompute)
    parts, start = [], 0
    for doc in docs:
        out = alone(doc[None])
        (out * weights[:, start : start + len(doc)]).sum().backward()
        parts.append(out.detach())
        start += len(doc)
    return dict(
        packed=logits.detach(),
        alone=torch.cat(parts, dim=1),
        grads_packed={n: p.grad for n, p in packed.named_parameters()},
        grads_alone={n: p.grad for n, p in alone.named_parameters()},
    )


@pytest.mark.parametrize("recompute", ["none", "full", "selective", "selective-op"])
@pytest.mark.parametrize("core", ["sdpa", "eager"])
def test_a_packed_row_equals_its_documents_alone(core, recompute):
    r = _packed_vs_alone(core, recompute, with_documents=True)
    terms = sum(LENGTHS)
    assert_values_close(r["packed"], r["alone"], terms, "logits")
    scale = max(float(g.abs().max()) for g in r["grads_alone"].values())
    for name, want in r["grads_alone"].items():
        assert_values_close(r["grads_packed"][name], want, terms, name, scale=scale)


def test_cross_attention_differs_from_documents_alone():
    r = _packed_vs_alone("sdpa", "none", with_documents=False)
    first = LENGTHS[0]  # the first document sees nothing before it either way
    assert torch.allclose(r["packed"][:, :first], r["alone"][:, :first], atol=1e-5)
    assert (r["packed"][:, first:] - r["alone"][:, first:]).abs().max() > 1e-2


# -- ring attention with documents (one spawn: cp 2 twice and cp 4 on 4 ranks) ------------------------
B_HEADS, D_HEAD = (4, 2), 8
CP_CASES = list(itertools.product((2, 4), ("zigzag", "contiguous"), ("packed", "one")))


def _case_id(case) -> str:
    return "cp{}-{}-{}".format(*case)


def _qkv(rows: torch.Tensor) -> list[torch.Tensor]:
    hq, hkv = B_HEADS
    g = torch.Generator().manual_seed(11)
    b, length = rows.shape
    return [torch.randn(b, h, length, D_HEAD, generator=g) for h in (hq, hkv, hkv, hq)]


def _attention_reference(kind: str) -> dict[str, torch.Tensor]:
    rows = _rows(kind)
    q, k, v, grad = _qkv(rows)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    group = B_HEADS[0] // B_HEADS[1]
    mask = find_documents(rows, EOS).mask
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask
    )
    out.backward(grad)
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _loss_weights(rows: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    return torch.randn(*rows.shape, VOCAB, generator=g)


def _model_reference(kind: str) -> dict:
    rows = _rows(kind)
    model = _model()
    logits = model(rows, find_documents(rows, EOS))
    (logits * _loss_weights(rows)).sum().backward()
    return dict(logits=logits.detach(), grads={n: p.grad for n, p in model.named_parameters()})


class _Counting:
    """A block kernel that counts its forward calls, then runs `inner`."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def supports(self, dtype, head_dim) -> bool:
        return True

    def forward(self, *args):
        self.calls += 1
        return self.inner.forward(*args)

    def backward(self, *args):
        return self.inner.backward(*args)


def _ring_worker() -> dict:
    import torch.distributed as dist

    from fivefold.context_parallel import apply_context_parallel
    from fivefold.context_parallel.ring_attention import ring_attention
    from fivefold.distributed.comm import Comm, CommLog
    from fivefold.models.plans import LLAMA_CP_PLAN

    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    comms = {2: Comm(pairs[rank // 2], "cp", CommLog()), 4: Comm(None, "cp", CommLog())}
    assert world == 4
    plain, masked = _Counting(KERNELS["cpu_flash"]), _Counting(kernels.MASKED)
    KERNELS["counting"], kernels.MASKED = plain, masked
    results = {}
    for case in CP_CASES:
        cp, layout_kind, rows_kind = case
        rows, comm, layout = _rows(rows_kind), comms[cp], SequenceLayout(layout_kind, cp)
        documents = find_documents(rows, EOS, layout, comm.rank)
        q, k, v, grad = (layout.shard(t, comm.rank, dim=2) for t in _qkv(rows))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        plain.calls = masked.calls = 0
        out = ring_attention(q, k, v, comm, layout, kernel="counting", documents=documents)
        calls = dict(plain=plain.calls, masked=masked.calls)
        out.backward(grad)
        res = dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad, calls=calls)
        # the whole model, its RoPE tables cut to this rank (the whole ones kept)
        model = apply_context_parallel(_model(), comm, layout, rows.shape[1], LLAMA_CP_PLAN, whole_tables=True)
        logits = model(layout.shard(rows, comm.rank), documents)
        (logits * layout.shard(_loss_weights(rows), comm.rank)).sum().backward()
        res["logits"] = logits.detach()
        res["grads"] = {n: p.grad for n, p in model.named_parameters()}
        results[_case_id(case)] = res
    return dict(cp_rank={2: comms[2].rank, 4: comms[4].rank}, results=results)


@pytest.fixture(scope="module")
def ring_results():
    return run_workers(_ring_worker, 4)


def _ranks_of(results: list, cp: int) -> list:
    """The results of ranks 0..cp-1 of the first cp group (world ranks 0..cp-1)."""
    ranked = sorted(results[:cp], key=lambda r: r["cp_rank"][cp])
    assert [r["cp_rank"][cp] for r in ranked] == list(range(cp))
    return ranked


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CP_CASES, ids=_case_id)
def test_ring_attention_with_documents_equals_the_masked_reference(ring_results, case):
    cp, layout_kind, kind = case
    layout = SequenceLayout(layout_kind, cp)
    ranks = [r["results"][_case_id(case)] for r in _ranks_of(ring_results, cp)]
    want = _attention_reference(kind)
    terms = _rows(kind).shape[1] * B_HEADS[0] // B_HEADS[1]
    scale = max(float(want[n].abs().max()) for n in ("dq", "dk", "dv"))
    for name in ("out", "dq", "dk", "dv"):
        got = layout.unshard([r[name] for r in ranks], dim=2)
        assert_values_close(
            got, want[name], terms, f"{name}", scale=None if name == "out" else scale
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CP_CASES, ids=_case_id)
def test_ring_attention_computes_only_blocks_with_an_allowed_pair(ring_results, case):
    cp, layout_kind, kind = case
    layout = SequenceLayout(layout_kind, cp)
    rows = _rows(kind)
    mask = find_documents(rows, EOS).mask[:, 0]
    chunk = rows.shape[1] // layout.n_chunks
    skipped_somewhere = 0
    for rank, r in enumerate(_ranks_of(ring_results, cp)):
        want = dict(plain=0, masked=0, skipped=0)
        for qc in layout.chunks_of(rank):
            for kc in range(qc + 1):
                brute = _brute_kind(mask, qc, kc, chunk)
                want[{SKIP: "skipped", MASKED: "masked"}.get(brute, "plain")] += 1
        assert r["results"][_case_id(case)]["calls"] == dict(
            plain=want["plain"], masked=want["masked"]
        )
        skipped_somewhere += want["skipped"]
    assert (skipped_somewhere > 0) == (kind == "packed" and layout.n_chunks >= 4)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CP_CASES, ids=_case_id)
def test_a_context_parallel_llama_with_documents_equals_one_process(ring_results, case):
    cp, layout_kind, kind = case
    layout = SequenceLayout(layout_kind, cp)
    ranks = [r["results"][_case_id(case)] for r in _ranks_of(ring_results, cp)]
    want = _model_reference(kind)
    rows = _rows(kind)
    terms = rows.numel()
    got = layout.unshard([r["logits"] for r in ranks], dim=1)
    assert_values_close(got, want["logits"], terms, "logits")
    scale = max(float(g.abs().max()) for g in want["grads"].values())
    for name, grad in want["grads"].items():
        total = sum(r["grads"][name] for r in ranks)  # each rank's tokens' share
        assert_values_close(total, grad, terms, name, scale=scale)
