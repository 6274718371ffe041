"""Request schemas (pydantic, strict: a string is never an integer) of the OpenAI routes and SGLang's
/generate, the strict body parser, and the mapping of each onto the engine's SamplingParams."""

from __future__ import annotations

import logging
import time
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.requests import ClientDisconnect

from longserve.sampling_params import SamplingParams
from longserve.server.chat_tools import template_tool_calls
from longserve.server.errors import APIError, ClientGone, validation_error

logger = logging.getLogger("longserve.server")

# ASGI scope key: time.perf_counter() when the server started on the request (engine timings count from it)
ARRIVAL_SCOPE_KEY = "longserve.arrival"

MAX_BODY_BYTES = 64 * 2**20
MAX_N = 128  # completions per prompt: n siblings are n engine requests
T = TypeVar("T", bound=BaseModel)


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Schema):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool = True  # a no-op: OpenAI's padding against side channels; none is sent here


class _OpenAISampling(_Schema):
    """Fields shared by /v1/completions and /v1/chat/completions (plus vLLM's sampling extras). A field not
    declared here is a 400 naming it (errors.UNSUPPORTED_FIELDS says why for OpenAI's and vLLM's): none is
    silently ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # accepted and without effect, as they are on vLLM: ids for OpenAI's abuse monitoring, OpenAI's stored
    # completions (nothing is stored here), its processing tier (there is one) and its cache-routing hint
    # (the prefix cache matches by content)
    user: str | None = None
    safety_identifier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM / SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # vLLM's: the prompt's logprobs, in the response's prompt_logprobs
    include_stop_str_in_output: bool = False  # vLLM's name for SGLang's no_stop_trim
    spaces_between_special_tokens: bool = True
    # output constraints (server/grammars.py reads them; at most one per request): vLLM's and SGLang's
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        kw: dict[str, Any] = dict(
            max_new_tokens=max_tokens,
            n=self.n,
            stop=self.stop if self.stop is not None else [],  # "" is refused as [""] is
            stop_token_ids=self.stop_token_ids or [],
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs,
            **self.logprob_fields(logprobs),
        )
        optional = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            min_new_tokens=self.min_tokens,
        )
        kw.update({k: v for k, v in optional.items() if v is not None})
        return make_sampling_params(kw, openai_names=True)

    def logprob_fields(self, logprobs: int | None) -> dict[str, Any]:
        """Prompt logprobs, logit_bias and the stop-string option, as SamplingParams fields."""
        return dict(
            prompt_logprobs=self.prompt_logprobs,
            logit_bias=parse_logit_bias(self.logit_bias),
            no_stop_trim=self.include_stop_str_in_output,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def logprob_fields(self, logprobs: int | None) -> dict[str, Any]:
        fields = super().logprob_fields(logprobs)
        if self.echo and fields["prompt_logprobs"] is None:
            fields["prompt_logprobs"] = logprobs  # echo with logprobs: the prompt's too (vLLM)
        fields["best_of"] = self.best_of
        return fields


class TextPart(_Schema):
    type: Literal["text"]
    text: str


class ChatMessage(_Schema):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool result's call
    reasoning_content: str | None = None  # an assistant's reasoning, for templates that show it (Qwen3)

    def as_dict(self, index: int = 0) -> dict[str, Any]:
        """The message as the chat template sees it; `index` (its place in `messages`) names it in errors."""
        content = self.content
        if content is None and self.role != "assistant":  # as OpenAI's API: only an assistant may omit it
            raise APIError(
                400,
                f"messages[{index}]: a '{self.role}' message needs 'content'",
                param=f"messages.{index}.content",
            )
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None and self.role == "assistant":
            out["tool_calls"] = template_tool_calls(self.tool_calls, f"messages.{index}.tool_calls")
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # default: "auto" with tools, as OpenAI's
    parallel_tool_calls: bool | None = None  # None: true
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateSampling(_Schema):
    """SGLang's sampling_params; unknown keys are refused (a typo must not be silently ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    max_new_tokens: int | None = 128  # SGLang's default
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's spelling
    no_stop_trim: bool = False  # keep the matched stop string in the text
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    stream_interval: int | None = None  # stream every N tokens (routes_generate.py)
    custom_params: dict[str, Any] | None = None  # carried along: longserve has no custom logit processors
    # output constraints (JSON text, a regex, EBNF, a structural tag as JSON text): server/grammars.py
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def to_params(
        self, logprobs: int | None, prompt_logprobs: int | None = None, logprob_start_len: int = 0
    ) -> SamplingParams:
        kw = self.model_dump(
            exclude={"sampling_seed", "json_schema", "regex", "ebnf", "structural_tag", "stream_interval"}
        )
        kw["stop"] = kw["stop"] if kw["stop"] is not None else []  # "" is refused as [""] is
        kw["stop_token_ids"] = kw["stop_token_ids"] or []
        kw["seed"] = self.seed if self.seed is not None else self.sampling_seed
        kw["logprobs"] = logprobs
        kw["prompt_logprobs"] = prompt_logprobs
        kw["logprob_start_len"] = logprob_start_len
        kw["logit_bias"] = parse_logit_bias(self.logit_bias, "sampling_params.logit_bias")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise APIError(
                400, "stream_interval must be an integer >= 1", param="sampling_params.stream_interval"
            )
        return make_sampling_params(kw)


