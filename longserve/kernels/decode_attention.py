"""Split-K paged flash-decoding in Triton: one new token per request attends over its whole paged KV.

Stage 1: each program (request, kv head, split) covers one contiguous key range for all q heads of that
kv head (GQA rows padded to 16 for tl.dot) and writes a partial (normalised output, log2-sum-exp).
Stage 2: per (request, q head), merges the splits. With one split, stage 1 writes the output directly.
Reference: `decode_attention_ref` (kernels/attention_reference.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from longserve.kernels.attention_reference import decode_attention_ref
from longserve.kernels.extend_attention import check_cache, interpreting, merge_splits
from longserve.kernels.launch import early_loads, fast_launch, pdl_prologue, use_pdl, zeroed_counters

__all__ = ["choose_num_splits", "decode_attention", "decode_attention_ref", "decode_config"]

MIN_KEYS_PER_SPLIT = 512  # below this a split's fixed cost outweighs the parallelism it buys
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep loads in flight
# The program that stores a (request, kv head)'s last partial merges that kv head's splits (a counter per
# pair, zero between launches: split_k.SPLIT_K_SERIAL_REDUCE's scheme) instead of a merge launch after the
# kernel: one launch fewer a layer in every split decode step (32 a step of the 8B shape; with the GEMVs'
# serial sums the FP8 batch-1 step went 4.38 -> 4.28 ms for 128 launches). Its sums over the splits run in
# split order, the merge kernel's in a tree: equal to fp32 rounding, not bit for bit. The last program reads
# every split's partial alone, so the merge launch wins when the splits are many: measured on an H200 (854fbd1,
# `gpu_check.sh decode-merge`, RESULTS.md fourteenth session), the 8B decode attention alone at 64 splits (b1,
# 32K) 37.2 us with the launch against 60.6 in the kernel, at 5 splits (b16, 8K) 131.4 / 131.1, at 2 (b64, 4K)
# 251.5 / 246.2; end to end b1 5.62 -> 6.21 ms, b16 8.73 -> 8.61, b64 12.79 -> 12.67. So: in the kernel up to
# this many splits (0: never). The merge's partials loaded 4 splits at once instead of one (a quarter of its L2 round
# trips) did not move that bound: on an H100 (thirtieth session, 2946dd0, `gpu_check.sh decode-merge`) alone at 64
# splits 70.5 us in the kernel against 75.0 one at a time and 51.1 with the launch; in the 8B decode equal up to 8
# splits (b1@32K 7.66 ms, b16@8K 12.03, b64@4K 17.93) and at 64 b1 8.08 (FP8 5.33 -> 5.84): dropped.
DECODE_SERIAL_MERGE_MAX_SPLITS = 8
MERGE_LOCKS = 1 << 14  # counters per device: (request, kv head) pairs of one launch; more merge apart
# An fp8 (e4m3) cache with 16-bit queries: K and V widened to fp16 and both dots in fp16, q scaled by qk_scale
# once and rounded to fp16 (11 bits, against bf16's 8; p likewise). sm90 converts e4m3 pairs to fp16 in one
# instruction and to bf16 only through fp16 and fp32: built for sm90 (Triton 3.6, the A3B shape's GROUP 8, 64
# keys a step), the loop's SASS 1,669 instructions with bf16 dots against 1,235 with fp16 ones (F2F 256 and PRMT
# 128 gone), and 791 on a bf16 cache (LDSM where fp8 takes LDS). The A3B decode at batch 64 (4K) ran 1.06x slower
# on an fp8 cache than on bf16 (RESULTS.md eighth session; issue 18: <= 1.05x) though it reads half the bytes.
# Measured on an H200 (2026-12-05, 46763a7, RESULTS.md twenty-fifth session; the fp8 KV GPU tests pass with it): the
# A3B decode at b64@4K 23.37 ms on a bf16 cache, 22.02 on an fp8 one with bf16 dots, 19.70 with fp16 dots (0.84x).
KV_FP8_AS_F16 = True
_MERGE_LOCKS: dict[torch.device, torch.Tensor] = {}


@fast_launch
@triton.jit(do_not_specialize=["stride_pt"])  # the batch's longest page table: not a variant per width class
def _decode_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,
    seq_lens_ptr,  # [B]
    page_table_ptr,  # [B, max_pages]
    mid_o_ptr,  # [B, Hq, splits, D] fp32, or the output [B, Hq, D] when not SPLIT
    mid_lse_ptr,  # [B, Hq, splits] fp32 (unused when not SPLIT)
    out_ptr,  # [B, Hq, D]: the merged output (SERIAL only)
    lock_ptr,  # [>= B * Hkv] int32 counters, zero between launches (SERIAL only)
    stride_qb,
    stride_qh,
    stride_slot,
    stride_kvh,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_rb,  # out's strides (SERIAL only)
    stride_rh,
    qk_scale,  # softmax scale * log2(e) * K's fp8 scale (1.0 for a 16-bit cache)
    v_scale,  # V's fp8 scale (1.0 for a 16-bit cache): the output is linear in V
    window,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # more than one split (grid dim 2): partials, merged by a second kernel or (SERIAL) here
    SERIAL: tl.constexpr,  # SPLIT, merged by each (request, kv head)'s last program (DECODE_SERIAL_MERGE_MAX_SPLITS)
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    KV_F16: tl.constexpr = False,  # an fp8 cache with 16-bit queries: the dots in fp16 (the launcher's comment)
    EARLY: tl.constexpr = False,  # launch.early_loads
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)  # not a constexpr: one compiled kernel serves every split count

    # EARLY: the length before the wait on the kernel before (launch.pdl_prologue: the host writes the lengths, no
    # kernel of the step): the page table's loads and the first keys' then follow the wait at once, not a round
    # trip after it
    pdl_prologue(USE_PDL and not EARLY)
    seq_len = tl.load(seq_lens_ptr + req)
    pdl_prologue(USE_PDL and EARLY)
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = 0
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * split_len
    s_hi = tl.minimum(s_lo + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_valid = offs_h < GROUP
    heads = kv_head * GROUP + offs_h  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_valid = offs_d < HEAD_DIM
    q_offs = req.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=h_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    # the scale applied to q once (|q| x ~0.1 x k_scale: far inside fp16's range), not to every score
    if KV_F16:
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    k_head_ptr = k_cache_ptr + kv_head * stride_kvh
    v_head_ptr = v_cache_ptr + kv_head * stride_kvh
    pt_row_ptr = page_table_ptr + req.to(tl.int64) * stride_pt
    for start in range(s_lo, s_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_valid = offs_n < s_hi
        page = tl.load(pt_row_ptr + offs_n // PAGE_SIZE, mask=n_valid, other=0)  # [BLOCK_N]
        slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # [BLOCK_N]
        kv_offs = slot[:, None] * stride_slot + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_head_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_head_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        k = k.to(q.dtype)  # an fp8 cache: e4m3 widened in registers (its scale is folded into qk_scale)
        v = v.to(q.dtype)  # (V's scale multiplies the output)
        if KV_F16:
            qk = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]: q carries qk_scale
        else:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        qk = tl.where(n_valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_H]
        p = tl.exp2(qk - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = h_valid[:, None] & d_valid[None, :]
    if not SPLIT:
        out = acc * (v_scale / l_i)[:, None]  # [BLOCK_H, BLOCK_D]
        o_offs = req.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(mid_o_ptr + o_offs, out.to(mid_o_ptr.dtype.element_ty), mask=out_mask)
    else:
        has_keys = l_i > 0.0
        out = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]  # [BLOCK_H, BLOCK_D]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))  # [BLOCK_H]
        row = req.to(tl.int64) * stride_ob + heads * stride_oh + split * stride_os  # [BLOCK_H]
        tl.store(mid_o_ptr + row[:, None] + offs_d[None, :], out, mask=out_mask)
        lse_offs = (req.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BLOCK_H]
        tl.store(mid_lse_ptr + lse_offs, lse, mask=h_valid)
        if SERIAL:
            # the CTA's stores before the counter's release (acq_rel, GPU scope); the last program's loads
            # after its acquire, from L2 (.cg)
            tl.debug_barrier()
            lock = lock_ptr + req * tl.num_programs(1) + kv_head
            if tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                first = (req.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * num_splits  # [BLOCK_H]
                m_all = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
                for s in range(0, num_splits):
                    m_all = tl.maximum(
                        m_all, tl.load(mid_lse_ptr + first + s, mask=h_valid, other=0.0, cache_modifier=".cg")
                    )
                merged = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
                w_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
                part = req.to(tl.int64) * stride_ob + heads * stride_oh  # [BLOCK_H]
                for s in range(0, num_splits):  # in split order; empty splits (lse -inf) weigh 0
                    w = tl.exp2(
                        tl.load(mid_lse_ptr + first + s, mask=h_valid, other=0.0, cache_modifier=".cg")
                        - m_all
                    )
                    o_s = tl.load(mid_o_ptr + (part + s * stride_os)[:, None] + offs_d[None, :], mask=out_mask,
                                  other=0.0, cache_modifier=".cg")  # fmt: skip
                    merged += o_s * w[:, None]
                    w_sum += w
                merged = merged / tl.where(h_valid, w_sum, 1.0)[:, None]  # [BLOCK_H, BLOCK_D]
                r_offs = req.to(tl.int64) * stride_rb + heads[:, None] * stride_rh + offs_d[None, :]
                tl.store(out_ptr + r_offs, merged.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(lock, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def choose_num_splits(max_seq_len: int, num_reqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Splits per (request, kv head) so a lone long request still fills the chip (host-side, no sync)."""
    by_length = triton.cdiv(max(max_seq_len, 1), MIN_KEYS_PER_SPLIT)
    by_occupancy = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(num_reqs * num_kv_heads, 1))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


