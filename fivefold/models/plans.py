"""Where each part of fivefold's Llama goes under each dimension, as data applied by
`models.parallelize`: `LLAMA_TP_PLAN` (heads split, wo and w2 row-parallel, embedding and head
vocab-parallel, norms replicated, per-head q/k norms' gradients summed over tp), `LLAMA_CP_PLAN`
(ring attention in every block, RoPE tables by position) and `llama_stage_modules` (contiguous
blocks, the embedding first, the norm and head last) —
docs/design.md#tensor-and-sequence-parallelism, #context-parallelism and #pipeline-schedules."""

from __future__ import annotations

import fnmatch

import torch

from fivefold.context_parallel.plan import CPPlan
from fivefold.models.llama import LlamaConfig
from fivefold.pipeline.split import split_layers
from fivefold.tensor_parallel.plan import (
    Colwise,
    HeadNorm,
    Norm,
    RegionEntry,
    Rowwise,
    TPPlan,
    VocabEmbedding,
    VocabHead,
)

__all__ = [
    "LLAMA_CP_PLAN",
    "LLAMA_FLOAT8",
    "LLAMA_MATRICES",
    "LLAMA_TP_PLAN",
    "is_block_matrix",
    "is_float8_linear",
    "is_float8_weight",
    "llama_stage_modules",
]

LLAMA_CP_PLAN = CPPlan(attention="layers.*.attention", position_tables=("rope_cos", "rope_sin"))

LLAMA_TP_PLAN: TPPlan = {
    "tok_embeddings": VocabEmbedding(),
    "layers.*.attention_norm": Norm(),
    "layers.*.attention": RegionEntry(),
    "layers.*.attention.wq": Colwise("n_heads"),
    "layers.*.attention.wk": Colwise("n_kv_heads"),
    "layers.*.attention.wv": Colwise("n_kv_heads"),
    "layers.*.attention.wo": Rowwise(),
    "layers.*.attention.q_norm": HeadNorm(),
    "layers.*.attention.k_norm": HeadNorm(),
    "layers.*.ffn_norm": Norm(),
    "layers.*.feed_forward": RegionEntry(),
    "layers.*.feed_forward.w1": Colwise("ffn_hidden"),
    "layers.*.feed_forward.w3": Colwise("ffn_hidden"),
    "layers.*.feed_forward.w2": Rowwise(),
    "norm": Norm(),
    "output": VocabHead(),
}


# The transformer blocks' matrices: Muon steps their weights (`optim.name = "muon"`,
# docs/design.md#muon-under-zero) — attention, dense and shared feed-forward, each MoE expert's
# feed-forward. Not the embedding, the head, norms, biases, nor the MoE router and shared gate
# (scores over the experts and a 1 × D gate: AdamW, as Moonlight leaves them).
LLAMA_MATRICES: tuple[str, ...] = (
    "layers.*.attention.w?.weight",
    "layers.*.feed_forward.w?.weight",
    "layers.*.feed_forward.shared.w?.weight",
    "layers.*.feed_forward.experts.*.w?.weight",
)


# The linears that compute in FP8 (`precision.fp8`, docs/design.md#fp8-training): the blocks'
# attention and dense / shared feed-forward projections. Not the embedding, the head, the MoE
# router and gate, nor the routed experts (their grouped GEMMs stay in the compute dtype).
LLAMA_FLOAT8: tuple[str, ...] = (
    "layers.*.attention.w?",
    "layers.*.feed_forward.w?",
    "layers.*.feed_forward.shared.w?",
)


def is_float8_linear(name: str) -> bool:
    """Whether module `name` (its single-process name) is one of `LLAMA_FLOAT8`."""
    return any(fnmatch.fnmatchcase(name, p) for p in LLAMA_FLOAT8)


def is_float8_weight(name: str) -> bool:
    """Whether parameter `name` is the weight of one of `LLAMA_FLOAT8` (ZeRO-3 gathers it in FP8
    under ``zero.fp8_gather``)."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and is_float8_linear(module)


def is_block_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether parameter `name` (its single-process name) is one of `LLAMA_MATRICES`."""
    return param.ndim == 2 and any(fnmatch.fnmatchcase(name, p) for p in LLAMA_MATRICES)


def llama_stage_modules(
    config: LlamaConfig,
    n_stages: int,
    layers_per_stage: list[int] | None = None,
) -> list[list[str]]:
    """For each stage, the names of the modules it holds (for `pipeline.split.keep_only`)."""
    if config.tie_embeddings and n_stages > 1:
        raise ValueError(
            "tie_embeddings=True with pipeline parallelism: the embedding (first stage) and the "
            "head (last stage) live on different ranks; set model.tie_embeddings=false or pp=1"
        )
    stages = []
    for s, blocks in enumerate(split_layers(config.n_layers, n_stages, layers_per_stage)):
        names = ["tok_embeddings"] if s == 0 else []
        names += [f"layers.{i}" for i in blocks]
        if s == n_stages - 1:
            names += ["norm", "output"]
        stages.append(names)
    return stages
