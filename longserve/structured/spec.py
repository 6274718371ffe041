"""GrammarSpec: what a request constrains its output to, as plain hashable data (the compile-cache key).

Pure Python (no xgrammar): the server builds specs from request fields, the compiler in `grammar.py` turns
them into token masks. Structural tags are xgrammar's JSON format, written here as plain dicts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "lark", "choice", "structural_tag"]
GRAMMAR_KINDS: tuple[str, ...] = GrammarKind.__args__  # type: ignore[attr-defined]

_ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """`kind` and its text: a JSON schema (JSON text), a regex, an EBNF or Lark grammar, a JSON list of
    choices, or an xgrammar structural tag (JSON text). Build with the classmethods: they normalize the
    text so equal constraints share one cache entry."""

    kind: GrammarKind
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; choose one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.text, str):
            raise ValueError(f"a {self.kind} grammar's text must be a string, got {type(self.text).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str | bool) -> GrammarSpec:
        return cls("json_schema", _json_text(schema, "JSON schema"))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object", _ANY_OBJECT_SCHEMA)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"a regex must be a non-empty string, got {pattern!r}")
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, text: str) -> GrammarSpec:
        """EBNF (GBNF-style `root ::= ...`, xgrammar's dialect) or Lark (`start: ...`), told apart the way
        vLLM does for `guided_grammar`: only EBNF defines rules with `::=`."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a grammar must be a non-empty string")
        return cls("ebnf" if "::=" in text else "lark", text)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        if (
            not isinstance(choices, (list, tuple))
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise ValueError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def structural_tag(cls, tag: dict | str) -> GrammarSpec:
        obj = _json_value(tag, "structural tag")
        if not isinstance(obj, dict):
            raise ValueError("a structural tag must be a JSON object")
        if obj.get("type") != "structural_tag":
            obj = {"type": "structural_tag", "format": obj}
        return cls("structural_tag", json.dumps(obj, ensure_ascii=False))

    def choices(self) -> list[str]:
        assert self.kind == "choice", self.kind
        return json.loads(self.text)

    def as_format(self) -> dict:
        """This constraint as one xgrammar structural-tag format (to nest it inside a structural tag)."""
        if self.kind in ("json_schema", "json_object"):
            return {"type": "json_schema", "json_schema": json.loads(self.text)}
        if self.kind == "regex":
            return {"type": "regex", "pattern": self.text}
        if self.kind in ("ebnf", "lark"):
            return {"type": "grammar", "grammar": self.text, "syntax": self.kind}
        if self.kind == "choice":
            return {"type": "grammar", "grammar": choice_ebnf(self.choices()), "syntax": "ebnf"}
        return json.loads(self.text)["format"]

    def after_reasoning(
        self, end: str = "</think>", *, start: str | None = None, excludes: Sequence[str] = ()
    ) -> GrammarSpec:
        """This constraint behind a free-text reasoning section that ends with `end`.

        `start=None`: the output begins inside the section (the prompt ended with `<think>`). With a
        `start` tag the section is optional (a model that may or may not think, like Qwen3 with
        enable_thinking unset). Whitespace between the section and the constrained part is allowed, as
        the templates put "\\n\\n" there. With this spec the engine needs no token-level gating. The
        section's text never holds `end` nor any of `excludes`.
        """
        section: dict[str, Any] = {
            "type": "tag",
            "begin": start or "",
            "content": {"type": "any_text", "excludes": [end, *excludes]},
            "end": end,
        }
        gap = {"type": "regex", "pattern": r"[ \n\r\t]*"}  # as xgrammar writes JSON's: bounded alike
        prefix: dict[str, Any] = {"type": "sequence", "elements": [section, gap]}
        if start is not None:
            prefix = {"type": "optional", "content": prefix}
        return GrammarSpec.structural_tag({"type": "sequence", "elements": [prefix, self.as_format()]})


def choice_ebnf(choices: list[str]) -> str:
    """EBNF matching exactly one of `choices`. JSON string literals are xgrammar EBNF string literals
    (same escapes); ensure_ascii=False keeps non-ASCII characters literal rather than \\u escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _json_value(value: Any, what: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"the {what} is not valid JSON: {e}") from None
    return value


def _json_text(value: Any, what: str) -> str:
    obj = _json_value(value, what)
    if not isinstance(obj, (dict, bool)):
        raise ValueError(f"a {what} must be a JSON object (or true/false), got {type(obj).__name__}")
    try:
        return json.dumps(obj, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the {what} is not plain JSON data: {e}") from None