# SGLang's GenerateReqInput (sglang/srt/managers/io_struct.py) declares more fields than longserve implements.
# SGLang reads its body as a dataclass, so it ignores a field it does not declare (a typo) without a word;
# longserve answers a 400 naming it instead, as on the OpenAI routes. Of SGLang's own fields: routing,
# tracing and logging hints are accepted and ignored (a debug log line names them) ...
SGLANG_IGNORED_FIELDS = frozenset({
    "session_id", "log_metrics", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
    "kv_router_hint", "routing_key", "conversation_id", "no_logs", "custom_labels", "external_trace_header",
    "received_time", "http_worker_ipc",
})  # fmt: skip
# ... and those that would change what is computed or returned are accepted at their default only (null,
# false, empty: a client that sends every field), else a 400 that says why (errors.UNSUPPORTED_FIELDS)
SGLANG_UNSUPPORTED_FIELDS = frozenset({
    "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes",
    "use_audio_in_video", "video_config", "modalities", "max_dynamic_patch", "min_dynamic_patch",
    "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "need_wait_for_mm_inputs",
    "num_items_assigned", "encoder_urls", "positional_embed_overrides", "token_ids_logprob",
    "return_sampling_mask", "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk",
    "return_entropy", "return_prompt_token_ids", "return_bytes", "session_params", "lora_path", "lora_id",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size",
    "background", "require_reasoning", "max_thinking_tokens", "priority", "extra_key", "cache_salt",
    "multi_item_delimiter_indices",
})  # fmt: skip
_SGLANG_DEFAULTS = {"routed_experts_start_len": 0}  # the unsupported fields' defaults that are not null/false


def _at_default(name: str, value: Any) -> bool:
    return value is None or value is False or value in ([], {}, "") or value == _SGLANG_DEFAULTS.get(name)


class GenerateRequest(_Schema):
    """SGLang's /generate body; a field not declared here is a 400 naming it, but for SGLang's own fields
    (SGLANG_IGNORED_FIELDS, SGLANG_UNSUPPORTED_FIELDS at their defaults), which are accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: GenerateSampling | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # with return_logprob: the prompt's logprobs from this position on (-1: its last token only, SGLang's
    # default; the first entry's logprob is null), and each token's text in the tuples
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    custom_logit_processor: str | None = None  # refused: longserve runs no client code
    rid: str | list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _sglang_fields(cls, data: Any) -> Any:
        """Drop SGLang's fields that longserve accepts and ignores (logged at debug level), and the nulls
        SGLang's clients send for the fields declared here (its `Runtime.generate` sends
        top_logprobs_num: null): they mean the default, as they do on SGLang."""
        if not isinstance(data, dict):
            return data
        ignored = [
            k
            for k, v in data.items()
            if k in SGLANG_IGNORED_FIELDS or (k in SGLANG_UNSUPPORTED_FIELDS and _at_default(k, v))
        ]
        nulls = [k for k, v in data.items() if v is None and k in _NULL_MEANS_DEFAULT]
        if ignored:
            logger.debug("/generate: ignoring SGLang field(s) %s", ", ".join(sorted(ignored)))
        if ignored or nulls:
            data = {k: v for k, v in data.items() if k not in ignored and k not in nulls}
        return data


_NULL_MEANS_DEFAULT = frozenset(
    ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream")
)


class TokenizeRequest(_Schema):
    """vLLM's /tokenize body (a prompt, or messages through the chat template); an undeclared field is a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    text: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # with messages, as on vLLM


class DetokenizeRequest(_Schema):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def parse_logit_bias(bias: dict[str, float] | None, param: str = "logit_bias") -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) with integer keys; a key that is not a token id
    is a 400 naming it (the values' range and the ids' vocab are checked with the other sampling fields)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        token = key.strip()
        if not token.isascii() or not token.isdigit():
            raise APIError(
                400, f"{param} keys must be token ids (integers as strings), got {key!r}", param=param
            )
        out[int(token)] = value
    return out


def make_sampling_params(kw: dict[str, Any], openai_names: bool = False) -> SamplingParams:
    """SamplingParams(**kw); its validation error becomes a 400 naming the field as the client spelled it."""
    n = kw.get("n", 1)
    if isinstance(n, int) and n > MAX_N:
        raise APIError(400, f"n must be at most {MAX_N}, got {n}", param="n")
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        if openai_names:
            for ours, theirs in _OPENAI_NAMES.items():
                message = message.replace(ours, theirs)
            field = _OPENAI_NAMES.get(field, field)
        raise APIError(400, message, param=field if field.isidentifier() else None) from None


async def parse_body(request: Request, schema: type[T]) -> T:
    """The request body as `schema`: invalid UTF-8, malformed JSON and wrong types are each a clear 400.
    Stamps the request's arrival (ARRIVAL_SCOPE_KEY): its timings (TTFT, queue time) count from here."""
    request.scope.setdefault(ARRIVAL_SCOPE_KEY, time.perf_counter())
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ClientGone from None
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"request body is {len(raw):,} bytes; the limit is {MAX_BODY_BYTES:,}")
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (bad byte at offset {e.start})") from None
    try:
        return schema.model_validate_json(text)
    except ValidationError as e:
        raise validation_error(e) from None
