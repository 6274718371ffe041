"""Attention backend interface and the per-step metadata every backend reads.

Token layout of one step (T new tokens, B requests, flattened, no padding):

    request:          r0          r1     r2
    new tokens:   [ q q q q | q | q q q ]        query_start_loc = [0, 4, 5, 8]
    prefix_lens:      12        30    0          tokens already in the KV pool before this step
    seq_lens:         16        31    3          prefix_lens + new tokens (the KV length attended to)

Token i of request r sits at absolute position prefix_lens[r] + (i - query_start_loc[r]) and attends
causally to KV positions [0, that position]. `slot_mapping[t]` = page_id * page_size + offset is where
the new token t's K/V are written; `page_table[r, j]` is the page id holding positions
[j*page_size, (j+1)*page_size) of request r (padded with 0 past the request's pages).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from longserve.attention.kv_quant import dequantize_kv, is_fp8, quantize_kv
from longserve.platform import to_device_async

T = TypeVar("T")


@dataclass
class AttentionMetadata:
    page_size: int
    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    prefix_lens: torch.Tensor  # [B] int32, device
    page_table: torch.Tensor  # [B, max_pages] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device
    # host copies (python lists) so reference backends need no device->host sync
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    # the requests' page ids on the host (build_step_tensors' input, kept by reference: no copy), for paths
    # that decide on the host how to read the pages; empty where the metadata was built without them
    page_rows_cpu: Sequence[Sequence[int]] = ()
    _contiguous: dict[tuple[int, int], int | None] = field(default_factory=dict, repr=False)
    _subsets: dict[tuple[int, ...], tuple[AttentionMetadata, torch.Tensor] | None] = field(
        default_factory=dict, repr=False
    )
    _per_step: dict[tuple, Any] = field(default_factory=dict, repr=False)

    def per_step(self, key: tuple, decide: Callable[[], T]) -> T:
        """decide() once per step and key, for the host-side decisions every layer would repeat (a backend's
        routing of the requests, its launch tiles): part of an eager layer's host time."""
        if key not in self._per_step:
            self._per_step[key] = decide()
        return self._per_step[key]

    def subset(self, requests: tuple[int, ...]) -> tuple[AttentionMetadata, torch.Tensor] | None:
        """The metadata of some of the step's requests as a batch of their own, and the device index of their
        new tokens' rows in the step ([T'] int64): one host-to-device copy, kept for the step (every layer
        asks). None when the metadata was built without the host page rows."""
        if requests not in self._subsets:
            sub = None
            if len(self.page_rows_cpu) == self.num_reqs:
                starts = np.cumsum([0, *self.query_lens_cpu])
                rows = np.concatenate([np.arange(starts[r], starts[r + 1]) for r in requests])
                meta, (index,) = build_step_tensors(
                    [self.prefix_lens_cpu[r] for r in requests], [self.query_lens_cpu[r] for r in requests],
                    [self.page_rows_cpu[r] for r in requests], self.page_size, self.slot_mapping.device,
                    extra=(rows,),
                )  # fmt: skip
                sub = (meta, index)
            self._subsets[requests] = sub
        return self._subsets[requests]

    def contiguous_pages(self, r: int, num_pages: int) -> int | None:
        """The first page id when request r's first `num_pages` pages are consecutive ids (a lone prompt's
        usually are: the pool hands out the lowest free ids first), else None. Every layer asks: the answer
        is kept for the step."""
        key = (r, num_pages)
        if key not in self._contiguous:
            first = None
            if r < len(self.page_rows_cpu) and num_pages > 0:
                rows = np.asarray(self.page_rows_cpu[r][:num_pages])
                start = int(rows[0])
                span = np.arange(start, start + num_pages)
                if int(rows[-1]) - start == num_pages - 1 and np.array_equal(rows, span):
                    first = start
            self._contiguous[key] = first
        return self._contiguous[key]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)


