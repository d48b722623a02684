"""The Hugging Face model families fivefold's one model reads and writes, as data
(docs/design.md#model-families): for each ``model_type``, how its ``config.json`` becomes a
`LlamaConfig` (and back) and how its tensor names map onto fivefold's parameter names.

Every family is the same decoder with options: Llama (none), Mistral (a sliding window), Qwen2
(q/k/v biases), Qwen3 (per-head q/k norms), Mixtral (a softmax top-k MoE), Qwen2-MoE (plus a
sigmoid-gated shared expert), Qwen3-MoE, and the DeepSeek-V3-style MoE (sigmoid scores, expert
groups, shared experts, a routed scaling factor and the aux-loss-free expert bias) as GLM-4.5
(``glm4_moe``) and dots.llm1 (``dots1``) carry it with GQA attention. DeepSeek-V3 itself
(``deepseek_v3``) is refused: its multi-head latent attention is not fivefold's attention.

A key the model cannot honour is an error naming it, never dropped: `read_config` lists every
problem of a config.json in one line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fivefold.models.llama import LlamaConfig, RopeScaling
from fivefold.models.moe import MoEConfig

__all__ = [
    "FAMILIES",
    "Family",
    "FamilyError",
    "family_for",
    "family_of",
    "hf_tensor_name",
    "read_config",
    "write_config",
]


class FamilyError(ValueError):
    """A config.json (or a model) no family can express; the message names the keys."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture: its names and the options of fivefold's model it uses.

    ``moe_prefix`` is the MoE layer's module in a block (``mlp`` or Mixtral's
    ``block_sparse_moe``), ``expert_names`` the HF names of an expert's w1 (gate), w3 (up) and w2
    (down), ``shared_name`` the shared experts' module. ``read`` turns the family's own keys into
    `LlamaConfig` / `MoEConfig` fields (the keys every family shares are read by `read_config`),
    ``write`` the reverse; ``fits`` says what a model lacks to be written as this family (empty:
    nothing; None: the family is read, never written); ``defaults`` are its transformers config
    class's values for the keys read, applied where a config.json leaves one out."""

    model_type: str
    architecture: str
    read: Callable[[_Keys], dict[str, Any]]
    write: Callable[[LlamaConfig], dict[str, Any]]
    fits: Callable[[LlamaConfig], list[str]] | None = None
    # what transformers' config class assumes of a key a config.json leaves out (those read here)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    moe_prefix: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_name: str = "shared_experts"
    router_bias: bool = False  # the router always holds e_score_correction_bias (DeepSeek-V3's)


# -- reading config.json ---------------------------------------------------------------------------


