"""`fivefold generate`: a prompt's continuation by a whole model (`use.model.load_model`), decoded
token by token with the KV cache (`models.kv_cache`: the prompt is one forward, each new token
another of one position): greedy at temperature 0, else sampled from the softmax at that
temperature cut to its top-p nucleus, by a `torch.Generator` seeded by ``seed`` (the same seed, the
same tokens on the same kind of device). It stops after ``max_new`` tokens, at an end-of-sequence
id, or when the model's context is full.

An MoE model decodes dropless (``moe.capacity_factor`` off), as the Hugging Face families do: a
capacity counted over the tokens of one forward would drop differently token by token than over
the whole sequence."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fivefold.models.kv_cache import KVCache
from fivefold.models.llama import Llama
from fivefold.models.moe import MoEFeedForward
from fivefold.use.model import UsedModel

__all__ = ["Generation", "Sampling", "dropless", "generate", "generate_ids"]


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy (the largest logit); above 0 a draw
    from softmax(logits / temperature) restricted to the smallest set of tokens whose probability
    reaches ``top_p`` (nucleus sampling; 1: every token), from a generator seeded by ``seed``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def check(self) -> Sampling:
        """ValueError (one line) for a temperature below 0 or a top-p outside (0, 1]."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"--temperature {self.temperature:g}: give 0 (greedy) or a positive temperature"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p {self.top_p:g}: give a probability in (0, 1] (1: all)")
        return self


@contextmanager
def dropless(model: Llama) -> Iterator[Llama]:
    """Every MoE layer without its capacity (each token to all of its top-k experts) inside the
    block; each layer's own setting is back afterwards, also on an error (a later `evaluate` of the
    same model counts the loss as trained)."""
    saved = [
        (m, m.config)
        for m in model.modules()
        if isinstance(m, MoEFeedForward) and m.config.capacity_factor is not None
    ]
    try:
        for m, config in saved:
            m.config = dataclasses.replace(config, capacity_factor=None)
        yield model
    finally:
        for m, config in saved:
            m.config = config


def _next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> torch.Tensor:
    """logits [V] (fp32) -> the chosen id, a 1-element tensor on their device."""
    if sampling.temperature == 0:
        return logits.argmax().reshape(1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # the mass of the likelier tokens
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)  # the first stays
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)


@torch.no_grad()
def generate_ids(
    model: Llama,
    prompt: Sequence[int],
    max_new: int,
    sampling: Sampling = Sampling(),
    eos_ids: Sequence[int] = (),
    vocab: int | None = None,
) -> list[int]:
    """``prompt`` followed by up to ``max_new`` tokens (an end-of-sequence id among ``eos_ids``
    ends it, itself included), never past the model's ``max_seq_len``. ``vocab``: ids at or above
    it are never chosen (a padded vocabulary's rows no tokenizer id uses)."""
    sampling.check()
    cfg = model.config
    if not prompt:
        raise ValueError("the prompt is empty: give some text to continue")
    if len(prompt) > cfg.max_seq_len:
        raise ValueError(
            f"the prompt is {len(prompt)} tokens, longer than the model's context of "
            f"{cfg.max_seq_len} (max_seq_len): shorten it"
        )
    max_new = max(0, min(max_new, cfg.max_seq_len - len(prompt)))
    device = model.rope_cos.device
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    cache = KVCache(len(prompt) + max_new)
    x = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    out, stops = list(prompt), set(eos_ids)
    for _ in range(max_new):
        logits = model(x, cache=cache)[0, -1].float()
        if vocab is not None and vocab < logits.shape[0]:
            logits[vocab:] = float("-inf")
        token = _next_token(logits, sampling, generator)
        out.append(int(token))  # (the host reads each token: the stop rule needs it)
        if out[-1] in stops:
            break
        x = token.view(1, 1)
    return out


@dataclass(frozen=True)
class Generation:
    text: str  # the prompt and its continuation, decoded
    ids: list[int]  # the prompt's ids and the new ones
    prompt_tokens: int
    stopped: str  # "eos" | "max_new" | "context" (the model's max_seq_len reached)

    @property
    def new_tokens(self) -> int:
        return len(self.ids) - self.prompt_tokens


def generate(
    used: UsedModel,
    prompt: str,
    max_new: int,
    sampling: Sampling = Sampling(),
    add_bos: bool = False,
) -> Generation:
    """``prompt`` encoded by the model's tokenizer as training encodes text (no special tokens;
    ``add_bos``: the tokenizer's beginning-of-document id first), continued (`generate_ids`), and
    decoded: an end-of-sequence token that stopped it is left out of the text."""
    sampling.check()
    if max_new < 0:
        raise ValueError(f"--max-new {max_new}: give a number of tokens (0 or more)")
    if not prompt:
        raise ValueError("the prompt is empty: give some text to continue")
    tok = used.tokenizer
    ids = [int(i) for i in tok.encode(prompt)]
    if add_bos:
        if used.tokenizer_record.bos_id is None:
            raise ValueError(f"--bos: the tokenizer {used.tokenizer_record.describe()} has none")
        ids.insert(0, used.tokenizer_record.bos_id)
    if not ids:
        raise ValueError("the prompt is empty once tokenized: give some text to continue")
    # the tokenizer's ids (a padded vocabulary's extra rows name no token it can decode)
    vocab = min(used.model.config.vocab_size, used.tokenizer.vocab_size)
    with dropless(used.model) as model:
        out = generate_ids(model, ids, max_new, sampling, used.eos_ids, vocab)
    new = len(out) - len(ids)
    if new and out[-1] in used.eos_ids:
        stopped, shown = "eos", out[:-1]
    elif new < max_new:
        stopped, shown = "context", out
    else:
        stopped, shown = "max_new", out
    if add_bos:
        shown = shown[1:]
    return Generation(tok.decode(shown), out, len(ids), stopped)
