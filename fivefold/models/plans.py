"""Where each part of fivefold's Llama goes under each dimension: plans as data, typed.

- `LLAMA_TP_PLAN` (seed 003 §7-8): attention split by heads (q by query heads, k/v by kv heads),
  output projection row-parallel; SwiGLU gate/up column-parallel, down row-parallel; one entry
  operator per attention / MLP region; embedding vocab-parallel; the head column-parallel over
  the vocabulary, its logits consumed by the vocab-parallel cross-entropy without being gathered;
  norms replicated (under SP their weight gradients are all-reduced).
- `llama_stage_modules` (seed 003 §9): the module names of each pipeline stage — contiguous
  blocks, the embedding on the first stage, the final norm and the head on the last.
- ZeRO-3 units: the blocks, plus ``Llama.fsdp_units`` (embedding, head).

The model file itself knows nothing of this; `models.parallelize` applies the plans.
"""

from __future__ import annotations

from fivefold.models.llama import LlamaConfig
from fivefold.pipeline.split import split_layers
from fivefold.tensor_parallel.plan import Colwise, Norm, RegionEntry, Rowwise, TPPlan, VocabEmbedding, VocabHead

__all__ = ["LLAMA_TP_PLAN", "llama_stage_modules"]

LLAMA_TP_PLAN: TPPlan = {
    "tok_embeddings": VocabEmbedding(),
    "layers.*.attention_norm": Norm(),
    "layers.*.attention": RegionEntry(),
    "layers.*.attention.wq": Colwise("n_heads"),
    "layers.*.attention.wk": Colwise("n_kv_heads"),
    "layers.*.attention.wv": Colwise("n_kv_heads"),
    "layers.*.attention.wo": Rowwise(),
    "layers.*.ffn_norm": Norm(),
    "layers.*.feed_forward": RegionEntry(),
    "layers.*.feed_forward.w1": Colwise("ffn_hidden"),
    "layers.*.feed_forward.w3": Colwise("ffn_hidden"),
    "layers.*.feed_forward.w2": Rowwise(),
    "norm": Norm(),
    "output": VocabHead(),
}


def llama_stage_modules(config: LlamaConfig, n_stages: int, layers_per_stage: list[int] | None = None,
                        ) -> list[list[str]]:
    """For each of `n_stages` stages, the names of the modules it holds (`pipeline.split.keep_only`)."""
    if config.tie_embeddings and n_stages > 1:
        raise ValueError("tie_embeddings=True with pipeline parallelism: the embedding (first stage) and the head "
                         "(last stage) live on different ranks; set model.tie_embeddings=false or pp=1")
    stages = []
    for s, blocks in enumerate(split_layers(config.n_layers, n_stages, layers_per_stage)):
        names = ["tok_embeddings"] if s == 0 else []
        names += [f"layers.{i}" for i in blocks]
        if s == n_stages - 1:
            names += ["norm", "output"]
        stages.append(names)
    return stages
