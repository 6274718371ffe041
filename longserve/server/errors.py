"""Errors as OpenAI's error object, {"error": {"message", "type", "param", "code"}}, on every endpoint.

Bad input raises APIError(400, ...) anywhere in a handler; the handlers installed here turn it, the tokenizer
pool's TokenizationError (its status, param and code), FastAPI's own validation and routing errors, and
anything unexpected (500, logged) into that shape.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from longserve.tokenization.pool import TokenizationError

logger = logging.getLogger("longserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_overloaded",
    504: "timeout_error",
}


# OpenAI's and vLLM's request fields that longserve refuses, and why (a request naming one is a 400)
UNSUPPORTED_FIELDS = {
    "audio": "audio output is not supported (this server generates text)",
    "modalities": "only text is supported (no image, audio or video input or output)",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "the legacy function-calling fields are not supported: use tools",
    "function_call": "the legacy function-calling fields are not supported: use tool_choice",
    "reasoning_effort": "not supported; a thinking model's switch is a chat template variable "
    "(chat_template_kwargs, e.g. enable_thinking)",
    "verbosity": "not supported",
    "continuous_usage_stats": "usage in every streamed chunk is not supported; include_usage sends it once, "
    "at the end",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "allowed_token_ids": "not supported; logit_bias can ban or favour tokens",
    "bad_words": "not supported; logit_bias can ban tokens",
    "truncate_prompt_tokens": "prompts are never truncated: a prompt over the context length is a 400",
    "continue_final_message": "not supported",
    "add_special_tokens": "not supported on this route",
    "documents": "not supported (RAG documents in the chat template)",
    "chat_template": "a request cannot bring its own chat template; the model's is used",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "priority": "priority scheduling is not supported",
    "logits_processors": "custom logits processors are not supported",
    "return_tokens_as_token_ids": "not supported",
    "return_token_ids": "not supported",
    "cache_salt": "not supported",
    "kv_transfer_params": "disaggregated serving is not supported",
    "vllm_xargs": "not supported",
    "return_token_strs": "not supported; /detokenize decodes token ids",
    # SGLang's /generate fields (protocol.SGLANG_UNSUPPORTED_FIELDS), refused when not at their default
    **dict.fromkeys(
        ("image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
         "video_config", "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch",
         "video_max_dynamic_patch", "images_config", "need_wait_for_mm_inputs", "num_items_assigned",
         "encoder_urls"),
        "multimodal inputs are not supported",
    ),
    "input_embeds": "prompt embeddings are not supported: give text or input_ids",
    "positional_embed_overrides": "embedding overrides are not supported",
    "token_ids_logprob": "not supported; top_logprobs_num returns the likeliest tokens' logprobs",
    **dict.fromkeys(
        ("return_sampling_mask", "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64",
         "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk",
         "return_entropy", "return_prompt_token_ids", "return_bytes", "multi_item_delimiter_indices"),
        "not supported",
    ),
    "session_params": "sessions are not supported; send the conversation so far (its prefix is cached)",
    "lora_path": "LoRA adapters are not supported",
    "lora_id": "LoRA adapters are not supported",
    **dict.fromkeys(
        ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size"),
        "disaggregated serving is not supported",
    ),
    "background": "background requests are not supported",
    "require_reasoning": "not supported; a thinking model's switch is a chat template variable",
    "max_thinking_tokens": "thinking budgets are not supported",
    "extra_key": "not supported (the prefix cache matches by content)",
}  # fmt: skip


class ClientGone(Exception):
    """The client hung up before its request was read whole: nobody is left to answer."""


def internal_error(what: str, request_id: str | None = None) -> APIError:
    """A 500 for a failure of ours while doing `what`: the traceback (of the exception being handled) goes to
    the log under an id that the body names, never into the body (it may hold internals)."""
    error_id = request_id or f"err-{uuid.uuid4().hex[:12]}"
    logger.error("internal error [%s] while %s", error_id, what, exc_info=True)
    return APIError(500, f"internal server error [{error_id}]; the server log has the details")


class APIError(Exception):
    """An error answered to the client; `status` 4xx for its input, 5xx for ours."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")
        self.param = param
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def sse(self) -> str:
        """The error as one server-sent event (a stream that already answered 200 ends with it)."""
        return f"data: {json.dumps(self.body(), ensure_ascii=False)}\n\n"


def as_api_error(exc: TokenizationError) -> APIError:
    """A refusal of the tokenizer pool as the error answered to the client."""
    return APIError(exc.status, exc.message, param=exc.param, code=exc.code)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# union members pydantic appends to an error's location (prompt.list[int].3) say nothing to a client
def _is_member_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none"))


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """The first problem of a pydantic error, as '<field>: <what is wrong> (got <value>)'."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [p for p in first.get("loc", ()) if p != "body" and not _is_member_tag(p)]
    param = ".".join(str(p) for p in loc) or None
    if first.get("type") == "json_invalid":
        return APIError(
            400, f"malformed JSON in the request body: {first['msg'].removeprefix('Invalid JSON: ')}"
        )
    if first.get("type") == "missing":
        return APIError(400, f"missing required field {param!r}", param=param)
    if first.get("type") == "extra_forbidden":
        why = UNSUPPORTED_FIELDS.get(str(loc[-1]) if loc else "")
        if why is not None:
            return APIError(400, f"unsupported field {param!r}: {why}", param=param)
        extra = [
            ".".join(str(p) for p in e.get("loc", ()) if p != "body" and not _is_member_tag(p))
            for e in errors
            if e.get("type") == "extra_forbidden"
        ]
        if len(extra) > 1:  # every unknown field named at once, not one per attempt
            names = ", ".join(repr(name) for name in extra)
            return APIError(
                400, f"unknown fields {names}; /docs lists the fields of every route", param=param
            )
        return APIError(400, f"unknown field {param!r}; /docs lists the fields of every route", param=param)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "model_type" and not loc:
        return APIError(400, "the request body must be a JSON object")
    got = f" (got {_describe(first['input'])})" if "input" in first and first["type"] != "model_type" else ""
    more = f"; {len(errors) - 1} more problem(s)" if len(errors) > 1 else ""
    return APIError(400, f"{param or 'body'}: {msg}{got}{more}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(TokenizationError)
    async def _tokenization_error(_: Request, exc: TokenizationError) -> JSONResponse:
        return as_api_error(exc).response()

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, _: ClientGone) -> Response:
        logger.debug("client disconnected while sending its request to %s", request.url.path)
        return Response(status_code=400)  # never read: the connection is gone

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs for the endpoints"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(f"handling {request.method} {request.url.path}").response()
