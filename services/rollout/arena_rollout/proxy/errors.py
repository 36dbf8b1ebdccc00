"""Errors on the proxy's routes in the shape of the API the agent speaks (the shapes:
``arena_core.llm_errors``, shared with the sandbox's LLM relay). Every answer carries ``x-request-id``;
errors say ``x-should-retry`` (read by the OpenAI and Anthropic SDKs). docs/rollout.md, "Errors".
"""

from __future__ import annotations

import os

from arena_core.errors import ArenaError, Overloaded
from arena_core.llm_errors import Flavor, body, flavor_of, status_of  # noqa: F401 - this module's API


def request_id() -> str:
    return "req_" + os.urandom(12).hex()


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
