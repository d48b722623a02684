"""Documents in attention: what keeping attention inside packed documents costs the single-rank
core, forward + backward, fp32, against plain causal SDPA over the whole row (cross-document).

One process, one attention call per step (q [B, H, L, hd], k and v [B, H_kv, L, hd], GQA), for each
sequence length a row of ``documents`` documents of uneven lengths. Contestants:

- ``causal``: SDPA ``is_causal`` over the whole row — no document masking (the baseline);
- ``sdpa-mask``: SDPA with the documents' dense boolean mask [B, 1, L, L];
- ``eager-mask``: the masked softmax written out (fivefold's eager core), up to ``eager_max_len``;
- ``per-doc``: causal SDPA on each document's slice over the host-side spans (fivefold's sdpa core
  with documents);
- ``flex``: torch.compile'd ``flex_attention`` with a ``create_block_mask`` block mask — timed when
  torch can run its backward on this device (torch 2.13 has no CPU backward: reported, not timed).

Steps alternate between contestants (blocks of ``steps`` each, ``repeats`` rounds); the table
gives the median step time and its ratio to ``causal``. The mask (and block mask) is built once,
outside the timed step, as `find_documents` builds it once per micro-batch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import markdown_table
from fivefold.models.documents import find_documents
from fivefold.models.llama import causal_attention, eager_attention

__all__ = ["DocumentsSpec", "bench_documents", "format_documents_table"]

EOS = 1


@dataclass(frozen=True)
class DocumentsSpec:
    seq_lens: tuple[int, ...] = (2048, 8192)
    batch: int = 1
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    documents: int = 6  # per row, uneven lengths
    eager_max_len: int = 2048  # eager's L×L probabilities: 2 GiB per head group at 8k
    steps: int = 2
    warmup: int = 1
    repeats: int = 2
    threads: int = 2
    seed: int = 0


def _row(seq: int, n_docs: int, g: torch.Generator) -> torch.Tensor:
    """[1, seq] tokens: n_docs documents of uneven lengths, each ending with EOS."""
    cuts = torch.randperm(seq - 1, generator=g)[: n_docs - 1].add(1).sort().values.tolist()
    tokens = torch.randint(2, 256, (1, seq), generator=g)
    for end in [*cuts, seq]:
        tokens[0, end - 1] = EOS
    return tokens


def _flex(tokens: torch.Tensor) -> Callable[..., torch.Tensor] | str:
    """A compiled flex attention call with the row's block mask, or why there is none."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        return f"no flex_attention ({e})"
    doc = find_documents(tokens, EOS).doc_ids

    def same_document(b, h, q, k):
        return (q >= k) & (doc[b, q] == doc[b, k])

    b, seq = tokens.shape
    block_mask = create_block_mask(same_document, b, None, seq, seq, device="cpu")
    compiled = torch.compile(flex_attention)

    def call(q, k, v):
        return compiled(q, k, v, block_mask=block_mask, enable_gqa=True)

    probe = torch.zeros(b, 2, 128, 16, requires_grad=True)
    try:  # the backward is what training needs: refuse early where torch has none
        from torch.nn.attention.flex_attention import _validate_device

        _validate_device(probe, probe, probe)
    except ImportError:
        pass
    except NotImplementedError as e:
        return f"not timed: {str(e).split('.')[0]}"
    return call


def _contestants(spec: DocumentsSpec, tokens: torch.Tensor) -> dict[str, Any]:
    documents = find_documents(tokens, EOS)
    mask = documents.mask

    def sdpa_mask(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    out: dict[str, Any] = {
        "causal": causal_attention,
        "sdpa-mask": sdpa_mask,
        "eager-mask": (lambda q, k, v: eager_attention(q, k, v, documents))
        if tokens.shape[1] <= spec.eager_max_len
        else f"not timed: L > eager_max_len={spec.eager_max_len}",
        "per-doc": lambda q, k, v: causal_attention(q, k, v, documents),
        "flex": _flex(tokens),
    }
    return out


def _step(core: Callable, q, k, v, grad) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    core(q, k, v).backward(grad)
    return time.perf_counter() - t0


def bench_documents(spec: DocumentsSpec = DocumentsSpec()) -> dict:
    torch.set_num_threads(spec.threads)
    g = torch.Generator().manual_seed(spec.seed)
    results: dict[str, Any] = {"kind": "documents", "spec": asdict(spec), "lengths": {}}
    for seq in spec.seq_lens:
        tokens = _row(seq, spec.documents, g)
        q = torch.randn(spec.batch, spec.heads, seq, spec.head_dim, generator=g)
        k, v = (
            torch.randn(spec.batch, spec.kv_heads, seq, spec.head_dim, generator=g) for _ in "kv"
        )
        grad = torch.randn_like(q)
        tokens = tokens.expand(spec.batch, seq).contiguous()
        cores = _contestants(spec, tokens)
        timed = {n: c for n, c in cores.items() if callable(c)}
        # every masked contestant's output equals the mask reference (a wrong one is not timed)
        want = cores["sdpa-mask"](q, k, v)
        errors = {
            n: float((c(q, k, v) - want).abs().max()) for n, c in timed.items() if n != "causal"
        }
        for core in timed.values():
            for _ in range(spec.warmup):
                _step(core, q, k, v, grad)
        times: dict[str, list[float]] = {n: [] for n in timed}
        for rnd in range(spec.repeats):
            order = list(timed) if rnd % 2 == 0 else list(reversed(timed))
            for name in order:
                times[name] += [_step(timed[name], q, k, v, grad) for _ in range(spec.steps)]
        base = statistics.median(times["causal"])
        results["lengths"][seq] = {
            "doc_lengths": torch.tensor(
                [0, *(tokens[0] == EOS).nonzero().flatten().add(1).tolist()]
            )
            .diff()
            .tolist(),
            "cores": {
                n: (
                    dict(
                        median_s=statistics.median(times[n]),
                        ratio=statistics.median(times[n]) / base,
                        max_abs_err=errors.get(n, 0.0),
                    )
                    if n in times
                    else dict(note=cores[n])
                )
                for n in cores
            },
        }
    return results


def format_documents_table(results: dict) -> str:
    spec = results["spec"]
    rows = [("L", "core", "median fwd+bwd ms", "vs causal", "max |err| vs sdpa-mask")]
    for seq, r in results["lengths"].items():
        for name, c in r["cores"].items():
            if "note" in c:
                rows.append((str(seq), name, c["note"], "", ""))
            else:
                rows.append(
                    (
                        str(seq),
                        name,
                        f"{c['median_s'] * 1e3:.0f}",
                        f"{c['ratio']:.2f}",
                        f"{c['max_abs_err']:.1e}",
                    )
                )
    out = markdown_table(rows)
    lengths = "; ".join(f"L={s}: {r['doc_lengths']}" for s, r in results["lengths"].items())
    out += [
        "",
        f"fp32, B={spec['batch']}, H={spec['heads']}, H_kv={spec['kv_heads']}, hd={spec['head_dim']}, "
        f"{spec['threads']} threads, one attention call forward + backward; document lengths {lengths}; "
        f"{spec['steps']} steps × {spec['repeats']} alternating rounds per contestant after {spec['warmup']} "
        "warmup. causal: no document masking (the baseline); per-doc: fivefold's sdpa core with documents.",
    ]
    return "\n".join(out)
