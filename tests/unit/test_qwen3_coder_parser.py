"""The `qwen3_coder` tool-call parser (Qwen3-Coder, Qwen3-Next-Coder, Qwen3.5 XML calls) against its references:
what Qwen3.5's and Qwen3-Coder's own chat templates write parses back to the same calls, whole and streamed in
any split or token by token, each value typed by its tool's schema; short cases of what vLLM's parser reads
(vllm-project/vllm, vllm/tool_parsers/qwen3coder_tool_parser.py at 00d0a333ba9b, Qwen3CoderToolParser:
_convert_param_value, _parse_xml_function_call, extract_tool_calls) read the same here; malformed output is
content, never an error; the grammar that forces tool_choice required/named in this syntax only lets through
calls the parser reads back, valid for their tool."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longserve.structured.grammar import GrammarCompiler
from longserve.structured.qwen_xml import ParamKind, convert, param_kind
from longserve.structured.reasoning import (
    Qwen3ReasoningParser,
    grammar_after_reasoning,
    prompt_reasoning_state,
)
from longserve.structured.tool_calls import StreamDelta, accumulate
from longserve.structured.tool_grammar import tool_call_grammar
from longserve.structured.tool_parsers import Qwen3CoderToolParser, get_tool_call_parser
from tests.fixtures.grammar_sampling import RandomSampler
from tests.fixtures.tool_tokenizer import make_tokenizer
from tests.unit.test_tool_parsers import check_stream_shape

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARAMS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "detailed": {"type": "boolean"},
        },
        "required": ["city"],
    },
    "search.web": {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "filters": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "limit": {"type": "number"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
    },
    "ping": {"type": "object", "properties": {}},
}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
    for n, s in PARAMS.items()
]
MARKERS = Qwen3CoderToolParser.markers

# A string value the template writes raw: anything but the tags that end a value.
text_values = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=16).filter(
    lambda s: not any(tag in s for tag in ("</parameter>", "</function>", "</tool_call>", "<parameter="))
)
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.sampled_from(["<tool_call>", "</parameter>", "a\nb", 'say "hi"']),
)  # fmt: skip
json_values = st.recursive(
    json_leaf,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=6,
)
ARGUMENTS = {
    "get_weather": st.fixed_dictionaries(
        {"city": text_values},
        optional={
            "days": st.integers(-(10**9), 10**9),
            "units": st.sampled_from(["celsius", "fahrenheit"]),
            "detailed": st.booleans(),
        },
    ),
    "search.web": st.fixed_dictionaries(
        {},
        optional={
            "query": text_values,
            "filters": st.dictionaries(st.text(max_size=5), json_values, max_size=3),
            "tags": st.lists(st.text(max_size=5), max_size=3),
            "limit": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-1000, 1000),
            "note": st.none() | text_values.filter(lambda s: s.strip().lower() not in ("null", "none")),
        },
    ),
    "ping": st.just({}),
}
content_text = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=1, max_size=30
).filter(lambda s: s.strip() == s and "<" not in s)


@st.composite
def tool_calls(draw, max_calls: int = 3) -> list[dict]:
    names = draw(st.lists(st.sampled_from(list(PARAMS)), min_size=1, max_size=max_calls))
    return [
        {"id": f"call{i:05d}", "type": "function", "function": {"name": n, "arguments": draw(ARGUMENTS[n])}}
        for i, n in enumerate(names)
    ]


def render(template: str, assistant: dict, **kwargs) -> tuple[str, str]:
    """(prompt, the assistant turn the template writes after it, without the end-of-turn token)."""
    tok = make_tokenizer(template, eos="<|im_end|>")
    user = {"role": "user", "content": "What is the weather?"}
    full = tok.apply_chat_template([user, assistant], tools=TOOLS, tokenize=False, **kwargs)
    prompt = tok.apply_chat_template(
        [user], tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n"), (prompt, full)
    return prompt, full[len(prompt) : -len("<|im_end|>\n")]


def stream(text: str, cuts: list[int], tools=PARAMS) -> list[StreamDelta]:
    parser = Qwen3CoderToolParser(tools)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    return [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]


def same(a: tuple, b: tuple) -> bool:
    return (a[0], [(c.name, c.arguments) for c in a[1]]) == (b[0], [(c.name, c.arguments) for c in b[1]])


@pytest.mark.parametrize("template", ["qwen35", "qwen3_coder"])
@SETTINGS
@given(data=st.data())
def test_template_written_calls_parse_back(template, data):
    calls = data.draw(tool_calls(), label="calls")
    content = data.draw(st.none() | content_text, label="content")
    reasoning = data.draw(st.none() | content_text, label="reasoning") if template == "qwen35" else None
    assistant = {"role": "assistant", "content": content or "", "tool_calls": calls}
    if reasoning:
        assistant["reasoning_content"] = reasoning
    prompt, out = render(template, assistant)
    if template == "qwen35":  # the prompt opened <think>; the output closes it (empty without reasoning)
        assert prompt.endswith("<think>\n") and prompt_reasoning_state(prompt) is True
        got_reasoning, out = Qwen3ReasoningParser.parse(out, True)
        assert got_reasoning == (reasoning or "")

    parsed = Qwen3CoderToolParser.parse(out, PARAMS)
    got_content, got = parsed
    assert got_content == (content or "")
    assert [c.name for c in got] == [c["function"]["name"] for c in calls]
    assert [json.loads(c.arguments) for c in got] == [c["function"]["arguments"] for c in calls]
    assert len({c.id for c in got}) == len(calls) and all(
        re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in got
    )

    cuts = data.draw(st.lists(st.integers(0, len(out)), max_size=40), label="cuts")
    deltas = stream(out, cuts)
    check_stream_shape(deltas, MARKERS)
    assert same(accumulate(deltas), parsed)


@pytest.mark.parametrize("template", ["qwen35", "qwen3_coder"])
def test_token_by_token_stream(template):
    """Deltas as a detokenizer makes them; a string value streams while it is written, not at the end."""
    args = [
        {"city": "Paris and its suburbs", "days": 3, "detailed": False},
        {"query": "weather\n</parameter> in Rome", "filters": {"a": [1, "x"]}, "limit": 2.5, "note": None},
    ]
    calls = [
        {"type": "function", "function": {"name": n, "arguments": a}}
        for n, a in zip(["get_weather", "search.web"], args)
    ]
    _, out = render(template, {"role": "assistant", "content": "Let me look.", "tool_calls": calls})
    if template == "qwen35":
        out = Qwen3ReasoningParser.parse(out, True)[1]
    tok = make_tokenizer(template)
    ids = tok.encode(out, add_special_tokens=False)
    parser, deltas, shown = Qwen3CoderToolParser(PARAMS), [], ""
    for k in range(1, len(ids) + 1):
        now = tok.decode(ids[:k], skip_special_tokens=False)
        if not now.endswith("\ufffd"):
            deltas.append(parser.feed(now[len(shown) :]))
            shown = now
    deltas.append(parser.finish())
    check_stream_shape(deltas, MARKERS)
    content, got = accumulate(deltas)
    assert content == "Let me look." and [json.loads(c.arguments) for c in got] == args
    pieces = [tc.arguments for d in deltas for tc in d.tool_calls if tc.index == 0 and tc.arguments]
    assert len(pieces) > 3 and "".join(pieces).startswith('{"city": "Paris')


def xml(name: str, *params: tuple[str, str], end: str = "</function>\n</tool_call>") -> str:
    body = "".join(f"<parameter={p}>\n{v}\n</parameter>\n" for p, v in params)
    return f"<tool_call>\n<function={name}>\n{body}{end}"


TYPED = {
    "f": {
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "i": {"type": "integer"},
            "n": {"type": "number"},
            "b": {"type": "boolean"},
            "o": {"type": "object"},
            "a": {"type": "array"},
            "ns": {"type": ["string", "null"]},
            "any": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
    }
}


@pytest.mark.parametrize(
    "name,text,expected",
    [
        # vLLM _convert_param_value: the schema's type converts the text; text that does not convert stays text
        ("s", "007", "007"),
        ("s", "null", "null"),  # "String type takes precedence: preserve the raw value"
        ("i", "5", 5),
        ("i", "5.5", "5.5"),  # "is not an integer ..., degenerating to string"
        ("i", "null", None),
        ("n", "5.0", 5),  # a whole float becomes an int
        ("n", "2.5", 2.5),
        ("n", "abc", "abc"),
        ("b", "TRUE", True),
        ("b", "yes", False),  # "is not a boolean ..., degenerating to false"
        ("o", '{"k": [1, 2]}', {"k": [1, 2]}),
        (
            "o",
            "{'k': 'v'}",
            {"k": "v"},
        ),  # ast.literal_eval fallback (templates that wrote dicts with |string)
        ("a", "[1, 'x']", [1, "x"]),
        ("ns", "None", None),  # a nullable string maps null / None to null
        ("any", "7", 7),  # anyOf: its first non-null type
        ("any", "None", None),
        ("undeclared", "5", "5"),  # a parameter the schema lacks: "directly returning the string value"
    ],
)
def test_values_typed_as_vllm_types_them(name, text, expected):
    _, calls = Qwen3CoderToolParser.parse(xml("f", (name, text)), TYPED)
    assert json.loads(calls[0].arguments) == {name: expected}


@pytest.mark.parametrize(
    "text,expected",
    [
        # one newline after the opening tag and one before the closing tag are the template's; others stay
        ("<tool_call>\n<function=f>\n<parameter=s>\n\n x \n\n</parameter>\n</function>\n</tool_call>", "\n x \n"),
        ("<tool_call><function=f><parameter=s>x</parameter></function></tool_call>", "x"),
        ("<tool_call>\n<function=f>\n<parameter=s>\na</parameter>b\n</parameter>\n</function>\n</tool_call>", "a</parameter>b"),
        # no </parameter>: </function> (followed by </tool_call>) ends the value; so does the end of the block
        ("<tool_call>\n<function=f>\n<parameter=s>\nx\n</function>\n</tool_call>", "x"),
        ("<tool_call>\n<function=f>\n<parameter=s>\nx\n</tool_call>", "x"),
    ],
)  # fmt: skip
def test_value_bounds(text, expected):
    content, calls = Qwen3CoderToolParser.parse(text, TYPED)
    assert content == "" and json.loads(calls[0].arguments) == {"s": expected}
    for seed in range(5):
        cuts = random.Random(seed).sample(range(len(text) + 1), 8)
        assert same(accumulate(stream(text, cuts, TYPED)), (content, calls))


def test_several_calls_and_text_around_them():
    """vLLM's extract_tool_calls: every <tool_call> block is a call and the text before the first is the
    content (here without the whitespace before the markup, as the other parsers here drop it); a missing
    </parameter> ends at the tool's next parameter (vLLM's regex: `(?=<parameter=)`)."""
    text = (
        "Checking both.\n\n"
        + xml("f", ("i", "1"), ("s", "a"))
        + "\n"
        + "<tool_call>\n<function=f>\n<parameter=s>\nno close\n<parameter=i>\n2\n</parameter>\n</function>\n"
        + "</tool_call>"
    )
    content, calls = Qwen3CoderToolParser.parse(text, TYPED)
    assert content == "Checking both."
    assert [json.loads(c.arguments) for c in calls] == [{"i": 1, "s": "a"}, {"s": "no close", "i": 2}]
    after = Qwen3CoderToolParser.parse(xml("f") + "\n\nDone.", TYPED)
    assert after[0] == "Done." and after[1][0].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot a function\n</tool_call>",
        "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",  # not among the tools
        "<tool_call>\n<function=bad name>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=s>\ncut off",  # cut short: no call in `parse`
        "<tool_call>\n<function=f",
        "<tool_call>",
        "<function=f>\n</function>",  # no <tool_call>
        "a <tool_cal>\n<function=f>\n</function>\n</tool_cal>",
    ],
)
def test_malformed_output_is_content(text):
    assert Qwen3CoderToolParser.parse(text, TYPED) == (text, [])
    for seed in range(5):
        cuts = random.Random(seed).sample(range(len(text) + 1), min(len(text), 6))
        deltas = stream(text, cuts, TYPED)
        check_stream_shape(deltas)
        content, calls = accumulate(deltas)
        if not calls:  # the stream commits to a call once its name is read; it then closes it at the end
            assert content == text
        else:
            assert json.loads(calls[0].arguments) == {"s": "cut off"}


fragments = st.sampled_from(
    [*MARKERS, "<function=f>", "<parameter=s>", "<parameter=i>", ">", "<", "/", "\n", " ", "x", "1", "é",
     "{", "}", '"', "\\", "null", "f"]
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(fragments, max_size=40), cuts=st.lists(st.integers(0, 200), max_size=10))
def test_any_text_never_raises(pieces, cuts):
    text = "".join(pieces)
    content, calls = Qwen3CoderToolParser.parse(text, TYPED)
    for c in calls:
        assert isinstance(json.loads(c.arguments), dict)
    deltas = stream(text, cuts, TYPED)
    check_stream_shape(deltas)
    for c in accumulate(deltas)[1]:  # streamed arguments are JSON even for a call the output cut short
        assert isinstance(json.loads(c.arguments), dict)


def test_param_kinds_beyond_vllm():
    """Schema shapes vLLM reads as strings, read by what they declare (qwen_xml.py's docstring)."""
    root = {"$defs": {"N": {"type": "integer"}}}
    assert param_kind({"$ref": "#/$defs/N"}, root) == ParamKind("integer", False)
    assert param_kind({"type": ["string", "null"]}) == ParamKind("string", True)
    assert param_kind({"enum": [1, 2]}) == ParamKind("any", False)
    assert convert(" true ", ParamKind("boolean", False)) is True
    assert convert("inf", ParamKind("number", False)) == "inf"  # not a JSON number: the text


# ---- forced tool calls: what the grammar allows is what the parser reads back

FORCED = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "code": {"type": "string", "minLength": 2, "maxLength": 3},
        },
        "required": ["city"],
    },
    "add": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -50, "maximum": 50},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
            "opts": {
                "type": "object",
                "properties": {"x": {"type": "boolean"}},
                "additionalProperties": False,
            },
            "r": {"type": ["boolean", "null"]},
        },
        "required": ["a", "b"],
    },
    "ping": None,
}
FORCED_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in FORCED.items()]


