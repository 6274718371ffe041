"""CUDA graphs for decode steps: one graph per bucketed batch size, replayed over static input buffers.

A decode step (every scheduled request computes exactly one token) of n requests replays the graph of
the smallest bucket >= n. Rows n..bucket are padding: token 0 at position 0, writing its K/V into page 0
(reserved, never handed out) and attending over one key there. The attention backend must launch a
fixed grid for a given batch size (the Triton decode kernel with a fixed split count does); the torch
reference backend loops on the host and cannot be captured.
"""

from __future__ import annotations

import logging
import time

import torch

from longserve.attention.base import AttentionMetadata, ForwardContext, KVCache

logger = logging.getLogger("longserve.runner.cuda_graph")

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in _BUCKETS if b <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class DecodeGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        make_backend,  # (batch_size) -> AttentionBackend with a fixed launch grid for that size
        max_bs: int,
        max_pages_per_req: int,
        page_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.page_size = page_size
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        n = self.max_bs
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, **i32)
        self.prefix_lens = torch.zeros(n, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.page_table = torch.zeros(n, max_pages_per_req, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.backends = {bs: make_backend(bs) for bs in self.batch_sizes}
        self.pool = None

    def _context(self, bs: int) -> ForwardContext:
        meta = AttentionMetadata(
            page_size=self.page_size,
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            prefix_lens=self.prefix_lens[:bs],
            page_table=self.page_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[1] * bs,
            prefix_lens_cpu=[0] * bs,
        )
        return ForwardContext(meta=meta, kv_cache=self.kv_cache, backend=self.backends[bs])

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self._context(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its pool blocks
                for _ in range(2):  # compile kernels and settle allocations outside the graph
                    self._forward(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[bs] = self._forward(bs)
                self.graphs[bs] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1fs",
            len(self.graphs),
            ",".join(map(str, self.batch_sizes)),
            time.perf_counter() - start,
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            bool(self.graphs)
            and 0 < meta.num_reqs <= self.max_bs
            and meta.num_tokens == meta.num_reqs
            and meta.page_table.shape[1] <= self.page_table.shape[1]
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the decode graph for these (already on-device) inputs; returns hidden [n, H]."""
        n = meta.num_reqs
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.page_table[:n, : meta.page_table.shape[1]].copy_(meta.page_table)
        if bs > n:  # padding rows: one key at slot 0 of page 0
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)
            self.page_table[n:bs, 0].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
