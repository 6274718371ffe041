"""SiLU-and-mul in Triton: x = gate|up [T, 2I] -> silu(gate) * up [T, I]; reference: `silu_and_mul_ref`.

Rounds where torch does: silu in float32 rounded to the input dtype, then the product rounded again, so
bf16 outputs match `F.silu(gate) * up` up to the exp approximation.

`silu_and_mul_quant`: the same product quantized to e4m3 per token-group in the same pass, for a block-FP8 down
projection (kernels/quant_fp8.py): equal, bit for bit, to `per_token_group_quant(silu_and_mul(x), group)`,
without writing and reading back the [T, I] product (at a 8K-token chunk of the Llama-3.1-8B shape 235 MB each
way, a layer).

`sigmoid_gated_add`: a Qwen-MoE block's out + sigmoid(gate) * shared (the shared expert scaled by its gate) in
place, one launch where torch makes three (sigmoid, product, sum), each rounded where torch rounds: 80 launches
fewer a decode step of the seed's 40 MoE layers (models/moe_block.py). `sigmoid_mul`: an attention output times
the sigmoid of its output gate (Qwen3.5 / Qwen3-Next) in place, the gate read by its head strides where it lies
in q_proj's output: one launch where the layer made three (the gate's copy, sigmoid, product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longserve.kernels.activation_reference import (
    sigmoid_gated_add_ref,
    sigmoid_mul_ref,
    silu_and_mul_quant_ref,
    silu_and_mul_ref,
)
from longserve.kernels.extend_attention import interpreting
from longserve.kernels.launch import fast_launch, pdl_prologue, use_pdl
from longserve.kernels.quant_reference import FP8_DTYPE, FP8_MAX
from longserve.kernels.quant_tiles import e4m3_rounded, groups_per_program, quant_outputs, rounded

__all__ = [
    "ROUNDED_AS_TORCH",
    "sigmoid_gated_add",
    "sigmoid_gated_add_ref",
    "sigmoid_mul",
    "sigmoid_mul_ref",
    "silu_and_mul",
    "silu_and_mul_quant",
    "silu_and_mul_quant_ref",
    "silu_and_mul_ref",
]

BLOCK = 1024


@fast_launch
@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate = tl.load(x_ptr + tok * stride_x + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    up = tl.load(x_ptr + tok * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # F.silu rounding
    tl.store(out_ptr + tok * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = gate|up [T, 2I] -> silu(gate) * up [T, I]; same signature and math as `silu_and_mul_ref`."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"expected [T, 2I], got {tuple(x.shape)}"
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)  # [T, I]
    if num_tokens == 0:
        return out
    pdl = use_pdl(x)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, BLOCK))](
        x, out, inter, x.stride(0), out.stride(0), BLOCK=BLOCK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl
    )
    return out


@triton.jit
def silu_mul_rounded(x_ptr, offs, mask, inter, out_ty: tl.constexpr):
    """silu(gate) * up at columns offs of the row x_ptr points at, rounded as _silu_and_mul_kernel rounds it (fp32
    values of out_ty)."""
    gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + inter + offs, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)  # F.silu rounding
    return (act * up).to(out_ty).to(tl.float32)


@fast_launch
@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, inter, stride_x, stride_q, stride_sm, stride_sg,
    QMAX: tl.constexpr, GROUP: tl.constexpr, GPP: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """One program per (token, GPP groups of GROUP columns): the rounded product, then per group scale = amax /
    QMAX and q = product / scale clamped and rounded to e4m3: quant_fp8._group_quant_kernel's arithmetic."""
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GPP + tl.arange(0, GPP)  # [GPP]
    offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GPP, GROUP]
    mask = offs < inter
    y = silu_mul_rounded(x_ptr + tok * stride_x, offs, mask, inter, x_ptr.dtype.element_ty)  # [GPP, GROUP]
    scale = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-10) / QMAX  # [GPP]
    q = tl.minimum(tl.maximum(y / scale[:, None], -QMAX), QMAX)
    if INTERPRET:
        q = e4m3_rounded(q)
    tl.store(q_ptr + tok * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + tok * stride_sm + groups * stride_sg, scale, mask=groups * GROUP < inter)


