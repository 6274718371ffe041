"""ServerState: what every route shares (configs, the AsyncEngine, the tokenizer pool) and the checks and
helpers common to the generation routes (model names, lengths, deadlines, client disconnects, SSE)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from longserve.config import EngineConfig
from longserve.outputs import RequestOutput
from longserve.sampling_params import SamplingParams, check_logprobs_limit, with_every_logprob
from longserve.server.async_engine import AsyncEngine
from longserve.server.config import ServerConfig
from longserve.server.errors import APIError, as_api_error, internal_error
from longserve.server.grammars import GrammarService
from longserve.server.metrics import ServerMetrics
from longserve.server.protocol import ARRIVAL_SCOPE_KEY
from longserve.server.response_store import ResponseStore
from longserve.tokenization.pool import TokenizationError, TokenizerPool

logger = logging.getLogger("longserve.server")
QUEUED_SCOPE_KEY = "longserve.queued"  # set on the ASGI scope once a call's requests reached the engine
EMPTY_PROMPT = "the prompt is empty: give at least one character or token"
CONTEXT_CODE = "context_length_exceeded"
DEFAULT_MODEL = "default"  # the model name any client may send (SGLang's and vLLM's examples use it)


@dataclass
class ServerState:
    engine_config: EngineConfig
    server_config: ServerConfig
    engine: AsyncEngine
    tokenizers: TokenizerPool
    started: float = field(default_factory=time.time)
    metrics: ServerMetrics | None = None  # set by create_app when server_config.enable_metrics

    @functools.cached_property
    def grammars(self) -> GrammarService:
        """Compiles requests' output constraints off the event loop (made on first use)."""
        return GrammarService(self.engine.engine)

    @functools.cached_property
    def responses(self) -> ResponseStore:
        """The Responses API's stored responses (routes_responses.py)."""
        return ResponseStore()

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.server_config.served_model_name or (self.engine_config.model,)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    def check_model(self, name: str | None) -> None:
        """A request may leave `model` out or say "default"; any other name is served too, as SGLang does
        (one model is served), unless --strict-model-name asks for vLLM's 404 on a name not served."""
        if name is None or name == DEFAULT_MODEL or name in self.model_names:
            return
        if self.server_config.strict_model_name:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {', '.join(map(repr, self.model_names))}",
                param="model",
                code="model_not_found",
            )

    def check_logprobs(self, params: SamplingParams, names: dict[str, str] | None = None) -> None:
        """More top logprobs than --max-logprobs allows (vLLM's 20 by default): a 400 naming the field as the
        client spelled it (`names`: ours -> theirs), before anything is queued."""
        try:
            check_logprobs_limit(with_every_logprob(params, self.engine.vocab_size), self.engine.max_logprobs)
        except ValueError as e:
            ours = str(e).split(" ", 1)[0]
            theirs = (names or {}).get(ours, ours)
            raise APIError(400, theirs + str(e)[len(ours) :], param=theirs) from None

    def check_lengths(self, num_prompt_tokens: int, max_new_tokens: int | None, what: str = "prompt") -> None:
        """Refuse a prompt (plus the tokens asked for; at least one) longer than the context, in OpenAI's
        words (context_length_error), which LiteLLM and LangChain map to their context-window errors."""
        completion = max(max_new_tokens or 0, 1)  # at least one token is generated
        if num_prompt_tokens + completion > self.context_length:
            raise context_length_error(self.context_length, num_prompt_tokens, completion, what)

    def deadline(self, request: Request) -> float | None:
        """The time.monotonic() by which the request must end: --request-timeout counts from its arrival,
        so tokenizing and waiting for the engine are inside it."""
        timeout = self.server_config.request_timeout
        if timeout is None:
            return None
        arrival = request.scope.get(ARRIVAL_SCOPE_KEY)
        elapsed = time.perf_counter() - arrival if arrival is not None else 0.0
        return time.monotonic() + timeout - elapsed

    async def encode_prompts(
        self, prompts: str | list, param: str, deadline: float | None
    ) -> list[list[int]]:
        """A prompt or a batch (strings or token ids) as token id lists. An empty prompt (an empty string,
        an empty id list, an empty batch) is refused alike on every route, as vLLM refuses it."""
        if isinstance(prompts, str) or not prompts or isinstance(prompts[0], int):
            prompts = [prompts]  # [] too: one empty prompt (ids) or an empty batch say the same
        out = []
        for p in prompts:
            if not p:
                raise APIError(400, EMPTY_PROMPT, param=param)
            out.append(
                await self.tokenizers.encode(p, deadline=deadline, param=param)
                if isinstance(p, str)
                else list(p)
            )
        return out

    async def add_all(
        self, request: Request, prompts: list[list[int]], params, ids: list[str | None], grammar: Any = None
    ) -> list[str]:
        """Queue every prompt or none: on a refusal the ones already queued are aborted. Once all are
        queued, the engine accounts for how they end (metrics: the HTTP call is no longer "rejected").
        grammar: the compiled output constraint of every prompt (GrammarService.compile)."""
        added: list[str] = []
        try:
            arrival = request.scope.get(ARRIVAL_SCOPE_KEY)  # tokenizing and waiting for the engine count
            kw = {"grammar": grammar} if grammar is not None else {}
            for prompt_ids, rid in zip(prompts, ids):
                added.append(await self.engine.add(prompt_ids, params, rid, arrival_time=arrival, **kw))
        except BaseException:
            for rid in added:
                self.engine.release(rid)
            raise
        request.scope[QUEUED_SCOPE_KEY] = True
        return added

    async def collect(self, request_id: str, deadline: float | None) -> RequestOutput:
        """The final output of a request (its streamed outputs are dropped)."""
        last = None
        async for out in self.engine.stream(request_id, deadline):
            last = out
        assert last is not None and last.finished
        return last

    async def collect_all(
        self, request: Request, rids: list[str], deadline: float | None
    ) -> list[RequestOutput]:
        """Final outputs of queued requests; a client that hangs up aborts them; released however it ends."""
        try:
            async with abort_on_disconnect(request, self.engine, rids):
                return [await self.collect(rid, deadline) for rid in rids]
        finally:
            for rid in rids:
                self.engine.release(rid)

    def stream_response(
        self, events: AsyncIterator[str], rids: list[str], done_marker: bool = True
    ) -> StreamingResponse:
        """`events` as server-sent events; the requests are released however the stream ends. `done_marker`:
        end with `data: [DONE]` (the completion routes; the Responses API's stream ends with its last event)."""

        def close() -> None:
            for rid in rids:
                self.engine.release(rid)

        return StreamingResponse(
            sse_stream(events, close, done_marker), media_type="text/event-stream", headers=SSE_HEADERS
        )

    def log_request(self, route: str, outs: Iterable[RequestOutput]) -> None:
        if not self.server_config.log_requests:
            return
        for out in outs:
            logger.info(
                "%s %s: %d prompt (%d cached) + %d completion tokens, %s, ttft %.3fs, e2e %.3fs",
                route,
                out.request_id,
                out.prompt_tokens,
                out.cached_tokens,
                out.completion_tokens,
                out.finish_reason,
                out.ttft or 0.0,
                out.e2e_latency or 0.0,
            )