class _Keys:
    """Typed reads of a config.json, errors naming the key; `problems` collects what the model
    cannot express so that one line names them all."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d
        self.problems: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        return self.d.get(key, default)

    def integer(self, key: str, default: Any = None, where: dict[str, Any] | None = None) -> int:
        where = self.d if where is None else where
        value = where.get(key, default)
        if value is None:
            raise FamilyError(f"no {self._label(key, where)!r} (a {self.model_type} config has it)")
        # JSON integers (4096.0 too); not true/false, which Python counts as 1/0, nor "4096"
        if isinstance(value, bool) or not (
            isinstance(value, int) or isinstance(value, float) and value.is_integer()
        ):
            raise FamilyError(f"{self._label(key, where)}={value!r} is not an integer")
        return int(value)

    def number(self, key: str, default: float, where: dict[str, Any] | None = None) -> float:
        where = self.d if where is None else where
        value = where.get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise FamilyError(f"{self._label(key, where)}={value!r} is not a finite number")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.d.get(key, default)
        if not isinstance(value, bool):
            raise FamilyError(f"{key}={value!r} is not true or false")
        return value

    def refuse(self, problem: str) -> None:
        self.problems.append(problem)

    @property
    def model_type(self) -> str:
        return str(self.d.get("model_type", "llama"))

    def _label(self, key: str, where: dict[str, Any]) -> str:
        if where is self.d:
            return key
        name = "rope_parameters" if where is self.d.get("rope_parameters") else "rope_scaling"
        return f"{name}.{key}"


def _rope(k: _Keys) -> dict[str, Any]:
    """rope_theta, Llama-3 scaling and the partial-rotary factor, in transformers 4's spelling
    (rope_theta, rope_scaling, partial_rotary_factor at the top) or 5's (all in rope_parameters)."""
    params = k.get("rope_parameters") or {}
    scaling = k.get("rope_parameters") or k.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise FamilyError(f"rope_scaling / rope_parameters={scaling!r} is not an object")
    out: dict[str, Any] = {
        "rope_theta": k.number("rope_theta", k.number("rope_theta", 10000.0), where=params)
    }
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "llama3":
            for key in ("factor", "low_freq_factor", "high_freq_factor"):
                if key not in scaling:
                    raise FamilyError(f"no {k._label(key, scaling)!r} (llama3 scaling needs it)")
            out["rope_scaling"] = RopeScaling(
                k.number("factor", 0, scaling),
                k.number("low_freq_factor", 0, scaling),
                k.number("high_freq_factor", 0, scaling),
                k.integer("original_max_position_embeddings", where=scaling),
            )
        elif kind not in (None, "default"):
            k.refuse(f"rope_scaling type {kind!r} (llama3 or default only)")
    fraction = k.number(
        "partial_rotary_factor", k.number("partial_rotary_factor", 1.0), where=params
    )
    if fraction != 1.0:
        out["rotary_fraction"] = fraction
    return out


# Each family's window per layer, as its transformers config derives it (None: full attention)


def _windows_every_layer(k: _Keys, n: int) -> list[int | None]:
    """Mistral, Mixtral: ``sliding_window`` on every layer (``layer_types`` ignored)."""
    return [k.get("sliding_window")] * n


def _windows_qwen(k: _Keys, n: int) -> list[int | None]:
    """Qwen2, Qwen3: the window only with ``use_sliding_window``, on the layers ``layer_types``
    names or else on those from ``max_window_layers`` on."""
    window = k.get("sliding_window") if k.get("use_sliding_window") else None
    start = k.integer("max_window_layers", n)
    default = ["sliding_attention" if window is not None and i >= start else "" for i in range(n)]
    return _by_types(k, n, window, default)


def _windows_qwen2_moe(k: _Keys, n: int) -> list[int | None]:
    """Qwen2-MoE: with ``use_sliding_window``, every other layer below ``max_window_layers``."""
    use = bool(k.get("use_sliding_window"))
    start = k.integer("max_window_layers", n)
    default = ["sliding_attention" if use and (i + 1) % 2 and i < start else "" for i in range(n)]
    return _by_types(k, n, k.get("sliding_window") if use else 0, default)


def _windows_qwen3_moe(k: _Keys, n: int) -> list[int | None]:
    """Qwen3-MoE: with ``use_sliding_window``, every layer."""
    return [k.get("sliding_window") if k.get("use_sliding_window") else None] * n


def _windows_dots1(k: _Keys, n: int) -> list[int | None]:
    """dots.llm1: the layers ``layer_types`` names, or else those from ``max_window_layers`` on."""
    window, start = k.get("sliding_window"), k.integer("max_window_layers", n)
    default = ["sliding_attention" if window is not None and i >= start else "" for i in range(n)]
    return _by_types(k, n, window, default)


def _by_types(k: _Keys, n: int, window: Any, default: list[str]) -> list[int | None]:
    types = k.get("layer_types")
    if types is None:
        types = default
    elif not isinstance(types, list) or len(types) != n:
        k.refuse(
            f"layer_types has {len(types) if isinstance(types, list) else types!r} entries "
            f"for {n} layers"
        )
        return [None] * n
    unknown = sorted({t for t in types if t not in ("full_attention", "sliding_attention", "")})
    if unknown:
        k.refuse(f"layer_types {unknown} (full_attention / sliding_attention only)")
    return [window if t == "sliding_attention" else None for t in types]


