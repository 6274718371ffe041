"""Grammars that make `tool_choice: "required"` or a named function a guarantee: the output is one or more
calls in the tool-call parser's own syntax, each call's arguments valid against its tool's JSON schema.

Built as xgrammar structural tags (tags with a separator, no free text), so what the grammar allows is
exactly what the matching parser in `tool_parsers.py` reads back as calls. In the Qwen3-Coder/Qwen3.5 XML
syntax the arguments are no JSON object: each parameter is a tag of its own, in the schema's order (the
optional ones may be left out), whose value is raw text for a string (free text that writes no tag of the
syntax, or the schema's enum, pattern or length) and JSON for any other type, as the parser reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from longserve.structured.qwen_xml import param_kind, properties, resolve
from longserve.structured.spec import GrammarSpec, choice_ebnf
from longserve.structured.tool_calls import TOOL_NAME
from longserve.structured.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Qwen3CoderToolParser,
    ToolCallParser,
    get_tool_call_parser,
)


def forced_tool_choice(tool_choice: Any) -> str | None:
    """The function name a tool_choice forces, "" for "required", None when calls stay optional."""
    if tool_choice in (None, "auto", "none"):
        return None
    if tool_choice == "required":
        return ""
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if isinstance(name, str) and name:
            return name
    raise ValueError(
        f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}; '
        f"got {tool_choice!r}"
    )


def tool_call_grammar(
    parser: str | type[ToolCallParser],
    tools: Sequence[dict],
    tool_choice: Any,
    *,
    parallel_tool_calls: bool = True,
    chat_template: str | None = None,
) -> GrammarSpec | None:
    """The GrammarSpec that forces `tool_choice` in `parser`'s syntax; None if it forces nothing.

    `tools` are OpenAI tool objects ({"type": "function", "function": {name, parameters}}); a tool without
    parameters takes any object. A named function forces exactly one call of it; "required" one call or
    more (one if not `parallel_tool_calls`). `chat_template` picks Mistral's newer `name[ARGS]` syntax
    when the template writes it.
    """
    forced = forced_tool_choice(tool_choice)
    if forced is None:
        return None
    schemas = _tool_schemas(tools)
    if forced:
        if forced not in schemas:
            raise ValueError(f"tool_choice names {forced!r}, which is not among the request's tools")
        schemas = {forced: schemas[forced]}
    elif not schemas:
        raise ValueError('tool_choice "required" needs at least one tool')
    cls = get_tool_call_parser(parser) if isinstance(parser, str) else parser
    one = bool(forced) or not parallel_tool_calls

    def tag(begin: str, schema: dict | bool, end: str) -> dict:
        return {
            "type": "tag",
            "begin": begin,
            "content": {"type": "json_schema", "json_schema": schema},
            "end": end,
        }

    def calls(tags: list[dict], separator: str) -> dict:
        return {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": separator,
            "at_least_one": True,
            "stop_after_first": one,
        }

    if issubclass(cls, HermesToolParser):
        fmt = calls(
            [
                tag(f'{cls.OPEN}\n{{"name": "{n}", "arguments": ', s, f"}}\n{cls.CLOSE}")
                for n, s in schemas.items()
            ],
            "\n",
        )
    elif issubclass(cls, Llama3JsonToolParser):
        fmt = calls([tag(f'{{"name": "{n}", "parameters": ', s, "}") for n, s in schemas.items()], "; ")
    elif issubclass(cls, MistralToolParser):
        if chat_template and cls.ARGS in chat_template:
            fmt = calls([tag(f"{cls.BOT}{n}{cls.ARGS}", s, "") for n, s in schemas.items()], "")
        else:
            listed = calls([tag(f'{{"name": "{n}", "arguments": ', s, "}") for n, s in schemas.items()], ", ")
            fmt = {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": f"{cls.BOT}["},
                    listed,
                    {"type": "const_string", "value": "]"},
                ],
            }
    elif issubclass(cls, Qwen3CoderToolParser):
        fmt = calls([_xml_call(cls, n, s) for n, s in schemas.items()], "\n")
    else:
        raise ValueError(f"no forcing grammar for the {cls.name!r} tool-call syntax")
    return GrammarSpec.structural_tag(fmt)


def _xml_call(cls: type[Qwen3CoderToolParser], name: str, schema: dict | bool) -> dict:
    """One call as the Qwen3.5 template writes it: `<tool_call>\n<function=NAME>\n`, then each parameter
    `<parameter=P>\nVALUE\n</parameter>\n`, then `</function>\n</tool_call>`."""
    props = properties(schema)
    required = schema.get("required") if isinstance(schema, dict) else None
    required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    elements = []
    for p in [*props, *(r for r in required if r not in props)]:
        if not p or any(c in p for c in "<>\n"):
            raise ValueError(f"{name}: parameter {p!r} cannot be written as a <parameter=...> tag")
        tag = {
            "type": "tag",
            "begin": f"{cls.PARAM}{p}>\n",
            "content": _xml_value(props.get(p), schema),
            "end": f"\n{cls.PARAM_END}\n",
        }
        elements.append(tag if p in required else {"type": "optional", "content": tag})
    return {
        "type": "tag",
        "begin": f"{cls.OPEN}\n{cls.FUNC}{name}>\n",
        "content": {"type": "sequence", "elements": elements}
        if elements
        else {"type": "const_string", "value": ""},
        "end": f"{cls.FUNC_END}\n{cls.CLOSE}",
    }


def _xml_value(spec: object, root: object) -> dict:
    """A parameter's value: raw text for a string (never a tag of the syntax, so it ends where the parser
    ends it), JSON for any other type (`root`'s $defs kept for its $refs)."""
    kind = param_kind(spec, root)
    spec = resolve(spec, root)
    if not kind.is_string:
        schema = spec if isinstance(spec, (dict, bool)) else {}
        defs = {k: root[k] for k in ("$defs", "definitions") if isinstance(root, dict) and k in root}
        if defs and isinstance(schema, dict):
            schema = {**defs, **schema}
        return {"type": "json_schema", "json_schema": schema}
    tags = Qwen3CoderToolParser.markers
    spec = spec if isinstance(spec, dict) else {}
    values = (
        spec["enum"] if isinstance(spec.get("enum"), list) else [spec["const"]] if "const" in spec else None
    )
    if values is not None:
        texts = [v for v in values if isinstance(v, str) and not any(t in v for t in tags)]
        if texts:
            return {"type": "grammar", "grammar": choice_ebnf(texts), "syntax": "ebnf"}
    if isinstance(spec.get("pattern"), str):
        return {"type": "regex", "pattern": spec["pattern"]}
    low, high = spec.get("minLength"), spec.get("maxLength")
    low = low if isinstance(low, int) and low > 0 else 0
    high = high if isinstance(high, int) and high >= 0 else None
    if low or high is not None:  # counted in whole characters (any_text may write bytes that decode to none)
        return {"type": "regex", "pattern": f"[^<\\ud800-\\udfff]{{{low},{'' if high is None else high}}}"}
    return {"type": "any_text", "excludes": list(tags)}


def tool_schemas(tools: Sequence[dict]) -> dict[str, dict | bool]:
    """Each tool's name -> its parameters' JSON schema; ValueError for a tool not shaped as OpenAI's."""
    return _tool_schemas(tools)


def _tool_schemas(tools: Sequence[dict]) -> dict[str, dict | bool]:
    schemas: dict[str, dict | bool] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"each tool must be {{'type': 'function', 'function': {{...}}}}; got {tool!r}")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ValueError(f"a tool's function name must match [A-Za-z0-9_.:-]+; got {name!r}")
        params = function.get("parameters")
        schemas[name] = params if isinstance(params, (dict, bool)) else {"type": "object"}
    return schemas
