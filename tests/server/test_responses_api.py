"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) through real servers of tiny
random-weight models with real chat templates (Qwen2.5 with the hermes tool parser; a DeepSeek-R1 distill with
the reasoning parser), driven by the openai client (its typed responses, its stream accumulator, which checks
every event's item identity, and its structured-output parsing), the OpenAI Agents SDK (an agent with a
function tool and an output type, plain and streamed) and LangChain's ChatOpenAI on the Responses API. Greedy replies equal the chat route's for the same
conversation; previous_response_id equals sending the history; the pool keeps no page after them."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from tests.fixtures.tool_servers import tool_servers

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}}]  # fmt: skip
SERVERS = {
    "qwen25": ("qwen25", ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]),
    "r1": ("deepseek_r1", ["--reasoning-parser", "deepseek_r1"]),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    yield from tool_servers(tmp_path_factory, SERVERS)


@pytest.fixture(scope="module")
def qwen(servers):
    return openai.OpenAI(base_url=servers["qwen25"] + "/v1", api_key="unused", max_retries=0, timeout=120)


def without_ids(items) -> list[dict]:
    """Output items as JSON, their generated ids dropped (a call's call_id too: each response draws its own)."""
    out = []
    for item in items:
        d = item.model_dump(exclude_none=True)
        d.pop("id", None)
        d.pop("call_id", None)
        out.append(d)
    return out


def test_text_equals_the_chat_route_plain_and_streamed(qwen):
    """instructions + input give the chat route's greedy reply to system + user; cut at max_output_tokens the
    response is incomplete; the stream's events come in order and build the same output."""
    kw = dict(
        model="qwen25", instructions="Be brief.", input="Hello there", max_output_tokens=12, temperature=0
    )
    r = qwen.responses.create(**kw)
    chat = qwen.chat.completions.create(
        model="qwen25",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.instructions == "Be brief."
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == "incomplete"
    events = list(qwen.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    final = events[-1].response
    assert final.id == events[0].response.id and without_ids(final.output) == without_ids(r.output)


def test_logprobs_as_the_chat_routes(qwen):
    """include message.output_text.logprobs with top_logprobs: the chat route's logprobs on the output text,
    plain and on the stream's deltas."""
    kw = dict(model="qwen25", input="Hello", max_output_tokens=5, temperature=0)
    r = qwen.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, **kw)
    chat = qwen.chat.completions.create(
        model="qwen25",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    # (the second request finds the prompt cached: its logprobs may differ in the last float32 bits)
    assert [(x.token, [t.token for t in x.top_logprobs]) for x in got] == [
        (x.token, [t.token for t in x.top_logprobs]) for x in want
    ]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got, want))
    events = list(
        qwen.responses.create(include=["message.output_text.logprobs"], top_logprobs=2, stream=True, **kw)
    )
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [x.token for x in want] and len(want) == 5


