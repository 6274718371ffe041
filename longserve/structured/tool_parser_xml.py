"""The Qwen3-Coder / Qwen3.5 tool-call syntax (`--tool-call-parser qwen3_coder`, vLLM's and SGLang's name):

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

values typed by the tool's JSON schema (qwen_xml.py); a state machine over one output with ToolCallParser's
streaming contract (tool_calls.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from longserve.structured.json_scan import partial_suffix, skip_ws
from longserve.structured.qwen_xml import RAW, ParamKind, param_kind, properties, value_json
from longserve.structured.tool_calls import ToolCallParser

_NAME_SO_FAR = re.compile(r"[\w.:\-]*")  # a function name still being written
_MAX_NAME = 256  # a tag's name longer than this is not a name


class _XmlCall:
    __slots__ = ("name", "props", "root", "index", "sent", "pending", "params", "seen")

    def __init__(self, name: str, schema: Any) -> None:
        self.name = name
        self.props = properties(schema)
        self.root = schema
        self.index: int | None = None  # set once the call's first delta went out
        self.sent = 0  # characters of arguments sent
        self.pending = ""  # arguments written before the call went out
        self.params = 0
        self.seen: set[str] = set()


class _XmlParam:
    __slots__ = ("name", "kind", "start", "scan", "safe", "sent", "prefix")

    def __init__(self, name: str, kind: ParamKind) -> None:
        self.name, self.kind = name, kind
        self.start = self.scan = self.safe = 0  # where the value starts; where to look for its end next
        self.sent = 0  # characters of the value streamed (raw values only)
        self.prefix = ""  # `, "name": ` of a value sent whole once it ends


class Qwen3CoderToolParser(ToolCallParser):
    """Qwen3-Coder, Qwen3-Next-Coder and Qwen3.5 (vLLM and SGLang `qwen3_coder`), one block per call:

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A value is the text between the tags, less one newline after the opening tag and one before the closing
    tag (the template's, removed as vLLM removes them), typed by the tool's schema (`tool_names` as a mapping
    of parameter schemas; qwen_xml.py). A raw-text value streams as it arrives, any other once it has ended.
    Tolerated as in vLLM: a missing `</parameter>` (the tool's next parameter or `</function>` ends the
    value), a missing `</function>` or `</tool_call>`, text between parameters (ignored), a `</parameter>`
    inside a value that no tag follows (text). A block whose function is not a request's tool is content,
    and so, in `parse`, is a call the output cuts short (vLLM keeps both as calls)."""

    name = "qwen3_coder"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    FUNC, FUNC_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"
    markers = (OPEN, CLOSE, FUNC, FUNC_END, PARAM, PARAM_END)
    _call: _XmlCall | None
    _param: _XmlParam | None = None
    _func_at = 0  # where the current `<function=` is
    _block_calls = 0  # calls finished in the current <tool_call> block

    def _step(self) -> None:
        while True:
            state = self._state
            if state == "content":
                if self._scan_content((self.OPEN,)) is None:
                    return
                self._begin_block(self.OPEN)
                self._block_calls, self._state = 0, "open"
            elif state in ("open", "after_function"):
                options = (self.FUNC,) if state == "open" else (self.CLOSE, self.FUNC)
                found, i = self._at(self._pos, options)
                if found == "wait":
                    return
                if found == self.FUNC:
                    self._func_at, self._pos, self._state = i, i + len(self.FUNC), "name"
                elif found == self.CLOSE:
                    self._end_block(i + len(self.CLOSE))
                elif state == "open":
                    self._bad_block(self.OPEN)
                else:
                    self._end_block(i)  # no </tool_call>: forgiven, what follows is content
            elif state == "name":
                if not self._read_function_name():
                    return
            elif state == "body":  # between parameters
                found, i = self._at(self._pos, (self.PARAM, self.FUNC_END, self.CLOSE))
                if found == "wait":
                    return
                if found == self.PARAM:
                    self._pos, self._state = i + len(self.PARAM), "param"
                elif found == self.FUNC_END:
                    self._finish_call()
                    self._pos, self._state = i + len(self.FUNC_END), "after_function"
                elif found == self.CLOSE:  # no </function>: forgiven
                    self._finish_call()
                    self._end_block(i + len(self.CLOSE))
                elif not self._skip_text(i):
                    return
            elif state == "param":
                if not self._read_param_name():
                    return
            elif state == "value_open":
                if self._pos == len(self._text) and not self._final:
                    return
                if self._text.startswith("\n", self._pos):  # the template's newline after the tag
                    self._pos += 1
                self._open_value()
            elif not self._read_value():
                return

    def _at(self, pos: int, options: tuple[str, ...]) -> tuple[str | None, int]:
        """Which of `options` the text shows after whitespace from `pos` ("wait" while it may still become
        one), and where it starts."""
        text = self._text
        i = skip_ws(text, pos)
        for option in options:
            if text.startswith(option, i):
                return option, i
        if not self._final and len(text) - i < max(map(len, options)):
            rest = text[i:]
            if any(option.startswith(rest) for option in options):
                return "wait", i
        return None, i

    def _args(self, text: str) -> None:
        call = self._call
        if call.index is None:
            call.pending += text
        else:
            self._emit_args(call, text)

    def _read_function_name(self) -> bool:
        text, start = self._text, self._pos
        end = text.find(">", start)
        name = text[start:] if end < 0 else text[start:end]
        if end < 0 and not self._final and len(name) <= _MAX_NAME and _NAME_SO_FAR.fullmatch(name):
            return False
        if end < 0 or not self._valid_name(name):
            self._not_a_call()
            return True
        call = _XmlCall(name, self.tool_schemas.get(name))
        self._call, self._pos, self._state = call, end + 1, "body"
        if not self._final:  # streaming: the call goes out with its name; `parse` waits for its end
            self._emit_start(call, name)
        return True

    def _not_a_call(self) -> None:
        """The `<function=` at self._func_at leads to no call: the calls before it in the block stand, the
        rest is content."""
        if self._block_calls:
            self._end_block(self._func_at)
        else:
            self._bad_block(self.OPEN)

    def _skip_text(self, i: int) -> bool:
        """Text between parameters that is no tag: skipped up to the next tag (False: none yet)."""
        text, tags = self._text, (self.PARAM, self.FUNC_END, self.CLOSE)
        hits = [j for tag in tags if (j := text.find(tag, i)) >= 0]
        if hits:
            self._pos = min(hits)
        elif self._final:
            self._cut_short()
        else:
            self._pos = len(text) - partial_suffix(text, i, tags)
            return False
        return True

    def _read_param_name(self) -> bool:
        text, start = self._text, self._pos
        end = text.find(">", start)
        name = text[start:] if end < 0 else text[start:end]
        bad = "\n" in name or "<" in name or len(name) > _MAX_NAME
        if end < 0 and not self._final and not bad:
            return False
        if end < 0 or bad or not name:  # no parameter tag: text between parameters
            self._state = "body"
            return True
        call = self._call
        kind = param_kind(call.props[name], call.root) if name in call.props else RAW
        self._param, self._pos, self._state = _XmlParam(name, kind), end + 1, "value_open"
        return True

    def _open_value(self) -> None:
        p, call = self._param, self._call
        p.start = p.scan = p.safe = self._pos
        p.prefix = f"{', ' if call.params else '{'}{json.dumps(p.name, ensure_ascii=False)}: "
        call.params += 1
        if p.kind.raw:
            self._args(p.prefix + '"')
        self._state = "value"

    def _stream_value(self, p: _XmlParam, text: str) -> None:
        if text:
            self._args(json.dumps(text, ensure_ascii=False)[1:-1])
            p.sent += len(text)

    def _read_value(self) -> bool:
        p, text = self._param, self._text
        found = self._value_end(p)
        if found is None and not self._final:
            if p.kind.raw:  # what surely is value; a newline that may be the template's waits
                safe = p.safe - (p.safe > p.start and text[p.safe - 1] == "\n")
                self._stream_value(p, text[p.start + p.sent : safe])
            return False
        end, resume = found if found is not None else (len(text), len(text))
        raw = text[p.start : end]
        if raw.endswith("\n"):  # the template's newline before the closing tag
            raw = raw[:-1]
        if p.kind.raw:
            self._stream_value(p, raw[p.sent :])
            self._args('"')
        else:
            self._args(p.prefix + value_json(raw, p.kind))
        self._call.seen.add(p.name)
        self._param, self._pos, self._state = None, resume, "body"
        if found is None:
            self._cut_short()
        return True

    def _value_end(self, p: _XmlParam) -> tuple[int, int] | None:
        """(where the value ends, where to go on) once known; None while it may still go on (p.safe: how far
        it surely is value)."""
        text, k = self._text, p.scan
        while True:
            i = text.find("<", k)
            if i < 0:
                p.scan = p.safe = len(text)
                return None
            verdict = self._ends_value(p, i)
            if verdict == "wait":
                p.scan = p.safe = i
                return None
            if verdict is not None:
                return verdict
            k = i + 1

    def _ends_value(self, p: _XmlParam, i: int) -> tuple[int, int] | str | None:
        """Whether the tag at `i` ends the value: (end, resume), "wait", or None (it is text of the value).
        A `</parameter>` ends it when a tag or the end of the output follows, as do a `</function>` that
        `</tool_call>` or the end follows and a `</tool_call>` that the end or another call follows (a missing
        `</parameter>`); so does `\n<parameter=` naming another parameter of the tool not given yet."""
        text = self._text
        for tag, follow, resume in (
            (self.PARAM_END, (self.PARAM, self.FUNC_END, self.CLOSE), len(self.PARAM_END)),
            (self.FUNC_END, (self.CLOSE,), 0),
            (self.CLOSE, (self.OPEN,), 0),
        ):
            if text.startswith(tag, i):
                found, j = self._at(i + len(tag), follow)
                if found == "wait":
                    return "wait"
                return (i, i + resume) if found is not None or j == len(text) else None
        if text.startswith(self.PARAM, i) and text[i - 1] == "\n":
            start = i + len(self.PARAM)
            end = text.find(">", start)
            if end < 0:
                name = text[start:]
                return "wait" if not self._final and "\n" not in name and len(name) <= _MAX_NAME else None
            name, call = text[start:end], self._call
            return (i, i) if name in call.props and name not in call.seen and name != p.name else None
        if not self._final and len(text) - i < len(self.PARAM_END):
            rest = text[i:]
            if any(tag.startswith(rest) for tag in (self.PARAM_END, self.FUNC_END, self.CLOSE, self.PARAM)):
                return "wait"
        return None

    def _finish_call(self) -> None:
        call = self._call
        self._args("}" if call.params else "{}")
        if call.index is None:
            self._emit_start(call, call.name)
            self._emit_args(call, call.pending)
        self._block_calls += 1
        self._call = None

    def _cut_short(self) -> None:
        """The output ended inside a call: a call that went out is closed with what it has; in `parse` it is
        no call."""
        if self._call.index is None:
            self._not_a_call()
        else:
            self._finish_call()
            self._end_block(len(self._text))
