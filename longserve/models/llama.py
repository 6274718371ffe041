"""Llama (incl. Llama 3.1 rope scaling) and Mistral: the shared decoder with optional biases.

Mistral differs only by its `sliding_window`, which the decoder reads from the config for every layer.
"""

from __future__ import annotations

from typing import Any

from longserve.models.causal_lm import CausalLM
from longserve.models.decoder import ArchOptions


class LlamaForCausalLM(CausalLM):
    @classmethod
    def arch_options(cls, hf_config: Any) -> ArchOptions:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        )


class MistralForCausalLM(LlamaForCausalLM):
    pass
