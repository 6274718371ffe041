"""Triton attention backend: paged flash attention for mixed batches, split-K flash-decoding for decodes.

Routing per step (host lists only, so no device sync): every request has one query -> decode kernel;
otherwise, with cold_path "sdpa", per request: cold prompts and long chunks over a cached prefix at a shape
built at start-up -> the library (cuDNN) calls of attention/sdpa.py, short chunks over a long prefix on
consecutive pages -> the packed cuDNN call plus the extend kernel for their last keys (`_packed`, run by
attention/packed_chunk.py; only with sdpa_shapes.PACKED_PREFIX_CALLS, off by default: eager between the graphs
its time scattered), the rest -> the decode kernel when they are all decodes, else the extend kernel over them
as one ragged sub-batch; with cold_path "triton", the extend kernel over the whole batch. Triton is imported
on construction. For CUDA graphs, each captured shape gets its own instance whose key-split counts are fixed
(sized for the longest context), so the grid of every replay is the one captured.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from longserve.attention import gluon_calls, sdpa_shapes
from longserve.attention.base import AttentionBackend, GraphShape, KVCache
from longserve.attention.metadata import AttentionMetadata, build_metadata
from longserve.attention.packed_chunk import packed_chunk
from longserve.attention.packed_graph import packed_backend
from longserve.attention.sdpa import prefix_split_sdpa, warm_up_packed, warm_up_plans
from longserve.attention.sdpa_shapes import PLANS, ModelShape, packed_splits, split_shape

COLD_PATHS = ("sdpa", "triton")
# Which chunks over a cached prefix run as two cuDNN calls merged (prefix_split_sdpa) rather than in the Triton
# extend kernel. Measured per layer on an H200, Llama-3.1-8B heads (scripts/probes/probe_split_threshold.py,
# ms Triton / cuDNN): 256 new over 32K 0.67 / 0.81; 512 over 8K 0.42 / 0.51, over 32K 1.14 / 0.72; 1024 over
# 8K 0.64 / 0.41. So: 1024+ new tokens always; 512+ over a prefix of 12K+ (the crossover, interpolated).
SPLIT_SDPA_MIN_QUERY = 1024
SPLIT_SDPA_MIN_QUERY_LONG_PREFIX = 512
SPLIT_SDPA_LONG_PREFIX = 12288


def use_split_sdpa(query_len: int, prefix_len: int) -> bool:
    """Whether a chunk of `query_len` new tokens over `prefix_len` cached ones runs faster on the split
    cuDNN path than in the Triton extend kernel (measurements above)."""
    if query_len >= SPLIT_SDPA_MIN_QUERY:
        return True
    return query_len >= SPLIT_SDPA_MIN_QUERY_LONG_PREFIX and prefix_len >= SPLIT_SDPA_LONG_PREFIX


class LibraryPlan(NamedTuple):
    """A step's requests whose attention runs in the library calls (attention/sdpa.py), decided once a step."""

    requests: tuple[int, ...]  # cold prompts, long chunks over a prefix, short chunks over a long one
    query_rows: dict[int, tuple[int, ...]]  # a long chunk's prefix-part calls (PlanRegistry.split_rows)
    packed: dict[int, int]  # a short chunk's split count (sdpa.packed_prefix_sdpa)


