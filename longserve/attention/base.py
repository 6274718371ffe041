"""The attention backend interface: the paged KV cache (KVCache), the shapes a backend's CUDA graphs are built
for (GraphShape), the backend base class (AttentionBackend) and what a layer hands it (ForwardContext). The
per-step metadata they read (AttentionMetadata, and the token layout of a step) lives in attention/metadata.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from longserve.attention.kv_quant import dequantize_kv, is_fp8, quantize_kv
from longserve.attention.metadata import AttentionMetadata
from longserve.attention.recurrent_state import RecurrentStates


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
    including the token itself, as in HF Mistral. `kv_stored`: the caller's rotary kernel stored k/v already;
    `q_placed`: it also wrote the rotated q into the tensor `q_destination` gave (a backend that gives none
    never sees it set).

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
        q_placed: bool = False,
    ) -> torch.Tensor: ...

    def q_destination(self, num_tokens: int) -> torch.Tensor | None:
        """Where the rotary kernel should also write a step's rotated q ([T, Hkv, G, D], any strides but D's), so
        that `forward` need not copy it there itself; None (the default): nowhere."""
        return None

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
    # a hybrid model's linear-attention states (attention/recurrent_state.py), slots in meta.state_slots
    states: RecurrentStates | None = None
