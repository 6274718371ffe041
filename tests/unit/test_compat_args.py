"""The pooling and compatibility flags in vLLM's and SGLang's spellings resolve onto the engine and server
settings; a bad value is refused naming the flag."""

from __future__ import annotations

import json

import pytest

from longserve.server.args import cli_message, parse

RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}


@pytest.mark.parametrize(
    "argv,runner,convert",
    [
        (["--runner", "pooling"], "pooling", "auto"),  # vLLM
        (["--is-embedding"], "pooling", "auto"),  # SGLang
        (["--task", "embed"], "auto", "embed"),  # vLLM's older spelling
        (["--task", "embedding"], "auto", "embed"),
        (["--task", "score"], "auto", "classify"),
        (["--convert", "classify"], "auto", "classify"),
        (["--task", "generate"], "auto", "none"),
        ([], "auto", "auto"),
    ],
)
def test_runner_and_convert(argv, runner, convert):
    engine, _ = parse(argv, environ={})
    assert (engine.runner, engine.convert) == (runner, convert)


def test_hf_overrides_from_flag_env_and_both_spellings():
    for flag in ("--hf-overrides", "--hf_overrides"):
        engine, _ = parse([flag, json.dumps(RERANKER)], environ={})
        assert engine.hf_overrides == RERANKER
    engine, _ = parse([], environ={"LONGSERVE_HF_OVERRIDES": json.dumps(RERANKER)})
    assert engine.hf_overrides == RERANKER
    with pytest.raises(ValueError) as e:
        parse(["--hf-overrides", "[1, 2]"], environ={})
    assert "--hf-overrides must be a JSON object" in cli_message(e.value)


def test_server_compat_flags():
    _, server = parse([], environ={})
    assert (server.strict_model_name, server.metrics_names) == (False, "longserve")
    _, server = parse(["--strict-model-name", "--metrics-names", "sglang"], environ={})
    assert (server.strict_model_name, server.metrics_names) == (True, "sglang")
    with pytest.raises(SystemExit):
        parse(["--metrics-names", "prometheus"], environ={})
