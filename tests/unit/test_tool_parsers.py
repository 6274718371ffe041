"""Tool-call parsers against what each model's own chat template writes: rendered calls parse back to the
same names and arguments, whole and streamed in any split; malformed output is content, never an error;
`tool_choice` required/named grammars only let through calls the parser reads back, valid for their tool."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longserve.structured.grammar import GrammarCompiler
from longserve.structured.reasoning import Qwen3ReasoningParser
from longserve.structured.tool_calls import StreamDelta, ToolCallDelta, accumulate
from longserve.structured.tool_grammar import tool_call_grammar
from longserve.structured.tool_parsers import (
    TOOL_CALL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    get_tool_call_parser,
)
from tests.fixtures.grammar_sampling import RandomSampler
from tests.fixtures.tool_tokenizer import make_tokenizer, read_template

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ["get_weather", "search_web", "calc.add", "send-mail"]
TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "description": n, "parameters": {"type": "object", "properties": {}}},
    }
    for n in NAMES
]
ALL_MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

# (template, parser, most calls the template can write, writes content beside calls, end of the turn)
CASES = [
    ("qwen25", "hermes", 3, True, "<|im_end|>\n"),
    ("hermes3", "hermes", 3, False, "<|im_end|>\n"),
    ("qwen25", "qwen25", 2, False, "<|im_end|>\n"),
    ("qwen3", "qwen", 3, True, "<|im_end|>\n"),
    ("llama31", "llama3_json", 1, False, "<|eot_id|>"),
    ("mistral_nemo", "mistral", 3, False, "</s>"),
    ("mistral_small32", "mistral", 3, False, "</s>"),
]

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12),
    st.sampled_from(
        ['say "hi"', "back\\slash", "}{][", "<tool_call>", "[TOOL_CALLS]", "</tool_call>", "é ✓"]
    ),
)
json_values = st.recursive(
    json_leaf,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(
    st.sampled_from(["city", "query", "n", "opts", "ключ", "a b"]), json_values, max_size=4
)
content_text = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=30
).filter(lambda s: s.strip() == s and s.strip() and "<" not in s)


def render_output(template: str, calls: list[dict], content: str, eot: str) -> str:
    """The assistant turn the template writes for `calls`, without the prompt or the end-of-turn token."""
    tok = make_tokenizer(template, eos="</s>")
    user = {"role": "user", "content": "What is the weather?"}
    assistant = {"role": "assistant", "content": content, "tool_calls": calls}
    full = tok.apply_chat_template([user, assistant], tools=TOOLS, tokenize=False)
    prompt = tok.apply_chat_template([user], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert full.startswith(prompt), (prompt, full)
    out = full[len(prompt) :]
    assert out.endswith(eot), out
    return out[: -len(eot)]


def make_calls(draw_names: list[str], draw_args: list[dict]) -> list[dict]:
    return [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(zip(draw_names, draw_args))
    ]


def stream(parser_cls, text: str, cuts: list[int], tool_names=None) -> list[StreamDelta]:
    parser = parser_cls(tool_names)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    return [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]


def check_stream_shape(deltas: list[StreamDelta], markers: tuple[str, ...] = ()) -> None:
    """OpenAI's shape: a call's first piece has its id and name, indices count up from 0 with no gaps; no
    content piece holds any of `markers` (a syntax's tags, where every call of the output is well formed)."""
    seen: list[int] = []
    for d in deltas:
        assert not any(m in d.content for m in markers), d.content
        for tc in d.tool_calls:
            if tc.index not in seen:
                assert tc.index == len(seen) and tc.id and tc.name, tc
                seen.append(tc.index)
            else:
                assert tc.id is None and tc.name is None, tc


def strip_reasoning(template: str, text: str) -> str:
    """Qwen3's template writes an (empty) think section before the last assistant turn's text."""
    if template != "qwen3":
        return text
    reasoning, content = Qwen3ReasoningParser.parse(text)
    assert reasoning == ""
    return content


@pytest.mark.parametrize("template,parser_name,max_calls,with_content,eot", CASES)
@SETTINGS
@given(data=st.data())
def test_template_written_calls_parse_back(template, parser_name, max_calls, with_content, eot, data):
    n = data.draw(st.integers(1, max_calls), label="calls")
    names = data.draw(st.lists(st.sampled_from(NAMES), min_size=n, max_size=n), label="names")
    args = data.draw(st.lists(arguments, min_size=n, max_size=n), label="arguments")
    content = data.draw(content_text, label="content") if with_content else ""
    text = strip_reasoning(template, render_output(template, make_calls(names, args), content, eot))
    parser_cls = get_tool_call_parser(parser_name)

    got_content, calls = parser_cls.parse(text, tool_names=NAMES)
    assert got_content == content
    assert [c.name for c in calls] == names
    assert [json.loads(c.arguments) for c in calls] == args
    assert len({c.id for c in calls}) == n
    id_pattern = r"[A-Za-z0-9]{9}" if parser_cls is MistralToolParser else r"call_[0-9a-f]{24}"
    assert all(re.fullmatch(id_pattern, c.id) for c in calls)

    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=40), label="cuts")
    deltas = stream(parser_cls, text, cuts, NAMES)
    check_stream_shape(deltas)
    assert not any(m in d.content for d in deltas for m in ALL_MARKERS)
    s_content, s_calls = accumulate(deltas)
    assert (s_content, [(c.name, c.arguments) for c in s_calls]) == (
        got_content,
        [(c.name, c.arguments) for c in calls],
    )


