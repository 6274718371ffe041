"""OpenAI's Responses API request (POST /v1/responses) and its mapping onto a chat completion: the input items
as chat messages (a stored response's conversation first, with previous_response_id), the function tools and
tool_choice in the chat shape, `text.format` as response_format. The chat path then renders the model's chat
template, forces or parses tool calls and compiles the output constraint as for /v1/chat/completions
(chat_request.prepare_chat): one mechanism behind both routes. routes_responses.py shapes the output.

What is refused, with a 400 naming the field: hosted tools (web search, file search, computer use, MCP, code
interpreter: only function tools, which the client runs), non-text input (images, files, audio), background
responses, server-side conversations, reusable prompts, `truncation: "auto"` (a prompt over the context length
is a 400, as on the other routes) and item references."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict

from longserve.server.errors import APIError
from longserve.server.protocol import ChatCompletionRequest, ChatMessage, _Schema

# `include` values OpenAI documents: the logprobs are returned; the rest name outputs of hosted tools or
# encrypted reasoning, which this server never produces, so asking for them adds nothing (as on vLLM)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
INCLUDABLE = frozenset({
    LOGPROBS_INCLUDE, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
})  # fmt: skip
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
_REASONING_PARTS = {"reasoning_text": "text", "summary_text": "text"}
_ITEMS = "message, function_call, function_call_output and reasoning items"


class ResponsesRequest(_Schema):
    """The body of POST /v1/responses. A field not declared here is a 400 naming it."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: a no-op (no padding is sent)
    store: bool = True  # kept in the server's memory for previous_response_id and GET (routes_responses.py)
    previous_response_id: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    metadata: dict[str, str] | None = None
    # accepted without effect, as on the chat route: abuse-monitoring ids, the processing tier, cache hints
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # refused unless at their defaults (check_supported)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    # vLLM's sampling extras on this route
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        refused = {
            "background": (self.background, "background responses are not supported: stream instead"),
            "conversation": (self.conversation, "server-side conversations are not supported: send the "
                             "conversation as input items, or chain responses with previous_response_id"),
            "prompt": (self.prompt, "reusable prompts are not supported: send instructions and input"),
            "context_management": (self.context_management, "context management is not supported"),
        }  # fmt: skip
        for name, (value, why) in refused.items():
            if value:
                raise APIError(400, f"{name}: {why}", param=name)
        if self.truncation == "auto":
            raise APIError(
                400,
                "truncation 'auto' is not supported: an input over the context length is refused, never cut",
                param="truncation",
            )
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(400, "max_output_tokens must be at least 1", param="max_output_tokens")
        if self.max_tool_calls is not None and self.max_tool_calls < 0:
            raise APIError(400, "max_tool_calls must be at least 0", param="max_tool_calls")
        for i, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise APIError(400, f"include[{i}]: unknown value {value!r}", param="include")
        if self.reasoning and self.reasoning.get("effort") is not None:
            raise APIError(
                400,
                "reasoning.effort is not supported; a thinking model's switch is a chat template variable "
                "(chat_template_kwargs, e.g. enable_thinking)",
                param="reasoning",
            )
        if self.text and self.text.get("verbosity") is not None:
            raise APIError(400, "text.verbosity is not supported", param="text.verbosity")

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or self.top_logprobs is not None


def _text(value: Any, where: str, kinds: dict[str, str] = _TEXT_PARTS) -> str:
    """A string, or a list of text parts joined; anything else (an image, a file, audio) is a 400."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
    out = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        key = kinds.get(kind)
        if key is None or not isinstance(part.get(key), str):
            raise APIError(
                400,
                f"{where}[{j}]: only text parts ({', '.join(kinds)}) are supported, got type {kind!r}",
                param=f"{where}[{j}]",
            )
        out.append(part[key])
    return "".join(out)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def input_messages(value: str | list[dict[str, Any]], param: str = "input") -> list[dict[str, Any]]:
    """Input items as chat messages: a function_call joins the assistant turn it follows (the model's reply
    was its message then its calls), a function_call_output is a tool message, a reasoning item's text goes
    with the assistant turn after it (for templates that show earlier reasoning)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise APIError(400, f"{param} is empty: give a string or at least one item", param=param)
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(value):
        where = f"{param}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant", param=where)
            message = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"], reasoning = "".join(reasoning), []
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": output}
            )
        elif kind == "reasoning":
            key = "content" if item.get("content") else "summary"
            reasoning.append(_text(item.get(key) or [], f"{where}.{key}", _REASONING_PARTS))
        elif kind == "item_reference":
            raise APIError(
                400, f"{where}: item references are not supported: send the item itself", param=where
            )
        else:
            raise APIError(
                400, f"{where}.type {kind!r} is not supported ({_ITEMS} are)", param=f"{where}.type"
            )
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' function tools ({type, name, parameters, ...}) in the chat shape ({type, function: {...}})."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"tools[{i}]: type {kind!r} is not supported: only function tools (the client runs them)",
                param=f"tools[{i}].type",
            )
        # the chat shape ({type, function: {...}}) as some clients send it here too (Codex CLI's older builds)
        flat = tool["function"] if isinstance(tool.get("function"), dict) and "name" not in tool else tool
        keys = ("name", "description", "parameters", "strict")
        out.append({"type": "function", "function": {k: flat[k] for k in keys if flat.get(k) is not None}})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def forces_call(choice: str | dict[str, Any] | None) -> bool:
    return choice == "required" or isinstance(choice, dict)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat route's response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list]:
    """The chat completion that answers `req` after `history` (a stored response's conversation), and the
    conversation it continues with (history + this input, as chat messages, for the store)."""
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": [ChatMessage.model_validate(m) for m in messages],
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _chat_tools(req.tools),
        "tool_choice": _chat_tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        # a forced call is the whole reply: the format is for messages, which it leaves none of (the Agents SDK
        # sends both for an agent with an output type and tool_choice "required"; the chat route refuses both)
        "response_format": None if forces_call(req.tool_choice) else _response_format(req.text),
        "stream": req.stream,
        "logprobs": req.logprobs,
        "top_logprobs": req.top_logprobs,
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "stop": req.stop,
        "logit_bias": req.logit_bias,
        "chat_template_kwargs": req.chat_template_kwargs,
    }
    chat = ChatCompletionRequest.model_construct(**{k: v for k, v in fields.items() if v is not None})
    return chat, conversation
