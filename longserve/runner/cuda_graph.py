"""CUDA graphs for decode steps and lone short prefill chunks, replayed over static input buffers (and
`build_graphs`, which also builds the piecewise graphs of runner/piecewise_graph.py).

A decode step (every scheduled request computes exactly one token) of n requests replays the graph of
the smallest bucket >= n. Rows n..bucket are padding: token 0 at position 0, writing its K/V into page 0
(reserved, never handed out) and attending over one key there. Each bucket captures with the backend the
attention backend's `prepare_for_capture` returns (a fixed launch grid for that size), and that backend's
`prepare_for_replay` runs before each replay; backends without `supports_cuda_graphs` are never captured.
The page size is the KV cache's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from longserve.attention.base import AttentionBackend, ForwardContext, GraphShape, KVCache
from longserve.attention.metadata import AttentionMetadata
from longserve.attention.recurrent_state import RecurrentStates
from longserve.config import EngineConfig
from longserve.progress import Progress
from longserve.runner.piecewise_graph import PiecewiseGraphRunner
from longserve.runner.static_tokens import StaticTokens

logger = logging.getLogger("longserve.runner.cuda_graph")

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_graphs(
    sizes: list[int],
    forward: Callable[[int], torch.Tensor],
    pool: object,
    graphs: dict[int, torch.cuda.CUDAGraph],
    outputs: dict[int, torch.Tensor],
    what: str,
) -> None:
    """Capture forward(n) for each size into graphs[n] (its output tensor into outputs[n]) on a side stream,
    largest first so that later graphs reuse its pool blocks; two eager runs per size before its capture
    compile the kernels and settle the allocations outside the graph. Logs 'captured N <what>' with the
    sizes filled into `what`'s %s, and the time taken."""
    start = time.perf_counter()
    progress = Progress(logger, "capturing " + what.partition(" (")[0], len(sizes))  # what, less its sizes
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i, n in enumerate(sorted(sizes, reverse=True)):
            for _ in range(2):
                forward(n)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs[n] = forward(n)
            graphs[n] = graph
            progress.step(i + 1)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    sizes_text = ",".join(map(str, sorted(sizes)))
    logger.info("captured %d %s in %.1fs", len(graphs), what % sizes_text, time.perf_counter() - start)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in _BUCKETS if b <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphRunner:
    """Decode graphs of batch sizes up to `max_bs` (bucketed), for sequences up to `shape.max_seq_len`.
    `eager = True` runs the same static-buffer forward without graphs (tests on the CPU)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        shape: GraphShape,
        max_bs: int,
        states: RecurrentStates | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # a hybrid model's linear-attention states: each row's slot, -1 for a padding row (the kernels read a zero
        # state for it and write nothing), and every row continues a history (its one-token kernels)
        self.states = states
        device = shape.device
        max_pages_per_req = -(-shape.max_seq_len // kv_cache.page_size)
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        n = self.max_bs
        i32 = dict(dtype=torch.int32, device=device)
        self.tokens = StaticTokens(n, device)
        self.seq_lens = torch.ones(n, **i32)
        self.prefix_lens = torch.zeros(n, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.page_table = torch.zeros(n, max_pages_per_req, **i32)
        self.state_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.backends = {bs: backend.prepare_for_capture(bs, shape) for bs in self.batch_sizes}
        self.pool = None
        self.eager = False  # True: run() executes the static-buffer forward instead of replaying

    def _context(self, bs: int) -> ForwardContext:
        meta = AttentionMetadata(
            page_size=self.kv_cache.page_size,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs],
            page_table=self.page_table[:bs],
            slot_mapping=self.tokens.slot_mapping[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[1] * bs,
            # a hybrid model's rows continue their histories: its layers take the one-token kernels
            prefix_lens_cpu=[0 if self.states is None else 1] * bs,
        )
        if self.states is not None:
            meta.state_slots = self.state_slots[:bs]
        return ForwardContext(
            meta=meta, kv_cache=self.kv_cache, backend=self.backends[bs], states=self.states
        )

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.tokens.input_ids[:bs], self.tokens.positions[:bs], self._context(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        capture_graphs(
            self.batch_sizes,
            self._forward,
            self.pool,
            self.graphs,
            self.outputs,
            "decode CUDA graphs (batch sizes %s)",
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            bool(self.graphs or self.eager)
            and 0 < meta.num_reqs <= self.max_bs
            and meta.num_tokens == meta.num_reqs
            and meta.page_table.shape[1] <= self.page_table.shape[1]
            # a hybrid model's one-token prompt starts its state: the eager step's chunked kernels do that
            and (self.states is None or meta.continues_every_request)
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the decode graph for these (already on-device) inputs; returns hidden [n, H]."""
        n = meta.num_reqs
        bs = next(b for b in self.batch_sizes if b >= n)
        self.tokens.load(input_ids, positions, meta.slot_mapping, bs)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.page_table[:n, : meta.page_table.shape[1]].copy_(meta.page_table)
        if bs > n:  # padding rows: one key at slot 0 of page 0
            self.seq_lens[n:bs].fill_(1)
            self.page_table[n:bs, 0].zero_()
        if self.states is not None:
            self.state_slots[:n].copy_(meta.state_slots)
            self.state_slots[n:bs].fill_(-1)
        self.backends[bs].prepare_for_replay(meta)
        if self.eager:
            with torch.inference_mode():
                return self._forward(bs)[:n]
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)


