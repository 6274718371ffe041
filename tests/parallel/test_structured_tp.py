"""Structured outputs under tensor parallelism (two CPU ranks, gloo): only rank 0 samples, so only it holds the
requests' grammars; the constrained greedy tokens equal TP=1's and every output validates."""

from __future__ import annotations

import json

import jsonschema

from longserve import LLM, SamplingParams
from longserve.structured.spec import GrammarSpec
from tests.fixtures.tool_checkpoints import make_tool_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}


def run(path: str, **kw) -> list[list[int]]:
    params = [
        SamplingParams(
            max_new_tokens=300, temperature=0.0, structured_outputs=GrammarSpec.json_schema(SCHEMA)
        ),
        SamplingParams(
            max_new_tokens=40, temperature=0.0, structured_outputs=GrammarSpec.regex(r"[a-z]{3,9}\.")
        ),
        SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    with LLM(path, dtype="float32", device="cpu", max_total_tokens=4096, **kw) as m:
        outs = m.generate(["The weather in Paris is", "Name a city:", "Let me think"], params)
        m.engine.check_integrity()
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert outs[1].text.endswith(".") and outs[1].finish_reason == "stop"
    return [o.token_ids for o in outs]


def test_tp2_constrained_equals_tp1(tmp_path):
    path = make_tool_checkpoint(tmp_path / "m", "qwen25", seed=3)
    assert run(path, tensor_parallel_size=2) == run(path)
