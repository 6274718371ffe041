"""Tool calls in model output: the OpenAI-shaped results and the streaming parser base that the per-syntax
parsers in `tool_parsers.py` build on.

A parser object serves one output: `feed(delta)` per text delta and `finish()` at the end, each returning
a StreamDelta (content, OpenAI `delta.tool_calls` pieces); `parse(text)` reads a finished output at once
and is stricter (a call is kept only if it is whole: its JSON valid, or its XML call closed). Invariants: a
parser never raises on model output (what does not parse is content); content never holds the markup of a
well-formed call; the argument pieces streamed for a call concatenate to what `parse` returns, however the
text is split.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from longserve.structured.json_scan import JsonObjectScanner, partial_suffix, skip_ws

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Mistral write "arguments", Llama 3 "parameters"
TOOL_NAME = re.compile(r"[\w.:\-]+")


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text, as OpenAI's function.arguments

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class ToolCallDelta:
    """One piece of OpenAI's `delta.tool_calls`: the first for a call has its id and name, later ones
    carry argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        function: dict = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


def accumulate(deltas: Iterable[StreamDelta]) -> tuple[str, list[ToolCall]]:
    """What a client rebuilds from streamed deltas: the content and the finished calls."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for d in deltas:
        content.append(d.content)
        for tc in d.tool_calls:
            if tc.index not in calls:
                calls[tc.index] = [tc.id or "", tc.name or "", ""]
            calls[tc.index][2] += tc.arguments
    return "".join(content), [ToolCall(*calls[i]) for i in sorted(calls)]


def openai_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class PendingCall:
    __slots__ = ("scanner", "name", "index", "sent")

    def __init__(self, start: int, name: str | None = None) -> None:
        self.scanner = JsonObjectScanner(start)
        self.name = name  # set when the syntax names the call outside the JSON (the object is the arguments)
        self.index: int | None = None  # set once the call's first delta went out
        self.sent = 0  # characters of arguments sent


class ToolCallParser:
    """Streaming state machine over one output; subclasses implement `_step` for their syntax."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()  # markup strings; a detokenizer must keep them (special or not)
    _idle_states: ClassVar[frozenset[str]] = frozenset({"content"})

    def __init__(self, tool_names: Iterable[str] | Mapping[str, object] | None = None) -> None:
        """`tool_names`: the request's functions; a call naming another is not a call (stays content). A
        mapping gives each one's parameters' JSON schema too, for syntaxes whose values are untyped text."""
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self.tool_schemas: Mapping[str, object] = tool_names if isinstance(tool_names, Mapping) else {}
        self._text = ""
        self._pos = 0
        self._final = False
        self._state = "content"
        self._block_start = 0  # where the markup of the current block began
        self._call: PendingCall | None = None
        self._num_calls = 0
        self._pending_ws = ""  # whitespace held back: it is markup's if markup follows
        self._dropped_ws = ""
        self._after_block = False  # whitespace right after markup is markup's too
        self._out = StreamDelta()

    # ---- public API
    def feed(self, text: str) -> StreamDelta:
        if self._state in self._idle_states and self._pos > 4096:
            self._text, self._pos = self._text[self._pos :], 0  # keep feed O(delta), not O(output)
        self._text += text
        self._step()
        return self._take()

    def finish(self) -> StreamDelta:
        self._final = True
        self._step()
        if not self._after_block:
            self._out.content += self._pending_ws
        self._pending_ws = ""
        return self._take()

    @classmethod
    def parse(
        cls, text: str, tool_names: Iterable[str] | Mapping[str, object] | None = None
    ) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a finished output."""
        parser = cls(tool_names)
        parser._final = True
        parser._text = text
        return accumulate([parser.finish()])

    # ---- helpers for subclasses
    def _take(self) -> StreamDelta:
        out, self._out = self._out, StreamDelta()
        merged: list[ToolCallDelta] = []
        for d in out.tool_calls:
            if merged and merged[-1].index == d.index and d.id is None:
                merged[-1].arguments += d.arguments
            else:
                merged.append(d)
        out.tool_calls = merged
        return out

    def _content(self, s: str) -> None:
        if self._after_block:
            s = s.lstrip()
            if not s:
                return
            self._after_block = False
        body = s.rstrip()
        if body:
            self._out.content += self._pending_ws + body
            self._pending_ws = ""
        self._pending_ws += s[len(body) :]

    def _scan_content(self, markers: tuple[str, ...]) -> str | None:
        """Emit content up to the first marker and return it (self._pos at it); None if there is none yet
        (a suffix that may still become a marker is held back)."""
        text, pos = self._text, self._pos
        hits = [(i, m) for m in markers if (i := text.find(m, pos)) >= 0]
        if hits:
            i, m = min(hits)
            self._content(text[pos:i])
            self._pos = i
            return m
        end = len(text) if self._final else len(text) - partial_suffix(text, pos, markers)
        self._content(text[pos:end])
        self._pos = end
        return None

    def _begin_block(self, marker: str) -> None:
        self._dropped_ws, self._pending_ws = self._pending_ws, ""
        self._block_start = self._pos
        self._pos += len(marker)
        self._after_block = False

    def _end_block(self, pos: int) -> None:
        self._pos, self._state, self._call, self._after_block = pos, "content", None, True

    def _bad_block(self, marker: str) -> None:
        """The markup that opened this block did not lead to a call: it is content, and so is what follows."""
        self._pending_ws = self._dropped_ws
        self._content(marker)
        self._pos, self._state, self._call = self._block_start + len(marker), "content", None

    def _need(self, pos: int) -> int | None:
        """The first non-whitespace index from pos; None while more text may come, len(text) at the end."""
        i = skip_ws(self._text, pos)
        if i == len(self._text) and not self._final:
            return None
        return i

    def _new_id(self) -> str:
        return openai_call_id()

    def _valid_name(self, name: object) -> bool:
        return (
            isinstance(name, str)
            and TOOL_NAME.fullmatch(name) is not None
            and (self.tool_names is None or name in self.tool_names)
        )

    def _emit_start(self, call: PendingCall, name: str) -> None:
        call.index = self._num_calls
        self._num_calls += 1
        self._out.tool_calls.append(ToolCallDelta(call.index, id=self._new_id(), name=name))

    def _emit_args(self, call: PendingCall, text: str) -> None:
        if text:
            self._out.tool_calls.append(ToolCallDelta(call.index, arguments=text))
            call.sent += len(text)

    def _advance_call(self, call: PendingCall) -> str:
        """Scan the call's JSON object further; "incomplete", "done" (a call went out) or "bad"."""
        sc, text = call.scanner, self._text
        sc.advance(text)
        if call.name is not None:  # the object is the arguments
            args_span = (sc.start, sc.end)
            name_ok, raw_start = True, sc.start
        else:
            name_m, args_m = sc.member(("name",)), sc.member(ARGUMENT_KEYS)
            args_span = (args_m[1], args_m[2]) if args_m else None
            name_ok = bool(
                name_m and name_m[2] is not None and self._valid_name(_loads(text[name_m[1] : name_m[2]]))
            )
            raw_start = args_m[1] if args_m and args_m[1] is not None and text[args_m[1]] == "{" else None
        if sc.error or (sc.end is None and self._final):
            if call.index is None:
                return "bad"
            self._emit_args(call, text[raw_start + call.sent : sc.pos] if raw_start is not None else "")
            return "done"
        if sc.end is not None:
            whole = _loads(text[sc.start : sc.end])
            if call.index is None:
                name, args = self._validate(call, whole, args_span)
                if name is None:
                    return "bad"
                self._emit_start(call, name)
                self._emit_args(call, args)
            elif raw_start is not None:
                self._emit_args(call, text[raw_start + call.sent : args_span[1]])
            return "done"
        if call.index is None and name_ok and raw_start is not None:
            self._emit_start(call, call.name or _loads(text[name_m[1] : name_m[2]]))
        if call.index is not None and raw_start is not None:
            end = args_span[1] if args_span[1] is not None else sc.pos
            self._emit_args(call, text[raw_start + call.sent : end])
        return "incomplete"

    def _validate(self, call: PendingCall, whole: object, args_span) -> tuple[str | None, str]:
        if not isinstance(whole, dict):
            return None, ""
        if call.name is not None:
            return call.name, self._text[args_span[0] : args_span[1]]
        name = whole.get("name")
        if not self._valid_name(name):
            return None, ""
        key = next((k for k in ARGUMENT_KEYS if k in whole), None)
        args = whole.get(key) if key else None
        if args is None:
            return name, "{}"
        if isinstance(args, dict):
            return name, self._text[args_span[0] : args_span[1]]
        if isinstance(args, str) and isinstance(_loads(args), dict):  # arguments written as a JSON string
            return name, args
        return None, ""

    def _step(self) -> None:
        raise NotImplementedError


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
