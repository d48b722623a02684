"""Where each Llama module goes under tensor (+ sequence) parallelism: the plan is data.

`LLAMA_TP_PLAN` maps module-name patterns to a placement style; `apply_tensor_parallel` walks the
model once and swaps modules for their parallel versions (seed 003 §7-8):

- attention: q by heads, k/v by kv heads (column), output projection row-parallel;
- MLP: gate/up column-parallel, down row-parallel;
- one entry operator per attention / MLP (f, or the SP all-gather) shared by its column layers,
  so a block costs exactly 2 entries + 2 exits;
- token embedding vocab-parallel; the head column-parallel over the vocabulary, its logits
  consumed by the vocab-parallel cross-entropy (`TPLoss`) without ever being gathered;
- norms: replicated; under SP they run on this rank's sequence chunk and their weight
  gradients (partial sums over the chunks) are all-reduced over the TP group.
The model file itself knows nothing of this.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.comm import Comm
from fivefold.models.llama import Llama
from fivefold.tensor_parallel.comm_ops import all_reduce_grad_hook, copy_to_tp, gather_from_sp
from fivefold.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from fivefold.tensor_parallel.loss import vocab_parallel_cross_entropy

LLAMA_TP_PLAN: dict[str, str] = {
    "tok_embeddings": "vocab_embedding",
    "layers.*.attention_norm": "norm",
    "layers.*.attention": "region_entry",
    "layers.*.attention.wq": "colwise:n_heads",
    "layers.*.attention.wk": "colwise:n_kv_heads",
    "layers.*.attention.wv": "colwise:n_kv_heads",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "norm",
    "layers.*.feed_forward": "region_entry",
    "layers.*.feed_forward.w1": "colwise:ffn_hidden",
    "layers.*.feed_forward.w3": "colwise:ffn_hidden",
    "layers.*.feed_forward.w2": "rowwise",
    "norm": "norm",
    "output": "colwise_vocab",
}


def check_tp_divisibility(model: nn.Module, tp: int) -> None:
    c = model.config
    for what, value in (("n_heads", c.n_heads), ("n_kv_heads", c.n_kv_heads), ("ffn_hidden", c.ffn_hidden),
                        ("vocab_size", c.vocab_size)):
        if value % tp:
            raise ValueError(f"tensor parallel: {what}={value} is not divisible by tp={tp}; choose tp dividing "
                             f"n_heads ({c.n_heads}), n_kv_heads ({c.n_kv_heads}), ffn_hidden ({c.ffn_hidden}) "
                             f"and vocab_size ({c.vocab_size})")


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


def _style_for(name: str, plan: dict[str, str]) -> str | None:
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def apply_tensor_parallel(model: nn.Module, comm: Comm, sequence_parallel: bool = False,
                          plan: dict[str, str] | None = None) -> Llama:
    """Shard `model` (a `Llama`, or a pipeline stage of one) in place over the TP group of `comm`
    following `plan` (default LLAMA_TP_PLAN)."""
    plan = LLAMA_TP_PLAN if plan is None else plan
    check_tp_divisibility(model, comm.size)
    # A pipeline stage holds only some of these modules (the embedding first, the head last).
    emb, head = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = emb is not None and head is not None and head.weight is emb.weight
    entry_mode = "gather" if sequence_parallel else "copy"
    for name, module in list(model.named_modules()):
        style = _style_for(name, plan)
        if style is None:
            continue
        if style == "vocab_embedding":
            _set_module(model, name, VocabParallelEmbedding.from_embedding(module, comm, sequence_parallel))
        elif style.startswith("colwise:"):
            _set_module(model, name, ColumnParallelLinear.from_linear(module, comm, "none", style.split(":")[1]))
        elif style == "colwise_vocab":
            _set_module(model, name, ColumnParallelLinear.from_linear(module, comm, entry_mode, "vocab_size"))
        elif style == "rowwise":
            _set_module(model, name, RowParallelLinear.from_linear(module, comm, sequence_parallel))
        elif style == "region_entry":
            module.register_forward_pre_hook(_region_entry(comm, entry_mode))
        elif style == "norm":
            if sequence_parallel:
                module.weight.register_hook(all_reduce_grad_hook(comm, "sp_norm_grad"))
        else:
            raise ValueError(f"unknown tensor-parallel style '{style}' for module '{name}'")
    if tied:
        model.output.weight = model.tok_embeddings.weight
    model.tp_comm = comm
    model.sequence_parallel = sequence_parallel
    return model


def _region_entry(comm: Comm, mode: str):
    def hook(module: nn.Module, args: tuple) -> tuple:
        x = copy_to_tp(args[0], comm) if mode == "copy" else gather_from_sp(args[0], comm)
        return (x, *args[1:])
    return hook


def is_tp_sharded(name: str, param: nn.Parameter, model: nn.Module) -> bool:
    """True if this parameter holds a 1/T slice (False: replicated across the TP group)."""
    owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return isinstance(owner, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding) and not (
        isinstance(owner, RowParallelLinear) and name.endswith("bias"))


@dataclass
class TPLoss:
    """Mean next-token cross-entropy on vocabulary-parallel logits [B, L, V/T]."""

    comm: Comm
    vocab_start: int

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, self.vocab_start, self.comm)


def tp_loss(model: nn.Module) -> TPLoss:
    """The loss for a TP-sharded model (or last pipeline stage): its head holds vocabulary rows
    [rank·V/T, (rank+1)·V/T)."""
    comm = model.tp_comm
    return TPLoss(comm, comm.rank * (model.config.vocab_size // comm.size))
