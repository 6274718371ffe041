"""Chunked prefill of the gated delta rule in Triton (varlen, state pool); reference: `gated_delta_prefill_ref`,
whose docstring gives the math (the WY / UT form of FLA's `chunk_gated_delta_rule`, chunks of 64 tokens).

Three launches:
1. `_gdn_chunk_wy_kernel`, grid (chunks, value heads), every chunk of every request at once: the chunk's
   cumulative decay gc (stored, [T, Hv] float32), the system L = beta k k^T exp(gc_i - gc_j) (strictly lower),
   E = (I + L)^-1, and w = E (beta k exp(gc)), u = E (beta v) (stored, [T, Hv, K] and [T, Hv, V], in the inputs'
   dtype as FLA does). Chunks are numbered over the step, request after request (`chunk_map`): a chunk never
   straddles two requests, a request's last chunk may be short (its missing rows load as zeros, which change
   nothing). The inverse is built by doubling: E_1 = I, E_2b = E_b - E_b O_b E_b with O_b the part of L coupling
   the two b-halves of each 2b-block (the exact block inverse, not a series): log2(64) = 6 steps of two 64x64
   dots on the tensor cores, no row-by-row substitution loop.
2. `_gdn_chunk_h_kernel`, grid (V blocks, value heads, requests): the inter-chunk recurrence, the state block
   S [K, BLOCK_V] in float32 registers, read from the request's slot once (zeros without has_state), walked chunk
   by chunk: the state before the chunk stored (h [chunks, Hv, K, V]), v' = u - w S stored, then
   S = exp(gc_last) S + (k exp(gc_last - gc))^T v'; written back once. Two dots a chunk. With `saves`, a
   request's state before one chosen chunk is also stored, in float32's precision, into a row of the pool: a
   prefix-cache checkpoint taken inside the step (cache/manager.py `in_step_save`).
3. `_gdn_chunk_o_kernel`, grid (chunks, value heads, V blocks), every chunk at once again: its output
   o = (q exp(gc)) h + tril(q k^T exp(gc_i - gc_j)) v'.
This is FLA's split (chunk_gated_delta_rule_fwd_h, chunk_fwd_o). Until the forty-sixth session the output was
computed inside the recurrence (five dots a chunk, 255 registers and a spill at Qwen3.5's shape): on an H100
(Triton 3.6) that kernel made an illegal memory access with float32 states, where every load and store stayed
inside its arguments (interpreted with longserve/testing/memcheck.py) — Triton's open reports of kernels with
several dots faulting on sm_90 (triton-lang/triton #10486, #11366) describe the same. Split, neither kernel
spills (sm_90, Triton 3.6: 189 and 168 registers), and on an H100 (RESULTS.md, forty-seventh session) they run
with float32 and bf16 states (scripts/probes/gdn_state_crash.py: ten of ten cases, 64 to 32K tokens): one layer's
lone 8K prompt 1.01 ms (bf16 states; the fused kernel's 1.32 ms in an earlier call), 32K 3.80 ms.

Precision: q and k are l2-normalized in float32 where they are loaded (both launches). Dot operands are the
inputs' dtype, bf16 on the tensor cores with float32 sums (the state, E and v' rounded to bf16 for the products,
as FLA does); E itself is built in float32 (tf32 dots). With float32 inputs every dot is tf32x3 (~float32).
Row scales (exp(gc), beta) go on the smaller tile of each product, and tiles are addressed by int32 offsets
from per-chunk 64-bit base pointers: 64-bit pointer tiles cost two registers an element.

Not yet done (against FLA's kernels, not yet timed beside them): the recurrence reloads and
renormalizes k a V block; our inverse spends 12 full 64x64 dots where FLA substitutes in 16x16 diagonal blocks and
merges them; FLA fuses the gate (and its cumsum) into its launches and autotunes blocks, warps and stages; the
l2norm, done here on every load, is its own pass there. h and v' cost (T / 64) x Hv x K x V and T x Hv x V values
of scratch in the inputs' dtype, as FLA's do (192 MiB for an 8K step at Qwen3.5's shape in bf16, freed after each
layer's call and reused by the next; from the memory mem_fraction_static leaves to activations). Kernels 1 and 3
have grids sized for the worst case (T/64 + B chunks, so no device-to-host sync): their extra programs exit at once.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from longserve.kernels.gated_delta_reference import CHUNK, gated_delta_prefill_ref
from longserve.kernels.launch import fast_launch

__all__ = ["gated_delta_prefill", "gated_delta_prefill_ref"]

# (chunk_req [N] int32, cu_chunks [B+1] int32, N): `chunk_map`
ChunkMap = tuple[torch.Tensor, torch.Tensor, int]
# (save_chunk [B] int32, save_row [B] int64): states saved inside a step (`gated_delta_prefill`)
StateSaves = tuple[torch.Tensor, torch.Tensor]

# The recurrence's value block (4 programs a head at V = 128: B * Hv * 4 programs, 128 for one prompt at Hv = 32),
# 4 warps: 189 registers at Qwen3.5's shape on sm_90 (Triton 3.6), no spill.
_STATE_BLOCK_V = 32
# the output kernel's value block (FLA's chunk_fwd_o tunes 64 or 128): (chunks, Hv, V / 64) programs
_OUT_BLOCK_V = 64


@triton.jit
def _load_qk(base, offs_t, row_ok, stride_t, offs_k, K: tl.constexpr, L2NORM: tl.constexpr):
    """[BT, BK] rows of one q/k head from `base` (its first row) in float32, l2-normalized as HF does
    (x * rsqrt(sum x^2 + 1e-6)) when L2NORM. The offsets are int32 from a per-chunk base pointer: 64-bit pointer
    tiles cost two registers an element."""
    mask = row_ok[:, None] & (offs_k[None, :] < K)
    x = tl.load(base + offs_t[:, None] * stride_t + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.math.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


# Triton's interpreter multiplies the raw bits in a 16-bit dot: interpreted, _mma multiplies the rounded operands in
# float32 instead (the same products, exact). A module constant, not a kernel argument, so that the launches the
# interpreted tests record are compiled (tests/conftest.py's sm90 check) with the GPU's 16-bit dots.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _mma(a, b, DT: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with both operands rounded to DT (the inputs' dtype: bf16 on the tensor cores), float32 sums."""
    a = a.to(DT)
    b = b.to(DT)
    if _INTERPRETED:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@fast_launch
