"""The shared Llama-style decoder (Llama, Mistral, Qwen2, Qwen3, and with MoE blocks Qwen2/3-MoE and Mixtral)
on flattened tokens of a whole step.

Per-architecture differences (biases, per-head q/k RMSNorm, sliding windows) are `ArchOptions` flags read
from the HF config by each architecture's `arch_options`; parameter names mirror HF's (with q/k/v and
gate/up fused, see layers.STACKED_PARAMS) so `load_weights` maps checkpoint names directly.
Under tensor parallelism each rank holds num_heads/tp query heads and its kv heads (`head_layout`), a
1/tp slice of the MLP's intermediate dim, and a vocab slice of the embedding; norms and RoPE replicate.
Every projection uses the linear method of the checkpoint's weight format (`get_linear_method`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from longserve.attention.base import ForwardContext
from longserve.distributed import get_tp_rank, get_tp_size, tp_all_reduce_async
from longserve.kernels.activation_reference import sigmoid_mul_ref
from longserve.models.heads import (  # noqa: F401 - HeadLayout, validate_tp_size: the models' API here too
    HeadLayout,
    get_head_dim,
    head_layout,
    layer_sliding_window,
    validate_tp_size,
)
from longserve.models.layers import (
    MergedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_shard_range,
)
from longserve.models.linear_method import LinearMethod, get_linear_method
from longserve.models.rope import RotaryEmbedding, RotaryStep
from longserve.platform import use_triton


@dataclass(frozen=True)
class ArchOptions:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    # Qwen3.5 / Qwen3-Next: q_proj also yields a gate a head ([q | gate] per head), the attention output is
    # multiplied by its sigmoid before o_proj
    attn_output_gate: bool = False
    # Qwen3.5 / Qwen3-Next: every RMSNorm's weight is an offset from 1 (layers.RMSNorm's zero_centered)
    zero_centered_norm: bool = False


class Attention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        opts: ArchOptions,
        layer_id: int,
        linear: LinearMethod,
        kv_layer: int | None = None,
    ) -> None:
        """`kv_layer`: its K/V's index in the KV cache, where not every layer attends (a hybrid model's); its
        `layer_id` from then on."""
        super().__init__()
        self.layer_id = layer_id if kv_layer is None else kv_layer
        total_heads = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or total_heads
        layout = head_layout(total_heads, total_kv_heads, get_tp_size(), get_tp_rank())
        self.num_heads, self.num_kv_heads = layout.num_q, layout.num_kv  # this rank's heads
        self.head_dim = d = get_head_dim(hf_config)
        self.scale = self.head_dim**-0.5
        self.sliding_window = layer_sliding_window(hf_config, layer_id)
        self.output_gate = opts.attn_output_gate
        qd = 2 * d if self.output_gate else d  # q_proj's rows a head: [q | gate] with the output gate
        q_size, kv_size = self.num_heads * qd, self.num_kv_heads * d
        self.qkv_proj = MergedLinear(
            hf_config.hidden_size,
            {"q": q_size, "k": kv_size, "v": kv_size},
            bias=opts.qkv_bias,
            shard_starts={"q": layout.q_start * qd, "k": layout.kv_start * d, "v": layout.kv_start * d},
            full_shard_sizes={"q": total_heads * qd, "k": total_kv_heads * d, "v": total_kv_heads * d},
            quant_method=linear,
        )
        self.o_proj = RowParallelLinear(
            total_heads * d, hf_config.hidden_size, bias=opts.o_bias, quant_method=linear
        )
        self.qk_norm = opts.qk_norm
        if opts.qk_norm:
            zero_centered = opts.zero_centered_norm
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, zero_centered=zero_centered)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps, zero_centered=zero_centered)

    def forward(self, hidden: torch.Tensor, rope: RotaryStep, ctx: ForwardContext) -> torch.Tensor:
        return self.o_proj(self.attend(hidden, rope, ctx))  # [T, hidden]

    def attend(self, hidden: torch.Tensor, rope: RotaryStep, ctx: ForwardContext) -> torch.Tensor:
        """Everything before o_proj: the attention output [T, Hq*D] of this rank's heads (gated, if so)."""
        call = self.project(hidden, rope, ctx)
        return self.gated(call.run(ctx), call)

    def gated(self, out: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """The attention output [T, Hq*D] times the sigmoid of its gate (the output gate), in the model dtype as
        transformers; unchanged without one. On CUDA one kernel multiplying `out` in place, reading the gate where
        it lies in q_proj's output."""
        if call.gate is None:
            return out
        heads = out.view(out.shape[0], self.num_heads, self.head_dim)  # [T, Hq, D]
        if use_triton(out) and out.is_contiguous():
            from longserve.kernels.activation import sigmoid_mul  # imports triton

            return sigmoid_mul(heads, call.gate).view_as(out)
        return sigmoid_mul_ref(heads, call.gate).view_as(out)

    def project(self, hidden: torch.Tensor, rope: RotaryStep, ctx: ForwardContext) -> AttentionCall:
        """The projections and rotary embedding before the attention proper (the new K/V may be stored)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))  # [T, Hq*D (2D gated)], [T, Hkv*D], [T, Hkv*D]
        gate = None
        if self.output_gate:
            qg = q.view(num_tokens, self.num_heads, 2 * self.head_dim)  # [T, Hq, 2D]: [q | gate] a head
            # both in place, no copy: the rotary kernel and the attention kernels read q by its token and head
            # strides (the library calls reshape it, a copy where they need one); Attention.gated reads the gate
            q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]  # [T, Hq, D] each
        q = q.view(num_tokens, self.num_heads, self.head_dim) if gate is None else q  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        # [T, H*, D]; the fused rotary kernel may also apply the q/k norms, store the new K/V in the cache and write
        # q where the backend reads it (q_destination)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        q_dst = ctx.backend.q_destination(num_tokens)
        rotated = rope.apply_and_store(
            q, k, v, ctx.kv_cache, self.layer_id, ctx.meta.slot_mapping, norms, q_dst
        )
        return AttentionCall(self, rotated.q, rotated.k, v, rotated.kv_stored, rotated.q_placed, gate)


class AttentionCall(NamedTuple):
    """One layer's attention proper over q [T, Hq, D], k/v [T, Hkv, D] (`stored`: the new K/V are in the
    cache already; `q_placed`: q is in the backend's `q_destination` too): what the piecewise CUDA graphs
    (runner/piecewise_graph.py) run eagerly between them."""

    attn: Attention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    stored: bool
    q_placed: bool = False
    gate: torch.Tensor | None = None  # [T, Hq, D]: the output gate's (Attention.gated), applied by the layer

    def run(self, ctx: ForwardContext) -> torch.Tensor:
        """The backend's attention over ctx's step: [T, Hq*D]."""
        out = ctx.backend.forward(
            self.q,
            self.k,
            self.v,
            self.attn.layer_id,
            ctx.meta,
            ctx.kv_cache,
            scale=self.attn.scale,
            sliding_window=self.attn.sliding_window,
            kv_stored=self.stored,
            q_placed=self.q_placed,
        )  # [T, Hq, D]
        return out.reshape(self.q.shape[0], -1)  # [T, Hq*D]


class MLP(nn.Module):
    """SiLU-gated MLP of `intermediate_size` (default: the config's), split over the tp ranks."""

    def __init__(
        self, hf_config: Any, opts: ArchOptions, linear: LinearMethod, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        full = intermediate_size or hf_config.intermediate_size
        start, inter = tp_shard_range(full, get_tp_size(), get_tp_rank(), "intermediate_size")
        self.gate_up_proj = MergedLinear(
            hf_config.hidden_size,
            {"gate": inter, "up": inter},
            bias=opts.mlp_bias,
            shard_starts={"gate": start, "up": start},
            full_shard_sizes={"gate": full, "up": full},
            quant_method=linear,
        )
        self.down_proj = RowParallelLinear(
            full, hf_config.hidden_size, bias=opts.mlp_bias, quant_method=linear
        )
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: silu")

    def _down_input(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The down projection's input and whether it is gate|up [T, 2I] (gated: silu(gate) * up is made on the
        way in) or already the product [T, I] (the gate/up GEMM's own epilogue: linear_method.apply_swiglu)."""
        act = self.gate_up_proj.swiglu(x)
        return (self.gate_up_proj(x), True) if act is None else (act, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gated = self._down_input(x)
        return self.down_proj(h, gated=gated)  # of silu(gate) * up: [T, hidden]

    def then_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`norm(self(x), residual)`, the add and norm in the down projection's kernel where it can (then_norm)."""
        h, gated = self._down_input(x)
        return self.down_proj.then_norm(h, residual, norm, gated=gated)  # [T, hidden] each

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        h, gated = self._down_input(x)
        return self.down_proj.partial(h, gated=gated)  # [T, hidden], not reduced

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The all-reduced `partial` -> the output (the bias added once)."""
        return self.down_proj.finish(y)


# builds layer `layer_id`'s MLP: the dense MLP, or an MoE block (models/moe_block.py); it has `forward`,
# and for micro-batch overlap `partial` (before its one all-reduce) and `finish` (after it)
MakeMLP = Callable[[Any, ArchOptions, int, LinearMethod], nn.Module]


def dense_mlp(hf_config: Any, opts: ArchOptions, layer_id: int, linear: LinearMethod) -> nn.Module:
    return MLP(hf_config, opts, linear)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        opts: ArchOptions,
        layer_id: int,
        linear: LinearMethod,
        make_mlp: MakeMLP = dense_mlp,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(hf_config, opts, layer_id, linear)
        self.mlp = make_mlp(hf_config, opts, layer_id, linear)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        rope: RotaryStep,
        ctx: ForwardContext,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's input already normed (`hidden`, and `residual` the stream it was normed from) to the output of
        `next_norm` (the next layer's input norm, or the model's final norm) and the stream, vLLM style: each norm
        first adds the previous sub-layer's output into the residual. The o and down projections' kernels do the
        add and norm where their methods can (RowParallelLinear.then_norm: one row, no tensor parallelism)."""
        out = self.self_attn.attend(hidden, rope, ctx)  # [T, Hq*D]
        hidden, residual = self.self_attn.o_proj.then_norm(out, residual, self.post_attention_layernorm)
        if isinstance(self.mlp, MLP):
            return self.mlp.then_norm(hidden, residual, next_norm)  # [T, hidden] each
        return next_norm(self.mlp(hidden), residual)  # type: ignore[return-value]

    def input_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm's output and the stream (residual None: `hidden` is the embedding, nothing to add)."""
        if residual is None:
            return self.input_layernorm(hidden), hidden  # [T, hidden] each
        return self.input_layernorm(hidden, residual)  # [T, hidden] each

    def pieces(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep, ctx: ForwardContext
    ) -> Generator[AttentionCall, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`forward` with the attention proper left to the caller: yields the layer's AttentionCall and
        resumes with its output [T, Hq*D]."""
        hidden, residual = self.input_norm(hidden, residual)
        call = self.self_attn.project(hidden, rope, ctx)
        out = yield call
        out = self.self_attn.gated(out, call)
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(out), residual)
        return self.mlp(hidden), residual  # [T, hidden] each

    def steps(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, rope: RotaryStep, ctx: ForwardContext
    ) -> Generator[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`forward` as a generator for micro-batch overlap: it yields each row-parallel partial sum
        (o_proj's, down_proj's) and resumes with the same tensor summed over the ranks."""
        hidden, residual = self.input_norm(hidden, residual)
        hidden = yield self.self_attn.o_proj.partial(self.self_attn.attend(hidden, rope, ctx))
        hidden = self.self_attn.o_proj.finish(hidden)  # [T, hidden]
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = yield self.mlp.partial(hidden)
        return self.mlp.finish(hidden), residual  # [T, hidden] each


class DecoderModel(nn.Module):
    def __init__(self, hf_config: Any, opts: ArchOptions, make_mlp: MakeMLP = dense_mlp) -> None:
        super().__init__()
        linear = get_linear_method(hf_config)  # the checkpoint's weight format, shared by every projection
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(hf_config, opts, i, linear, make_mlp) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(hf_config, get_head_dim(hf_config))
        self.num_kv_layers = hf_config.num_hidden_layers  # every layer attends

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary_emb.prepare(positions, hidden.dtype)  # shared by all layers
        if not self.layers:
            return self.norm(hidden)  # [T, hidden]
        # each layer takes its input normed and hands on the next norm's output (DecoderLayer.forward)
        hidden, residual = self.layers[0].input_norm(hidden, None)  # [T, hidden] each
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            hidden, residual = layer(hidden, residual, rope, ctx, after)  # [T, hidden] each
        return hidden  # [T, hidden]: the final norm's output

    def forward_overlapped(
        self, batches: list[tuple[torch.Tensor, torch.Tensor, ForwardContext]]
    ) -> list[torch.Tensor]:
        """Micro-batches of one step, layer by layer in turn, so that the all-reduce of one runs while
        the other computes (tensor parallelism): per layer, batch 0's attention, then batch 1's (which
        may attend to batch 0's keys of this layer: they are stored by then), then their MLPs.

            GPU:   A.attn | B.attn   | A.mlp    | B.mlp    | A.attn ...
            NCCL:         | A.reduce | B.reduce | A.reduce | B.reduce ...
        """
        gens = [self._steps(ids, pos, ctx) for ids, pos, ctx in batches]
        pending: list[tuple[torch.Tensor, Any] | None] = [None] * len(gens)
        results: list[torch.Tensor | None] = [None] * len(gens)

        def advance(i: int, reduced: torch.Tensor | None) -> None:
            try:
                partial = next(gens[i]) if reduced is None else gens[i].send(reduced)
            except StopIteration as stop:
                results[i], pending[i] = stop.value, None
                return
            pending[i] = (partial, tp_all_reduce_async(partial))

        for i in range(len(gens)):
            advance(i, None)
        while any(p is not None for p in pending):
            for i, p in enumerate(pending):
                if p is not None:
                    partial, work = p
                    if work is not None:
                        work.wait()
                    advance(i, partial)
        return results  # type: ignore[return-value]

    def pieces(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> Generator[AttentionCall, torch.Tensor, torch.Tensor]:
        """`forward` with each layer's attention proper left to the caller (DecoderLayer.pieces): the code
        between two yields is what one piecewise CUDA graph holds. Returns the final hidden [T, hidden]."""
        return layer_by_layer(self, input_ids, positions, ctx, DecoderLayer.pieces)

    def _steps(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> Generator[torch.Tensor, torch.Tensor, torch.Tensor]:
        return layer_by_layer(self, input_ids, positions, ctx, DecoderLayer.steps)


def layer_by_layer(
    model: nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    ctx: ForwardContext,
    per_layer: Callable,
) -> Generator[Any, torch.Tensor, torch.Tensor]:
    """A decoder's (embed_tokens, rotary_emb, layers, norm) `forward` through a generator of each layer (its
    layers' `pieces` or `steps`), whose yields pass through to the caller. Returns the final hidden [T, hidden]."""
    hidden = model.embed_tokens(input_ids)  # [T, hidden]
    rope = model.rotary_emb.prepare(positions, hidden.dtype)
    residual = None
    for layer in model.layers:
        hidden, residual = yield from per_layer(layer, hidden, residual, rope, ctx)
    if residual is None:
        return model.norm(hidden)
    return model.norm(hidden, residual)[0]  # [T, hidden]
