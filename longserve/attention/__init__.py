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

ATTENTION_BACKENDS = ("auto", "torch")


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """'torch' is the reference backend; 'auto' picks the best for `device` (torch until Triton lands)."""
    if name in ("auto", "torch"):
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
