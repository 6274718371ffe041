"""The output constraint a request asks for, from whichever dialect it speaks: OpenAI `response_format`,
vLLM `structured_outputs` and `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar`, SGLang's
`json_schema`/`regex`/`ebnf`/`structural_tag` sampling params. At most one constraint per request.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from longserve.structured.spec import GrammarSpec


def grammar_spec_from_request(fields: Mapping[str, Any]) -> GrammarSpec | None:
    """The GrammarSpec of a request body (or SGLang sampling_params); None if it constrains nothing.
    ValueError names the field at fault, and says so when two fields each ask for a constraint."""
    found: list[tuple[str, GrammarSpec]] = []

    def add(field: str, make) -> None:
        value = fields.get(field)
        if value is None or value is False:
            return
        try:
            spec = make(value)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        if spec is not None:
            found.append((field, spec))

    add("response_format", _from_response_format)
    add("structured_outputs", _from_structured_outputs)
    add("guided_json", GrammarSpec.json_schema)
    add("guided_regex", GrammarSpec.regex)
    add("guided_choice", GrammarSpec.choice)
    add("guided_grammar", GrammarSpec.grammar)
    add("json_schema", GrammarSpec.json_schema)  # SGLang: a JSON string
    add("regex", GrammarSpec.regex)  # SGLang
    add("ebnf", GrammarSpec.grammar)  # SGLang
    add("structural_tag", _structural_tag)  # SGLang: a JSON string
    if len(found) > 1:
        raise ValueError(f"only one output constraint per request; got {', '.join(f for f, _ in found)}")
    return found[0][1] if found else None


def _from_response_format(rf: Any) -> GrammarSpec | None:
    if not isinstance(rf, Mapping):
        raise ValueError(f"must be an object with a 'type'; got {rf!r}")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, Mapping):
            raise ValueError("type json_schema needs a 'json_schema' object with a 'schema'")
        schema = js.get("schema", js.get("json_schema"))  # "json_schema" as some clients misname it
        return GrammarSpec.json_object() if schema is None else GrammarSpec.json_schema(schema)
    if kind == "structural_tag":
        return _structural_tag(rf)
    raise ValueError(f"type must be text, json_object, json_schema or structural_tag; got {kind!r}")


def structured_outputs_spec(so: Any) -> GrammarSpec | None:
    """The GrammarSpec of vLLM's StructuredOutputsParams fields (a dict: json, regex, choice, grammar,
    json_object, structural_tag), as `SamplingParams(structured_outputs=...)` takes them offline."""
    try:
        return _from_structured_outputs(so)
    except ValueError as e:
        raise ValueError(f"structured_outputs: {e}") from None


def _from_structured_outputs(so: Any) -> GrammarSpec | None:
    if not isinstance(so, Mapping):
        raise ValueError(f"must be an object; got {so!r}")
    makers = {
        "json": GrammarSpec.json_schema,
        "regex": GrammarSpec.regex,
        "choice": GrammarSpec.choice,
        "grammar": GrammarSpec.grammar,
        "json_object": lambda v: GrammarSpec.json_object() if v else None,
        "structural_tag": _structural_tag,
    }
    given = [k for k in makers if so.get(k) not in (None, False)]
    if len(given) > 1:
        raise ValueError(f"set one of {', '.join(makers)}; got {', '.join(given)}")
    return makers[given[0]](so[given[0]]) if given else None


def _structural_tag(value: Any) -> GrammarSpec:
    """xgrammar's structural tag ({"format": ...}), or vLLM's older form ({"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}), which is the same as triggered tags."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(value, Mapping):
        raise ValueError("a structural tag must be an object")
    if "structures" in value:
        structures, triggers = value.get("structures"), value.get("triggers")
        if not isinstance(structures, list) or not isinstance(triggers, list):
            raise ValueError("'structures' and 'triggers' must be lists")
        tags = [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s.get("schema", True)},
                "end": s["end"],
            }
            for s in structures
            if isinstance(s, Mapping) and "begin" in s and "end" in s
        ]
        if len(tags) != len(structures):
            raise ValueError("each structure needs 'begin' and 'end'")
        return GrammarSpec.structural_tag({"type": "triggered_tags", "triggers": triggers, "tags": tags})
    if "format" not in value:
        raise ValueError("a structural tag needs a 'format' (or vLLM's 'structures' and 'triggers')")
    return GrammarSpec.structural_tag({"type": "structural_tag", "format": value["format"]})