def _sliding(k: _Keys, windows: list[int | None]) -> int | None:
    """The one window of every layer, or None; a window on some layers only (or differing) is
    refused: fivefold's window is the same in every layer."""
    if all(w is None for w in windows):
        return None
    if any(w != windows[0] for w in windows):
        sliding = sum(w is not None for w in windows)
        k.refuse(
            f"a sliding window on {sliding} of {len(windows)} layers (fivefold's window is the "
            "same in every layer)"
        )
        return None
    if isinstance(windows[0], bool) or not isinstance(windows[0], int) or windows[0] < 1:
        k.refuse(f"sliding_window={windows[0]!r} on a sliding layer (a positive integer)")
        return None
    return windows[0]


def _window(k: _Keys, rule: Any) -> int | None:
    return _sliding(k, rule(k, k.integer("num_hidden_layers")))


def _bias(k: _Keys, key: str, when_true: str) -> str:
    return when_true if k.flag(key, False) else "off"


def _read_llama(k: _Keys) -> dict[str, Any]:
    if k.get("pretraining_tp", 1) != 1:
        k.refuse(f"pretraining_tp={k.get('pretraining_tp')} (1 only)")
    return {"attention_bias": _bias(k, "attention_bias", "all")}


def _read_mistral(k: _Keys) -> dict[str, Any]:
    return {"sliding_window": _window(k, _windows_every_layer)}


def _read_qwen2(k: _Keys) -> dict[str, Any]:
    return {"attention_bias": "qkv", "sliding_window": _window(k, _windows_qwen)}


def _qwen3_attention(k: _Keys) -> dict[str, Any]:
    return {"attention_bias": _bias(k, "attention_bias", "all"), "qk_norm": True}


def _read_qwen3(k: _Keys) -> dict[str, Any]:
    return {**_qwen3_attention(k), "sliding_window": _window(k, _windows_qwen)}


def _aux(k: _Keys) -> dict[str, Any]:
    """HF adds the router's aux loss (its pooled convention) only with output_router_logits."""
    coef = k.number("router_aux_loss_coef", 0.001) if k.get("output_router_logits") else 0.0
    return {"aux_loss_coef": coef, "aux_convention": "hf"}


def _sparse_layers(k: _Keys) -> dict[str, Any]:
    if k.get("mlp_only_layers"):
        k.refuse(f"mlp_only_layers={k.get('mlp_only_layers')} (use decoder_sparse_step only)")
    step = k.integer("decoder_sparse_step", 1)
    if step < 1:
        raise FamilyError(f"decoder_sparse_step={step} must be at least 1")
    return {"every": step}


def _read_mixtral(k: _Keys) -> dict[str, Any]:
    if k.get("router_jitter_noise"):
        k.refuse(f"router_jitter_noise={k.get('router_jitter_noise')} (no router noise)")
    moe = MoEConfig(
        experts=k.integer("num_local_experts"),
        top_k=k.integer("num_experts_per_tok"),
        score="softmax",
        norm_topk=True,
        **_aux(k),
    )
    return {"moe": moe, "sliding_window": _window(k, _windows_every_layer)}


def _read_qwen2_moe(k: _Keys) -> dict[str, Any]:
    shared = k.integer("shared_expert_intermediate_size", 0)
    moe = MoEConfig(
        experts=k.integer("num_experts"),
        top_k=k.integer("num_experts_per_tok"),
        hidden=k.integer("moe_intermediate_size"),
        norm_topk=k.flag("norm_topk_prob", False),
        shared_experts=1 if shared else 0,
        shared_hidden=shared or None,
        shared_gate=bool(shared),
        **_sparse_layers(k),
        **_aux(k),
    )
    return {
        "moe": moe,
        "attention_bias": _bias(k, "qkv_bias", "qkv"),
        "sliding_window": _window(k, _windows_qwen2_moe),
    }


