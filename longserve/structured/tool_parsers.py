"""Tool-call parsers for the syntaxes models emit, chosen by `--tool-call-parser NAME` (vLLM's and SGLang's
names): Hermes/Qwen `<tool_call>{json}</tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`, Qwen3-Coder/Qwen3.5
XML (`<function=...><parameter=...>`). Each is a state machine over one output; the streaming contract and its
invariants are ToolCallParser's (tool_calls.py).
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Iterable

from longserve.structured.tool_calls import PendingCall, ToolCallParser
from longserve.structured.tool_parser_xml import Qwen3CoderToolParser

_NAME_AND_ID = re.compile(r"([\w.:\-]*)(?:\[CALL_ID\]\w*)?")


class HermesToolParser(ToolCallParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, several in a row for parallel calls;
    Hermes 2/3, Qwen2.5, QwQ and Qwen3 (vLLM `hermes`, SGLang `qwen`/`qwen25`)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def _step(self) -> None:
        while True:
            if self._state == "content":
                if self._scan_content((self.OPEN,)) is None:
                    return
                self._begin_block(self.OPEN)
                self._state = "open"
            elif self._state == "open":
                if (i := self._need(self._pos)) is None:
                    return
                if i == len(self._text) or self._text[i] != "{":
                    self._bad_block(self.OPEN)
                    continue
                self._call, self._state = PendingCall(i), "call"
            elif self._state == "call":
                status = self._advance_call(self._call)
                if status == "incomplete":
                    return
                if status == "bad":
                    self._bad_block(self.OPEN)
                    continue
                self._pos, self._state = self._call.scanner.pos, "close"
            else:  # after the object: the closing tag (a missing one is forgiven)
                if (i := self._need(self._pos)) is None:
                    return
                rest = self._text[i:]
                if rest.startswith(self.CLOSE):
                    self._end_block(i + len(self.CLOSE))
                elif self.CLOSE.startswith(rest) and rest and not self._final:
                    return
                else:
                    self._end_block(i)


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.1/3.2/3.3 custom tools: the whole output is `{"name": ..., "parameters": {...}}`, possibly
    after `<|python_tag|>`, several separated by `;` (vLLM `llama3_json`, SGLang `llama3`). An output
    that does not start so is plain content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)
    _idle_states = frozenset({"text"})

    def __init__(self, tool_names: Iterable[str] | None = None) -> None:
        super().__init__(tool_names)
        self._state = "start"

    def _step(self) -> None:
        while True:
            text = self._text
            if self._state == "start":
                if (i := self._need(0)) is None:
                    return
                rest = text[i:]
                if rest.startswith(self.PYTHON_TAG):
                    self._pos, self._block_start, self._state = i + len(self.PYTHON_TAG), 0, "open"
                elif rest and self.PYTHON_TAG.startswith(rest) and not self._final:
                    return
                elif rest.startswith("{"):
                    self._pos, self._block_start, self._state = i, 0, "open"
                else:
                    self._state = "text"
            elif self._state == "text":
                self._content(text[self._pos :])
                self._pos = len(text)
                return
            elif self._state == "open":
                if (i := self._need(self._pos)) is None:
                    return
                if i == len(text) or text[i] != "{":
                    self._give_up()
                    continue
                self._call, self._state = PendingCall(i), "call"
            elif self._state == "call":
                status = self._advance_call(self._call)
                if status == "incomplete":
                    return
                if status == "bad":
                    self._give_up()
                    continue
                self._pos, self._state, self._after_block = self._call.scanner.pos, "sep", True
            else:  # between calls
                if (i := self._need(self._pos)) is None or i == len(text):
                    self._pos = len(text) if i is not None else self._pos
                    return
                if text[i] == ";":
                    self._pos, self._block_start, self._state = i + 1, i, "open"
                else:
                    self._pos, self._state = i, "text"

    def _give_up(self) -> None:
        """Not (or no longer) a call: the rest, from the start of this object, is content."""
        self._pos, self._state, self._call = self._block_start, "text", None
        self._after_block = False


class MistralToolParser(ToolCallParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizer: 7B-v0.3, Nemo) or
    `[TOOL_CALLS]name[ARGS]{...}`, optionally `[CALL_ID]id` before `[ARGS]` (v11+: Small 3.2, Devstral),
    one `[TOOL_CALLS]` per call. Ids are 9 alphanumerics, as Mistral's templates require."""

    name = "mistral"
    BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
    _pending_name = ""  # the name read before [ARGS]
    markers = (BOT, ARGS, CALL_ID)

    def _new_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def _step(self) -> None:
        while True:
            text = self._text
            if self._state == "content":
                if self._scan_content((self.BOT,)) is None:
                    return
                self._begin_block(self.BOT)
                self._state = "after_bot"
            elif self._state == "after_bot":
                if (i := self._need(self._pos)) is None:
                    return
                if text.startswith("[", i):  # a JSON list; names never start with "["
                    self._pos, self._state = i + 1, "item"
                else:
                    self._pos, self._state = i, "name"
            elif self._state == "item":
                if (i := self._need(self._pos)) is None:
                    return
                if text.startswith("{", i):
                    self._call, self._state = PendingCall(i), "list_call"
                elif self._call is None:  # "[TOOL_CALLS][]" or junk: no call at all
                    self._bad_block(self.BOT)
                else:  # junk after ", ": keep the calls before it
                    self._end_block(i)
            elif self._state in ("list_call", "args_call"):
                status = self._advance_call(self._call)
                if status == "incomplete":
                    return
                if status == "bad":
                    self._bad_block(self.BOT)
                    continue
                end = self._call.scanner.pos
                if self._state == "args_call":
                    self._end_block(end)
                else:
                    self._pos, self._state = end, "list_sep"
            elif self._state == "list_sep":
                if (i := self._need(self._pos)) is None:
                    return
                if text.startswith(",", i):
                    self._pos, self._state = i + 1, "item"
                else:
                    self._end_block(i + 1 if text.startswith("]", i) else i)
            elif self._state == "name":
                if not self._read_name():
                    return
            else:  # after [ARGS]
                if (i := self._need(self._pos)) is None:
                    return
                if not text.startswith("{", i):
                    self._bad_block(self.BOT)
                    continue
                self._call, self._state = PendingCall(i, name=self._pending_name), "args_call"

    def _read_name(self) -> bool:
        """`name[ARGS]` or `name[CALL_ID]id[ARGS]`; False while waiting for more text."""
        text, pos = self._text, self._pos
        m = _NAME_AND_ID.match(text, pos)
        j = m.end()
        if text.startswith(self.ARGS, j) and self._valid_name(m.group(1)):
            self._pending_name, self._pos, self._state = m.group(1), j + len(self.ARGS), "args"
            return True
        tail = text[j:]
        if not self._final and (not tail or any(mk.startswith(tail) for mk in (self.ARGS, self.CALL_ID))):
            return False
        self._bad_block(self.BOT)
        return True


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,  # vLLM
    "qwen": HermesToolParser,  # SGLang (Qwen2.5, QwQ, Qwen3)
    "qwen25": HermesToolParser,  # SGLang, older name
    "llama3_json": Llama3JsonToolParser,  # vLLM
    "llama3": Llama3JsonToolParser,  # SGLang
    "mistral": MistralToolParser,  # vLLM and SGLang
    "qwen3_coder": Qwen3CoderToolParser,  # vLLM and SGLang (Qwen3-Coder, Qwen3-Next-Coder, Qwen3.5)
}


def get_tool_call_parser(name: str) -> type[ToolCallParser]:
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_CALL_PARSERS))}"
        ) from None
