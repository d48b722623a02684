"""Splitting a Llama into pipeline stages; each rank materialises only its own layers.

Seed 003 §9: stage i holds a contiguous range of transformer blocks; the first stage also holds
the token embedding, the last the final norm and the head (the loss is computed there). With
V virtual stages per rank (interleaved 1F1B) there are P·V stages and rank r holds stages
r, r + P, r + 2P, ... (the placement of `schedules.interleaved_1f1b`).

Every parameter keeps its single-process name (``layers.5.attention.wq.weight``), and its value:
the model is created on the meta device, only this rank's modules are given storage, and the
seeded initialisation replays the whole random stream (drawing, and discarding, the values of
layers held elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.models.llama import Llama, LlamaConfig


def split_layers(n_layers: int, n_stages: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Contiguous block ranges per stage: an explicit list, or as even as possible (earlier stages
    get the extra blocks — the last stage already carries the head and the loss)."""
    if layers_per_stage is not None:
        if len(layers_per_stage) != n_stages or sum(layers_per_stage) != n_layers or min(layers_per_stage) < 0:
            raise ValueError(f"layers_per_stage={layers_per_stage} must have {n_stages} non-negative entries "
                             f"summing to n_layers={n_layers}")
        counts = layers_per_stage
    else:
        if n_layers < n_stages:
            raise ValueError(f"n_layers={n_layers} is fewer than the {n_stages} pipeline stages (pp × virtual "
                             f"stages); use fewer stages or a deeper model")
        base, extra = divmod(n_layers, n_stages)
        counts = [base + (1 if s < extra else 0) for s in range(n_stages)]
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


class PipelineStage(nn.Module):
    """One (virtual) stage: blocks ``layer_range`` (+ embedding if first, + norm and head if last)."""

    def __init__(self, model: Llama, stage: int, n_stages: int, layer_range: range) -> None:
        super().__init__()
        self.config: LlamaConfig = model.config
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.tok_embeddings = model.tok_embeddings if self.is_first else None
        # ModuleDict keyed by the global block index keeps the single-process parameter names.
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_range})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def fsdp_units(self) -> list[str]:
        """As `Llama.fsdp_units`, for the parts this stage holds (pipelines refuse tied embeddings)."""
        return [name for name in ("tok_embeddings", "output") if getattr(self, name) is not None]

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """x: tokens [B, L] on the first stage, hidden states [B, L(/T), D] elsewhere."""
        seq = x.shape[1] if self.is_first else (seq_len or x.shape[1])
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(x) if self.is_first else x
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h)) if self.is_last else h


def build_stages(config: LlamaConfig, stage_ids: list[int], n_stages: int, *, seed: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 layers_per_stage: list[int] | None = None) -> dict[int, PipelineStage]:
    """The stages `stage_ids` of a model split into `n_stages`, with single-process weights."""
    if config.tie_embeddings and n_stages > 1:
        raise ValueError("tie_embeddings=True with pipeline parallelism: the embedding (first stage) and the head "
                         "(last stage) live on different ranks; set model.tie_embeddings=false or pp=1")
    ranges = split_layers(config.n_layers, n_stages, layers_per_stage)
    model = Llama(config, device="meta", dtype=dtype)
    stages = {s: PipelineStage(model, s, n_stages, ranges[s]) for s in stage_ids}
    for stage in stages.values():
        for child in stage.children():
            child.to_empty(device=device)
    model.rope_cos = torch.empty(model.rope_cos.shape, device=device)
    model.rope_sin = torch.empty(model.rope_sin.shape, device=device)
    model.init_weights(seed)
    for stage in stages.values():
        stage.rope_cos, stage.rope_sin = model.rope_cos, model.rope_sin
    return stages
