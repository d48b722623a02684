"""Hugging Face Llama weights in and out: `export_checkpoint` (a fivefold checkpoint ->
safetensors + config.json in HF Llama naming, one parameter at a time) and `load_hf_weights` (HF
safetensors -> this rank's share of any layout, reading only its rectangles from the memory-mapped
files).

fivefold's Llama uses HF's rotate-half RoPE, so weights map one to one, by name only (`HF_NAMES`).
What HF Llama cannot express is refused with the reason: MoE blocks, biases, another activation,
another RoPE scaling type.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from fivefold.checkpoint.manager import (
    CheckpointError,
    find_checkpoint,
    read_checkpoint_meta,
    verify_files,
)
from fivefold.checkpoint.state import training_state
from fivefold.data_parallel import ZeroDataParallel
from fivefold.distributed.comm import Comm
from fivefold.models.llama import LlamaConfig, RopeScaling
from fivefold.paths import PathOutside, inside

__all__ = [
    "HF_CONFIG",
    "check_hf_weights",
    "config_from_hf",
    "config_to_hf",
    "export_checkpoint",
    "hf_name",
    "load_hf_weights",
]

HF_CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """fivefold parameter name -> HF Llama's (``layers.3.attention.wq.weight`` ->
    ``model.layers.3.self_attn...``)."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    raise CheckpointError(
        f"parameter {name!r} has no Hugging Face Llama counterpart (an MoE expert or router?): "
        "HF Llama checkpoints hold dense Llama models only"
    )


def config_to_hf(c: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    if c.moe is not None:
        raise CheckpointError(
            "an MoE model has no Hugging Face Llama form (LlamaForCausalLM is dense)"
        )
    out: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.ffn_hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
    }
    if (
        c.rope_scaling is not None
    ):  # both spellings: transformers < 5 reads rope_scaling, 5 rope_parameters
        s = c.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
        out["rope_parameters"] = {**out["rope_scaling"], "rope_theta": c.rope_theta}
    return out