@triton.jit
def _gdn_chunk_wy_kernel(
    k_ptr,  # [T, Hk, K], unit stride along K
    v_ptr,  # [T, Hv, V]
    g_ptr,  # [T, Hv] float32 (log decay of each token)
    beta_ptr,  # [T, Hv]
    gc_ptr,  # out [T, Hv] float32: g summed from the chunk's start
    w_ptr,  # out [T, Hv, K]
    u_ptr,  # out [T, Hv, V]
    qsl_ptr,  # [B+1] int32
    chunk_req_ptr,  # [max chunks] int32: the chunk's request (B past the last chunk)
    cu_chunks_ptr,  # [B+1] int32: the first chunk of each request
    num_reqs,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    H: tl.constexpr,  # value heads
    GROUP: tl.constexpr,  # value heads a q/k head serves
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    LOG2_BT: tl.constexpr,
    L2NORM: tl.constexpr,
    PRECISION: tl.constexpr,  # float32 dots: "tf32x3" (~float32) for float32 inputs, else "tf32"
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.load(chunk_req_ptr + chunk)
    if req >= num_reqs:  # the grid is sized for the worst case
        return
    t0 = tl.load(qsl_ptr + req) + (chunk - tl.load(cu_chunks_ptr + req)) * BT  # the chunk's first token
    offs_t = tl.arange(0, BT)
    # [BT] rows of the request (its last chunk may be short)
    row_ok = offs_t < tl.load(qsl_ptr + req + 1) - t0
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    t0 = t0.to(tl.int64)  # scalar 64-bit bases, int32 offsets within the chunk

    g = tl.load(g_ptr + t0 * stride_gt + head + offs_t * stride_gt, mask=row_ok, other=0.0).to(tl.float32)
    # [BT]: missing rows add 0, so they carry the chunk's total (and exp(gc_i - gc_j) <= 1 for i >= j)
    gc = tl.cumsum(g, axis=0)
    tl.store(gc_ptr + t0 * H + head + offs_t * H, gc, mask=row_ok)
    beta = tl.load(beta_ptr + t0 * stride_bt + head + offs_t * stride_bt, mask=row_ok, other=0.0)
    beta = beta.to(tl.float32)
    k_base = k_ptr + t0 * stride_kt + (head // GROUP) * stride_kh
    dt = k_ptr.dtype.element_ty  # dot operands: the inputs' dtype (tiles held so: half the registers in bf16)
    k = _load_qk(k_base, offs_t, row_ok, stride_kt, offs_k, K, L2NORM).to(dt)  # [BT, BK]

    # L [BT, BT]: beta_i k_i.k_j exp(gc_i - gc_j) for i > j
    ii = offs_t[:, None]
    jj = offs_t[None, :]
    kk = _mma(k, tl.trans(k), dt, PRECISION)  # [BT, BT]
    lower_mask = ii > jj
    # exp of 0 above the diagonal: there gc_i - gc_j > 0 may overflow
    decay = tl.where(lower_mask, tl.exp(tl.where(lower_mask, gc[:, None] - gc[None, :], 0.0)), 0.0)
    lower = kk * decay * beta[:, None]

    # E = (I + L)^-1 by doubling the solved block size: E_2b = E_b - E_b O_b E_b, where O_b holds L's entries
    # coupling the halves of each 2b-block (rows of the lower half, columns of the upper)
    inv = tl.where(ii == jj, 1.0, 0.0)  # [BT, BT] E_1 = I
    blk = 1
    for _ in tl.static_range(LOG2_BT):
        couple = ((ii // (2 * blk)) == (jj // (2 * blk))) & ((ii // blk) != (jj // blk))
        off = tl.where(couple, lower, 0.0)
        inv = inv - tl.dot(inv, tl.dot(off, inv, input_precision=PRECISION), input_precision=PRECISION)
        blk = blk * 2

    # w = E (beta k exp(gc)) [BT, BK], u = E (beta v) [BT, BV], rows of [T, Hv, *] scratch; the row scales of
    # k and v applied to E's columns ([BT, BT], the smaller tile), E rounded to the inputs' dtype as FLA does
    w = _mma(inv * (beta * tl.exp(gc))[None, :], k, dt, PRECISION)
    k_mask = row_ok[:, None] & (offs_k[None, :] < K)
    w_tile = w_ptr + (t0 * H + head) * K + offs_t[:, None] * (H * K) + offs_k[None, :]
    tl.store(w_tile, w.to(w_ptr.dtype.element_ty), mask=k_mask)
    v_mask = row_ok[:, None] & (offs_v[None, :] < V)
    v_tile = v_ptr + t0 * stride_vt + head * stride_vh + offs_t[:, None] * stride_vt + offs_v[None, :]
    v = tl.load(v_tile, mask=v_mask, other=0.0)
    u = _mma(inv * beta[None, :], v, dt, PRECISION)
    u_tile = u_ptr + (t0 * H + head) * V + offs_t[:, None] * (H * V) + offs_v[None, :]
    tl.store(u_tile, u.to(u_ptr.dtype.element_ty), mask=v_mask)


@fast_launch
@triton.jit
def _gdn_chunk_h_kernel(
    k_ptr,  # [T, Hk, K]
    gc_ptr,  # [T, Hv] float32
    w_ptr,  # [T, Hv, K]
    u_ptr,  # [T, Hv, V]
    h_ptr,  # out [chunks, Hv, K, V] in the inputs' dtype: the state before each chunk
    vn_ptr,  # out [T, Hv, V] in the inputs' dtype: v' = u - w S
    state_ptr,  # [S, Hv, K, V]
    qsl_ptr,
    cu_chunks_ptr,  # [B+1] int32: the first chunk of each request
    slot_ptr,
    has_state_ptr,
    save_chunk_ptr,  # [B] int32: the chunk before which the state is saved (-1: none); read with SAVE
    save_row_ptr,  # [B] int64: the pool row it is saved into
    stride_kt,
    stride_kh,
    stride_ss,
    stride_sh,
    stride_sk,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
    PRECISION: tl.constexpr,
    SAVE: tl.constexpr,
):
    vb = tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    first_chunk = tl.load(cu_chunks_ptr + req)
    slot = tl.load(slot_ptr + req)
    offs_t = tl.arange(0, BT)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    kv_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)  # [BK, BLOCK_V]
    s_offs = offs_k[:, None] * stride_sk + offs_v[None, :]  # int32 tile offsets
    s_base = state_ptr + slot.to(tl.int64) * stride_ss + head * stride_sh
    read = (slot >= 0) & (tl.load(has_state_ptr + req) != 0)
    # the scalar broadcast before it meets the mask (the interpreter mis-types scalar & tensor)
    read_mask = kv_mask & ((read.to(tl.int32) + tl.zeros([BK, BLOCK_V], tl.int32)) != 0)
    state = tl.load(s_base + s_offs, mask=read_mask, other=0.0).to(tl.float32)  # [BK, BLOCK_V]
    dt = k_ptr.dtype.element_ty
    k_head = k_ptr + (head // GROUP) * stride_kh  # GQA: value head h reads k head h // GROUP
    h_offs = offs_k[:, None] * V + offs_v[None, :]  # [BK, BLOCK_V] in one chunk's [K, V] block of a head
    save_chunk = -1
    save_base = state_ptr
    if SAVE:
        save_chunk = tl.load(save_chunk_ptr + req)
        save_base = state_ptr + tl.load(save_row_ptr + req) * stride_ss + head * stride_sh
    for c in range(0, tl.cdiv(end - start, BT)):
        t0 = start + c * BT  # the chunk's first token
        row_ok = offs_t < end - t0  # [BT]
        last = tl.minimum(BT, end - t0) - 1
        h_base = h_ptr + ((first_chunk + c).to(tl.int64) * H + head) * (K * V)
        tl.store(h_base + h_offs, state.to(h_ptr.dtype.element_ty), mask=kv_mask)
        if SAVE:  # the state after the request's first c chunks, unrounded (h holds it in the inputs' dtype)
            here = ((c == save_chunk).to(tl.int32) + tl.zeros([BK, BLOCK_V], tl.int32)) != 0
            tl.store(save_base + s_offs, state.to(state_ptr.dtype.element_ty), mask=kv_mask & here)
        t0 = t0.to(tl.int64)  # 64-bit scalar bases, int32 offsets within the chunk
        gc_base = gc_ptr + t0 * H + head
        g_last = tl.load(gc_base + last * H)
        gc = tl.load(gc_base + offs_t * H, mask=row_ok, other=0.0)
        k_mask = row_ok[:, None] & (offs_k[None, :] < K)
        w_tile = w_ptr + (t0 * H + head) * K + offs_t[:, None] * (H * K) + offs_k[None, :]
        w = tl.load(w_tile, mask=k_mask, other=0.0)
        v_mask = row_ok[:, None] & (offs_v[None, :] < V)
        uv_offs = (t0 * H + head) * V + offs_t[:, None] * (H * V) + offs_v[None, :]  # [BT, BLOCK_V] u, v'
        u = tl.load(u_ptr + uv_offs, mask=v_mask, other=0.0).to(tl.float32)
        # v' = u - w S: the part of the chunk's values that the state before it does not predict
        v_new = u - _mma(w, state, dt, PRECISION)  # [BT, BLOCK_V]
        tl.store(vn_ptr + uv_offs, v_new.to(vn_ptr.dtype.element_ty), mask=v_mask)
        # S <- exp(gc_last) S + (k exp(gc_last - gc))^T v' (the row scale on v'; missing rows of k are 0)
        k = _load_qk(k_head + t0 * stride_kt, offs_t, row_ok, stride_kt, offs_k, K, L2NORM).to(dt)
        v_end = v_new * tl.exp(g_last - tl.where(row_ok, gc, g_last))[:, None]
        state = state * tl.exp(g_last) + _mma(tl.trans(k), v_end, dt, PRECISION)
    write_mask = kv_mask & (((slot >= 0).to(tl.int32) + tl.zeros([BK, BLOCK_V], tl.int32)) != 0)
    s_offs = offs_k[:, None] * stride_sk + offs_v[None, :]
    tl.store(s_base + s_offs, state.to(state_ptr.dtype.element_ty), mask=write_mask)


@fast_launch
@triton.jit
def _gdn_chunk_o_kernel(
    q_ptr,  # [T, Hk, K]
    k_ptr,  # [T, Hk, K]
    gc_ptr,  # [T, Hv] float32
    h_ptr,  # [chunks, Hv, K, V]: the state before each chunk
    vn_ptr,  # [T, Hv, V]: v'
    o_ptr,  # out [T, Hv, V]
    qsl_ptr,
    chunk_req_ptr,  # [max chunks] int32: the chunk's request (B past the last chunk)
    cu_chunks_ptr,
    num_reqs,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    H: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    vb = tl.program_id(2)
    req = tl.load(chunk_req_ptr + chunk)
    if req >= num_reqs:  # the grid is sized for the worst case
        return
    t0 = tl.load(qsl_ptr + req) + (chunk - tl.load(cu_chunks_ptr + req)) * BT  # the chunk's first token
    offs_t = tl.arange(0, BT)
    rows = tl.load(qsl_ptr + req + 1) - t0
    row_ok = offs_t < rows  # [BT]
    offs_k = tl.arange(0, BK)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    t0 = t0.to(tl.int64)  # 64-bit scalar bases, int32 offsets within the chunk
    dt = k_ptr.dtype.element_ty
    gc_base = gc_ptr + t0 * H + head
    g_last = tl.load(gc_base + (tl.minimum(BT, rows) - 1) * H)
    # missing rows (q, k, v' 0 there) carry the last one's: exp(gc_i - gc_j) <= 1 still, no overflow
    gc = tl.where(row_ok, tl.load(gc_base + offs_t * H, mask=row_ok, other=0.0), g_last)  # [BT]
    q = _load_qk(
        q_ptr + t0 * stride_qt + (head // GROUP) * stride_qh, offs_t, row_ok, stride_qt, offs_k, K, L2NORM
    )
    q = (q * scale).to(dt)  # [BT, BK]
    k = _load_qk(k_ptr + t0 * stride_kt + (head // GROUP) * stride_kh, offs_t, row_ok, stride_kt, offs_k, K,
                 L2NORM).to(dt)  # fmt: skip
    kv_mask = (offs_k[:, None] < K) & (offs_v[None, :] < V)
    h_base = h_ptr + (chunk.to(tl.int64) * H + head) * (K * V)
    h = tl.load(h_base + offs_k[:, None] * V + offs_v[None, :], mask=kv_mask, other=0.0)  # [BK, BLOCK_V]
    v_mask = row_ok[:, None] & (offs_v[None, :] < V)
    uv_offs = (t0 * H + head) * V + offs_t[:, None] * (H * V) + offs_v[None, :]
    v_new = tl.load(vn_ptr + uv_offs, mask=v_mask, other=0.0)  # [BT, BLOCK_V]
    causal = offs_t[:, None] >= offs_t[None, :]
    attn = _mma(q, tl.trans(k), dt, PRECISION)  # [BT, BT]
    attn = tl.where(causal, attn * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    # o = (q exp(gc)) S + attn v' (the row scale after the product)
    o = _mma(q, h, dt, PRECISION) * tl.exp(gc)[:, None] + _mma(attn, v_new, dt, PRECISION)
    tl.store(o_ptr + uv_offs, o.to(o_ptr.dtype.element_ty), mask=v_mask)


def chunk_map(query_start_loc: torch.Tensor, num_tokens: int) -> ChunkMap:
    """(chunk_req [N] int32, cu_chunks [B+1] int32, N): the chunks of 64 of each request, numbered request after
    request, computed on the device without a sync; N = cdiv(T, 64) + B bounds their count (each request adds
    at most one partial chunk) and chunk_req is B past the last one. The same for every layer of a step: a model
    computes it once a step and hands it to each layer's `gated_delta_prefill` (seven small ops a call, called
    once a layer it took 4.0 of the 12-layer Qwen3-Next hit's 54.7 ms under cProfile, H100, 2026-12-07)."""
    lens = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    cu_chunks = torch.zeros_like(query_start_loc)
    cu_chunks[1:] = torch.cumsum((lens + CHUNK - 1) // CHUNK, 0)
    bound = triton.cdiv(num_tokens, CHUNK) + lens.shape[0]
    ids = torch.arange(bound, dtype=cu_chunks.dtype, device=cu_chunks.device)
    chunk_req = torch.searchsorted(cu_chunks[1:].contiguous(), ids, right=True).to(torch.int32)
    return chunk_req, cu_chunks, bound


def gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunks: ChunkMap | None = None,
    saves: StateSaves | None = None,
) -> torch.Tensor:
    """q, k [T, Hk, K], v [T, Hv, V] (unit stride along K / V, any token and head strides), g [T, Hv] float32,
    beta [T, Hv], states [S, Hv, K, V] -> o [T, Hv, V] in v's dtype; each request's final state is written to
    states[slot] in the pool's dtype. Same math as `gated_delta_prefill_ref`. `chunks`: the step's `chunk_map`
    (computed here when not given). `saves` (save_chunk [B] int32, save_row [B] int64): request r's state after
    its first save_chunk[r] chunks of this step is also written to states[save_row[r]] (save_chunk -1: none)."""
    num_tokens, num_k_heads, head_k = k.shape
    num_v_heads, head_v = v.shape[1:]
    assert q.shape == k.shape and v.shape[0] == num_tokens and num_v_heads % num_k_heads == 0, "q/k/v shapes"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "unit stride along the head dim"
    assert g.shape == beta.shape == (num_tokens, num_v_heads) and g.stride(1) == 1 and beta.stride(1) == 1
    assert states.shape[1:] == (num_v_heads, head_k, head_v) and states.stride(3) == 1, "states [S, Hv, K, V]"
    assert head_k >= 16 and head_v >= 16, "head dims of 16 or more (tl.dot's smallest tile)"
    scale = head_k**-0.5 if scale is None else scale
    o = torch.empty(num_tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    num_reqs = slots.shape[0]
    if num_reqs == 0:  # (requests of no tokens still get their state: kept, or zeros without has_state)
        return o
    group = num_v_heads // num_k_heads
    block_k, block_v = triton.next_power_of_2(head_k), triton.next_power_of_2(head_v)
    precision = "tf32x3" if k.dtype == torch.float32 else "tf32"
    chunk_req, cu_chunks, bound = chunk_map(query_start_loc, num_tokens) if chunks is None else chunks
    gc = torch.empty(num_tokens, num_v_heads, dtype=torch.float32, device=v.device)
    w = torch.empty(num_tokens, num_v_heads, head_k, dtype=k.dtype, device=v.device)
    u = torch.empty(num_tokens, num_v_heads, head_v, dtype=v.dtype, device=v.device)
    _gdn_chunk_wy_kernel[(bound, num_v_heads)](
        k, v, g, beta, gc, w, u, query_start_loc, chunk_req, cu_chunks, num_reqs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        H=num_v_heads, GROUP=group, K=head_k, V=head_v, BT=CHUNK, BK=block_k, BV=block_v,
        LOG2_BT=CHUNK.bit_length() - 1, L2NORM=use_qk_l2norm, PRECISION=precision, num_warps=4,
    )  # fmt: skip
    block_sv = min(_STATE_BLOCK_V, block_v)
    # the state before each chunk and v' (the inputs' dtype, as the products round them), then each chunk's output
    h = torch.empty(bound, num_v_heads, head_k, head_v, dtype=k.dtype, device=v.device)
    v_new = torch.empty(num_tokens, num_v_heads, head_v, dtype=k.dtype, device=v.device)
    save_chunk, save_row = (slots, slots) if saves is None else saves  # (unread without saves)
    _gdn_chunk_h_kernel[(triton.cdiv(head_v, block_sv), num_v_heads, num_reqs)](
        k, gc, w, u, h, v_new, states, query_start_loc, cu_chunks, slots, has_state, save_chunk, save_row,
        k.stride(0), k.stride(1), states.stride(0), states.stride(1), states.stride(2),
        H=num_v_heads, GROUP=group, K=head_k, V=head_v, BT=CHUNK, BK=block_k, BLOCK_V=block_sv,
        L2NORM=use_qk_l2norm, PRECISION=precision, SAVE=saves is not None, num_warps=4,
    )  # fmt: skip
    _gdn_chunk_o_kernel[(bound, num_v_heads, triton.cdiv(head_v, _OUT_BLOCK_V))](
        q, k, gc, h, v_new, o, query_start_loc, chunk_req, cu_chunks, num_reqs, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        H=num_v_heads, GROUP=group, K=head_k, V=head_v, BT=CHUNK, BK=block_k,
        BLOCK_V=min(_OUT_BLOCK_V, block_v), L2NORM=use_qk_l2norm, PRECISION=precision, num_warps=4,
    )  # fmt: skip
    return o
