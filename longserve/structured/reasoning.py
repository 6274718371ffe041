"""Reasoning sections (`<think>...</think>`) split off an output into `reasoning_content`, chosen by
`--reasoning-parser NAME` (`qwen3`, `deepseek_r1`; SGLang's `deepseek-r1`, `qwen3-thinking`), finished or
streamed; plus what the engine needs to start a grammar after the section.

Where the section starts: the chat template may have put `<think>` at the end of the prompt (DeepSeek-R1
0528/distills, Qwen3 thinking models): the output then begins inside it, which `for_prompt` detects; a
prompt that ends with a closed, empty section (Qwen3 with enable_thinking=false) means no section at all.
Qwen3.5's template opens `<think>\n` in the prompt (only `</think>` is generated) and writes
`<think>\n\n</think>\n\n` there with enable_thinking=false: the same two cases. Newlines between the tags
and the text are the template's, so they are stripped from both parts.

Qwen3.5 may open a tool call inside the section without closing it first: for the Qwen3 parsers a
`<tool_call>` that `<function=` follows ends the section too, and the call is content (vLLM's
Qwen3ReasoningParser does the same); a `<tool_call>` mentioned in the reasoning otherwise stays reasoning.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from longserve.structured.json_scan import partial_suffix, skip_ws
from longserve.structured.spec import GrammarSpec

_FUNCTION = "<function"
_FUNCTION_OPEN = re.compile(r"<function[\s=]")  # after a `<tool_call>`: a call, not a mention (vLLM's test)


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One output's reasoning/content split. `in_reasoning`: True if the output starts inside the section,
    False if it has none, None to decide from the output (inside only if it opens with the start tag)."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    starts_inside: ClassVar[bool | None] = None  # the default when the prompt does not tell
    implicit_end: ClassVar[str | None] = None  # a tag that, `<function=` following it, ends the section too

    def __init__(self, in_reasoning: bool | None = None) -> None:
        self._state = {True: "opening", False: "content", None: "undecided"}[
            self.starts_inside if in_reasoning is None else in_reasoning
        ]
        self._text = ""
        self._pos = 0
        self._final = False
        self._held_newlines = ""  # newlines at the end of reasoning so far: dropped if the end tag follows
        self._reasoning_started = False
        self._saw_section = False

    @classmethod
    def for_prompt(cls, prompt: str) -> ReasoningParser:
        """A parser for the output that follows the rendered `prompt`."""
        return cls(prompt_reasoning_state(prompt, cls.start, cls.end))

    @property
    def in_reasoning(self) -> bool:
        """Inside the section, or not yet past where it may open (no content has come out yet)."""
        return self._state in ("opening", "undecided", "reasoning")

    def feed(self, text: str) -> ReasoningDelta:
        # positions live only in self._pos, so the consumed text can go: feed stays O(delta), not O(output)
        self._text, self._pos = self._text[self._pos :] + text, 0
        return self._step()

    def finish(self) -> ReasoningDelta:
        self._final = True
        return self._step()

    @classmethod
    def parse(cls, text: str, in_reasoning: bool | None = None) -> tuple[str | None, str]:
        """(reasoning or None if the output has no section, content) of a finished output."""
        parser = cls(in_reasoning)
        parser._text, parser._final = text, True
        out = parser._step()
        return (out.reasoning if parser._saw_section else None), out.content

    def _step(self) -> ReasoningDelta:
        out = ReasoningDelta()
        text = self._text
        while True:
            if self._state in ("undecided", "opening"):
                i = len(text) - len(text[self._pos :].lstrip())
                rest = text[i:]
                if rest.startswith(self.start):
                    self._pos, self._state = i + len(self.start), "reasoning"
                elif not self._final and self.start.startswith(rest):
                    break  # may still become the start tag (or only whitespace so far)
                else:
                    self._state = "reasoning" if self._state == "opening" else "content"
                self._saw_section |= self._state == "reasoning"
            elif self._state == "reasoning":
                j = text.find(self.end, self._pos)
                call, hold = self._implicit_end_at(text, j if j >= 0 else len(text))
                if call is not None:  # a tool call ends the section: it is content
                    stop = call
                elif j >= 0 and hold is None:
                    stop = j
                elif hold is not None:
                    stop = hold  # a `<tool_call>` that may still open a call waits
                else:
                    tags = (self.end, self.implicit_end) if self.implicit_end else (self.end,)
                    stop = len(text) - (0 if self._final else partial_suffix(text, self._pos, tags))
                out.reasoning += self._reasoning_piece(text[self._pos : stop])
                self._pos = stop
                if call is None and (j < 0 or hold is not None):
                    break
                self._held_newlines = ""  # the template's newline before the end tag (or the call)
                if call is not None:
                    self._state = "content"
                else:
                    self._pos, self._state = j + len(self.end), "after"
            elif self._state == "after":  # the template's newlines between the end tag and the content
                k = len(text) - len(text[self._pos :].lstrip("\n"))
                self._pos = k
                if k == len(text) and not self._final:
                    break
                self._state = "content"
            else:
                out.content += text[self._pos :]
                self._pos = len(text)
                break
        return out

    def _implicit_end_at(self, text: str, limit: int) -> tuple[int | None, int | None]:
        """(where a tool call ends the section before `limit`, or None; where an undecided one waits)."""
        tag = self.implicit_end
        i = text.find(tag, self._pos) if tag else -1
        while 0 <= i < limit:
            k = skip_ws(text, i + len(tag))
            if _FUNCTION_OPEN.match(text, k):
                return i, None
            if not self._final and len(text) - k <= len(_FUNCTION) and _FUNCTION.startswith(text[k:]):
                return None, i
            i = text.find(tag, i + 1)
        return None, None

    def _reasoning_piece(self, piece: str) -> str:
        """What to emit of this reasoning text: leading newlines of the section are dropped, trailing ones
        wait until more reasoning follows them (they are dropped if the end tag does)."""
        if not self._reasoning_started:
            piece = piece.lstrip("\n")
        body = piece.rstrip("\n")
        if not body:
            self._held_newlines += piece
            return ""
        self._reasoning_started = True
        emitted, self._held_newlines = self._held_newlines + body, piece[len(body) :]
        return emitted


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 (hybrid) and Qwen3.5: a section only if the output opens `<think>` or the prompt left one open
    (Qwen3.5's always does, unless enable_thinking=false closed it); a tool call may end it."""

    name = "qwen3"
    starts_inside = None
    implicit_end = "<tool_call>"