SHORT_CHUNK_ROWS = 256  # query rows per kv head (new tokens x group) up to which 64-row tiles win
# A short chunk's tile: 64 rows, 4 warps (scripts/probes/sweep_short_extend.py on an H200, 2026-12-01: no tile of
# 64 rows beat it).
SHORT_CHUNK_TILE: dict[str, int] = {"BLOCK_M": 64, "num_warps": 4}
# ... unless every request of the launch has more than WIDE_SHORT_MIN_ROWS rows a kv head (the prefix hit: 64 new
# tokens x 4 q heads = 256, in the lone chunk's graph): then one 256-row tile a kv head, four warpgroups of 64 rows
# (128 registers, 72 bytes of stack: scripts/dev/compile_extend.py), reads each key block once where 64-row tiles
# read it 4 times (from L2 but the first), keys split to one wave (choose_extend_splits one_wave). On an H100
# (RESULTS.md thirty-third session; `gpu_check.sh hit-fa3`, graph replays): 64 new over 32K 0.147 -> 0.122 ms a
# layer, over 128K 0.484 -> 0.399; 16 new (64 rows) 0.061 -> 0.113, hence the floor. The 8B hit (32K + 64) end to
# end: 13.2-14.3 -> 12.4-12.8 ms; A/B in one process each, alternating (thirty-fourth session, `queue.sh hit-tiles`):
# off 13.5 / 14.1, on 13.3 / 13.0 ms. A decode beside it fills 4 of 256 rows: a batch with one keeps
# SHORT_CHUNK_TILE. Its GPU test (tests/gpu/test_attention_gpu.py test_wide_short_tile, against fp32) passed at 028ec0c.
# At SHORT_CHUNK_STAGES (3) it builds with 72 bytes of stack, at 2 stages with none (scripts/dev/compile_extend.py);
# the probe's 0.122 ms ran 2 stages, the engine's hit 3: `queue.sh hit-tiles` times both ("num_stages" in the tile).
WIDE_SHORT_CHUNKS = True
WIDE_SHORT_TILE: dict[str, int] = {"BLOCK_M": 256, "BLOCK_N": 64, "num_warps": 16}
WIDE_SHORT_MIN_ROWS = 128
# A short chunk's launch knobs beside its 64-row tiles: pipeline stages and a register cap (None: the compiler's
# 252 registers, two programs an SM). On an H200 (RESULTS.md fifteenth session): alone, 2 stages capped at 168
# registers took 64 new over 32K scattered pages in 0.206-0.208 ms against 0.241-0.248 (`queue.sh
# hit-attention`), but the 8B hit in the engine ran 13.8 / 13.2 ms against 13.0 / 13.0 (`queue.sh hit-regs`).
SHORT_CHUNK_STAGES = 3
SHORT_CHUNK_MAXNREG: int | None = None
# Short-chunk tiles and the key split's warps are tuned at head dim 128; at 256 the wide tile does not compile for
# sm_90, the short one spills, the long chunks' holds 226 registers (scripts/dev/compile_extend.py; RESULTS.md 46th).
SHORT_TILES_MAX_HEAD_DIM = 128
# A long chunk split over its keys is short per program: 4 warps beat 8 (scripts/probes/sweep_short_extend.py on an
# H200: 64 new over 32K 0.255 -> 0.192 ms with 64-row tiles; 512 new 1.03 -> 0.83 ms).
KEY_SPLIT_WARPS = 4


def short_chunk_config(config: dict[str, int], wide: bool) -> dict[str, int]:
    """A short chunk's launch on a GPU from extend_config's `config`: SHORT_CHUNK_TILE, or WIDE_SHORT_TILE (a tile
    may carry its own stages)."""
    config = {**config, "num_stages": SHORT_CHUNK_STAGES, **(WIDE_SHORT_TILE if wide else SHORT_CHUNK_TILE)}
    return config if wide or SHORT_CHUNK_MAXNREG is None else {**config, "maxnreg": SHORT_CHUNK_MAXNREG}