def config_from_hf(d: dict[str, Any]) -> LlamaConfig:
    """An HF ``config.json`` (Llama) as a `LlamaConfig`; what fivefold's Llama cannot express is an
    error, and so is a value of the wrong type (naming its key) or a size beyond
    `check_model_bounds` (naming config.json's key)."""
    import math

    from fivefold.models.llama import check_model_bounds

    def label(key: str, where: dict[str, Any]) -> str:
        if where is d:
            return key
        return f"{'rope_parameters' if where is d.get('rope_parameters') else 'rope_scaling'}.{key}"

    def integer(key: str, default: Any = None, where: dict[str, Any] = d) -> int:
        value = where.get(key, default)
        if value is None:
            raise CheckpointError(f"no {label(key, where)!r} (a Llama config.json has it)")
        # JSON integers (4096.0 too); not true/false, which Python would count as 1/0, nor "4096"
        if isinstance(value, bool) or not (
            isinstance(value, int) or isinstance(value, float) and value.is_integer()
        ):
            raise CheckpointError(f"{label(key, where)}={value!r} is not an integer")
        return int(value)

    def number(key: str, default: float, where: dict[str, Any] = d) -> float:
        value = where.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise CheckpointError(f"{label(key, where)}={value!r} is not a finite number")
        return float(value)

    problems = []
    if d.get("model_type", "llama") != "llama":
        problems.append(f"model_type={d.get('model_type')!r} (only llama)")
    if d.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={d.get('hidden_act')!r} (SwiGLU with silu only)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            problems.append(f"{key}=true (no biases)")
    if d.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={d['pretraining_tp']} (1 only)")
    # transformers < 5 writes rope_theta and rope_scaling; 5 writes both into rope_parameters
    scaling = d.get("rope_parameters") or d.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise CheckpointError(f"rope_scaling / rope_parameters={scaling!r} is not an object")
    theta = number(
        "rope_theta", number("rope_theta", 10000.0), where=d.get("rope_parameters") or {}
    )
    rope = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor"):
                if key not in scaling:
                    raise CheckpointError(f"no {label(key, scaling)!r} (llama3 scaling needs it)")
            rope = RopeScaling(
                number("factor", 0, scaling),
                number("low_freq_factor", 0, scaling),
                number("high_freq_factor", 0, scaling),
                integer("original_max_position_embeddings", where=scaling),
            )
        elif kind != "default":
            problems.append(f"rope_scaling type {kind!r} (llama3 only)")
    if problems:
        raise CheckpointError(
            "this Hugging Face model cannot be expressed by fivefold's Llama: "
            + "; ".join(problems)
        )
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise CheckpointError(f"tie_word_embeddings={tie!r} is not true or false")
    heads, dim = integer("num_attention_heads"), integer("hidden_size")
    head_dim = integer("head_dim") if d.get("head_dim") else None
    config = LlamaConfig(
        vocab_size=integer("vocab_size"),
        dim=dim,
        n_layers=integer("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=integer("num_key_value_heads") if d.get("num_key_value_heads") else heads,
        ffn_hidden=integer("intermediate_size"),
        max_seq_len=integer("max_position_embeddings", 2048),
        rope_theta=theta,
        norm_eps=number("rms_norm_eps", 1e-6),
        tie_embeddings=tie,
        attention_head_dim=head_dim
        if head_dim and heads > 0 and head_dim != dim // heads
        else None,
        rope_scaling=rope,
    )
    # absurd sizes first (a damaged file), named as config.json names them
    check_model_bounds(
        config,
        names={
            "vocab_size": "vocab_size",
            "dim": "hidden_size",
            "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads",
            "n_kv_heads": "num_key_value_heads",
            "ffn_hidden": "intermediate_size",
            "max_seq_len": "max_position_embeddings",
            "attention_head_dim": "head_dim",
        },
    )
    return config.validate()


def read_hf_config(directory: str | Path) -> LlamaConfig:
    """`config_from_hf` of ``directory``/config.json; every error is a `CheckpointError` naming the
    file."""
    path = Path(directory) / HF_CONFIG
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} is not a Hugging Face model directory (no {HF_CONFIG})"
        ) from None
    except (
        OSError,
        UnicodeDecodeError,
    ) as e:  # a directory named config.json, no permission, not text
        raise CheckpointError(
            f"{path} cannot be read ({getattr(e, 'strerror', None) or e})"
        ) from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(
            f"{path} is not a Llama config (a JSON object), but a {type(d).__name__}"
        )
    try:
        return config_from_hf(d)
    except (
        ValueError
    ) as e:  # CheckpointError, ConfigError (sizes), LlamaConfig.validate's ValueError
        raise CheckpointError(f"{path}: {e}") from None


# -- out -------------------------------------------------------------------------------------------


