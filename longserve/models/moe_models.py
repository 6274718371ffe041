"""Mixture-of-experts architectures on the shared decoder: Qwen3-MoE (Qwen3's attention with q/k RMSNorm),
Qwen2-MoE (Qwen2's q/k/v bias, plus a shared expert) and Mixtral (Mistral's attention, sliding window if
set, top-2 renormalized). Their MLPs come from moe_block.make_moe_mlp (sparse or dense per layer, as the
config's decoder_sparse_step / mlp_only_layers say); the expert tensors load from either checkpoint layout.
"""

from __future__ import annotations

from typing import Any

from longserve.models.causal_lm import CausalLM, _map_name
from longserve.models.decoder import ArchOptions
from longserve.models.moe_block import make_moe_mlp, map_expert_name


class MoECausalLM(CausalLM):
    make_mlp = staticmethod(make_moe_mlp)

    def map_weight_name(self, name: str) -> tuple[str, str | None]:
        """Mixtral's `block_sparse_moe.` is transformers 5's `mlp.`; expert tensors map onto the stacked
        experts (per-expert ones with a shard id "gate:e" / "up:e" / "down:e"); the rest as for dense models
        (the shared expert's gate/up into its fused gate_up_proj)."""
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return map_expert_name(name) or _map_name(name)


class Qwen3MoeForCausalLM(MoECausalLM):
    @classmethod
    def arch_options(cls, hf_config: Any) -> ArchOptions:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchOptions(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)


class Qwen2MoeForCausalLM(MoECausalLM):
    @classmethod
    def arch_options(cls, hf_config: Any) -> ArchOptions:
        return ArchOptions(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)), o_bias=False)


class MixtralForCausalLM(MoECausalLM):
    @classmethod
    def arch_options(cls, hf_config: Any) -> ArchOptions:
        return ArchOptions()