def build_metadata(
    prefix_lens: list[int],
    query_lens: list[int],
    page_tables: list[list[int]],
    page_size: int,
    device: torch.device | str,
) -> AttentionMetadata:
    """Build one step's metadata from host lists (pure: no cache access, no device sync).

    `page_tables[r]` lists the page ids of request r in position order and must cover its
    `prefix_lens[r] + query_lens[r]` positions. Index math runs on the CPU; results are copied to `device`.
    """
    return build_step_tensors(prefix_lens, query_lens, page_tables, page_size, device)[0]


def build_step_tensors(
    prefix_lens: list[int],
    query_lens: list[int],
    page_tables: Sequence[Sequence[int]],  # lists, or int64 arrays (runner.inputs.page_row)
    page_size: int,
    device: torch.device | str,
    extra: Sequence[Sequence[int]] = (),
) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """build_metadata, plus each `extra` list (e.g. input ids) as an int64 tensor on `device`.

    The index math runs in numpy and everything reaches the device in two copies (one int32 buffer, one
    int64 buffer, each tensor 16-byte aligned in it) rather than one per tensor: a decode step's host time
    is on the critical path."""
    num_reqs = len(prefix_lens)
    if not (len(query_lens) == len(page_tables) == num_reqs):
        raise ValueError(
            f"build_metadata: got {num_reqs} prefix_lens, {len(query_lens)} query_lens and "
            f"{len(page_tables)} page_tables; they must have one entry per request"
        )
    query_lens_np = np.asarray(query_lens, dtype=np.int64).reshape(num_reqs)  # [B]
    prefix_np = np.asarray(prefix_lens, dtype=np.int64).reshape(num_reqs)  # [B]
    seq_lens_np = prefix_np + query_lens_np  # [B]
    num_pages = np.fromiter(map(len, page_tables), dtype=np.int64, count=num_reqs)  # [B]
    short = np.flatnonzero(num_pages * page_size < seq_lens_np)
    if len(short):
        r = int(short[0])
        raise ValueError(
            f"request {r} has seq_len {seq_lens_np[r]} but only {num_pages[r]} pages of {page_size} tokens"
        )
    max_pages = int(num_pages.max()) if num_reqs else 0
    page_table = np.zeros((num_reqs, max_pages), dtype=np.int64)  # [B, max_pages]
    for r, pages in enumerate(page_tables):  # build_step's rows are int64 arrays: a copy each, no conversion
        page_table[r, : len(pages)] = pages

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)  # [B+1]
    np.cumsum(query_lens_np, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    if num_tokens == num_reqs and (num_reqs == 0 or query_lens_np.max() == 1):  # decode: one token each
        req_idx = np.arange(num_reqs)
        positions = prefix_np
    else:
        req_idx = np.repeat(np.arange(num_reqs), query_lens_np)  # [T]
        # absolute position of each new token: prefix_len + index within its request's query
        positions = prefix_np[req_idx] + np.arange(num_tokens) - query_start_loc[:-1][req_idx]  # [T]
    slot_mapping = page_table[req_idx, positions // page_size] * page_size + positions % page_size  # [T]

    ints = [query_start_loc, seq_lens_np, prefix_np, page_table.reshape(-1)]
    longs = [slot_mapping, *(np.asarray(x, dtype=np.int64).reshape(-1) for x in extra)]
    i32 = _packed([a.astype(np.int32) for a in ints], device)
    i64 = _packed(longs, device)
    meta = AttentionMetadata(
        page_size=page_size,
        query_start_loc=i32[0],  # [B+1]
        seq_lens=i32[1],  # [B]
        prefix_lens=i32[2],  # [B]
        page_table=i32[3].view(num_reqs, max_pages),  # [B, max_pages]
        slot_mapping=i64[0],  # [T] int64
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens_np.tolist(),
        prefix_lens_cpu=list(prefix_lens),
        page_rows_cpu=page_tables,
    )
    return meta, i64[1:]


def _to_device(a: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host array on `device`, queued without waiting for the stream (platform.to_device_async)."""
    return to_device_async(torch.from_numpy(np.ascontiguousarray(a)), device)


ALIGN_BYTES = 16  # what Triton specializes a pointer on (divisible by 16 or not): every segment starts there


def _packed(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """The arrays (one dtype) on `device` in one copy, each starting 16-byte aligned.

    Unpadded, a segment's alignment followed the batch (the page table of B requests started at (3B + 1)
    int32s, aligned only when B % 4 == 1), and every kernel that reads it compiled one variant per
    alignment mix as batches varied: a second or more of stalled step each time, through HTTP."""
    if not arrays:
        return []
    unit = ALIGN_BYTES // arrays[0].itemsize
    starts, end = [], 0
    for a in arrays:
        starts.append(end)
        end += -(-len(a) // unit) * unit
    flat = np.zeros(end, dtype=arrays[0].dtype)
    for a, start in zip(arrays, starts):
        flat[start : start + len(a)] = a
    dev = _to_device(flat, device)
    # slices, one view each (torch.split and a slice of each took 3x the host time: 22 against 7 us for 4 segments)
    return [dev[start : start + len(a)] for a, start in zip(arrays, starts)]


class KVCache:
    """The paged K/V tensors, one pair per layer: [num_pages, page_size, num_kv_heads, head_dim].

    `dtype` is what the pages hold: the model's dtype, or float8_e4m3fn for an fp8 cache, whose values are
    x / scale with one float scale per layer for K and one for V (`k_scales`, `v_scales`; 1.0 unless the
    checkpoint has calibrated ones: attention/kv_quant.py). Backends read pages through `dequantize` (or,
    in the Triton kernels, widen e4m3 in registers and apply the scales as scalars)."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.is_fp8 = is_fp8(dtype)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token's K and V take in every layer; `dtype` is the storage dtype (1 byte for fp8: the
        per-layer scales are negligible)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_scales(self, k_scales: Sequence[float], v_scales: Sequence[float]) -> None:
        """The fp8 cache's per-layer scales (before any token is stored: pages keep the scale they were written with)."""
        assert len(k_scales) == len(v_scales) == len(self.k)
        self.k_scales, self.v_scales = [float(s) for s in k_scales], [float(s) for s in v_scales]

    def slots(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V pages as [num_slots, Hkv, D] views (slot = page * page_size + offset)."""
        k, v = self.k[layer_id], self.v[layer_id]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def store(self, layer_id: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([T, Hkv, D]) into their slots (quantized for an fp8 cache)."""
        kc, vc = self.slots(layer_id)  # [num_slots, Hkv, D]
        if self.is_fp8:  # as bytes: index_copy_ has no float8 kernel on the CPU
            k, v = quantize_kv(k, self.k_scales[layer_id]), quantize_kv(v, self.v_scales[layer_id])
            kc.view(torch.uint8).index_copy_(0, slot_mapping, k.view(torch.uint8))
            vc.view(torch.uint8).index_copy_(0, slot_mapping, v.view(torch.uint8))
            return
        kc.index_copy_(0, slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, slot_mapping, v.to(vc.dtype))

    def dequantize(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
        """Gathered pages (or any slice of them) of K and V as `dtype` values: the scales applied for fp8."""
        if not self.is_fp8:
            return k.to(dtype), v.to(dtype)
        return (
            dequantize_kv(k, self.k_scales[layer_id], dtype),
            dequantize_kv(v, self.v_scales[layer_id], dtype),
        )

    def as_stored(self, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        """New tokens' K/V as the pages hold them, in their own dtype: an fp8 cache rounds them through
        e4m3, so paths that attend over the new tokens directly (a cold prompt's SDPA) see what a later
        chunk, a prefix hit or a recomputation reads from the pages."""
        if not self.is_fp8:
            return k, v
        ks, vs = self.k_scales[layer_id], self.v_scales[layer_id]
        return dequantize_kv(quantize_kv(k, ks), ks, k.dtype), dequantize_kv(quantize_kv(v, vs), vs, v.dtype)


@dataclass(frozen=True)
class GraphShape:
    """What the attention of a captured CUDA graph is sized for: the longest sequence any replay attends
    over (the context length) and the layers' heads (this rank's), head size, dtype and device."""

    max_seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    Contract of `forward`: q [T, Hq, D], k/v [T, Hkv, D] are the new tokens of the step laid out as in
    the module docstring; the backend first stores k/v at `meta.slot_mapping` in `kv_cache`, then
    returns [T, Hq, D] attention output where each new token attends causally over its request's
    prefix (read from the pages) and the new tokens up to itself. Hq is a multiple of Hkv (GQA).
    `sliding_window` (if not None) limits attention to the last `sliding_window` positions,
    including the token itself, as in HF Mistral.

    CUDA graphs (runner/cuda_graph.py), for a backend with `supports_cuda_graphs`: each captured shape
    (a decode batch size, a prefill chunk bucket) gets the backend `prepare_for_capture` /
    `prepare_for_extend_capture` returns, whose launches have a grid fixed for any lengths up to the
    shape's `max_seq_len`. Before each replay the graph runner refreshes the graph's static metadata
    tensors with the step's values (padding rows and tokens aimed at page 0) and calls that backend's
    `prepare_for_replay`.
    """

    name: str = "base"
    supports_cuda_graphs: bool = False
    # a chunk over a prefix of a multiple of this many tokens pads no rows: chunks end on one (sched/chunk_size.py)
    chunk_granule: int = 1

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor: ...

    @staticmethod
    def store_and_pages(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        kv_stored: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first step of every `forward`: store the new tokens' K/V at `meta.slot_mapping` (unless the
        caller's rotary kernel already did, `kv_stored`), check GQA (Hq a multiple of Hkv), and return the
        layer's pages (k, v: [num_pages, page_size, Hkv, D])."""
        if not kv_stored:
            kv_cache.store(layer_id, meta.slot_mapping, k, v)
        num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
        assert num_q_heads % num_kv_heads == 0, f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}"
        return kv_cache.k[layer_id], kv_cache.v[layer_id]

    def prepare_for_capture(self, batch_size: int, shape: GraphShape) -> AttentionBackend:
        """The backend a decode graph of `batch_size` requests (one new token each) captures with."""
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in CUDA graphs")

    def prepare_for_extend_capture(self, num_tokens: int, shape: GraphShape) -> AttentionBackend:
        """The backend a graph of one request computing `num_tokens` new tokens (a prefill chunk padded
        to this bucket) over any cached prefix captures with."""
        raise NotImplementedError(f"the {self.name} attention backend cannot be captured in CUDA graphs")

    def prepare_for_packed_capture(
        self, num_tokens: int, shape: GraphShape, kv_cache: KVCache
    ) -> AttentionBackend | None:
        """A second backend for the lone chunk's bucket of `num_tokens`, captured in a graph of its own, that its
        `takes(meta)` picks before a replay (attention/packed_graph.py: a long prefix in one cuDNN call); None."""
        return None

    def graph_defers(self, meta: AttentionMetadata, shape: GraphShape, kv_cache: KVCache) -> bool:
        """Whether this step's attention takes a path the lone chunk's graphs (captured with
        `prepare_for_extend_capture`) cannot replay: the step then runs without them."""
        return False

    def warm_up(  # noqa: B027 (optional hook)
        self, shape: GraphShape, chunk_size: int, kv_cache: KVCache, step_tokens: int | None = None
    ) -> None:
        """Build, on the calling thread, what the backend would otherwise build in the middle of a step
        (kernel variants, library plans per shape), for prefill chunks of up to `chunk_size` tokens (a lone
        prompt's step: up to `step_tokens`) over contexts of up to `shape.max_seq_len`; it may write the
        reserved page 0 of `kv_cache`. Called on the thread that will run the steps, before the first one."""

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Called on a captured backend with the step's own metadata (real lengths, host lists) before its
        graph replays: where a backend refreshes state its kernels read besides the metadata tensors (a
        planner's work lists). The Triton kernels read only the metadata tensors: nothing to do."""


@dataclass
class ForwardContext:
    """What a model's forward needs besides token ids and positions; passed explicitly, never global."""

    meta: AttentionMetadata
    kv_cache: KVCache
    backend: AttentionBackend
