"""OpenAI's Responses API: POST /v1/responses (what the OpenAI Agents SDK calls by default), GET and DELETE
/v1/responses/{id}. A request runs as the chat completion its input maps to (responses_input.py: the chat
template, tool calls forced or parsed, the output constraint, as /v1/chat/completions); its reply comes back
as output items: a reasoning item (with --reasoning-parser), a message, function calls. Streamed, the items
open, grow and close through OpenAI's typed events (`response.created` ... `response.completed`, each with a
`sequence_number`), which the openai client's stream accumulator checks item by item. One writer builds the
items both ways, so a streamed response ends with the same output a plain one returns."""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from longserve.outputs import RequestOutput
from longserve.server import openapi
from longserve.server.chat_request import prepare_chat
from longserve.server.errors import APIError
from longserve.server.logprobs import completion_logprobs
from longserve.server.protocol import parse_body
from longserve.server.response_store import MAX_RESPONSES
from longserve.server.responses_input import ResponsesRequest, chat_request, input_messages
from longserve.server.state import ServerState, get_state

router = APIRouter()
ROUTE = "/v1/responses"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputWriter:
    """A response's output items, built from the chat path's deltas (`ChoiceStream.delta`'s reasoning_content,
    content and tool_calls), and the stream events that build them (a plain response drops the events)."""

    def __init__(self, max_tool_calls: int | None) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written, last in `items`
        self.calls: dict[int, dict[str, Any]] = {}  # a tool call's delta index -> its item
        self.max_tool_calls = max_tool_calls
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def feed(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> Iterator[str]:
        if delta.get("reasoning_content"):
            yield from self.text("reasoning", delta["reasoning_content"], [])
        if delta.get("content"):
            yield from self.text("message", delta["content"], logprobs)
        for call in delta.get("tool_calls") or ():
            yield from self._call(call)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def text(self, kind: str, text: str, logprobs: list[dict[str, Any]]) -> Iterator[str]:
        if self.open is None or self.open["type"] != kind:
            yield from self.close()
            if kind == "message":
                item = {"id": _new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant"}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            else:
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            self.open = {**item, "content": []}
            self.items.append(self.open)
            # (each event is serialized as it is made: the item as it stands now)
            yield self.event("response.output_item.added", output_index=len(self.items) - 1, item=self.open)
            self.open["content"].append(part)
            yield self.event("response.content_part.added", **self._where(), content_index=0, part=part)
        part = self.open["content"][0]
        part["text"] += text
        if kind == "message":
            part["logprobs"].extend(logprobs)
            yield self.event(
                "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=logprobs
            )
        else:
            yield self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text)

    def _call(self, call: dict[str, Any]) -> Iterator[str]:
        function = call.get("function") or {}
        if "id" in call:  # a new call: its id and name come first
            if self.max_tool_calls is not None and len(self.calls) >= self.max_tool_calls:
                self.calls[call["index"]] = {}  # past max_tool_calls: dropped
                return
            yield from self.close()
            item = {
                "id": _new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call["id"],
                "name": function.get("name", ""),
                "arguments": "",
            }
            self.open = self.calls[call["index"]] = item
            self.items.append(item)
            yield self.event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        item = self.calls.get(call["index"])
        if item and function.get("arguments"):  # (the parsers finish a call before the next one starts)
            item["arguments"] += function["arguments"]
            where = {"item_id": item["id"], "output_index": self.items.index(item)}
            yield self.event("response.function_call_arguments.delta", **where, delta=function["arguments"])

    def close(self, status: str = "completed") -> Iterator[str]:
        """The open item's closing events."""
        item, self.open = self.open, None
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        item["status"] = status
        if item["type"] == "function_call":
            yield self.event(
                "response.function_call_arguments.done",
                **where,
                arguments=item["arguments"],
                name=item["name"],
            )
        else:
            part = item["content"][0]
            if item["type"] == "message":
                yield self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
            else:
                yield self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            yield self.event("response.content_part.done", **where, content_index=0, part=part)
        yield self.event("response.output_item.done", output_index=where["output_index"], item=item)

    def finish(self, status: str) -> Iterator[str]:
        """Closes the last item (`incomplete` when the reply was cut short); a reply of nothing still has a
        message, with empty text."""
        if not self.items:
            yield from self.text("message", "", [])
        yield from self.close(status)


class ResponseRun:
    """One response's fixed fields and the body at each stage (in progress, then completed or incomplete)."""

    def __init__(self, req: ResponsesRequest, state: ServerState, params: Any) -> None:
        self.req, self.params = req, params
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self.model = req.model or state.model_name

    def body(self, status: str, output: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
        req = self.req
        usage = None
        if out is not None:
            usage = {
                "input_tokens": out.prompt_tokens,
                "input_tokens_details": {"cached_tokens": out.cached_tokens},
                "output_tokens": out.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},  # not counted apart
                "total_tokens": out.prompt_tokens + out.completion_tokens,
            }
        text = dict(req.text or {})
        text.setdefault("format", {"type": "text"})
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": req.store,
            "temperature": self.params.temperature,
            "text": text,
            "tool_choice": req.tool_choice
            if req.tool_choice is not None
            else ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
        }


