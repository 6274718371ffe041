"""The Responses API's request mapped onto a chat completion (server/responses_input.py) and its store's bounds
(server/response_store.py), without a server: the items as chat messages, the tools, tool_choice and
text.format in the chat shape, and each refusal naming its field."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from longserve.server.errors import APIError  # noqa: E402
from longserve.server.response_store import ResponseStore  # noqa: E402
from longserve.server.responses_input import ResponsesRequest, chat_request, input_messages  # noqa: E402


def call(call_id: str, name: str = "f") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}", "id": "fc_1"}


def test_items_become_the_chat_turns():
    """A reply's reasoning, message and calls make one assistant turn; each output one tool message."""
    items = [
        {"role": "user", "content": "q"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hm"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "a", "annotations": []}],
        },
        call("c1"),
        call("c2", "g"),
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "r2"}]},
        call("c3"),  # a call with no message before it: an assistant turn of its own
    ]
    fn = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert input_messages(items) == [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "a",
            "reasoning_content": "hm",
            "tool_calls": [
                {"id": "c1", **fn},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c3", **fn}]},
    ]
    assert input_messages("hello") == [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    "items,param",
    [
        ([], "input"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0]"),
        ([{"type": "web_search_call", "id": "ws_1"}], "input[0].type"),
        ([{"role": "tool", "content": "x"}], "input[0]"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": 3}], "input[0].content"),
    ],
)
def test_items_refused_name_their_field(items, param):
    with pytest.raises(APIError) as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == param


def test_the_chat_request():
    """Instructions first, then the stored history, then the input; function tools, a named tool_choice and
    text.format in the chat shape; a forced call drops the format (the reply is the call)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = ResponsesRequest.model_validate(
        {
            "input": "next",
            "instructions": "be brief",
            "tools": [{"type": "function", "name": "f", "parameters": schema, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": schema}},
            "max_output_tokens": 7,
        }
    )
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    chat, conversation = chat_request(req, history)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user"]
    assert chat.messages[0].content == "be brief" and chat.messages[-1].content == "next"
    assert conversation == [*history, {"role": "user", "content": "next"}]  # no instructions: not carried on
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    ]
    assert (
        chat.tool_choice == {"type": "function", "function": {"name": "f"}} and chat.response_format is None
    )
    assert chat.max_tokens == 7
    req.tool_choice = "auto"
    chat, _ = chat_request(req, [])
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    nested = {"type": "function", "function": {"name": "f", "parameters": schema}}  # the chat shape, accepted
    req.tools = [nested]
    assert chat_request(req, [])[0].tools == [nested]
    req.tools = [{"type": "file_search", "vector_store_ids": []}]
    with pytest.raises(APIError, match="only function tools") as e:
        chat_request(req, [])
    assert e.value.param == "tools[0].type"


@pytest.mark.parametrize(
    "field,value,param",
    [
        ("background", True, "background"),
        ("conversation", "conv_1", "conversation"),
        ("truncation", "auto", "truncation"),
        ("max_output_tokens", 0, "max_output_tokens"),
        ("include", ["message.output_text.logprobs", "x"], "include"),
        ("reasoning", {"effort": "high"}, "reasoning"),
    ],
)
def test_unsupported_settings_are_refused(field, value, param):
    req = ResponsesRequest.model_validate({"input": "x", field: value})
    with pytest.raises(APIError) as e:
        req.check_supported()
    assert e.value.status == 400 and e.value.param == param
    ResponsesRequest.model_validate({"input": "x", "truncation": "disabled", "include": []}).check_supported()


def test_store_drops_the_oldest_past_its_bounds():
    store = ResponseStore(max_responses=2, max_chars=10**6)
    for rid in ("a", "b", "c"):
        store.put({"id": rid}, [{"role": "user", "content": rid}])
    assert store.get("a") is None and store.get("b") is not None and len(store) == 2
    assert store.delete("b") and not store.delete("b") and len(store) == 1
    small = ResponseStore(max_responses=10, max_chars=200)
    small.put({"id": "x"}, [{"role": "user", "content": "x" * 100}])
    small.put({"id": "y"}, [{"role": "user", "content": "y" * 100}])  # both past 200 characters: x goes
    assert small.get("x") is None and small.get("y") is not None
    small.put({"id": "y"}, [{"role": "user", "content": "z"}])  # the same id again: replaced, counted once
    assert len(small) == 1 and small.get("y").conversation[0]["content"] == "z" and small._chars < 100


def replay(events: list[str]) -> None:
    """Our SSE events parsed as the openai client parses them, through its stream accumulator (which checks
    each item's identity from added to done, and that none is left open at response.completed)."""
    import json

    from openai._models import construct_type
    from openai._types import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    state = ResponseStreamState(input_tools=[], text_format=omit)
    for i, raw in enumerate(events):
        kind, data = raw.split("\n")[:2]
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}" and event["sequence_number"] == i
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))


def test_the_writer_streams_what_it_returns():
    """Reasoning, then text, then two calls arriving in pieces (a parser's deltas), as the stream events and
    the items: accepted by the openai client's accumulator in order, and equal to the items of the whole reply
    fed at once (a plain response)."""
    pytest.importorskip("openai")
    from types import SimpleNamespace

    from longserve.server.routes_responses import OutputWriter, ResponseRun

    deltas = [
        {"reasoning_content": "let me "},
        {"reasoning_content": "think"},
        {"content": "Sure"},
        {"content": "."},
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
        {
            "tool_calls": [
                {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}
            ]
        },
    ]
    req = ResponsesRequest.model_validate({"input": "q"})
    run = ResponseRun(req, SimpleNamespace(model_name="m"), SimpleNamespace(temperature=1.0, top_p=1.0))
    out = SimpleNamespace(prompt_tokens=3, cached_tokens=0, completion_tokens=9)
    writer = OutputWriter(None)
    events = [writer.event("response.created", response=run.body("in_progress", [], None))]
    for d in deltas:
        events += list(writer.feed(d, []))
    events += list(writer.finish("completed"))
    events.append(writer.event("response.completed", response=run.body("completed", writer.items, out)))
    replay(events)
    kinds = [(i["type"], i["status"]) for i in writer.items]
    assert kinds == [("reasoning", "completed"), ("message", "completed"), ("function_call", "completed")] + [
        ("function_call", "completed")
    ]
    assert (
        writer.items[0]["content"][0]["text"] == "let me think"
        and writer.items[1]["content"][0]["text"] == "Sure."
    )
    assert [(i["call_id"], i["name"], i["arguments"]) for i in writer.items[2:]] == [
        ("call_a", "f", '{"x": 1}'),
        ("call_b", "g", "{}"),
    ]
    whole = OutputWriter(None)
    calls = [{"index": 0, "id": "call_a", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{}"}}]  # fmt: skip
    list(whole.feed({"reasoning_content": "let me think", "content": "Sure.", "tool_calls": calls}, []))
    list(whole.finish("completed"))
    strip = [{k: v for k, v in i.items() if k != "id"} for i in writer.items]
    assert strip == [{k: v for k, v in i.items() if k != "id"} for i in whole.items]
    capped = OutputWriter(1)  # max_tool_calls 1: the second call is dropped, its pieces too
    for d in deltas:
        list(capped.feed(d, []))
    assert [i["type"] for i in capped.items] == ["reasoning", "message", "function_call"]