def _read_qwen3_moe(k: _Keys) -> dict[str, Any]:
    # transformers 5 writes num_local_experts, 4 num_experts
    key = "num_experts" if k.get("num_experts") is not None else "num_local_experts"
    moe = MoEConfig(
        experts=k.integer(key),
        top_k=k.integer("num_experts_per_tok"),
        hidden=k.integer("moe_intermediate_size"),
        norm_topk=k.flag("norm_topk_prob", False),
        **_sparse_layers(k),
        **_aux(k),
    )
    return {**_qwen3_attention(k), "sliding_window": _window(k, _windows_qwen3_moe), "moe": moe}


def _deepseek_moe(k: _Keys) -> MoEConfig:
    """DeepSeek-V3's router as GLM-4.5 and dots.llm1 write it: sigmoid scores, the bias
    ``e_score_correction_bias`` choosing experts, n_group groups of which topk_group, shared
    experts of moe_intermediate_size each, the first first_k_dense_replace blocks dense."""
    shared = k.integer("n_shared_experts", 0)
    hidden = k.integer("moe_intermediate_size")
    return MoEConfig(
        experts=k.integer("n_routed_experts"),
        top_k=k.integer("num_experts_per_tok"),
        hidden=hidden,
        score="sigmoid",
        norm_topk=k.flag("norm_topk_prob", True),
        shared_experts=shared,
        shared_hidden=shared * hidden or None,
        groups=k.integer("n_group", 1),
        group_limit=k.integer("topk_group", 1) if k.integer("n_group", 1) > 1 else None,
        first_dense=k.integer("first_k_dense_replace", 0),
        routed_scaling=k.number("routed_scaling_factor", 1.0),
        expert_bias=True,
        aux_loss_coef=0.0,  # aux-loss-free: the bias balances the load
    )


def _read_glm4_moe(k: _Keys) -> dict[str, Any]:
    return {
        "moe": _deepseek_moe(k),
        "attention_bias": _bias(k, "attention_bias", "qkv"),
        "qk_norm": k.flag("use_qk_norm", False),
    }


def _read_dots1(k: _Keys) -> dict[str, Any]:
    return {
        **_qwen3_attention(k),
        "sliding_window": _window(k, _windows_dots1),
        "moe": _deepseek_moe(k),
    }


def _read_deepseek_v3(k: _Keys) -> dict[str, Any]:
    k.refuse(
        "model_type='deepseek_v3': its multi-head latent attention (q_lora_rank, kv_lora_rank) "
        "is not fivefold's GQA attention; its MoE is (the deepseek-v3 preset, or glm4_moe / dots1 "
        "checkpoints, which carry it with GQA)"
    )
    return {}


# -- writing config.json ---------------------------------------------------------------------------


def _write_sliding(c: LlamaConfig) -> dict[str, Any]:
    return {"sliding_window": c.sliding_window}


def _write_layer_types(c: LlamaConfig) -> dict[str, Any]:
    kind = "sliding_attention" if c.sliding_window else "full_attention"
    return {
        "sliding_window": c.sliding_window,
        "use_sliding_window": bool(c.sliding_window),
        "max_window_layers": 0 if c.sliding_window else c.n_layers,
        "layer_types": [kind] * c.n_layers,
    }


def _write_hf_aux(c: LlamaConfig) -> dict[str, Any]:
    """HF's coefficient multiplies its pooled aux, k times the Switch aux of one layer: a model
    trained with fivefold's Switch convention gets coef / k (the same gradient with one MoE layer;
    with more, HF pools where fivefold sums: docs/design.md#expert-parallelism)."""
    m = c.moe
    assert m is not None
    coef = (
        m.aux_loss_coef
        if getattr(m, "aux_convention", "switch") == "hf"
        else (m.aux_loss_coef / m.top_k)
    )
    return {"router_aux_loss_coef": coef, "output_router_logits": coef > 0}


def _write_mixtral(c: LlamaConfig) -> dict[str, Any]:
    m = c.moe
    assert m is not None
    return {
        "intermediate_size": m.hidden or c.ffn_hidden,  # Mixtral's experts' width (no dense block)
        "num_local_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "router_jitter_noise": 0.0,
        **_write_hf_aux(c),
        **_write_sliding(c),
    }


