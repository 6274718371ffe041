"""Before the first step, on the thread that will run the steps: what a step would otherwise build or compile
in its middle, while every request in it waits.

Through HTTP on an H200 (2026-12-02, `3672e1d`), random 2K-token prompts at 8 a second had a TTFT P50 of
1.6 s against vLLM's 55 ms: the steps stalled 0.15-3.3 s at a time while Triton compiled kernel variants
(one per key-split count, per pointer alignment of the step's packed tensors, per tile of a token-count
bucket) and cuDNN built an execution plan per new prompt length. The counts and alignments no longer make
variants (kernels/extend_attention.py, attention/metadata.py: _packed); what remains is built here:
- the attention backend's own warm-up (cuDNN plans of the padded shapes, the extend kernel's variants);
- one eager forward pass of the whole model per power-of-two token count from WARM_UP_MIN_TOKENS to a
  chunk: the kernels whose tiles or configs follow the token count (MoE alignment and grouped GEMM,
  quantized GEMMs) compile here. Smaller counts ran when the CUDA graphs were captured.
Every pass is one cold "prompt" of zeros whose K/V go to page 0, reserved for padding (as graph capture
does). Under tensor parallelism rank 0 sends the other ranks a `WarmUp` on the step channel and every rank
runs the same passes, so their collectives pair up.

Then the start-up heap is frozen (`freeze_heap`), as vLLM's engine core does after its start-up: the garbage
collector's full collections, which pause the stepping thread, no longer walk the hundreds of thousands of
objects of torch, the model, its graphs and plans (up to ~200 ms a collection at an 8B engine's start-up on an
H200 host: scripts/probes/gc_pauses.py, RESULTS.md twentieth session), only what serving allocates.
`unfreeze_heap` at shutdown gives them back to the collector.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from longserve.attention import AttentionBackend, ForwardContext, GraphShape, KVCache
from longserve.attention.metadata import build_step_tensors
from longserve.attention.recurrent_state import RecurrentStates
from longserve.progress import Progress

logger = logging.getLogger(__name__)

# below this many tokens, the prefill graphs' capture (chunks of up to 256 tokens) ran the kernels already
WARM_UP_MIN_TOKENS = 512
FREEZE_HEAP = True  # freeze the start-up heap after the warm-up (see the module's docstring)


@dataclass(frozen=True)
class WarmUp:
    """Rank 0 to the other ranks, in place of a step: run `ModelRunner.warm_up(counts)` now."""

    counts: list[int] | None = None


def warm_up_counts(step_tokens: int, context_length: int) -> list[int]:
    """512, 1024, ... below the largest step, then that step; none past the context length (the rotary kernel's
    cos/sin cache covers the context and the kernel does not bound-check positions: models/rope.py), none
    when that leaves less than 512 tokens."""
    largest = min(step_tokens, context_length)
    counts, n = [], WARM_UP_MIN_TOKENS
    while n < largest:
        counts.append(n)
        n *= 2
    return counts + [largest] if largest >= WARM_UP_MIN_TOKENS else counts


@torch.inference_mode()
def warm_up(
    model: torch.nn.Module,
    backend: AttentionBackend,
    kv_cache: KVCache,
    shape: GraphShape,
    step_tokens: int,
    counts: list[int] | None = None,
    optional_past: int | None = None,
    chunk_size: int | None = None,
    states: RecurrentStates | None = None,
) -> int:
    """The backend's warm-up, then a forward pass of `model` per token count (default `warm_up_counts`).
    step_tokens: the most tokens a step takes; chunk_size: a usual step's, when that is a lone prompt's larger
    one (the backend plans chunks over a prefix at the usual size). The counts past `optional_past` are optional
    (a lone step the model chose itself, runner/step_tokens.py): out of device memory at one of them, the
    warm-up stops there. Returns the most tokens a step may take: step_tokens, or the largest count that ran
    before an optional one ran out of memory. A hybrid model's passes run in state slot -1 (`states`: a zero
    state, nothing written), so a warm-up never touches a request's slot."""
    start = time.perf_counter()
    backend.warm_up(shape, chunk_size or step_tokens, kv_cache, step_tokens=step_tokens)
    counts = warm_up_counts(step_tokens, shape.max_seq_len) if counts is None else counts
    page_size = kv_cache.page_size
    ran = 0
    progress = Progress(logger, "warm-up passes", len(counts))
    for i, n in enumerate(counts):
        meta, (input_ids, positions, state_slot) = build_step_tensors(
            [0], [n], [[0] * -(-n // page_size)], page_size, shape.device, extra=([0] * n, range(n), [-1])
        )
        meta.state_slots = state_slot
        try:
            ctx = ForwardContext(meta=meta, kv_cache=kv_cache, backend=backend, states=states)
            model(input_ids, positions, ctx)
        except torch.OutOfMemoryError as e:  # at start-up, named, rather than under load
            if optional_past is not None and n > optional_past:
                del meta, input_ids, positions
                if shape.device.type == "cuda":
                    torch.cuda.empty_cache()  # what the failed pass held, back for the KV pool's neighbours
                return ran
            raise RuntimeError(
                f"warm-up ran out of device memory in a step of {n:,} prompt tokens, the most a step takes "
                "(--chunked-prefill-size, or --lone-prefill-chunk-size: 32768 by default for integer weights); "
                "lower it, or lower --mem-fraction-static to leave more room beside the KV pool"
            ) from e
        ran = n
        progress.step(i + 1)
    if shape.device.type == "cuda":
        torch.cuda.synchronize(shape.device)
    logger.info(
        "warm-up: attention paths, and the model at %s tokens, in %.1fs",
        ",".join(map(str, counts)) or "no extra", time.perf_counter() - start,
    )  # fmt: skip
    return step_tokens


def freeze_heap() -> bool:
    """Collect every generation (garbage left by loading and capture is freed, not frozen), then move every
    object alive into the collector's permanent generation (gc.freeze). What an earlier engine's freeze holds is
    unfrozen first, so that an engine dropped without close (a test's, a notebook's) is collected here rather
    than kept with its device memory. Whether it froze (FREEZE_HEAP)."""
    if not FREEZE_HEAP:
        return False
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return True


def unfreeze_heap() -> None:
    """Undo freeze_heap: an engine torn down in a process that goes on (tests, notebooks) must be collectable,
    reference cycles included. Process-wide, as gc.freeze is: another engine's start-up heap is unfrozen too,
    which costs only collection time."""
    gc.unfreeze()
