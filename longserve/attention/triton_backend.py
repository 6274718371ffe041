"""Triton attention backend: paged flash attention for mixed batches, split-K flash-decoding for decodes.

Routing per step (host lists only, so no device sync): every request has one query -> decode kernel;
every request is a cold prompt (no prefix) and cold_path is "sdpa" -> torch SDPA per request on the new
q/k/v; otherwise the extend kernel over the whole ragged batch. Triton is imported on construction.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from longserve.attention.base import AttentionBackend, AttentionMetadata, KVCache

logger = logging.getLogger("longserve.attention")

COLD_PATHS = ("sdpa", "triton")
# Which chunks over a cached prefix run as two cuDNN calls merged (prefix_split_sdpa) rather than in the Triton
# extend kernel. Measured per layer on an H200, Llama-3.1-8B heads (scripts/probe_split_threshold.py, ms
# Triton / cuDNN): 256 new over 32K 0.67 / 0.81; 512 over 8K 0.42 / 0.51, over 32K 1.14 / 0.72; 1024 over 8K
# 0.64 / 0.41. So: 1024+ new tokens always; 512+ over a prefix of 12K+ (the crossover, interpolated).
SPLIT_SDPA_MIN_QUERY = 1024
SPLIT_SDPA_MIN_QUERY_LONG_PREFIX = 512
SPLIT_SDPA_LONG_PREFIX = 12288


def use_split_sdpa(query_len: int, prefix_len: int) -> bool:
    """Whether a chunk of `query_len` new tokens over `prefix_len` cached ones runs faster on the split
    cuDNN path than in the Triton extend kernel (measurements above)."""
    if query_len >= SPLIT_SDPA_MIN_QUERY:
        return True
    return query_len >= SPLIT_SDPA_MIN_QUERY_LONG_PREFIX and prefix_len >= SPLIT_SDPA_LONG_PREFIX


SHORT_CHUNK_ROWS = 256  # query rows per kv head (new tokens x group) up to which 64-row tiles win


class TritonAttentionBackend(AttentionBackend):
    """Stores K/V with `KVCache.store`, then runs the Triton kernel that fits the step's shape.

    cold_path: how a batch of only cold prompts runs ("sdpa" or "triton"; None = "sdpa" on CUDA, else
    "triton"). num_splits / extend_splits: fixed key-range split counts of the decode / extend kernels
    (e.g. for CUDA graphs); None picks them per step from the host-side lengths and the SM count.
    """

    name = "triton"

    def __init__(
        self,
        cold_path: str | None = None,
        num_splits: int | None = None,
        extend_splits: int | None = None,
        num_sms: int | None = None,
    ) -> None:
        if cold_path is not None and cold_path not in COLD_PATHS:
            raise ValueError(f"cold_path must be one of {', '.join(COLD_PATHS)}, got {cold_path!r}")
        from longserve.kernels import decode_attention, extend_attention  # imports triton

        self._extend = extend_attention.extend_attention
        self._extend_config = extend_attention.extend_config
        self._choose_extend_splits = extend_attention.choose_extend_splits
        self._decode = decode_attention.decode_attention
        self._choose_num_splits = decode_attention.choose_num_splits
        self.cold_path = cold_path
        self.num_splits = num_splits
        self.extend_splits = extend_splits
        self._num_sms = num_sms

    def extend_launch(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[dict[str, int], int]:
        """Tiles and key-split count of an extend launch for these requests (host lists, no sync)."""
        config = self._extend_config(head_dim, dtype)
        tuned = device.type == "cuda" and dtype != torch.float32
        if tuned and max(query_lens, default=0) * (num_q_heads // num_kv_heads) <= SHORT_CHUNK_ROWS:
            config = {**config, "BLOCK_M": 64, "num_warps": 4}
        splits = self.extend_splits or self._choose_extend_splits(
            query_lens, seq_lens, num_q_heads, num_kv_heads, config["BLOCK_M"], self.num_sms(device)
        )
        if tuned and splits > 1:
            # key-split launches are short per program: 4 warps beat 8 (scripts/sweep_short_extend.py on
            # an H200: 64 new over 32K 0.255 -> 0.192 ms with 64-row tiles; 512 new 1.03 -> 0.83 ms)
            config = {**config, "num_warps": 4}
        return config, splits

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            cuda = device.type == "cuda"
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        return self._num_sms

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
    ) -> torch.Tensor:
        kv_cache.store(layer_id, meta.slot_mapping, k, v)
        num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
        assert num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}"
        k_cache, v_cache = kv_cache.k[layer_id], kv_cache.v[layer_id]  # [num_pages, page_size, Hkv, D]
        if q.shape[0] == 0:
            return torch.empty_like(q)

        if all(n == 1 for n in meta.query_lens_cpu):
            num_splits = self.num_splits or self._choose_num_splits(
                meta.max_seq_len, meta.num_reqs, num_kv_heads, self.num_sms(q.device)
            )
            return self._decode(
                q, k_cache, v_cache, meta.seq_lens, meta.page_table, meta.page_size, scale,
                sliding_window, num_splits,
            )  # fmt: skip

        cold_path = self.cold_path or ("sdpa" if q.is_cuda else "triton")
        window_matters = sliding_window is not None and sliding_window < meta.max_seq_len
        if cold_path == "sdpa" and not window_matters:
            if not any(meta.prefix_lens_cpu):
                return cold_sdpa(q, k, v, meta.query_lens_cpu, scale)
            # long chunks over a cached prefix: two cuDNN calls merged beat the Triton kernel (measured:
            # ~530 vs ~315 TFLOP/s for 8K over 24K..120K; a 64-token suffix is faster in Triton)
            half = q.dtype in (torch.float16, torch.bfloat16)  # cuDNN's kernels: 16-bit only
            if (half or not q.is_cuda) and all(
                map(use_split_sdpa, meta.query_lens_cpu, meta.prefix_lens_cpu)
            ):
                return prefix_split_sdpa(q, k, v, k_cache, v_cache, meta, scale)

        config, extend_splits = self.extend_launch(
            meta.query_lens_cpu, meta.seq_lens_cpu, num_q_heads, num_kv_heads, q.shape[2], q.dtype, q.device
        )
        return self._extend(
            q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
            meta.page_size, meta.max_query_len, scale, sliding_window, config=config, num_splits=extend_splits,
        )  # fmt: skip


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
) -> torch.Tensor:
    """Per request: (new x cached prefix, no mask) and (new x new, causal) as two SDPA calls, merged by
    their log-sum-exps in one pass (`merge_two`). Exact up to rounding; runs at the library kernel's rate
    on long chunks."""
    from longserve.kernels.merge_attention import merge_two, merge_two_ref

    merge = merge_two if q.is_cuda else merge_two_ref
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
            pages = meta.page_table[r, : -(-prefix_len // page_size)].long()  # [P]
            k_pre = k_cache[pages].flatten(0, 1)[:prefix_len]  # [S, Hkv, D]
            v_pre = v_cache[pages].flatten(0, 1)[:prefix_len]
            o_pre, lse_pre = attention_with_lse(q_r, heads(k_pre), heads(v_pre), False, scale)
            merge(o_pre[0], lse_pre[0], o_new[0], lse_new[0], out[start:end])
        start = end
    return out
