"""The packed prefix hit's causal part and merge in one kernel (attention/packed_graph.py, PACKED_TAIL_FUSED).

A short chunk over a long cached prefix (the prefix hit: 64 new tokens over 32K) runs its prefix part as one cuDNN
call over S splits of the prefix's keys; then, a layer each, the extend kernel ran the causal part (the prefix's
last partial page and the new tokens, fewer than page_size + 64 keys) into fp32 partials and merge_packed merged the
S + 1 parts: 0.42 + 0.19 ms of the 8B hit's ~11.7 ms on an H100 (RESULTS.md thirty-fifth session), two launches a
layer for work a few microseconds long. Here one program takes a block of tokens of one kv head (all its q heads:
the keys are read once for them), computes their causal attention in registers and folds in the S splits' rows.

Not yet measured on a GPU: off until `gpu_check.sh hit-tail` times it. Reference: attention_reference.packed_tail_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.attention_reference import packed_tail_ref
from longserve.kernels.launch import fast_launch

__all__ = ["packed_tail", "packed_tail_ref"]

LN2 = 0.6931471805599453
# (token, q head) rows a program: 8 tokens of the 8B's 4-head groups, 64 programs (64 rows: 3% slower, H100 2026-12-06)
ROWS = 32
KEYS = 64  # keys a loop step


@fast_launch
@triton.jit(do_not_specialize=["num_tokens"])
def _packed_tail_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_pages, page_size, Hkv, D]
    v_ptr,
    pages_ptr,  # [>= (page_size - 1 + T) / page_size] int32: the tail's page, then the new tokens'
    tail_ptr,  # [1] int32: the prefix's keys on the first page (the causal part's first key is its first)
    seq_ptr,  # [1] int32: tail + the chunk's new tokens
    part_ptr,  # [S, Hkv, R, D]: the splits' rows, row t * GROUP + g = q head kv_head * GROUP + g of token t
    plse_ptr,  # [S, Hkv, R] fp32, natural log
    out_ptr,  # [T, Hq, D]
    num_tokens,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ps,
    stride_ph,
    stride_pr,
    stride_ls,
    stride_lh,
    stride_ot,
    stride_oh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens a program: BLOCK_T * GROUP <= BLOCK_M
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # unrolled: the splits' loads issue together (PACKED_GRAPH_SPLITS, one value)
):
    kv = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    tok = tl.program_id(0) * BLOCK_T + offs_m // GROUP
    row_ok = (offs_m < BLOCK_T * GROUP) & (tok < num_tokens)
    head = kv * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    tail = tl.load(tail_ptr)
    # token t is key tail + t of the causal part and sees the keys up to it (the bucket's padding rows past the
    # chunk see all of them: computed, never read)
    last = tl.minimum(tl.program_id(0) * BLOCK_T + BLOCK_T, num_tokens) - 1
    hi = tl.minimum(tl.load(seq_ptr), tail + last + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        page = tl.load(pages_ptr + offs_n // PAGE_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
        k = tl.load(
            k_ptr + page[None, :] * stride_kp + slot[None, :] * stride_ks + kv * stride_kh + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k) * scale_log2
        s = tl.where(n_ok[None, :] & (offs_n[None, :] <= tail + tok[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: nothing to rescale
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        v = tl.load(
            v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vs + kv * stride_vh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    # the causal part, normalised, with its log-sum-exp in natural units; then each split's rows folded in
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    m = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    num = acc / l_safe[:, None]
    den = tl.where(l_i > 0, 1.0, 0.0)
    row = tok * GROUP + offs_m % GROUP
    for s in tl.static_range(NUM_SPLITS):
        lse = tl.load(plse_ptr + s * stride_ls + kv * stride_lh + row, mask=row_ok, other=float("-inf"))
        part = tl.load(
            part_ptr
            + s * stride_ps
            + kv * stride_ph
            + row.to(tl.int64)[:, None] * stride_pr
            + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m - m_safe)
        b = tl.exp(lse - m_safe)
        num = num * a[:, None] + part.to(tl.float32) * b[:, None]
        den = den * a + b
        m = m_new
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(
        out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def packed_tail(
    q: torch.Tensor,  # [T, Hq, D]: the bucket's rows (the chunk's new tokens first)
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D], the new tokens' K/V stored
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [P] int32: the causal part's pages (the prefix's last, partial one first)
    tail: torch.Tensor,  # [1] int32: the prefix's keys on that page
    seq: torch.Tensor,  # [1] int32: tail + the chunk's new tokens
    part: torch.Tensor,  # [S, Hkv, R, D]: the prefix splits' rows (PrefixCall)
    part_lse: torch.Tensor,  # [S, Hkv, R] fp32, natural log
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t, h] = attention of token t, q head h over the prefix (the splits' rows, merged) and causally over the
    tail and the new tokens up to itself: what extend_attention(partials=True) + merge_packed give, in one launch."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_splits = part.shape[0]
    assert (
        num_heads % num_kv_heads == 0
        and part.shape[1] == num_kv_heads
        and part.shape[2] >= num_tokens * group
    )
    assert (
        q.stride(2) == k_cache.stride(3) == v_cache.stride(3) == part.stride(3) == 1
        and part_lse.stride(2) == 1
    )
    out = torch.empty_like(q) if out is None else out
    assert out.stride(2) == 1
    block_m = max(ROWS, triton.next_power_of_2(group))
    block_t = block_m // group
    _packed_tail_kernel[(triton.cdiv(num_tokens, block_t), num_kv_heads)](
        q, k_cache, v_cache, pages, tail, seq, part, part_lse, out, num_tokens, scale / LN2,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), part.stride(0), part.stride(1), part.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        PAGE_SIZE=page_size, GROUP=group, BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_N=KEYS, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits, num_warps=4,
    )  # fmt: skip
    return out
