"""`fivefold eval`: a whole model's loss (mean next-token cross-entropy) and perplexity on held-out
tokens, computed as the trainer computes its validation loss, so the two are one number on the
same data: the data resolved and opened by the trainer's own functions (`data_source.resolve_data`
with the run's recorded data and train settings, `data_source.open_dataset`: a prepared
directory's split, text tokenized with the run's tokenizer + an end-of-document id per document,
its last ``data.val_fraction`` the validation split), cut by `TokenDataset.val_batches` into the
same ``seq_len`` windows (evenly spaced starts), each batch's loss `models.loss.lm_cross_entropy`,
the mean over the batches in fp64 times `val_loss_weight` (targets after an end-of-document token
dropped with ``data.loss_across_documents`` false), documents masked in attention with
``data.documents`` mask. The trainer splits the batches over its dp ranks and averages the ranks'
means: the same mean (each rank takes as many), summed in another order."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from fivefold.config import Config
from fivefold.models.loss import lm_cross_entropy
from fivefold.train.data import TokenDataset
from fivefold.train.data_source import is_prepared, open_dataset, resolve_data
from fivefold.use.model import UsedModel

__all__ = ["EvalReport", "default_batches", "evaluate", "run_config"]

Split = Literal["train", "val"]


@dataclass(frozen=True)
class EvalReport:
    loss: float  # mean cross-entropy, nats per target
    perplexity: float  # exp(loss)
    batches: int
    micro_batch: int  # sequences per batch
    seq_len: int
    split: str
    data: str
    source: str  # the checkpoint or directory evaluated

    @property
    def tokens(self) -> int:
        return self.batches * self.micro_batch * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "tokens": self.tokens}


def run_config(used: UsedModel) -> Config:
    """The settings the trainer evaluated with: a run's recorded ``[data]`` and ``[train]`` (its
    checkpoint's config), defaults for a Hugging Face directory (its tokenizer and vocabulary)."""
    cfg = Config()
    if used.meta is None:
        cfg.model.init_from = used.source
        return cfg
    recorded = used.meta.get("config") or {}
    for section in ("data", "train"):
        target = getattr(cfg, section)
        for key, value in (recorded.get(section) or {}).items():
            if hasattr(target, key):
                setattr(target, key, value)
    return cfg


def default_batches(used: UsedModel, cfg: Config) -> int:
    """The trainer's number of validation batches: ``train.eval_batches`` rounded down to a multiple
    of the run's dp (at least dp)."""
    dp = int(((used.meta or {}).get("layout") or {}).get("dp", 1))
    return max(dp, cfg.train.eval_batches - cfg.train.eval_batches % dp)


@torch.no_grad()
def evaluate(
    used: UsedModel,
    data: str,
    split: Split = "val",
    batches: int | None = None,
    seq_len: int | None = None,
    micro_batch: int | None = None,
) -> EvalReport:
    """The loss of ``used``'s model on ``data`` (a `fivefold prepare` directory, a text file or
    folder, a nanoGPT .bin), on its ``split``, in ``batches`` batches of ``micro_batch`` windows of
    ``seq_len`` tokens (each default: what the run's trainer used). Bad input is one ValueError."""
    if split not in ("train", "val"):
        raise ValueError(f"--split {split}: give train or val")
    if not Path(data).exists():
        raise ValueError(f"--data {data} does not exist")
    cfg = run_config(used)
    cfg.data.path = str(data)
    # text is tokenized with the model's tokenizer (checked already); a prepared directory's index
    # names its own, which resolve_data holds to the checkpoint's
    cfg.data.tokenizer = "" if is_prepared(data) else used.tokenizer_record.spec
    t = cfg.train
    t.seq_len = seq_len if seq_len is not None else t.seq_len
    t.micro_batch = micro_batch if micro_batch is not None else (t.micro_batch or 8)
    n = batches if batches is not None else default_batches(used, cfg)
    sizes = (("--batches", n), ("--seq-len", t.seq_len), ("--micro-batch", t.micro_batch))
    for flag, value in sizes:
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{flag} {value}: give a positive integer")
    model = used.model
    if t.seq_len > model.config.max_seq_len:
        raise ValueError(
            f"--seq-len {t.seq_len} exceeds the model's context of {model.config.max_seq_len} "
            "(max_seq_len)"
        )
    plan, _, _ = resolve_data(cfg, model.config, 1, used.meta)
    ds = open_dataset(cfg, plan)
    if split == "train":  # the train split's tokens cut as the validation split's are
        view = TokenDataset.from_splits(
            ds.train_tokens, ds.train_tokens, t.seq_len, t.seed, source=ds.source
        )
        ds = view if ds.boundary_id is None else view.ignore_targets_after(ds.boundary_id)
    if len(ds.val_tokens) < t.seq_len + 1:
        raise ValueError(
            f"--data {data} has no validation split of {t.seq_len + 1} tokens or more "
            f"({len(ds.val_tokens):,}): --split train evaluates on its train split"
        )
    windows = ds.val_batches(n, t.micro_batch)
    weight = ds.val_loss_weight(n, t.micro_batch)
    device = model.rope_cos.device
    eos = plan.eos_id if plan.documents == "mask" else None
    total = torch.zeros((), dtype=torch.float64, device=device)  # the trainer's fp64 sum
    for x, y in windows:
        if eos is None:
            logits = model(x.to(device))
        else:
            from fivefold.models.documents import find_documents

            logits = model(x.to(device), find_documents(x, int(eos), device=device))
        total += lm_cross_entropy(logits, y.to(device))
    loss = (total * weight / len(windows)).item()
    return EvalReport(
        loss,
        math.exp(loss) if loss < 700 else math.inf,
        n,
        t.micro_batch,
        t.seq_len,
        split,
        str(data),
        used.source,
    )
