"""Model definitions (parallelism-free); parallel plans address their modules by name."""

from fivefold.models.llama import PRESETS, Llama, LlamaConfig, build_model, count_params, get_config

__all__ = ["PRESETS", "Llama", "LlamaConfig", "build_model", "count_params", "get_config"]
