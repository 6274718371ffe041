"""The token mask of one step's constrained rows (structured outputs, forced tool calls), on the rank that
samples (rank 0 under tensor parallelism; the other ranks never see a grammar).

Each request with a grammar carries its own matcher (`Request.grammar`, advanced by the engine when the
sampled ids reach the host). While the device runs the step's forward pass, `GrammarMasker.prepare` fills
the host bitmask rows of those requests (pinned memory on CUDA) and starts one non-blocking copy to the
device; the sampler applies the mask after the raw logprobs and before bans, penalties and temperature.
Nothing here waits for the device: the engine's read of the sampled ids, which it does every step anyway,
is the only sync, and it also guarantees that the previous step's copies are done before the host rows
are refilled.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from longserve.request import Request
from longserve.structured.grammar import TokenBitmask, apply_token_bitmask

# from this many constrained rows on, xgrammar's batch matcher fills them on several threads (one fill takes
# ~20 us at a 40K vocab and grows with it: 64 rows one by one could outlast a decode step's forward pass)
BATCH_FILL_MIN_ROWS = 8
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclass(slots=True)
class TokenMask:
    """The bitmask of one step on the logits' device: rows[i] of the logits is masked by bitmask[rows[i]]."""

    bitmask: torch.Tensor  # [N, ceil(V/32)] int32, on the device
    rows: list[int]  # the masked rows (sorted); other rows of the batch are left untouched
    rows_device: torch.Tensor  # the same rows, int32 on the device

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """In place: tokens the grammar does not allow next get -inf, in the masked rows only."""
        return apply_token_bitmask(logits, self.bitmask, self.rows_device)

    def row(self, i: int) -> TokenMask | None:
        """The mask of batch row i alone (as row 0), for re-sampling one row; None if it has no grammar.
        Only the rare row-by-row fallback uses it, so the small device tensor it makes may sync."""
        if i not in self.rows:
            return None
        return TokenMask(
            self.bitmask[i : i + 1], [0], torch.zeros(1, dtype=torch.int32, device=self.bitmask.device)
        )


class GrammarMasker:
    """Fills one step's bitmask from the requests' matchers; the buffers are made on first use (a server
    that never sees a grammar allocates nothing) and grow if a step has more sampling rows than expected."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size  # the logits' width (lm_head rows)
        self.device = device
        self._bitmask: TokenBitmask | None = None

    def prepare(self, reqs: Sequence[Request]) -> tuple[TokenMask | None, dict[int, Exception]]:
        """The mask for sampling rows `reqs` (row i: reqs[i]) and the rows whose matcher raised (each such
        request is ended alone with an error; its row is left unmasked). (None, {}) when no row has a grammar."""
        # a request that ended while its row was in flight (overlapped schedule) needs no mask
        matchers = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None and not r.is_finished]
        if not matchers:
            return None, {}
        bitmask = self._buffers(len(reqs))
        rows: list[int] = []
        failed: dict[int, Exception] = {}
        if len(matchers) >= BATCH_FILL_MIN_ROWS and FILL_THREADS > 1:
            try:
                rows = bitmask.fill_batch(dict(matchers), FILL_THREADS)
                matchers = []
            except Exception:  # one matcher failed: row by row below finds which
                rows = []
        for i, matcher in matchers:
            try:
                if matcher.fill_bitmask(bitmask.host, i):  # False: every token allowed, no need to mask
                    rows.append(i)
            except Exception as e:
                failed[i] = e
        if not rows:
            return None, failed
        return TokenMask(bitmask.to_device(len(reqs)), rows, bitmask.rows_on_device(rows)), failed

    def _buffers(self, num_rows: int) -> TokenBitmask:
        if self._bitmask is None or num_rows > self.max_rows:
            self.max_rows = max(self.max_rows, num_rows)
            self._bitmask = TokenBitmask(self.max_rows, self.vocab_size, self.device)
        return self._bitmask
