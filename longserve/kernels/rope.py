"""Rotary embedding of q and k in one Triton kernel, in place; reference: `rotary_embedding_ref`. Optionally
the same launch stores the rotated keys and the values into their KV-cache slots (reference: the rotation,
then `KVCache.store`'s index_copy; for an fp8 cache its quantization too: x / scale saturated to +-448,
rounded to e4m3, attention/kv_quant.py), and normalizes each head first (Qwen3's q/k RMSNorm, or Qwen3.5's
zero-centered one; reference: `rms_norm` of kernels/norm.py with the same `zero_centered`, then the rotation).

The fp8 store is fused for the launches it saves: unfused, an fp8 cache's store is ~8 small launches a layer
(the division, the clamp and the cast of K and of V, two index_copy): the A3B decode at batch 1 (32K) took 5.87
ms with an fp8 cache against 4.66 with bf16 (2026-12-02, 35fd681, RESULTS.md seventh session), though it
reads half the KV bytes.

HF rotate_half (neox) convention: the two halves of the rotated dims rotate together. One program per token
reads its cos|sin row [R] from the float32 cache once, then rotates all Hq + Hkv heads, BLOCK_HEADS at a time,
in float32. q/k only need a unit stride along D (views of the fused qkv output work as they are).

Partial rotary (Qwen3.5, Qwen3-Next: R = D / 4): the cache is R wide, only each head's first R dims rotate and
its last PASS_D = D - R pass through: read only where they are normed or copied (to the KV cache or q_dst). With
PASS_D = 0 (every other model) that code is not generated, and the kernel compiles to what it was before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.extend_attention import interpreting
from longserve.kernels.launch import early_loads, fast_launch, pdl_prologue, use_pdl
from longserve.kernels.quant_tiles import e4m3_rounded
from longserve.kernels.rope_reference import rotary_embedding_ref

__all__ = ["rotary_embedding", "rotary_embedding_ref"]


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's first head
    stride_h,
    num_heads,
    cos,  # [1, BLOCK_D2] float32
    sin,  # [1, BLOCK_D2] float32
    offs_d,  # [BLOCK_D2]
    dst_ptr,  # with HAS_DST: where the rotated heads also go (this token's KV-cache slot, or its packed q rows)
    dst_stride_h,  # head h goes to (h // DST_GROUP) * dst_stride_h + (h % DST_GROUP) * dst_stride_g
    dst_stride_g,
    dst_scale,  # FP8_DST: the cache's scale (stored = x / scale)
    w_ptr,  # with HAS_NORM: the per-head RMSNorm weight [2 * HALF_D + PASS_D] applied before the rotation
    eps,
    HALF_D: tl.constexpr,  # half the rotated dims R
    BLOCK_HEADS: tl.constexpr,
    HAS_DST: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8_DST: tl.constexpr,
    INTERPRET: tl.constexpr,
    DST_GROUP: tl.constexpr = 1,
    ZERO_CENTERED: tl.constexpr = False,  # HAS_NORM: the weight is an offset from 1 (Qwen3.5's q/k norm)
    PASS_D: tl.constexpr = 0,  # partial rotary: the dims after the rotated ones, not rotated (BLOCK_P >= PASS_D)
    BLOCK_P: tl.constexpr = 1,
):
    for h0 in range(0, num_heads, BLOCK_HEADS):
        heads = h0 + tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
        mask = (heads[:, None] < num_heads) & (offs_d[None, :] < HALF_D)  # [BLOCK_HEADS, BLOCK_D2]
        ptr1 = x_ptr + heads[:, None] * stride_h + offs_d[None, :]  # first half of each head
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_D2]
        x2 = tl.load(ptr1 + HALF_D, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_D2]
        if PASS_D > 0 and (HAS_NORM or HAS_DST):  # the pass-through dims: in the norm's sum, normed, copied
            offs_p = tl.arange(0, BLOCK_P)  # [BLOCK_P]
            p_mask = (heads[:, None] < num_heads) & (offs_p[None, :] < PASS_D)  # [BLOCK_HEADS, BLOCK_P]
            ptr_p = x_ptr + heads[:, None] * stride_h + 2 * HALF_D + offs_p[None, :]
            xp = tl.load(ptr_p, mask=p_mask, other=0.0).to(tl.float32)  # [BLOCK_HEADS, BLOCK_P]
        if HAS_NORM:  # Qwen3's q/k norm, as kernels/norm.py computes it (in float32 over the whole head)
            dt = x_ptr.dtype.element_ty
            sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BLOCK_HEADS]
            if PASS_D > 0:
                sum_sq += tl.sum(xp * xp, axis=1)
            rstd = tl.math.rsqrt(sum_sq / (2 * HALF_D + PASS_D) + eps)  # [BLOCK_HEADS]
            w1 = _norm_weight(w_ptr, offs_d, HALF_D, ZERO_CENTERED)  # [1, BLOCK_D2]
            w2 = _norm_weight(w_ptr + HALF_D, offs_d, HALF_D, ZERO_CENTERED)
            x1 = _normed(x1, rstd, w1, dt, ZERO_CENTERED)
            x2 = _normed(x2, rstd, w2, dt, ZERO_CENTERED)
            if PASS_D > 0:  # normed in place too, as the rotated dims are
                xp = _normed(xp, rstd, _norm_weight(w_ptr + 2 * HALF_D, offs_p, PASS_D, ZERO_CENTERED), dt,
                             ZERO_CENTERED)  # fmt: skip
                tl.store(ptr_p, xp.to(dt), mask=p_mask)
        out1 = x1 * cos - x2 * sin  # x * cos + rotate_half(x) * sin, rotate_half = (-x2, x1)
        out2 = x2 * cos + x1 * sin
        tl.store(ptr1, out1.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr1 + HALF_D, out2.to(x_ptr.dtype.element_ty), mask=mask)
        if HAS_DST:  # the value stored above, as the pages (or the packed rows) hold it
            dst_heads = (heads // DST_GROUP) * dst_stride_h + (heads % DST_GROUP) * dst_stride_g
            dst1 = dst_ptr + dst_heads[:, None] + offs_d[None, :]
            tl.store(dst1, _as_stored(out1.to(x_ptr.dtype.element_ty), dst_ptr, dst_scale, FP8_DST, INTERPRET),
                     mask=mask)  # fmt: skip
            tl.store(dst1 + HALF_D,
                     _as_stored(out2.to(x_ptr.dtype.element_ty), dst_ptr, dst_scale, FP8_DST, INTERPRET),
                     mask=mask)  # fmt: skip
            if PASS_D > 0:
                dst_p = dst_ptr + dst_heads[:, None] + 2 * HALF_D + offs_p[None, :]
                tl.store(dst_p, _as_stored(xp.to(x_ptr.dtype.element_ty), dst_ptr, dst_scale, FP8_DST, INTERPRET),
                         mask=p_mask)  # fmt: skip


@triton.jit
def _norm_weight(w_ptr, offs, n: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """The per-head norm's weight over `offs` (< n) as [1, len(offs)] float32: 1 + the stored offset when
    ZERO_CENTERED (HF adds it in float32: `1.0 + weight.float()`)."""
    w = tl.load(w_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
    return w[None, :]


@triton.jit
def _normed(x, rstd, w, dt: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """x [BLOCK_HEADS, N] float32 normalized (rstd [BLOCK_HEADS]) and scaled by w [1, N], rounded to dt where
    kernels/norm.py rounds: Llama's way casts before the weight, the zero-centered way only after it."""
    if ZERO_CENTERED:
        y = x * rstd[:, None] * w
    else:
        y = (x * rstd[:, None]).to(dt).to(tl.float32) * w
    return y.to(dt).to(tl.float32)


