"""Batched token sampling: bans, penalties, greedy/temperature/top-k/top-p/min-p, seeded rows, logprobs.

Runs on the logits' device with no host syncs: every branch is decided from the Python-side SamplingParams,
never from tensor values, and the only host->device traffic is small index/parameter tensors, queued from
pinned memory (platform.host_to_device) so that sampling a step never waits for the one before it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from longserve.platform import host_to_device
from longserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingInfo:
    """One row per request that samples this step (row i of the logits)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Set by the engine when params.seed is not None, on the logits' device; advanced in place each step.
    generator: torch.Generator | None
    # E.g. eos/stop ids while len(output) < min_new_tokens.
    banned_token_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    # [N] float32: log-prob of the chosen token under the RAW model distribution (before penalties,
    # temperature and truncation, like vLLM's default); None when no request asked for logprobs.
    logprobs: torch.Tensor | None
    top_logprobs: torch.Tensor | None  # [N, K] float32, sorted descending; K = max requested logprobs
    top_token_ids: torch.Tensor | None  # [N, K] int64


def _token_counts(
    token_lists: Sequence[Sequence[Sequence[int]]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """counts[i, t] = occurrences of token t in the sequences of row i; one scatter for the whole batch."""
    lengths = [sum(len(seq) for seq in seqs) for seqs in token_lists]
    total = sum(lengths)
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)  # [N, V]
    if total == 0:
        return counts
    flat_ids = host_to_device(
        list(itertools.chain.from_iterable(itertools.chain.from_iterable(token_lists))),
        dtype=torch.int64,
        device=device,
    )  # [T]
    # output_size keeps repeat_interleave from syncing to learn the result length on GPU.
    rows = torch.repeat_interleave(
        torch.arange(len(token_lists), device=device),
        host_to_device(lengths, dtype=torch.int64, device=device),
        output_size=total,
    )  # [T]
    counts.view(-1).scatter_add_(
        0, rows * vocab_size + flat_ids, torch.ones_like(flat_ids, dtype=counts.dtype)
    )
    return counts


def apply_bans(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """Banned ids -> -inf. Out of place: the caller's logits are never modified."""
    rows = [i for i, info in enumerate(infos) for _ in info.banned_token_ids]
    if not rows:
        return logits
    cols = [t for info in infos for t in info.banned_token_ids]
    index = (
        host_to_device(rows, dtype=torch.int64, device=logits.device),
        host_to_device(cols, dtype=torch.int64, device=logits.device),
    )
    return logits.index_put(index, torch.full((), -math.inf, device=logits.device))  # [N, V]


def apply_logit_bias(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """OpenAI's logit_bias: each row's biases added to its logits (one index_put for the batch; ids were
    checked against the vocab when the request came in). Out of place, like the bans."""
    biased = [(i, info.params.logit_bias) for i, info in enumerate(infos) if info.params.logit_bias]
    if not biased:
        return logits
    rows = [i for i, bias in biased for _ in bias]
    cols = [t for _, bias in biased for t in bias]
    values = [b for _, bias in biased for b in bias.values()]
    device = logits.device
    index = (
        host_to_device(rows, dtype=torch.int64, device=device),
        host_to_device(cols, dtype=torch.int64, device=device),
    )
    bias = host_to_device(values, dtype=logits.dtype, device=device)  # [B]
    return logits.index_put(index, bias, accumulate=True)  # [N, V]


def apply_penalties(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
    """Repetition (HF, over prompt + output), then frequency and presence (OpenAI, over output only).

    Rows without a penalty contribute no tokens to the count tensors and get identity factors, so they pass
    through bit-exactly; a batch without any penalty does no work at all.
    """
    num_reqs, vocab_size = logits.shape
    device = logits.device
    params = [info.params for info in infos]

    reps = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in reps):
        seen = (
            _token_counts(
                [
                    (info.prompt_token_ids, info.output_token_ids) if r != 1.0 else ()
                    for info, r in zip(infos, reps)
                ],
                vocab_size,
                device,
            )
            > 0
        )  # [N, V] bool
        rep = host_to_device(reps, dtype=logits.dtype, device=device)[:, None]  # [N, 1]
        # HF semantics: dividing a negative logit would *raise* it, so negatives are multiplied instead.
        penalized = torch.where(logits > 0, logits / rep, logits * rep)  # [N, V]
        logits = torch.where(seen, penalized, logits)  # [N, V]

    freqs = [p.frequency_penalty for p in params]
    presences = [p.presence_penalty for p in params]
    if any(f != 0.0 or q != 0.0 for f, q in zip(freqs, presences)):
        counts = _token_counts(
            [
                (info.output_token_ids,) if f != 0.0 or q != 0.0 else ()
                for info, f, q in zip(infos, freqs, presences)
            ],
            vocab_size,
            device,
        )  # [N, V]
        freq = host_to_device(freqs, dtype=logits.dtype, device=device)[:, None]  # [N, 1]
        presence = host_to_device(presences, dtype=logits.dtype, device=device)[:, None]  # [N, 1]
        logits = logits - freq * counts - presence * (counts > 0).to(logits.dtype)  # [N, V]
    return logits


def apply_truncation(
    logits: torch.Tensor, top_ks: Sequence[int], top_ps: Sequence[float], min_ps: Sequence[float]
) -> torch.Tensor:
    """top-k, then top-p (on the top-k-renormalized distribution), then min-p; dropped tokens -> -inf.

    top_k <= 0 means disabled. The most likely token always survives, so every row keeps a token.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    use_top_k = any(0 < k < vocab_size for k in top_ks)
    use_top_p = any(p < 1.0 for p in top_ps)
    if use_top_k or use_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V], [S, V]
        if use_top_k:
            ks = host_to_device(
                [k if 0 < k < vocab_size else vocab_size for k in top_ks], dtype=torch.int64, device=device
            )  # [S]
            positions = torch.arange(vocab_size, device=device)  # [V]
            sorted_logits = sorted_logits.masked_fill(positions[None, :] >= ks[:, None], -math.inf)  # [S, V]
        if use_top_p:
            probs = sorted_logits.softmax(dim=-1)  # [S, V]
            # Mass strictly before each token: a token is needed while that mass is still < top_p, which keeps
            # the smallest prefix whose cumulative prob reaches top_p (and always the first token, mass 0).
            mass_before = probs.cumsum(dim=-1) - probs  # [S, V]
            ps = host_to_device(list(top_ps), dtype=probs.dtype, device=device)  # [S]
            drop = mass_before >= ps[:, None]  # [S, V]
            drop[:, 0] = False  # guard against rounding in the cumsum
            sorted_logits = sorted_logits.masked_fill(drop, -math.inf)  # [S, V]
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)  # [S, V] back to vocab order
    if any(m > 0.0 for m in min_ps):
        # prob < min_p * max_prob  <=>  logit - max_logit < log(min_p): no softmax needed, and the test is
        # invariant to the renormalization after top-k/top-p. log(0) = -inf keeps every token of such rows.
        log_min_p = host_to_device(list(min_ps), dtype=logits.dtype, device=device).log()  # [S]
        max_logit = logits.max(dim=-1, keepdim=True).values  # [S, 1]
        logits = logits.masked_fill(logits - max_logit < log_min_p[:, None], -math.inf)  # [S, V]
    return logits


def _exponential_noise(
    shape: torch.Size, infos: Sequence[SamplingInfo], device: torch.device
) -> torch.Tensor:
    """Exponential(1) noise; seeded rows draw theirs from their own generator so the token they get
    depends only on (seed, step, logits row), not on the batch around them."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)  # [S, V]
    seeded = [(i, info.generator) for i, info in enumerate(infos) if info.generator is not None]
    if len(seeded) < len(infos):
        noise.exponential_()  # default RNG for the unseeded rows; seeded rows are overwritten below
    for i, generator in seeded:
        noise[i].exponential_(generator=generator)  # [V]
    return noise


class Sampler:
    """Picks one token per row of logits [N, V] according to each row's SamplingParams."""

    def __call__(
        self, logits: torch.Tensor, infos: list[SamplingInfo], token_mask: Any = None
    ) -> SamplerOutput:
        """`token_mask`: runner.grammar_mask.TokenMask of the rows whose grammar restricts the next token."""
        assert logits.dim() == 2 and logits.shape[0] == len(infos), (tuple(logits.shape), len(infos))
        num_reqs, vocab_size = logits.shape
        device = logits.device
        given = logits
        logits = logits.float()  # [N, V]; a no-op for float32, and every step below is out of place
        params = [info.params for info in infos]

        asked = [p.logprobs for p in params if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if asked else None  # [N, V]

        if token_mask is not None:  # the grammar's disallowed tokens -> -inf (logprobs stay the model's own)
            logits = token_mask.apply(logits.clone() if logits is given else logits)  # [N, V], in place

        logits = apply_logit_bias(logits, infos)  # [N, V]
        logits = apply_bans(logits, infos)  # [N, V]
        logits = apply_penalties(logits, infos)  # [N, V]

        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sample_rows) == num_reqs:
            token_ids = self._sample(logits, infos)  # [N]
        else:
            token_ids = logits.argmax(dim=-1)  # [N]
            if sample_rows:
                rows = host_to_device(sample_rows, dtype=torch.int64, device=device)  # [S]
                token_ids[rows] = self._sample(logits[rows], [infos[i] for i in sample_rows])  # [S]

        logprobs = top_logprobs = top_token_ids = None
        if raw_logprobs is not None:
            logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [N]
            num_top = min(max(asked), vocab_size)
            if num_top > 0:
                top_logprobs, top_token_ids = raw_logprobs.topk(num_top, dim=-1)  # [N, K], [N, K] sorted desc
        return SamplerOutput(token_ids, logprobs, top_logprobs, top_token_ids)

    @staticmethod
    def _sample(logits: torch.Tensor, infos: Sequence[SamplingInfo]) -> torch.Tensor:
        """Non-greedy rows [S, V] -> sampled token ids [S]."""
        params = [info.params for info in infos]
        temperatures = [p.temperature for p in params]
        if any(t != 1.0 for t in temperatures):
            temps = host_to_device(temperatures, dtype=logits.dtype, device=logits.device)  # [S]
            logits = logits / temps[:, None]  # [S, V]
        logits = apply_truncation(
            logits, [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params]
        )  # [S, V]
        noise = _exponential_noise(logits.shape, infos, logits.device)  # [S, V]
        # Exponential race: argmax(probs / E) samples from probs. In log space that is argmax(logits - log E),
        # which skips the softmax (the normalizer is a per-row constant), cannot underflow small probs to 0,
        # and keeps dropped tokens at -inf. The clamp avoids log(0) = -inf -> +inf noise on a 0 draw.
        scores = logits - noise.clamp_min_(torch.finfo(noise.dtype).tiny).log()  # [S, V]
        return scores.argmax(dim=-1)  # [S]
