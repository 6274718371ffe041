"""The sampling of a forwarded step, on the rank that samples: its grammar rows' mask, then one token per row,
each request isolated (one whose own setup or sampling raises fails alone; the others are sampled as usual)."""

from __future__ import annotations

import logging

import torch

from longserve.outputs import RunnerOutput
from longserve.request import Request
from longserve.runner.grammar_mask import GrammarMasker, TokenMask
from longserve.runner.sampled import SampledStep
from longserve.runner.sampler import Sampler, SamplingInfo
from longserve.sampling_params import SamplingParams

logger = logging.getLogger("longserve.runner")
_PLACEHOLDER = SamplingParams(temperature=0.0)  # the row of a request whose sampling setup failed


def request_failure(stage: str, request_id: str, exc: Exception) -> str:
    """Log a request's own failure with its traceback; the message its caller gets (no internals in it).
    `stage` reads before "request <id>": "sampling", "taking the token of"."""
    message = f"internal error while {stage} request {request_id}"
    logger.error(message, exc_info=exc)
    return f"{message}; the server log has the details"


class StepSampler:
    """The sampler and the grammar masker of one runner; `sampler` and `sampling_info` are the parts tests
    replace to inject failures."""

    def __init__(self, device: torch.device, max_rows: int, vocab_size: int) -> None:
        self.device = device
        self.sampler = Sampler()
        self.grammar_masker = GrammarMasker(max_rows, vocab_size, device)

    def __call__(
        self, logits: torch.Tensor, reqs: list[Request], eos_token_ids: frozenset[int]
    ) -> SampledStep:
        """Queue the sampling of logits [N, V] (row i: reqs[i]) without waiting for the device. A request
        that ended while its row was in flight keeps its row (its token is dropped) but no grammar mask."""
        # on the host while the device runs the forward pass (nothing before this waited for it)
        token_mask, mask_failures = self.grammar_masker.prepare(reqs)
        failed = {
            reqs[i].request_id: request_failure("filling its grammar mask for", reqs[i].request_id, e)
            for i, e in mask_failures.items()
        }
        with torch.inference_mode():
            return self._sample(logits, reqs, eos_token_ids, token_mask, failed)

    def _sample(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        eos_token_ids: frozenset[int],
        token_mask: TokenMask | None = None,
        failed: dict[str, str] | None = None,
    ) -> SampledStep:
        """One token per row of logits [N, V]. A request whose own setup or sampling raises is isolated:
        it gets a placeholder token and an entry in `failed` (the engine ends it with an error), and the
        others are sampled as usual; the batch is re-sampled row by row only when the batched call raised.
        `token_mask`: the grammar rows' mask; `failed`: requests that already failed (their grammar's mask)."""
        failed = dict(failed or {})
        infos = []
        for req in reqs:
            try:
                infos.append(self.sampling_info(req, eos_token_ids))
            except Exception as e:
                failed[req.request_id] = request_failure("preparing its sampling", req.request_id, e)
                infos.append(SamplingInfo(_PLACEHOLDER, (), (), None))
        try:
            result = self.sampler(logits, infos, token_mask=token_mask)
        except Exception:
            return self._sample_rows(logits, reqs, infos, token_mask, failed)
        return SampledStep(
            result.token_ids, result.logprobs, result.top_logprobs, result.top_token_ids, failed=failed
        )

    def _sample_rows(
        self,
        logits: torch.Tensor,
        reqs: list[Request],
        infos: list[SamplingInfo],
        token_mask: TokenMask | None,
        failed: dict[str, str],
    ) -> SampledStep:
        """The batched sampler raised: each row alone, so that only the rows that fail again fail (rare, so
        this waits for each row's result)."""
        tokens = [0] * len(reqs)  # placeholders stay for the failed rows
        logprobs: list[float] | None = None
        top: list[list[tuple[int, float]]] = [[] for _ in reqs]
        for i, (req, info) in enumerate(zip(reqs, infos)):
            try:
                row_mask = token_mask.row(i) if token_mask is not None else None
                result = self.sampler(logits[i : i + 1], [info], token_mask=row_mask)
            except Exception as e:
                failed[req.request_id] = request_failure("sampling", req.request_id, e)
                continue
            tokens[i] = int(result.token_ids.item())
            if result.logprobs is not None:
                logprobs = logprobs or [0.0] * len(reqs)
                logprobs[i] = float(result.logprobs.item())
                if result.top_logprobs is not None:
                    top[i] = list(zip(result.top_token_ids[0].tolist(), result.top_logprobs[0].tolist()))
        done = RunnerOutput(
            sampled_token_ids=tokens,
            logprobs=logprobs,
            top_logprobs=top if any(top) else None,
            failed=failed,
        )
        return SampledStep(torch.tensor(tokens, dtype=torch.int64, device=logits.device), done=done)

    def sampling_info(self, req: Request, eos_token_ids: frozenset[int]) -> SamplingInfo:
        params = req.sampling_params
        banned: list[int] = []
        # a complete grammar may allow nothing but its stop tokens: the grammar wins over min_new_tokens
        # (a request that ended while its row was in flight: its matcher is left alone)
        grammar_done = req.grammar is not None and (req.is_finished or req.grammar.is_completed)
        if req.num_output_tokens < params.min_new_tokens and not grammar_done:
            banned.extend(params.stop_token_ids)
            if not params.ignore_eos:
                banned.extend(eos_token_ids)
        if params.seed is not None and req.generator is None:
            req.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return SamplingInfo(
            params=params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            generator=req.generator,
            banned_token_ids=banned,
        )