def _write_qwen2_moe(c: LlamaConfig) -> dict[str, Any]:
    m = c.moe
    assert m is not None
    return {
        "num_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.hidden or c.ffn_hidden,
        "norm_topk_prob": m.norm_topk,
        "shared_expert_intermediate_size": _shared_hidden(c),
        "decoder_sparse_step": m.every,
        "mlp_only_layers": [],
        "qkv_bias": c.attention_bias == "qkv",
        **_write_hf_aux(c),
        **_write_layer_types(c),
    }


def _write_qwen3_moe(c: LlamaConfig) -> dict[str, Any]:
    m = c.moe
    assert m is not None
    return {
        "num_experts": m.experts,
        "num_local_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.hidden or c.ffn_hidden,
        "norm_topk_prob": m.norm_topk,
        "decoder_sparse_step": m.every,
        "mlp_only_layers": [],
        "attention_bias": c.attention_bias == "all",
        **_write_hf_aux(c),
        **_write_layer_types(c),
    }


def _write_deepseek_moe(c: LlamaConfig) -> dict[str, Any]:
    m = c.moe
    assert m is not None
    return {
        "n_routed_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.hidden or c.ffn_hidden,
        "norm_topk_prob": m.norm_topk,
        "n_shared_experts": m.shared_experts,
        "n_group": m.groups,
        "topk_group": m.group_limit or m.groups,
        "first_k_dense_replace": m.first_dense,
        "routed_scaling_factor": m.routed_scaling,
    }


def _write_glm4_moe(c: LlamaConfig) -> dict[str, Any]:
    return {
        **_write_deepseek_moe(c),
        "attention_bias": c.attention_bias == "qkv",
        "use_qk_norm": c.qk_norm,
        "num_nextn_predict_layers": 0,
    }


def _write_dots1(c: LlamaConfig) -> dict[str, Any]:
    return {
        **_write_deepseek_moe(c),
        "attention_bias": c.attention_bias == "all",
        **_write_layer_types(c),
    }


def _shared_hidden(c: LlamaConfig) -> int:
    m = c.moe
    assert m is not None
    if not m.shared_experts:
        return 0
    return m.shared_hidden or (m.hidden or c.ffn_hidden) * m.shared_experts


def _nothing(c: LlamaConfig) -> dict[str, Any]:
    return {}


# -- which family expresses a model ----------------------------------------------------------------

_OTHER_KIND = "dense / MoE"


def _want(*checks: tuple[bool, str]) -> list[str]:
    return [why for ok, why in checks if not ok]


def _common(c: LlamaConfig, rotary: bool = False, llama3: bool = False) -> list[str]:
    return _want(
        (rotary or c.rotary_dim is None, "no partial rotary"),
        (llama3 or c.rope_scaling is None, "no Llama-3 RoPE scaling"),
    )


def _fits_dense(c: LlamaConfig, bias: tuple[str, ...], qk_norm: bool, window: bool) -> list[str]:
    if c.moe is not None:
        return [_OTHER_KIND]
    return _want(
        (c.attention_bias in bias, f"attention_bias {' or '.join(bias)}"),
        (c.qk_norm == qk_norm, "q/k norms" if qk_norm else "no q/k norms"),
        (window or c.sliding_window is None, "no sliding window"),
    )