class Qwen3ThinkingReasoningParser(ReasoningParser):
    """Qwen3 thinking-only models (…-Thinking-2507): always inside at first, as the template opens it."""

    name = "qwen3-thinking"
    starts_inside = True
    implicit_end = "<tool_call>"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: always think; the first R1 did not write `<think>`, later templates
    put it in the prompt, so the output starts inside either way."""

    name = "deepseek_r1"
    starts_inside = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "qwen3-thinking": Qwen3ThinkingReasoningParser,  # SGLang
    "deepseek_r1": DeepSeekR1ReasoningParser,  # vLLM
    "deepseek-r1": DeepSeekR1ReasoningParser,  # SGLang
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


def prompt_reasoning_state(prompt: str, start: str = "<think>", end: str = "</think>") -> bool | None:
    """True if `prompt` ends inside an open section, False if it ends right after a closed one (thinking
    switched off), None if the prompt does not say."""
    tail = prompt.rstrip()
    if tail.endswith(start):
        return True
    if tail.endswith(end) and re.search(re.escape(start) + r"\s*" + re.escape(end) + r"$", tail):
        return False
    return None


def reasoning_end_token_ids(tokenizer: Any, end: str = "</think>") -> list[int]:
    """The token ids of the end tag (one id where the tokenizer has it as a token, as Qwen3 and R1 do)."""
    return list(tokenizer.encode(end, add_special_tokens=False))


class ReasoningEnd:
    """Watches sampled token ids for the end of the reasoning section, so the engine starts the output's
    grammar on the token after it. Exact id match: a tokenizer that splits the tag differently in running
    text than alone would be missed, which is why `grammar_after_reasoning` is the more robust choice."""

    def __init__(self, end_token_ids: Sequence[int], in_reasoning: bool = True) -> None:
        self._end = tuple(end_token_ids)
        self._recent: list[int] = []
        self.done = not in_reasoning

    def accept(self, token_id: int) -> bool:
        """Record a sampled token; True once the section has ended (the grammar applies from the next)."""
        if not self.done:
            self._recent = (self._recent + [int(token_id)])[-len(self._end) :]
            self.done = tuple(self._recent) == self._end
        return self.done


def grammar_after_reasoning(
    spec: GrammarSpec, parser: type[ReasoningParser], in_reasoning: bool | None
) -> GrammarSpec:
    """`spec` preceded by the reasoning section the output may have, so the matcher can run from the first
    token: inside -> up to the end tag; undecided -> an optional whole section; no section -> `spec`. The
    section never writes the parser's implicit end tag, which would end it where the grammar does not."""
    state = parser.starts_inside if in_reasoning is None else in_reasoning
    if state is False:
        return spec
    excludes = (parser.implicit_end,) if parser.implicit_end else ()
    return spec.after_reasoning(parser.end, start=None if state else parser.start, excludes=excludes)
