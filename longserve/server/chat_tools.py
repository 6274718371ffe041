"""Tools and reasoning in chat completions: what a request's `tools` / `tool_choice` / `parallel_tool_calls`
mean on this server, the messages and tools its chat template gets, the grammar that forces a call, and how
each completion's text becomes OpenAI's `message` (content, `tool_calls`, `reasoning_content`) or, streamed,
`delta` chunks.

As in vLLM: `tool_choice` defaults to "auto" when a request has tools, and "auto" needs
`--enable-auto-tool-choice` with a `--tool-call-parser`; "none" still shows the tools to the template but
reads no calls. "required" and a named function are forced by a grammar, never hoped for: in the parser's
own syntax when the server has one (the model writes what it was trained to write), else in vLLM's JSON
form (a list of {"name", "parameters"} objects; a named function's arguments alone).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from longserve.server.config import ServerConfig
from longserve.server.errors import APIError
from longserve.structured.reasoning import ReasoningParser, grammar_after_reasoning
from longserve.structured.spec import GrammarSpec
from longserve.structured.tool_calls import ToolCall, ToolCallParser, openai_call_id
from longserve.structured.tool_grammar import forced_tool_choice, tool_call_grammar, tool_schemas
from longserve.structured.tool_parsers import get_tool_call_parser

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def template_tool_calls(calls: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """An assistant message's OpenAI `tool_calls` as chat templates read them: each call's arguments as a dict
    (templates write them with `tojson`; a JSON string would come out quoted). `where` names the field."""
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise APIError(
                400, f"{where}[{j}] needs a function with a name", param=f"{where}.{j}.function.name"
            )
        args = function.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        if not isinstance(args, dict):
            raise APIError(
                400,
                f"{where}[{j}].function.arguments must be a JSON object (or its JSON text)",
                param=f"{where}.{j}.function.arguments",
            )
        item = {"type": "function", "function": {"name": name, "arguments": args}}
        if isinstance(call.get("id"), str):
            item["id"] = call["id"]
        out.append(item)
    return out


def _mistral_id(call_id: str) -> str:
    """Mistral's templates refuse ids that are not 9 alphanumerics (ours, OpenAI's "call_..." too): the last
    9 alphanumerics (vLLM keeps the last 9 characters), or a hash of a shorter id; an id always maps alike,
    so a call and its tool result still match."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    alnum = re.sub(r"[^A-Za-z0-9]", "", call_id)
    return alnum[-9:] if len(alnum) >= 9 else hashlib.sha1(call_id.encode()).hexdigest()[:9]


@dataclass
class ChatTools:
    """One chat request's tool settings, checked."""

    tools: list[dict] | None  # for the chat template (None: the request has none)
    names: list[str]
    schemas: dict[str, Any]  # each tool's parameters schema (the XML syntax types its values by them)
    mode: str  # "none": read no calls; "auto": the parser reads what the model chose; "forced"
    forced_name: str | None  # a named tool_choice
    parser: type[ToolCallParser] | None
    parallel: bool

    @classmethod
    def from_request(cls, req: Any, config: ServerConfig) -> ChatTools:
        tools = req.tools or None
        choice = req.tool_choice
        parallel = req.parallel_tool_calls is not False  # OpenAI's default: true
        parser = get_tool_call_parser(config.tool_call_parser) if config.tool_call_parser else None
        if tools is None:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools: the request has none", param="tool_choice")
            return cls(None, [], {}, "none", None, parser, parallel)
        try:
            schemas = tool_schemas(tools)
        except ValueError as e:
            raise APIError(400, f"tools: {e}", param="tools") from None
        try:
            forced = forced_tool_choice(choice)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        if forced and forced not in schemas:
            raise APIError(
                400,
                f"tool_choice names {forced!r}, which is not among the request's tools",
                param="tool_choice",
            )
        if forced is not None:
            mode = "forced"
        elif choice == "none":
            mode = "none"
        else:
            if not (config.enable_auto_tool_choice and parser is not None):
                raise APIError(400, AUTO_NEEDS_FLAGS, param="tool_choice")
            mode = "auto"
        return cls(tools, list(schemas), schemas, mode, forced or None, parser, parallel)

    def template_messages(self, messages: list[dict[str, Any]], chat_template: str | None) -> list[dict]:
        """The messages as the template wants them: Mistral's templates need 9-character call ids."""
        if not chat_template or "length != 9" not in chat_template:
            return messages
        for m in messages:
            for call in m.get("tool_calls") or ():
                if "id" in call:
                    call["id"] = _mistral_id(call["id"])
            if isinstance(m.get("tool_call_id"), str):
                m["tool_call_id"] = _mistral_id(m["tool_call_id"])
        return messages

    def grammar(self, chat_template: str | None) -> GrammarSpec | None:
        """The grammar that forces the call(s) of a "required" or named tool_choice; None otherwise."""
        if self.mode != "forced":
            return None
        choice = (
            {"type": "function", "function": {"name": self.forced_name}} if self.forced_name else "required"
        )
        try:
            if self.parser is not None:
                return tool_call_grammar(
                    self.parser,
                    self.tools or [],
                    choice,
                    parallel_tool_calls=self.parallel,
                    chat_template=chat_template,
                )
            return _json_calls_grammar(tool_schemas(self.tools or []), self.forced_name, self.parallel)
        except ValueError as e:
            raise APIError(400, f"tools: {e}", param="tools") from None

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"


