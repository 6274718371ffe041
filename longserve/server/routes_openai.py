"""OpenAI-compatible POST /v1/completions and /v1/chat/completions (streaming, n, stop, seed, logprobs,
usage with prompt_tokens_details.cached_tokens) and GET /v1/models. Each finished choice also carries the
request's own `meta_info` (ttft, queue_time, prefill_time, decode_time, e2e_latency, cached_tokens), an
extension clients that do not know it ignore."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from longserve.outputs import RequestOutput
from longserve.server import openapi
from longserve.server.chat_request import prepare_chat
from longserve.server.chat_tools import ChatOutput, ChatTools
from longserve.server.errors import APIError
from longserve.server.grammars import constraint_fields
from longserve.server.logprobs import (
    check_best_of,
    check_prompt_logprobs_stream,
    completion_logprobs,
    echo_texts,
    vllm_prompt_logprobs,
    with_echo,
)
from longserve.server.metrics import timings
from longserve.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, parse_body
from longserve.server.state import ServerState, get_state, sse

router = APIRouter()


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(o.prompt_tokens for o in outs)
    completion = sum(o.completion_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)},
    }


async def _run(
    request: Request,
    state: ServerState,
    prompts: list[list[int]],
    req: CompletionRequest | ChatCompletionRequest,
    params,
    chat: bool,
    deadline: float | None,
    grammar: Any = None,
    output: ChatOutput | None = None,
    echo: list[str] | None = None,
):
    """`grammar`: the compiled output constraint; `output`: how a chat reply reads (tool calls, reasoning)."""
    for p in prompts:
        state.check_lengths(len(p), params.max_new_tokens, "messages" if chat else "prompt")
    if chat and output is None:
        output = ChatOutput(ChatTools(None, [], {}, "none", None, None, True))  # plain content
    rids = await state.add_all(request, prompts, params, [None] * len(prompts), grammar=grammar)
    response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    base = {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": req.model or state.model_name,
    }
    route = "/v1/chat/completions" if chat else "/v1/completions"

    if req.stream:

        async def events() -> AsyncIterator[str]:
            finals: list[RequestOutput] = []
            for p_idx, rid in enumerate(rids):
                started, done = [False] * params.n, [False] * params.n
                replies = [output.stream() for _ in range(params.n)] if output is not None else []
                async for out in state.engine.stream(rid, deadline):
                    for c in out.outputs:
                        index = p_idx * params.n + c.index
                        if chat and not started[c.index]:
                            started[c.index] = True
                            first = {"index": index, "delta": {"role": "assistant", "content": ""}}
                            yield sse(
                                {**base, "choices": [{**first, "logprobs": None, "finish_reason": None}]}
                            )
                        if done[c.index] or not (c.new_text or c.new_token_ids or c.finish_reason):
                            continue
                        done[c.index] = c.finish_reason is not None
                        start = len(c.token_ids) - len(c.new_token_ids)
                        choice: dict[str, Any] = {"index": index}
                        if chat:
                            choice["delta"] = replies[c.index].delta(c.new_text, c.finish_reason is not None)
                        else:
                            choice["text"] = c.new_text
                        choice["logprobs"] = (
                            await completion_logprobs(state, c, start, chat) if c.new_token_ids else None
                        )
                        if echo is not None and not started[c.index]:  # the prompt goes first
                            started[c.index] = True
                            await with_echo(
                                state, choice, out, echo[p_idx], c.logprobs is not None, stream=True
                            )
                        choice["finish_reason"] = c.finish_reason
                        if chat and replies[c.index].called and c.finish_reason == "stop":
                            choice["finish_reason"] = "tool_calls"
                        if chat and not (choice["delta"] or choice["logprobs"] or c.finish_reason):
                            continue  # text a parser holds back (markup of a tool call): nothing yet
                        if c.finish_reason is not None:
                            choice["meta_info"] = timings(out)
                        yield sse({**base, "choices": [choice]})
                    if out.finished:
                        finals.append(out)
            state.log_request(route, finals)
            if req.include_usage:
                yield sse({**base, "choices": [], "usage": usage(finals)})

        return state.stream_response(events(), rids)

    outs = await state.collect_all(request, rids, deadline)
    state.log_request(route, outs)
    choices = []
    for p_idx, out in enumerate(outs):
        for c in out.outputs:
            choice: dict[str, Any] = {"index": p_idx * params.n + c.index}
            called = False
            if chat:
                choice["message"], called = output.message(c.text)
            else:
                choice["text"] = c.text
            choice["logprobs"] = await completion_logprobs(state, c, 0, chat)
            if not chat:  # echo, vLLM's prompt_logprobs
                await with_echo(state, choice, out, echo[p_idx] if echo else None, c.logprobs is not None)
            choice["finish_reason"] = (
                "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
            )
            if c.stop_reason is not None:
                choice["stop_reason"] = c.stop_reason
            choice["meta_info"] = timings(out)
            choices.append(choice)
    body = {**base, "object": "chat.completion" if chat else "text_completion", "choices": choices}
    if chat and outs[0].prompt_logprobs is not None:  # vLLM's, beside the choices
        body["prompt_logprobs"] = await vllm_prompt_logprobs(state, outs[0])
    return JSONResponse({**body, "usage": usage(outs)})


@router.post("/v1/completions", openapi_extra=openapi.body(CompletionRequest))
async def completions(request: Request):
    state = get_state(request)
    req = await parse_body(request, CompletionRequest)
    state.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    check_best_of(req.best_of, req.n, req.stream, MAX_N)
    check_prompt_logprobs_stream(req.prompt_logprobs, req.stream)
    params = req.sampling_params(req.max_tokens, req.logprobs)
    state.check_logprobs(params)
    deadline = state.deadline(request)
    grammar = await state.grammars.compile_fields(constraint_fields(req), deadline)
    prompts = await state.encode_prompts(req.prompt, "prompt", deadline)
    echo = await echo_texts(state, req.prompt, prompts) if req.echo else None
    return await _run(
        request, state, prompts, req, params, chat=False, deadline=deadline, grammar=grammar, echo=echo
    )


@router.post("/v1/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest))
async def chat_completions(request: Request):
    state = get_state(request)
    req = await parse_body(request, ChatCompletionRequest)
    state.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    check_prompt_logprobs_stream(req.prompt_logprobs, req.stream)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    state.check_logprobs(params, {"logprobs": "top_logprobs"})
    messages = [m.as_dict(i) for i, m in enumerate(req.messages)]
    deadline = state.deadline(request)
    # tools, tool_choice, the output constraint and the reasoning section: chat_request.py
    chat = await prepare_chat(state, req, params, messages, deadline)
    return await _run(
        request, state, [chat.prompt], req, chat.params, True, deadline, chat.grammar, chat.output
    )


@router.get("/v1/models")
async def models(request: Request):
    state = get_state(request)
    data = [
        {
            "id": name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "longserve",
            "root": state.engine_config.model,
            "max_model_len": state.context_length,
        }
        for name in state.model_names
    ]
    return {"object": "list", "data": data}
