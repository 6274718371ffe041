"""Causal depthwise conv of the Gated DeltaNet layers in Triton, varlen and state-pool aware; references:
`causal_conv1d_prefill_ref`, `causal_conv1d_decode_ref` (the math and the state layout are in
causal_conv1d_reference.py's docstring).

Prefill, two launches:
- `_conv1d_prefill_kernel`, grid (token blocks of the whole step, channel blocks): output tokens need not share
  a request, so each token finds its request by a binary search over `query_start_loc` (log2 B loads, vectorized
  over the block) and takes each of its W taps from x when it falls inside its request, else from its slot's
  state (`has_state`), else zero. Channels are the contiguous dim of x, y and the state rows, so every tap is
  one coalesced row load; the W overlapping rows of neighbouring tokens come from L1/L2.
- `_conv1d_state_kernel`, grid (requests, channel blocks), after it: each slot's new W-1 inputs, which may mix
  the old state and the new tokens. Apart because the first launch's programs read the old states that this one
  overwrites. In place: row i is written with what row L+i held, so rows are read and written in increasing
  order, all by the thread that owns the channel (BLOCK_D covers the CTA's threads once: no replicated owner).

Decode, `_conv1d_decode_kernel`, grid (requests, channel blocks): one token each, the state read once, shifted by
one row in place in the same pass (each row read before it is overwritten, by the same thread), then the token
appended. Accumulation in float32, one rounding to x's dtype; slot -1: zero state, nothing written.

Not yet (against vLLM's / the causal-conv1d package's kernels; nothing here is timed on a GPU yet): decode takes
one token a request (no multi-token update for speculative decoding), the prefill's state update is a second
launch, and the conv is not fused with the q/k/v split, the gating or the l2norm that follow it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.causal_conv1d_reference import causal_conv1d_decode_ref, causal_conv1d_prefill_ref
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl

__all__ = [
    "causal_conv1d_decode",
    "causal_conv1d_decode_ref",
    "causal_conv1d_prefill",
    "causal_conv1d_prefill_ref",
]

# Prefill: 16 tokens x 256 channels a program at 8 warps, 16 values a thread (sm90 compile, Triton 3.9, bf16:
# 167 registers, no spills; at 4 warps the W taps' two masked loads each spill ~200 bytes).
# (W-1)/16 of the row loads re-read a neighbour block's rows (from L2).
_BLOCK_T = 16
_BLOCK_D = 256
# the state and decode kernels: 2 warps x 32 threads x 4 channels = 256, each channel owned by one thread
_NUM_WARPS = 2


@triton.jit
def _find_request(qsl_ptr, tok, num_reqs, search_steps):
    """[BLOCK_T] tokens -> the request each falls in: the largest n < B with query_start_loc[n] <= token (an empty
    request never wins: the next one starts where it does). ceil(log2 B) halvings of [lo, hi)."""
    lo = tl.zeros_like(tok)
    hi = tl.zeros_like(tok) + num_reqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(qsl_ptr + mid) <= tok
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@fast_launch
@triton.jit
def _conv1d_prefill_kernel(
    x_ptr,  # [T, D], unit stride along D
    w_ptr,  # [D, W]
    bias_ptr,  # [D] (unused without HAS_BIAS)
    state_ptr,  # [S, W-1, D], unit stride along D
    y_ptr,  # [T, D]
    qsl_ptr,  # [B+1] int32
    slot_ptr,  # [B] int32
    has_state_ptr,  # [B] bool
    num_reqs,
    dim,
    stride_x,
    stride_w,
    stride_ss,  # state: slot stride
    stride_sr,  # state: row stride
    stride_y,
    search_steps,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_T
    offs_t = tl.arange(0, BLOCK_T)
    tok = first + offs_t  # [BLOCK_T]
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    ch_ok = ch < dim
    req = _find_request(qsl_ptr, tok, num_reqs, search_steps)  # [BLOCK_T]
    tok_ok = tok < tl.load(qsl_ptr + num_reqs)  # rows past the step's last token: none of ours
    slot = tl.load(slot_ptr + req)
    from_state = tok_ok & (slot >= 0) & (tl.load(has_state_ptr + req) != 0)  # [BLOCK_T]
    pos = tok - tl.load(qsl_ptr + req)  # [BLOCK_T] position in the request
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)[None, :]
    # int32 tile offsets from 64-bit scalar bases (a 64-bit pointer tile costs two registers an element): x's
    # rows from the block's first token, the state's from the pool's start (the wrapper bounds its size)
    x_blk = x_ptr + first.to(tl.int64) * stride_x
    state_rows = slot[:, None] * stride_ss + ch[None, :]  # [BLOCK_T, BLOCK_D]
    for j in tl.static_range(WIDTH):
        src = pos + (j - (WIDTH - 1))  # [BLOCK_T] where tap j reads, relative to the request's start
        in_x = (tok_ok & (src >= 0))[:, None] & ch_ok[None, :]
        x_rows = (offs_t + (j - (WIDTH - 1)))[:, None] * stride_x + ch[None, :]
        xs = tl.load(x_blk + x_rows, mask=in_x, other=0.0)
        in_s = (from_state & (src < 0))[:, None] & ch_ok[
            None, :
        ]  # state row W-1+src (W-1: just before start)
        ss = tl.load(state_ptr + state_rows + (src + (WIDTH - 1))[:, None] * stride_sr, mask=in_s, other=0.0)
        wj = tl.load(w_ptr + ch * stride_w + j, mask=ch_ok, other=0.0).to(tl.float32)  # [BLOCK_D]
        acc += (xs.to(tl.float32) + ss.to(tl.float32)) * wj[None, :]  # one of the two is zero
    if SILU:
        acc = acc * tl.sigmoid(acc)
    y_rows = y_ptr + first.to(tl.int64) * stride_y + offs_t[:, None] * stride_y + ch[None, :]
    tl.store(y_rows, acc.to(y_ptr.dtype.element_ty), mask=tok_ok[:, None] & ch_ok[None, :])


@fast_launch
@triton.jit
def _conv1d_state_kernel(
    x_ptr,
    state_ptr,
    qsl_ptr,
    slot_ptr,
    has_state_ptr,
    dim,
    stride_x,
    stride_ss,
    stride_sr,
    WIDTH: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    slot = tl.load(slot_ptr + req)
    if slot < 0:
        return
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    ch_ok = ch < dim
    start = tl.load(qsl_ptr + req)
    length = tl.load(qsl_ptr + req + 1) - start
    # scalars broadcast to [BLOCK_D] before they meet a mask (the interpreter mis-types scalar & tensor)
    keep_old = ch_ok & ((tl.load(has_state_ptr + req) + tl.zeros_like(ch)) != 0)  # [BLOCK_D]
    rows = state_ptr + slot.to(tl.int64) * stride_ss + ch  # [BLOCK_D]
    for i in tl.static_range(WIDTH - 1):
        # [BLOCK_D] new row i is input `src` of the request
        src = length - (WIDTH - 1) + i + tl.zeros_like(ch)
        xs = tl.load(x_ptr + (start + src).to(tl.int64) * stride_x + ch, mask=ch_ok & (src >= 0), other=0.0)
        old = tl.load(rows + (length + i) * stride_sr, mask=keep_old & (src < 0), other=0.0)  # old row L+i
        new = tl.where(src >= 0, xs.to(tl.float32), old.to(tl.float32))
        tl.store(rows + i * stride_sr, new.to(state_ptr.dtype.element_ty), mask=ch_ok)


@fast_launch
@triton.jit
def _conv1d_decode_kernel(
    x_ptr,  # [B, D]
    w_ptr,
    bias_ptr,
    state_ptr,
    y_ptr,
    slot_ptr,
    dim,
    stride_x,
    stride_w,
    stride_ss,
    stride_sr,
    stride_y,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    req = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    ch_ok = ch < dim
    slot = tl.load(slot_ptr + req)  # the host's slots: no kernel of the step writes them
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_ok, other=0.0).to(tl.float32)
    pdl_prologue(USE_PDL)
    x = tl.load(x_ptr + req.to(tl.int64) * stride_x + ch, mask=ch_ok, other=0.0)
    has = ch_ok & ((slot + tl.zeros_like(ch)) >= 0)  # scalar broadcast first (see _conv1d_state_kernel)
    rows = state_ptr + slot.to(tl.int64) * stride_ss + ch  # [BLOCK_D]
    for j in tl.static_range(WIDTH - 1):
        s = tl.load(rows + j * stride_sr, mask=has, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + ch * stride_w + j, mask=ch_ok, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(rows + (j - 1) * stride_sr, s, mask=has)  # shift: row j-1 <- row j, read just above
    w_last = tl.load(w_ptr + ch * stride_w + (WIDTH - 1), mask=ch_ok, other=0.0).to(tl.float32)
    acc += x.to(tl.float32) * w_last  # the new token: the last tap
    tl.store(rows + (WIDTH - 2) * stride_sr, x.to(state_ptr.dtype.element_ty), mask=has)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + req.to(tl.int64) * stride_y + ch, acc.to(y_ptr.dtype.element_ty), mask=ch_ok)


def _silu(activation: str | None) -> bool:
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported conv activation {activation!r} (None, 'silu' or 'swish')")


def _check(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> int:
    dim, width = weight.shape
    assert width >= 2 and weight.stride(1) == 1, "weight: [D, W] with unit stride along W, W >= 2"
    assert x.shape[-1] == dim and x.stride(-1) == 1, "x: [*, D] with unit stride along D"
    assert conv_states.shape[1:] == (width - 1, dim) and conv_states.stride(-1) == 1, (
        "conv_states: [S, W-1, D]"
    )
    return width


def causal_conv1d_prefill(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    slots: torch.Tensor,
    has_state: torch.Tensor,
    activation: str | None = "silu",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, D] (unit stride along D), weight [D, W], conv_states [S, W-1, D] -> y [T, D] in x's dtype; each
    request's slot then holds its last W-1 inputs. Same math as `causal_conv1d_prefill_ref`."""
    width = _check(x, weight, conv_states)
    assert conv_states.numel() < 2**31, "the prefill kernel addresses the pool by int32 offsets"
    num_tokens, dim = x.shape
    num_reqs = slots.shape[0]
    y = torch.empty(num_tokens, dim, dtype=x.dtype, device=x.device)
    if num_reqs == 0:
        return y
    if num_tokens > 0:  # (requests of no tokens still get their state: kept, or zeros without has_state)
        grid = (triton.cdiv(num_tokens, _BLOCK_T), triton.cdiv(dim, _BLOCK_D))
        _conv1d_prefill_kernel[grid](
            x, weight, bias if bias is not None else weight, conv_states, y, query_start_loc, slots, has_state,
            num_reqs, dim, x.stride(0), weight.stride(0), conv_states.stride(0), conv_states.stride(1),
            y.stride(0), (num_reqs - 1).bit_length(),  # ceil(log2 B) search steps
            WIDTH=width, HAS_BIAS=bias is not None, SILU=_silu(activation), BLOCK_T=_BLOCK_T, BLOCK_D=_BLOCK_D,
            num_warps=8,
        )  # fmt: skip
    _conv1d_state_kernel[(num_reqs, triton.cdiv(dim, _BLOCK_D))](
        x, conv_states, query_start_loc, slots, has_state, dim, x.stride(0), conv_states.stride(0),
        conv_states.stride(1), WIDTH=width, BLOCK_D=_BLOCK_D, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return y


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [B, D] (one token a request, unit stride along D) -> y [B, D] in x's dtype; each slot's inputs shift by
    one in place. Same math as `causal_conv1d_decode_ref`."""
    width = _check(x, weight, conv_states)
    batch, dim = x.shape
    y = torch.empty(batch, dim, dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    pdl = use_pdl(x)
    _conv1d_decode_kernel[(batch, triton.cdiv(dim, _BLOCK_D))](
        x, weight, bias if bias is not None else weight, conv_states, y, slots, dim, x.stride(0), weight.stride(0),
        conv_states.stride(0), conv_states.stride(1), y.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, SILU=_silu(activation), BLOCK_D=_BLOCK_D, USE_PDL=pdl,
        num_warps=_NUM_WARPS, launch_pdl=pdl,
    )  # fmt: skip
    return y