def _fits_router(
    c: LlamaConfig, sigmoid: bool, shared: str, qk_norm: bool | None, bias: tuple[str, ...]
) -> list[str]:
    """What ``c``'s MoE lacks for a router family: ``shared`` "none", "plain" (ungated shared
    experts of the experts' width) or "gated" (Qwen2-MoE's one gated shared expert)."""
    m = c.moe
    if m is None:
        return [_OTHER_KIND]
    hidden = m.hidden or c.ffn_hidden
    lacks = _want(
        ((m.score == "sigmoid") == sigmoid, "sigmoid scores" if sigmoid else "softmax scores"),
        (c.attention_bias in bias, f"attention_bias {' or '.join(bias)}"),
        (qk_norm is None or c.qk_norm == qk_norm, "q/k norms" if qk_norm else "no q/k norms"),
        (m.capacity_factor is None, "dropless routing (no capacity factor)"),
        (not m.z_loss_coef, "no router z-loss"),
        (sigmoid or not m.expert_bias, "no expert bias"),
        (sigmoid or m.groups == 1, "no expert groups"),
        (sigmoid or m.first_dense == 0, "no dense first blocks"),
        (sigmoid or m.routed_scaling == 1.0, "routed_scaling 1"),
        (not sigmoid or m.every == 1, "every block MoE after the dense ones"),
    )
    if shared == "gated":
        lacks += _want(
            (m.shared_experts == 1 and m.shared_gate, "one gated shared expert"),
        )
    elif shared == "plain":
        lacks += _want(
            (m.shared_experts >= 1, "shared experts"),
            (not m.shared_gate, "an ungated shared expert"),
            (_shared_hidden(c) == hidden * m.shared_experts, "shared_hidden = hidden × shared"),
        )
    else:
        lacks += _want((m.shared_experts == 0, "no shared experts"))
    return lacks


def _fits(fn: Callable[..., list[str]], **kw: Any) -> Callable[[LlamaConfig], list[str]]:
    rotary = kw.pop("rotary", False)
    llama3 = kw.pop("llama3", False)
    extra = kw.pop("extra", None)

    def fits(c: LlamaConfig) -> list[str]:
        lacks = fn(c, **kw)
        if lacks[:1] == [_OTHER_KIND]:
            return lacks
        return lacks + _common(c, rotary, llama3) + (extra(c) if extra else [])

    return fits


def _SEQ(positions: int, eps: float = 1e-6) -> dict[str, Any]:  # noqa: N802 - a table's row
    return {"max_position_embeddings": positions, "rms_norm_eps": eps}


_QWEN_WINDOW = {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28}
_DEEPSEEK_ROUTER = {
    "moe_intermediate_size": 1408,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
}
_NONE_ALL = ("off", "all")
_NONE_QKV = ("off", "qkv")
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            _read_llama,
            lambda c: {"attention_bias": c.attention_bias == "all", "mlp_bias": False},
            _fits(_fits_dense, bias=_NONE_ALL, qk_norm=False, window=False, llama3=True),
            defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            _read_mistral,
            _write_sliding,
            _fits(_fits_dense, bias=("off",), qk_norm=False, window=True),
            defaults={**_SEQ(131072), "num_key_value_heads": 8, "sliding_window": 4096},
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            _read_qwen2,
            _write_layer_types,
            _fits(_fits_dense, bias=("qkv",), qk_norm=False, window=True),
            defaults={**_SEQ(32768), "num_key_value_heads": 32, **_QWEN_WINDOW},
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            _read_qwen3,
            lambda c: {"attention_bias": c.attention_bias == "all", **_write_layer_types(c)},
            _fits(_fits_dense, bias=_NONE_ALL, qk_norm=True, window=True),
            defaults={**_SEQ(32768), "num_key_value_heads": 32, "head_dim": 128, **_QWEN_WINDOW},
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            _read_mixtral,
            _write_mixtral,
            _fits(
                _fits_router,
                sigmoid=False,
                shared="none",
                qk_norm=False,
                bias=("off",),
                extra=lambda c: _want(
                    (c.moe.norm_topk, "renormalised top-k weights"),
                    (c.moe.every == 1, "every block MoE"),
                ),
            ),
            defaults={
                **_SEQ(131072, eps=1e-5),
                "rope_theta": 1e6,
                "num_key_value_heads": 8,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
            },
            moe_prefix="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            _read_qwen3_moe,
            _write_qwen3_moe,
            _fits(_fits_router, sigmoid=False, shared="none", qk_norm=True, bias=_NONE_ALL),
            defaults={
                **_SEQ(32768),
                "num_key_value_heads": 4,
                "sliding_window": 4096,
                "num_local_experts": 128,
                "num_experts_per_tok": 8,
                "moe_intermediate_size": 768,
            },
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            _read_qwen2_moe,
            _write_qwen2_moe,
            _fits(
                _fits_router,
                sigmoid=False,
                shared="gated",
                qk_norm=False,
                bias=_NONE_QKV,
                extra=lambda c: _want((c.sliding_window is None, "no sliding window")),
            ),
            defaults={
                **_SEQ(32768),
                "num_key_value_heads": 16,
                **_QWEN_WINDOW,
                "num_experts": 60,
                "num_experts_per_tok": 4,
                "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632,
                "qkv_bias": True,
            },
            shared_name="shared_expert",
        ),
        Family(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            _read_glm4_moe,
            _write_glm4_moe,
            _fits(
                _fits_router,
                sigmoid=True,
                shared="plain",
                qk_norm=None,
                bias=_NONE_QKV,
                rotary=True,
                extra=lambda c: _want((c.sliding_window is None, "no sliding window")),
            ),
            defaults={
                **_SEQ(131072, eps=1e-5),
                "num_key_value_heads": 8,
                "partial_rotary_factor": 0.5,
                "n_routed_experts": 128,
                "num_experts_per_tok": 8,
                **_DEEPSEEK_ROUTER,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
                "norm_topk_prob": True,
            },
            router_bias=True,
        ),
        Family(
            "dots1",
            "Dots1ForCausalLM",
            _read_dots1,
            _write_dots1,
            _fits(_fits_router, sigmoid=True, shared="plain", qk_norm=True, bias=_NONE_ALL),
            defaults={
                **_SEQ(2048),
                "num_key_value_heads": 32,
                "sliding_window": 4096,
                "max_window_layers": 62,
                **_DEEPSEEK_ROUTER,
                "first_k_dense_replace": 0,
                "norm_topk_prob": False,
            },
            router_bias=True,
        ),
        Family("deepseek_v3", "DeepseekV3ForCausalLM", _read_deepseek_v3, _nothing),
    )
}


