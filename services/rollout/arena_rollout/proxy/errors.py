"""Errors on the proxy's routes in the shape of the API the agent speaks.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``; Anthropic:
``{"type": "error", "error": {"type", "message"}}``. Every answer carries ``x-request-id``;
errors say ``x-should-retry`` (read by the OpenAI and Anthropic SDKs). docs/rollout.md, "Errors".
"""

from __future__ import annotations

import os
from typing import Literal

import msgspec

from arena_core.errors import ArenaError, Overloaded

Flavor = Literal["openai", "anthropic"]

#: the APIs' own statuses: both answer a malformed request with 400 (Arena's API says 422)
_STATUS = {422: 400}
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                   529: "overloaded_error"}


class _OpenAIBody(msgspec.Struct):
    message: str
    type: str
    param: None
    code: str


class _OpenAIError(msgspec.Struct):
    error: _OpenAIBody


class _AnthropicBody(msgspec.Struct):
    type: str
    message: str


class _AnthropicError(msgspec.Struct, tag_field="type", tag="error"):
    error: _AnthropicBody


def flavor_of(path: str, anthropic_version: bool = False) -> Flavor:
    """Anthropic for the Messages API's paths (and any call that sends ``anthropic-version``)."""
    return "anthropic" if anthropic_version or "/v1/messages" in path else "openai"


def request_id() -> str:
    return "req_" + os.urandom(12).hex()


def status_of(status: int) -> int:
    return _STATUS.get(status, status)


def body(flavor: Flavor, status: int, code: str, message: str) -> bytes:
    status = status_of(status)
    if flavor == "anthropic":
        kind = _ANTHROPIC_TYPE.get(status, "api_error")
        return msgspec.json.encode(_AnthropicError(error=_AnthropicBody(type=kind, message=message)))
    kind = _OPENAI_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return msgspec.json.encode(_OpenAIError(error=_OpenAIBody(message=message, type=kind, param=None, code=code)))


def headers(rid: str, *, retry: bool, retry_after: float | None = None) -> list[tuple[bytes, bytes]]:
    out = [(b"x-request-id", rid.encode()), (b"request-id", rid.encode()),
           (b"x-should-retry", b"true" if retry else b"false")]
    if retry_after is not None:
        out.append((b"retry-after", str(max(1, int(retry_after))).encode()))
    return out


def of(exc: ArenaError, flavor: Flavor, rid: str) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    """``exc`` as (status, body, headers) on a proxy route."""
    retry_after = exc.retry_after if isinstance(exc, Overloaded) else None
    return (status_of(exc.status), body(flavor, exc.status, exc.code, exc.message),
            headers(rid, retry=exc.retryable, retry_after=retry_after))
