"""Shared helpers for multi-process tests: a toy model with awkward parameters, batches, launching.

`run_workers` spawns gloo workers through `launch_local`, so every test that calls it is marked
`multiprocess`; `reference_training` and `trainer_reference` build the single-process training those
tests compare with. No tests here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.distributed.launch import launch_local


def run_workers(fn, world_size: int, *args):
    """Spawn `world_size` gloo ranks (one thread each, free port) running fn(*args); return results."""
    return launch_local(fn, world_size, *args, threads=1, timeout_s=240.0)


class _AllOf:
    """One work standing for a batch: complete when every op in it is (what NCCL's coalesced batch returns)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        self.works = []  # waiting again returns at once, as on NCCL (a gloo p2p work may be waited only once)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


@contextlib.contextmanager
def coalescing_p2p() -> Iterator[list[int]]:
    """In a worker: `batch_isend_irecv` returns ONE work per batch, as torch does for NCCL (gloo returns one per op).
    Yields a list that receives the size of every batch issued."""
    original, sizes = dist.batch_isend_irecv, []

    def coalesced(ops):
        sizes.append(len(ops))
        works = original(ops)
        return [_AllOf(works)] if works else works

    dist.batch_isend_irecv = coalesced
    try:
        yield sizes
    finally:
        dist.batch_isend_irecv = original


class ToyNet(nn.Module):
    """Odd sizes on purpose (so flat buffers need padding), a tied embedding/head pair,
    a frozen layer, and optionally a parameter that never receives a gradient."""

    def __init__(self, vocab: int = 13, dim: int = 6, hidden: int = 10, tie: bool = True,
                 frozen: bool = True, unused: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.frozen = nn.Linear(dim, dim) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.emb.weight
        self.unused = nn.Linear(3, 3) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.fc2(torch.tanh(self.fc1(h)))
        if self.frozen is not None:
            h = self.frozen(h)
        return self.head(h)


def build_toy(seed: int = 0, **kw) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet(**kw)


def toy_batch(step: int, batch: int = 12, seq: int = 5, vocab: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    return x, y


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def initial_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's state as the workers draw it, for a reference to start from: torch's CPU random kernels draw other
    values on another kernel path (tests/tolerance.py's OTHER), so a reference there must not draw its own."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_training(steps: int, opt_kind: str, grad_accum: int = 1, init: dict[str, torch.Tensor] | None = None,
                       **model_kw) -> list[dict[str, torch.Tensor]]:
    """Single-process training on the full global batch from `init` (else the model's own draw); parameters after
    every step. A training reference for `tolerance.reference(reference_training, ..., terms=n)`."""
    model = build_toy(**model_kw)
    if init is not None:
        model.load_state_dict(init)
    opt = make_optimizer(opt_kind, [p for p in model.parameters() if p.requires_grad])
    history = []
    for step in range(steps):
        x, y = toy_batch(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(grad_accum), y.chunk(grad_accum)):
            (lm_loss(model(xs), ys) / grad_accum).backward()
        opt.step()
        history.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return history


def trainer_reference(model_cfg, batch, steps: int, micro: int, dp: int, lr: float, eps: float) -> dict:
    """Single-process training of a fivefold model as the trainer configures it (AdamW with its decay groups,
    clipping 1.0) on `batch(step)`, global micro-batch i = every dp rank's i-th (as an MoE's balancing sees it):
    the losses and the final parameters. For `tolerance.reference` (batch: a module-level function)."""
    from fivefold.config import Config
    from fivefold.models.llama import Llama
    from fivefold.models.parallelize import set_aux_grad_scale

    t = Config().train
    net = Llama(model_cfg, seed=t.seed)
    decay = [p for n, p in net.named_parameters() if p.ndim >= 2 and n != "tok_embeddings.weight"]
    no_decay = [p for p in net.parameters() if all(p is not d for d in decay)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(t.beta1, t.beta2), eps=eps)
    set_aux_grad_scale([net], 1.0 / micro)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        total = 0.0
        for i in range(micro):
            xi = torch.cat([xr.chunk(micro)[i] for xr in x.chunk(dp)])
            yi = torch.cat([yr.chunk(micro)[i] for yr in y.chunk(dp)])
            loss = F.cross_entropy(net(xi).flatten(0, 1), yi.flatten()) / micro
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return dict(losses=losses, final={n: p.detach().clone() for n, p in net.named_parameters()})
