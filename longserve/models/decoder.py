"""The shared Llama-style decoder (Llama, Mistral, Qwen2, Qwen3) on flattened tokens of a whole step.

Per-architecture differences (biases, per-head q/k RMSNorm, sliding windows) are `ArchOptions` flags read
from the HF config by each architecture's `arch_options`; parameter names mirror HF's (with q/k/v and
gate/up fused, see layers.STACKED_PARAMS) so `load_weights` maps checkpoint names directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from longserve.attention.base import ForwardContext
from longserve.models.layers import MergedLinear, RMSNorm, silu_and_mul
from longserve.models.rope import RotaryEmbedding, RotaryStep


@dataclass(frozen=True)
class ArchOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE


def get_head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def layer_sliding_window(hf_config: Any, layer_id: int) -> int | None:
    """HF semantics: `layer_types` picks sliding layers (Qwen2/3); without it the window applies to all (Mistral)."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_id] == "sliding_attention" else None
    return window


class Attention(nn.Module):
    def __init__(self, hf_config: Any, opts: ArchOptions, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = get_head_dim(hf_config)
        self.scale = self.head_dim**-0.5
        self.sliding_window = layer_sliding_window(hf_config, layer_id)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            hf_config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=opts.qkv_bias
        )
        self.o_proj = nn.Linear(q_size, hf_config.hidden_size, bias=opts.o_bias)
        self.qk_norm = opts.qk_norm
        if opts.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, rope: RotaryStep, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k)  # [T, H*, D]
        out = ctx.backend.forward(
            q,
            k,
            v,
            self.layer_id,
            ctx.meta,
            ctx.kv_cache,
            scale=self.scale,
            sliding_window=self.sliding_window,
        )  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, -1))  # [T, hidden]


class MLP(nn.Module):
    def __init__(self, hf_config: Any, opts: ArchOptions) -> None:
        super().__init__()
        inter = hf_config.intermediate_size
        self.gate_up_proj = MergedLinear(
            hf_config.hidden_size, {"gate": inter, "up": inter}, bias=opts.mlp_bias
        )
        self.down_proj = nn.Linear(inter, hf_config.hidden_size, bias=opts.mlp_bias)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, opts: ArchOptions, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(hf_config, opts, layer_id)
        self.mlp = MLP(hf_config, opts)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(sub-layer output, residual stream) in and out, vLLM style: each norm first adds the previous
        sub-layer's output into the residual (residual=None: `hidden` is the embedding, nothing to add)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden  # [T, hidden] each
        else:
            hidden, residual = self.input_layernorm(hidden, residual)  # [T, hidden] each
        hidden = self.self_attn(hidden, rope, ctx)  # [T, hidden]
        hidden, residual = self.post_attention_layernorm(hidden, residual)  # [T, hidden] each
        return self.mlp(hidden), residual  # [T, hidden] each


class DecoderModel(nn.Module):
    def __init__(self, hf_config: Any, opts: ArchOptions) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, opts, i) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(hf_config, get_head_dim(hf_config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb.prepare(positions, hidden.dtype)  # shared by all layers
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, ctx)  # [T, hidden] each
        if residual is None:
            return self.norm(hidden)  # [T, hidden]
        return self.norm(hidden, residual)[0]  # [T, hidden]


def compute_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, lm_head_weight).float()  # [N, V]
