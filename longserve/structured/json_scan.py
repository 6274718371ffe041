"""An incremental scanner of one JSON object in a growing text (where its members' values start and end),
and the small text helpers the streaming parsers share. Each character is scanned once however the text
arrives; validity is the caller's json.loads once the object is whole."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

_WS = " \t\r\n"
_STRING_BODY = re.compile(r'[^"\\]*')
_VALUE_BODY = re.compile(r'[^"{}\[\]]*')
_SCALAR = re.compile(r"[^,}\s]*")


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


class JsonObjectScanner:
    """The top-level members of one JSON object in a text that grows, scanned once per character.

    It finds structure (where each member's value starts and ends), not validity: the caller json-loads
    the finished object. `members` holds [key, value_start, value_end or None while inside the value].
    """

    __slots__ = ("start", "pos", "end", "error", "members", "_state", "_depth", "_in_str", "_key_start")

    def __init__(self, start: int) -> None:
        self.start = start  # index of the "{"
        self.pos = start + 1
        self.end: int | None = None  # index after the closing "}"
        self.error = False
        self.members: list[list] = []
        self._state = "key"
        self._depth = 0
        self._in_str = False
        self._key_start = 0

    def member(self, keys: Sequence[str]) -> list | None:
        return next((m for m in self.members if m[0] in keys), None)

    def advance(self, text: str) -> None:
        n = len(text)
        while self.pos < n and self.end is None and not self.error:
            i, st, ch = self.pos, self._state, text[self.pos]
            if st in ("key", "colon", "value", "after") and ch in _WS:
                self.pos = skip_ws(text, i)
            elif st == "key":
                if ch == '"':
                    self._key_start, self._state, self.pos = i, "key_str", i + 1
                elif ch == "}" and not self.members:
                    self.end = self.pos = i + 1
                else:
                    self.error = True
            elif st == "key_str":
                j = _string_end(text, i)
                if j is None:
                    self.pos = _string_resume(text, i)
                    if self.pos == i:
                        break  # a trailing backslash: wait for the character it escapes
                    continue
                try:
                    key = json.loads(text[self._key_start : j])
                except json.JSONDecodeError:
                    self.error = True
                    continue
                self.members.append([key, None, None])
                self._state, self.pos = "colon", j
            elif st == "colon":
                self.error = ch != ":"
                self._state, self.pos = "value", i + 1
            elif st == "value":
                self.members[-1][1] = i
                if ch in "{[":
                    self._state, self._depth, self.pos = "nested", 1, i + 1
                elif ch == '"':
                    self._state, self._depth, self._in_str, self.pos = "nested", 0, True, i + 1
                else:
                    self._state = "scalar"
            elif st == "scalar":
                j = _SCALAR.match(text, i).end()
                if j == n:
                    self.pos = j
                    continue
                self._close_value(j)
            elif st == "nested":
                self._advance_nested(text)
            else:  # after a value
                if ch == ",":  # back to "key", where "}" is an error once a member exists
                    self._state, self.pos = "key", i + 1
                elif ch == "}":
                    self.end = self.pos = i + 1
                else:
                    self.error = True
            if self.pos == i and self._state == st:
                break  # waiting for the character after a trailing backslash

    def _close_value(self, j: int) -> None:
        self.members[-1][2] = j
        self._state, self.pos = "after", j

    def _advance_nested(self, text: str) -> None:
        i = self.pos
        if self._in_str:
            j = _string_end(text, i)
            if j is None:
                self.pos = _string_resume(text, i)
                return
            self._in_str = False
            if self._depth == 0:
                self._close_value(j)
            else:
                self.pos = j
            return
        i = _VALUE_BODY.match(text, i).end()
        if i == len(text):
            self.pos = i
            return
        ch = text[i]
        if ch == '"':
            self._in_str, self.pos = True, i + 1
        elif ch in "{[":
            self._depth, self.pos = self._depth + 1, i + 1
        else:
            self._depth -= 1
            if self._depth == 0:
                self._close_value(i + 1)
            else:
                self.pos = i + 1


def _string_end(text: str, i: int) -> int | None:
    """Index after the closing quote of the string whose body starts at i; None if not in `text` yet."""
    n = len(text)
    while True:
        i = _STRING_BODY.match(text, i).end()
        if i >= n:
            return None
        if text[i] == '"':
            return i + 1
        if i + 1 >= n:  # a backslash at the very end: its escaped character has not arrived
            return None
        i += 2


def _string_resume(text: str, i: int) -> int:
    """Where to resume an unfinished string body: before a trailing lone backslash, else at the end."""
    n = len(text)
    while True:
        i = _STRING_BODY.match(text, i).end()
        if i >= n or i + 1 >= n:
            return i
        i += 2


def partial_suffix(text: str, start: int, markers: Sequence[str]) -> int:
    """Length of the longest suffix of text[start:] that is a proper prefix of one of `markers`."""
    longest = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text) - start), longest, -1):
            if text.endswith(m[:k]):
                longest = k
                break
    return longest
