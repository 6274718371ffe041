"""Request bodies in the OpenAPI schema (/openapi.json, /docs). The routes parse their bodies themselves
(protocol.parse_body: strict types, clear 400s), so FastAPI cannot see them; `body(Model)` declares one in
a route's `openapi_extra`, and `install` adds the models' JSON schemas to the schema's components."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_MODELS: dict[str, type[BaseModel]] = {}


def body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a POST route whose JSON body is `model`."""
    _MODELS[model.__name__] = model
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _MODELS.items():
                model_schema = model.model_json_schema(ref_template=_REF)
                components.update(model_schema.pop("$defs", {}))
                components[name] = model_schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
