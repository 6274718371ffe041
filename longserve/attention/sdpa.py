"""The cuDNN / torch SDPA attention paths the Triton backend routes some prefill steps to.

`cold_sdpa`: prompts with no cached prefix, straight from the new q/k/v. `prefix_split_sdpa`: long chunks
over a cached prefix as (new x prefix, no mask) + (new x new, causal), two library calls merged by their
log-sum-exps. No Triton needed on the CPU (the merge's torch reference runs there).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from longserve.attention.base import AttentionMetadata

logger = logging.getLogger("longserve.attention")


# a prefix on consecutive pages is read in place (a view) rather than gathered: at 128K in chunks of 8K the
# gathers copy ~1M prefix tokens x 32 layers x 4 KB twice over (read + write), ~70 ms estimated at 3.6 TB/s;
# not yet measured (`with_constants.py longserve.attention.sdpa.PREFIX_PAGES_AS_VIEW=False` is the A/B)
PREFIX_PAGES_AS_VIEW = True


def cold_sdpa(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of prompts with no cached prefix straight from the new q/k/v (one SDPA per request)."""
    out = torch.empty_like(q)  # [T, Hq, D]
    start = 0
    for query_len in query_lens:
        if query_len == 0:
            continue
        end = start + query_len
        o_r = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),  # [1, Hq, L, D]
            k[start:end].transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
            v[start:end].transpose(0, 1).unsqueeze(0),  # [1, Hkv, L, D]
            is_causal=True,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [1, Hq, L, D]
        out[start:end] = o_r[0].transpose(0, 1)  # [L, Hq, D]
        start = end
    return out


_CUDNN_GQA: bool | None = None  # whether cuDNN took K/V with fewer heads than Q (None: not tried yet)


def attention_with_lse(
    q: torch.Tensor,  # [1, Hq, L, D]
    k: torch.Tensor,  # [1, Hkv, S, D]
    v: torch.Tensor,  # [1, Hkv, S, D]
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns the natural-log log-sum-exp of each query row: (o [1,Hq,L,D], lse [1,Hq,L]).
    GQA: cuDNN reads the kv heads as they are when it accepts them (no 4x copy); else they are expanded."""
    global _CUDNN_GQA
    group = q.shape[1] // k.shape[1]
    if q.is_cuda and group > 1 and _CUDNN_GQA is not False:
        try:
            out = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )
            _CUDNN_GQA = True
            return out[0], out[1].reshape(q.shape[:3]).float()
        except RuntimeError as e:  # this torch/cuDNN wants equal head counts: expand from now on
            logger.info("cuDNN attention does not take GQA K/V directly (%s); expanding kv heads", e)
            _CUDNN_GQA = False
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [1, Hq, S, D]
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out[0], out[1].reshape(q.shape[:3]).float()


def prefix_split_sdpa(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D] new tokens
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    dequantize: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Per request: (new x cached prefix, no mask) and (new x new, causal) as two SDPA calls, merged by
    their log-sum-exps in one pass (`merge_two`). Exact up to rounding; runs at the library kernel's rate
    on long chunks. `dequantize`: an fp8 cache's gathered prefix -> q's dtype (cuDNN reads no e4m3 pages);
    k/v are then the new tokens as the pages hold them (KVCache.as_stored)."""
    if q.is_cuda:
        from longserve.kernels.merge_attention import merge_two as merge  # imports triton
    else:
        from longserve.kernels.attention_reference import merge_two_ref as merge

    out = torch.empty_like(q)  # [T, Hq, D]
    page_size = meta.page_size
    start = 0
    for r, (prefix_len, query_len) in enumerate(zip(meta.prefix_lens_cpu, meta.query_lens_cpu)):
        end = start + query_len
        q_r = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]

        def heads(x: torch.Tensor) -> torch.Tensor:  # [S, Hkv, D] -> [1, Hkv, S, D] (a view)
            return x.transpose(0, 1).unsqueeze(0)

        o_new, lse_new = attention_with_lse(q_r, heads(k[start:end]), heads(v[start:end]), True, scale)
        if prefix_len == 0:
            out[start:end] = o_new[0].transpose(0, 1)  # [L, Hq, D]
        else:
            num_pages = -(-prefix_len // page_size)
            first = meta.contiguous_pages(r, num_pages) if PREFIX_PAGES_AS_VIEW else None
            if first is not None:  # consecutive pages: a view, where a gather would copy the whole prefix
                k_pre = k_cache[first : first + num_pages].flatten(0, 1)[:prefix_len]  # [S, Hkv, D]
                v_pre = v_cache[first : first + num_pages].flatten(0, 1)[:prefix_len]
            else:
                pages = meta.page_table[r, :num_pages].long()  # [P]
                k_pre = k_cache[pages].flatten(0, 1)[:prefix_len]  # [S, Hkv, D]
                v_pre = v_cache[pages].flatten(0, 1)[:prefix_len]
            if dequantize is not None:
                k_pre, v_pre = dequantize(k_pre, v_pre)
            o_pre, lse_pre = attention_with_lse(q_r, heads(k_pre), heads(v_pre), False, scale)
            merge(o_pre[0], lse_pre[0], o_new[0], lse_new[0], out[start:end])
        start = end
    return out