def test_structured_output_through_the_client_parser(qwen):
    """text.format json_schema constrains the reply; the client's own parse (responses.parse and the stream
    helper's output_parsed) reads it as the pydantic type; the stream helper's accumulated final response
    equals the plain one."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=8)
        sunny: bool

    kw = dict(model="qwen25", input="Pick a city", max_output_tokens=200, temperature=0)
    parsed = qwen.responses.parse(text_format=City, **kw)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, City)
    with qwen.responses.stream(text_format=City, **kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed
    assert without_ids(final.output) == without_ids(parsed.output)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_loop_and_previous_response_id(qwen, stream):
    """tool_choice "required": function_call items whose arguments validate, as the chat route's calls; the
    tool's result sent back two ways, as the whole history or as previous_response_id: the same prompt and the
    same greedy answer."""
    kw = dict(model="qwen25", input="Weather in Paris?", tools=TOOLS, max_output_tokens=100, temperature=0)
    if stream:
        with qwen.responses.stream(tool_choice="required", **kw) as s:
            for _ in s:
                pass
            r = s.get_final_response()
    else:
        r = qwen.responses.create(tool_choice="required", **kw)
    assert r.status == "completed" and r.output and {o.type for o in r.output} == {"function_call"}
    chat = qwen.chat.completions.create(
        model="qwen25",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        max_tokens=100,
        temperature=0,
    )
    assert [(o.name, o.arguments) for o in r.output] == [
        (c.function.name, c.function.arguments) for c in chat.choices[0].message.tool_calls
    ]
    for call in r.output:
        assert call.call_id.startswith("call_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "21 C"} for c in r.output]
    follow = dict(model="qwen25", tools=TOOLS, tool_choice="none", max_output_tokens=10, temperature=0)
    chained = qwen.responses.create(previous_response_id=r.id, input=results, **follow)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        *[o.model_dump() for o in r.output],
        *results,
    ]
    whole = qwen.responses.create(input=history, **follow)
    assert chained.usage.input_tokens == whole.usage.input_tokens > r.usage.input_tokens
    assert chained.output_text == whole.output_text and chained.previous_response_id == r.id
    # the same prompt: the second finds all of it but the last partial page in the prefix cache
    assert whole.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens - 16


def test_stored_responses_get_delete_and_errors(qwen, servers):
    """store (the default) keeps a response for GET and previous_response_id until DELETE; store false keeps
    none; what is not supported is a 400 naming the field, the server serving on."""
    r = qwen.responses.create(model="qwen25", input="Hi", max_output_tokens=3, temperature=0)
    assert qwen.responses.retrieve(r.id).output_text == r.output_text
    qwen.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        qwen.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        qwen.responses.create(model="qwen25", previous_response_id=r.id, input="Again", max_output_tokens=3)
    unstored = qwen.responses.create(model="qwen25", input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        qwen.responses.retrieve(unstored.id)
    url = servers["qwen25"] + "/v1/responses"
    bad = {
        "tools": ([{"type": "web_search"}], "tools[0].type"),
        "input": (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            "input[0].content[0]",
        ),
        "background": (True, "background"),
        "truncation": ("auto", "truncation"),
        "include": (["nothing.real"], "include"),
        "temperatur": (0.5, "temperatur"),
        "logit_bias": ({"x": 1.0}, "logit_bias"),
    }
    for field, (value, param) in bad.items():
        body = {"model": "qwen25", "input": "Hi", "max_output_tokens": 3, field: value}
        got = httpx.post(url, json=body, timeout=60)
        assert got.status_code == 400, (field, got.text)
        assert got.json()["error"]["param"] == param, got.json()
    schema = {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
    got = httpx.post(url, json={"model": "qwen25", "input": "Hi", "text": {"format": schema}}, timeout=60)
    assert got.status_code == 400 and got.json()["error"]["param"].startswith("text.format"), got.text
    assert qwen.responses.create(model="qwen25", input="Hi", max_output_tokens=2).status == "incomplete"
    # vLLM's logit_bias on this route: a token biased by +100 is every token of the reply
    biased = qwen.responses.create(
        model="qwen25",
        input="Hi",
        max_output_tokens=3,
        include=["message.output_text.logprobs"],
        extra_body={"logit_bias": {"300": 100.0}},
    )
    tokens = [lp.token for lp in biased.output[0].content[0].logprobs]
    assert len(tokens) == 3 and len(set(tokens)) == 1


def test_reasoning_item_plain_and_streamed(servers):
    """With --reasoning-parser, the thinking comes out as a reasoning item (reasoning_text), as the chat
    route's reasoning_content; streamed through reasoning_text events to the same output."""
    client = openai.OpenAI(base_url=servers["r1"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model="r1", input="Why?", max_output_tokens=16, temperature=0)
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(
        model="r1", messages=[{"role": "user", "content": "Why?"}], max_tokens=16, temperature=0
    )
    assert r.output[0].type == "reasoning"
    assert r.output[0].content[0].text == chat.choices[0].message.reasoning_content
    assert r.output_text == (chat.choices[0].message.content or "")
    events = list(client.responses.create(stream=True, **kw))
    assert "response.reasoning_text.delta" in {e.type for e in events}
    assert without_ids(events[-1].response.output) == without_ids(r.output)


def test_openai_agents_sdk_runs_a_tool_and_returns_its_output_type(servers):
    """The OpenAI Agents SDK, whose default model calls /v1/responses: its first turn forced to call the
    function tool (which runs, here, with the arguments the grammar allowed), its last returning the agent's
    output type through text.format; plain and streamed."""
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel, Field

    class Report(BaseModel):
        city: str = Field(max_length=8)
        celsius: int = Field(ge=-50, le=60)

    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"21 C in {city}"

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=servers["qwen25"] + "/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather",
            instructions="Answer weather questions.",
            tools=[get_weather],
            output_type=Report,
            model=agents.OpenAIResponsesModel(model="qwen25", openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", max_tokens=300, temperature=0),
        )
        plain = await agents.Runner.run(agent, "Weather in Paris?", max_turns=4)
        streamed = agents.Runner.run_streamed(agent, "Weather in Rome?", max_turns=4)
        async for _ in streamed.stream_events():
            pass
        return [plain, streamed]

    for result in asyncio.run(run()):
        assert isinstance(result.final_output, Report)
        kinds = [type(item).__name__ for item in result.new_items]
        assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem"
    assert len(seen) >= 2 and all(
        isinstance(city, str) for city in seen
    )  # the SDK checked them against its schema


def test_langchain_chat_openai_on_the_responses_api(servers):
    """LangChain's ChatOpenAI with use_responses_api: a reply equal to the openai client's, streamed to the same
    text, and bind_tools with tool_choice "any" (forced) giving a call whose arguments validate."""
    langchain_openai = pytest.importorskip("langchain_openai")
    kw = dict(base_url=servers["qwen25"] + "/v1", api_key="unused", model="qwen25", max_retries=0)
    llm = langchain_openai.ChatOpenAI(use_responses_api=True, temperature=0, max_tokens=8, **kw)
    client = openai.OpenAI(base_url=kw["base_url"], api_key="unused", max_retries=0)
    want = client.responses.create(model="qwen25", input="Hello there", max_output_tokens=8, temperature=0)
    message = llm.invoke("Hello there")
    assert message.text == want.output_text and message.usage_metadata["output_tokens"] == 8
    assert "".join(chunk.text for chunk in llm.stream("Hello there")) == want.output_text
    tools = langchain_openai.ChatOpenAI(use_responses_api=True, temperature=0, max_tokens=100, **kw)
    called = tools.bind_tools(CHAT_TOOLS, tool_choice="any").invoke("Weather in Paris?")
    assert [c["name"] for c in called.tool_calls] == ["get_weather"]
    jsonschema.validate(called.tool_calls[0]["args"], WEATHER)
