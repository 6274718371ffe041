"""The shapes the cuDNN attention calls run at: few, padded to a grid, and built before they are needed.

cuDNN runs fixed-shape execution plans. torch builds one per shape (query and key lengths, heads, strides)
the first time it meets it, and keeps it in a per-thread cache (aten/src/ATen/native/cudnn/MHA.cpp). A
build took ~50 ms at start-up on an H200 (25 plans in 1.3 s, 2026-12-02, `59cbde2`) and 0.9 s for the first
call of a new head count; ~0.4 s is reported in sglang#4650, ~0.26 s a shape in flashinfer#2545. Meanwhile
the whole step, and every request in it, waits. Called with each prompt's own lengths, a server meets a new
shape with nearly every prompt: through HTTP (`3672e1d`, with the Triton kernels' recompiles) the RAG and
random workloads stalled 0.15-2.8 s at a time, while one request at a time matched vLLM.

So a cuDNN call here only runs a shape of a small set, built at start-up on the thread that runs the steps
(`sdpa.warm_up_plans`, in the layout the calls use: `sdpa.fused_rows`), and every other request goes to the
Triton extend kernel, which compiles once:
- new tokens: padded up to a multiple of Q_GRANULE (a short cold prompt's: of a quarter of it). Exact: under
  the causal mask a real row never sees the padding after it, and padded rows are dropped; across a cached
  prefix (no mask) extra rows only add rows.
- a cached prefix: cuDNN reads its first multiple of PREFIX_GRANULE keys; the rest ("tail", fewer than
  PREFIX_GRANULE keys) joins the causal part, in front of the new tokens, with zero query rows that are
  dropped. Exact too: a new token sees all of the tail and the new tokens up to itself.
- built at start-up: the causal shapes up to one chunk (a lone prompt's step) plus a tail, and a full (usual)
  chunk's new tokens over every multiple of PREFIX_GRANULE of prefix. Not only over multiples of the chunk: a long
  prompt that follows a cached prefix (a conversation's next turn) starts unaligned, and so did every chunk after
  the first while decodes took their tokens from the budget (they ride on top of it now, sched/scheduler.py):
  with only the aligned shapes built, those chunks ran in Triton (the HTTP multi-turn workload's 16K openings: the
  second 8K chunk 350 ms against the first's 224, 2026-12-02). A full chunk never waits. A shorter chunk over a
  prefix (a long prompt's last) pads its new tokens further, up to the built rows (the chunk's), when it fills at
  least PAD_QUERY_MIN_FILL of them; else, and for prefix hits with short suffixes, it runs in Triton (~315 against
  ~530 TFLOP/s of attention, measured on 8K chunks). Between those two, a chunk runs its prefix part as pieces at
  built row counts when it fills PAD_QUERY_MIN_FILL of their rows (PlanRegistry._pieces): a lone prompt's chunks
  past its first (sched/chunk_size.py: between the usual chunk and its first) thus run in cuDNN.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

logger = logging.getLogger("longserve.attention")

Q_GRANULE = 1024  # new tokens are padded up to a multiple: at most 1023 dropped rows
PREFIX_GRANULE = 2048  # cuDNN reads the prefix up to a multiple; the tail (< this) joins the causal part
# a prompt's chunks end on PREFIX_GRANULE where they can (sched/chunk_size.py, through the backend's chunk_granule);
# False: anywhere, as before the forty-second session (`gpu_check.sh granule` is the A/B)
CHUNKS_ON_GRANULE = True
MIN_COLD_QUERY = 512  # a cold prompt shorter than this runs in Triton (its attention is a sliver of the step)
# a chunk over a prefix whose padded rows have no plan runs at a built row count it fills at least this much of:
# cuDNN on the padded rows (~530 TFLOP/s) beats Triton on the real ones (~315) down to 315 / 530 = 0.59 full.
# Not yet measured as such: a prompt of 8K x n + 4K..8K tokens ran its last chunk in Triton before.
PAD_QUERY_MIN_FILL = 0.6
# Row counts below a full chunk whose plans over every multiple of PREFIX_GRANULE are built too: a prefix hit
# with 1-4K new tokens (a conversation's next turn, an agent's tool output over its history) runs in cuDNN
# instead of Triton (a chunk over a prefix pads to the next of these it fills PAD_QUERY_MIN_FILL of). Measured
# on an H200 (Llama-3.1-8B shape, RESULTS.md ninth session, gpu_check.sh short-plans): over 32K, 1024 / 2048 /
# 4096 new tokens take 57.0 / 111.6 / 225.3 ms with these plans against 69.7 / 135.6 / 274.4 ms in Triton, 1024
# over 64K 87.3 against 110.2 ms; cold prompts unchanged. The cost is start-up: a plan per 2K of the longest
# prefix and row count (64K contexts: 135 plans in 3.7 s against 39 in 1.1 s; 128K about 6 s more).
SHORT_QUERY_ROWS: tuple[int, ...] = (1024, 2048, 4096)
# A short chunk over a long prefix (a prefix hit's question: the 8B shape's 64 new tokens over 32K) gives cuDNN
# one program per 128 rows of a head, 32 programs for 132 SMs, where the Triton extend kernel runs at ~180-240
# TFLOP/s. Packed instead (`sdpa.packed_prefix_sdpa`): the q heads of a kv head as the rows of one call (64
# tokens x 4 heads = 256 rows), padded to PACKED_ROWS, and the prefix's keys split as a batch of PREFIX_GRANULE
# keys each; the rest (the prefix's tail, the new tokens) in the extend kernel (triton_backend._packed). Measured
# on an H200 (RESULTS.md fifteenth session): the call alone 66 us a layer for 64 new over 32K (519 TFLOP/s; 16
# splits) against the Triton kernel's 145-240; the 8B hit 11.8 / 11.7 ms against 12.6 / 13.6 without it (104x /
# 105x cold 32K, `queue.sh hit-packed`, two calls), 12.7 ms in a third run. One plan per split count, built at
# start-up for prefixes from PACKED_MIN_PREFIX to the context (a 32K context: 13 plans, 0.6 s). The lone chunk
# then runs in the piecewise graphs with its attention eager (a plan's key count cannot vary in a graph).
# Off since the sixteenth session: over more runs (RESULTS.md) the packed hit's TTFT scattered from 11.9 to 22.1 ms
# (median 17.4 ms in an engine with a 292,864-token pool, 21.8 ms in `queue.sh vllm`'s) where the Triton kernel
# in the lone chunk's graph held 13.4-14.3 ms: the eager layers' host launches are exposed to every host stall,
# the one graph replay is not. A capturable packed call (its plan not fixed to the key count) would keep both.
PACKED_PREFIX_CALLS = False
# A chunk of at least this many new tokens over a prefix that meets no built shape runs in the Triton extend kernel
# at ~60% of cuDNN's rate, which nothing else shows: said once a process (PlanRegistry.split_rows). A lone prompt's
# chunks past its first did so from the thirty-eighth session to the forty-first (8B cold 128K 16.05 against 10.21 s).
UNPLANNED_WARN_TOKENS = 4096
PACKED_ROWS = 256
PACKED_MIN_PREFIX = 8192


def pad_rows(n: int) -> int:
    return -(-n // Q_GRANULE) * Q_GRANULE


# A cold prompt of up to COLD_FINE_GRANULES Q_GRANULEs pads to a multiple of a quarter granule instead: under the
# causal mask the padding rows are the costliest (the last), so a 1,100-token prompt padded to 2,048 rows ran
# ~3.5x its own attention FLOPs. Through HTTP on an H200 (random 1-2K prompts beside decodes, RESULTS.md
# nineteenth session) a prompt step cost ~4.7 ms over its tokens' share, an estimated ~1 ms of it this padding
# (not separated by measurement); the extra plans (11 for the 8B shape: 512..3840 rows) take ~0.5 s more at
# start-up.
COLD_FINE_GRANULES = 4


def pad_cold_rows(n: int) -> int:
    """A cold prompt's padded rows: a multiple of Q_GRANULE / 4 up to 4 Q_GRANULEs, of Q_GRANULE above."""
    if n > COLD_FINE_GRANULES * Q_GRANULE:
        return pad_rows(n)
    fine = Q_GRANULE // COLD_FINE_GRANULES
    return -(-n // fine) * fine


@dataclass(frozen=True)
class SplitShape:
    """One request of the split path: cuDNN reads `prefix_keys` of its cached prefix with its new tokens
    padded to `query_rows`, in one call per piece of `pieces` rows (consecutive, summing to query_rows); the
    causal part holds the `tail` keys, the new tokens and padding (`causal_rows` in all)."""

    prefix_keys: int
    tail: int
    query_rows: int
    causal_rows: int
    pieces: tuple[int, ...]


def split_shape(prefix_len: int, query_len: int, pieces: tuple[int, ...] | None = None) -> SplitShape:
    """pieces: the prefix part's calls' rows when not one call of pad_rows(query_len) (PlanRegistry.split_rows)."""
    prefix_keys = prefix_len // PREFIX_GRANULE * PREFIX_GRANULE
    tail = prefix_len - prefix_keys
    pieces = (pad_rows(query_len),) if pieces is None else pieces
    rows = sum(pieces)
    assert rows >= query_len and rows - pieces[-1] < query_len, (pieces, query_len)
    return SplitShape(prefix_keys, tail, rows, pad_rows(tail + query_len), pieces)


def packed_splits(prefix_len: int, query_len: int, group: int) -> int | None:
    """The packed prefix call's split count (its batch) for this chunk, or None when the chunk is not short
    enough (new tokens x group over PACKED_ROWS), its prefix not long enough for it, or it is a decode's one
    token (a mixed step's decodes run together in one Triton launch, not a library call each)."""
    if (
        not PACKED_PREFIX_CALLS
        or query_len < 2
        or query_len * group > PACKED_ROWS
        or prefix_len < PACKED_MIN_PREFIX
    ):
        return None
    return prefix_len // PREFIX_GRANULE


def warm_up_packed_splits(max_seq_len: int) -> list[int]:
    """The packed calls' split counts a context of up to max_seq_len reaches (a chunk leaves one token); none
    while they are off (PACKED_PREFIX_CALLS)."""
    if not PACKED_PREFIX_CALLS:
        return []
    return list(range(PACKED_MIN_PREFIX // PREFIX_GRANULE, (max_seq_len - 1) // PREFIX_GRANULE + 1))


@dataclass(frozen=True)
class ModelShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


class PlanRegistry:
    """The cuDNN shapes built on each thread (torch's plan cache is per thread, so is this record).

    On the CPU every shape is ready: the CPU kernels build nothing. On CUDA a shape is ready once `warm_up`
    built it on the calling thread."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._warned = False  # a long chunk without a plan was logged (_unplanned)

    def _built(self) -> set[tuple]:
        built = getattr(self._local, "built", None)
        if built is None:
            built = self._local.built = set()
        return built

    def ready(self, model: ModelShape, q_rows: int, kv_rows: int, causal: bool, device: torch.device) -> bool:
        return device.type != "cuda" or (model, q_rows, kv_rows, causal) in self._built()

    def cold_ready(self, model: ModelShape, query_len: int, device: torch.device) -> bool:
        """Whether a cold prompt runs at a built shape (on CUDA: and is long enough to bother)."""
        if device.type != "cuda":
            return True
        rows = pad_cold_rows(query_len)
        return query_len >= MIN_COLD_QUERY and self.ready(model, rows, rows, True, device)

    def split_rows(
        self, model: ModelShape, prefix_len: int, query_len: int, device: torch.device
    ) -> tuple[int, ...] | None:
        """The prefix part's calls (their query rows) for a chunk over a cached prefix at built shapes: one call
        of its new tokens padded to a multiple of Q_GRANULE, or further to a built row count they fill at least
        PAD_QUERY_MIN_FILL of; else consecutive pieces at built row counts (`_pieces`) when they fill that much
        of their rows; None when its causal part or its prefix part has no built shape (it runs in Triton)."""
        s = split_shape(prefix_len, query_len)
        if not self.ready(model, s.causal_rows, s.causal_rows, True, device):
            return self._unplanned(prefix_len, query_len, device)
        if not s.prefix_keys or self.ready(model, s.query_rows, s.prefix_keys, False, device):
            return (s.query_rows,)
        rows = s.query_rows + Q_GRANULE
        while query_len >= PAD_QUERY_MIN_FILL * rows:
            if self.ready(model, rows, s.prefix_keys, False, device):
                return (rows,)
            rows += Q_GRANULE
        pieces = self._pieces(model, s.prefix_keys, query_len, device)
        if pieces and query_len >= PAD_QUERY_MIN_FILL * sum(pieces):
            return pieces
        return self._unplanned(prefix_len, query_len, device)

    def _unplanned(self, prefix_len: int, query_len: int, device: torch.device) -> None:
        """None (the chunk runs in Triton), said once a process for a long chunk (UNPLANNED_WARN_TOKENS)."""
        if query_len >= UNPLANNED_WARN_TOKENS and not self._warned:
            self._warned = True
            logger.warning(
                "a chunk of %d new tokens over %d cached ones has no cuDNN plan built for its shape on %s "
                "(sdpa_shapes.warm_up_shapes): it runs in the Triton extend kernel, at ~60%% of the rate; "
                "said once", query_len, prefix_len, device,
            )  # fmt: skip
        return None

    def _pieces(self, model: ModelShape, keys: int, query_len: int, device: torch.device) -> tuple[int, ...]:
        """Rows at built shapes over `keys` that cover query_len rows, largest first, the last padded: a lone
        prompt's chunks between the usual chunk and its first (sched/chunk_size.py: 12K after 32K, shrinking to the
        usual 8K) over the usual chunk's plans and the short ones (SHORT_QUERY_ROWS). Exact: the rows of a call
        without a mask are independent. Built for none of them, these ran in Triton, at ~60% of cuDNN's rate:
        the 8B's cold 128K in steps of 32K took 16.05 s against 10.21 s in 8K chunks (H100, RESULTS.md
        forty-first session). () when no row count is built over `keys`."""
        built = [
            r
            for r in range(Q_GRANULE, pad_rows(query_len) + 1, Q_GRANULE)
            if self.ready(model, r, keys, False, device)
        ]
        pieces: list[int] = []
        left = query_len
        while built and left > 0:
            if pad_rows(left) in built:  # the rest in one call
                pieces.append(pad_rows(left))
                break
            under = [r for r in built if r <= left]
            pieces.append(under[-1] if under else built[0])  # built[0] > left: the last, padded
            left -= pieces[-1]
        return tuple(pieces)

    def mark(self, model: ModelShape, q_rows: int, kv_rows: int, causal: bool) -> None:
        self._built().add((model, q_rows, kv_rows, causal))

    def packed_ready(self, model: ModelShape, splits: int, device: torch.device) -> bool:
        """Whether the packed prefix call of `splits` splits (`packed_splits`) is built on this thread."""
        return device.type != "cuda" or ("packed", model, splits) in self._built()

    def mark_packed(self, model: ModelShape, splits: int) -> None:
        self._built().add(("packed", model, splits))


PLANS = PlanRegistry()


def warm_up_shapes(
    chunk_size: int, max_seq_len: int, step_tokens: int | None = None
) -> list[tuple[int, int, bool]]:
    """(query rows, key rows, causal) to build: causal up to the largest step (`step_tokens`, a lone prompt's;
    default a chunk) plus a tail (and short cold prompts' finer rows, `pad_cold_rows`), a full chunk over every
    multiple of PREFIX_GRANULE of prefix that leaves room for it (the 8B shape at 131072 tokens, chunks of 8192:
    10 + 11 + 60 shapes, ~50 ms each on an H200), and each of SHORT_QUERY_ROWS over every multiple below the
    context. A lone prompt's larger chunks over a prefix run as pieces of these (PlanRegistry._pieces)."""
    step_tokens = max(chunk_size, step_tokens or 0)
    shapes = [
        (n, n, True) for n in range(Q_GRANULE, pad_rows(step_tokens + PREFIX_GRANULE - 1) + 1, Q_GRANULE)
    ]
    # short cold prompts' rows (pad_cold_rows), from the shortest served
    fine, first = Q_GRANULE // COLD_FINE_GRANULES, pad_cold_rows(MIN_COLD_QUERY)
    shapes += [(n, n, True) for n in range(first, min(COLD_FINE_GRANULES * Q_GRANULE, step_tokens) + 1, fine)]
    rows = pad_rows(chunk_size)
    last = max_seq_len - (chunk_size - Q_GRANULE + 1)  # the longest prefix a full chunk can follow
    shapes += [(rows, keys, False) for keys in range(PREFIX_GRANULE, last + 1, PREFIX_GRANULE)]
    for short in (r for r in SHORT_QUERY_ROWS if r < rows):  # hits with short suffixes, over any prefix
        shapes += [(short, keys, False) for keys in range(PREFIX_GRANULE, max_seq_len, PREFIX_GRANULE)]
    return list(dict.fromkeys(shapes))
