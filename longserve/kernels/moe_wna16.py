"""Integer-weight experts (W4A16 / W8A16: GPTQ, AWQ, compressed-tensors pack-quantized MoE) at the two ends of
the token range, where `fused_moe`'s int path is slowest. Its tiles unpack the packed weights byte by byte and
dequantize them in fp32 once per BLOCK_M block of (token, expert) pairs: measured on an H200 (2026-12-02,
35fd681, RESULTS.md seventh session) the Qwen3-30B-A3B shape with GPTQ int4 g128 experts took 33.2 ms a decode
step at batch 1 (32K context; bf16 4.66) and 4.94 s for a cold 32K prompt (bf16 1.10).

- Decode (at most MOE_WNA16_GEMV_MAX_TOKENS tokens, 4-bit groups of whole tiles): kernels/int4_gemv.py's
  one-row GEMV routed over the (token, k) pairs, grid axis 2: gate+up [T*k, 2I] (each pair's token row times its
  expert's w13), silu(gate) * up, down [T*k, H] (each pair's row times its expert's w2), then moe_sum adds the
  k rows times their routing weights. Four launches: the split-K partials of each GEMV are added by the launch
  after it (silu * up; moe_sum), not by reductions of their own (six launches at `c9a2ca1`, where one token
  took 19.5 us a layer, the 8 experts' 18.9 MB at ~1 TB/s: launch-bound). Each pair reads its expert's packed
  weights once: at batch 1 the bytes of the 8 experts touched, a quarter of bf16's.
- Prefill (at least MOE_WNA16_DEQUANT_MIN_TOKENS tokens): every expert dequantized to the activations' dtype
  (quant_gemm.wna16_dequantize, one launch a projection), then the 16-bit fused_moe, whose grouped GEMMs run at
  the tensor cores' bf16 rate. The dequantization is paid once a layer rather than once per block of pairs:
  at the A3B shape 0.3 GB read and 1.2 GB written a layer (~0.4 ms at 4.2 TB/s) against a 16-bit MoE layer's
  ~2 ms at 8K tokens. The transient [E, 2I, H] + [E, H, I] (1.2 GB at the A3B shape) comes out of the memory
  --mem-fraction-static leaves to activations, as the dense layers' dequantized weights do (quant_gemm).
- Otherwise (in between, act order, or experts split over ranks) fused_moe's int path serves.

Rounding: the dequantize path equals `fused_moe_ref` as the 16-bit fused_moe does (the weights rounded to the
dtype, as the reference rounds them). The GEMV keeps (q - z) * s in fp32 instead of rounding each weight to
the dtype first (as the dense GEMV: quant_gemv.py's docstring), then rounds each projection, silu(gate) * up,
the weighted products and their sum where the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.extend_attention import interpreting
from longserve.kernels.int4_gemv import int4_gemv_kernel
from longserve.kernels.launch import fast_launch
from longserve.kernels.moe_reference import MoEQuant
from longserve.kernels.moe_sum import moe_sum
from longserve.kernels.quant_gemm import wna16_dequantize
from longserve.kernels.quant_gemv import _num_sms, _tile_k, split_k_output, splits_for
from longserve.kernels.quant_tiles import rounded

__all__ = [
    "MOE_WNA16_DEQUANT_MIN_TOKENS",
    "MOE_WNA16_GEMV_MAX_TOKENS",
    "dequantize_experts",
    "moe_wna16_gemv",
    "moe_wna16_path",
]

# Steps of at most this many tokens take the routed GEMV, of at least MOE_WNA16_DEQUANT_MIN_TOKENS the
# dequantized experts. Measured on an H200 (2026-12-02, c9a2ca1, tests/gpu/test_quant_kernels_gpu.py
# test_int4_experts_paths, RESULTS.md seventh session), one A3B MoE layer as CUDA graphs, us (GEMV / dequantized /
# fused int path): 1 token 19.5 / 562 / 261; 8: 89.7 / 700 / 6,084; 64: 485 / 820 / 2,980; 512: 3,631 / 999 /
# 1,636. The batch-64 decode took 31.79 ms through the GEMV against 40.91 through the dequantized experts. The
# crossover (~110 tokens by the slopes) is not timed: 64 is the largest size measured on the GEMV's side.
MOE_WNA16_GEMV_MAX_TOKENS = 64
MOE_WNA16_DEQUANT_MIN_TOKENS = 65


def _gemv_tile_k(quant: MoEQuant, k: int) -> int:
    """The routed GEMV's K tile for a projection over k (0: it cannot take it): int4_gemv's, a power of two
    of at least 16 values within one scale group, dividing K."""
    block_k = _tile_k(quant.group(k), k, 128)
    return block_k if block_k and k % block_k == 0 else 0


def moe_wna16_path(
    quant: MoEQuant,
    num_tokens: int,
    hidden_size: int,
    inter: int,
    distributed: bool,  # experts split over ranks (an expert map): remote pairs carry no local expert
) -> str:
    """Which path serves integer experts for a step of num_tokens: "gemv", "dequant" or "fused"."""
    if not quant.is_int or distributed or quant.w13_g_idx is not None or quant.w2_g_idx is not None:
        return "fused"
    if num_tokens >= MOE_WNA16_DEQUANT_MIN_TOKENS:
        return "dequant"
    gemv_ok = quant.bits == 4 and _gemv_tile_k(quant, hidden_size) and _gemv_tile_k(quant, inter)
    return "gemv" if gemv_ok and num_tokens <= MOE_WNA16_GEMV_MAX_TOKENS else "fused"


def dequantize_experts(quant: MoEQuant, w: torch.Tensor, proj: str, dtype: torch.dtype) -> torch.Tensor:
    """The experts of projection `proj` ("w13" / "w2") of packed w [E, N, K * bits / 8] in `dtype` [E, N, K]:
    one launch over all E * N rows (the layout is per row; no act order)."""
    num_experts, n, packed = w.shape
    k = packed * 8 // quant.bits
    scale, zero = getattr(quant, f"{proj}_scale"), getattr(quant, f"{proj}_zero")
    flat = wna16_dequantize(
        w.reshape(num_experts * n, packed),
        scale.reshape(num_experts * n, -1),
        None if zero is None else zero.reshape(num_experts * n, -1),
        None,
        quant.bits,
        quant.group(k),
        dtype,
    )  # [E * N, K]
    return flat.view(num_experts, n, k)


@fast_launch
@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [S, P, 2I]: gate|up rows, S split-K partial sums (fp32), or S = 1 rows in out's dtype
    out_ptr,  # [P, I]
    inter,
    num_splits,
    stride_xs,
    stride_xp,
    stride_op,
    BLOCK: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
):
    """silu(gate) * up of each pair, rounded as activation.silu_and_mul (silu to the dtype, the product
    again; by hand under the interpreter), after summing the partials in split order and rounding the
    projections to the dtype (quant_gemv.splitk_reduce's result): one launch for both."""
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    ty = out_ptr.dtype.element_ty
    row = x_ptr + pair * stride_xp + cols
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, num_splits):  # in order: deterministic
        gate += tl.load(row + s * stride_xs, mask=mask, other=0.0).to(tl.float32)
        up += tl.load(row + s * stride_xs + inter, mask=mask, other=0.0).to(tl.float32)
    gate, up = rounded(gate, ty, INTERPRET_BF16), rounded(up, ty, INTERPRET_BF16)
    act = rounded(gate / (1.0 + tl.exp(-gate)), ty, INTERPRET_BF16)
    tl.store(out_ptr + pair * stride_op + cols, rounded(act * up, ty, INTERPRET_BF16).to(ty), mask=mask)