def silu_and_mul_quant(
    x: torch.Tensor, group_size: int, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x = gate|up [T, 2I] -> (e4m3 [T, I], float32 scales [T, ceil(I / group)], or stored [G, T] and returned
    transposed with column_major_scales): `per_token_group_quant(silu_and_mul(x), group_size)` in one pass."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"expected [T, 2I], got {tuple(x.shape)}"
    assert group_size > 0 and group_size & (group_size - 1) == 0, f"group_size {group_size}: a power of two"
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    groups = triton.cdiv(inter, group_size)
    q, scales = quant_outputs(num_tokens, inter, groups, FP8_DTYPE, x.device, column_major_scales)
    if num_tokens == 0:
        return q, scales
    gpp = groups_per_program(group_size, groups)
    pdl = use_pdl(x)
    _silu_and_mul_quant_kernel[(num_tokens, triton.cdiv(groups, gpp))](
        x, q, scales, inter, x.stride(0), q.stride(0), scales.stride(0), scales.stride(1),
        QMAX=FP8_MAX, GROUP=group_size, GPP=gpp, INTERPRET=interpreting(), USE_PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return q, scales


# The launch option of every kernel that calls plus_sigmoid_gated: with Triton's default FP fusion, LLVM folds the
# product's rounding and the sum into one bf16 FMA (`fma.rn.bf16`: the product unrounded), and on an H100 (fiftieth
# session, RESULTS.md) only 75-84% of the gated add's elements had torch's bits; without it, sm90 PTX rounds the
# product (`mul.rn.bf16`) then adds (`add.rn.bf16`), as torch does (tests/unit/test_rounding_ptx.py).
ROUNDED_AS_TORCH = {"enable_fp_fusion": False}


@triton.jit
def plus_sigmoid_gated(x, logit, shared, ty: tl.constexpr, INTERPRET_BF16: tl.constexpr):
    """fp32 x (a value of dtype ty) + sigmoid(logit) * shared, rounded to ty where torch's three ops round (the
    sigmoid, the product, the sum), in fp32: this kernel's and moe_sum's ADDEND epilogue's one formula. Launch
    with ROUNDED_AS_TORCH."""
    gate = rounded(tl.sigmoid(logit), ty, INTERPRET_BF16)
    return rounded(x + rounded(gate * shared, ty, INTERPRET_BF16), ty, INTERPRET_BF16)


@fast_launch
@triton.jit
def _sigmoid_gated_add_kernel(
    out_ptr,  # [T, H], updated in place
    gate_ptr,  # [T, 1] logits
    shared_ptr,  # [T, H]
    hidden,
    stride_o,
    stride_g,
    stride_s,
    BLOCK: tl.constexpr,
    INTERPRET_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < hidden
    dt = out_ptr.dtype.element_ty
    logit = tl.load(gate_ptr + tok * stride_g).to(tl.float32)
    shared = tl.load(shared_ptr + tok * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(out_ptr + tok * stride_o + cols, mask=mask, other=0.0).to(tl.float32)
    y = plus_sigmoid_gated(x, logit, shared, dt, INTERPRET_BF16)
    tl.store(out_ptr + tok * stride_o + cols, y.to(dt), mask=mask)


def sigmoid_gated_add(out: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """out [T, H] += sigmoid(gate [T, 1]) * shared [T, H], in place (unit stride along H); returns out. Same math
    as `sigmoid_gated_add_ref`."""
    num_tokens, hidden = out.shape
    assert gate.shape == (num_tokens, 1) and shared.shape == out.shape, (gate.shape, shared.shape, out.shape)
    assert out.stride(1) == 1 and shared.stride(1) == 1 and gate.dtype == shared.dtype == out.dtype
    if num_tokens == 0:
        return out
    pdl = use_pdl(out)
    _sigmoid_gated_add_kernel[(num_tokens, triton.cdiv(hidden, BLOCK))](
        out, gate, shared, hidden, out.stride(0), gate.stride(0), shared.stride(0), BLOCK=BLOCK,
        INTERPRET_BF16=interpreting() and out.dtype == torch.bfloat16, USE_PDL=pdl, num_warps=4, launch_pdl=pdl,
        **ROUNDED_AS_TORCH,
    )  # fmt: skip
    return out


@fast_launch
@triton.jit
def _sigmoid_mul_kernel(
    x_ptr,  # [T, H, D] contiguous, updated in place
    gate_ptr,  # [T, H, D], unit stride along D
    width,  # H * D
    stride_gt,
    stride_gh,
    HEAD_DIM: tl.constexpr,  # a constant: the column's head and place by shifts where D is a power of two
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_prologue(USE_PDL)
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] along H * D
    mask = cols < width
    dt = x_ptr.dtype.element_ty
    g_offs = tok * stride_gt + (cols // HEAD_DIM) * stride_gh + cols % HEAD_DIM
    gate = tl.sigmoid(tl.load(gate_ptr + g_offs, mask=mask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
    x = tl.load(x_ptr + tok * width + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + tok * width + cols, (x * gate).to(dt), mask=mask)  # torch's two roundings


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (contiguous) *= sigmoid(gate [T, H, D]) in place (gate: unit stride along D, any token and
    head strides); returns x. Same math as `sigmoid_mul_ref`."""
    shapes = f"x {tuple(x.shape)}, gate {tuple(gate.shape)}"
    assert x.dim() == 3 and gate.shape == x.shape and x.is_contiguous() and gate.stride(2) == 1, shapes
    assert gate.dtype == x.dtype, shapes
    num_tokens, heads, head_dim = x.shape
    if num_tokens == 0:
        return x
    pdl = use_pdl(x)
    _sigmoid_mul_kernel[(num_tokens, triton.cdiv(heads * head_dim, BLOCK))](
        x, gate, heads * head_dim, gate.stride(0), gate.stride(1), HEAD_DIM=head_dim, BLOCK=BLOCK, USE_PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return x
