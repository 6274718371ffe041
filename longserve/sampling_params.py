"""SamplingParams: what a request asks of generation. Validated on construction so that bad input fails
with an actionable message before it reaches the engine."""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from longserve.structured.spec import GrammarSpec

_GREEDY_EPS = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # seeds are signed 64-bit, as OpenAI's API documents them


def wrap_seed(seed: int) -> int:
    """`seed` reduced into the signed 64-bit range (seed + i of the i-th of n siblings may pass its end)."""
    return (seed - INT64_MIN) % 2**64 + INT64_MIN


@dataclass(slots=True)
class SamplingParams:
    """Per-request generation settings; names follow SGLang (max_new_tokens). The constructor also takes
    vLLM's and SGLang's other spellings of the same settings (ALIASES: max_tokens, min_tokens,
    include_stop_str_in_output, extra_args, sampling_seed), stored under one field each and readable under
    vLLM's name too (`params.max_tokens`); both spellings with different values is a TypeError."""

    max_new_tokens: int | None = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    skip_special_tokens: bool = True
    logprobs: int | None = None  # number of top logprobs to return per token; None: none
    # logprobs of the prompt's tokens (vLLM's prompt_logprobs): per prompt position from logprob_start_len on,
    # the token's logprob and the top `prompt_logprobs`; the first entry is None (nothing predicts it)
    prompt_logprobs: int | None = None
    logprob_start_len: int = 0  # SGLang's: the first prompt position with an entry; negative: from the end
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI)
    best_of: int | None = None  # generate best_of completions, return the n of highest cumulative logprob
    no_stop_trim: bool = False  # keep the matched stop string (or stop token's text) in the text
    # accepted as vLLM and SGLang do: the fast (Rust) tokenizers decode special tokens with no spaces added
    spaces_between_special_tokens: bool = True
    custom_params: dict[str, Any] | None = None  # SGLang's, carried along: no logits processor reads it
    # the output's grammar: a GrammarSpec, or vLLM's StructuredOutputsParams fields as a dict ({"json":
    # schema}, {"regex": ...}, {"choice": [...]}, {"grammar": ...}, {"json_object": True}, ...); None: free
    structured_outputs: GrammarSpec | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        # `type() is int`: False == 0 too, and a bool must fail validation rather than mean "no top-k".
        if type(self.top_k) is int and self.top_k == 0:
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            from longserve.structured.request_formats import structured_outputs_spec

            self.structured_outputs = structured_outputs_spec(self.structured_outputs)
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            # NaN/inf fail every range check below except the open-ended ones, so reject them here.
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        need(
            self.max_new_tokens is None or (is_int(self.max_new_tokens) and self.max_new_tokens >= 0),
            f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}",
        )
        need(
            is_int(self.min_new_tokens) and self.min_new_tokens >= 0,
            f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}",
        )
        if self.max_new_tokens is not None:
            need(
                self.min_new_tokens <= self.max_new_tokens,
                f"min_new_tokens ({self.min_new_tokens}) must not exceed max_new_tokens ({self.max_new_tokens})",
            )
        need(
            is_num(self.temperature) and self.temperature >= 0,
            f"temperature must be a finite number >= 0, got {self.temperature!r}",
        )
        need(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(
            is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}",
        )
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(
            is_num(self.repetition_penalty) and self.repetition_penalty > 0,
            f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}",
        )
        need(
            is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}",
        )
        need(
            is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}",
        )
        need(
            self.seed is None or (is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
            f"seed must be a signed 64-bit integer (in [-2**63, 2**63 - 1]), got {self.seed!r}",
        )
        need(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}",
        )
        need(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}",
        )
        need(is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(
            self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= -1),
            f"logprobs must be an integer >= 0, or -1 for every token, got {self.logprobs!r}",
        )
        _validate_logprob_extras(self, need, is_int, is_num)
        need(
            self.structured_outputs is None or isinstance(self.structured_outputs, GrammarSpec),
            "structured_outputs must be a GrammarSpec or a dict of vLLM's StructuredOutputsParams fields, "
            f"got {type(self.structured_outputs).__name__}",
        )

    # vLLM's names of the fields, for code written against vLLM's SamplingParams
    max_tokens = property(
        lambda self: self.max_new_tokens, lambda self, v: setattr(self, "max_new_tokens", v)
    )
    min_tokens = property(
        lambda self: self.min_new_tokens, lambda self, v: setattr(self, "min_new_tokens", v)
    )
    include_stop_str_in_output = property(
        lambda self: self.no_stop_trim, lambda self, v: setattr(self, "no_stop_trim", v)
    )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def clone(self, **changes) -> SamplingParams:
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values["stop"] = list(self.stop)
        values["stop_token_ids"] = list(self.stop_token_ids)
        if self.logit_bias is not None:
            values["logit_bias"] = dict(self.logit_bias)
        values.update(changes)
        return SamplingParams(**values)


