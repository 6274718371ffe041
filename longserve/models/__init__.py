"""Model implementations (Llama, Mistral, Qwen2, Qwen3; the mixtures of experts Qwen2-MoE, Qwen3-MoE and
Mixtral), their registry, the checkpoint loader, and the layers' weight-format methods (linear_method.py,
moe.py: chosen from the checkpoint's quantization_config)."""

from __future__ import annotations

from longserve.models.loader import load_hf_config, load_model, resolve_dtype
from longserve.models.registry import get_model_class

__all__ = ["get_model_class", "load_hf_config", "load_model", "resolve_dtype"]
