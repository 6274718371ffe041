"""Triton kernels, each beside a torch reference with the same signature; the kernel modules import triton.

The references live in `*_reference.py` modules (norm, activation, rope, attention, moe, quant) that import
without triton: layers run them on the CPU and tests check the kernels against them. Nothing here imports
triton, and nothing under kernels/ imports the layers above it (models, attention backends, runner).
Attention: extend_attention (paged flash attention, split-K when the grid is small), decode_attention
(split-K flash-decoding), merge_attention; their GPU microbenchmarks are in longserve.bench.kernels.
Quantized weights: quant_gemm (W4A16/W8A16, dequantization fused), quant_fp8 (activation quantization,
block / per-channel FP8, INT8), quant_tiles (shared Triton helpers), and fused_moe's int4/int8/fp8 experts.
"""