def graph_token_buckets(max_tokens: int) -> list[int]:
    sizes = [t for t in PREFILL_BUCKETS if t <= max_tokens]
    if max_tokens > 1 and (not sizes or sizes[-1] != max_tokens):
        sizes.append(max_tokens)
    return sizes


class ExtendGraphRunner:
    """CUDA graphs for a lone short chunk: one request computing 2..max_tokens new tokens over any cached
    prefix (a question over a cached document, a chat's next turn). Eagerly, such a step is bound by the
    host launching ~15 kernels per layer (measured on an H200: GPU busy 9.6 of ~21 ms for 64 new tokens over
    32K); replayed, it launches once.

    The chunk of n tokens replays the graph of the smallest bucket T >= n: tokens n..T are padding at the
    request's last position, writing their K/V into page 0 (reserved). The request's seq_len stays its real
    prefix + n, so real tokens attend exactly as in an eager step and padding rows (never sampled) see only
    real keys. Each bucket captures with the backend `prepare_for_extend_capture` plans (Triton: its extend
    kernel with a fixed key-split count, sized for the longest context `shape.max_seq_len`).
    `eager = True` runs the same static-buffer forward without graphs (tests on the CPU).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        backend: AttentionBackend,
        shape: GraphShape,
        max_tokens: int,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        device = shape.device
        max_pages_per_req = -(-shape.max_seq_len // kv_cache.page_size)
        self.max_positions = max_pages_per_req * kv_cache.page_size
        # a bucket longer than the page table would make the capture's padding rows read past it (an illegal
        # address on an H200 with a 192-token pool and 512-token buckets); can_run() never picks one anyway
        self.buckets = graph_token_buckets(min(max_tokens, self.max_positions))
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        n = self.max_tokens
        i32 = dict(dtype=torch.int32, device=device)
        self.tokens = StaticTokens(n, device)
        self.seq_lens = torch.ones(1, **i32)
        self.prefix_lens = torch.zeros(1, **i32)
        self.query_start_locs = {t: torch.tensor([0, t], **i32) for t in self.buckets}
        self.page_table = torch.zeros(1, max_pages_per_req, **i32)
        # asked before each replay whether the step's attention is one these graphs cannot run (graph_defers),
        # once piecewise graphs exist to take the step (build_graphs): an eager step is slower than either
        self.backend, self.shape = backend, shape
        self.defers = False
        self.backends = {t: backend.prepare_for_extend_capture(t, shape) for t in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # a second graph of a bucket whose backend takes some steps another way (a long prefix in one cuDNN call:
        # attention/packed_graph.py), replayed when its backend `takes` the step
        self.packed = {
            t: b
            for t in self.buckets
            if (b := backend.prepare_for_packed_capture(t, shape, kv_cache)) is not None
        }
        self.packed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.packed_outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.eager = False  # True: run() executes the static-buffer forward instead of replaying
        self.num_runs = 0
        self.num_packed_runs = 0  # of which the packed graphs replayed

    def _context(self, t: int, backend: AttentionBackend | None = None) -> ForwardContext:
        meta = AttentionMetadata(
            page_size=self.kv_cache.page_size,
            query_start_loc=self.query_start_locs[t],
            seq_lens=self.seq_lens,
            prefix_lens=self.prefix_lens,
            page_table=self.page_table,
            slot_mapping=self.tokens.slot_mapping[:t],
            query_lens_cpu=[t],
            seq_lens_cpu=[self.max_positions],  # host hints only: the kernel reads the device lengths
            prefix_lens_cpu=[self.max_positions - t],
        )
        return ForwardContext(meta=meta, kv_cache=self.kv_cache, backend=backend or self.backends[t])

    def _forward(self, t: int, packed: bool = False) -> torch.Tensor:
        context = self._context(t, self.packed[t] if packed else None)
        return self.model(self.tokens.input_ids[:t], self.tokens.positions[:t], context)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.seq_lens.fill_(1)  # warm-up and capture attend over page 0 only
        self.prefix_lens.zero_()
        self.page_table.zero_()
        capture_graphs(
            self.buckets, self._forward, self.pool, self.graphs, self.outputs,
            "prefill CUDA graphs (chunks of up to %s tokens)",
        )  # fmt: skip
        if not self.packed:
            return
        try:  # an optimisation that must not keep a server from starting: the plain buckets take every step
            capture_graphs(
                list(self.packed), lambda t: self._forward(t, packed=True), self.pool, self.packed_graphs,
                self.packed_outputs, "prefill CUDA graphs with a long prefix in one cuDNN call (chunks of %s tokens)",
            )  # fmt: skip
        except Exception as e:
            logger.warning(
                "the packed prefill graphs failed to capture (%s): chunks run in the plain ones", e
            )
            self.packed, self.packed_graphs, self.packed_outputs = {}, {}, {}

    def can_run(self, meta: AttentionMetadata) -> bool:
        if not (self.graphs or self.eager) or meta.num_reqs != 1:
            return False
        n = meta.num_tokens
        if not 1 < n <= self.max_tokens:
            return False
        bucket = next(b for b in self.buckets if b >= n)
        # the kernel may read page-table entries up to position prefix + bucket (padding rows)
        return (
            meta.prefix_lens_cpu[0] + bucket <= self.max_positions
            and meta.page_table.shape[1] <= self.page_table.shape[1]
            and not (self.defers and self.backend.graph_defers(meta, self.shape, self.kv_cache))
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the bucket's graph for this chunk (inputs already on the device); hidden [n, H]."""
        n = meta.num_tokens
        t = next(b for b in self.buckets if b >= n)
        pages = meta.page_table.shape[1]
        self.num_runs += 1
        self.tokens.load(input_ids, positions, meta.slot_mapping, t, pad_at_last_position=True)
        self.seq_lens.copy_(meta.seq_lens)
        self.prefix_lens.copy_(meta.prefix_lens)
        self.page_table[:, :pages].copy_(meta.page_table)
        self.page_table[:, pages:].zero_()
        packed = t in self.packed and self.packed[t].takes(meta)
        (self.packed[t] if packed else self.backends[t]).prepare_for_replay(meta)
        self.num_packed_runs += packed
        if self.eager:
            with torch.inference_mode():
                return self._forward(t, packed)[:n]
        (self.packed_graphs if packed else self.graphs)[t].replay()
        return (self.packed_outputs if packed else self.outputs)[t][:n]