def _model_parameters(meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the checkpoint's model, in the single-process order."""
    from fivefold.models.llama import Llama

    cfg = _llama_config(meta["model"])
    return [(n, tuple(p.shape)) for n, p in Llama(cfg, device="meta").named_parameters()]


def _llama_config(d: dict[str, Any]) -> LlamaConfig:
    from fivefold.models.moe import MoEConfig

    d = dict(d)
    if d.get("moe"):
        d["moe"] = MoEConfig(**d["moe"])
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return LlamaConfig(**d)


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 2 << 30,
    trust: bool = False,
) -> dict[str, Any]:
    """Write the model of the fivefold checkpoint ``source`` (a checkpoint, a run's checkpoint
    folder or a run directory: its latest) as HF Llama safetensors in ``out_dir``: shards of at most
    ``max_shard_bytes`` (with ``model.safetensors.index.json`` when more than one) and
    ``config.json``. One process; it holds one shard and one parameter at a time, each read from DCP
    alone. Returns a summary (files, bytes, peak held bytes). A checkpoint whose metadata only DCP's
    pickle holds needs ``trust`` (`UntrustedCheckpoint`)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict_loader import load

    from fivefold.checkpoint.manager import check_loadable
    from fivefold.checkpoint.metadata import SafeReader

    src = find_checkpoint(source)
    meta = read_checkpoint_meta(src)
    problems = verify_files(
        src, meta
    )  # sizes and SHA-256 of every file, before anything is exported
    if problems:
        raise CheckpointError(f"checkpoint {src} is damaged: " + "; ".join(problems[:5]))
    check_loadable(src, trust)
    cfg = _llama_config(meta["model"])
    hf_config = config_to_hf(cfg, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [
        (n, s)
        for n, s in _model_parameters(meta)
        if not (cfg.tie_embeddings and n == "output.weight")
    ]
    for n, _ in names:
        hf_name(n)  # every name maps, before anything is written
    reader = SafeReader(src, trust)
    shards: list[dict[str, torch.Tensor]] = [{}]
    held = peak = 0
    files: list[tuple[str, list[str]]] = []
    total = 0

    def flush(final: bool) -> None:
        nonlocal held
        if not shards[-1]:
            return
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(out / name), metadata={"format": "pt"})
        files.append((name, list(shards[-1])))
        shards[-1] = {}
        held = 0

    for n, shape in names:
        buf = {
            f"model.{n}": torch.empty(shape, dtype=torch.float32, device="cpu")
        }  # export is a CPU process
        with (
            warnings.catch_warnings()
        ):  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load(
                buf, storage_reader=reader, no_dist=True
            )  # DCP reads this parameter's chunks alone
        tensor = buf[f"model.{n}"].to(dtype)
        size = tensor.numel() * tensor.element_size()
        if held and held + size > max_shard_bytes:
            flush(False)
        shards[-1][hf_name(n)] = tensor
        held += size
        total += size
        peak = max(peak, held)
    flush(True)
    if len(files) == 1:  # one file: HF's plain name, no index
        (out / files[0][0]).rename(out / "model.safetensors")
        files = [("model.safetensors", files[0][1])]
    else:
        renamed = []
        for i, (name, keys) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            (out / name).rename(out / final)
            renamed.append((final, keys))
        files = renamed
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: f for f, keys in files for k in keys},
        }
        (out / INDEX).write_text(json.dumps(index, indent=1))
    (out / HF_CONFIG).write_text(json.dumps(hf_config, indent=1))
    return {
        "checkpoint": str(src),
        "files": [f for f, _ in files],
        "bytes": total,
        "peak_held_bytes": peak,
        "steps_done": meta.get("steps_done"),
    }


# -- in --------------------------------------------------------------------------------------------


def _weight_files(directory: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file that holds it."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index} is damaged (no weight_map object)") from None
        try:
            return {
                k: inside(directory, f, f"the weight file of {k!r} in {index}")
                for k, f in weight_map.items()
            }
        except PathOutside as e:
            raise CheckpointError(str(e)) from None
    single = directory / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{directory} has neither model.safetensors nor {INDEX}")
    from safetensors import safe_open

    with _opened(safe_open, single) as f:
        return {k: single for k in f.keys()}


# HF tensors no fivefold parameter reads, and rightly: derived buffers older checkpoints saved
_DERIVED = ("rotary_emb.inv_freq",)


def check_hf_weights(
    directory: str | Path, config: LlamaConfig, allow_unused: bool = False
) -> list[str]:
    """Before any worker starts: every tensor of ``config``'s model is in the directory's
    safetensors files with its shape (only the files' headers are read), and — strict — every
    tensor there is one the model reads (a head the tied model does not use and derived RoPE
    buffers aside), unless ``allow_unused`` (``model.init_from_allow_unused``: then the notes name
    what is left unread). Raises `CheckpointError` naming the first problem."""
    from safetensors import safe_open

    from fivefold.models.llama import Llama

    directory = Path(directory)
    where = _weight_files(directory)
    by_file: dict[Path, list[tuple[str, tuple[int, ...]]]] = {}
    for name, p in Llama(config, device="meta").named_parameters():
        hf = hf_name(name)
        if hf not in where:
            raise CheckpointError(
                f"{directory} has no tensor {hf!r} (for {name}): the weights are not those of its "
                f"{HF_CONFIG}"
            )
        by_file.setdefault(where[hf], []).append((hf, tuple(p.shape)))
    for path, items in by_file.items():
        if not path.is_file():
            raise CheckpointError(f"{path} is missing ({INDEX} names it)")
        with _opened(safe_open, path) as f:
            for hf, shape in items:
                have = tuple(f.get_slice(hf).get_shape())
                if have != shape:
                    raise CheckpointError(
                        f"{path.name}: {hf} is {have}, but {HF_CONFIG} makes it {shape}"
                    )
    used = {hf for items in by_file.values() for hf, _ in items}
    unused = sorted(
        n
        for n in where
        if n not in used
        and not n.endswith(_DERIVED)
        and not (config.tie_embeddings and n == "lm_head.weight")
    )
    if not unused:
        return []
    more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
    if not allow_unused:
        raise CheckpointError(
            f"{directory} holds {unused[0]!r}{more}, which this model has no place for: the "
            f"weights are not a plain Llama's whatever its {HF_CONFIG} says (attention biases: "
            "Qwen2? per-head q/k norms: Qwen3?); --init-from-allow-unused loads the rest on purpose"
        )
    return [f"model.init_from: {unused[0]!r}{more} left unread (model.init_from_allow_unused)"]


class _opened:
    """``safe_open`` with a clear error for a damaged file."""

    def __init__(self, opener: Any, path: Path) -> None:
        self.opener, self.path = opener, path

    def __enter__(self) -> Any:
        try:
            self.f = self.opener(str(self.path), framework="pt")
        except Exception as e:  # safetensors raises its own types for a truncated header or data
            raise CheckpointError(
                f"{self.path} is not a readable safetensors file (truncated or damaged?): {e}"
            ) from None
        return self.f.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.f.__exit__(*exc)


def load_hf_weights(
    directory: str | Path, engines: Iterable[ZeroDataParallel], tp: Comm | None
) -> int:
    """Fill every engine's fp32 master shard from the HF Llama safetensors in ``directory``, each
    rank reading only the rectangles its layout holds (`training_state`'s `Pieces`), then refresh
    the compute copies. Returns the number of elements read on this rank."""
    from safetensors import safe_open

    directory = Path(directory)
    engines = list(engines)
    where = _weight_files(directory)
    ts = training_state(engines, tp)
    by_file: dict[Path, list[tuple[str, Any]]] = {}
    for key, pieces in ts.state_dict.items():
        if not key.startswith("model."):
            continue
        name = hf_name(key[len("model.") :])
        if name not in where:
            raise CheckpointError(
                f"{directory} has no tensor {name!r} (for {key[len('model.') :]})"
            )
        by_file.setdefault(where[name], []).append((name, pieces))
    read = 0
    for path, items in by_file.items():
        with _opened(safe_open, path) as f:
            for name, pieces in items:
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if shape != tuple(pieces.size):
                    raise CheckpointError(
                        f"{path.name}: {name} is {shape}, but this model's is {tuple(pieces.size)}"
                    )
                for offsets, values in pieces.boxes.items():
                    index = tuple(slice(o, o + s) for o, s in zip(offsets, values.shape))
                    values.copy_(sl[index].to(values.dtype))
                    read += values.numel()
    ts.after_load(engines)
    return read


def iter_hf_tensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF safetensors directory (tests)."""
    from safetensors import safe_open

    for name, path in sorted(_weight_files(Path(directory)).items()):
        with _opened(safe_open, path) as f:
            yield name, f.get_tensor(name)
