"""The reference torch attention backend: the oracle the other backends are tested against.

One SDPA call per request, in float32, with an explicit boolean mask (causal + optional sliding window).
Reads only the host-side `*_cpu` lists for loop bounds, so it never syncs the device; its host loop cannot
be captured in a CUDA graph. The explicit mask sends CPU SDPA to its math path (the [Hq, L, S] scores are
materialized): what runs under the name "torch" is its fused-kernel subclass, torch_sdpa_backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longserve.attention.base import AttentionBackend, KVCache
from longserve.attention.metadata import AttentionMetadata
from longserve.kernels.attention_reference import attention_mask, gather_kv


class TorchAttentionBackend(AttentionBackend):
    """Reference backend (the oracle): gathers each request's pages, then one masked float32 SDPA call per
    request. Named "torch" as the base of TorchSDPABackend, which the registry gives for that name."""

    name = "torch"

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        layer_id: int,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
        q_placed: bool = False,
    ) -> torch.Tensor:
        k_cache, v_cache = self.store_and_pages(q, k, v, layer_id, meta, kv_cache, kv_stored)
        group = q.shape[1] // k.shape[1]

        out = torch.empty_like(q)  # [T, Hq, D]
        start = 0
        for r, (query_len, prefix_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.prefix_lens_cpu, meta.seq_lens_cpu)
        ):
            if query_len == 0:
                continue
            assert prefix_len + query_len == seq_len
            page_ids = meta.page_table[r]  # [max_pages]
            k_r, v_r = kv_cache.dequantize(
                layer_id,
                gather_kv(k_cache, page_ids, seq_len),
                gather_kv(v_cache, page_ids, seq_len),
                torch.float32,
            )  # [S, Hkv, D] each (an fp8 cache's scales applied)
            k_r = k_r.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
            v_r = v_r.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, S, D]
            q_r = q[start : start + query_len].float().transpose(0, 1)  # [Hq, L, D]
            mask = attention_mask(prefix_len, seq_len, sliding_window, q.device)  # [L, S]
            o_r = F.scaled_dot_product_attention(q_r, k_r, v_r, attn_mask=mask, scale=scale)  # [Hq, L, D]
            out[start : start + query_len] = o_r.transpose(0, 1).to(q.dtype)  # [L, Hq, D]
            start += query_len
        assert start == q.shape[0], f"query_lens sum to {start} but q has {q.shape[0]} tokens"
        return out