def _routed_gemv(
    x: torch.Tensor,  # [rows, K]
    w: torch.Tensor,  # [E, N, K / 2] uint8
    scale: torch.Tensor,  # [E, N, G]
    zero: torch.Tensor | None,  # [E, N, G] uint8
    ids: torch.Tensor,  # [P] int32: each output row's expert
    x_row_div: int,  # output row p reads x row p // x_row_div
    group: int,
    block_k: int,
) -> torch.Tensor:
    """Row p = x[p // x_row_div] @ dequantize(w[ids[p]])^T: [P, N] in x's dtype, or with split-K its fp32
    partial sums [S, P, N] (the consumers add them: _silu_mul_kernel, moe_sum)."""
    num_rows, (_, n, packed) = ids.shape[0], w.shape
    k = packed * 2
    w = w if w.is_contiguous() else w.contiguous()
    assert x.stride(1) == 1 and w.data_ptr() % 16 == 0 and packed % 4 == 0, "rows of whole 32-bit words"
    # int4_gemv's rows per program (wna16_gemv_config's fast path), counting every pair's row blocks
    sms = _num_sms(x.device.index or 0) if x.device.type == "cuda" else 1
    num_tiles = k // block_k
    block_n = 256
    while block_n > 64 and triton.cdiv(n, block_n) * num_rows * min(32, num_tiles // 2) < 2 * sms:
        block_n //= 2
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    n_blocks = triton.cdiv(n, block_n)
    split = splits_for(x.device, n_blocks * num_rows, num_tiles)
    tiles_per_split, split, out = split_k_output(num_tiles, split, num_rows, n, x.dtype, x.device)
    z = zero if zero is not None else scale
    int4_gemv_kernel[(n_blocks, split, num_rows)](
        x, w.view(torch.int32), scale, z, scale, ids, out, n, group, tiles_per_split, num_tiles,
        packed // 4, scale.stride(1), z.stride(1), out.stride(0) if split > 1 else 0,
        x.stride(0), out.stride(-2), w.stride(0) // 4, scale.stride(0), z.stride(0),
        HAS_ZP=zero is not None, HAS_BIAS=False, BLOCK_N=block_n, BLOCK_K=block_k, PARTIAL=split > 1,
        INTERPRET_BF16=interpreting() and x.dtype == torch.bfloat16, ROUTED=True, X_ROW_DIV=x_row_div,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def moe_wna16_gemv(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H / 2] uint8
    w2: torch.Tensor,  # [E, H, I / 2] uint8
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    quant: MoEQuant,
    out: torch.Tensor,  # [T, H]
) -> torch.Tensor:
    """`fused_moe_ref`'s result for 4-bit experts (the module docstring: rounding) in four launches, no host
    sync: gate+up, silu * up (adding gate+up's split-K partials), down, the weighted k-sum (adding down's)."""
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter = hidden.shape[1], w13.shape[1] // 2
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    ids = topk_ids.reshape(-1).to(torch.int32)  # [T*k], pair p = (token p // k, its j = p % k)
    gate_up = _routed_gemv(
        hidden, w13, quant.w13_scale, quant.w13_zero, ids, top_k, quant.group(hidden_size),
        _gemv_tile_k(quant, hidden_size),
    )  # fmt: skip
    gate_up = gate_up if gate_up.dim() == 3 else gate_up.unsqueeze(0)  # [S, T*k, 2I]
    act = torch.empty(num_tokens * top_k, inter, dtype=hidden.dtype, device=hidden.device)  # [T*k, I]
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens * top_k, triton.cdiv(inter, block))](
        gate_up, act, inter, gate_up.shape[0], gate_up.stride(0), gate_up.stride(1), act.stride(0), BLOCK=block,
        INTERPRET_BF16=interpreting() and hidden.dtype == torch.bfloat16,
    )  # fmt: skip
    down = _routed_gemv(
        act, w2, quant.w2_scale, quant.w2_zero, ids, 1, quant.group(inter), _gemv_tile_k(quant, inter)
    )  # [T*k, H], or its partials [S, T*k, H]
    rows = down.view(*down.shape[:-2], num_tokens, top_k, hidden_size)  # [(S,) T, k, H]
    return moe_sum(rows, out, topk_weights.contiguous())
