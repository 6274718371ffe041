"""How large a prompt's chunk may be (Scheduler._chunk, Scheduler._fit).

Each chunk of a prompt that more of it follows ends on a multiple of the attention backend's `chunk_granule`
(AttentionBackend) where it can: the cuDNN path reads a cached prefix in multiples of 2,048 keys and puts the rest
(the "tail") in front of the next chunk's causal call, behind query rows that compute nothing, padded to the next
1,024 rows: a tail of one key costs an 8K chunk 1,024 causal rows more (the 8B: ~4.7 TFLOP, ~9 ms at cuDNN's ~530
TFLOP/s; not measured as such). A usual chunk is shortened to end on the granule when it is long (two granules or
more: it keeps more than half) and the prompt takes no more steps for it (`aligned_chunk`; a prompt behind a
cached prefix of 16,400 tokens: its first chunk 8,176, the rest whole 8K ones on the granule).

A lone prompt (while one request's prompt is all the work there is) may take lone_prefill_chunk_size tokens a
step, as long as the step holds no more attention work than a lone chunk from the prompt's start.
Attention over n new tokens after `done` computed ones costs about n * done + n^2 / 2; a lone chunk from the start
lone^2 / 2. Bounding the one by the other bounds what a request arriving behind the step waits: about a cold
prompt of lone tokens. Past lone tokens the chunks shrink (lone 32K: 12K after 32K, 10K after those, the usual 8K from
55K on), while the usual chunks' own attention grows (8K after 120K holds more work than 32K from the start).
Unbounded, the step from 96K to 128K of the Llama-3.1-8B shape would take ~4.5 s (7/16 of its cold 128K, 10.2 s on
an H100: RESULTS.md thirty-eighth session) where a usual chunk there takes ~1.2 s. A bounded chunk ends on the
granule too: ending anywhere (32768 + 13572 + 10415 + 8780 = 65535, then 8K chunks from there) padded the 8B's
cold 128K with 3% more attention than its 8K chunks and made it 1.9% slower in lone steps (10.36 against 10.17 s,
H100, forty-second session); on the granule the lone steps hold exactly the chunks' attention.
"""

from __future__ import annotations

import math


def lone_chunk_bound(done: int, lone: int) -> int:
    """The most tokens a lone chunk after `done` computed tokens may take: n * (n + 2 * done) <= lone^2."""
    return math.isqrt(done * done + lone * lone) - done


def bounded_lone_chunk(n: int, done: int, lone: int | None, budget: int, granule: int = 1) -> int:
    """A lone chunk of up to n tokens (n > budget) after `done` computed ones: within the bound, ending on a
    multiple of `granule` unless it ends the prompt or the bound spans less than two granules (as aligned_chunk:
    a lone size below the granule, as tests use on a GPU, would otherwise round every lone chunk away), never
    below the usual budget."""
    if lone is None:
        return budget
    bound = lone_chunk_bound(done, lone)
    end = done + bound if bound < 2 * granule else (done + bound) // granule * granule
    return max(budget, min(n, end - done))


def aligned_chunk(n: int, done: int, remaining: int, budget: int, granule: int) -> int:
    """A usual chunk of n of a prompt's `remaining` tokens after `done` computed ones, shortened to end on a multiple
    of `granule` (the module's docstring) when more of the prompt follows, n is at least two granules (so that it
    keeps more than half), and the prompt then takes no more steps of `budget` than it would have."""
    if granule <= 1 or n >= remaining or n < 2 * granule:
        return n
    aligned = (done + n) // granule * granule - done
    if aligned == n:  # (from two granules on, what it keeps is more than half)
        return n
    steps = -(-(remaining - n) // budget)
    return aligned if -(-(remaining - aligned) // budget) == steps else n
