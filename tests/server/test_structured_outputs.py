"""Structured outputs through the real server (the shared tiny random-weight model): every dialect that asks
for a constraint (OpenAI response_format, vLLM structured_outputs / guided_*, SGLang's json_schema / regex /
ebnf on /generate and the OpenAI routes) is honoured, whatever the weights; random schemas' outputs all
validate; the openai client's `.parse()` fills a pydantic model; a constraint that cannot compile is a 400
naming its field, and the server keeps serving with every page back."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tests.fixtures.finite_schemas import finite_json_schemas, finite_regexes

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

MSGS = [{"role": "user", "content": "Describe the weather as JSON."}]
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
MAX_TOKENS = 1200  # above what the finite schemas can take (JSON whitespace is bounded by default)
OBJ = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "temp": {"type": "integer", "minimum": -30, "maximum": 45},
        "sky": {"enum": ["sunny", "rain", "snow"]},
    },
    "required": ["city", "temp", "sky"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **body):
    body.setdefault("messages", MSGS)
    body.setdefault("max_tokens", MAX_TOKENS)
    r = client.post(CHAT, json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


@pytest.mark.parametrize(
    "fields",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": OBJ, "strict": True},
            }
        },
        {"guided_json": OBJ},
        {"guided_json": json.dumps(OBJ)},
        {"structured_outputs": {"json": OBJ}},
        {"json_schema": json.dumps(OBJ)},  # SGLang's field on its OpenAI routes
    ],
)
def test_json_schema_dialects(client, fields):
    jsonschema.validate(json.loads(chat(client, temperature=1.0, seed=3, **fields)), OBJ)


def test_json_object_regex_choice_grammar(client, tiny_model):
    # any object: random weights never close a string, but with "}" favoured an object ends at once
    close = AutoTokenizer.from_pretrained(tiny_model).convert_tokens_to_ids("}")
    text = chat(client, response_format={"type": "json_object"}, logit_bias={str(close): 100})
    assert json.loads(text) == {}
    for fields, pattern in [
        ({"guided_regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}, r"[A-Z][a-z]{2,5} [0-9]{2}"),
        ({"regex": r"(yes|no)!"}, r"(yes|no)!"),
        ({"structured_outputs": {"regex": r"-?[0-9]{1,3}"}}, r"-?[0-9]{1,3}"),
        ({"guided_grammar": 'root ::= "(" [0-9] ("," [0-9])* ")"'}, r"\(\d(,\d)*\)"),
        ({"ebnf": 'root ::= "a" | "bc"'}, r"a|bc"),
    ]:
        assert re.fullmatch(pattern, chat(client, temperature=1.0, seed=1, **fields)), fields
    for fields in (
        {"guided_choice": ["left", "right"]},
        {"structured_outputs": {"choice": ["left", "right"]}},
    ):
        assert chat(client, temperature=1.0, **fields) in ("left", "right")


def test_completions_and_generate(client):
    r = client.post(COMPL, json={"prompt": "Weather:", "max_tokens": MAX_TOKENS, "guided_json": OBJ, "n": 2})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        jsonschema.validate(json.loads(choice["text"]), OBJ)
    for params, check in [
        ({"json_schema": json.dumps(OBJ)}, lambda t: jsonschema.validate(json.loads(t), OBJ)),
        ({"regex": r"[0-9]{4}-[0-9]{2}"}, lambda t: re.fullmatch(r"[0-9]{4}-[0-9]{2}", t) or pytest.fail(t)),
        ({"ebnf": 'root ::= "x" "y"*'}, lambda t: re.fullmatch(r"xy*", t) or pytest.fail(t)),
    ]:
        body = {
            "text": "Weather:",
            "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 1.0, **params},
        }
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        check(r.json()["text"])
        # streamed: the cumulative text of the last event is the same kind of output
        with client.stream("POST", "/generate", json={**body, "stream": True}) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: {")]
        check(json.loads(lines[-1][len("data: ") :])["text"])


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(schema=finite_json_schemas, pattern=finite_regexes, seed=st.integers(0, 2**31))
def test_random_schemas_and_regexes_through_the_server(client, schema, pattern, seed):
    """Random (finite) schemas and regexes, sampled at temperature 1 by random weights: each output ends by
    itself and is valid; with n=2 both completions are."""
    body = {"temperature": 1.0, "seed": seed, "n": 2, "messages": MSGS, "max_tokens": MAX_TOKENS}
    r = client.post(
        CHAT,
        json={
            **body,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        },
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    r = client.post(COMPL, json={"prompt": "Text:", "max_tokens": 200, "seed": seed, "guided_regex": pattern})
    assert r.status_code == 200, r.text
    assert re.fullmatch(pattern, r.json()["choices"][0]["text"]), (pattern, r.json())


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    temp: int = pydantic.Field(ge=-30, le=45)
    sky: str = pydantic.Field(pattern="^(sunny|rain|snow)$")


def test_openai_parse_with_a_pydantic_model(oai, tiny_model):
    parse = getattr(oai.chat.completions, "parse", None) or oai.beta.chat.completions.parse
    r = parse(
        model=tiny_model,
        messages=MSGS,
        response_format=Weather,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
    )
    weather = r.choices[0].message.parsed
    assert isinstance(weather, Weather) and weather.sky in ("sunny", "rain", "snow")
    # streamed: the client parses the accumulated content the same way
    with oai.chat.completions.stream(
        model=tiny_model,
        messages=MSGS,
        response_format=Weather,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == weather  # same seed, same tokens


BAD = [
    (
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "bogus"}},
            }
        },
        "response_format",
    ),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format"),
    (CHAT, {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "guided_json"),
    (CHAT, {"guided_regex": "(unclosed"}, "guided_regex"),
    (CHAT, {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    (CHAT, {"guided_choice": []}, "guided_choice"),
    (CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    (CHAT, {"guided_json": OBJ, "guided_regex": "a"}, "only one output constraint"),
    (CHAT, {"guided_json": OBJ, "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    (
        CHAT,
        {
            "guided_json": {
                "type": "object",
                "properties": {f"p{i}": {"type": "string", "description": "x" * 300} for i in range(1000)},
            }
        },
        "guided_json",
    ),
    (COMPL, {"guided_json": {"type": 5}}, "guided_json"),
    (COMPL, {"regex": "[z-a]"}, "regex"),
    ("/generate", {"sampling_params": {"json_schema": '{"type": "bogus"}'}}, "json_schema"),
    ("/generate", {"sampling_params": {"regex": "(ab"}}, "regex"),
    ("/generate", {"sampling_params": {"ebnf": "root ::= ("}}, "ebnf"),
]


@pytest.mark.parametrize("route,fields,named", BAD, ids=[f"{r}-{n}" for r, _, n in BAD])
def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(client, route, fields, named):
    body = {"messages": MSGS} if route == CHAT else ({"prompt": "x"} if route == COMPL else {"text": "x"})
    r = client.post(route, json={**body, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert named in error["message"] and error["type"] == "invalid_request_error", error
    assert ".cc:" not in error["message"]  # xgrammar's C++ location is not the client's business


def test_the_server_keeps_serving_with_every_page_back(client):
    for route, fields, _ in BAD[:3]:
        client.post(route, json={"messages": MSGS, **fields})
    assert chat(client, guided_choice=["ok"]) == "ok"
    info = client.get("/server_info", params={"check_integrity": "1"}).json()
    assert info["kv_integrity"] == "ok" and info["num_unfinished_requests"] == 0


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": OBJ}},
    {"type": "function", "function": {"name": "noop"}},  # no parameters: any object
]


def test_forced_tool_calls_without_a_parser_are_vllms_json(oai, tiny_model, client):
    """No --tool-call-parser: "required" forces vLLM's JSON list of calls, a named function its arguments;
    "auto" is refused as vLLM refuses it without --enable-auto-tool-choice."""
    kw = dict(model=tiny_model, messages=MSGS, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=1.0, seed=8)
    r = oai.chat.completions.create(tool_choice="required", parallel_tool_calls=False, n=3, **kw)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), OBJ)
        else:
            assert call.function.name == "noop" and isinstance(json.loads(call.function.arguments), dict)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        if stream:
            chunks = list(oai.chat.completions.create(tool_choice=named, stream=True, **kw))
            calls = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        else:
            calls = oai.chat.completions.create(tool_choice=named, **kw).choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].function.arguments), OBJ)
    r = client.post(CHAT, json={"messages": MSGS, "tools": TOOLS})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
