"""Tool calling and reasoning through real servers of tiny random-weight models that carry real chat
templates (Qwen2.5 with `--tool-call-parser hermes --enable-auto-tool-choice`, Llama 3.1 with
`--tool-call-parser llama3_json` and no auto choice, a DeepSeek-R1 distill with `--reasoning-parser
deepseek_r1`, Qwen3.5's template with its vLLM launch line `--tool-call-parser qwen3_coder
--reasoning-parser qwen3 --enable-auto-tool-choice`), driven by the real clients: the openai client's tool
loop (call, tool result, final answer; streamed and not), LangChain's bind_tools / with_structured_output,
LiteLLM. `tool_choice` "required" or named is forced by the grammar, so random weights always yield calls
that parse and validate."""

from __future__ import annotations

import json
import os

import httpx
import jsonschema
import pytest

from tests.fixtures.tool_servers import tool_servers

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
    for n, s in SCHEMAS.items()
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED_TEXT = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CHAT = "/v1/chat/completions"

SERVERS = {  # name -> (checkpoint style, flags)
    "qwen25": ("qwen25", ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]),
    "llama31": ("llama31", ["--tool-call-parser", "llama3_json"]),
    "r1": (
        "deepseek_r1",
        ["--reasoning-parser", "deepseek_r1", "--tool-call-parser", "qwen25", "--enable-auto-tool-choice"],
    ),
    "qwen35": (
        "qwen35",
        ["--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"],
    ),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The servers, started side by side (their startups overlap)."""
    yield from tool_servers(tmp_path_factory, SERVERS)


@pytest.fixture(scope="module")
def qwen(servers):
    return openai.OpenAI(base_url=servers["qwen25"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def check_calls(calls, names=None) -> None:
    """Each call names a tool and its arguments validate against that tool's schema; ids are unique."""
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    assert len({c["id"] for c in calls}) == len(calls)
    if names is not None:
        assert [c["function"]["name"] for c in calls] == names


