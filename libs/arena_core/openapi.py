"""OpenAPI fragments from the msgspec schemas: request bodies, answers and the error shape, so a
service's OpenAPI document describes the bodies it really reads and writes. See docs/schemas.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from arena_core.schemas import ErrorResponse

REF = "#/components/schemas/{name}"

#: What each error status means on Arena's APIs (the body is always an ``ErrorResponse``).
ERROR_MEANINGS: Mapping[int, str] = {
    400: "the request cannot be used as sent (an upstream refused it)",
    401: "no or a wrong key",
    403: "refused for good: the rollout's budget or wall clock is spent",
    404: "no such resource",
    405: "the path does not take this method",
    409: "the resource is not in a state that allows this",
    413: "the body is over the limit",
    422: "the request is not valid: the message names each problem",
    429: "the queue is full: try again after Retry-After",
    502: "the upstream failed",
    503: "a dependency (NATS, the store) is unavailable now",
}


def ref(struct: type) -> dict[str, str]:
    return {"$ref": REF.format(name=struct.__name__)}


def json_content(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": dict(schema)}}}


def answer(schema: type | Mapping[str, Any], description: str = "OK") -> dict[str, Any]:
    """A documented answer whose JSON body is the Struct ``schema`` (or a JSON Schema)."""
    body = ref(schema) if isinstance(schema, type) else schema
    return {"description": description, **json_content(body)}


def errors(*statuses: int) -> dict[int, dict[str, Any]]:
    """Documented error answers (``ErrorResponse`` bodies), for FastAPI's ``responses=``."""
    return {s: {"description": ERROR_MEANINGS[s], **json_content(ref(ErrorResponse))} for s in statuses}


def api_errors(*statuses: int) -> dict[int, dict[str, Any]]:
    """Documented error answers of the LLM proxy, in the shape of the API called (OpenAI's
    ``{"error": {...}}`` or Anthropic's ``{"type": "error", "error": {...}}``)."""
    shape = {"type": "object", "properties": {"error": {"type": "object"}}, "required": ["error"]}
    return {s: {"description": ERROR_MEANINGS[s], **json_content(shape)} for s in statuses}


def request_body(struct: type, *, media_type: str = "application/json") -> dict[str, Any]:
    """``openapi_extra`` for a route that decodes its body itself (msgspec), so the document shows it."""
    return {"requestBody": {"required": True, "content": {media_type: {"schema": ref(struct)}}}}


def request_body_schema(schema: Mapping[str, Any], *, media_type: str = "application/json") -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is any ``schema`` (e.g. a proxied LLM call)."""
    return {"requestBody": {"required": True, "content": {media_type: {"schema": dict(schema)}}}}


def add_components(document: dict[str, Any], structs: Iterable[type]) -> dict[str, Any]:
    """``document`` with the JSON Schemas of ``structs`` (and those they use) as components."""
    _, components = msgspec.json.schema_components([ErrorResponse, *structs], ref_template=REF)
    document.setdefault("components", {}).setdefault("schemas", {}).update(components)
    return document


def install(app: Any, structs: Iterable[type]) -> None:
    """Make a FastAPI ``app``'s OpenAPI document carry ``structs``' schemas."""
    structs = list(structs)
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = add_components(generate(), structs)
        return app.openapi_schema

    app.openapi = openapi
