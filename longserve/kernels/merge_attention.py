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

__all__ = ["PACKED_MERGE_HEADS", "merge_packed", "merge_packed_ref", "merge_two", "merge_two_ref"]

# the q heads of one kv head that a merge_packed program takes: their rows lie side by side in each split's
# output, so a program reads HEADS * D contiguous values a split (1 KB for the 8B shape's 4 heads of 128) where one
# head a program read 256 B runs; with one head a program the merge took 14.7 us a layer of the 8B hit on an H100
# (RESULTS.md thirty-fifth session: ~3 us of traffic at the chip's bandwidth)
PACKED_MERGE_HEADS = 4


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
    HEADS: tl.constexpr,  # q heads a program merges (of one kv head; their rows are adjacent in every split)
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CAUSAL_LOG2: tl.constexpr,  # the causal part's LSE in log2 units (the Triton extend kernel's partials)
):
    tok = tl.program_id(0)
    blocks_per_kv_head = tl.cdiv(GROUP, HEADS)
    kv_head = tl.program_id(1) // blocks_per_kv_head
    offs_g = (tl.program_id(1) % blocks_per_kv_head) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    g_ok = offs_g < GROUP
    head = kv_head * GROUP + offs_g
    row = tok * GROUP + offs_g
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    sg_ok = s_ok[:, None] & g_ok[None, :]  # [BLOCK_S, HEADS]
    lse = tl.load(
        plse_ptr + offs_s[:, None] * stride_ls + kv_head * stride_lh + row[None, :],
        mask=sg_ok,
        other=float("-inf"),
    )  # [BLOCK_S, HEADS]
    part = tl.load(
        part_ptr
        + offs_s.to(tl.int64)[:, None, None] * stride_ps
        + kv_head * stride_ph
        + row[None, :, None] * stride_pr
        + offs_d[None, None, :],
        mask=sg_ok[:, :, None] & d_ok[None, None, :],
        other=0.0,
    )  # [BLOCK_S, HEADS, BLOCK_D]
    # a token sees itself: finite (a padding head's 0 weighs its zeros by 1, never stored)
    lse_c = tl.load(
        clse_ptr + head * stride_cl_h + (tail + tok) * stride_cl_l, mask=g_ok, other=0.0
    )  # [HEADS]
    if CAUSAL_LOG2:
        lse_c = lse_c * 0.6931471805599453  # ln 2
    o_c = tl.load(
        oc_ptr + head[:, None] * stride_oc_h + (tail + tok).to(tl.int64) * stride_oc_l + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [HEADS, BLOCK_D]
    m = tl.maximum(tl.max(lse, 0), lse_c)  # [HEADS]
    w = tl.exp(lse - m[None, :])  # [BLOCK_S, HEADS]: padding splits weigh 0
    w_c = tl.exp(lse_c - m)
    merged = (tl.sum(part.to(tl.float32) * w[:, :, None], 0) + o_c.to(tl.float32) * w_c[:, None]) / (
        tl.sum(w, 0) + w_c
    )[:, None]  # [HEADS, BLOCK_D]
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_out_t + head[:, None] * stride_out_h + offs_d[None, :],
        merged.to(out_ptr.dtype.element_ty),
        mask=g_ok[:, None] & d_ok[None, :],
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
    group = num_heads // num_kv_heads
    heads = min(PACKED_MERGE_HEADS, triton.next_power_of_2(group))
    block_s, block_d = max(2, triton.next_power_of_2(num_splits)), triton.next_power_of_2(head_dim)
    elements = block_s * heads * block_d
    _merge_packed_kernel[(num_tokens, num_kv_heads * triton.cdiv(group, heads))](
        part, part_lse, o_c, lse_c, out, num_splits, tail,
        part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
        o_c.stride(0), o_c.stride(1), lse_c.stride(0), lse_c.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEADS=heads, BLOCK_D=block_d, BLOCK_S=block_s, CAUSAL_LOG2=causal_log2,
        num_warps=8 if elements >= 8192 else 4 if elements >= 2048 else 2,
    )  # fmt: skip
    return out