def build_graphs(
    model: torch.nn.Module,
    kv_cache: KVCache,
    backend: AttentionBackend,
    shape: GraphShape,
    config: EngineConfig,
    states: RecurrentStates | None = None,
) -> tuple[DecodeGraphRunner | None, ExtendGraphRunner | None, PiecewiseGraphRunner | None]:
    """The step graphs the config asks for, captured on a GPU (None where off): decode batches up to
    cuda_graph_max_bs, a lone chunk up to cuda_graph_max_prefill_tokens, then the pieces of any step up to
    piecewise_cuda_graph_max_tokens; the later two in the decode graphs' pool (replays never overlap). A hybrid
    model (`states`) takes no lone-chunk graphs (a chunk's padding rows would be folded into its state); its
    pieces run the linear attention's mixer over the real rows between them, as the attention."""
    if shape.device.type != "cuda" or config.enforce_eager:
        return None, None, None
    if not backend.supports_cuda_graphs:
        logger.info(
            "the %s attention backend cannot be captured in CUDA graphs: decode runs eagerly", backend.name
        )
        return None, None, None
    max_bs = min(config.cuda_graph_max_bs, config.max_running_requests)
    decode = DecodeGraphRunner(model, kv_cache, backend, shape, max_bs=max_bs, states=states)
    decode.capture()
    extend = None
    max_tokens = min(config.cuda_graph_max_prefill_tokens, config.chunked_prefill_size)
    if max_tokens >= 2 and states is None:
        extend = ExtendGraphRunner(model, kv_cache, backend, shape, max_tokens=max_tokens)
        extend.capture(pool=decode.pool)
    max_tokens = min(config.piecewise_cuda_graph_max_tokens, config.chunked_prefill_size)
    pieces = None
    if max_tokens >= 2:
        pieces = capture_pieces(
            model, kv_cache, shape, max_tokens, decode.pool, config.piecewise_cuda_graph_tokens
        )
    if extend is not None and pieces is not None:
        extend.defers = pieces.max_tokens >= extend.max_tokens  # a deferred chunk runs in the pieces
    return decode, extend, pieces


