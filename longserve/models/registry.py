"""HF architecture name -> model class, imported lazily so unused models cost nothing at import."""

from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("longserve.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("longserve.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("longserve.models.qwen", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("longserve.models.qwen", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("longserve.models.moe_models", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("longserve.models.moe_models", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("longserve.models.moe_models", "MixtralForCausalLM"),
    # hybrid linear/full attention; the vision-language checkpoints serve their text model (loader.text_part)
    "Qwen3_5ForCausalLM": ("longserve.models.hybrid", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("longserve.models.hybrid", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("longserve.models.hybrid", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("longserve.models.hybrid", "Qwen3_5MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("longserve.models.qwen3_next", "Qwen3NextForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """Return the class of the first supported name in `architectures` (config.json's list)."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    shown = ", ".join(repr(a) for a in architectures or []) or "(none listed in config.json)"
    raise ValueError(
        f"architecture {shown} is not supported; supported: {', '.join(supported_architectures())}"
    )
