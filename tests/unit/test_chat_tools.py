"""The server's reading of chat replies: tools and tool_choice checked as vLLM checks them, Mistral's
9-character call ids for its templates, forced calls without a parser in vLLM's JSON form (whole and
streamed alike), parallel_tool_calls false keeping one call, reasoning split before the calls; Qwen3.5's XML
calls typed by the request's tool schemas, and a call opened inside its reasoning section ending it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from longserve.server.chat_tools import ChatOutput, ChatTools, template_tool_calls
from longserve.server.config import ServerConfig
from longserve.server.errors import APIError
from longserve.structured.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from tests.fixtures.tool_tokenizer import make_tokenizer, read_template

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("f", "g")]
HERMES = ServerConfig(tool_call_parser="hermes", enable_auto_tool_choice=True)
TWO_CALLS = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'


def request(**kw):
    return SimpleNamespace(**{"tools": TOOLS, "tool_choice": None, "parallel_tool_calls": None, **kw})


def streamed(output: ChatOutput, text: str, step: int = 3) -> tuple[str, list[dict], str]:
    s = output.stream()
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    deltas = [s.delta(p, final=False) for p in pieces[:-1]] + [s.delta(pieces[-1], final=True)]
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc["function"].get("name") or ""
            call["arguments"] += tc["function"]["arguments"]
    content = "".join(d.get("content", "") for d in deltas)
    return content, [calls[i] for i in sorted(calls)], "".join(d.get("reasoning_content", "") for d in deltas)


def test_auto_and_parallel_false():
    for parallel, names in ((None, ["f", "g"]), (False, ["f"])):
        output = ChatOutput(ChatTools.from_request(request(parallel_tool_calls=parallel), HERMES))
        message, called = output.message("Hi." + TWO_CALLS)
        assert called and message["content"] == "Hi."
        assert [c["function"]["name"] for c in message["tool_calls"]] == names
        content, calls, _ = streamed(output, "Hi." + TWO_CALLS)
        assert content == "Hi." and [c["name"] for c in calls] == names


def test_forced_calls_without_a_parser_are_vllms_json():
    required = ChatTools.from_request(request(tool_choice="required"), ServerConfig())
    assert json.loads(required.grammar(None).text)["type"] == "array"
    text = '[{"name": "g", "parameters": {"x": [1, 2]}}, {"name": "f", "parameters": {}}]'
    message, called = ChatOutput(required).message(text)
    assert called and message["content"] is None
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ] == [
        ("g", {"x": [1, 2]}),
        ("f", {}),
    ]
    content, calls, _ = streamed(ChatOutput(required), text)
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("g", {"x": [1, 2]}),
        ("f", {}),
    ]
    named = ChatTools.from_request(
        request(tool_choice={"type": "function", "function": {"name": "g"}}), ServerConfig()
    )
    message, _ = ChatOutput(named).message(' {"x": 1}')
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("g", '{"x": 1}')
    ]
    cut, called = ChatOutput(named).message('{"x": ')  # cut short by max_tokens: the text, no call
    assert not called and cut["content"] == '{"x": '


def test_reasoning_is_split_before_the_calls():
    output = ChatOutput(ChatTools.from_request(request(), HERMES), DeepSeekR1ReasoningParser, True)
    text = "Let me think.\n</think>\n\n" + TWO_CALLS
    message, called = output.message(text)
    assert called and message["reasoning_content"] == "Let me think." and message["content"] is None
    content, calls, reasoning = streamed(output, text, step=2)
    assert (content, reasoning, [c["name"] for c in calls]) == ("", "Let me think.", ["f", "g"])


@pytest.mark.parametrize(
    "kw,config,match",
    [
        ({}, ServerConfig(tool_call_parser="hermes"), "--enable-auto-tool-choice"),
        ({"tool_choice": "auto"}, ServerConfig(), "--enable-auto-tool-choice"),
        ({"tools": None, "tool_choice": "required"}, HERMES, "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "h"}}}, HERMES, "not among"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            HERMES,
            "tools: a tool's function name",
        ),
    ],
)
def test_refusals(kw, config, match):
    with pytest.raises(APIError, match=match):
        ChatTools.from_request(request(**kw), config)


def test_mistral_templates_get_9_character_ids():
    tok = make_tokenizer("mistral_small32", eos="</s>")
    call = {
        "id": "call_0123456789abcdef01234567",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": template_tool_calls([call], "messages.1.tool_calls"),
        },
        {"role": "tool", "tool_call_id": call["id"], "content": "42"},
    ]
    tools = ChatTools.from_request(request(), HERMES)
    fixed = tools.template_messages(messages, read_template("mistral_small32"))
    text = tok.apply_chat_template(fixed, tools=TOOLS, tokenize=False)
    new_id = fixed[1]["tool_calls"][0]["id"]
    assert new_id == "f01234567" == fixed[2]["tool_call_id"]  # the last 9 alphanumerics of the OpenAI id
    assert f"[CALL_ID]{new_id}[ARGS]" in text and f"[TOOL_RESULTS]{new_id}" in text
    assert fixed[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}  # a dict, as templates write it


QWEN35 = ServerConfig(tool_call_parser="qwen3_coder", reasoning_parser="qwen3", enable_auto_tool_choice=True)
TYPED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "say", "parameters": {"properties": {"text": {"type": "string"}}}},
    },
]
XML_CALLS = (
    "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n0.5\n</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=say>\n<parameter=text>\n2\n</parameter>\n</function>\n"
    "</tool_call>"
)


def test_qwen35_xml_calls_typed_by_the_request_tools():
    """The request's schemas type the values: 2 is an integer for `add`, the text "2" for `say`."""
    tools = ChatTools.from_request(request(tools=TYPED_TOOLS), QWEN35)
    expected = [("add", {"a": 2, "b": 0.5}), ("say", {"text": "2"})]
    for text, reasoning, content in (
        ("Let me think.\n</think>\n\nOn it.\n\n" + XML_CALLS, "Let me think.", "On it."),
        ("Let me think.\n\n" + XML_CALLS, "Let me think.", None),  # no </think>: the call ends the section
        ("A <tool_call> mention.\n</think>\n\nOn it.\n\n" + XML_CALLS, "A <tool_call> mention.", "On it."),
    ):
        output = ChatOutput(tools, Qwen3ReasoningParser, True)  # Qwen3.5's prompt opened <think>
        message, called = output.message(text)
        assert called and (message["reasoning_content"], message["content"]) == (reasoning, content)
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        assert got == expected
        for step in (1, 4):
            got_content, calls, got_reasoning = streamed(output, text, step=step)
            assert (got_reasoning, got_content) == (reasoning, content or "")
            assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected


def test_qwen35_forced_calls_use_the_xml_syntax():
    tools = ChatTools.from_request(request(tools=TYPED_TOOLS, tool_choice="required"), QWEN35)
    spec = ChatOutput(tools, Qwen3ReasoningParser, True).constrain(tools.grammar(read_template("qwen35")))
    assert "<function=add>\\n" in spec.text and '"<parameter=a>\\n"' in spec.text