def context_length_error(context: int, prompt: int, completion: int | None, what: str = "prompt") -> APIError:
    """A 400 worded as OpenAI's API words it (and vLLM copies), type invalid_request_error and code
    context_length_exceeded: LiteLLM raises ContextWindowExceededError on "This model's maximum context
    length is", LangChain's ChatOpenAI its ContextOverflowError on the code (which the message also ends
    with). `what`: "messages" (chat), "prompt" (completions, /generate) or "input" (embeddings and scores:
    `completion` None)."""
    if completion is None:
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested {prompt} tokens "
            f"in the input. Please reduce the length of the input."
        )
    elif what == "messages":
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt + completion} tokens ({prompt} in the messages, {completion} in the completion). "
            "Please reduce the length of the messages or completion."
        )
    else:  # the legacy completions endpoint's wording
        message = (
            f"This model's maximum context length is {context} tokens, however you requested "
            f"{prompt + completion} tokens ({prompt} in your prompt; {completion} for the completion). "
            "Please reduce your prompt; or completion length."
        )
    # the openai client's exception text carries the message alone (not the body's code), and LangChain's
    # ChatOpenAI looks for the code in that text: the code ends the message too
    return APIError(400, f"{message} ({CONTEXT_CODE})", param=what, code=CONTEXT_CODE)


def get_state(request: Request) -> ServerState:
    return request.app.state.longserve


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, engine: AsyncEngine, request_ids: list[str]):
    """While the body runs, a client that hangs up aborts its requests (their pages return to the pool)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                logger.info("client disconnected: aborting %s", ", ".join(request_ids))
                for rid in request_ids:
                    engine.abort(rid)  # the waiting handler gets the final (aborted) output and returns
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def sse_stream(events: AsyncIterator[str], on_close, done_marker: bool = True) -> AsyncIterator[str]:
    """Events, then [DONE] (with done_marker); an APIError mid-stream becomes an error event. on_close() runs
    however it ends."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield e.sse()
    except TokenizationError as e:
        yield as_api_error(e).sse()
    except Exception:
        yield internal_error("streaming a response").sse()
    finally:
        on_close()
    if done_marker:
        yield SSE_DONE
