"""The Triton backend's packed path (TritonAttentionBackend._packed; only with
sdpa_shapes.PACKED_PREFIX_CALLS): a short chunk over a long cached prefix on consecutive pages of a 16-bit
cache, its prefix's first keys in the packed cuDNN call (sdpa.packed_prefix_sdpa), the rest (the prefix's tail
and the new tokens, causal) in the extend kernel's unmerged partials, one merge. The backend hands in its
extend kernel and launch choice, so that what it was built with (or a test put in their place) runs here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from longserve.attention import sdpa_shapes
from longserve.attention.metadata import AttentionMetadata, build_metadata
from longserve.attention.sdpa import packed_prefix_sdpa
from longserve.attention.sdpa_shapes import split_shape


def packed_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    r: int,
    splits: int,
    scale: float,
    out: torch.Tensor,
    extend: Callable[..., Any],
    extend_launch: Callable[..., tuple[dict[str, int], int]],
) -> None:
    """Request r's short chunk over its long prefix (a 16-bit cache, consecutive pages: the backend's
    `_packs`) into its rows of `out`: the prefix's first prefix_keys keys in the packed cuDNN call, the rest
    in `extend`'s partials, one merge. No padded causal rows, no second library call: on an H200 the layer's
    host time bounds the step here (RESULTS.md fifteenth session)."""
    if q.is_cuda:
        from longserve.kernels.merge_attention import merge_packed
    else:
        from longserve.kernels.attention_reference import merge_packed_ref as merge_packed
    start, query_len = sum(meta.query_lens_cpu[:r]), meta.query_lens_cpu[r]
    shape = split_shape(meta.prefix_lens_cpu[r], query_len)
    page_size = meta.page_size
    num_pages = shape.prefix_keys // page_size
    first = meta.contiguous_pages(r, num_pages)
    k_pre = k_cache[first : first + num_pages].flatten(0, 1)  # [prefix_keys, Hkv, D], views
    v_pre = v_cache[first : first + num_pages].flatten(0, 1)
    num_kv_heads = k_cache.shape[2]
    causal, config = meta.per_step(
        ("packed causal", r, *q.shape[1:], q.dtype), lambda: _causal(q, num_kv_heads, meta, r, extend_launch)
    )
    q_r, out_r = q[start : start + query_len], out[start : start + query_len]
    part, lse = extend(
        q_r, k_cache, v_cache, causal.query_start_loc, causal.prefix_lens, causal.seq_lens, causal.page_table,
        page_size, query_len, scale, config=config, num_splits=1, partials=True,
    )  # fmt: skip
    rows = meta.per_step(  # the packed rows' buffer (its padding rows never read back): one for all layers
        ("packed rows", q.shape[1:], q.dtype, q.device),
        lambda: q.new_zeros(num_kv_heads, sdpa_shapes.PACKED_ROWS, q.shape[2]),
    )
    o_pre, lse_pre = packed_prefix_sdpa(q_r, k_pre, v_pre, splits, scale, rows)
    o_c, lse_c = part[:, :, 0].transpose(0, 1), lse[:, :, 0].transpose(0, 1)  # [Hq, L, D], [Hq, L] log2
    merge_packed(o_pre, lse_pre, o_c, lse_c, out_r, 0, causal_log2=True)


def _causal(
    q: torch.Tensor,
    num_kv_heads: int,
    meta: AttentionMetadata,
    r: int,
    extend_launch: Callable[..., tuple[dict[str, int], int]],
) -> tuple[AttentionMetadata, dict[str, int]]:
    """Request r's keys after its packed prefix part (the tail and the new tokens) as a one-request batch of
    their own, and the extend kernel's tiles for it: made once a step (every layer asks)."""
    shape = split_shape(meta.prefix_lens_cpu[r], meta.query_lens_cpu[r])
    pages = [meta.page_rows_cpu[r][shape.prefix_keys // meta.page_size :]]
    causal = build_metadata([shape.tail], [meta.query_lens_cpu[r]], pages, meta.page_size, q.device)
    config, _ = extend_launch(
        causal.query_lens_cpu,
        causal.seq_lens_cpu,
        q.shape[1],
        num_kv_heads,
        q.shape[2],
        q.dtype,
        q.device,
    )
    return causal, config
