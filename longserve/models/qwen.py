"""Qwen2 (q/k/v bias, no o_proj bias) and Qwen3 (per-head q/k RMSNorm before RoPE, explicit head_dim)."""

from __future__ import annotations

from typing import Any

from longserve.models.causal_lm import CausalLM
from longserve.models.decoder import ArchOptions


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def arch_options(cls, hf_config: Any) -> ArchOptions:
        return ArchOptions(qkv_bias=True, o_bias=False)


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def arch_options(cls, hf_config: Any) -> ArchOptions:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)
