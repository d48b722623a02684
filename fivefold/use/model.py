"""The model a command uses outside training (`fivefold generate`, `fivefold eval`), whole in this
one process: from a run's checkpoint, whatever layout trained it (each tensor read whole by
export's reader, `hf.read_checkpoint_tensors`), or from a Hugging Face directory of any family
fivefold reads (`hf.read_hf_tensors`, after the strict `check_hf_weights`); and its tokenizer: the
run's (the one its checkpoint records, checked by that sha256, as export checks it) or the
directory's ``tokenizer.json``; ``tokenizer`` overrides either (a run's still checked)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fivefold.checkpoint.hf import (
    GENERATION_CONFIG,
    HF_CONFIG,
    check_hf_weights,
    model_tensors,
    open_checkpoint,
    read_checkpoint_tensors,
    read_hf_config,
    read_hf_tensors,
)
from fivefold.checkpoint.manager import CHECKPOINT_META
from fivefold.models.llama import Llama, LlamaConfig
from fivefold.train.tokenizer import (
    TokenizerError,
    TokenizerInfo,
    load_tokenizer,
    tokenizer_info,
)

__all__ = ["UsedModel", "is_hf_dir", "load_model", "run_tokenizer"]


@dataclass
class UsedModel:
    """A model read for use, with what reading it decided."""

    model: Llama  # whole, in eval mode, no gradients
    tokenizer: Any  # `train.tokenizer.Tokenizer` or the bytes (`corpus.ByteTokenizer`)
    tokenizer_record: TokenizerInfo  # the tokenizer as a checkpoint records one
    eos_ids: tuple[int, ...]  # the ids that end a generation (none: the byte tokenizer)
    source: str  # the checkpoint or directory read
    meta: dict[str, Any] | None  # the checkpoint's fivefold.json; None for a Hugging Face directory

    @property
    def config(self) -> LlamaConfig:
        return self.model.config


def is_hf_dir(path: str | Path) -> bool:
    """``path`` is a Hugging Face model directory (a config.json), not a fivefold run."""
    p = Path(path)
    return (p / HF_CONFIG).is_file() and not (p / CHECKPOINT_META).is_file()


def _filled(cfg: LlamaConfig, tensors: Any, device: torch.device, dtype: torch.dtype) -> Llama:
    """A `Llama` of ``cfg`` on ``device`` holding ``tensors`` ((name, tensor), every parameter and
    persistent buffer: a tied head once), its RoPE tables computed."""
    model = Llama(cfg, seed=None, device=device, dtype=dtype)
    model.init_buffers()  # the RoPE tables (derived, never stored); an expert bias is read next
    state = model.state_dict(keep_vars=True)
    want = {n for n, _ in model_tensors(cfg) if not (cfg.tie_embeddings and n == "output.weight")}
    got = set()
    with torch.no_grad():
        for name, value in tensors:
            target = state[name]  # (an expert bias stays fp32 whatever the dtype, as trained)
            target.copy_(value.to(device=device, dtype=target.dtype))
            got.add(name)
    if got != want:  # the readers yield model_tensors' names: a bug, not bad input
        raise AssertionError(f"tensors not read: {sorted(want ^ got)}")
    return model.eval().requires_grad_(False)


def run_tokenizer(meta: dict[str, Any], given: str | None = None) -> tuple[Any, TokenizerInfo]:
    """The tokenizer a checkpoint's metadata records (``given`` names its file when the recorded
    path has moved), checked against the recorded sha256 and special ids; the bytes when the run
    trained on bytes (or saved no record). A file that is gone or another one is one line."""
    record = meta.get("tokenizer")
    saved = TokenizerInfo.from_dict(record) if record else None
    if saved is None or (saved.fingerprint == "bytes" and given is None):
        spec = given or "bytes"
        tok = _load(spec)
        return tok, tokenizer_info(tok, spec)
    spec = given or saved.spec
    try:
        tok = _load(spec)
    except TokenizerError:
        if given is not None:
            raise
        raise TokenizerError(
            f"the run's tokenizer {spec} is gone (or unreadable): --tokenizer FILE names it "
            "(checked against the sha256 its checkpoint recorded)"
        ) from None
    info = tokenizer_info(tok, spec)
    if not info.same_as(saved):
        raise TokenizerError(
            f"the tokenizer {spec} is {info.describe()}, but the run trained with "
            f"{saved.describe()}: give --tokenizer the file the run trained with"
        )
    return tok, info


def _load(spec: str) -> Any:
    try:
        return load_tokenizer(spec)
    except TokenizerError as e:  # its messages name data.tokenizer, the train key
        raise TokenizerError(str(e).replace("data.tokenizer: ", "--tokenizer: ", 1)) from None


def _hf_eos(directory: Path, tokenizer_eos: int | None) -> tuple[int, ...]:
    """The ids that end a generation: generation_config.json's eos_token_id (an id or a list), else
    config.json's, else the tokenizer's."""
    for name in (GENERATION_CONFIG, HF_CONFIG):
        path = directory / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,)
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return tuple(value)
    return () if tokenizer_eos is None else (tokenizer_eos,)


def load_model(
    spec: str | Path,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tokenizer: str | None = None,
    trust: bool = False,
) -> UsedModel:
    """The whole model ``spec`` names — a run directory (its latest checkpoint), a checkpoint
    folder, a checkpoint, or a Hugging Face model directory — on ``device`` in ``dtype``, with its
    tokenizer. Every problem is a ValueError (one line): `CheckpointError`, `TokenizerError`."""
    device = torch.device(device)
    path = Path(spec)
    if is_hf_dir(path):
        cfg = read_hf_config(path)
        check_hf_weights(path, cfg)  # strict: every tensor used, every parameter found
        model = _filled(cfg, read_hf_tensors(path, cfg), device, dtype)
        if tokenizer is None and not (path / "tokenizer.json").is_file():
            raise TokenizerError(
                f"{path} holds no tokenizer.json: --tokenizer names the model's tokenizer (a "
                "tokenizer.json, a directory holding one, a tiktoken BPE file, or bytes)"
            )
        spec_tok = tokenizer or str(path)
        tok = _load(spec_tok)
        info = tokenizer_info(tok, spec_tok)
        eos = _hf_eos(path, info.eos_id)
        return UsedModel(model, tok, info, eos, str(path), None)
    src, meta, cfg = open_checkpoint(path, trust)
    tok, info = run_tokenizer(meta, tokenizer)
    names = [n for n in model_tensors(cfg) if not (cfg.tie_embeddings and n[0] == "output.weight")]
    model = _filled(cfg, read_checkpoint_tensors(src, names, trust), device, dtype)
    eos = () if info.eos_id is None else (info.eos_id,)
    return UsedModel(model, tok, info, eos, str(src), meta)
