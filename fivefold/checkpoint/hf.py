"""Hugging Face weights in and out, every family of `families`: `export_checkpoint` (a fivefold
checkpoint -> safetensors + config.json + generation_config.json + the run's tokenizer, in the
family's naming, one tensor at a time) and `load_hf_weights` (HF safetensors -> this rank's share of
any layout, reading only its rectangles from the memory-mapped files), checked first and strictly
by `check_hf_weights` (every tensor used, every parameter found).

fivefold's model uses HF's rotate-half RoPE and keeps experts as separate parameters, so tensors
map one to one, by name only (`families.hf_tensor_name`). What no family can express is refused
with the reason (docs/design.md#model-families).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from fivefold.checkpoint.families import (
    FAMILIES,
    Family,
    FamilyError,
    family_for,
    family_of,
    hf_tensor_name,
    read_config,
    write_config,
)
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
from fivefold.paths import PathOutside, atomic_path, inside

__all__ = [
    "HF_CONFIG",
    "check_hf_weights",
    "config_from_hf",
    "config_to_hf",
    "export_checkpoint",
    "hf_name",
    "load_hf_weights",
    "open_checkpoint",
    "read_checkpoint_tensors",
    "read_hf_family",
    "read_hf_tensors",
]

HF_CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
INDEX = "model.safetensors.index.json"


def hf_name(name: str, family: Family | None = None) -> str:
    """fivefold parameter (or persistent buffer) name -> ``family``'s (default Llama's) HF tensor
    name (``layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    family = family or FAMILIES["llama"]
    hf = hf_tensor_name(name, family)
    if hf is None:
        raise CheckpointError(
            f"parameter {name!r} has no Hugging Face {family.model_type} counterpart"
        )
    return hf


def config_to_hf(
    c: LlamaConfig, dtype: torch.dtype, family: Family | None = None
) -> dict[str, Any]:
    """``c`` as a config.json of ``family`` (default: the plainest family that expresses it,
    `family_for`); a model no family expresses is a `CheckpointError` saying what each lacks."""
    try:
        family = family or family_for(c)
        if family.fits is None:
            raise FamilyError(
                f"{family.model_type} is read, never written (its attention is not fivefold's)"
            )
        if lacks := family.fits(c):
            raise FamilyError(f"a {family.model_type} model has {lacks[0]}; this one has not")
    except FamilyError as e:
        raise CheckpointError(str(e)) from None
    return {**write_config(c, family), "torch_dtype": str(dtype).removeprefix("torch.")}


def config_from_hf(d: dict[str, Any]) -> LlamaConfig:
    """An HF ``config.json`` of any family fivefold reads (`families.FAMILIES`) as a
    `LlamaConfig`; what fivefold's model cannot express is an error, and so is a value of the
    wrong type (naming its key) or a size beyond `check_model_bounds` (naming config.json's
    key)."""
    from fivefold.models.llama import check_model_bounds

    try:
        config, _ = read_config(d)
        if config.moe is not None:
            config.moe.validate()  # before the sizes: param_counts divides by its every
    except (FamilyError, ValueError) as e:
        raise CheckpointError(str(e)) from None
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


def _read_json(directory: str | Path, name: str = HF_CONFIG) -> dict[str, Any]:
    """``directory``/config.json as an object; every error is a `CheckpointError` naming the
    file."""
    path = Path(directory) / name
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} is not a Hugging Face model directory (no {name})"
        ) from None
    except (OSError, UnicodeDecodeError) as e:  # a directory named config.json, no permission
        raise CheckpointError(
            f"{path} cannot be read ({getattr(e, 'strerror', None) or e})"
        ) from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise CheckpointError(
            f"{path} is not a model config (a JSON object), but a {type(d).__name__}"
        )
    return d


def read_hf_family(directory: str | Path) -> Family:
    """The `Family` of ``directory``'s config.json (by its model_type)."""
    try:
        return family_of(_read_json(directory))
    except FamilyError as e:
        raise CheckpointError(f"{Path(directory) / HF_CONFIG}: {e}") from None


def read_hf_config(directory: str | Path) -> LlamaConfig:
    """`config_from_hf` of ``directory``/config.json; every error is a `CheckpointError` naming the
    file."""
    d = _read_json(directory)
    try:
        return config_from_hf(d)
    except ValueError as e:  # CheckpointError, ConfigError (sizes), LlamaConfig.validate's
        raise CheckpointError(f"{Path(directory) / HF_CONFIG}: {e}") from None