class TritonAttentionBackend(AttentionBackend):
    """Stores K/V with `KVCache.store`, then runs the Triton kernel that fits the step's shape.

    cold_path: how a batch of only cold prompts runs ("sdpa" or "triton"; None = "sdpa" on CUDA, else
    "triton"). num_splits / extend_splits: fixed key-range split counts of the decode / extend kernels
    (e.g. for CUDA graphs); None picks them per step from the host-side lengths and the SM count.
    """

    name = "triton"
    supports_cuda_graphs = True

    @property
    def chunk_granule(self) -> int:  # the cuDNN path's prefix granule (sdpa_shapes.CHUNKS_ON_GRANULE)
        return sdpa_shapes.PREFIX_GRANULE if sdpa_shapes.CHUNKS_ON_GRANULE else 1

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

        # the Gluon extend kernel in its place where it applies, when switched on (gluon_calls.GLUON_EXTEND_CALLS)
        self._extend = (
            gluon_calls.extend_attention
            if gluon_calls.GLUON_EXTEND_CALLS
            else extend_attention.extend_attention
        )
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
        tuned = device.type == "cuda" and dtype != torch.float32 and head_dim <= SHORT_TILES_MAX_HEAD_DIM
        group = num_q_heads // num_kv_heads
        short = tuned and max(query_lens, default=0) * group <= SHORT_CHUNK_ROWS
        wide = (
            short
            and WIDE_SHORT_CHUNKS
            and min((q for q in query_lens if q), default=0) * group > WIDE_SHORT_MIN_ROWS
        )
        if short:
            config = short_chunk_config(config, wide)
        splits = self.extend_splits or self._choose_extend_splits(
            query_lens, seq_lens, num_q_heads, num_kv_heads, config["BLOCK_M"], self.num_sms(device), wide
        )
        if tuned and splits > 1 and not short:
            config = {**config, "num_warps": KEY_SPLIT_WARPS}
        return config, splits

    def warm_up(
        self, shape: GraphShape, chunk_size: int, kv_cache: KVCache, step_tokens: int | None = None
    ) -> None:
        """The cuDNN plans of sdpa_shapes.py, then one forward pass per variant of the extend kernel a
        serving mix reaches (short/long row tiles, keys split or not, the merge's tiles) and of the split
        cuDNN path's merge, over the reserved page 0 (as graph capture does). Compiled mid-step, each variant
        stalled the step for seconds, and a first launch waited for the device."""
        if self.cold_path in (None, "sdpa"):
            model = ModelShape(shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.dtype)
            warm_up_plans(model, shape.device, chunk_size, shape.max_seq_len, step_tokens)
            warm_up_packed(model, shape.device, shape.max_seq_len)
        cases = [([16, 0], [1, 16]), ([16, 0], [1, 512]), ([4096], [16]), ([4096], [512]), ([16384], [16])]
        if WIDE_SHORT_CHUNKS:  # its tile, keys split and not
            wide = max(1, SHORT_CHUNK_ROWS // (shape.num_q_heads // shape.num_kv_heads))
            cases += [([4096], [wide]), ([512], [wide])]
        cases += [([32768], [16]), ([chunk_size], [chunk_size])]  # the last: the split path's merge kernel
        page_size = kv_cache.page_size
        for prefix_lens, query_lens in cases:
            if max(map(sum, zip(prefix_lens, query_lens))) > shape.max_seq_len:
                continue
            tables = [[0] * -(-(p + n) // page_size) for p, n in zip(prefix_lens, query_lens)]
            meta = build_metadata(prefix_lens, query_lens, tables, page_size, shape.device)
            num_tokens = sum(query_lens)
            q = torch.zeros(
                num_tokens, shape.num_q_heads, shape.head_dim, dtype=shape.dtype, device=shape.device
            )
            kv = torch.zeros(
                num_tokens, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=shape.device
            )
            self.forward(q, kv, kv, 0, meta, kv_cache, shape.head_dim**-0.5)
        if shape.device.type == "cuda":
            torch.cuda.synchronize(shape.device)

    # ---- CUDA graphs ---------------------------------------------------------------------------
    def prepare_for_capture(self, batch_size: int, shape: GraphShape) -> TritonAttentionBackend:
        """A fixed decode split count for this batch size, sized for the longest context: the grid stays
        static whatever the lengths of a replay."""
        splits = self._choose_num_splits(
            shape.max_seq_len, batch_size, shape.num_kv_heads, self.num_sms(shape.device)
        )
        return TritonAttentionBackend(num_splits=splits)

    def prepare_for_extend_capture(self, num_tokens: int, shape: GraphShape) -> TritonAttentionBackend:
        """The extend kernel for one request of `num_tokens` new tokens, always (a graph cannot switch to
        the cuDNN paths), with the key-split count this backend would pick over the longest context."""
        _, splits = self.extend_launch(
            [num_tokens], [shape.max_seq_len], shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
            shape.dtype, shape.device,
        )  # fmt: skip
        return TritonAttentionBackend(cold_path="triton", extend_splits=splits)

    def prepare_for_packed_capture(self, num_tokens: int, shape: GraphShape, kv_cache: KVCache):
        return packed_backend(self, num_tokens, shape, kv_cache)

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            from longserve.kernels import split_k  # the one place the SM count is read (and faked in tests)

            self._num_sms = split_k.num_sms(device.index or 0) if device.type == "cuda" else 4
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
        kv_stored: bool = False,
        q_placed: bool = False,
    ) -> torch.Tensor:
        k_cache, v_cache = self.store_and_pages(q, k, v, layer_id, meta, kv_cache, kv_stored)
        num_kv_heads = k.shape[1]
        if q.shape[0] == 0:
            return torch.empty_like(q)

        if all(n == 1 for n in meta.query_lens_cpu):
            return self._decodes(q, k_cache, v_cache, meta, layer_id, kv_cache, scale, sliding_window)

        cold_path = self.cold_path or ("sdpa" if q.is_cuda else "triton")
        window_matters = sliding_window is not None and sliding_window < meta.max_seq_len
        plan = LibraryPlan((), {}, {})
        if cold_path == "sdpa" and not window_matters:
            plan = self._library_plan(q, num_kv_heads, meta, kv_cache.is_fp8)
        library = plan.requests
        if not library:
            return self._triton(q, k_cache, v_cache, meta, layer_id, kv_cache, scale, sliding_window)
        # per request: the library's (cuDNN's) cold prompts and long chunks, the Triton kernel's the rest (the
        # decodes and short chunks batched with them): one long chunk no longer sends its whole step to Triton
        out = torch.empty_like(q)
        chosen = set(library)
        rest = tuple(r for r in range(meta.num_reqs) if r not in chosen and meta.query_lens_cpu[r])
        if rest:
            sub = meta.subset(rest)
            if sub is None:  # metadata built without the host page rows: the whole batch in Triton
                return self._triton(q, k_cache, v_cache, meta, layer_id, kv_cache, scale, sliding_window)
            sub_meta, rows = sub
            # decodes beside the library's prompts in the split-K decode kernel: in the extend kernel a decode's
            # GQA rows filled 4 of a 64-row tile (through HTTP on an H200, a decode row cost a mixed step ~0.26 ms
            # against ~0.06 in a decode step: RESULTS.md nineteenth session)
            ragged = self._triton if any(meta.query_lens_cpu[r] > 1 for r in rest) else self._decodes
            part = ragged(
                q.index_select(0, rows), k_cache, v_cache, sub_meta, layer_id, kv_cache, scale, None
            )
            out.index_copy_(0, rows, part)
        dequantize = None
        if kv_cache.is_fp8:  # the library reads no e4m3: the new tokens as stored, the prefix dequantized
            k, v = kv_cache.as_stored(layer_id, k, v)

            def dequantize(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return kv_cache.dequantize(layer_id, a, b, q.dtype)

        for r, splits in plan.packed.items():
            self._packed(q, k_cache, v_cache, meta, r, splits, scale, out)
        split = tuple(r for r in library if r not in plan.packed)
        if not split:
            return out
        return prefix_split_sdpa(
            q, k, v, k_cache, v_cache, meta, scale, dequantize, requests=split, out=out, query_rows=plan.query_rows
        )  # fmt: skip

    def _packed(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        r: int,
        splits: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Request r's short chunk over its long prefix into its rows of `out`, packed (attention/packed_chunk.py)
        with this backend's extend kernel and tiles."""
        packed_chunk(q, k_cache, v_cache, meta, r, splits, scale, out, self._extend, self.extend_launch)

    def library_requests(
        self, q: torch.Tensor, num_kv_heads: int, meta: AttentionMetadata, kv_fp8: bool = False
    ) -> tuple[int, ...]:
        """The requests whose attention runs in the library calls (attention/sdpa.py): cold prompts and long
        chunks over a cached prefix, 16-bit, at a shape built at start-up (sdpa_shapes.py: a cuDNN plan built
        mid-step stalls every request in it for a few hundred ms; the Triton kernel compiles once for all
        lengths). Long chunks over a prefix: two cuDNN calls merged beat the Triton kernel (measured: ~530 vs
        ~315 TFLOP/s for 8K over 24K..120K; `use_split_sdpa`). Short chunks over a long prefix on consecutive
        pages of a 16-bit cache: the packed call (sdpa_shapes.PACKED_ROWS). Decided once per step (every layer
        asks the same: part of an eager layer's host time)."""
        return self._library_plan(q, num_kv_heads, meta, kv_fp8).requests

    def graph_defers(self, meta: AttentionMetadata, shape: GraphShape, kv_cache: KVCache) -> bool:
        """A lone short chunk whose prefix part runs packed in cuDNN: its plan has the prefix's key count, which
        a graph captured for the longest context cannot vary, so the step runs in the pieces instead (the
        attention eager between them). A sliding-window model's chunk then runs its Triton kernel eagerly."""
        if not sdpa_shapes.PACKED_PREFIX_CALLS:  # (a step's plan is host time the graph's replay would add)
            return False
        if (self.cold_path or ("sdpa" if shape.device.type == "cuda" else "triton")) != "sdpa":
            return False
        model = ModelShape(shape.num_q_heads, shape.num_kv_heads, shape.head_dim, shape.dtype)
        return bool(self._plan(model, shape.device, meta, kv_cache.is_fp8).packed)

    def _library_plan(
        self, q: torch.Tensor, num_kv_heads: int, meta: AttentionMetadata, kv_fp8: bool
    ) -> LibraryPlan:
        return self._plan(ModelShape(q.shape[1], num_kv_heads, q.shape[2], q.dtype), q.device, meta, kv_fp8)

    def _plan(
        self, model: ModelShape, device: torch.device, meta: AttentionMetadata, kv_fp8: bool
    ) -> LibraryPlan:
        return meta.per_step(
            ("library", self, model, device, kv_fp8), lambda: self._plan_library(model, device, meta, kv_fp8)
        )

    def _plan_library(
        self, model: ModelShape, device: torch.device, meta: AttentionMetadata, kv_fp8: bool
    ) -> LibraryPlan:
        # cuDNN's kernels: 16-bit only
        half = model.dtype in (torch.float16, torch.bfloat16) or device.type != "cuda"
        group = model.num_q_heads // model.num_kv_heads
        plan = LibraryPlan((), {}, {})
        chosen = []
        for r, (prefix_len, query_len) in enumerate(zip(meta.prefix_lens_cpu, meta.query_lens_cpu)):
            if not query_len:
                continue
            if prefix_len == 0:
                if PLANS.cold_ready(model, query_len, device):
                    chosen.append(r)
            elif half and use_split_sdpa(query_len, prefix_len):
                n = PLANS.split_rows(model, prefix_len, query_len, device)
                if n is not None:
                    chosen.append(r)
                    plan.query_rows[r] = n
            elif half and not kv_fp8:
                splits = packed_splits(prefix_len, query_len, group)
                if splits is not None and self._packs(model, device, meta, r, splits):
                    chosen.append(r)
                    plan.packed[r] = splits
        return plan._replace(requests=tuple(chosen))

    @staticmethod
    def _packs(model: ModelShape, device: torch.device, meta: AttentionMetadata, r: int, splits: int) -> bool:
        """Whether request r's short chunk runs packed (`splits` from sdpa_shapes.packed_splits): its plan built,
        and its prefix on consecutive pages (read in place; a gather would copy the whole prefix)."""
        if not PLANS.packed_ready(model, splits, device):
            return False
        shape = split_shape(meta.prefix_lens_cpu[r], meta.query_lens_cpu[r])
        if shape.prefix_keys % meta.page_size:  # the causal part's keys start on a page of their own
            return False
        return meta.contiguous_pages(r, shape.prefix_keys // meta.page_size) is not None

    def _decodes(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """The split-K decode kernel over the batch of `meta`, one new token a request (its K/V in the pages)."""
        num_splits = self.num_splits or self._choose_num_splits(
            meta.max_seq_len, meta.num_reqs, k_cache.shape[2], self.num_sms(q.device)
        )
        return self._decode(
            q, k_cache, v_cache, meta.seq_lens, meta.page_table, meta.page_size, scale, sliding_window,
            num_splits, k_scale=kv_cache.k_scales[layer_id], v_scale=kv_cache.v_scales[layer_id],
        )  # fmt: skip

    def _triton(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        layer_id: int,
        kv_cache: KVCache,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """The extend kernel over the batch of `meta` (its K/V already in the pages)."""
        shape = (q.shape[1], k_cache.shape[2], q.shape[2], q.dtype, q.device)
        config, extend_splits = meta.per_step(
            ("extend", self, *shape),
            lambda: self.extend_launch(meta.query_lens_cpu, meta.seq_lens_cpu, *shape),
        )
        return self._extend(
            q, k_cache, v_cache, meta.query_start_loc, meta.prefix_lens, meta.seq_lens, meta.page_table,
            meta.page_size, meta.max_query_len, scale, sliding_window, config=config, num_splits=extend_splits,
            k_scale=kv_cache.k_scales[layer_id], v_scale=kv_cache.v_scales[layer_id],
        )  # fmt: skip
