"""Reasoning sections against what Qwen3's, Qwen3.5's and DeepSeek-R1's templates write: split off whole and
streamed, the prompt deciding where the output starts, the tool parser reading what follows, the grammar after
it; a Qwen3.5 tool call opened inside the section ends it, as in vLLM's Qwen3ReasoningParser."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longserve.structured.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningEnd,
    get_reasoning_parser,
    grammar_after_reasoning,
    prompt_reasoning_state,
    reasoning_end_token_ids,
)
from longserve.structured.spec import GrammarSpec
from longserve.structured.tool_calls import accumulate
from longserve.structured.tool_parsers import HermesToolParser
from tests.fixtures.tool_tokenizer import make_tokenizer

words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=20)
paragraphs = (
    st.lists(words, min_size=1, max_size=3)
    .map("\n".join)
    .filter(lambda s: s.strip() == s and s and "<" not in s)
)
USER = {"role": "user", "content": "Why is the sky blue?"}


def render(template: str, assistant: dict, **kwargs) -> tuple[str, str]:
    """(prompt, output) as the template writes them, the end-of-turn token cut off."""
    tok = make_tokenizer(template)
    full = tok.apply_chat_template([USER, assistant], tokenize=False, **kwargs)
    prompt = tok.apply_chat_template([USER], tokenize=False, add_generation_prompt=True, **kwargs)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n"), (prompt, full)
    return prompt, full[len(prompt) : -len("<|im_end|>\n")]


def run(parser, text: str, cuts: list[int]) -> tuple[str, str]:
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    pieces = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.finish()]
    return "".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)


@settings(max_examples=30, deadline=None)
@given(reasoning=paragraphs, content=paragraphs, cuts=st.lists(st.integers(0, 200), max_size=20))
def test_qwen3_template_round_trip(reasoning, content, cuts):
    prompt, out = render("qwen3", {"role": "assistant", "content": content, "reasoning_content": reasoning})
    assert out.startswith("<think>\n")  # this template lets the model open the section itself
    parser = Qwen3ReasoningParser.for_prompt(prompt)
    assert Qwen3ReasoningParser.parse(out) == (reasoning, content)
    assert run(parser, out, cuts) == (reasoning, content)


@settings(max_examples=20, deadline=None)
@given(reasoning=paragraphs, content=paragraphs, cuts=st.lists(st.integers(0, 200), max_size=20))
def test_deepseek_r1_prompt_opens_the_section(reasoning, content, cuts):
    # The template drops reasoning from history, so it only writes the prompt; the output is the model's.
    prompt = make_tokenizer("deepseek_r1_distill").apply_chat_template(
        [USER], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<｜Assistant｜><think>\n") and prompt_reasoning_state(prompt) is True
    out = f"{reasoning}\n</think>\n\n{content}"
    assert run(DeepSeekR1ReasoningParser.for_prompt(prompt), out, cuts) == (reasoning, content)
    assert run(Qwen3ReasoningParser.for_prompt(prompt), out, cuts) == (reasoning, content)
    # some outputs repeat the opening tag; the first R1 had none in the prompt: both read the same
    assert DeepSeekR1ReasoningParser.parse(f"<think>\n{out}") == (reasoning, content)
    assert DeepSeekR1ReasoningParser.parse(out) == (reasoning, content)


def test_enable_thinking_false_means_no_section():
    prompt, out = render("qwen3", {"role": "assistant", "content": "Rayleigh."}, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and prompt_reasoning_state(prompt) is False
    parser = Qwen3ReasoningParser.for_prompt(prompt)
    assert not parser.in_reasoning
    text = "A <think> tag in the answer</think> stays."
    assert run(parser, text, [3, 9]) == ("", text)


def test_qwen3_without_a_section_is_all_content():
    assert Qwen3ReasoningParser.parse("  Plain answer.") == (None, "  Plain answer.")
    parser = Qwen3ReasoningParser()
    assert parser.feed("\n<thi").content == ""  # may still open the section
    assert parser.feed("s is not it").content == "\n<this is not it"


def test_cut_off_inside_the_section_is_all_reasoning():
    assert DeepSeekR1ReasoningParser.parse("still thinking\n") == ("still thinking", "")
    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>abc</thi").reasoning == "abc"  # the partial end tag is held back
    assert parser.in_reasoning
    delta = parser.feed("nk>\n\nanswer")
    assert (delta.reasoning, delta.content) == ("", "answer") and not parser.in_reasoning


@settings(max_examples=20, deadline=None)
@given(reasoning=paragraphs, cuts=st.lists(st.integers(0, 300), max_size=25))
def test_tool_calls_after_reasoning(reasoning, cuts):
    calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assistant = {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": calls}
    prompt, out = render("qwen3", assistant, tools=tools)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(out)), len(out)]
    reasoner, tool_parser = Qwen3ReasoningParser.for_prompt(prompt), HermesToolParser(["get_weather"])
    got_reasoning, deltas = "", []
    for piece in [reasoner.feed(out[a:b]) for a, b in zip(bounds, bounds[1:])] + [reasoner.finish()]:
        got_reasoning += piece.reasoning
        deltas.append(tool_parser.feed(piece.content))
    deltas.append(tool_parser.finish())
    content, got = accumulate(deltas)
    assert (got_reasoning, content) == (reasoning, "")
    assert [json.loads(c.arguments)["city"] for c in got] == ["Paris", "Oslo"]


def test_end_detector_starts_the_grammar_after_the_tag():
    tok = make_tokenizer("qwen3")
    end_ids = reasoning_end_token_ids(tok)
    assert end_ids == [tok.convert_tokens_to_ids("</think>")]
    ids = tok.encode("<think>\nhm, </think> not yet\n</think>\n\n{}", add_special_tokens=False)
    detector = ReasoningEnd(end_ids)
    flags = [detector.accept(t) for t in ids]
    first = flags.index(True)
    assert ids[first] == end_ids[0] and all(flags[first:]) and not any(flags[:first])
    assert ReasoningEnd(end_ids, in_reasoning=False).done


def test_end_detector_matches_a_multi_token_tag():
    tok = make_tokenizer()
    end_ids = reasoning_end_token_ids(tok, "</reason>")
    assert len(end_ids) > 1
    detector = ReasoningEnd(end_ids)
    assert not any(detector.accept(t) for t in end_ids[:-1]) and detector.accept(end_ids[-1])


@pytest.mark.parametrize(
    "parser,state,text",
    [
        (Qwen3ReasoningParser, None, '<think>\nsure?\n</think>\n\n{"a": 1}'),
        (Qwen3ReasoningParser, None, '{"a": 1}'),
        (DeepSeekR1ReasoningParser, True, 'yes\n</think>\n\n{"a": 1}'),
        (Qwen3ReasoningParser, False, '{"a": 1}'),
    ],
)
def test_grammar_after_reasoning_accepts_the_section_then_the_schema(parser, state, text):
    import xgrammar as xgr

    from longserve.structured.grammar import GrammarCompiler

    tok = make_tokenizer("qwen3")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    spec = grammar_after_reasoning(GrammarSpec.json_schema(schema), parser, state)
    compiled = GrammarCompiler(tok).compile(spec)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string(text) and matcher.is_completed()
    wrong = xgr.GrammarMatcher(compiled)  # the schema still binds after the section
    assert not (wrong.accept_string(text.replace("1", '"1"')) and wrong.is_completed())
    assert json.loads(parser.parse(text, state)[1]) == {"a": 1}


def test_registry():
    assert {"qwen3", "deepseek_r1", "deepseek-r1", "qwen3-thinking"} <= set(REASONING_PARSERS)
    assert get_reasoning_parser("qwen3-thinking")().in_reasoning
    with pytest.raises(ValueError, match="choose one of"):
        get_reasoning_parser("gpt-oss")


@settings(max_examples=20, deadline=None)
@given(reasoning=paragraphs, content=paragraphs, cuts=st.lists(st.integers(0, 200), max_size=20))
def test_qwen35_template_opens_the_section_in_the_prompt(reasoning, content, cuts):
    prompt, out = render("qwen35", {"role": "assistant", "content": content, "reasoning_content": reasoning})
    assert prompt.endswith("<|im_start|>assistant\n<think>\n") and not out.startswith("<think>")
    parser = Qwen3ReasoningParser.for_prompt(prompt)
    assert parser.in_reasoning
    assert run(parser, out, cuts) == (reasoning, content)
    assert Qwen3ReasoningParser.parse(out, prompt_reasoning_state(prompt)) == (reasoning, content)


def test_qwen35_enable_thinking_false_closes_the_section_in_the_prompt():
    prompt, out = render("qwen35", {"role": "assistant", "content": "Rayleigh."}, enable_thinking=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and prompt_reasoning_state(prompt) is False
    parser = Qwen3ReasoningParser.for_prompt(prompt)
    assert not parser.in_reasoning
    assert run(parser, "Rayleigh scattering.", [4]) == ("", "Rayleigh scattering.")


CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize(
    "text,expected",
    [
        # vLLM's Qwen3ReasoningParser.extract_reasoning (vllm/reasoning/qwen3_reasoning_parser.py at
        # 00a4c6a1d828): a <tool_call> that <function= follows (its _RE_FUNCTION_OPEN) ends the section
        (f"I should call it.\n\n{CALL}", ("I should call it.", CALL)),
        ("Thinking.\n<tool_call>  <function=f>", ("Thinking.", "<tool_call>  <function=f>")),
        # ... a bare mention does not; nor does one the output ends on
        (f"Write <tool_call> then JSON.\n</think>\n\n{CALL}", ("Write <tool_call> then JSON.", CALL)),
        ("Cut at <tool_call>", ("Cut at <tool_call>", "")),
        ("Cut at <tool_call>\n<func", ("Cut at <tool_call>\n<func", "")),
        ("<tool_call>\n<functional> is no call", ("<tool_call>\n<functional> is no call", "")),
    ],
)
def test_a_tool_call_ends_the_qwen3_section(text, expected):
    assert Qwen3ReasoningParser.parse(text, True) == expected
    for cuts in ([], list(range(len(text))), [5, 17, 30, 31, 44]):
        assert run(Qwen3ReasoningParser(True), text, cuts) == expected
    # DeepSeek-R1's parser has no such end: the call is reasoning until </think>
    assert DeepSeekR1ReasoningParser.parse(f"I should call it.\n\n{CALL}")[1] == ""


def test_grammar_after_the_qwen3_section_keeps_tool_calls_out_of_it():
    spec = grammar_after_reasoning(GrammarSpec.json_schema({"type": "object"}), Qwen3ReasoningParser, True)
    assert json.loads(spec.text)["format"]["elements"][0]["elements"][0]["content"]["excludes"] == [
        "</think>",
        "<tool_call>",
    ]
    spec = grammar_after_reasoning(
        GrammarSpec.json_schema({"type": "object"}), DeepSeekR1ReasoningParser, True
    )
    assert json.loads(spec.text)["format"]["elements"][0]["elements"][0]["content"]["excludes"] == [
        "</think>"
    ]
