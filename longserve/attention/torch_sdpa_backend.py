"""The torch attention backend on the CPU: torch's fused SDPA kernels without an explicit mask.

An explicit [L, S] mask sends CPU SDPA to its math path, which materializes the [Hq, L, S] scores: a 16K
prompt of a tiny model took 15x transformers' forward that way. Here each request takes the kernel's own
causal flag or no mask at all (on the CPU, `_scaled_dot_product_flash_attention_for_cpu`, GQA read in place):

- a chunk with no cached prefix: one causal call on the new q/k/v (the pages are not read);
- one new token (a decode): one call over the whole gathered sequence with no mask (it sees every key);
- a chunk over a cached prefix: (new x prefix, no mask) + (new x new, causal), merged by their log-sum-exps;
- a sliding window shorter than the sequence: per block of queries, the keys the window reaches with an
  additive float mask (the flash kernel takes one; a boolean mask would go to the math path).

Runs in the input dtype, as transformers does (the flash kernel accumulates in float32). The plain masked
float32 reference it subclasses (TorchAttentionBackend) stays the oracle the tests compare against, and is
what "torch" still runs on CUDA: the GPU tests' reference engine (`attention_backend="torch"`) keeps its
exact float32 answers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from longserve.attention.base import KVCache
from longserve.attention.metadata import AttentionMetadata
from longserve.attention.torch_backend import TorchAttentionBackend
from longserve.kernels.attention_reference import gather_kv


class TorchSDPABackend(TorchAttentionBackend):
    """On the CPU, per request one or two fused SDPA calls with the kernel's causal flag or no mask (module
    docstring); elsewhere the masked float32 reference."""

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
        if q.device.type != "cpu":
            return super().forward(q, k, v, layer_id, meta, kv_cache, scale, sliding_window, kv_stored)
        k_cache, v_cache = self.store_and_pages(q, k, v, layer_id, meta, kv_cache, kv_stored)
        if kv_cache.is_fp8:  # rounded through e4m3 as the pages hold them; the pages read dequantized
            k, v = kv_cache.as_stored(layer_id, k, v)
            read = functools.partial(_read_fp8, kv_cache, layer_id, q.dtype)
        else:
            # what the pages hold, so every path reads the same
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
            read = None

        out = torch.empty_like(q)  # [T, Hq, D]
        start = 0
        for r, (query_len, prefix_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.prefix_lens_cpu, meta.seq_lens_cpu)
        ):
            if query_len == 0:
                continue
            assert prefix_len + query_len == seq_len
            end = start + query_len
            _attend(
                q[start:end], k[start:end], v[start:end], k_cache, v_cache, meta.page_table[r], prefix_len,
                scale, sliding_window, out[start:end], read,
            )  # fmt: skip
            start = end
        assert start == q.shape[0], f"query_lens sum to {start} but q has {q.shape[0]} tokens"
        return out


def _attend(
    q: torch.Tensor,  # [L, Hq, D] one request's new tokens, at positions [prefix_len, prefix_len + L)
    k: torch.Tensor,  # [L, Hkv, D] their K/V (also in the pages by now)
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [max_pages] the request's page ids
    prefix_len: int,
    scale: float,
    sliding_window: int | None,
    out: torch.Tensor,  # [L, Hq, D]
    read=None,  # an fp8 cache: (gathered k, v) -> dequantized (k, v) in q's dtype
) -> None:
    seq_len = prefix_len + q.shape[0]
    read = read or (lambda k_, v_: (k_, v_))
    if sliding_window is not None and sliding_window < seq_len:
        _windowed(q, k_cache, v_cache, pages, prefix_len, sliding_window, scale, out, read)
    elif prefix_len == 0:  # a cold chunk: the kernel's own causal mask on the new tokens, no page read
        out.copy_(_sdpa(q, k, v, scale, is_causal=True))
    elif q.shape[0] == 1:  # a decode sees every key: no mask
        out.copy_(
            _sdpa(q, *read(gather_kv(k_cache, pages, seq_len), gather_kv(v_cache, pages, seq_len)), scale)
        )
    else:  # a chunk over a cached prefix: is_causal would align query 0 with key 0, so two calls
        k_pre, v_pre = read(gather_kv(k_cache, pages, prefix_len), gather_kv(v_cache, pages, prefix_len))
        o_pre, lse_pre = _sdpa_lse(q, k_pre, v_pre, scale, causal=False)
        o_new, lse_new = _sdpa_lse(q, k, v, scale, causal=True)
        _merge(o_pre, lse_pre, o_new, lse_new, out)


def _read_fp8(kv_cache: KVCache, layer_id: int, dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor):
    """Gathered e4m3 pages as `dtype` values (the flash kernel takes no fp8)."""
    return kv_cache.dequantize(layer_id, k, v, dtype)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> [1, H, S, D] (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


def _sdpa(
    q: torch.Tensor,  # [L, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,  # [S, Hkv, D]
    scale: float,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[L, Hq, D] attention output, the kv heads read in place (GQA); is_causal aligns query 0 with key 0."""
    o = F.scaled_dot_product_attention(
        _heads(q),
        _heads(k),
        _heads(v),
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [1, Hq, L, D]
    return o[0].transpose(0, 1)


def _sdpa_lse(
    q: torch.Tensor,  # [L, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,  # [S, Hkv, D]
    scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [Hq, L, D], lse [Hq, L] float32): SDPA and each query row's natural-log log-sum-exp (the CPU flash
    kernel, which reads GQA K/V in place)."""
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads(q), _heads(k), _heads(v), 0.0, causal, scale=scale
    )[:2]  # [1, Hq, L, D], [1, Hq, L]
    return o[0], lse[0].float()


def _merge(
    o_pre: torch.Tensor,  # [Hq, L, D] attention over the prefix
    lse_pre: torch.Tensor,  # [Hq, L] float32
    o_new: torch.Tensor,  # [Hq, L, D] attention over the new tokens (causal)
    lse_new: torch.Tensor,  # [Hq, L]
    out: torch.Tensor,  # [L, Hq, D]
) -> None:
    """The two partial attentions as one: the prefix part's share of the softmax mass is
    exp(lse_pre) / (exp(lse_pre) + exp(lse_new)) = sigmoid(lse_pre - lse_new) (both finite: the prefix is
    not empty and each query sees itself). Three ops, not merge_two_ref's dozen: on a shared CPU every
    multi-threaded op can wait a scheduler slice for its second thread."""
    w_pre = torch.sigmoid(lse_pre - lse_new).transpose(0, 1).unsqueeze(-1)  # [L, Hq, 1]
    torch.lerp(o_new.transpose(0, 1), o_pre.transpose(0, 1), w_pre.to(o_new.dtype), out=out)


# queries per SDPA call of a sliding-window request: each call reads at most this + window keys and builds
# a mask of that many columns, so a long windowed prompt never holds an [L, S] mask
_WINDOW_QUERY_BLOCK = 1024


def _windowed(
    q: torch.Tensor,  # [L, Hq, D] queries at positions [prefix_len, prefix_len + L)
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    pages: torch.Tensor,  # [max_pages] the request's page ids
    prefix_len: int,
    sliding_window: int,
    scale: float,
    out: torch.Tensor,  # [L, Hq, D]
    read,
) -> None:
    """Sliding-window attention of one request: per block of queries, the keys the window reaches with an
    additive float mask (the flash kernel takes it; a boolean one would go to the math path)."""
    block = max(sliding_window, _WINDOW_QUERY_BLOCK)
    for a in range(0, q.shape[0], block):
        b = min(a + block, q.shape[0])
        first, last = prefix_len + a, prefix_len + b  # absolute positions [first, last)
        lo = max(0, first - sliding_window + 1)  # keys before the window of the block's first query
        k_blk, v_blk = read(_gather_range(k_cache, pages, lo, last), _gather_range(v_cache, pages, lo, last))
        q_pos = torch.arange(first, last, device=q.device)[:, None]  # [l, 1]
        k_pos = torch.arange(lo, last, device=q.device)[None, :]  # [1, s]
        allowed = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)  # [l, s]
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, -torch.inf)
        out[a:b] = _sdpa(q[a:b], k_blk, v_blk, scale, attn_mask=mask)


def _gather_range(cache: torch.Tensor, pages: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """K or V of positions [lo, hi) of one request from a [num_pages, page_size, Hkv, D] cache: [hi-lo, Hkv, D]."""
    page_size = cache.shape[1]
    first_page, end_page = lo // page_size, -(-hi // page_size)
    rows = cache[pages[first_page:end_page].long()].flatten(0, 1)  # [pages * page_size, Hkv, D]
    offset = lo - first_page * page_size
    return rows[offset : offset + hi - lo]
