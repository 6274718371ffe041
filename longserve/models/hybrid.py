"""Hybrid decoders: Qwen3.5 (dense and MoE) and its text part of the vision-language checkpoints, whose layers
are Gated DeltaNet linear attention (models/gated_delta_net.py) or full attention with an output gate, as
`config.layer_types` says (three of four linear in the released models).

Against the shared decoder (models/decoder.py): every RMSNorm's weight is an offset from 1 (zero-centered,
scaled in float32 before the cast), q/k per-head norms and partial rotary (a quarter of each head rotates) on
the attention layers, and only those layers have K/V in the cache: attention layer i of the model is KV layer
`kv_index[i]`, linear-attention layer i its state `state_index[i]` (attention/recurrent_state.py). The norms
are not fused into the projections' epilogues (those kernels scale as Llama does).

The checkpoints: `model.language_model.*` (the vision-language wrapper's text model) or `model.*` (the text
model alone); the vision tower (`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are not used.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from typing import Any

import torch
from torch import nn

from longserve.attention.base import ForwardContext
from longserve.attention.recurrent_state import RecurrentStateSpec
from longserve.models.causal_lm import CausalLM, _map_name
from longserve.models.decoder import (
    ArchOptions,
    Attention,
    AttentionCall,
    MakeMLP,
    dense_mlp,
    get_head_dim,
    layer_by_layer,
)
from longserve.models.gated_delta_net import GatedDeltaNet, LinearAttentionCall
from longserve.models.layers import RMSNorm, VocabParallelEmbedding
from longserve.models.linear_method import get_linear_method
from longserve.models.moe_block import make_moe_mlp, map_expert_name
from longserve.models.rope import RotaryEmbedding, RotaryStep

LINEAR, FULL = "linear_attention", "full_attention"


class HybridDecoderLayer(nn.Module):
    """Norm, token mixer (`self_attn` or `linear_attn`, HF's names), norm, MLP (dense or MoE)."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.attends = isinstance(mixer, Attention)
        if self.attends:
            self.self_attn = mixer
        else:
            self.linear_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, zero_centered=True)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's input, the stream before it: None for the first layer) -> (its MLP's output, the stream):
        each norm first adds the sub-layer before into the stream, vLLM style."""
        hidden, residual = self._input_norm(hidden, residual)
        if self.attends:
            out = self.self_attn(hidden, rope, ctx)  # [T, hidden]
        else:
            out = self.linear_attn(hidden, ctx)  # [T, hidden]
        hidden, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(hidden), residual  # [T, hidden] each

    def _input_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: `hidden` is the embedding, nothing to add
            return self.input_layernorm(hidden), hidden
        return self.input_layernorm(hidden, residual)

    def pieces(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep, ctx: ForwardContext
    ) -> Generator[AttentionCall | LinearAttentionCall, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`forward` with the token mixer proper left to the caller (the attention, or the linear attention's
        conv and delta rule): yields its call and resumes with its output ([T, Hq*D] or [T, Hv*V])."""
        hidden, residual = self._input_norm(hidden, residual)
        if self.attends:
            call = self.self_attn.project(hidden, rope, ctx)
            out = self.self_attn.o_proj(self.self_attn.gated((yield call), call))
        else:
            out = self.linear_attn.out_proj((yield self.linear_attn.project(hidden)))
        hidden, residual = self.post_attention_layernorm(out, residual)
        return self.mlp(hidden), residual  # [T, hidden] each


