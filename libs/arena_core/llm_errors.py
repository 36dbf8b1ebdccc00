"""Errors in the shape of the LLM API an agent speaks, for everything that answers an agent's
call in its place: the rollout service's proxy routes and the sandbox's LLM relay.

OpenAI (Chat Completions, Completions, Responses): ``{"error": {"message", "type", "param", "code"}}``;
Anthropic: ``{"type": "error", "error": {"type", "message"}}``; Gemini: ``{"error": {"code", "message",
"status"}}``. docs/rollout.md, "Errors".
"""

from __future__ import annotations

from typing import Literal

import re

import msgspec

Flavor = Literal["openai", "anthropic", "gemini"]

#: the APIs' own statuses: both answer a malformed request with 400 (Arena's API says 422)
_STATUS = {422: 400}
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                   529: "overloaded_error"}
_GEMINI_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                  405: "INVALID_ARGUMENT", 409: "ABORTED", 413: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED",
                  501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
#: the Gemini API's paths: ``/v1beta/models/{model}:{method}`` (or ``/v1/``)
_GEMINI_PATH = re.compile(r"/v1(?:beta)?/models/[^/]+:[A-Za-z]+$")


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


class _GeminiBody(msgspec.Struct):
    code: int
    message: str
    status: str


class _GeminiError(msgspec.Struct):
    error: _GeminiBody


def gemini_status(status: int) -> str:
    """Google's canonical status name for an HTTP status."""
    return _GEMINI_STATUS.get(status, "INTERNAL" if status >= 500 else "FAILED_PRECONDITION")


def flavor_of(path: str, anthropic_version: bool = False) -> Flavor:
    """Anthropic for the Messages API's paths (and any call that sends ``anthropic-version``),
    Gemini for the Gemini API's, else OpenAI."""
    if anthropic_version or "/v1/messages" in path:
        return "anthropic"
    return "gemini" if _GEMINI_PATH.search(path) else "openai"


def status_of(status: int) -> int:
    return _STATUS.get(status, status)


def body(flavor: Flavor, status: int, code: str, message: str) -> bytes:
    """The error's body in ``flavor``'s shape (its type named by the API's own status)."""
    status = status_of(status)
    if flavor == "gemini":
        return msgspec.json.encode(_GeminiError(error=_GeminiBody(code=status, message=message,
                                                                  status=gemini_status(status))))
    if flavor == "anthropic":
        kind = _ANTHROPIC_TYPE.get(status, "api_error")
        return msgspec.json.encode(_AnthropicError(error=_AnthropicBody(type=kind, message=message)))
    kind = _OPENAI_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return msgspec.json.encode(_OpenAIError(error=_OpenAIBody(message=message, type=kind, param=None, code=code)))
