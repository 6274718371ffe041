"""How large a lone prompt's chunk may be (Scheduler._fit): while one request's prompt is all the work there is,
a step may take lone_prefill_chunk_size of its tokens, as long as the step holds no more attention work than a
lone chunk from the prompt's start.

Attention over n new tokens after `done` computed ones costs about n * done + n^2 / 2; a lone chunk from the start
lone^2 / 2. Bounding the one by the other bounds what a request arriving behind the step waits: about a cold
prompt of lone tokens. Past lone tokens the chunks shrink (lone 32K: 13.6K after 32K, the usual budget of 8K from
64K on), while the usual chunks' own attention grows (8K after 120K holds more work than 32K from the start).
Unbounded, the step from 96K to 128K of the Llama-3.1-8B shape would take ~4.5 s (7/16 of its cold 128K, 10.2 s on
an H100: RESULTS.md thirty-eighth session) where a usual chunk there takes ~1.2 s.

A bounded chunk ends on a multiple of the attention backend's `chunk_granule` (AttentionBackend): the cuDNN path
reads a cached prefix in multiples of 2,048 keys and puts the rest in front of the next chunk's causal call, behind
query rows that compute nothing. Ending anywhere (32768 + 13572 + 10415 + 8780 = 65535, then 8K chunks from
there) padded the 8B's cold 128K with 3% more attention than its 8K chunks and made it 1.9% slower in lone steps
(10.36 against 10.17 s, H100, forty-second session); ending on the granule, the lone steps hold exactly the
chunks' attention.
"""

from __future__ import annotations

import math


def lone_chunk_bound(done: int, lone: int) -> int:
    """The most tokens a lone chunk after `done` computed tokens may take: n * (n + 2 * done) <= lone^2."""
    return math.isqrt(done * done + lone * lone) - done


def bounded_lone_chunk(n: int, done: int, lone: int | None, budget: int, granule: int = 1) -> int:
    """A lone chunk of up to n tokens (n > budget) after `done` computed ones: within the bound, ending on a
    multiple of `granule` unless it ends the prompt, never below the usual budget."""
    if lone is None:
        return budget
    end = (done + lone_chunk_bound(done, lone)) // granule * granule
    return max(budget, min(n, end - done))
