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
        ({"logprobs": 21}, "logprobs"),
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