def capture_pieces(
    model: torch.nn.Module,
    kv_cache: KVCache,
    shape: GraphShape,
    max_tokens: int,
    pool: object,
    sizes: tuple[int, ...] | None = None,
) -> PiecewiseGraphRunner | None:
    """The piecewise graphs at `sizes` (default: piecewise_buckets') up to max_tokens, or None (mixed steps run
    eagerly, as with --piecewise-cuda-graph-max-tokens 0) when no size is left or a model's dense parts cannot be
    captured: they are on by default, an optimisation that must not keep a server from starting; the warning
    names the error."""
    # its buffers only: nothing is captured before the checks below
    pieces = PiecewiseGraphRunner(model, kv_cache, shape, max_tokens, sizes)
    buckets = pieces.buckets
    if sizes is not None and len(buckets) < len(sizes):
        logger.info(
            "--piecewise-cuda-graph-tokens: sizes above %d tokens (the chunk, --piecewise-cuda-graph-max-tokens) "
            "are not captured: %s", max_tokens, ",".join(str(n) for n in sizes if n > max_tokens),
        )  # fmt: skip
    if not buckets:
        logger.info(
            "no --piecewise-cuda-graph-tokens size within %d tokens: mixed steps run eagerly", max_tokens
        )
        return None
    try:
        pieces.capture(pool=pool)
    except Exception as e:  # noqa: BLE001 - any capture failure: serve without them
        logger.warning(
            "piecewise CUDA graphs could not be captured (%s: %s): mixed steps run eagerly; "
            "--piecewise-cuda-graph-max-tokens 0 skips the attempt", type(e).__name__, e,
        )  # fmt: skip
        return None
    return pieces