def accumulate(chunks) -> tuple[str, list[dict], str | None, str]:
    """What a client rebuilds from a chat stream: content, tool calls, finish reason, reasoning."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                call = calls.setdefault(
                    tc.index, {"id": tc.id, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                assert tc.index == len(calls) - 1 or tc.id is None  # a new call starts with its id
                call["function"]["name"] += tc.function.name or ""
                call["function"]["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, reasoning


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_tool_loop(qwen, servers, stream):
    """Call (forced), tool result, final answer (auto: the model may answer or call again)."""
    messages = list(USER)
    kw = dict(model="qwen25", tools=TOOLS, max_tokens=300, temperature=1.0, seed=11)
    if stream:
        content, calls, finish, _ = accumulate(
            qwen.chat.completions.create(messages=messages, tool_choice="required", stream=True, **kw)
        )
    else:
        message = qwen.chat.completions.create(messages=messages, tool_choice="required", **kw).choices[0]
        finish, content = message.finish_reason, message.message.content
        calls = [c.model_dump() for c in message.message.tool_calls]
    assert finish == "tool_calls" and not content
    check_calls(calls)
    messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    for call in calls:
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"temp_c": 21})})
    final = qwen.chat.completions.create(
        messages=messages, max_tokens=20, **{k: v for k, v in kw.items() if k != "max_tokens"}
    )
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content
    assert final.usage.prompt_tokens > 150  # the conversation with the tools, the call and the result
    # the template got the call's arguments as an object and the result under <tool_response>
    ids = httpx.post(servers["qwen25"] + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(servers["qwen25"] + "/detokenize", json={"tokens": ids}).json()["text"]
    args = json.loads(calls[0]["function"]["arguments"])
    written = json.dumps(args, ensure_ascii=False)  # as the template's tojson writes a dict
    assert (
        f'<tool_call>\n{{"name": "{calls[0]["function"]["name"]}", "arguments": {written}}}\n</tool_call>'
        in text
    )
    assert '<tool_response>\n{"temp_c": 21}\n</tool_response>' in text


def test_required_always_yields_calls_that_parse(qwen):
    """Random weights, temperature 1, many samples: every one is exactly one valid call (no parallel calls)."""
    r = qwen.chat.completions.create(
        model="qwen25", messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=400, temperature=1.0, seed=5, n=6,
    )  # fmt: skip
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        check_calls([c.model_dump() for c in choice.message.tool_calls])
        assert len(choice.message.tool_calls) == 1


def test_named_tool_choice(qwen):
    for stream in (False, True):
        kw = dict(model="qwen25", messages=USER, tools=TOOLS, max_tokens=300, temperature=1.0, seed=2)
        choice = {"type": "function", "function": {"name": "add"}}
        if stream:
            _, calls, finish, _ = accumulate(
                qwen.chat.completions.create(tool_choice=choice, stream=True, **kw)
            )
        else:
            r = qwen.chat.completions.create(tool_choice=choice, **kw).choices[0]
            calls, finish = [c.model_dump() for c in r.message.tool_calls], r.finish_reason
        assert finish == "tool_calls"
        check_calls(calls, ["add"])


def test_auto_reads_the_calls_the_model_writes(qwen):
    """tool_choice auto: the hermes parser reads calls out of whatever the model wrote (here a guided choice
    makes the random model write one after some text); "none" leaves the text as it is."""
    kw = dict(
        model="qwen25",
        messages=USER,
        tools=TOOLS,
        max_tokens=100,
        extra_body={"guided_choice": [FORCED_TEXT]},
    )
    r = qwen.chat.completions.create(**kw).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content == "Sure."
    check_calls([c.model_dump() for c in r.message.tool_calls], ["get_weather"])
    assert json.loads(r.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    content, calls, finish, _ = accumulate(qwen.chat.completions.create(stream=True, **kw))
    assert (content, finish) == ("Sure.", "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    r = qwen.chat.completions.create(tool_choice="none", **kw).choices[0]
    assert r.message.content == FORCED_TEXT and not r.message.tool_calls and r.finish_reason == "stop"


@pytest.mark.parametrize(
    "body,status,named",
    [
        ({"tool_choice": "required"}, 400, "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            400,
            "not among",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, 400, "tool_choice must be"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, 400, "guided_regex"),
        (
            {
                "messages": USER
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "x", "type": "function", "function": {"name": "add", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            400,
            "messages.1.tool_calls",
        ),
    ],
)
def test_bad_tool_requests(servers, body, status, named):
    r = httpx.post(servers["qwen25"] + CHAT, json={"messages": USER, **body})
    assert r.status_code == status, r.text
    assert named in r.json()["error"]["message"] + str(r.json()["error"]["param"])


def test_auto_needs_the_flag_as_in_vllm(servers):
    """The Llama server has a parser but no --enable-auto-tool-choice: tools with tool_choice auto (the
    default with tools) are refused with vLLM's words; required works, in Llama 3's JSON syntax."""
    url = servers["llama31"]
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        r = httpx.post(url + CHAT, json={"messages": USER, **body})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(
        model="llama31", tools=TOOLS, max_tokens=300, temperature=1.0, seed=4, parallel_tool_calls=False
    )
    r = client.chat.completions.create(messages=USER, tool_choice="required", **kw).choices[0]
    assert r.finish_reason == "tool_calls"
    calls = [c.model_dump() for c in r.message.tool_calls]
    check_calls(calls)
    # the result goes back through Llama 3.1's template (ipython turn); tool_choice none: a plain answer
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": calls}]
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp_c": 21}'})
    final = client.chat.completions.create(messages=messages, tool_choice="none", **{**kw, "max_tokens": 10})
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_reasoning_then_constrained_output(servers):
    """DeepSeek-R1's template opens <think> in the prompt: the output's reasoning (ended early by a logit
    bias on </think>) becomes reasoning_content, and the JSON schema holds for what follows it, streamed
    the same as whole."""
    url = servers["r1"]
    from transformers import AutoTokenizer

    end = AutoTokenizer.from_pretrained(
        httpx.get(url + "/model_info").json()["model_path"]
    ).convert_tokens_to_ids("</think>")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(
        model="r1", messages=USER, max_tokens=400, temperature=1.0, seed=0, logit_bias={str(end): 3},
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}},
    )  # fmt: skip
    r = client.chat.completions.create(**kw).choices[0]
    reasoning = r.message.model_extra["reasoning_content"]
    assert r.finish_reason == "stop" and reasoning and "</think>" not in reasoning + r.message.content
    jsonschema.validate(json.loads(r.message.content), schema)
    content, _, finish, streamed_reasoning = accumulate(client.chat.completions.create(stream=True, **kw))
    assert (content, streamed_reasoning, finish) == (r.message.content, reasoning, "stop")
    # a forced call after the reasoning section
    r = client.chat.completions.create(
        **{**kw, "response_format": None}, tools=TOOLS, tool_choice="required"
    ).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.model_extra["reasoning_content"]
    check_calls([c.model_dump() for c in r.message.tool_calls])


QWEN35_CALL = (  # a Qwen3.5 reply as its template writes one: text, then the call in XML
    "Sure.\n\n<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n4\n</parameter>\n"
    "</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def qwen35(servers):
    url = servers["qwen35"]
    from transformers import AutoTokenizer

    path = httpx.get(url + "/model_info").json()["model_path"]
    end = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids("</think>")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client, {str(end): 3}  # a logit bias that ends the random model's reasoning soon


def reply(client, stream: bool, **kw) -> tuple[str | None, list[dict], str | None, str | None]:
    """(content, tool calls, finish reason, reasoning) of one chat completion, streamed or not."""
    if stream:
        content, calls, finish, reasoning = accumulate(client.chat.completions.create(stream=True, **kw))
        return content, calls, finish, reasoning
    choice = client.chat.completions.create(**kw).choices[0]
    calls = [c.model_dump() for c in choice.message.tool_calls or []]
    return (
        choice.message.content,
        calls,
        choice.finish_reason,
        choice.message.model_extra["reasoning_content"],
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_qwen35_forced_calls_after_reasoning(qwen35, stream):
    """Qwen3.5's template opens <think> in the prompt: the reply's reasoning goes to reasoning_content, then
    tool_choice required / named forces the calls in the XML syntax, their values typed by the schemas (with
    enable_thinking false the prompt closes the section and the calls come at once)."""
    client, end_think = qwen35
    kw = dict(model="qwen35", messages=USER, tools=TOOLS, max_tokens=400, temperature=1.0, seed=7)
    for choice, extra in (
        ("required", {"logit_bias": end_think}),
        ({"type": "function", "function": {"name": "add"}}, {"logit_bias": end_think}),
        ("required", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}),
    ):
        content, calls, finish, reasoning = reply(client, stream, tool_choice=choice, **kw, **extra)
        assert finish == "tool_calls" and not content
        assert bool(reasoning) == ("logit_bias" in extra) and "</think>" not in (reasoning or "")
        check_calls(calls, ["add"] if isinstance(choice, dict) else None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_qwen35_auto_reads_xml_calls_then_the_tool_loop(qwen35, servers, stream):
    """tool_choice auto: the qwen3_coder parser reads the call a guided choice makes the random model write
    (after a reasoning section when thinking is on), `a` and `b` as integers; the call and its result go back
    through Qwen3.5's template as it writes them."""
    client, end_think = qwen35
    kw = dict(model="qwen35", messages=USER, tools=TOOLS, max_tokens=400, temperature=1.0, seed=3)
    for thinking in (False, True):
        body = {"guided_choice": [QWEN35_CALL], "chat_template_kwargs": {"enable_thinking": thinking}}
        content, calls, finish, reasoning = reply(
            client, stream, extra_body=body, **kw, **({"logit_bias": end_think} if thinking else {})
        )
        # (the grammar lets the random model write any whitespace after </think>: content's, as in vLLM)
        assert (content.strip(), finish, bool(reasoning)) == ("Sure.", "tool_calls", thinking)
        assert content == "Sure." or thinking
        check_calls(calls, ["add"])
        assert json.loads(calls[0]["function"]["arguments"]) == {"a": 3, "b": 4}
    messages = [*USER, {"role": "assistant", "content": "Sure.", "tool_calls": calls}]
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"sum": 7}'})
    final = client.chat.completions.create(
        messages=messages, tool_choice="none", extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **{k: v for k, v in kw.items() if k not in ("messages", "max_tokens")}, max_tokens=10,
    )  # fmt: skip
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    ids = httpx.post(servers["qwen35"] + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(servers["qwen35"] + "/detokenize", json={"tokens": ids}).json()["text"]
    assert QWEN35_CALL in text and '<tool_response>\n{"sum": 7}\n</tool_response>' in text


def test_langchain_bind_tools_and_structured_output(servers):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel, Field

    class GetWeather(BaseModel):
        """Get the weather of a city."""

        city: str = Field(max_length=10)

    llm = langchain_openai.ChatOpenAI(
        model="qwen25",
        base_url=servers["qwen25"] + "/v1",
        api_key="unused",
        max_tokens=300,
        temperature=1.0,
        seed=3,
        max_retries=0,
    )
    messages = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([GetWeather], tool_choice="any").invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "GetWeather"
    assert len(ai.tool_calls[0]["args"]["city"]) <= 10
    messages += [ai, ToolMessage('{"temp_c": 21}', tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([GetWeather]).invoke(messages)  # auto: the server has --enable-auto-tool-choice
    assert isinstance(final.content, str)

    class Answer(BaseModel):
        """An answer."""

        ok: bool
        n: int = Field(ge=0, le=9)

    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Answer, method=method).invoke("Answer me.")
        assert isinstance(got, Answer) and 0 <= got.n <= 9, method


@pytest.mark.filterwarnings("ignore::UserWarning")  # litellm's own pydantic models warn on import
def test_litellm_tool_calls(servers):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the cost map
    litellm = pytest.importorskip("litellm")
    kw = dict(
        model="openai/qwen25", api_base=servers["qwen25"] + "/v1", api_key="unused", messages=USER, tools=TOOLS,
        tool_choice="required", max_tokens=300, temperature=1.0, seed=9,
    )  # fmt: skip
    r = litellm.completion(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls([c.model_dump() for c in r.choices[0].message.tool_calls])
    chunks = list(litellm.completion(stream=True, **kw))
    rebuilt = litellm.stream_chunk_builder(chunks).choices[0].message.tool_calls
    check_calls([c.model_dump() for c in rebuilt])