def family_of(d: dict[str, Any]) -> Family:
    """The family of a config.json (by ``model_type``; absent: llama)."""
    kind = d.get("model_type", "llama")
    if kind not in FAMILIES:
        raise FamilyError(
            f"model_type={kind!r} is not a family fivefold reads ({', '.join(FAMILIES)})"
        )
    return FAMILIES[kind]


def read_config(d: dict[str, Any]) -> tuple[LlamaConfig, Family]:
    """An HF ``config.json`` as a `LlamaConfig` and its `Family`; what the model cannot express is
    one `FamilyError` naming every such key, and a value of the wrong type names its key. (Sizes
    are checked by the caller, `check_model_bounds`.)"""
    family = family_of(d)
    d = {**family.defaults, **d}
    k = _Keys(d)
    if d.get("hidden_act", "silu") != "silu":
        k.refuse(f"hidden_act={d.get('hidden_act')!r} (SwiGLU with silu only)")
    if d.get("mlp_bias"):
        k.refuse("mlp_bias=true (the feed-forward has no biases)")
    rope = _rope(k)
    own = family.read(k)
    if k.problems:
        raise FamilyError(
            f"this Hugging Face {family.model_type} model cannot be expressed by fivefold's "
            "model: " + "; ".join(k.problems)
        )
    tie = k.flag("tie_word_embeddings", False)
    heads, dim = k.integer("num_attention_heads"), k.integer("hidden_size")
    head_dim = k.integer("head_dim") if d.get("head_dim") else None
    width = head_dim or (dim // heads if heads > 0 else 0)
    fraction = rope.pop("rotary_fraction", None)
    rotary_dim = None
    if fraction is not None:
        rotary_dim = int(width * fraction)
        if not 0 < rotary_dim < width:
            raise FamilyError(f"partial_rotary_factor={fraction} leaves {rotary_dim} channels")
    config = LlamaConfig(
        vocab_size=k.integer("vocab_size"),
        dim=dim,
        n_layers=k.integer("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=k.integer("num_key_value_heads") if d.get("num_key_value_heads") else heads,
        ffn_hidden=k.integer("intermediate_size"),
        max_seq_len=k.integer("max_position_embeddings", 2048),
        norm_eps=k.number("rms_norm_eps", 1e-6),
        tie_embeddings=tie,
        attention_head_dim=head_dim
        if head_dim and heads > 0 and head_dim != dim // heads
        else None,
        rotary_dim=rotary_dim,
        **rope,
        **own,
    )
    return config, family


def family_for(c: LlamaConfig) -> Family:
    """The first family (in `FAMILIES`' order: the plainest first) that expresses ``c`` exactly
    (export's choice), or a `FamilyError` naming, for each family of the model's kind (dense or
    MoE), the first thing it lacks."""
    tried = []
    for family in FAMILIES.values():
        if family.fits is None:  # read only (deepseek_v3)
            continue
        lacks = family.fits(c)
        if not lacks:
            return family
        if lacks[0] != _OTHER_KIND:
            tried.append(f"{family.model_type}: {lacks[0]}")
    raise FamilyError("no Hugging Face family expresses this model (" + "; ".join(tried) + ")")


def write_config(c: LlamaConfig, family: Family) -> dict[str, Any]:
    """``c`` as ``family``'s config.json (without dtype and token ids: the caller's)."""
    out: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
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
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        **family.write(c),
    }
    # always written: a family's own default may be partial (GLM-4.5's is 0.5)
    fraction = c.rope_dim / c.head_dim
    out["partial_rotary_factor"] = fraction
    out["rope_parameters"]["partial_rotary_factor"] = fraction
    if (
        c.rope_scaling is not None
    ):  # both spellings: transformers < 5 reads rope_scaling, 5 the other
        s = c.rope_scaling
        out["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position,
        }
        out["rope_parameters"] = {
            **out["rope_scaling"],
            "rope_theta": c.rope_theta,
            "partial_rotary_factor": fraction,
        }
    return out


# -- tensor names ----------------------------------------------------------------------------------

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_W = ("w1", "w3", "w2")
_DENSE_FFN = dict(zip(_W, ("gate_proj", "up_proj", "down_proj")))
_BLOCK = [
    (re.compile(r"attention\.w([qkvo])\.(weight|bias)"), r"self_attn.\1_proj.\2"),
    (re.compile(r"attention\.([qk])_norm\.weight"), r"self_attn.\1_norm.weight"),
    (re.compile(r"attention_norm\.weight"), "input_layernorm.weight"),
    (re.compile(r"ffn_norm\.weight"), "post_attention_layernorm.weight"),
]


def hf_tensor_name(name: str, family: Family) -> str | None:
    """fivefold parameter (or persistent buffer) name -> ``family``'s tensor name, or None."""
    if name in _TOP:
        return _TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not m:
        return None
    layer, rest = m.groups()
    base = f"model.layers.{layer}."
    for pattern, template in _BLOCK:
        if pattern.fullmatch(rest):
            return base + pattern.sub(template, rest)
    if ffn := re.fullmatch(r"feed_forward\.(w[123])\.weight", rest):
        return base + f"mlp.{_DENSE_FFN[ffn.group(1)]}.weight"
    moe = base + family.moe_prefix
    expert_names = dict(zip(_W, family.expert_names))
    if e := re.fullmatch(r"feed_forward\.experts\.(\d+)\.(w[123])\.weight", rest):
        return f"{moe}.experts.{e.group(1)}.{expert_names[e.group(2)]}.weight"
    if s := re.fullmatch(r"feed_forward\.shared\.(w[123])\.weight", rest):
        return f"{moe}.{family.shared_name}.{_DENSE_FFN[s.group(1)]}.weight"
    return {
        "feed_forward.router.weight": f"{moe}.gate.weight",
        "feed_forward.expert_bias": f"{moe}.gate.e_score_correction_bias",
        "feed_forward.shared_gate.weight": f"{moe}.shared_expert_gate.weight",
    }.get(rest)
