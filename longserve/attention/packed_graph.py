"""The lone short chunk's CUDA graph over a long cached prefix (the prefix hit), with its prefix part in one cuDNN
call that the graph holds.

The packed call (sdpa.packed_prefix_sdpa: each kv head's q heads as up to PACKED_ROWS rows, the prefix's keys split
as the batch) took the hit's prefix part in ~70 us a layer on an H200 where the Triton kernel in the graph takes
~122-148 us on an H100 (RESULTS.md seventeenth and thirty-third sessions). Through torch, cuDNN's plans fix the key
count, so that path (sdpa_shapes.PACKED_PREFIX_CALLS) ran between the piecewise graphs, eagerly, and its host
launches scattered the hit's TTFT. Built here with cudnn-frontend, every per-request input is a device tensor:
split s reads its run of the prefix's pages through a page table [S, 1, W, 1] (any pages) and its key count from
seq_len_kv. The prefix's last partial page and the new tokens run causal, merged with the S parts in the same kernel
(kernels/packed_tail.py, PACKED_TAIL_FUSED; before it, the extend kernel's partials then
merge_attention.merge_packed, two launches a layer). Every per-step input reaches the device in one copy,
before the replay (`prepare_for_replay`). On the CPU, or without the frontend, `prefix_attention_ref` stands in
for the cuDNN call (the tests run the whole path).

On (PACKED_GRAPHS) since the thirty-fifth session (RESULTS.md; H100): the 8B hit (32K cached + 64 new) went from
12.93 to 12.57 ms (means of three A/Bs at 16 splits, `gpu_check.sh hit-cudnn-graph`), then to 11.6 ms (105.6x the
cold 32K) at 8 splits (`hit-merge`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch

from longserve.attention import sdpa_shapes
from longserve.attention.base import AttentionBackend, GraphShape, KVCache
from longserve.attention.metadata import AttentionMetadata
from longserve.kernels.extend_attention import extend_attention
from longserve.platform import to_device_async

logger = logging.getLogger("longserve.attention.packed_graph")

PACKED_GRAPHS = True
# the prefix's splits: at 8 the 8B hit took 11.6 ms where 16 took 11.9 / 12.2 (H100, `hit-merge`; the cuDNN call
# ~2 us a layer faster, the merge of the splits 5.8 against 13.9 us)
PACKED_GRAPH_SPLITS = 8
# the causal part and the merge of the S + 1 parts in one kernel a layer (kernels/packed_tail.py) instead of the
# extend kernel's partials and merge_packed (0.42 + 0.19 ms of the 8B hit on an H100). `gpu_check.sh hit-tail`, an
# H100, 2026-12-06, two calls x two rounds, 8B hit 32768 + 64: 12.5 / 12.7 / 12.4 / 12.8 ms off, 11.6 / 12.3 / 11.8
# / 11.8 ms fused at 32 rows a program (64 rows: 12.1 / 12.7 / 12.0 / 12.4)
PACKED_TAIL_FUSED = True
# the rotary kernel writes each layer's rotated q into the packed call's rows too (kernels/rope.py, q_dst), instead
# of a copy of its own a layer (a torch elementwise kernel: 0.09 ms of the 8B hit on an H100 and 32 launch gaps,
# thirty-fifth session's `hit-profile`). `gpu_check.sh hit-tail`, an H100, 2026-12-07, 8B hit 32768 + 64, two rounds:
# 12.0 / 12.2 ms against 12.2 / 12.4 without (the fused tail on in both; 4 cuDNN splits, not 8: 14.7 / 14.5)
PACKED_Q_BY_ROPE = True


def split_pages(num_pages: int, splits: int) -> list[tuple[int, int]]:
    """[start, end) of `splits` near-equal runs of a prefix's pages: none empty while num_pages >= splits (an empty
    split's log-sum-exp is not -inf in cuDNN but garbage, RESULTS.md seventeenth session)."""
    return [(s * num_pages // splits, (s + 1) * num_pages // splits) for s in range(splits)]


def prefix_attention_ref(
    q_rows: torch.Tensor,  # [Hkv, R, D]
    k_cache: torch.Tensor,  # [num_pages, page_size, Hkv, D]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [S, 1, W, 1] page ids of each split
    len_kv: torch.Tensor,  # [S, 1, 1, 1] keys of each split
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the cuDNN call computes, in torch (fp32 math): each split's attention of the rows over its keys, no mask;
    (o [S, Hkv, R, D] in q's dtype, lse [S, Hkv, R] natural log)."""
    page_size = k_cache.shape[1]
    outs, lses = [], []
    for s in range(table.shape[0]):
        n = int(len_kv[s])
        pages = table[s, 0, : -(-n // page_size), 0].long()
        k = k_cache[pages].flatten(0, 1)[:n].float().transpose(0, 1)  # [Hkv, n, D]
        v = v_cache[pages].flatten(0, 1)[:n].float().transpose(0, 1)
        scores = torch.einsum("hrd,hkd->hrk", q_rows.float(), k) * scale
        outs.append(torch.einsum("hrk,hkd->hrd", torch.softmax(scores, -1), v).to(q_rows.dtype))
        lses.append(torch.logsumexp(scores, -1))
    return torch.stack(outs), torch.stack(lses)


class PrefixCall:
    """The split prefix attention of one captured bucket: its static device inputs (the rows, each split's pages
    and key count) and the cuDNN graph over them, built on the first call (the capture's eager warm-up), one variant
    pack a layer (each layer's pages)."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        splits: int,
        max_pages: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.splits, self.width = splits, -(-max_pages // splits)
        self.q_rows = torch.zeros(num_kv_heads, sdpa_shapes.PACKED_ROWS, head_dim, dtype=dtype, device=device)
        self.len_q = torch.full((splits, 1, 1, 1), sdpa_shapes.PACKED_ROWS, dtype=torch.int32, device=device)
        self.o = torch.empty(
            splits, num_kv_heads, sdpa_shapes.PACKED_ROWS, head_dim, dtype=dtype, device=device
        )
        self.stats = torch.empty(
            splits, num_kv_heads, sdpa_shapes.PACKED_ROWS, 1, dtype=torch.float32, device=device
        )
        self.cudnn: Any = None
        if device.type == "cuda":
            import cudnn  # nvidia-cudnn-frontend (`packs` checked that it imports)

            self.cudnn, self.handle = cudnn, cudnn.create_handle()
        self.graph: Any = None
        self.q_all: torch.Tensor | None = None
        self.packs: dict[int, dict] = {}

    def __call__(
        self, layer_id: int, k_cache: torch.Tensor, v_cache: torch.Tensor, table, len_kv, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(o [S, Hkv, R, D], lse [S, Hkv, R] natural log) of the rows over each split's keys."""
        if self.cudnn is None:
            return prefix_attention_ref(self.q_rows, k_cache, v_cache, table, len_kv, scale)
        kc, vc = (c.permute(0, 2, 1, 3) for c in (k_cache, v_cache))  # [pages, Hkv, page_size, D], strided
        if self.graph is None:
            self._build(kc, vc, table, len_kv, scale)
        if self.q_all is not None:  # the frontend took no stride-0 batch: the rows copied for every split
            self.q_all.copy_(self.q_rows.unsqueeze(0).expand_as(self.q_all))
        if layer_id not in self.packs:
            t = self.tensors
            q = self.q_rows.unsqueeze(0).expand(self.splits, -1, -1, -1) if self.q_all is None else self.q_all
            self.packs[layer_id] = {
                t["q"]: q, t["k"]: kc, t["v"]: vc,
                t["table"]: table, t["len_q"]: self.len_q, t["len_kv"]: len_kv, t["o"]: self.o, t["stats"]: self.stats,
            }  # fmt: skip
        # on the current stream: a capture's side stream too (the handle would launch on its own otherwise)
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.graph.execute(self.packs[layer_id], self.workspace, handle=self.handle)
        return self.o, self.stats[..., 0]

    def _build(self, kc: torch.Tensor, vc: torch.Tensor, table, len_kv, scale: float) -> None:
        try:  # the rows once for every split: a stride-0 batch, as the eager packed call passes them to torch
            self._build_graph(kc, vc, table, len_kv, scale, stride0=True)
        except Exception as e:
            logger.info(
                "cuDNN took no stride-0 batch of packed rows (%s): one copy a split instead", str(e)[:200]
            )
            self.q_all = self.q_rows.new_empty(self.o.shape)
            self._build_graph(kc, vc, table, len_kv, scale, stride0=False)

    def _build_graph(
        self, kc: torch.Tensor, vc: torch.Tensor, table, len_kv, scale: float, stride0: bool
    ) -> None:
        cudnn, dt = self.cudnn, self.cudnn.data_type
        io = dt.BFLOAT16 if self.q_rows.dtype == torch.bfloat16 else dt.HALF
        g = cudnn.pygraph(
            io_data_type=io, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT, handle=self.handle
        )
        num_kv_heads, rows, head_dim = self.q_rows.shape
        batch_stride = 0 if stride0 else num_kv_heads * rows * head_dim
        q = g.tensor(name="q", dim=[self.splits, num_kv_heads, rows, head_dim],
                     stride=[batch_stride, rows * head_dim, head_dim, 1], data_type=io)  # fmt: skip
        k, v, tt = g.tensor_like(kc), g.tensor_like(vc), g.tensor_like(table)
        len_q, lkv = g.tensor_like(self.len_q), g.tensor_like(len_kv)
        o, stats = g.sdpa(
            name="packed_prefix", q=q, k=k, v=v, attn_scale=scale, generate_stats=True, use_padding_mask=True,
            seq_len_q=len_q, seq_len_kv=lkv, paged_attention_k_table=tt, paged_attention_v_table=tt,
            paged_attention_max_seq_len_kv=self.width * kc.shape[2],
        )  # fmt: skip
        o.set_output(True).set_dim(list(self.o.shape)).set_stride(list(self.o.stride()))
        stats.set_output(True).set_data_type(dt.FLOAT).set_dim(list(self.stats.shape))
        stats.set_stride(list(self.stats.stride()))
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph, self.tensors = g, dict(q=q, k=k, v=v, table=tt, len_q=len_q, len_kv=lkv, o=o, stats=stats)
        self.workspace = torch.empty(
            max(g.get_workspace_size(), 1), dtype=torch.uint8, device=self.q_rows.device
        )


@functools.cache
def frontend_available() -> bool:
    try:
        import cudnn  # noqa: F401
    except Exception as e:  # not installed, or no libcudnn it can load
        logger.warning(
            "cuDNN's frontend does not import (%s): a short chunk over a long cached prefix runs without its packed "
            "graph (the 8B shape's 32K hit ~0.7-1 ms slower on an H100); `pip install nvidia-cudnn-frontend` (in "
            "longserve[gpu])",
            e,
        )
        return False
    return True


class PackedPrefixBackend(AttentionBackend):
    """The backend a packed bucket's graph captures with (TritonAttentionBackend.prepare_for_packed_capture): static
    per-step inputs (the splits' pages and key counts, the causal part's one-request metadata) filled from the step's
    host lists in one copy before the replay, and each layer's attention over them. A sliding-window layer (whose
    keys the packed rows cannot limit) runs `plain`, the backend the bucket's plain graph captures with."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(
        self,
        num_tokens: int,
        shape: GraphShape,
        kv_cache: KVCache,
        causal_config: dict[str, int],
        plain: AttentionBackend,
    ) -> None:
        self.plain = plain
        self.num_tokens, self.page_size = num_tokens, kv_cache.page_size
        self.group = shape.num_q_heads // shape.num_kv_heads
        max_pages = -(-shape.max_seq_len // self.page_size)
        self.splits = PACKED_GRAPH_SPLITS
        self.call = PrefixCall(
            shape.num_kv_heads, shape.head_dim, self.splits, max_pages, shape.dtype, shape.device
        )
        # the causal part's pages: the prefix's last partial page (the tail) and the bucket's rows after it
        self.causal_pages = -(-(self.page_size - 1 + num_tokens) // self.page_size) + 1
        self.causal_config = causal_config
        sizes = [self.splits * self.call.width, self.splits, 2, 1, 1, self.causal_pages]
        self.offsets = np.cumsum([0, *sizes])
        self.host = np.zeros(self.offsets[-1], dtype=np.int32)
        self.buffer = torch.zeros(self.offsets[-1], dtype=torch.int32, device=shape.device)
        table, len_kv, qsl, prefix, seq, pages = (
            self.buffer[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])
        )
        self.table = table.view(self.splits, 1, self.call.width, 1)
        self.len_kv = len_kv.view(self.splits, 1, 1, 1)
        self.causal = (qsl, prefix, seq, pages.view(1, self.causal_pages))
        # until a step loads them (the capture's warm-up and graph): every split and the rows over page 0's first key
        self.len_kv.fill_(1)
        qsl[1], seq[0] = num_tokens, 1

    def q_destination(self, num_tokens: int) -> torch.Tensor | None:
        """The packed rows as [T, Hkv, G, D] (row t * G + g of kv head j), for the rotary kernel to fill
        (PACKED_Q_BY_ROPE)."""
        if not PACKED_Q_BY_ROPE:
            return None
        num_kv_heads, rows, head_dim = self.call.q_rows.shape
        packed = self.call.q_rows.view(num_kv_heads, rows // self.group, self.group, head_dim)
        return packed[:, :num_tokens].permute(1, 0, 2, 3)

    def takes(self, meta: AttentionMetadata) -> bool:
        """A lone chunk of at most this bucket over a prefix long enough to split (its host page rows known)."""
        return (
            meta.num_reqs == 1
            and meta.prefix_lens_cpu[0] >= max(sdpa_shapes.PACKED_MIN_PREFIX, self.splits * self.page_size)
            and len(meta.page_rows_cpu) == 1
            and meta.num_tokens <= self.num_tokens
        )

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        """The step's splits and causal metadata into the static inputs (one host-to-device copy)."""
        prefix, n = meta.prefix_lens_cpu[0], meta.query_lens_cpu[0]
        pages = np.asarray(meta.page_rows_cpu[0])
        prefix_pages = prefix // self.page_size
        tail = prefix - prefix_pages * self.page_size
        host, off = self.host, self.offsets
        host[:] = 0
        table = host[off[0] : off[1]].reshape(self.splits, self.call.width)
        for s, (a, b) in enumerate(split_pages(prefix_pages, self.splits)):
            table[s, : b - a] = pages[a:b]
            host[off[1] + s] = (b - a) * self.page_size
        host[off[2] : off[3]] = (0, self.num_tokens)
        host[off[3]], host[off[4]] = tail, tail + n
        causal = pages[prefix_pages : prefix_pages + self.causal_pages]
        host[off[5] : off[5] + len(causal)] = causal
        self.buffer.copy_(to_device_async(torch.from_numpy(host), self.buffer.device), non_blocking=True)

    def forward(
        self,
        q: torch.Tensor,  # [t, Hq, D]: the bucket's rows
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
        q_placed: bool = False,
    ) -> torch.Tensor:
        """The rows over the prefix (cuDNN) and causally over the tail and themselves (the extend kernel's
        partials), merged: [t, Hq, D]. `q_placed`: q is in the rows already (`q_destination`)."""
        if sliding_window is not None:
            return self.plain.forward(q, k, v, layer_id, meta, kv_cache, scale, sliding_window, kv_stored)
        k_cache, v_cache = self.store_and_pages(q, k, v, layer_id, meta, kv_cache, kv_stored)
        if q.is_cuda:
            from longserve.kernels.merge_attention import merge_packed
        else:
            from longserve.kernels.attention_reference import merge_packed_ref as merge_packed
        t, num_q_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_q_heads // num_kv_heads
        if not q_placed:
            by_token = q.reshape(t, num_kv_heads, group * head_dim).transpose(0, 1)  # [Hkv, t, G * D]
            rows = self.call.q_rows.view(num_kv_heads, sdpa_shapes.PACKED_ROWS // group, group * head_dim)
            rows[:, :t] = by_token  # row t * G + g of kv head j: q head j * G + g of token t
        o_pre, lse_pre = self.call(layer_id, k_cache, v_cache, self.table, self.len_kv, scale)
        qsl, prefix, seq, pages = self.causal
        if PACKED_TAIL_FUSED:
            if q.is_cuda:
                from longserve.kernels.packed_tail import packed_tail
            else:
                from longserve.kernels.attention_reference import packed_tail_ref as packed_tail
            return packed_tail(q, k_cache, v_cache, pages.view(-1), prefix, seq, o_pre, lse_pre, scale)
        part, lse = extend_attention(
            q, k_cache, v_cache, qsl, prefix, seq, pages, self.page_size, t, scale, config=self.causal_config,
            num_splits=1, partials=True,
        )  # fmt: skip
        out = torch.empty_like(q)
        merge_packed(o_pre, lse_pre, part[:, :, 0].transpose(0, 1), lse[:, :, 0].transpose(0, 1), out, 0,
                     causal_log2=True)  # fmt: skip
        return out


def packed_backend(
    backend: Any, num_tokens: int, shape: GraphShape, kv_cache: KVCache
) -> PackedPrefixBackend | None:
    """TritonAttentionBackend.prepare_for_packed_capture (`backend`: that Triton backend, its launch choices): the
    bucket's packed backend, or None (`packs`)."""
    if not packs(num_tokens, shape, kv_cache):
        return None
    plain = backend.prepare_for_extend_capture(num_tokens, shape)  # what a sliding-window layer launches
    causal, _ = backend.extend_launch(  # the tail (under a page) and the bucket's own keys, in one split
        [num_tokens], [num_tokens + kv_cache.page_size - 1], shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
        shape.dtype, shape.device,
    )  # fmt: skip
    return PackedPrefixBackend(num_tokens, shape, kv_cache, causal, plain)


def packs(num_tokens: int, shape: GraphShape, kv_cache: KVCache) -> bool:
    """Whether a bucket of `num_tokens` gets a packed graph: the switch on, a 16-bit cache (on a GPU: bf16/fp16 with
    the frontend importable), the bucket's rows within PACKED_ROWS."""
    group = shape.num_q_heads // shape.num_kv_heads
    if (
        not PACKED_GRAPHS
        or kv_cache.is_fp8
        or sdpa_shapes.PACKED_ROWS % group
        or num_tokens * group > sdpa_shapes.PACKED_ROWS
    ):
        return False
    if shape.device.type == "cuda":
        return shape.dtype in (torch.float16, torch.bfloat16) and frontend_available()
    return True


__all__ = [
    "PACKED_GRAPHS",
    "PACKED_GRAPH_SPLITS",
    "PACKED_Q_BY_ROPE",
    "PackedPrefixBackend",
    "packs",
    "prefix_attention_ref",
    "split_pages",
]
