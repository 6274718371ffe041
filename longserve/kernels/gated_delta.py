"""Gated DeltaNet kernels (Qwen3-Next / Qwen3.5 linear attention) in Triton, for flattened varlen steps over a
state pool; references in gated_delta_reference.py (the math, the pool and slot conventions), the conv in
causal_conv1d.py, the gated output norm in gated_norm.py.

- `gdn_gating`: g = -exp(A_log) softplus(a + dt_bias) (float32) and beta = sigmoid(b) (b's dtype, as HF's
  `b.sigmoid()`), one elementwise pass over [T, Hv]; grid (token blocks,).
- `gated_delta_prefill`: the chunked algorithm, in gated_delta_chunk.py (its docstring: layout, and what FLA does
  that it does not yet).
- `gated_delta_decode`: one token a request, the recurrent rule. Grid (requests, value heads, V blocks): each
  program holds its state block [K, BLOCK_V] in float32 registers, read once from states[slot] and written back
  once, q / k (l2-normalized in float32, GQA head h // (Hv // Hk)) and the token's v block loaded beside it;
  BLOCK_V = 32 gives B * Hv * 4 programs at V = 128 (a batch of 1 still fills 128 SMs at Hv = 32) and 32 state
  values a thread at 4 warps. Decode is a read and a write of the state (64 KiB a head in float32): memory-bound,
  so nothing is recomputed across programs but the q/k norms (K values). Slot -1: zero state, nothing written.
  `gated_delta_decode_gating` computes the gating inside the decode kernel (each program its head's g and beta),
  as vLLM's fused decode does: the model's decode steps take it (models/gated_delta_net.py).

Not yet (against FLA's `fused_recurrent_gated_delta_rule` and vLLM's fused decode, not yet timed beside them;
on an H100 a decode step's delta rule took 0.044 ms at batch 1 and 0.080 ms at 64, eager, bf16 states): decode
takes one token a request (no multi-token verify for speculative decoding, no intermediate states kept).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.gated_delta_chunk import gated_delta_prefill
from longserve.kernels.gated_delta_reference import (
    gated_delta_decode_gating_ref,
    gated_delta_decode_ref,
    gated_delta_prefill_ref,
    gdn_gating_ref,
)
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl

__all__ = [
    "gated_delta_decode",
    "gated_delta_decode_gating",
    "gated_delta_decode_gating_ref",
    "gated_delta_decode_ref",
    "gated_delta_prefill",
    "gated_delta_prefill_ref",
    "gdn_gating",
    "gdn_gating_ref",
]

_DECODE_BLOCK_V = 32


@triton.jit
def _decay(a, dt_bias, a_log):
    """g = -exp(A_log) softplus(a + dt_bias), all float32: softplus as torch's (threshold 20), and
    log1p(y) = log(1+y) * y / ((1+y) - 1), exact where 1+y rounds."""
    x = a + dt_bias
    y = tl.exp(tl.minimum(x, 20.0))
    one_y = 1.0 + y
    log1p = tl.where(one_y == 1.0, y, tl.log(one_y) * (y / (one_y - 1.0)))
    return -tl.exp(a_log) * tl.where(x > 20.0, x, log1p)


@fast_launch
@triton.jit
def _gdn_gating_kernel(
    a_ptr,  # [T, H]
    b_ptr,  # [T, H]
    a_log_ptr,  # [H]
    dt_bias_ptr,  # [H]
    g_ptr,  # out [T, H] float32
    beta_ptr,  # out [T, H] in b's dtype
    num_tokens,
    heads,
    stride_a,
    stride_b,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < heads
    # weights: loaded before the wait (no kernel of the step writes them)
    a_log = tl.load(a_log_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    pdl_prologue(USE_PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = (rows[:, None] < num_tokens) & col_ok[None, :]  # [BLOCK_T, BLOCK_H]
    x = tl.load(a_ptr + rows[:, None] * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = _decay(x, dt_bias[None, :], a_log[None, :])
    tl.store(g_ptr + rows[:, None] * heads + cols[None, :], g, mask=mask)
    b = tl.load(b_ptr + rows[:, None] * stride_b + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(
        beta_ptr + rows[:, None] * heads + cols[None, :],
        tl.sigmoid(b).to(beta_ptr.dtype.element_ty),
        mask=mask,
    )


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b [T, H] (unit stride along H), A_log, dt_bias [H] -> (g [T, H] float32, beta [T, H] in b's dtype);
    same math as `gdn_gating_ref`."""
    num_tokens, heads = a.shape
    assert b.shape == a.shape and a.stride(1) == 1 and b.stride(1) == 1, "a, b: [T, H], unit stride along H"
    g = torch.empty(num_tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty(num_tokens, heads, dtype=b.dtype, device=a.device)
    if num_tokens == 0:
        return g, beta
    block_h = triton.next_power_of_2(heads)
    block_t = max(1, 1024 // block_h)
    pdl = use_pdl(a)
    _gdn_gating_kernel[(triton.cdiv(num_tokens, block_t),)](
        a, b, A_log, dt_bias, g, beta, num_tokens, heads, a.stride(0), b.stride(0),
        BLOCK_T=block_t, BLOCK_H=block_h, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return g, beta


@fast_launch
@triton.jit
def _gdn_decode_kernel(
    q_ptr,  # [B, Hk, K]
    k_ptr,  # [B, Hk, K]
    v_ptr,  # [B, Hv, V]
    g_ptr,  # [B, Hv] float32 (GATE: the layer's a, its dtype)
    beta_ptr,  # [B, Hv] (GATE: the layer's b)
    a_log_ptr,  # GATE: [Hv] A_log (else a placeholder)
    dt_bias_ptr,  # GATE: [Hv] dt_bias
    state_ptr,  # [S, Hv, K, V]
    o_ptr,  # out [B, Hv, V]
    slot_ptr,  # [B] int32
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_g,
    stride_beta,
    stride_ss,
    stride_sh,
    stride_sk,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
    GATE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = offs_k < K
    v_ok = offs_v < V
    slot = tl.load(slot_ptr + req)  # the host's slots: no kernel of the step writes them
    if GATE:  # weights: loaded before the wait
        a_log = tl.load(a_log_ptr + head).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    pdl_prologue(USE_PDL)
    kv_mask = k_ok[:, None] & v_ok[None, :]  # [BK, BLOCK_V]
    # the scalar broadcast before it meets the mask (the interpreter mis-types scalar & tensor)
    has = kv_mask & (((slot >= 0).to(tl.int32) + tl.zeros([BK, BLOCK_V], tl.int32)) != 0)
    s_base = state_ptr + slot.to(tl.int64) * stride_ss + head * stride_sh  # scalar: int32 tile offsets below
    s_offs = offs_k[:, None] * stride_sk + offs_v[None, :]  # [BK, BLOCK_V]
    state = tl.load(s_base + s_offs, mask=has, other=0.0).to(tl.float32)  # [BK, BLOCK_V]
    qk_head = (head // GROUP).to(tl.int64)  # GQA: value head h reads q/k head h // GROUP
    q = tl.load(q_ptr + req.to(tl.int64) * stride_qb + qk_head * stride_qh + offs_k, mask=k_ok, other=0.0)
    k = tl.load(k_ptr + req.to(tl.int64) * stride_kb + qk_head * stride_kh + offs_k, mask=k_ok, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    if L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    v_row = req.to(tl.int64) * stride_vb + head * stride_vh + offs_v
    v = tl.load(v_ptr + v_row, mask=v_ok, other=0.0).to(tl.float32)  # [BLOCK_V]
    g = tl.load(g_ptr + req.to(tl.int64) * stride_g + head).to(tl.float32)
    beta = tl.load(beta_ptr + req.to(tl.int64) * stride_beta + head)
    if GATE:  # gdn_gating's math on the head's a and b: beta rounded to b's dtype as there
        g = _decay(g, dt_bias, a_log)
        beta = tl.sigmoid(beta.to(tl.float32)).to(beta_ptr.dtype.element_ty)
    beta = beta.to(tl.float32)
    state = state * tl.exp(g)
    delta = (v - tl.sum(state * k[:, None], axis=0)) * beta  # [BLOCK_V] v minus what the state predicts for k
    state = state + k[:, None] * delta[None, :]
    o = tl.sum(state * q[:, None], axis=0)  # [BLOCK_V]
    tl.store(o_ptr + (req.to(tl.int64) * H + head) * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=v_ok)
    s_offs = offs_k[:, None] * stride_sk + offs_v[None, :]
    tl.store(s_base + s_offs, state.to(state_ptr.dtype.element_ty), mask=has)


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """q, k [B, Hk, K], v [B, Hv, V] (unit stride along K / V), g [B, Hv] float32, beta [B, Hv], states
    [S, Hv, K, V] -> o [B, Hv, V] in v's dtype; states[slots[b]] updated in place. Same math as
    `gated_delta_decode_ref`."""
    return _decode(q, k, v, g, beta, None, states, slots, scale, use_qk_l2norm)


def gated_delta_decode_gating(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """`gdn_gating` then `gated_delta_decode` in one launch: a, b [B, Hv] the layer's gate inputs (unit stride
    along Hv), A_log, dt_bias [Hv]; each program gates its own head (a decode step of a hybrid model launches
    one kernel a layer fewer). Same math as `gated_delta_decode_gating_ref`."""
    assert A_log.shape == dt_bias.shape == (v.shape[1],), "A_log, dt_bias: [Hv]"
    return _decode(q, k, v, a, b, (A_log, dt_bias), states, slots, scale, use_qk_l2norm)


def _decode(q, k, v, g, beta, gate, states, slots, scale, use_qk_l2norm) -> torch.Tensor:
    batch, num_k_heads, head_k = k.shape
    num_v_heads, head_v = v.shape[1:]
    assert q.shape == k.shape and v.shape[0] == batch and num_v_heads % num_k_heads == 0, "q/k/v shapes"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "unit stride along the head dim"
    assert g.shape == beta.shape == (batch, num_v_heads) and g.stride(1) == 1 and beta.stride(1) == 1
    assert states.shape[1:] == (num_v_heads, head_k, head_v) and states.stride(3) == 1, "states [S, Hv, K, V]"
    scale = head_k**-0.5 if scale is None else scale
    o = torch.empty(batch, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    if batch == 0:
        return o
    block_v = min(_DECODE_BLOCK_V, triton.next_power_of_2(head_v))
    pdl = use_pdl(v)
    a_log, dt_bias = gate if gate is not None else (g, g)
    _gdn_decode_kernel[(batch, num_v_heads, triton.cdiv(head_v, block_v))](
        q, k, v, g, beta, a_log, dt_bias, states, o, slots, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        states.stride(0), states.stride(1), states.stride(2),
        H=num_v_heads, GROUP=num_v_heads // num_k_heads, K=head_k, V=head_v, BK=triton.next_power_of_2(head_k),
        BLOCK_V=block_v, L2NORM=use_qk_l2norm, GATE=gate is not None, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return o
