"""The extend kernel's online-softmax pass over one range of paged keys (kernels/extend_attention.py's
`_extend_kernel` runs it over up to three ranges a row block: masked, unmasked, masked). Keys are gathered
through the request's page-table row; an fp8 cache's e4m3 values are widened in registers."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def extend_blocks(
    acc,
    l_i,
    m_i,
    q,  # [BLOCK_M, BLOCK_D]
    q_pos,  # [BLOCK_M] absolute position of each row's token
    k_head_ptr,
    v_head_ptr,
    pt_row_ptr,  # this request's page_table row
    stride_slot,
    kv_lo,
    kv_hi,
    kv_end,  # keys >= kv_end are never read
    qk_scale,
    window,
    offs_d,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update over keys [kv_lo, kv_hi); MASKED applies causal/window/length masks."""
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        if MASKED:
            n_valid = offs_n < kv_end
            page = tl.load(pt_row_ptr + offs_n // PAGE_SIZE, mask=n_valid, other=0)  # [BLOCK_N]
        else:
            page = tl.load(pt_row_ptr + offs_n // PAGE_SIZE)  # [BLOCK_N]
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # [BLOCK_N]
        kv_offs = slot[:, None] * stride_slot + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        if MASKED:
            kv_mask = n_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(k_head_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_head_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        elif BLOCK_D != HEAD_DIM:
            k = tl.load(k_head_ptr + kv_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            v = tl.load(v_head_ptr + kv_offs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            k = tl.load(k_head_ptr + kv_offs)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_head_ptr + kv_offs)  # [BLOCK_N, BLOCK_D]
        k = k.to(q.dtype)  # an fp8 cache: e4m3 widened in registers (its scale is folded into qk_scale)
        v = v.to(q.dtype)  # (V's scale multiplies the output)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N] log2 units
        if MASKED:
            allowed = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]  # [BLOCK_M, BLOCK_N]
            if HAS_WINDOW:
                allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i