@triton.jit
def _as_stored(x, dst_ptr, scale, FP8_DST: tl.constexpr, INTERPRET: tl.constexpr):
    """x in the cache's dtype: a plain cast, or (FP8_DST) kv_quant.quantize_kv's x / scale saturated to
    e4m3's +-448 and rounded to nearest even (by hand under the interpreter, whose cast mis-rounds)."""
    if FP8_DST:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0)
        if INTERPRET:
            y = e4m3_rounded(y)
        return y.to(dst_ptr.dtype.element_ty)
    else:
        return x.to(dst_ptr.dtype.element_ty)


@fast_launch
@triton.jit
def _rope_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    v_ptr,  # STORE_KV: the new tokens' values, and where rotated keys and values go
    slot_ptr,
    kc_ptr,
    vc_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    stride_vt,
    stride_vh,
    stride_slot,  # the caches' slot and head strides ([num_slots, Hkv, D] views)
    stride_head,
    qw_ptr,  # HAS_NORM: the q and k norms' weights [D]
    kw_ptr,
    eps,
    qd_ptr,  # Q_DST: where the rotated q also goes, [T, Hkv, Q_GROUP, D] (the packed prefix call's rows)
    stride_qdt,
    stride_qdk,
    stride_qdg,
    num_q_heads,
    num_kv_heads,
    k_scale,  # FP8_KV: the fp8 cache's K and V scales
    v_scale,
    HALF_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    STORE_KV: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8_KV: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
    EARLY: tl.constexpr = False,
    Q_DST: tl.constexpr = False,
    Q_GROUP: tl.constexpr = 1,
    ZERO_CENTERED: tl.constexpr = False,  # HAS_NORM: the norms' weights are offsets from 1 (Qwen3.5)
    PASS_D: tl.constexpr = 0,  # partial rotary: a head's D - R dims after the rotated R = 2 * HALF_D
    BLOCK_P: tl.constexpr = 1,
):
    # EARLY: the position, its cos and sin and the slot before the wait on the kernel before (launch.pdl_prologue:
    # the host writes them, no kernel of the step); after it, two dependent round trips in series with it
    pdl_prologue(USE_PDL and not EARLY)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D2)  # [BLOCK_D2]
    d_mask = offs_d < HALF_D
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF_D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]  # [1, BLOCK_D2]
    if STORE_KV:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
    pdl_prologue(USE_PDL and EARLY)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_q_heads, cos, sin, offs_d, qd_ptr + tok * stride_qdt,
                  stride_qdk, stride_qdg, 1.0, qw_ptr, eps, HALF_D, BLOCK_HEADS, Q_DST, HAS_NORM, False, INTERPRET,
                  Q_GROUP, ZERO_CENTERED, PASS_D, BLOCK_P)  # fmt: skip
    if STORE_KV:
        _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_kv_heads, cos, sin, offs_d,
                      kc_ptr + slot * stride_slot, stride_head, 0, k_scale, kw_ptr, eps, HALF_D, BLOCK_HEADS, True,
                      HAS_NORM, FP8_KV, INTERPRET, 1, ZERO_CENTERED, PASS_D, BLOCK_P)  # fmt: skip
        for h0 in range(0, num_kv_heads, BLOCK_HEADS):  # the values as they are (two halves; fp8: quantized)
            heads = h0 + tl.arange(0, BLOCK_HEADS)  # [BLOCK_HEADS]
            mask = (heads[:, None] < num_kv_heads) & d_mask[None, :]  # [BLOCK_HEADS, BLOCK_D2]
            src = v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_d[None, :]
            dst = vc_ptr + slot * stride_slot + heads[:, None] * stride_head + offs_d[None, :]
            tl.store(dst, _as_stored(tl.load(src, mask=mask), vc_ptr, v_scale, FP8_KV, INTERPRET), mask=mask)
            tl.store(dst + HALF_D, _as_stored(tl.load(src + HALF_D, mask=mask), vc_ptr, v_scale, FP8_KV, INTERPRET),
                     mask=mask)  # fmt: skip
            if PASS_D > 0:  # the values' dims past R (a value head is D wide)
                offs_p = 2 * HALF_D + tl.arange(0, BLOCK_P)  # [BLOCK_P]
                p_mask = (heads[:, None] < num_kv_heads) & (offs_p[None, :] < 2 * HALF_D + PASS_D)
                src_p = v_ptr + tok * stride_vt + heads[:, None] * stride_vh + offs_p[None, :]
                dst_p = vc_ptr + slot * stride_slot + heads[:, None] * stride_head + offs_p[None, :]
                tl.store(dst_p, _as_stored(tl.load(src_p, mask=p_mask), vc_ptr, v_scale, FP8_KV, INTERPRET),
                         mask=p_mask)  # fmt: skip
    else:
        _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_kv_heads, cos, sin, offs_d, k_ptr, 0, 0, 1.0, kw_ptr,
                      eps, HALF_D, BLOCK_HEADS, False, HAS_NORM, False, INTERPRET, 1, ZERO_CENTERED, PASS_D,
                      BLOCK_P)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    store: tuple | None = None,
    qk_norm: tuple | None = None,
    q_dst: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (their first R dims); returns (q, k). Flat q [T, Hq*R] and
    k [T, Hkv*R] are rotated whole (D = R).

    positions [T] (int) index cos_sin_cache [P, R] (cos | sin halves, float32, see
    `RotaryEmbedding.cos_sin_cache`; R < D for partial rotary); positions must be < P (not checked on the device).
    store = (v [T, Hkv, D], slot_mapping [T], k_cache, v_cache [num_slots, Hkv, D] views of the pages[, k_scale,
    v_scale]): the same launch also writes the rotated keys and the values into their slots (what KVCache.store
    does, without its launches: two index_copy a layer for a 16-bit cache, ~8 for fp8); float8_e4m3fn caches
    are written quantized with the scales (default 1.0).
    qk_norm = (q weight [D], k weight [D], eps[, zero_centered]): each head is RMS-normalized first (Qwen3's
    q_norm / k_norm, computed as kernels/norm.py's rms_norm with the same zero_centered: Qwen3.5's weights are
    offsets from 1), so the norms need no launches of their own; the weights must have q's dtype (the norm's
    output dtype is then q's, as the rotation writes in place).
    q_dst [T, Hkv, G, D] (any strides but D's; q's dtype): the rotated q goes there too, head h = j * G + g at
    [t, j, g] (the packed prefix call's rows, attention/packed_graph.py: no copy of its own).
    """
    rot_dim = cos_sin_cache.shape[-1]
    head_dim = q.shape[-1] if q.dim() == 3 else rot_dim
    assert rot_dim % 2 == 0 and rot_dim <= head_dim and cos_sin_cache.stride(-1) == 1
    num_tokens = positions.shape[0]
    q3 = q.view(num_tokens, -1, head_dim)  # [T, Hq, D]
    k3 = k.view(num_tokens, -1, head_dim)  # [T, Hkv, D]
    assert q3.stride(2) == 1 and k3.stride(2) == 1, "q and k need a unit stride along head_dim"
    if num_tokens == 0:
        return q, k
    half, pass_d = rot_dim // 2, head_dim - rot_dim
    block_d2 = triton.next_power_of_2(half)
    block_p = triton.next_power_of_2(pass_d) if pass_d else 1
    block_heads = max(
        1, min(triton.next_power_of_2(max(q3.shape[1], k3.shape[1])), 4096 // max(block_d2, block_p))
    )
    fp8_kv, kv_scales = False, (1.0, 1.0)
    if store is not None:
        v, slots, k_cache, v_cache = store[:4]
        fp8_kv = k_cache.dtype == torch.float8_e4m3fn
        assert v_cache.dtype == k_cache.dtype
        kv_scales = tuple(float(x) for x in store[4:6]) or kv_scales
        v3 = v.view(num_tokens, -1, head_dim)  # [T, Hkv, D]
        assert v3.stride(2) == 1 and k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride()
        assert k_cache.shape[1:] == k3.shape[1:] and slots.shape == (num_tokens,)
        extra = (
            v3,
            slots,
            k_cache,
            v_cache,
            v3.stride(0),
            v3.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
        )
    else:
        extra = (q3, positions, q3, q3, 0, 0, 0, 0)  # unused
    zero_centered = False
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm[:3]
        zero_centered = bool(qk_norm[3]) if len(qk_norm) > 3 else False
        assert q_weight.shape == k_weight.shape == (head_dim,) and q_weight.dtype == k_weight.dtype == q.dtype
        norm_args = (q_weight, k_weight, float(eps))
    else:
        norm_args = (q3, q3, 0.0)  # unused
    if q_dst is not None:
        assert q_dst.dim() == 4 and q_dst.shape[0] == num_tokens and q_dst.shape[3] == head_dim
        assert q_dst.shape[1] * q_dst.shape[2] == q3.shape[1]
        assert q_dst.stride(3) == 1 and q_dst.dtype == q.dtype
        q_dst_args = (q_dst, q_dst.stride(0), q_dst.stride(1), q_dst.stride(2))
        q_group = q_dst.shape[2]
    else:
        q_dst_args, q_group = (q3, 0, 0, 0), 1  # unused
    pdl = use_pdl(q3)
    _rope_kernel[(num_tokens,)](
        positions, q3, k3, cos_sin_cache, *extra[:4],
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos_sin_cache.stride(0), *extra[4:],
        *norm_args, *q_dst_args, q3.shape[1], k3.shape[1], *kv_scales,
        HALF_D=half, BLOCK_D2=block_d2, BLOCK_HEADS=block_heads, STORE_KV=store is not None,
        HAS_NORM=qk_norm is not None, FP8_KV=fp8_kv, INTERPRET=interpreting(), USE_PDL=pdl, EARLY=early_loads(),
        Q_DST=q_dst is not None, Q_GROUP=q_group, ZERO_CENTERED=zero_centered, PASS_D=pass_d, BLOCK_P=block_p,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return q, k
