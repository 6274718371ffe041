"""SamplingParams: defaults, normalization, and validation messages that name the bad field."""

from __future__ import annotations

import pytest

from longserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": False}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n must"),
        ({"n": True}, "n must"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 3.0}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -3}, "presence_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"seed": False}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_invalid_values_raise_with_field_name(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_normalization() -> None:
    params = SamplingParams()
    assert params.max_new_tokens == 16 and params.top_k == -1 and not params.greedy
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(max_new_tokens=None, min_new_tokens=100).max_new_tokens is None


def test_greedy() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy


def test_clone_copies_lists_and_revalidates() -> None:
    params = SamplingParams(stop=["x"], stop_token_ids=[2])
    copy = params.clone(temperature=0.5)
    copy.stop.append("y")
    assert params.stop == ["x"] and copy.temperature == 0.5 and params.temperature == 1.0
    with pytest.raises(ValueError, match="top_p"):
        params.clone(top_p=2.0)


def test_vllm_and_sglang_keyword_spellings() -> None:
    """vLLM's names (max_tokens, min_tokens, include_stop_str_in_output, extra_args) and SGLang's
    sampling_seed set our fields; the ones vLLM spells as we do are accepted as they are."""
    p = SamplingParams(
        max_tokens=7,
        min_tokens=2,
        include_stop_str_in_output=True,
        extra_args={"k": 1},
        sampling_seed=5,
        stop_token_ids=[3],
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        prompt_logprobs=1,
    )
    assert (p.max_new_tokens, p.min_new_tokens, p.no_stop_trim, p.custom_params, p.seed) == (
        7, 2, True, {"k": 1}, 5
    )  # fmt: skip
    assert (p.stop_token_ids, p.skip_special_tokens, p.spaces_between_special_tokens) == ([3], False, False)
    assert (p.max_tokens, p.min_tokens, p.include_stop_str_in_output) == (7, 2, True)  # read as vLLM does
    p.max_tokens = 9
    assert p.max_new_tokens == 9 and p.clone().max_tokens == 9
    assert SamplingParams(max_tokens=4, max_new_tokens=4).max_new_tokens == 4  # both, agreeing: fine
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_tokens=1, min_tokens=2)  # validated as one field


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 4, "max_new_tokens": 5}, "max_tokens=4 and max_new_tokens=5: two spellings"),
        ({"min_new_tokens": 1, "min_tokens": 2}, "min_new_tokens=1 and min_tokens=2"),
        ({"max_token": 3}, "'max_token': did you mean 'max_tokens'"),
        ({"temprature": 1.0}, "'temprature': did you mean 'temperature'"),
        ({"bad_words": ["x"]}, "'bad_words': not supported"),
        ({"logits_processors": []}, "custom logits processors are not supported"),
    ],
)
def test_conflicting_or_unknown_keywords_are_type_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        SamplingParams(**kwargs)


def test_logprobs_past_the_engines_limit_name_their_field() -> None:
    """The top-logprob counts have no fixed bound in SamplingParams (vLLM's --max-logprobs sets the engine's):
    check_logprobs_limit refuses more than the limit, naming the field first (the server's 400 param)."""
    from longserve.sampling_params import check_logprobs_limit, with_every_logprob

    params = SamplingParams(logprobs=50, prompt_logprobs=30)
    check_logprobs_limit(params, 50)
    every = with_every_logprob(SamplingParams(logprobs=-1, prompt_logprobs=-1), 512)  # vLLM's -1: every token
    assert (every.logprobs, every.prompt_logprobs) == (512, 512)
    assert with_every_logprob(params, 512) is params
    with pytest.raises(
        ValueError, match=r"^prompt_logprobs must be at most 29 \(max_logprobs, --max-logprobs\)"
    ):
        check_logprobs_limit(SamplingParams(prompt_logprobs=30), 29)
    with pytest.raises(ValueError, match=r"^logprobs must be at most 20 .* got 50$"):
        check_logprobs_limit(params, 20)
