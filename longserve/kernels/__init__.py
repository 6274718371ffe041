"""Triton kernels, each beside a torch reference with the same signature; submodules import triton.

Nothing here imports triton: import the submodule you need (e.g. `from longserve.kernels.extend_attention
import extend_attention`), so the core package stays importable on machines without it.
Attention: extend_attention (paged flash attention, split-K when the grid is small), decode_attention
(split-K flash-decoding), bench_attention (GPU timing helper).
"""
