"""`longserve generate`: the engine flags of `serve` (SGLang and vLLM spellings), text out or JSON."""

from __future__ import annotations

import json

import pytest

from longserve import LLM, SamplingParams, cli
from longserve.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli"), "qwen2")


def test_generate_json_equals_offline_api(ckpt, capsys):
    argv = ["generate", "--model-path", ckpt, "--device", "cpu", "--dtype", "float32"]
    argv += ["--max-model-len", "256", "--max-total-tokens", "1024", "--disable-radix-cache"]
    argv += ["--prompt", "Hello there", "--prompt", "General Kenobi", "--max-new-tokens", "12", "--json"]
    assert cli.main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    llm = LLM(ckpt, device="cpu", dtype="float32", max_total_tokens=1024)
    ref = llm.generate(["Hello there", "General Kenobi"], SamplingParams(max_new_tokens=12, temperature=0))
    assert [x["prompt"] for x in lines] == ["Hello there", "General Kenobi"]
    assert [x["token_ids"] for x in lines] == [o.token_ids for o in ref]
    assert [x["text"] for x in lines] == [o.text for o in ref]


def test_generate_reports_bad_input(ckpt, capsys):
    argv = ["generate", "--model", ckpt, "--device", "cpu", "--max-total-tokens", "1024"]
    assert cli.main([*argv, "--max-model-len", "4", "--prompt", "a long enough prompt"]) == 2
    assert "the context length is 4" in capsys.readouterr().err
