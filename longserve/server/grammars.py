"""Output constraints of HTTP requests: which field asks for one (OpenAI `response_format`, vLLM
`structured_outputs` / `guided_*`, SGLang `json_schema` / `regex` / `ebnf` / `structural_tag`), and its
compilation in a small thread pool of its own, off the event loop and off the engine thread, through the
engine's compiler (which caches compiled grammars, so a repeated schema costs a lookup).

A constraint that cannot compile is a 400 naming the field; one past MAX_GRAMMAR_CHARS is refused before it
is compiled (a huge schema could keep a compile thread busy for long); one still compiling at the request's
deadline is a 504 (its thread finishes, bounded by that size, and the result is dropped).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from longserve.engine import Engine
from longserve.server.errors import APIError
from longserve.structured.grammar import StructuredOutputsUnavailable
from longserve.structured.request_formats import grammar_spec_from_request
from longserve.structured.spec import GrammarSpec

# the request fields that may carry an output constraint, in the order grammar_spec_from_request reads them
CONSTRAINT_FIELDS = (
    "response_format",  # OpenAI
    "structured_outputs",  # vLLM
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "json_schema",  # SGLang
    "regex",
    "ebnf",
    "structural_tag",
)
MAX_GRAMMAR_CHARS = 256 * 1024  # a JSON schema, regex or grammar; OpenAI's own limits are far below this
BACKENDS = (None, "auto", "xgrammar")  # vLLM's guided_decoding_backend values this server honours


def constraint_fields(req: Any) -> dict[str, Any]:
    """The constraint fields a parsed request body (pydantic model, or SGLang's sampling_params) sets."""
    names = (*CONSTRAINT_FIELDS, "guided_decoding_backend", "guided_whitespace_pattern")
    return {f: getattr(req, f) for f in names if getattr(req, f, None) is not None}


def spec_of(fields: Mapping[str, Any]) -> tuple[GrammarSpec | None, str | None]:
    """The request's constraint and the field it came from; (None, None) if it constrains nothing.
    APIError 400 names the field at fault (or says two fields each ask for a constraint)."""
    backend = fields.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise APIError(
            400,
            f"guided_decoding_backend {backend!r} is not available; this server's is xgrammar",
            param="guided_decoding_backend",
        )
    if fields.get("guided_whitespace_pattern") is not None:
        raise APIError(
            400,
            "guided_whitespace_pattern is not supported (xgrammar has no whitespace pattern); the server's "
            "--structured-outputs-max-whitespace bounds JSON whitespace",
            param="guided_whitespace_pattern",
        )
    try:
        spec = grammar_spec_from_request(fields)
    except ValueError as e:
        message = str(e)
        field = message.split(":", 1)[0]
        raise APIError(400, message, param=field if field in CONSTRAINT_FIELDS else None) from None
    if spec is None:
        return None, None
    field = next(f for f in CONSTRAINT_FIELDS if fields.get(f) not in (None, False))
    return spec, field


class GrammarService:
    """Compiles the constraints of one server's requests with its engine's compiler."""

    def __init__(self, engine: Engine, num_workers: int = 2) -> None:
        self._engine = engine
        self._executor = ThreadPoolExecutor(num_workers, thread_name_prefix="longserve-grammar")

    async def compile(self, spec: GrammarSpec, param: str | None, deadline: float | None) -> Any:
        """The compiled grammar of `spec` (param: the request field it came from, named in errors)."""
        if len(spec.text) > MAX_GRAMMAR_CHARS:
            raise APIError(
                400,
                f"{param}: the {spec.kind} constraint has {len(spec.text):,} characters; at most "
                f"{MAX_GRAMMAR_CHARS:,} are compiled",
                param=param,
            )
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, self._compile, spec)
        try:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise APIError(
                504,
                "request timed out (--request-timeout) while its output constraint compiled",
                code="timeout",
            ) from None
        except (ValueError, StructuredOutputsUnavailable) as e:
            # the constraint's own fault (xgrammar's reason, without its internals), or one this server cannot
            # enforce (no xgrammar here): refused as the server refuses the fields it does not support, a 400
            raise APIError(400, f"{param}: {e}" if param else str(e), param=param) from None

    def _compile(self, spec: GrammarSpec) -> Any:
        return self._engine.grammar_compiler.compile(spec)

    async def compile_fields(self, fields: Mapping[str, Any], deadline: float | None) -> Any | None:
        """spec_of + compile: the compiled constraint of a request's fields, None if it has none."""
        spec, field = spec_of(fields)
        return None if spec is None else await self.compile(spec, field, deadline)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