@pytest.mark.parametrize("template,parser_name,eot", [(c[0], c[1], c[4]) for c in CASES if c[0] != "qwen3"])
def test_token_by_token_stream(template, parser_name, eot):
    """Deltas as a detokenizer makes them (one token at a time, markers as whole tokens)."""
    args = [{"city": "Paris", "opts": {"units": ["C", "F"], "note": 'a "quoted" }'}}, {"q": "ü"}]
    n = 1 if parser_name == "llama3_json" else 2
    text = render_output(template, make_calls(["get_weather", "search_web"][:n], args[:n]), "", eot)
    tok = make_tokenizer(template)
    ids = tok.encode(text, add_special_tokens=False)
    parser = get_tool_call_parser(parser_name)()
    deltas, shown = [], ""
    for k in range(1, len(ids) + 1):
        now = tok.decode(ids[:k], skip_special_tokens=False)
        if not now.endswith("\ufffd"):  # an incomplete UTF-8 sequence waits for its next byte
            deltas.append(parser.feed(now[len(shown) :]))
            shown = now
    deltas.append(parser.finish())
    check_stream_shape(deltas)
    content, calls = accumulate(deltas)
    assert content == ""
    assert [json.loads(c.arguments) for c in calls] == args[:n]
    # arguments arrive while the call is still being written, not all at the end
    assert sum(1 for d in deltas for tc in d.tool_calls if tc.arguments) > n


def test_arguments_stream_before_the_call_ends():
    parser = HermesToolParser()
    first = parser.feed('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first.content == "Checking."
    assert [(tc.index, tc.name, tc.arguments) for tc in first.tool_calls] == [
        (0, "get_weather", '{"city": "Pa')
    ]
    second = parser.feed('ris"}}\n</tool_call>')
    assert [(tc.index, tc.id, tc.arguments) for tc in second.tool_calls] == [(0, None, 'ris"}')]
    assert not parser.finish()


def test_partial_marker_is_held_back_then_released():
    parser = HermesToolParser()
    assert parser.feed("a <tool_").content == "a"
    assert parser.feed("box> b").content == " <tool_box> b"


def test_arguments_written_as_a_json_string():
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>'
    content, calls = HermesToolParser.parse(text)
    assert content == "" and calls[0].arguments == '{"city": "Oslo"}'
    assert (
        accumulate(stream(HermesToolParser, text, list(range(0, len(text), 3))))[1][0].arguments
        == calls[0].arguments
    )


def test_missing_arguments_mean_an_empty_object():
    _, calls = Llama3JsonToolParser.parse('{"name": "get_weather"}')
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", "{}")]


@pytest.mark.parametrize(
    "parser_cls,text",
    [
        (HermesToolParser, "<tool_call>not json</tool_call>"),
        (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": {"a": 1,}}</tool_call>'),
        (HermesToolParser, '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>'),
        (HermesToolParser, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'),  # not a tool
        (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"ci'),  # cut off
        (HermesToolParser, "<tool_cal>{}</tool_cal> and </tool_call>"),
        (HermesToolParser, "<tool_call>"),
        (Llama3JsonToolParser, '{"answer": 42}'),
        (Llama3JsonToolParser, 'Sure: {"name": "get_weather", "parameters": {}}'),
        (Llama3JsonToolParser, '<|python_tag|>brave_search.call(query="x")'),
        (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"a": tru}}'),
        (MistralToolParser, "[TOOL_CALLS]garbage here"),
        (MistralToolParser, '[TOOL_CALLS][{"name": 1, "arguments": {}}]'),
        (MistralToolParser, "[TOOL_CALLS][]"),
        (MistralToolParser, "[TOOL_CALLS]get_weather[ARGS]not json"),
    ],
)
def test_malformed_output_is_content(parser_cls, text):
    assert parser_cls.parse(text, tool_names=NAMES) == (text, [])
    for seed in range(5):
        cuts = random.Random(seed).sample(range(len(text) + 1), min(len(text), 6))
        deltas = stream(parser_cls, text, cuts, NAMES)
        check_stream_shape(deltas)
        content, calls = accumulate(deltas)
        if not calls:  # the stream may have committed to a call before the JSON broke; then it keeps it
            assert content == text


fragments = st.sampled_from(
    [*ALL_MARKERS, "{", "}", "[", "]", '"', "\\", ",", ";", ":", " ", "\n", '"name"', '"arguments"',
     '"parameters"', '"get_weather"', "{}", "x", "é", "1"]
)  # fmt: skip


@pytest.mark.parametrize("parser_cls", [HermesToolParser, Llama3JsonToolParser, MistralToolParser])
@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(fragments, max_size=40), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_text_never_raises(parser_cls, pieces, cuts):
    text = "".join(pieces)
    content, calls = parser_cls.parse(text)
    for c in calls:  # parse keeps only calls whose JSON is whole and valid
        assert isinstance(json.loads(c.arguments), dict)
    check_stream_shape(stream(parser_cls, text, cuts))


def test_registry_has_vllm_and_sglang_names():
    for name in ("hermes", "qwen", "qwen25", "llama3_json", "llama3", "mistral", "qwen3_coder"):
        assert name in TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="choose one of .*hermes.*llama3_json.*mistral.*qwen3_coder"):
        get_tool_call_parser("pythonic")


def test_openai_shapes():
    assert ToolCallDelta(0, id="call_x", name="f").to_openai() == {
        "index": 0,
        "id": "call_x",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    assert ToolCallDelta(1, arguments='{"a"').to_openai() == {"index": 1, "function": {"arguments": '{"a"'}}
    _, calls = HermesToolParser.parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert calls[0].to_openai()["function"] == {"name": "f", "arguments": "{}"}


def test_whitespace_beside_markup_is_markup():
    text = 'A\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nB \n'
    assert HermesToolParser.parse(text)[0] == "AB \n"
    assert accumulate(stream(HermesToolParser, text, list(range(len(text)))))[0] == "AB \n"


# ---- forced tool calls: what the grammar allows is what the parser reads back


@pytest.fixture(scope="module")
def sample():
    tok = make_tokenizer(eos="<|im_end|>")
    return RandomSampler(
        tok, GrammarCompiler(tok, vocab_size=len(tok) + 40, stop_token_ids=[tok.eos_token_id])
    )


TOOL_SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
    "add": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"],
    },
    "ping": None,
}
FORCED_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOL_SCHEMAS.items()
]


