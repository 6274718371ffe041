"""Merge attention partials over disjoint key sets by their log-sum-exps, in one pass (Triton).

`prefix_split_sdpa` computes a chunk's attention as (new x cached prefix) + (new x new, causal), two cuDNN
calls whose outputs o_a, o_b [H, L, D] (16-bit, any row/head strides) and natural-log LSEs [H, L] are
combined as (o_a e^(lse_a - m) + o_b e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m)), m = max of the two,
and written straight into the step's output [L, H, D]. Done with torch ops this took ~8 fp32 passes over
[H, L, D] (~140 ms of a 32K-token prefill in 8K chunks on an H200); here it is one read of each partial.

`merge_packed` does the same for a short chunk over a long prefix (`sdpa.packed_prefix_sdpa`): the prefix part
comes as S splits of its keys with the q heads of each kv head packed as rows, [S, Hkv, T * G, D], plus the
causal part [Hq, rows, D]; torch ops merging them took ~75 us a layer of the 8B shape's 64 new over 32K on an
H200, more than the cuDNN call itself (67 us; RESULTS.md fifteenth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.attention_reference import merge_packed_ref, merge_two_ref
from longserve.kernels.launch import fast_launch

__all__ = ["merge_packed", "merge_packed_ref", "merge_two", "merge_two_ref"]


@fast_launch
# not specialized on: the row count (any query length) and the LSE pointers (the causal part's rows start after
# a tail of any length): each value class would compile its own variant mid-step (sdpa_shapes.py)
@triton.jit(do_not_specialize=["num_rows", "lse_a_ptr", "lse_b_ptr"])
def _merge_two_kernel(
    o_a_ptr,
    lse_a_ptr,
    o_b_ptr,
    lse_b_ptr,
    out_ptr,
    num_rows,
    stride_oa_h,
    stride_oa_l,
    stride_ob_h,
    stride_ob_l,
    stride_la_h,
    stride_lb_h,
    stride_out_l,
    stride_out_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)  # [BLOCK_L]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    lse_a = tl.load(lse_a_ptr + head * stride_la_h + rows, mask=row_ok, other=float("-inf"))  # [BLOCK_L]
    lse_b = tl.load(lse_b_ptr + head * stride_lb_h + rows, mask=row_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)  # rows with no key at all: both weights 0 (masked rows)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    denom = tl.where(w_a + w_b > 0.0, w_a + w_b, 1.0)
    rows64 = rows.to(tl.int64)
    o_a = tl.load(o_a_ptr + head * stride_oa_h + rows64[:, None] * stride_oa_l + offs_d[None, :], mask=mask)
    o_b = tl.load(o_b_ptr + head * stride_ob_h + rows64[:, None] * stride_ob_l + offs_d[None, :], mask=mask)
    out = (o_a.to(tl.float32) * (w_a / denom)[:, None]) + (o_b.to(tl.float32) * (w_b / denom)[:, None])
    out_offs = rows64[:, None] * stride_out_l + head * stride_out_h + offs_d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def merge_two(
    o_a: torch.Tensor,  # [H, L, D]
    lse_a: torch.Tensor,  # [H, L] fp32, natural log
    o_b: torch.Tensor,  # [H, L, D]
    lse_b: torch.Tensor,  # [H, L] fp32
    out: torch.Tensor,  # [L, H, D], written
) -> torch.Tensor:
    num_heads, num_rows, head_dim = o_a.shape
    assert o_b.shape == o_a.shape and out.shape == (num_rows, num_heads, head_dim)
    assert lse_a.shape == lse_b.shape == (num_heads, num_rows)
    assert o_a.stride(2) == o_b.stride(2) == out.stride(2) == 1 and lse_a.stride(1) == lse_b.stride(1) == 1
    if num_rows == 0:
        return out
    block_l = 16
    _merge_two_kernel[(triton.cdiv(num_rows, block_l), num_heads)](
        o_a, lse_a, o_b, lse_b, out, num_rows,
        o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1), lse_a.stride(0), lse_b.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_L=block_l, num_warps=4,
    )  # fmt: skip
    return out


@fast_launch
# one (token, q head) a program: programs taking a kv head's 4 q heads (1 KB runs of each split where one head
# reads 256 B) were slower on an H100, 24.2 against 13.9 us at 16 splits and 12.8 against 5.8 at 8 (the 8B hit's
# shape; RESULTS.md thirty-fifth session, scripts/probes/probe_merge_packed.py)
@triton.jit(do_not_specialize=["num_splits", "tail", "clse_ptr"])
def _merge_packed_kernel(
    part_ptr,  # [S, Hkv, R, D]: the prefix splits' outputs, row t * GROUP + g = q head kv_head * GROUP + g
    plse_ptr,  # [S, Hkv, R] fp32, natural log
    oc_ptr,  # [Hq, Lc, D]: the causal part's outputs, token t at row tail + t
    clse_ptr,  # [Hq, Lc] fp32
    out_ptr,  # [T, Hq, D]
    num_splits,
    tail,
    stride_ps,
    stride_ph,
    stride_pr,
    stride_ls,
    stride_lh,
    stride_oc_h,
    stride_oc_l,
    stride_cl_h,
    stride_cl_l,
    stride_out_t,
    stride_out_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CAUSAL_LOG2: tl.constexpr,  # the causal part's LSE in log2 units (the Triton extend kernel's partials)
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row = tok * GROUP + head % GROUP
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(plse_ptr + offs_s * stride_ls + kv_head * stride_lh + row, mask=s_ok, other=float("-inf"))
    part = tl.load(
        part_ptr
        + offs_s.to(tl.int64)[:, None] * stride_ps
        + kv_head * stride_ph
        + row * stride_pr
        + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    lse_c = tl.load(clse_ptr + head * stride_cl_h + (tail + tok) * stride_cl_l)  # a token sees itself: finite
    if CAUSAL_LOG2:
        lse_c = lse_c * 0.6931471805599453  # ln 2
    o_c = tl.load(oc_ptr + head * stride_oc_h + (tail + tok).to(tl.int64) * stride_oc_l + offs_d, mask=d_ok)
    m = tl.maximum(tl.max(lse, 0), lse_c)
    w = tl.exp(lse - m)  # [BLOCK_S]: padding splits weigh 0
    w_c = tl.exp(lse_c - m)
    merged = (tl.sum(part.to(tl.float32) * w[:, None], 0) + o_c.to(tl.float32) * w_c) / (tl.sum(w, 0) + w_c)
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_out_t + head * stride_out_h + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


def merge_packed(
    part: torch.Tensor,  # [S, Hkv, R, D] (D contiguous)
    part_lse: torch.Tensor,  # [S, Hkv, R] fp32, natural log (rows contiguous)
    o_c: torch.Tensor,  # [Hq, Lc, D] (D contiguous)
    lse_c: torch.Tensor,  # [Hq, Lc] fp32
    out: torch.Tensor,  # [T, Hq, D], written
    tail: int,  # the causal part's rows before the new tokens' (a prefix's last keys, sdpa_shapes.split_shape)
    causal_log2: bool = False,  # lse_c in log2 units
) -> torch.Tensor:
    """out[t, h] = the merge of the prefix splits' rows of (t, h) and the causal part's row tail + t."""
    num_tokens, num_heads, head_dim = out.shape
    num_splits, num_kv_heads, rows = part.shape[:3]
    assert num_heads % num_kv_heads == 0 and rows >= num_tokens * (num_heads // num_kv_heads)
    assert part.stride(3) == o_c.stride(2) == out.stride(2) == 1 and part_lse.stride(2) == 1
    assert o_c.shape[0] == lse_c.shape[0] == num_heads and o_c.shape[1] >= tail + num_tokens
    if num_tokens == 0:
        return out
    _merge_packed_kernel[(num_tokens, num_heads)](
        part, part_lse, o_c, lse_c, out, num_splits, tail,
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        o_c.stride(0), o_c.stride(1), lse_c.stride(0), lse_c.stride(1), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), CAUSAL_LOG2=causal_log2,
        num_warps=4 if head_dim >= 128 else 2,
    )  # fmt: skip
    return out
