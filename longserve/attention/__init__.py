"""Attention backends over the paged KV cache, and the name -> backend registry."""

from __future__ import annotations

from longserve.attention.base import AttentionBackend, ForwardContext, GraphShape, KVCache
from longserve.attention.metadata import AttentionMetadata, build_metadata
from longserve.attention.registry import (
    ATTENTION_BACKEND_CLASSES,
    attention_backend_class,
    get_attention_backend,
)
from longserve.attention.torch_backend import TorchAttentionBackend
from longserve.attention.torch_sdpa_backend import TorchSDPABackend

__all__ = [
    "ATTENTION_BACKEND_CLASSES",
    "AttentionBackend",
    "AttentionMetadata",
    "ForwardContext",
    "GraphShape",
    "KVCache",
    "TorchAttentionBackend",
    "TorchSDPABackend",
    "attention_backend_class",
    "build_metadata",
    "get_attention_backend",
]