class HybridDecoderModel(nn.Module):
    def __init__(self, hf_config: Any, opts: ArchOptions, make_mlp: MakeMLP = dense_mlp) -> None:
        super().__init__()
        linear = get_linear_method(hf_config)
        kinds = list(hf_config.layer_types)[: hf_config.num_hidden_layers]
        unknown = sorted(set(kinds) - {LINEAR, FULL})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported; supported: {LINEAR}, {FULL}")
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.kv_index: dict[int, int] = {}  # model layer -> KV-cache layer
        self.state_index: dict[int, int] = {}  # model layer -> recurrent-state layer
        layers = []
        for i, kind in enumerate(kinds):
            if kind == FULL:
                self.kv_index[i] = len(self.kv_index)
                mixer: nn.Module = Attention(hf_config, opts, i, linear, kv_layer=self.kv_index[i])
            else:
                self.state_index[i] = len(self.state_index)
                mixer = GatedDeltaNet(hf_config, self.state_index[i], linear)
            mlp = make_mlp(hf_config, opts, i, linear)
            layers.append(HybridDecoderLayer(mixer, mlp, hf_config.hidden_size, hf_config.rms_norm_eps))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, zero_centered=True)
        self.rotary_emb = RotaryEmbedding.from_config(hf_config, get_head_dim(hf_config))
        self.num_kv_layers = len(self.kv_index)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb.prepare(positions, hidden.dtype)  # shared by the attention layers
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, ctx)  # [T, hidden] each
        if residual is None:
            return self.norm(hidden)
        return self.norm(hidden, residual)[0]  # [T, hidden]

    def pieces(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> Generator[AttentionCall | LinearAttentionCall, torch.Tensor, torch.Tensor]:
        """`forward` with each layer's mixer proper left to the caller (HybridDecoderLayer.pieces): the code
        between two yields is what one piecewise CUDA graph holds. Returns the final hidden [T, hidden]."""
        return layer_by_layer(self, input_ids, positions, ctx, HybridDecoderLayer.pieces)

    def forward_overlapped(
        self, batches: list[tuple[torch.Tensor, torch.Tensor, ForwardContext]]
    ) -> list[torch.Tensor]:
        """Micro-batches one after the other (no overlap yet): the same outputs; a request cut in two continues
        in the second from the state the first left, as the first runs whole before it."""
        return [self(ids, pos, ctx) for ids, pos, ctx in batches]


class Qwen3_5ForCausalLM(CausalLM):
    """Qwen3.5 dense (`Qwen3_5ForConditionalGeneration`'s text model, or `Qwen3_5ForCausalLM`)."""

    decoder_class = HybridDecoderModel
    _vl_layout: bool | None = (
        None  # the checkpoint's text model lies under `model.language_model.` (when known)
    )

    @classmethod
    def arch_options(cls, hf_config: Any) -> ArchOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return ArchOptions(
            qkv_bias=bias, o_bias=bias, qk_norm=True, attn_output_gate=True, zero_centered_norm=True
        )

    def recurrent_states(self) -> tuple[int, RecurrentStateSpec] | None:
        mixers = [layer.linear_attn for layer in self.model.layers if not layer.attends]
        return (len(mixers), mixers[0].state_spec()) if mixers else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name, t) for name, t in weights if not name.startswith(_UNUSED))
        # calibrated fp8 KV scales were read by model layer: the cache numbers only the attention layers
        kv_index = self.model.kv_index
        self.kv_scales = {(kv_index[i], kind): v for (i, kind), v in self.kv_scales.items() if i in kv_index}

    def checkpoint_module_name(self, name: str, tensors: set[str] | None) -> str:
        """Our module's name as the checkpoint spells it: under `model.language_model.` in a vision-language one
        (the quantization config's rules and its companion tensors are named so)."""
        if self._vl_layout is None:
            self._vl_layout = bool(tensors) and any(t.startswith(_VL_PREFIX) for t in tensors)
        return (
            _VL_PREFIX + name.removeprefix("model.")
            if self._vl_layout and name.startswith("model.")
            else name
        )

    def map_weight_name(self, name: str) -> tuple[str, str | None]:
        name = name.replace(_VL_PREFIX, "model.", 1)
        for hf, shard in _ZBA:
            if f".linear_attn.{hf}." in name:
                return name.replace(f".{hf}.", ".in_proj_zba."), shard
        return self._map_rest(name)

    def _map_rest(self, name: str) -> tuple[str, str | None]:
        return _map_name(name)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 MoE (routed experts + a gated shared expert in every layer)."""

    make_mlp = staticmethod(make_moe_mlp)

    def _map_rest(self, name: str) -> tuple[str, str | None]:
        return map_expert_name(name) or _map_name(name)


_VL_PREFIX = "model.language_model."
_UNUSED = ("model.visual.", "mtp.", "model.mtp.")
_ZBA = (("in_proj_z", "z"), ("in_proj_b", "b"), ("in_proj_a", "a"))