# other engines' keyword -> the field that holds the setting here (one field per setting). vLLM's
# stop_token_ids, skip_special_tokens, spaces_between_special_tokens, n, best_of, logprobs, prompt_logprobs,
# logit_bias, seed, ignore_eos, the penalties and structured_outputs are spelled as ours already.
ALIASES = {
    "max_tokens": "max_new_tokens",  # vLLM
    "min_tokens": "min_new_tokens",  # vLLM
    "include_stop_str_in_output": "no_stop_trim",  # vLLM
    "extra_args": "custom_params",  # vLLM: carried along for custom samplers (none reads it here)
    "sampling_seed": "seed",  # SGLang's /generate spelling
}
# vLLM's SamplingParams fields with no equivalent here: an explanation instead of a bare "unexpected keyword"
_UNSUPPORTED = {
    "logits_processors": "custom logits processors are not supported",
    "allowed_token_ids": "not supported; logit_bias can ban or favour tokens",
    "bad_words": "not supported; logit_bias can ban tokens",
    "truncate_prompt_tokens": "prompts are never truncated",
    "detokenize": "outputs are always detokenized",
    "guided_decoding": "use structured_outputs (vLLM's newer name): a dict such as {'json': schema}",
    "use_beam_search": "beam search is not supported",
}


def _canonical_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Constructor keywords with every alias under its field's name; an unknown keyword is a TypeError naming
    the closest known one."""
    names = SamplingParams.__dataclass_fields__
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # field -> the keyword that set it
    for key, value in kwargs.items():
        name = ALIASES.get(key, key)
        if name not in names:
            why = _UNSUPPORTED.get(key)
            if why is None:
                close = difflib.get_close_matches(key, [*names, *ALIASES], n=1)
                why = f"did you mean {close[0]!r}?" if close else "see SamplingParams' fields"
            raise TypeError(f"SamplingParams got an unexpected keyword argument {key!r}: {why}")
        if name in out and out[name] != value:
            raise TypeError(
                f"SamplingParams got {given[name]}={out[name]!r} and {key}={value!r}: two spellings of one "
                "setting with different values; give one"
            )
        out[name] = value
        given[name] = key
    return out


def _accept_aliases(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs) -> None:
        init(self, *args, **_canonical_kwargs(kwargs))

    return __init__


SamplingParams.__init__ = _accept_aliases(SamplingParams.__init__)  # type: ignore[method-assign]


def _validate_logprob_extras(p: SamplingParams, need, is_int, is_num) -> None:
    """prompt logprobs, logit_bias, best_of and SGLang's text options (validate's helper)."""
    need(
        p.prompt_logprobs is None or (is_int(p.prompt_logprobs) and p.prompt_logprobs >= -1),
        f"prompt_logprobs must be an integer >= 0, or -1 for every token, got {p.prompt_logprobs!r}",
    )
    need(is_int(p.logprob_start_len), f"logprob_start_len must be an integer, got {p.logprob_start_len!r}")
    if p.logit_bias is not None:
        need(isinstance(p.logit_bias, dict), f"logit_bias must map token ids to numbers: {p.logit_bias!r}")
        bad = [t for t in p.logit_bias if not (is_int(t) and t >= 0)]
        need(not bad, f"logit_bias keys must be token ids (integers >= 0), got {bad[:5]!r}")
        bad = {t: b for t, b in p.logit_bias.items() if not (is_num(b) and -100 <= b <= 100)}
        need(not bad, f"logit_bias values must be numbers in [-100, 100], got {bad!r}")
    need(
        p.best_of is None or (is_int(p.best_of) and is_int(p.n) and p.best_of >= p.n),
        f"best_of must be an integer >= n ({p.n!r}), got {p.best_of!r}",
    )
    for name in ("no_stop_trim", "spaces_between_special_tokens"):
        need(isinstance(getattr(p, name), bool), f"{name} must be a boolean, got {getattr(p, name)!r}")
    need(
        p.custom_params is None or isinstance(p.custom_params, dict),
        f"custom_params must be an object, got {p.custom_params!r}",
    )


def with_every_logprob(params: SamplingParams, vocab: int) -> SamplingParams:
    """logprobs / prompt_logprobs of -1 (vLLM's: every token of the vocabulary) as the vocabulary's size, what the
    engine and the limit below work with."""
    every = {name: vocab for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
    return params.clone(**every) if every else params


def check_logprobs_limit(params: SamplingParams, limit: int) -> None:
    """logprobs and prompt_logprobs (-1 resolved by with_every_logprob) at most `limit`, the engine's cap
    (EngineConfig.max_logprobs, -1 read as the vocabulary): ValueError naming the field first, as the
    constructor's checks do."""
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > limit:
            raise ValueError(f"{name} must be at most {limit} (max_logprobs, --max-logprobs), got {asked}")
