"""The values of Qwen3-Coder / Qwen3.5 XML tool calls (`<parameter=NAME>\\nvalue\\n</parameter>`): raw text,
typed by the tool's JSON schema for that parameter, as vLLM's `qwen3_coder` parser types them
(Qwen3CoderToolParser._convert_param_value, vllm/tool_parsers/qwen3coder_tool_parser.py): a string stays the
text; an integer, number or boolean is read from it; an object or array is JSON (a Python literal as the
fallback, as the older Qwen3-Coder template wrote dicts with `|string`); "null" / "None" is null for a
non-string type or a nullable one. Text that does not read as its type stays a string, as in vLLM.

Where this reads what the schema declares and vLLM does not: a type list (`["string", "null"]`, which vLLM
reads as no known type, so "3" became 3) and `oneOf` count like `anyOf`, a local `$ref` is followed, an
`enum`/`const` of non-strings without a `type` is read as JSON (vLLM: a string); whitespace around a
non-string value is ignored (vLLM reads " true" as false); a non-finite number or a value JSON cannot hold
(a Python set) stays the text, where vLLM makes the whole reply content (an infinite number, a set).
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from typing import Any

STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NULLS = ("null", "none")


@dataclass(frozen=True, slots=True)
class ParamKind:
    type: str  # the schema's type in lower case; "string" when it names none
    nullable: bool

    @property
    def is_string(self) -> bool:
        return self.type in STRING_TYPES

    @property
    def raw(self) -> bool:
        """The value is the text itself whatever it says, so it can stream as it arrives."""
        return self.is_string and not self.nullable


RAW = ParamKind("string", False)  # a parameter the schema does not declare: its text, as vLLM keeps it


def properties(schema: Any) -> dict:
    """A tool's parameters' `properties` (name -> schema), {} when it declares none."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def resolve(spec: Any, root: Any) -> Any:
    """`spec` with a local `$ref` ("#/$defs/X") followed inside `root`, the tool's parameters schema."""
    for _ in range(8):
        ref = spec.get("$ref") if isinstance(spec, dict) else None
        if not (isinstance(ref, str) and ref.startswith("#/") and isinstance(root, dict)):
            return spec
        node: Any = root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return spec
            node = node[part]
        spec = node
    return spec


def param_kind(spec: Any, root: Any = None) -> ParamKind:
    """How a parameter's text is read, from its schema (`root`: the tool's, for `$ref`)."""
    spec = resolve(spec, root)
    if not isinstance(spec, dict):
        return RAW
    if "type" in spec:
        types = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
        names = [str(t).strip().lower() for t in types]
        others = [n for n in names if n != "null"]
        return ParamKind(others[0] if others else "null", "null" in names)
    for key in ("anyOf", "oneOf"):  # the first non-null option's type (vLLM reads anyOf alike)
        options = spec.get(key)
        if isinstance(options, list):
            picked, nullable = None, False
            for option in options:
                option = resolve(option, root)
                if isinstance(option, dict) and "type" in option:
                    kind = param_kind(option, root)
                    nullable |= kind.nullable or kind.type == "null"
                    if kind.type != "null" and picked is None:
                        picked = kind.type
            return ParamKind(picked or "string", nullable)
    values = (
        spec["enum"] if isinstance(spec.get("enum"), list) else [spec["const"]] if "const" in spec else []
    )
    rest = [v for v in values if v is not None]
    return ParamKind("string" if all(isinstance(v, str) for v in rest) else "any", None in values)


def _literal(text: str, default: Any) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return default


def convert(text: str, kind: ParamKind) -> Any:
    """The value a parameter's text stands for (the newlines the template writes around it removed)."""
    value = text.strip()
    if value.lower() in _NULLS and (kind.nullable or not kind.is_string):
        return None
    if kind.is_string:
        return text
    t = kind.type
    if t.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return text
    if t.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if t in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    container = t in ("object", "array", "arr") or t.startswith(("dict", "list"))
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        parsed = _literal(value, text)
    if container and isinstance(parsed, str):  # a JSON string holding a Python literal (vLLM reads it too)
        parsed = _literal(parsed, parsed)
    return parsed


def value_json(text: str, kind: ParamKind) -> str:
    """The parameter's value as JSON text, as it goes into the call's arguments."""
    try:
        return json.dumps(convert(text, kind), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):  # a set, bytes, NaN...: the text itself
        return json.dumps(text, ensure_ascii=False)