# the tile of 16-bit caches at head_dim <= 128: 64 keys, 3 stages, and 2 warps for a launch of at most
# DECODE_FEW_PROGRAMS programs (requests x kv heads x splits), else 4. In the engine on an H200 (2026-12-02,
# c1e17c0, Llama-3.1-8B shape, bench latency ITL, 2 warps against 4): 16 x 8K (640 programs) 8.89 against
# 10.04 ms a step, 1 x 32K (512) 5.92 against 5.92, 64 x 4K (1,024) 13.80 against 13.25. Between 640 and 1,024
# programs the threshold is a guess. (scripts/probes/sweep_decode.py, the kernel alone, agrees at 16 x 8K:
# 175 against 252 us a layer.)
DECODE_BLOCK_N = 64
DECODE_NUM_STAGES = 3
DECODE_FEW_PROGRAMS = 768
# The tile at head_dim > 128 (the seed's Qwen3.5 attention layers: 256, 16 query heads on 2 KV heads): never swept.
# On an H100 its decode kernel took 43 us a layer at b1@32K (forty-eighth session's profile: 320 calls in 13.8 ms)
# where the layer's 67 MB of K/V take ~24 us at the 2.84 TB/s bench latency's floor counts. Compiled for sm90
# (Triton 3.6, its strides marked divisible by 16 as the GPU specializes them) this tile takes 64 registers and 42 KB
# of shared memory, no spills, so room for 4 programs an SM, but a lone 32K request's grid is 2 KV heads x 64
# splits (MAX_SPLITS, MIN_KEYS_PER_SPLIT) = 128 programs, under one an SM (the 8B's: 512). `gpu_check.sh
# decode-wide` sweeps the tile (scripts/probes/sweep_decode.py --shape qwen3.5) and times the seed's decode with the
# sweep's best, and with twice the splits.
WIDE_HEAD_CONFIG = {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def decode_config(head_dim: int, dtype: torch.dtype, num_programs: int = 0) -> dict[str, int]:
    """Memory-bound: 64-key tiles (sm_90 compile: ~39 KB smem, ~100-125 regs, no spills); num_programs: the
    launch's grid size, which picks the warps."""
    if interpreting():
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    if head_dim > 128:
        return dict(WIDE_HEAD_CONFIG)
    warps = 2 if num_programs <= DECODE_FEW_PROGRAMS else 4
    return {"BLOCK_N": DECODE_BLOCK_N, "num_warps": warps, "num_stages": DECODE_NUM_STAGES}


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, max_pages] int32
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each request's one new token (at position seq_len - 1) over its pages; o [B, Hq, D].
    The caches may hold float8_e4m3fn values x / scale (an fp8 KV cache): k_scale / v_scale are their scales."""
    num_reqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[1] == page_size and k_cache.shape[3] == head_dim
    assert q.stride(2) == 1 and num_splits >= 1
    check_cache(k_cache, v_cache)
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out  # [B, Hq, D]
    assert out.shape == q.shape and out.stride(2) == 1
    if num_reqs == 0:
        return out
    programs = num_reqs * num_kv_heads * num_splits
    cfg = decode_config(head_dim, q.dtype, programs) if config is None else config
    block_d = triton.next_power_of_2(head_dim)
    if num_splits == 1:
        mid_o, mid_lse = out, out  # stage 1 writes the output; mid_lse is never touched
        strides = (out.stride(0), out.stride(1), 0)
    else:
        mid_o = torch.empty(num_reqs, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(num_reqs, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2))
    locks = merge_locks(num_reqs * num_kv_heads, num_splits, q.device)
    pdl = use_pdl(q)
    _decode_split_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, seq_lens, page_table, mid_o, mid_lse, out, locks if locks is not None else out,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), page_table.stride(0), *strides,
        out.stride(0), out.stride(1), scale * math.log2(math.e) * k_scale, v_scale, sliding_window or 0,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), PAGE_SIZE=page_size,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=cfg["BLOCK_N"], SPLIT=num_splits > 1,
        SERIAL=locks is not None, HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        KV_F16=KV_FP8_AS_F16 and k_cache.dtype == torch.float8_e4m3fn and q.dtype != torch.float32, EARLY=early_loads(),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], launch_pdl=pdl,
    )  # fmt: skip
    if num_splits > 1 and locks is None:
        merge_splits(mid_o, mid_lse, out)
    return out


def merge_locks(pairs: int, num_splits: int, device: torch.device) -> torch.Tensor | None:
    """The device's merge counters (launch.zeroed_counters: one set for every decode launch) when a launch of
    `num_splits` > 1 splits merges them in the kernel (DECODE_SERIAL_MERGE_MAX_SPLITS) and they cover `pairs`
    (request, kv head) pairs, else None (no merge, or a merge launch)."""
    if not 1 < num_splits <= DECODE_SERIAL_MERGE_MAX_SPLITS or pairs > MERGE_LOCKS:
        return None
    return zeroed_counters(_MERGE_LOCKS, MERGE_LOCKS, device)