# the chat path's field names in its errors, as this route's request spells them
_NAMES = {"response_format": "text.format", "max_tokens": "max_output_tokens", "messages": "input"}


@contextlib.contextmanager
def responses_names() -> Iterator[None]:
    """A 400 of the chat path (responses_input.chat_request, prepare_chat) naming the Responses field."""
    try:
        yield
    except APIError as e:
        if e.param is not None:
            head, _, rest = e.param.partition(".")
            if head in _NAMES:
                e.param = _NAMES[head] + ("." + rest if rest else "")
        message = str(e)
        for chat_name, name in _NAMES.items():
            message = message.replace(chat_name, name)
        raise APIError(e.status, message, e.type, e.param, e.code) from None


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


@router.post(ROUTE, openapi_extra=openapi.body(ResponsesRequest))
async def create_response(request: Request):
    state = get_state(request)
    req = await parse_body(request, ResponsesRequest)
    state.check_model(req.model)
    req.check_supported()
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = state.responses.get(req.previous_response_id)
        if stored is None:
            raise APIError(
                404,
                f"previous_response_id {req.previous_response_id!r}: no stored response has this id (this "
                f"server keeps responses in memory while it runs, the latest {MAX_RESPONSES}; send the "
                "conversation as input items instead)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = stored.conversation
    deadline = state.deadline(request)
    with responses_names():
        chat_req, conversation = chat_request(req, history)
        params = chat_req.sampling_params(
            chat_req.max_tokens, (req.top_logprobs or 0) if req.logprobs else None
        )
        state.check_logprobs(params, {"logprobs": "top_logprobs"})
        messages = [m.as_dict(i) for i, m in enumerate(chat_req.messages)]
        chat = await prepare_chat(state, chat_req, params, messages, deadline)
    state.check_lengths(len(chat.prompt), chat.params.max_new_tokens, "input")
    rids = await state.add_all(request, [chat.prompt], chat.params, [None], grammar=chat.grammar)
    run = ResponseRun(req, state, chat.params)
    writer = OutputWriter(req.max_tool_calls)

    def done(out: RequestOutput) -> dict[str, Any]:
        body = run.body(_status(out), writer.items, out)
        state.log_request(ROUTE, [out])
        if req.store:
            state.responses.put(body, conversation + input_messages(writer.items, "output"))
        return body

    if req.stream:

        async def events() -> AsyncIterator[str]:
            yield writer.event("response.created", response=run.body("in_progress", [], None))
            yield writer.event("response.in_progress", response=run.body("in_progress", [], None))
            reply, final = chat.output.stream(), None
            pending: list[dict[str, Any]] = []  # tokens' logprobs whose text has not come out yet
            async for out in state.engine.stream(rids[0], deadline):
                c = out.outputs[0]
                if c.new_text or c.new_token_ids or c.finish_reason:
                    delta = reply.delta(c.new_text, c.finish_reason is not None)
                    if c.new_token_ids and req.logprobs:
                        lps = await completion_logprobs(
                            state, c, len(c.token_ids) - len(c.new_token_ids), True
                        )
                        pending.extend(lps["content"] if lps else ())
                    # a token of a partial character has no text yet: its logprob waits for the next text
                    lps, pending = (pending, []) if delta.get("content") else ([], pending)
                    for event in writer.feed(delta, lps):
                        yield event
                if out.finished:
                    final = out
            assert final is not None
            if pending and writer.open is not None and writer.open["type"] == "message":
                for event in writer.text("message", "", pending):
                    yield event
            for event in writer.finish(_status(final)):
                yield event
            body = done(final)
            yield writer.event(f"response.{body['status']}", response=body)

        return state.stream_response(events(), rids, done_marker=False)

    (out,) = await state.collect_all(request, rids, deadline)
    c = out.outputs[0]
    message, _ = chat.output.message(c.text)
    lps = await completion_logprobs(state, c, 0, True)
    delta = {
        "reasoning_content": message.get("reasoning_content"),
        "content": message.get("content"),
        "tool_calls": [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())],
    }
    for _ in writer.feed(delta, lps["content"] if lps else []):
        pass
    for _ in writer.finish(_status(out)):
        pass
    return JSONResponse(done(out))


def _stored(state: ServerState, response_id: str):
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(
            404, f"no stored response has id {response_id!r}", param="response_id", code="not_found"
        )
    return stored


@router.get(ROUTE + "/{response_id}")
async def get_response(request: Request, response_id: str):
    return JSONResponse(_stored(get_state(request), response_id).body)


@router.delete(ROUTE + "/{response_id}")
async def delete_response(request: Request, response_id: str):
    state = get_state(request)
    _stored(state, response_id)
    state.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
