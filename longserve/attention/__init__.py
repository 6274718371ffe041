"""Attention backends over the paged KV cache, and the name -> backend registry."""

from __future__ import annotations

import torch

from longserve.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    ForwardContext,
    KVCache,
    build_metadata,
)
from longserve.attention.torch_ref import TorchAttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """'torch' is the reference backend, 'triton' the GPU kernels; 'auto' = triton on CUDA when triton
    imports, else torch. Backends other than torch are imported here, on first use."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from longserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "auto":
        if device.type == "cuda":
            try:
                from longserve.attention.triton_backend import TritonAttentionBackend

                return TritonAttentionBackend()
            except ImportError:
                pass
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; known backends: {', '.join(ATTENTION_BACKENDS)}")


__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "KVCache",
    "TorchAttentionBackend",
    "build_metadata",
    "get_attention_backend",
]
