"""FP8-block experts at decode sizes in four launches, without the alignment and the grouped GEMMs:
`fused_moe_ref`'s result (its rounding: each projection to the dtype, silu(gate) * up, the routing weight's
product, the sum over k in fp32 rounded once) for e4m3 experts with block scales (DeepSeek / Qwen3 FP8).

  1. gate+up: kernels/fp8_gemv.py's GEMV routed, one program row per (token, k) pair reading its expert's
     w13 (activations quantized per group of the block's K inside, as per_token_group_quant does);
  2. silu(gate) * up, adding gate+up's split-K partials (moe_wna16.silu_mul_partials);
  3. down: the same GEMV over each pair's activation row and its expert's w2;
  4. the weighted sum over k, adding down's partials (moe_sum).
With quant_fp8.FP8_WGMMA_GEMV on, both GEMVs are kernels/fp8_wgmma_gemv.py's routed form (TMA + wgmma) instead.

Why: at one token the A3B shape's FP8 MoE block took the general path (the alignment, the activations'
quantization before each grouped GEMM, the GEMMs in 16-row tiles with one real row, the sum over k): six
launches a layer, and the FP8 decode at batch 1 (32K) came to 0.97x of bf16's time (RESULTS.md twelfth
session) where the GPTQ int4 experts, through their routed GEMV, came to 0.90x. Each pair re-reads its
expert's weights, so past a few tokens (experts shared) the grouped GEMMs read less: FP8_MOE_GEMV_MAX_TOKENS
(kernels/fused_moe.py) picks: 8, from its times on an H200 (RESULTS.md fourteenth session: the A3B FP8 decode at
batch 1, 32K, 4.21 -> 4.04 ms).
"""

from __future__ import annotations

import torch

from longserve.kernels import quant_fp8
from longserve.kernels.fp8_gemv import fp8_block_gemv_supported, fp8_routed_gemv
from longserve.kernels.moe_reference import MoEQuant
from longserve.kernels.moe_sum import moe_sum
from longserve.kernels.moe_wna16 import silu_mul_partials

__all__ = ["moe_fp8_gemv", "moe_fp8_gemv_supported"]


def moe_fp8_gemv_supported(quant: MoEQuant, hidden_size: int, inter: int) -> bool:
    """Block-FP8 experts whose activation group (a power of two >= 16) divides both projections' K."""
    if quant.weight_dtype != "fp8_e4m3" or quant.group_size <= 0:
        return False
    group = quant.group_size
    return (
        fp8_block_gemv_supported(1, (quant.block_n, group))
        and hidden_size % group == 0
        and inter % group == 0
    )


def _routed_gemv(hidden, w13, w13_scale, w2, w2_scale, block: tuple[int, int], config):
    """The routed GEMV both projections take: fp8_wgmma_gemv.routed_gemv (TMA + wgmma) under quant_fp8's
    FP8_WGMMA_GEMV where it takes both, else fp8_gemv.fp8_routed_gemv (the CUDA cores); (x, w, scale, ids,
    x_row_div) -> [(S,) P, N]."""
    if quant_fp8.FP8_WGMMA_GEMV and hidden.is_cuda and config is None:
        from longserve.kernels import fp8_wgmma_gemv as wg

        if wg.supported() and all(
            wg.fits_routed(hidden, w, s, block) for w, s in ((w13, w13_scale), (w2, w2_scale))
        ):
            acc = quant_fp8.wgmma_imprecise_acc(wg.BLOCK[1])
            return lambda x, w, s, ids, div: wg.routed_gemv(x, w, s, ids, div, acc)
    return lambda x, w, s, ids, div: fp8_routed_gemv(x, w, s, block, ids, div, config)


def moe_fp8_gemv(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    w2: torch.Tensor,  # [E, H, I] e4m3
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    quant: MoEQuant,
    out: torch.Tensor,  # [T, H]
    config: dict[str, int] | None = None,  # both GEMVs' tiles (tests: a forced split-K)
    addend: tuple[torch.Tensor, torch.Tensor] | None = None,  # fused_moe's
) -> torch.Tensor:
    """The module docstring's four launches, no host sync (CUDA graphs capture them)."""
    num_tokens, top_k = topk_ids.shape
    hidden_size, inter = hidden.shape[1], w13.shape[1] // 2
    assert moe_fp8_gemv_supported(quant, hidden_size, inter), quant
    block = (quant.block_n, quant.group_size)
    ids = topk_ids.reshape(-1).to(torch.int32)  # [T*k], pair p = (token p // k, its j = p % k)
    routed = _routed_gemv(hidden, w13, quant.w13_scale, w2, quant.w2_scale, block, config)
    gate_up = routed(hidden, w13, quant.w13_scale, ids, top_k)  # [(S,) T*k, 2I]
    act = silu_mul_partials(gate_up, inter, hidden.dtype)  # [T*k, I]
    down = routed(act, w2, quant.w2_scale, ids, 1)  # [(S,) T*k, H]
    rows = down.view(*down.shape[:-2], num_tokens, top_k, hidden_size)  # [(S,) T, k, H]
    return moe_sum(rows, out, topk_weights.contiguous(), addend)