@pytest.fixture(scope="module")
def sample():
    tok = make_tokenizer(eos="<|im_end|>")
    compiler = GrammarCompiler(
        tok, vocab_size=len(tok) + 40, stop_token_ids=[tok.eos_token_id], max_whitespace=0
    )
    return RandomSampler(tok, compiler)


@pytest.mark.parametrize(
    "tool_choice,parallel",
    [("required", True), ("required", False), ({"type": "function", "function": {"name": "add"}}, True)],
)
def test_forced_tool_calls_parse_back(sample, tool_choice, parallel):
    spec = tool_call_grammar("qwen3_coder", FORCED_TOOLS, tool_choice, parallel_tool_calls=parallel)
    counts = set()
    for seed in range(8):
        text = sample(spec, seed)
        parsed = Qwen3CoderToolParser.parse(text, FORCED)
        content, calls = parsed
        assert content == "" and calls, text
        counts.add(len(calls))
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), FORCED[call.name] or {"type": "object"})
        if isinstance(tool_choice, dict):
            assert [c.name for c in calls] == ["add"]
        assert same(accumulate(stream(text, list(range(0, len(text), 5)), FORCED)), parsed)
    if not parallel or isinstance(tool_choice, dict):
        assert counts == {1}


def test_forced_grammar_accepts_the_templates_form_only():
    import xgrammar as xgr

    tools = [{"type": "function", "function": {"name": "f", "parameters": TYPED["f"]}}]
    tok = make_tokenizer(eos="<|im_end|>")
    compiled = GrammarCompiler(tok).compile(tool_call_grammar("qwen3_coder", tools, "required"))

    def accepts(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.is_completed()

    text = xml("f", ("s", "free\ntext"), ("i", "-3"), ("ns", "None"), ("any", "null"))
    assert accepts(text)
    assert json.loads(Qwen3CoderToolParser.parse(text, TYPED)[1][0].arguments) == {
        "s": "free\ntext", "i": -3, "ns": None, "any": None,
    }  # fmt: skip
    assert not accepts(xml("f", ("s", "a</parameter>b")))  # a value never writes a tag of the syntax
    assert not accepts(xml("f", ("i", "3.5")))  # not an integer
    assert not accepts(xml("f", ("i", "1"), ("s", "a")))  # the schema's order
    assert not accepts(xml("g", ("s", "a")))  # not a tool


def test_forced_calls_after_the_qwen35_reasoning_section(sample):
    """Qwen3.5 opens <think> in the prompt: the section, then the calls; the section never writes
    <tool_call> (the reasoning parser would end it there)."""
    spec = tool_call_grammar("qwen3_coder", FORCED_TOOLS, {"type": "function", "function": {"name": "add"}})
    spec = grammar_after_reasoning(spec, Qwen3ReasoningParser, True)
    assert '"excludes": ["</think>", "<tool_call>"]' in spec.text
    for seed in range(4):
        text = sample(spec, seed, prefer=("</think>",))
        _, content = Qwen3ReasoningParser.parse(text, True)
        got, calls = get_tool_call_parser("qwen3_coder").parse(content, FORCED)
        assert got == "" and [c.name for c in calls] == ["add"], text
        jsonschema.validate(json.loads(calls[0].arguments), FORCED["add"])


def test_parameter_names_the_syntax_cannot_write():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a>b": {}}}}}]
    with pytest.raises(ValueError, match="cannot be written"):
        tool_call_grammar("qwen3_coder", tools, "required")