@pytest.mark.parametrize(
    "parser,template",
    [("hermes", None), ("llama3_json", None), ("mistral", "mistral_nemo"), ("mistral", "mistral_small32")],
)
@pytest.mark.parametrize(
    "tool_choice,parallel",
    [("required", True), ("required", False), ({"type": "function", "function": {"name": "add"}}, True)],
)
def test_forced_tool_calls_parse_back(sample, parser, template, tool_choice, parallel):
    chat_template = read_template(template) if template else None
    spec = tool_call_grammar(
        parser, FORCED_TOOLS, tool_choice, parallel_tool_calls=parallel, chat_template=chat_template
    )
    counts = set()
    for seed in range(8):
        text = sample(spec, seed)
        content, calls = get_tool_call_parser(parser).parse(text, tool_names=TOOL_SCHEMAS)
        assert content == "" and calls, text
        counts.add(len(calls))
        for call in calls:
            schema = TOOL_SCHEMAS[call.name] or {"type": "object"}
            jsonschema.validate(json.loads(call.arguments), schema)
        if isinstance(tool_choice, dict):
            assert [c.name for c in calls] == ["add"]
    if not parallel or isinstance(tool_choice, dict):
        assert counts == {1}


def test_tool_choice_without_a_grammar_and_errors():
    assert tool_call_grammar("hermes", FORCED_TOOLS, "auto") is None
    assert tool_call_grammar("hermes", FORCED_TOOLS, "none") is None
    with pytest.raises(ValueError, match="not among"):
        tool_call_grammar("hermes", FORCED_TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="at least one tool"):
        tool_call_grammar("hermes", [], "required")
    with pytest.raises(ValueError, match="tool_choice must be"):
        tool_call_grammar("hermes", FORCED_TOOLS, "always")


def test_forced_calls_after_a_reasoning_section(sample):
    from longserve.structured.reasoning import DeepSeekR1ReasoningParser, grammar_after_reasoning

    spec = tool_call_grammar("qwen", FORCED_TOOLS, {"type": "function", "function": {"name": "add"}})
    for parser_cls, state in ((Qwen3ReasoningParser, None), (DeepSeekR1ReasoningParser, True)):
        for seed in range(4):
            text = sample(grammar_after_reasoning(spec, parser_cls, state), seed, prefer=("</think>",))
            _, content = parser_cls.parse(text, state)
            got, calls = HermesToolParser.parse(content, tool_names=TOOL_SCHEMAS)
            assert got == "" and [c.name for c in calls] == ["add"], text
            jsonschema.validate(json.loads(calls[0].arguments), TOOL_SCHEMAS["add"])
