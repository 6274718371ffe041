"""The sum over the k experts of each token's weighted down projections, [T, k, H] -> [T, H]: fp32 accumulation
in expert order, rounded once to the output's dtype (as `torch.sum(x, dim=1, out=out)` of 16-bit x gives, up to
its summation order). Reference: that torch.sum.

Why a kernel of its own: in the A3B decode at batch 1 torch's reduction took 4.8 us a layer for 8 x 2048
values (48 launches, 0.23 ms of a 3.98 ms step, 2026-12-02 profile, benchmarks/RESULTS.md), a fixed cost of its
launch configuration rather than of the 32 KB it reads. `fused_moe.MOE_SUM_TRITON_MAX_TOKENS` routes steps of
a few tokens here (up to 8 since it measured faster on an H200, RESULTS.md sixth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.activation import ROUNDED_AS_TORCH, plus_sigmoid_gated
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl
from longserve.kernels.quant_tiles import rounded

__all__ = ["moe_sum"]


@fast_launch
@triton.jit
def _moe_sum_kernel(
    x_ptr,  # [S, T, k, H]: S = 1, or split-K partial sums (fp32) of each row
    out_ptr,  # [T, H]
    w_ptr,  # HAS_WEIGHTS: [T, k] routing weights, each row's multiplier
    gate_ptr,  # ADDEND: [T, 1] a shared expert's gate logits
    shared_ptr,  # ADDEND: [T, H] the shared expert's output
    hidden_size,
    num_splits,
    stride_xs,
    stride_xt,
    stride_xk,
    stride_ot,
    stride_wt,
    stride_gt,
    stride_st,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,  # the products rounded to the rows' dtype (16-bit weights) before the sum
    PARTIALS: tl.constexpr,  # x holds fp32 partial sums: each row rounded to out's dtype once summed
    ADDEND: tl.constexpr,  # + sigmoid(gate) * shared, after the sum's rounding (torch's three ops' roundings)
    INTERPRET_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,  # programmatic dependent launch (kernels/launch.py)
):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden_size
    out_ty = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # in order: deterministic
        row = x_ptr + token * stride_xt + j * stride_xk + offs
        v = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        for s in range(1, num_splits):  # partials: in split order, then the row rounded as a projection
            v += tl.load(row + s * stride_xs, mask=mask, other=0.0)
        if PARTIALS:
            v = rounded(v, out_ty, INTERPRET_BF16)
        if HAS_WEIGHTS:
            v = v * tl.load(w_ptr + token * stride_wt + j).to(tl.float32)
            if ROUND_PRODUCT:
                v = rounded(v, out_ty, INTERPRET_BF16)
        acc += v
    acc = rounded(acc, out_ty, INTERPRET_BF16)
    if ADDEND:
        logit = tl.load(gate_ptr + token * stride_gt).to(tl.float32)
        shared = tl.load(shared_ptr + token * stride_st + offs, mask=mask, other=0.0).to(tl.float32)
        acc = plus_sigmoid_gated(acc, logit, shared, out_ty, INTERPRET_BF16)
    tl.store(out_ptr + token * stride_ot + offs, acc.to(out_ty), mask=mask)


def moe_sum(
    x: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor | None = None,
    addend: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """out [T, H] = x [T, k, H] summed over k in fp32, rounded once to out's dtype. With `weights` [T, k] each
    row x[t, j] is first multiplied by weights[t, j] in their promoted dtype (fused_moe_ref's weighted rows).
    x may also be [S, T, k, H] float32 split-K partial sums of the rows: each row is their sum in split order,
    rounded to out's dtype (what split_k.splitk_reduce would have written), in the same launch. With `addend`
    (gate [T, 1], shared [T, H] in out's dtype, unit stride along H): + sigmoid(gate) * shared, a Qwen-MoE
    block's shared expert, rounded as torch's sigmoid, product and sum (activation.sigmoid_gated_add's math)."""
    partials = x.dim() == 4
    x4 = x if partials else x.unsqueeze(0)  # [S, T, k, H]
    num_splits, num_tokens, top_k, hidden = x4.shape
    assert out.shape == (num_tokens, hidden) and x4.stride(3) == 1 and out.stride(1) == 1
    assert x.dtype == (torch.float32 if partials else out.dtype), f"rows {x.dtype}, out {out.dtype}"
    assert weights is None or (weights.shape == (num_tokens, top_k) and weights.stride(1) == 1)
    if num_tokens == 0:
        return out
    round_product = weights is not None and torch.promote_types(out.dtype, weights.dtype) == out.dtype
    gate, shared = addend if addend is not None else (out, out)
    if addend is not None:
        assert gate.shape == (num_tokens, 1) and shared.shape == out.shape and shared.stride(1) == 1
        assert gate.dtype == shared.dtype == out.dtype, (
            f"addend {gate.dtype}, {shared.dtype}, out {out.dtype}"
        )
    block = min(1024, triton.next_power_of_2(hidden))
    pdl = use_pdl(out)
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        x4, out, weights if weights is not None else x4, gate, shared, hidden, num_splits, x4.stride(0),
        x4.stride(1), x4.stride(2), out.stride(0), weights.stride(0) if weights is not None else 0, gate.stride(0),
        shared.stride(0), TOP_K=top_k, BLOCK=block, HAS_WEIGHTS=weights is not None,
        ROUND_PRODUCT=round_product and out.dtype != torch.float32, PARTIALS=partials, ADDEND=addend is not None,
        INTERPRET_BF16=interpreting() and out.dtype == torch.bfloat16, USE_PDL=pdl, launch_pdl=pdl,
        **(ROUNDED_AS_TORCH if addend is not None else {}),
    )  # fmt: skip
    return out
