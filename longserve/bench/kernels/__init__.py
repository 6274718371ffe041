"""Kernel microbenchmarks on a CUDA GPU: attention (`attention.bench_attention`), the fused
norm/activation/RoPE ops (`fused_ops.bench_fused_ops`) and the fused MoE (`python -m
longserve.bench.kernels.moe`); each returns one dict per case and the caller prints or stores them."""