# -- out -------------------------------------------------------------------------------------------


def model_tensors(cfg: LlamaConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of ``cfg``'s model a checkpoint holds — parameters and
    persistent buffers (the MoE expert bias), a tied head once — in the single-process order."""
    from fivefold.models.llama import Llama

    model = Llama(cfg, device="meta")
    out = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    out += [
        (n, tuple(b.shape))
        for n, b in model.state_dict(keep_vars=True).items()
        if not isinstance(b, torch.nn.Parameter)
    ]
    return out


def _llama_config(d: dict[str, Any]) -> LlamaConfig:
    from fivefold.models.moe import MoEConfig

    d = dict(d)
    if d.get("moe"):
        d["moe"] = MoEConfig(**d["moe"])
    if d.get("rope_scaling"):
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return LlamaConfig(**d)


def _zero_expert_bias(cfg: LlamaConfig, family: Family, names: list[str]) -> dict[str, int]:
    """HF tensor -> experts, for the DeepSeek-V3-style families' ``e_score_correction_bias`` a
    model without an expert bias does not have: exported as zeros (selection by the scores
    alone, as this model selects)."""
    if cfg.moe is None or not family.router_bias:
        return {}
    out = {}
    for i in range(cfg.n_layers):
        name = f"layers.{i}.feed_forward.expert_bias"
        if cfg.is_moe_block(i) and name not in names:
            out[hf_name(name, family)] = cfg.moe.experts
    return out


def open_checkpoint(
    source: str | Path, trust: bool = False
) -> tuple[Path, dict[str, Any], LlamaConfig]:
    """The checkpoint ``source`` names (a checkpoint, a run's checkpoint folder or a run directory:
    its latest), its metadata (``fivefold.json``) and its model's config, once every file's size and
    SHA-256 match the manifest and its DCP metadata is readable (without ``trust``: no pickle,
    `UntrustedCheckpoint`)."""
    from fivefold.checkpoint.manager import check_loadable

    src = find_checkpoint(source)
    meta = read_checkpoint_meta(src)
    problems = verify_files(src, meta)  # before anything is read
    if problems:
        raise CheckpointError(f"checkpoint {src} is damaged: " + "; ".join(problems[:5]))
    check_loadable(src, trust)
    return src, meta, _llama_config(meta["model"])


def read_checkpoint_tensors(
    src: Path, names: Iterable[tuple[str, tuple[int, ...]]], trust: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each named tensor of the checkpoint ``src`` (`open_checkpoint`'s) whole, fp32 on the CPU,
    whatever layout saved it: DCP reads that tensor's chunks (the rectangles every rank wrote)
    alone, so one tensor is held at a time. ``names``: (name, full shape), `model_tensors`'."""
    from torch.distributed.checkpoint.state_dict_loader import load

    from fivefold.checkpoint.metadata import SafeReader

    reader = SafeReader(src, trust)
    for n, shape in names:
        buf = {f"model.{n}": torch.empty(shape, dtype=torch.float32, device="cpu")}
        with (
            warnings.catch_warnings()
        ):  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load(buf, storage_reader=reader, no_dist=True)
        yield n, buf[f"model.{n}"]


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = 2 << 30,
    trust: bool = False,
    family: str | None = None,
    tokenizer: str | None = None,
) -> dict[str, Any]:
    """Write the model of the fivefold checkpoint ``source`` (a checkpoint, a run's checkpoint
    folder or a run directory: its latest) as Hugging Face safetensors in ``out_dir``: shards of
    at most ``max_shard_bytes`` (with ``model.safetensors.index.json`` when more than one), named
    as ``family`` names them (default: the plainest family that expresses the model,
    `families.family_for`), with ``config.json``, ``generation_config.json`` and the tokenizer the
    run trained with (`write_tokenizer`; ``tokenizer`` names its file when the recorded path has
    moved), so ``from_pretrained`` and ``generate`` work. One process; it holds one shard and one
    tensor at a time, each read from DCP alone. Returns a summary (files, bytes, peak held bytes,
    family, notes). A checkpoint whose metadata only DCP's pickle holds needs ``trust``
    (`UntrustedCheckpoint`)."""
    from safetensors.torch import save_file

    src, meta, cfg = open_checkpoint(source, trust)
    if family is not None and family not in FAMILIES:
        raise CheckpointError(f"family {family!r} is not one of {', '.join(FAMILIES)}")
    fam = FAMILIES[family] if family else None
    hf_config = config_to_hf(cfg, dtype, fam)
    fam = FAMILIES[hf_config["model_type"]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [
        (n, s) for n, s in model_tensors(cfg) if not (cfg.tie_embeddings and n == "output.weight")
    ]
    for n, _ in names:
        hf_name(n, fam)  # every name maps, before anything is written
    zeros = _zero_expert_bias(cfg, fam, [n for n, _ in names])
    shards: list[dict[str, torch.Tensor]] = [{}]
    held = peak = 0
    files: list[tuple[str, list[str]]] = []
    total = 0

    def flush() -> None:
        nonlocal held
        if not shards[-1]:
            return
        name = f"model-{len(files) + 1:05d}.safetensors"
        with atomic_path(out / name) as tmp:  # safetensors writes 0600: the umask's mode instead
            save_file(shards[-1], str(tmp), metadata={"format": "pt"})
        files.append((name, list(shards[-1])))
        shards[-1] = {}
        held = 0

    def add(hf: str, tensor: torch.Tensor) -> None:
        nonlocal held, total, peak
        size = tensor.numel() * tensor.element_size()
        if held and held + size > max_shard_bytes:
            flush()
        shards[-1][hf] = tensor
        held += size
        total += size
        peak = max(peak, held)

    for n, tensor in read_checkpoint_tensors(src, names, trust):  # export is a CPU process
        # an expert bias stays fp32 (HF keeps e_score_correction_bias in fp32 too)
        cast = torch.float32 if n.endswith("expert_bias") else dtype
        add(hf_name(n, fam), tensor.to(cast))
    for hf, experts in zeros.items():
        add(hf, torch.zeros(experts, dtype=torch.float32, device="cpu"))
    flush()
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
    notes, ids = write_tokenizer(meta.get("tokenizer"), out, tokenizer)
    hf_config.update(ids)
    (out / HF_CONFIG).write_text(json.dumps(hf_config, indent=1))
    generation = {k: v for k, v in ids.items() if v is not None}
    (out / GENERATION_CONFIG).write_text(json.dumps(generation, indent=1))
    return {
        "checkpoint": str(src),
        "files": [f for f, _ in files],
        "bytes": total,
        "peak_held_bytes": peak,
        "steps_done": meta.get("steps_done"),
        "family": fam.model_type,
        "notes": notes,
    }


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_tokenizer(
    record: dict[str, Any] | None, out: Path, given: str | None = None
) -> tuple[list[str], dict[str, int | None]]:
    """Write the tokenizer a checkpoint records (``record``: its spec, sha256, special ids) into
    ``out`` as Hugging Face files: a ``tokenizer.json`` (with ``tokenizer_config.json`` and
    ``special_tokens_map.json`` where they lie beside it) copied when its sha256 is still the
    recorded one, or for the byte tokenizer one made here (id i is byte i). ``given`` names the
    file instead of the recorded path. Returns (notes on what was not written, the token ids for
    config.json: bos_token_id, eos_token_id)."""
    import hashlib
    import shutil

    if record is None or record.get("fingerprint") == "bytes":
        made = _byte_tokenizer(out)
        ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
        return ([] if made else ["tokenizer not written: pip install tokenizers"]), ids
    ids = {"bos_token_id": record.get("bos_id"), "eos_token_id": record.get("eos_id")}
    spec = Path(given or record.get("spec", ""))
    path = spec / "tokenizer.json" if spec.is_dir() else spec
    if not path.is_file():
        return [f"tokenizer not written: {path} is gone (export --tokenizer FILE names it)"], ids
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != record.get("fingerprint"):
        return [
            f"tokenizer not written: {path} is not the file the run trained with (its "
            "sha256 differs)"
        ], ids
    if data[:1] != b"{":
        return [
            f"tokenizer not written: {path} is a tiktoken file, which Hugging Face's "
            "tokenizers do not read"
        ], ids
    for name in _TOKENIZER_FILES:
        if (path.parent / name).is_file() and (name != "tokenizer.json" or path.name == name):
            shutil.copyfile(path.parent / name, out / name)
    if path.name != "tokenizer.json":
        shutil.copyfile(path, out / "tokenizer.json")
    return [], ids


def _byte_tokenizer(out: Path) -> bool:
    """A ``tokenizer.json`` whose id i is byte i (fivefold's byte tokenizer), with a
    tokenizer_config.json that `AutoTokenizer` reads; False without the tokenizers library."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return False
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters standing for bytes
    from tokenizers.pre_tokenizers import ByteLevel

    chars = _bytes_to_unicode()
    assert sorted(chars.values()) == sorted(alphabet)
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30})
    )
    return True


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


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
    """Before any worker starts: every tensor of ``config``'s model (`model_tensors`) is in the
    directory's safetensors files under its family's name (`families`) with its shape (only the
    files' headers are read), and — strict — every tensor there is one the model reads (a head the
    tied model does not use and derived RoPE buffers aside), unless ``allow_unused``
    (``model.init_from_allow_unused``: then the notes name what is left unread). Raises
    `CheckpointError` naming the first problem."""
    from safetensors import safe_open

    directory = Path(directory)
    family = read_hf_family(directory)
    where = _weight_files(directory)
    by_file: dict[Path, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in model_tensors(config):
        if config.tie_embeddings and name == "output.weight":
            continue
        hf = hf_name(name, family)
        if hf not in where:
            raise CheckpointError(
                f"{directory} has no tensor {hf!r} (for {name}): the weights are not those of its "
                f"{HF_CONFIG} ({family.model_type})"
            )
        by_file.setdefault(where[hf], []).append((hf, shape))
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
    for path in {p for p in where.values() if p.is_file()} - set(by_file):
        by_file[path] = []  # a file the model reads nothing from: its tensors are unused too
    stored = set(where)
    for path in by_file:  # every tensor in the files, the index's weight_map or not
        with _opened(safe_open, path) as f:
            stored.update(f.keys())
    unused = sorted(
        n
        for n in stored
        if n not in used
        and not n.endswith(_DERIVED)
        and not (config.tie_embeddings and n == "lm_head.weight")
    )
    if not unused:
        return []
    more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
    if not allow_unused:
        raise CheckpointError(
            f"{directory} holds {unused[0]!r}{more}, which this {family.model_type} model has no "
            f"place for: the weights are not those its {HF_CONFIG} describes (another family "
            "relabelled? attention biases: Qwen2; per-head q/k norms: Qwen3; extra layers: a "
            "multi-token-prediction head); --init-from-allow-unused loads the rest on purpose"
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
    """Fill every engine's fp32 master shard from the Hugging Face safetensors in ``directory``
    (named as its config.json's family names them), each rank reading only the rectangles its
    layout holds (`training_state`'s `Pieces`), and the persistent buffers (an MoE expert bias)
    whole, then refresh the compute copies. Returns the number of elements read on this rank."""
    from safetensors import safe_open

    directory = Path(directory)
    family = read_hf_family(directory)
    engines = list(engines)
    where = _weight_files(directory)
    ts = training_state(engines, tp)
    by_file: dict[Path, list[tuple[str, Any]]] = {}
    for key, pieces in ts.state_dict.items():
        if not key.startswith("model."):
            continue
        name = hf_name(key[len("model.") :], family)
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
                whole = isinstance(pieces, torch.Tensor)  # a buffer, the same on every rank
                size = tuple(pieces.shape) if whole else tuple(pieces.size)
                if shape != size:
                    raise CheckpointError(
                        f"{path.name}: {name} is {shape}, but this model's is {size}"
                    )
                if whole:
                    pieces.copy_(f.get_tensor(name).to(pieces.dtype))
                    read += pieces.numel()
                    continue
                for offsets, values in pieces.boxes.items():
                    index = tuple(slice(o, o + s) for o, s in zip(offsets, values.shape))
                    values.copy_(sl[index].to(values.dtype))
                    read += values.numel()
    ts.after_load(engines)
    return read


def read_hf_tensors(
    directory: str | Path, config: LlamaConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``config``'s model (`model_tensors`, a tied head once) whole from the
    Hugging Face directory, by its family's name, as stored (dtype, CPU), one at a time; call
    `check_hf_weights` first (it names what is missing or unused)."""
    from safetensors import safe_open

    directory = Path(directory)
    family = read_hf_family(directory)
    where = _weight_files(directory)
    for name, _ in model_tensors(config):
        if config.tie_embeddings and name == "output.weight":
            continue
        hf = hf_name(name, family)
        with _opened(safe_open, where[hf]) as f:
            yield name, f.get_tensor(hf)


def iter_hf_tensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF safetensors directory (tests)."""
    from safetensors import safe_open

    for name, path in sorted(_weight_files(Path(directory)).items()):
        with _opened(safe_open, path) as f:
            yield name, f.get_tensor(name)
