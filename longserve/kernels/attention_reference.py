"""Torch references of the paged attention kernels (extend, decode, the two-partial merge), with the kernels'
signatures, and the page gather and causal/sliding-window mask they and the torch backend share.

Importable without Triton. Float32 math; the extend and decode references read the lengths on the host
(a device sync), so they are oracles for tests and the CPU, never for CUDA graphs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "attention_mask", "decode_attention_ref", "extend_attention_ref", "gather_kv", "merge_packed_ref", "merge_two_ref",
    "packed_tail_ref",
]  # fmt: skip


def gather_kv(cache: torch.Tensor, page_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    """K or V of positions [0, seq_len) of one request from a [num_pages, page_size, Hkv, D] cache."""
    page_size = cache.shape[1]
    num_pages = -(-seq_len // page_size)
    pages = cache[page_ids[:num_pages].long()]  # [num_pages, page_size, Hkv, D]
    return pages.reshape(num_pages * page_size, *cache.shape[2:])[:seq_len]  # [S, Hkv, D]


def attention_mask(
    prefix_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[L, S] bool, True = attend: query at position p sees keys k with p - window < k <= p."""
    q_pos = torch.arange(prefix_len, seq_len, device=device)[:, None]  # [L, 1]
    k_pos = torch.arange(seq_len, device=device)[None, :]  # [1, S]
    mask = k_pos <= q_pos  # [L, S]
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window  # [L, S]
    return mask


def extend_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [B+1] int32
    prefix_lens: torch.Tensor,  # [B] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, max_pages] int32
    page_size: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    num_splits: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Same contract as `extend_attention`, in float32 torch (syncs to read the lengths; tests only); an
    fp8 cache's values are dequantized (x * scale) in float32 before the attention."""
    del page_size, max_query_len, config, num_splits
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out  # [T, Hq, D]
    starts, prefixes, seqs = query_start_loc.tolist(), prefix_lens.tolist(), seq_lens.tolist()
    for r, (prefix_len, seq_len) in enumerate(zip(prefixes, seqs)):
        a, b = starts[r], starts[r + 1]
        if a == b:
            continue
        k_r = gather_kv(k_cache, page_table[r], seq_len).float() * k_scale  # [S, Hkv, D]
        v_r = gather_kv(v_cache, page_table[r], seq_len).float() * v_scale
        k_r, v_r = k_r.repeat_interleave(group, 1), v_r.repeat_interleave(group, 1)  # [S, Hq, D]
        mask = attention_mask(prefix_len, seq_len, sliding_window, q.device)  # [L, S]
        o_r = F.scaled_dot_product_attention(
            q[a:b].float().transpose(0, 1),
            k_r.transpose(0, 1),
            v_r.transpose(0, 1),
            attn_mask=mask,
            scale=scale,
        )  # [Hq, L, D]
        out[a:b] = o_r.transpose(0, 1).to(out.dtype)
    return out


def decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, max_pages] int32
    page_size: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Same contract as `decode_attention`: the extend reference with one query per request."""
    del num_splits, config
    num_reqs = q.shape[0]
    query_start_loc = torch.arange(num_reqs + 1, dtype=torch.int32, device=q.device)  # [B+1]
    return extend_attention_ref(
        q, k_cache, v_cache, query_start_loc, seq_lens - 1, seq_lens, page_table, page_size, 1, scale,
        sliding_window, out, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def merge_two_ref(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Same contract as `merge_two` (kernels/merge_attention.py), in torch ops (fp32 math)."""
    m = torch.maximum(lse_a, lse_b)  # [H, L]
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    denom = torch.where(w_a + w_b > 0, w_a + w_b, torch.ones_like(w_a))
    merged = o_a.float() * (w_a / denom)[..., None] + o_b.float() * (w_b / denom)[..., None]  # [H, L, D]
    out.copy_(merged.transpose(0, 1))
    return out


def merge_packed_ref(
    part: torch.Tensor,
    part_lse: torch.Tensor,
    o_c: torch.Tensor,
    lse_c: torch.Tensor,
    out: torch.Tensor,
    tail: int,
    causal_log2: bool = False,
) -> torch.Tensor:
    """Same contract as `merge_packed` (kernels/merge_attention.py), in torch ops (fp32 math)."""
    num_tokens, num_heads, head_dim = out.shape
    num_splits, num_kv_heads = part.shape[:2]
    group = num_heads // num_kv_heads
    rows = num_tokens * group
    # [S, Hkv, T * G, D] -> [S, T, Hq, D]: packed row t * G + g of kv head j is q head j * G + g of token t
    p = part[:, :, :rows].float().view(num_splits, num_kv_heads, num_tokens, group, head_dim)
    p = p.permute(0, 2, 1, 3, 4).reshape(num_splits, num_tokens, num_heads, head_dim)
    pl = part_lse[:, :, :rows].float().view(num_splits, num_kv_heads, num_tokens, group)
    pl = pl.permute(0, 2, 1, 3).reshape(num_splits, num_tokens, num_heads)
    oc = o_c[:, tail : tail + num_tokens].float().transpose(0, 1)[None]  # [1, T, Hq, D]
    lc = lse_c[:, tail : tail + num_tokens].float().transpose(0, 1)[None]  # [1, T, Hq]
    if causal_log2:
        lc = lc * math.log(2)
    w = torch.softmax(torch.cat([pl, lc]), dim=0)  # [S + 1, T, Hq]
    out.copy_((torch.cat([p, oc]) * w[..., None]).sum(0))
    return out


def packed_tail_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    tail: torch.Tensor,
    seq: torch.Tensor,
    part: torch.Tensor,
    part_lse: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `packed_tail` (kernels/packed_tail.py), in torch ops (fp32 math): the bucket's rows causally
    over the tail and themselves (row t sees keys up to tail + t, of at most seq), merged with the splits' rows."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    tail_n, seq_n = int(tail.reshape(-1)[0]), int(seq.reshape(-1)[0])
    k = gather_kv(k_cache, pages.reshape(-1), seq_n).float().repeat_interleave(group, 1).transpose(0, 1)
    v = gather_kv(v_cache, pages.reshape(-1), seq_n).float().repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.einsum("thd,hkd->htk", q.float(), k) * scale  # [Hq, T, seq]
    keys = torch.arange(seq_n, device=q.device)
    visible = keys[None, :] <= tail_n + torch.arange(num_tokens, device=q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    o_c = torch.einsum("htk,hkd->htd", torch.softmax(scores, -1), v)  # [Hq, T, D]
    out = torch.empty_like(q) if out is None else out
    return merge_packed_ref(part, part_lse, o_c, torch.logsumexp(scores, -1), out, 0)
