"""What the engine does with each request's sampled token: logprobs and pooled values kept, then the checks
that may end the request, in order: a prefill-only request (max_tokens 0), its grammar terminating, a stop
or EOS token, a stop string in its text, its length (max_tokens, the context). `Engine._complete` calls
`accept` for each token a step read; a token a request cannot take fails that request alone (`fail`)."""

from __future__ import annotations

import logging
from typing import Any

from longserve.request import FinishReason, Request
from longserve.runner.sample_step import request_failure
from longserve.sched.scheduler import Scheduler
from longserve.tokenization.detokenizer import DeferredText

logger = logging.getLogger("longserve.engine")


class TokenHandler:
    def __init__(self, scheduler: Scheduler, context_length: int) -> None:
        self.scheduler = scheduler
        self.context_length = context_length

    def accept(self, req: Request, i: int, token: int, runner_out: Any, now: float) -> None:
        """Row i of a step's output: the request's token (already appended by the scheduler's commit)."""
        if req.first_token_time is None:
            req.first_token_time = now
        if runner_out.pooled is not None:
            req.pooled = runner_out.pooled[i]
        if runner_out.logprobs is not None and req.sampling_params.logprobs is not None:
            req.logprobs.append(runner_out.logprobs[i])
            if runner_out.top_logprobs is not None:
                req.top_logprobs.append(runner_out.top_logprobs[i][: req.sampling_params.logprobs])
        self.process(req, token)

    @staticmethod
    def log_failure(req: Request, exc: Exception) -> str:
        return request_failure("taking the token of", req.request_id, exc)

    def fail(self, req: Request, message: str, internal: bool = False) -> None:
        """End a request with an error (`internal`: ours, not its input's); its siblings go on."""
        req.error = message
        req.error_internal = internal
        self.scheduler.finish_request(req, FinishReason.ERROR)

    def process(self, req: Request, token: int) -> None:
        params = req.sampling_params
        if params.max_new_tokens == 0:  # prefill only (warms the prefix cache): drop the sample
            req.output_token_ids.pop()
            req.logprobs.clear()  # and its logprobs (the prompt's, if asked, are kept)
            req.top_logprobs.clear()
            self.scheduler.finish_request(req, FinishReason.LENGTH)
            return
        # a complete output ends at the stop token its grammar allowed, ignore_eos or not
        grammar_done = req.grammar is not None and self.advance_grammar(req, token)
        if (
            grammar_done
            or token in params.stop_token_ids
            or (token in req.eos_token_ids and not params.ignore_eos)
        ):
            req.stop_reason = token
            # the stop token has no text, unless no_stop_trim keeps it (a special one decodes to nothing)
            self.finish(req, FinishReason.STOP, text_upto=req.num_output_tokens - (not params.no_stop_trim))
            return
        if self.detokenize(req, req.num_output_tokens, final=False):
            return
        if (params.max_new_tokens is not None and req.num_output_tokens >= params.max_new_tokens) or (
            req.num_prompt_tokens + req.num_output_tokens >= self.context_length  # a pending one apart
        ):
            self.finish(req, FinishReason.LENGTH, text_upto=req.num_output_tokens)

    @staticmethod
    def advance_grammar(req: Request, token: int) -> bool:
        """Give the sampled token to the request's matcher; True once it has terminated. The matcher applies
        it when next used (the next step's mask fill, while the forward pass runs); a token its own mask did
        not allow is a bug that ends the request with an error there."""
        return req.grammar.defer_accept(token)

    def detokenize(self, req: Request, upto: int, final: bool) -> bool:
        """Append the text of output tokens [.., upto); True if a stop string ended the request."""
        text = req.text
        if text is None:
            return False
        if type(text) is DeferredText:
            text.add(upto, final)
            return False
        stop = text.add(req.output_token_ids, final, upto)
        if stop is None:
            return False
        req.stop_reason = stop
        self.scheduler.finish_request(req, FinishReason.STOP)
        return True

    def finish(self, req: Request, reason: FinishReason, text_upto: int) -> None:
        # release text held back for an incomplete character; a stop string found there still wins
        if not self.detokenize(req, text_upto, final=True):
            self.scheduler.finish_request(req, reason)