def _json_calls_grammar(schemas: dict[str, Any], name: str | None, parallel: bool) -> GrammarSpec:
    """vLLM's forced calls without a parser: a named function's arguments alone, or a JSON list of calls."""
    if name:
        return GrammarSpec.json_schema(schemas[name])
    call = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [n]}, "parameters": s},
            "required": ["name", "parameters"],
        }
        for n, s in schemas.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec.json_schema(schema)


def _json_calls(text: str, name: str | None) -> list[ToolCall] | None:
    """The calls of vLLM's JSON form (see _json_calls_grammar); None if the text is not one (cut short)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if name:
        return [ToolCall(openai_call_id(), name, text.strip())] if isinstance(value, dict) else None
    if not isinstance(value, list) or not all(
        isinstance(v, dict) and isinstance(v.get("name"), str) for v in value
    ):
        return None
    return [
        ToolCall(openai_call_id(), v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False))
        for v in value
    ]


class ChatOutput:
    """How one chat request's completions read: reasoning split off first, then tool calls out of the rest."""

    def __init__(
        self,
        tools: ChatTools,
        reasoning: type[ReasoningParser] | None = None,
        in_reasoning: bool | None = None,
    ) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.in_reasoning = in_reasoning
        # without a parser, forced calls are vLLM's JSON (read once the text is whole)
        self.json_calls = tools.mode == "forced" and tools.parser is None
        self.parser = tools.parser if tools.reads_calls and not self.json_calls else None

    def constrain(self, spec: GrammarSpec | None) -> GrammarSpec | None:
        """The request's grammar, behind the reasoning section the output may open with."""
        if spec is None or self.reasoning is None:
            return spec
        return grammar_after_reasoning(spec, self.reasoning, self.in_reasoning)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """OpenAI's `message` of a finished completion, and whether it holds tool calls."""
        reasoning, content = (None, text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text, self.in_reasoning)
        calls: list[ToolCall] = []
        if self.json_calls:
            found = _json_calls(content, self.tools.forced_name)
            if found:
                calls, content = found, ""
        elif self.parser is not None:
            content, calls = self.parser.parse(content, self.tools.schemas)
        if not self.tools.parallel:
            calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message, bool(calls)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: text deltas in, OpenAI `delta` objects out."""

    def __init__(self, output: ChatOutput) -> None:
        self.output = output
        self.reasoning = output.reasoning(output.in_reasoning) if output.reasoning is not None else None
        self.parser = output.parser(output.tools.schemas) if output.parser is not None else None
        self._held = ""  # vLLM-form calls are read once whole
        self.called = False

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The delta fields for new text (`final`: the completion ended; everything held comes out)."""
        reasoning, content = "", text
        if self.reasoning is not None:
            r = self.reasoning.feed(text)
            reasoning, content = r.reasoning, r.content
            if final:
                r = self.reasoning.finish()
                reasoning, content = reasoning + r.reasoning, content + r.content
        calls: list[dict[str, Any]] = []
        if self.output.json_calls:
            self._held += content
            content = ""
            if final:
                found = _json_calls(self._held, self.output.tools.forced_name) or []
                if not self.output.tools.parallel:
                    found = found[:1]
                calls = [{"index": i, **c.to_openai()} for i, c in enumerate(found)]
                content = "" if found else self._held
        elif self.parser is not None:
            d = self.parser.feed(content)
            content, pieces = d.content, list(d.tool_calls)
            if final:
                d = self.parser.finish()
                content, pieces = content + d.content, pieces + d.tool_calls
            calls = [p.to_openai() for p in pieces if self.output.tools.parallel or p.index == 0]
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
            self.called = True
        return out
