"""The proxy routes an agent may call, in one place: the sandbox relay (arena_sandbox_providers/relay.py)
and the rollout service's proxy-only listener (``ARENA_PROXY_PORT``, arena_rollout/proxy_only.py)
both let through exactly these, below a rollout's prefix ``/proxy/{rollout_id}``, and answer
anything else 404 in the API's error shape. See docs/sandbox.md ("The LLM relay").
"""

from __future__ import annotations

import re

from arena_core.schemas import valid_id

#: The proxy routes an agent may call, below its rollout's prefix (``/proxy/{rollout_id}``):
#: the LLM APIs, Anthropic's token count, the model list and vLLM's (de)tokenize -- the
#: ``/proxy/{rollout_id}/...`` routes of arena_rollout/app.py (the Gemini API's, whose path
#: names a model, in :data:`GEMINI`). A route added there is refused to agents until it is
#: added here.
ROUTES: frozenset[tuple[bytes, str]] = frozenset({
    (b"POST", "/v1/chat/completions"),
    (b"POST", "/v1/completions"),
    (b"POST", "/v1/messages"),
    (b"POST", "/v1/messages/count_tokens"),
    (b"POST", "/v1/responses"),
    (b"GET", "/v1/models"),
    (b"POST", "/tokenize"),
    (b"POST", "/v1/tokenize"),
    (b"POST", "/detokenize"),
    (b"POST", "/v1/detokenize"),
})

#: The Gemini API's routes (POST): ``/v1beta/models/{model}:{method}``, also under ``/v1/``.
GEMINI = re.compile(r"/v1(?:beta)?/models/[A-Za-z0-9_.-]+:(?:generateContent|streamGenerateContent|countTokens)")

#: An origin-form target of plain path characters and an optional query: no percent-encoding,
#: no absolute form, no ``*``, no fragment; ``.`` and ``..`` segments never equal a route.
_TARGET = re.compile(rb"(/[A-Za-z0-9_./:-]*)(?:\?[\x21-\x7e]*)?")
_PREFIX = "/proxy/"


def path_of(target: bytes) -> str | None:
    """The path of an origin-form request target of plain path characters, or None."""
    match = _TARGET.fullmatch(target)
    return None if match is None else match[1].decode("ascii")


def route_of(method: bytes, target: bytes, prefix: str) -> str | None:
    """The route below ``prefix`` (``/proxy/{rollout_id}``) that ``method target`` calls, or
    None: not one of :data:`ROUTES`."""
    path = path_of(target)
    if path is None or not path.startswith(prefix + "/"):
        return None
    route = path[len(prefix):]
    if (method, route) in ROUTES or (method == b"POST" and GEMINI.fullmatch(route)):
        return route
    return None


def rollout_route_of(method: bytes, target: bytes) -> tuple[str, str] | None:
    """``(rollout_id, route)`` when ``method target`` is one of :data:`ROUTES` below some
    rollout's prefix (an id of the id grammar), else None. Which rollout's key it needs is
    the proxy's to check."""
    path = path_of(target)
    if path is None or not path.startswith(_PREFIX):
        return None
    rollout_id, sep, _ = path[len(_PREFIX):].partition("/")
    if not sep or not valid_id(rollout_id):
        return None
    route = route_of(method, target, _PREFIX + rollout_id)
    return None if route is None else (rollout_id, route)
