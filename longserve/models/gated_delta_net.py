"""The Gated DeltaNet token mixer of Qwen3.5 / Qwen3-Next's linear-attention layers, on a step's flattened tokens.

Per layer (transformers' `Qwen3_5MoeGatedDeltaNet`, whose parameter names these mirror):

    x ─ in_proj_qkv ─ causal conv (width W, silu) ─ q | k | v ─┐
      ├ in_proj_a, in_proj_b ─ g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) ─ gated delta rule
      └ in_proj_z ─────────────────────────────── gated RMSNorm(out, z) ─ out_proj ─ y

The conv's last W-1 inputs and the delta rule's [value heads, K, V] state are a request's whole past: they live in
slot `meta.state_slots[r]` of `ctx.states` (attention/recurrent_state.py); a request whose prefix length is 0
starts from zero, any later chunk or decode continues its slot. Steps whose every request decodes one token
past a non-empty history take the one-token kernels; any other step (prompts, chunks, a mix with decodes) the
chunked ones, which treat a decode as a sequence of one.

Tensor parallelism splits the key and value heads (a value head reads key head h // (Hv / Hk): consecutive
value heads share one, so a rank's value heads read only its own key heads); out_proj is row-parallel.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

from longserve.attention.base import ForwardContext
from longserve.attention.recurrent_state import RecurrentStateSpec
from longserve.distributed import get_tp_rank, get_tp_size
from longserve.kernels.causal_conv1d_reference import causal_conv1d_decode_ref, causal_conv1d_prefill_ref
from longserve.kernels.gated_delta_reference import (
    CHUNK,
    gated_delta_decode_gating_ref,
    gated_delta_decode_ref,
    gated_delta_prefill_ref,
    gdn_gating_ref,
)
from longserve.kernels.gated_norm_reference import gated_rms_norm_ref
from longserve.models.layers import MergedLinear, RowParallelLinear, TensorLike, as_tensor, tp_shard_range
from longserve.models.linear_method import (
    LinearMethod,
    StacksInputs,
    is_plain,
    plain_linear,
    stack_plain_weights,
)
from longserve.models.quant.layout import check_dtype, tensor_name
from longserve.platform import host_to_device, use_triton

# A decode step's gating (g, beta) computed inside the delta rule's decode kernel (kernels/gated_delta.py
# `gated_delta_decode_gating`), as vLLM's fused decode does: one launch a linear-attention layer fewer (30 a step
# of Qwen3.5-35B-A3B). On: with STACKED_PROJECTIONS and moe_block.FUSED_SHARED_GATE the seed's decode b1@32K went
# 4.53 -> 3.98 ms, b64@4K 15.99 -> 15.37 (H100, `gpu_check.sh seed-decode`, RESULTS.md forty-ninth session). Read at
# each call.
FUSED_DECODE_GATING = True
# in_proj_qkv and in_proj_zba as one GEMM over their stacked weights (`GatedDeltaNet.stack_inputs`, where both are
# plain): one launch a layer fewer at every step (30 a decode step of Qwen3.5-35B-A3B). On (measured with
# FUSED_DECODE_GATING, above). Read at each call.
STACKED_PROJECTIONS = True


class GatedDeltaNet(nn.Module, StacksInputs):
    """One linear-attention layer's mixer; `state_id` is its index among the model's linear-attention layers."""

    def __init__(self, hf_config: Any, state_id: int, linear: LinearMethod) -> None:
        super().__init__()
        self.state_id = state_id
        tp, rank = get_tp_size(), get_tp_rank()
        hk, hv = hf_config.linear_num_key_heads, hf_config.linear_num_value_heads
        self.k_dim, self.v_dim = hf_config.linear_key_head_dim, hf_config.linear_value_head_dim
        if hv % hk:
            raise ValueError(f"linear_num_value_heads={hv} is not a multiple of linear_num_key_heads={hk}")
        k_start, self.num_k_heads = tp_shard_range(hk, tp, rank, "linear_num_key_heads")
        v_start, self.num_v_heads = tp_shard_range(hv, tp, rank, "linear_num_value_heads")
        self.conv_width = hf_config.linear_conv_kernel_dim
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported; supported: silu")
        key, value = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim  # this rank's widths
        self.key_size, self.value_size = key, value
        # q | k | v: one checkpoint tensor (`in_proj_qkv`), each part sliced to this rank's heads
        starts = {"q": k_start * self.k_dim, "k": k_start * self.k_dim, "v": v_start * self.v_dim}
        full = {"q": hk * self.k_dim, "k": hk * self.k_dim, "v": hv * self.v_dim}
        self.in_proj_qkv = MergedLinear(
            hf_config.hidden_size, {"q": key, "k": key, "v": value}, bias=False,
            shard_starts=starts, full_shard_sizes=full, quant_method=linear,
        )  # fmt: skip
        # z | b | a: three checkpoint tensors (`in_proj_z`, `in_proj_b`, `in_proj_a`) in one product
        self.in_proj_zba = MergedLinear(
            hf_config.hidden_size,
            {"z": value, "b": self.num_v_heads, "a": self.num_v_heads},
            bias=False,
            shard_starts={"z": v_start * self.v_dim, "b": v_start, "a": v_start},
            full_shard_sizes={"z": hv * self.v_dim, "b": hv, "a": hv},
            quant_method=linear,
        )
        self._conv_rows = [(0, k_start * self.k_dim, key), (hk * self.k_dim, k_start * self.k_dim, key),
                           (2 * hk * self.k_dim, v_start * self.v_dim, value)]  # fmt: skip
        self.conv_dim = 2 * key + value
        self.full_conv_dim, self.full_v_heads = 2 * hk * self.k_dim + hv * self.v_dim, hv  # the checkpoint's
        # the checkpoint's depthwise conv `conv1d.weight` [D, 1, W]; held as [D_rank, W]
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_width))
        self.conv1d.weight.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.conv1d.weight.full_shape = (self.full_conv_dim, 1, self.conv_width)  # type: ignore[attr-defined]
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        for p in (self.dt_bias, self.A_log):
            p.weight_loader = self._load_heads  # type: ignore[attr-defined]
            p.full_shape = (hv,)  # type: ignore[attr-defined]
        self._v_start = v_start
        self.norm = nn.Module()  # the gated RMSNorm over a value head: `norm.weight` [V]
        self.norm.weight = nn.Parameter(torch.empty(self.v_dim))
        self.norm_eps = hf_config.rms_norm_eps
        self.out_proj = RowParallelLinear(
            hv * self.v_dim, hf_config.hidden_size, bias=False, quant_method=linear
        )
        self.stacked_inputs: torch.Tensor | None = None  # in_proj_qkv | in_proj_zba (stack_inputs)

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec.for_heads(
            self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim, self.conv_width
        )

    def _load_conv(self, param: nn.Parameter, loaded: TensorLike, shard_id: str | None = None) -> None:
        """conv1d.weight [D, 1, W] of every head -> this rank's q, k and v channels [D_rank, W]."""
        check_dtype(param, loaded)
        if tuple(loaded.shape) != (self.full_conv_dim, 1, self.conv_width):
            raise ValueError(
                f"{tensor_name(loaded)}: expected shape {(self.full_conv_dim, 1, self.conv_width)}, got "
                f"{tuple(loaded.shape)}"
            )
        parts = [as_tensor(loaded.narrow(0, base + start, size)) for base, start, size in self._conv_rows]
        param.data.copy_(torch.cat(parts).reshape(param.shape))

    def _load_heads(self, param: nn.Parameter, loaded: TensorLike, shard_id: str | None = None) -> None:
        """dt_bias, A_log [Hv] -> this rank's value heads."""
        check_dtype(param, loaded)
        if tuple(loaded.shape) != (self.full_v_heads,):
            raise ValueError(
                f"{tensor_name(loaded)}: expected shape ({self.full_v_heads},), got {tuple(loaded.shape)}"
            )
        param.data.copy_(as_tensor(loaded.narrow(0, self._v_start, self.num_v_heads)))

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.out_proj(self.project(hidden).run(ctx))  # [T, hidden]

    def stack_inputs(self) -> bool:
        """After loading: in_proj_qkv's and in_proj_zba's weights as views of one stacked tensor [D + Z, H] where
        both are plain (the official GPTQ checkpoints keep linear attention bf16), so `project` makes both in one
        GEMM; False: not so."""
        if not (is_plain(self.in_proj_qkv) and is_plain(self.in_proj_zba)):
            return False
        self.stacked_inputs = stack_plain_weights([self.in_proj_qkv.weight, self.in_proj_zba.weight])
        return self.stacked_inputs is not None

    def project(self, hidden: torch.Tensor) -> LinearAttentionCall:
        """The input projections (qkv [T, D], zba [T, Z]), which read no state: what a piecewise CUDA graph holds
        before the mixer. One GEMM over the stacked weights where they are (STACKED_PROJECTIONS): qkv and zba
        are then column ranges of its output (the mixer's kernels take row strides)."""
        if self.stacked_inputs is not None and STACKED_PROJECTIONS:
            y = plain_linear(hidden, self.stacked_inputs)  # [T, D + Z]
            return LinearAttentionCall(self, (y[:, : self.conv_dim], y[:, self.conv_dim :]))
        return LinearAttentionCall(self, (self.in_proj_qkv(hidden), self.in_proj_zba(hidden)))

    def mix(self, qkv: torch.Tensor, zba: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The mixer proper over the step's tokens (each request's conv and delta-rule state read and written):
        the gated norm's output [T, Hv*V], before out_proj."""
        meta, states = ctx.meta, ctx.states
        assert states is not None and meta.state_slots is not None, (
            "a hybrid model's step needs its state slots"
        )
        t = qkv.shape[0]
        conv_state, ssm_state = states.conv[self.state_id], states.ssm[self.state_id]
        slots = meta.state_slots  # [B]
        z, b, a = self.in_proj_zba.split(zba)  # [T, Hv*V], [T, Hv], [T, Hv]
        fast = use_triton(qkv)
        # one token a request, each continuing a history: the one-token kernels (host lists: no sync)
        decode = meta.max_query_len == 1 and meta.continues_every_request
        if decode:
            conv = _kernel(fast, "causal_conv1d", "causal_conv1d_decode", causal_conv1d_decode_ref)
            mixed = conv(qkv, self.conv1d.weight, conv_state, slots)  # [B, D]
        else:
            has_state = meta.per_step(("has_state",), lambda: meta.prefix_lens > 0)  # [B] bool
            conv = _kernel(fast, "causal_conv1d", "causal_conv1d_prefill", causal_conv1d_prefill_ref)
            mixed = conv(
                qkv, self.conv1d.weight, conv_state, meta.query_start_loc, slots, has_state
            )  # [T, D]
        saves = None
        if meta.state_mid_saves and not decode:  # checkpoints inside the step: the conv's inputs before them
            *saves, conv_rows, conv_dst = meta.per_step(
                ("gdn_saves",), lambda: _mid_saves(meta, self.conv_width, qkv.device)
            )
            conv_state.index_copy_(
                0, conv_dst, qkv[conv_rows].view(-1, *conv_state.shape[1:]).to(conv_state.dtype)
            )
        q, k, v = mixed.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = q.view(t, self.num_k_heads, self.k_dim)  # [T, Hk, K]
        k = k.view(t, self.num_k_heads, self.k_dim)  # [T, Hk, K]
        v = v.view(t, self.num_v_heads, self.v_dim)  # [T, Hv, V]
        if decode:
            out = self._decode_rule(q, k, v, a, b, ssm_state, slots, fast)  # [B, Hv, V]
        else:
            g, beta = self._gating(a, b, fast)  # [T, Hv] each
            rule = _kernel(fast, "gated_delta", "gated_delta_prefill", gated_delta_prefill_ref)
            # the step's chunks, once a step for every layer (kernels/gated_delta_chunk.py `chunk_map`)
            chunks = (
                meta.per_step(("gdn_chunks",), lambda: _chunk_map(meta.query_start_loc, t)) if fast else None
            )
            qsl = meta.query_start_loc
            out = rule(
                q, k, v, g, beta, ssm_state, qsl, slots, has_state, chunks=chunks, saves=saves
            )  # [T, Hv, V]
        norm = _kernel(fast, "gated_norm", "gated_rms_norm", gated_rms_norm_ref)
        # [T, Hv, V] each: z read where it lies in the projection's output (the kernel takes its strides)
        out = norm(out, z.view(t, self.num_v_heads, self.v_dim), self.norm.weight, self.norm_eps)
        return out.view(t, self.value_size)  # [T, Hv*V]

    def _gating(self, a: torch.Tensor, b: torch.Tensor, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(g [T, Hv] float32, beta [T, Hv]) of the layer's a and b."""
        return _kernel(fast, "gated_delta", "gdn_gating", gdn_gating_ref)(a, b, self.A_log, self.dt_bias)

    def _decode_rule(self, q, k, v, a, b, ssm_state, slots, fast: bool) -> torch.Tensor:
        """One token a request: the recurrent rule, gated inside its kernel (FUSED_DECODE_GATING) or after the
        gating's own launch."""
        if FUSED_DECODE_GATING:
            rule = _kernel(fast, "gated_delta", "gated_delta_decode_gating", gated_delta_decode_gating_ref)
            return rule(q, k, v, a, b, self.A_log, self.dt_bias, ssm_state, slots)
        rule = _kernel(fast, "gated_delta", "gated_delta_decode", gated_delta_decode_ref)
        return rule(q, k, v, *self._gating(a, b, fast), ssm_state, slots)


class LinearAttentionCall(NamedTuple):
    """One linear-attention layer's mixer over its projections `inputs` (qkv [T, D], zba [T, Z]): what the
    piecewise CUDA graphs (runner/piecewise_graph.py) run eagerly between them, over a step's real rows only (a
    padding row would be folded into a request's state)."""

    mixer: GatedDeltaNet
    inputs: tuple[torch.Tensor, torch.Tensor]

    @property
    def out_width(self) -> int:
        return self.mixer.value_size

    def rows(self, n: int) -> LinearAttentionCall:
        """The call over the first n rows of its inputs."""
        return self._replace(inputs=tuple(x[:n] for x in self.inputs))

    def run(self, ctx: ForwardContext) -> torch.Tensor:
        """The mixer over ctx's step: [T, Hv*V]."""
        return self.mixer.mix(*self.inputs, ctx)


def _mid_saves(meta: Any, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A step's states saved inside it (AttentionMetadata.state_mid_saves) as the chunked rule's `saves`
    (save_chunk [B] int32, save_row [B] int64) and the conv's: the step rows of each saved state's last W-1
    inputs [N * (W-1)] and their state rows [N]."""
    num_reqs, starts = meta.num_reqs, [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    save_chunk, save_row, conv_rows, conv_dst = [-1] * num_reqs, [0] * num_reqs, [], []
    for r, tokens, row in meta.state_mid_saves:
        assert tokens % CHUNK == 0 and width - 1 <= tokens < meta.query_lens_cpu[r], (
            f"a state saved after {tokens} of {meta.query_lens_cpu[r]} new tokens: not on a chunk inside the step"
        )
        save_chunk[r], save_row[r] = tokens // CHUNK, row
        conv_rows.extend(range(starts[r] + tokens - (width - 1), starts[r] + tokens))
        conv_dst.append(row)
    return (
        host_to_device(save_chunk, torch.int32, device),
        *(host_to_device(x, torch.int64, device) for x in (save_row, conv_rows, conv_dst)),
    )


def _chunk_map(query_start_loc: torch.Tensor, num_tokens: int) -> Any:
    """The Triton prefill's chunk numbering of a step (imported on first use, as the kernels)."""
    return _kernel_module("gated_delta_chunk").chunk_map(query_start_loc, num_tokens)


def _kernel(fast: bool, module: str, name: str, reference: Any) -> Any:
    """The Triton kernel `longserve.kernels.<module>.<name>` on CUDA, else its torch reference."""
    return getattr(_kernel_module(module), name) if fast else reference


@functools.cache
def _kernel_module(module: str) -> ModuleType:
    """Imported on first use (it imports triton), then a cached lookup: every layer asks each step."""
    return importlib.import_module(f"longserve.kernels.{module}")
