"""The attention backend registry: canonical name -> backend class, the one table every entry point uses.

Names are resolved for a device by `platform.resolve_attention_backend` (aliases, the `auto` rule, torch
off CUDA); backends other than torch are imported on first use, so triton is needed only where it runs.
"""

from __future__ import annotations

import importlib

import torch

from longserve.attention.base import AttentionBackend
from longserve.platform import normalize_attention_backend, resolve_attention_backend

# canonical name (platform.ATTENTION_BACKENDS) -> (module, class)
ATTENTION_BACKEND_CLASSES: dict[str, tuple[str, str]] = {
    # fused SDPA kernels on the CPU; on CUDA its base class, the masked float32 reference (the tests' oracle)
    "torch": ("longserve.attention.torch_sdpa_backend", "TorchSDPABackend"),
    "triton": ("longserve.attention.triton_backend", "TritonAttentionBackend"),
}


def attention_backend_class(name: str) -> type[AttentionBackend]:
    """The class of a backend by any accepted spelling ('auto' has none: resolve it for a device first)."""
    canonical = normalize_attention_backend(name)
    if canonical not in ATTENTION_BACKEND_CLASSES:
        raise ValueError(f"attention backend {name!r} names no class: resolve it for a device first")
    module, cls = ATTENTION_BACKEND_CLASSES[canonical]
    return getattr(importlib.import_module(module), cls)


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """A new backend of the kind that runs `name` on `device` (e.g. 'auto' -> triton on CUDA, torch on the
    CPU); ValueError for a name the registry does not accept, naming the accepted ones."""
    return attention_backend_class(resolve_attention_backend(name, device))()
