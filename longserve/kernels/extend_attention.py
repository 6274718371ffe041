"""Paged flash attention for a ragged batch of new tokens (prefill chunks, extends, decodes) in Triton.

Each program owns BLOCK_M packed rows (token, q head of one kv head) of one request, so the q heads that
share a kv head share its K/V loads; keys are gathered through the page table and only key blocks under
the causal (and sliding-window) mask are visited. Needs the new tokens' K/V already stored in the cache.
When the row blocks are too few to fill the chip (a short suffix over a long prefix), the key range is
split over several programs whose fp32 partials a second kernel merges (split-K, as in decode).
Reference: `extend_attention_ref` (kernels/attention_reference.py). The online-softmax pass over one range of
keys that the kernel runs up to three times is kernels/extend_blocks.py's `extend_blocks`.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from longserve.kernels.attention_reference import extend_attention_ref
from longserve.kernels.extend_blocks import extend_blocks
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl

__all__ = [
    "check_cache",
    "choose_extend_splits",
    "extend_attention",
    "extend_attention_ref",
    "extend_config",
    "interpreting",
    "merge_splits",
]

MIN_KEYS_PER_EXTEND_SPLIT = 1024
MAX_EXTEND_SPLITS = 32
# below this many waves of row-block programs, split the keys (tail effect <= 12.5%); 8 rather than 4 measured
# on an H200 (scripts/probes/sweep_short_extend.py): 64 new over 32K 0.227 -> 0.190 ms (17 -> 32 splits), 256
# new over 32K 0.534 -> ~0.49 ms (5 -> 9 splits)
WAVES_PER_EXTEND = 8
MAX_PARTIAL_ROWS = 1 << 19  # bounds the fp32 partials: T * Hq * splits rows of D floats


# the split count is a runtime argument, not specialized on: a constexpr compiled one kernel per count at
# serve time (choose_extend_splits picks 1..32 from each batch), seconds each, every running request stalled
# behind them (HTTP compare on an H200, 2026-12-02: 1-2.8 s stalls in the RAG and random workloads); nor is
# the page table's row stride (the batch's longest table: 1, a multiple of 16 or neither)
@fast_launch
@triton.jit(do_not_specialize=["num_splits", "stride_pt"])
def _extend_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_pages, page_size, Hkv, D]
    v_cache_ptr,
    o_ptr,  # [T, Hq, D], or partials [T, Hq, num_splits, D] fp32 when SPLIT
    lse_ptr,  # [T, Hq, num_splits] fp32 log2-sum-exp of each partial (unused unless SPLIT)
    query_start_loc_ptr,  # [B+1]
    prefix_lens_ptr,  # [B]
    seq_lens_ptr,  # [B]
    page_table_ptr,  # [B, max_pages]
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_os,
    stride_slot,
    stride_kvh,
    stride_pt,
    qk_scale,  # softmax scale * log2(e) * K's fp8 scale (1.0 for a 16-bit cache)
    v_scale,  # V's fp8 scale (1.0 for a 16-bit cache): the output is linear in V
    window,  # sliding window (unused unless HAS_WINDOW)
    num_splits,  # key-range splits per row block (split-K when the grid is small; 1 unless SPLIT)
    GROUP: tl.constexpr,  # Hq // Hkv
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: fp32 partials, merged by _merge_splits_kernel
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(1)
    if not SPLIT:
        # grid (Hkv, B, row blocks), x fastest: the heaviest (last, longest-causal) row blocks of every head
        # and request launch first, so the tail of the grid is short work
        kv_head = tl.program_id(0)
        num_kv_heads = tl.num_programs(0)
        block = tl.num_programs(2) - 1 - tl.program_id(2)
        split = 0
    else:
        # grid (row blocks, B, Hkv * splits), x fastest: the row blocks that share one kv head's key range
        # run side by side, so its K/V comes from DRAM once and from L2 for the others (a short suffix
        # over a long prefix is bound by those reads: 4 row blocks launched a wave apart read it 4 times)
        block = tl.num_programs(0) - 1 - tl.program_id(0)
        kv_head = tl.program_id(2) // num_splits
        num_kv_heads = tl.num_programs(2) // num_splits
        split = tl.program_id(2) % num_splits

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    num_rows = q_len * GROUP
    row0 = block * BLOCK_M
    if row0 >= num_rows:
        return
    prefix_len = tl.load(prefix_lens_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)

    # packed rows: row = token * GROUP + (q head within the kv head's group)
    rows = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_valid = rows < num_rows
    rows = tl.minimum(rows, num_rows - 1)  # padding rows repeat the last real row; never stored
    tok = rows // GROUP  # [BLOCK_M]
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    q_pos = prefix_len + tok  # [BLOCK_M]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_valid = offs_d < HEAD_DIM

    tok64 = (q_start + tok).to(tl.int64)
    q_offs = tok64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]  # [BLOCK_M, BLOCK_D]
    q = tl.load(q_ptr + q_offs, mask=d_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # key ranges (block-aligned from 0):  [lo, full_lo) masked | [full_lo, full_hi) unmasked | [full_hi, hi) masked
    first_pos = prefix_len + row0 // GROUP
    last_pos = prefix_len + (tl.minimum(row0 + BLOCK_M, num_rows) - 1) // GROUP
    hi = last_pos + 1
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(full_lo, full_hi)
    else:
        lo = 0
        full_lo = 0
    if SPLIT:  # this program's share of [lo, hi), block-aligned; the three ranges clip to it
        chunk = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        s_lo = lo + split * chunk
        s_hi = tl.minimum(s_lo + chunk, hi)
        full_lo = tl.minimum(tl.maximum(full_lo, s_lo), s_hi)
        full_hi = tl.minimum(tl.maximum(full_hi, s_lo), s_hi)
        lo = tl.minimum(tl.maximum(lo, s_lo), s_hi)
        hi = s_hi

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a row may see no key in a block
    k_head_ptr = k_cache_ptr + kv_head * stride_kvh
    v_head_ptr = v_cache_ptr + kv_head * stride_kvh
    pt_row_ptr = page_table_ptr + req.to(tl.int64) * stride_pt

    if HAS_WINDOW:
        acc, l_i, m_i = extend_blocks(
            acc, l_i, m_i, q, q_pos, k_head_ptr, v_head_ptr, pt_row_ptr, stride_slot, lo, full_lo,
            seq_len, qk_scale, window, offs_d,
            PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True, HAS_WINDOW, DOT_PRECISION,
        )  # fmt: skip
    acc, l_i, m_i = extend_blocks(
        acc, l_i, m_i, q, q_pos, k_head_ptr, v_head_ptr, pt_row_ptr, stride_slot, full_lo, full_hi,
        seq_len, qk_scale, window, offs_d,
        PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, False, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = extend_blocks(
        acc, l_i, m_i, q, q_pos, k_head_ptr, v_head_ptr, pt_row_ptr, stride_slot, full_hi, hi,
        seq_len, qk_scale, window, offs_d,
        PAGE_SIZE, BLOCK_N, HEAD_DIM, BLOCK_D, True, HAS_WINDOW, DOT_PRECISION,
    )  # fmt: skip

    out_mask = row_valid[:, None] & d_valid[None, :]
    # a row may see no key at all: a graph's padding rows past a sliding window (their K/V, NaN otherwise, would
    # reach the reserved page 0 in the next layer), or a split's rows before their keys. Such a row outputs 0
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    if not SPLIT:
        out = acc * (v_scale / l_safe)[:, None]  # [BLOCK_M, BLOCK_D]
        o_offs = tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))  # [BLOCK_M]
        row = tok64 * stride_ot + head * stride_oh + split * stride_os  # [BLOCK_M]
        tl.store(o_ptr + row[:, None] + offs_d[None, :], acc * (v_scale / l_safe)[:, None], mask=out_mask)
        lse_offs = (tok64 * num_kv_heads * GROUP + head) * num_splits + split  # [BLOCK_M]
        tl.store(lse_ptr + lse_offs, lse, mask=row_valid)


@fast_launch
@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_ptr,  # [N, H, num_splits, D] fp32 normalised partial outputs
    lse_ptr,  # [N, H, num_splits] fp32 log2-sum-exp per partial (-inf: empty)
    o_ptr,  # [N, H, D]
    stride_on,
    stride_oh,
    num_splits,  # runtime (see _extend_kernel); BLOCK_S, its power of two, is what compiles
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    n = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    s_valid = offs_s < num_splits
    d_valid = offs_d < HEAD_DIM
    base = n.to(tl.int64) * NUM_HEADS + head  # (row, head) of the partials
    lse = tl.load(lse_ptr + base * num_splits + offs_s, mask=s_valid, other=float("-inf"))  # [BLOCK_S]
    part = tl.load(
        part_ptr + (base * num_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (a row that sees no key): 0, not NaN
    w = tl.exp2(lse - m)  # [BLOCK_S]; empty splits weigh 0
    den = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)  # [BLOCK_D]
    tl.store(
        o_ptr + n.to(tl.int64) * stride_on + head * stride_oh + offs_d,
        out.to(o_ptr.dtype.element_ty),
        mask=d_valid,
    )


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[n, h] = the softmax-weighted merge of part[n, h, :] ([N, H, S, D] fp32) by lse [N, H, S]."""
    num_rows, num_heads, num_splits, head_dim = part.shape
    assert part.is_contiguous() and lse.is_contiguous() and out.stride(2) == 1
    if num_rows > 0:
        pdl = use_pdl(part)
        _merge_splits_kernel[(num_rows, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), num_splits,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=max(8, triton.next_power_of_2(num_splits)),  # 4 tiny variants for 1..64 splits
            USE_PDL=pdl, num_warps=4 if head_dim >= 128 else 2, launch_pdl=pdl,
        )  # fmt: skip
    return out


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def extend_config(head_dim: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile shape and launch knobs (a config may also cap the registers: "maxnreg"), checked against an sm_90
    compile (Triton 3.9, no spills in 16-bit):
    D=128: 128x64 tiles, 8 warps, 3 stages (wgmma, ~96 KB smem, ~190-230 regs, 1 program per SM).
    float32 (a correctness path, not a serving dtype) uses exact fp32 dots and smaller tiles."""
    if interpreting():
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    if head_dim <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}


def choose_extend_splits(
    query_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    block_m: int,
    num_sms: int = 132,
    one_wave: bool = False,
) -> int:
    """Key-range splits for an extend launch (host lists, no sync): >1 only when the row blocks alone
    make few waves (one program per SM is resident) and the keys are long, e.g. a short question over
    a long cached document, where 16 programs would otherwise leave 116 of 132 SMs idle. one_wave: the
    tile holds an SM alone (triton_backend.WIDE_SHORT_TILE's 16 warps take its registers), so split to at
    most one program an SM: a second, part-filled wave cost more than it spread (below)."""
    group = num_q_heads // num_kv_heads
    programs = num_kv_heads * sum(-(-q * group // block_m) for q in query_lens)
    target = num_sms if one_wave else WAVES_PER_EXTEND * num_sms
    if programs == 0 or programs >= target:
        return 1
    # 256-row tiles, 64 new over 32K on an H100 (hit_attention_fa3.py, RESULTS.md thirty-third session): 8 programs
    # x 16 splits 0.122 ms, x 32 (two waves) 0.141; end to end x 8 / 12 / 16 / 32 splits 15.4 / 13.5 / 12.4 / 13.1 ms
    by_occupancy = target // programs if one_wave else -(-target // programs)
    by_length = -(-max(seq_lens, default=1) // MIN_KEYS_PER_EXTEND_SPLIT)
    by_memory = max(1, MAX_PARTIAL_ROWS // max(sum(query_lens) * num_q_heads, 1))
    return max(1, min(by_occupancy, by_length, by_memory, MAX_EXTEND_SPLITS))


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), (
        "the kernels need [num_pages, page_size, Hkv, D] caches with contiguous pages and rows"
    )


def extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B+1] int32
    prefix_lens: torch.Tensor,  # [B] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, max_pages] int32
    page_size: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    num_splits: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    partials: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the new tokens over their requests' paged K/V (stored already); o [T, Hq, D].

    num_splits > 1 splits each row block's key range over that many programs (see choose_extend_splits)
    and merges their fp32 partials in a second kernel. The caches may hold float8_e4m3fn values x / scale
    (an fp8 KV cache, attention/kv_quant.py): k_scale / v_scale are their per-tensor scales. `partials`: the
    unmerged (o [T, Hq, num_splits, D] fp32 normalised, lse [T, Hq, num_splits] log2) instead, at any split
    count, for a caller that merges them with attention over other keys (triton_backend's packed path).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[1] == page_size and k_cache.shape[3] == head_dim
    assert q.stride(2) == 1
    check_cache(k_cache, v_cache)
    group = num_q_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    split = num_splits > 1 or partials
    if split:
        part = torch.empty(
            num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
        dst, strides = part, (part.stride(0), part.stride(1), part.stride(2))
    if not partials:
        out = torch.empty_like(q) if out is None else out  # [T, Hq, D]
        assert out.shape == q.shape and out.stride(2) == 1
        if not split:
            dst, lse, strides = out, out, (out.stride(0), out.stride(1), 0)
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 0:
        return (part, lse) if partials else out
    cfg = extend_config(head_dim, q.dtype) if config is None else config
    row_blocks = triton.cdiv(max_query_len * group, cfg["BLOCK_M"])
    if split:
        grid = (row_blocks, num_reqs, num_kv_heads * num_splits)  # see the kernel: row blocks side by side
    else:
        grid = (num_kv_heads, num_reqs, row_blocks)
    _extend_kernel[grid](
        q, k_cache, v_cache, dst, lse, query_start_loc, prefix_lens, seq_lens, page_table,
        q.stride(0), q.stride(1), *strides,
        k_cache.stride(1), k_cache.stride(2), page_table.stride(0),
        scale * math.log2(math.e) * k_scale, v_scale, sliding_window or 0, num_splits,
        GROUP=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SPLIT=split,
        HAS_WINDOW=sliding_window is not None, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **{k: cfg[k] for k in ("maxnreg",) if k in cfg},
    )  # fmt: skip
    if partials:
        return part, lse
    if split:
        merge_splits(part, lse, out)
    return out
