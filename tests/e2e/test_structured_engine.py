"""Structured outputs through the offline engine (LLM.generate with SamplingParams.structured_outputs): every
constrained output of a random-weight model validates against its random schema / fullmatches its regex,
in mixed batches where unconstrained rows keep their exact greedy tokens; n > 1 siblings, preemption by
recompute, min_new_tokens / ignore_eos, the whitespace bound, a bad spec refused before anything is queued,
and a grammar failing at run time ending its own request alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longserve import LLM, SamplingParams
from longserve.structured.spec import GrammarSpec
from tests.fixtures.finite_schemas import finite_json_schemas, finite_regexes
from tests.fixtures.tool_checkpoints import make_tool_checkpoint

PROMPTS = ["The weather in Paris is", "What is the weather like in Rome today?", "Let me think step by step"]
MAX_TOKENS = 1500  # far above what the finite schemas below can take


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tool_checkpoint(tmp_path_factory.mktemp("qwen25"), "qwen25")
    # a random model pads JSON with all the whitespace allowed: a small bound keeps these outputs short
    with LLM(
        path, dtype="float32", device="cpu", max_total_tokens=16384, structured_outputs_max_whitespace=2
    ) as m:
        yield m


def constrained(spec, **kw) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    return SamplingParams(max_new_tokens=MAX_TOKENS, structured_outputs=spec, **kw)


def check_done(llm) -> None:
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    schemas=st.lists(finite_json_schemas, min_size=2, max_size=4),
    patterns=st.lists(finite_regexes, min_size=1, max_size=2),
    seed=st.integers(0, 2**31),
)
def test_random_constraints_in_one_batch_all_hold(llm, schemas, patterns, seed):
    """One batch: random schemas and regexes, sampled at temperature 1, beside an unconstrained greedy row
    whose tokens must equal its run alone (rows without a grammar are never touched by the mask)."""
    free = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    specs = [GrammarSpec.json_schema(s) for s in schemas] + [GrammarSpec.regex(p) for p in patterns]
    params = [constrained(spec, seed=seed + i) for i, spec in enumerate(specs)] + [free]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = llm.generate(prompts, params)
    for out, spec in zip(outs, specs):
        assert out.finish_reason == "stop", (spec, out.text)
        if spec.kind == "json_schema":
            jsonschema.validate(json.loads(out.text), json.loads(spec.text))
        else:
            assert re.fullmatch(spec.text, out.text), (spec.text, out.text)
    alone = llm.generate([prompts[-1]], free)[0]
    assert outs[-1].token_ids == alone.token_ids
    check_done(llm)


def test_offline_dialects_and_greedy(llm):
    """vLLM's StructuredOutputsParams fields as a dict, greedy and sampled; a choice is one of the choices."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    outs = llm.generate(
        PROMPTS,
        [
            SamplingParams(max_new_tokens=200, temperature=0.0, structured_outputs={"json": schema}),
            SamplingParams(max_new_tokens=50, structured_outputs={"choice": ["yes", "no", "maybe"]}, seed=1),
            SamplingParams(max_new_tokens=50, temperature=0.0, structured_outputs={"regex": r"[0-9]{3}"}),
        ],
    )
    assert json.loads(outs[0].text)["ok"] in (True, False)
    assert outs[1].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{3}", outs[2].text)
    assert all(o.finish_reason == "stop" for o in outs)


def test_n_siblings_each_follow_their_own_matcher(llm):
    schema = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4}
    out = llm.generate(PROMPTS[0], constrained(GrammarSpec.json_schema(schema), n=4, seed=7))[0]
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1  # the siblings sampled apart, each under its own grammar state
    check_done(llm)


def test_preempted_requests_keep_their_grammar_state(tmp_path_factory):
    """A KV pool too small for the batch preempts requests by recompute; their matchers stay where their
    tokens are (nothing is re-fed), so every output still validates."""
    path = make_tool_checkpoint(tmp_path_factory.mktemp("preempt"), "qwen25")
    schema = {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 6, "maxItems": 6}
    with LLM(
        path,
        dtype="float32",
        device="cpu",
        max_total_tokens=256,
        page_size=16,
        structured_outputs_max_whitespace=2,
    ) as m:
        outs = m.generate(
            [p * 3 for p in PROMPTS] * 2,
            [constrained(GrammarSpec.json_schema(schema), seed=i) for i in range(6)],
        )
        assert m.engine.scheduler.num_preemptions > 0
        for out in outs:
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)
        check_done(m)


def test_the_grammar_wins_over_min_tokens_and_ignore_eos(llm):
    """A complete grammar allows only its stop tokens: min_new_tokens must not ban them, and the stop
    ends the request even with ignore_eos (else it would run to max_new_tokens on masked logits)."""
    spec = GrammarSpec.choice(["yes", "no"])
    for kw in ({"min_new_tokens": 20}, {"ignore_eos": True}):
        out = llm.generate(PROMPTS[0], constrained(spec, **kw))[0]
        assert out.text in ("yes", "no") and out.finish_reason == "stop", (kw, out.text)
        assert out.outputs[0].stop_reason in llm.engine.eos_token_ids


def test_compact_json_without_whitespace(tmp_path_factory):
    path = make_tool_checkpoint(tmp_path_factory.mktemp("compact"), "qwen25")
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    with LLM(
        path, dtype="float32", device="cpu", max_total_tokens=4096, structured_outputs_max_whitespace=0
    ) as m:
        outs = m.generate(PROMPTS, [constrained(GrammarSpec.json_schema(schema), seed=i) for i in range(3)])
    for out in outs:
        value = json.loads(out.text)
        assert out.text == json.dumps(value, separators=(",", ":")), out.text


def test_a_bad_constraint_queues_nothing(llm):
    for bad in ({"json": {"type": "bogus"}}, {"regex": "(ab"}, {"grammar": "root ::= nothing_here"}):
        with pytest.raises(ValueError, match="cannot compile"):
            llm.generate(
                PROMPTS[:2], [SamplingParams(max_new_tokens=4), SamplingParams(structured_outputs=bad)]
            )
        check_done(llm)
    with pytest.raises(ValueError, match="structured_outputs: set one of"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})


class _BrokenMatcher:
    """A grammar whose mask cannot be filled (what a bug in the grammar engine would look like)."""

    is_completed = is_terminated = False

    def fill_bitmask(self, bitmask, row):
        raise RuntimeError("broken grammar")


def test_a_failing_grammar_ends_its_own_request_alone(llm):
    engine = llm.engine
    good = engine.add_request(PROMPTS[0], constrained(GrammarSpec.regex("[a-c]{5}"), seed=3))
    free = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
    bad = engine.add_request(PROMPTS[2], constrained(GrammarSpec.regex("[a-c]{5}")))
    engine.groups[bad].members[0].grammar = _BrokenMatcher()
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[bad].finish_reason == "error" and "internal error" in done[bad].error
    assert re.fullmatch("[a-c]{5}", done[good].text) and done[good].error is None
    assert len(done[free].token_ids) == 8 and done[free].error is None
    check_done(llm)
