"""The rollout service's proxy-only listener (``ARENA_PROXY_PORT``): agents' proxy routes, nothing else.

An ASGI filter in front of the service's own app (same process, same proxy state: budgets,
captures, orphaned calls): a request for one of :data:`arena_core.proxy_routes.ROUTES` below
``/proxy/{rollout_id}`` goes on (the proxy still checks that rollout's key); every other
request -- the rollout API, health, metrics, the judge route, OpenEnv, a percent-encoded or
``..`` path, a WebSocket -- is answered here, 404 in the API's error shape, and never reaches
the API. It is what a Kubernetes sandbox pod may reach (docs/kubernetes.md): a relay inside
the pod shares the agent's network namespace and could not confine it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from arena_core.errors import NotFound
from arena_core.proxy_routes import rollout_route_of

from arena_rollout.app import error_response
from arena_rollout.proxy import errors


class ProxyOnly:
    """``app`` with every request but the agents' proxy routes answered 404 here."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if kind != "http":
            return  # lifespan is off; nothing else is served here
        if self.allowed(scope):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        response = error_response(NotFound(f"no route for {scope['method']} {path[:200]}"), Request(scope))
        if "x-request-id" not in response.headers:
            response.headers["x-request-id"] = errors.request_id()
        await response(scope, receive, send)

    @staticmethod
    def allowed(scope) -> bool:
        """Whether the request is one of the proxy routes: its raw target (no percent-encoding,
        no dot tricks: :func:`arena_core.proxy_routes.rollout_route_of`) and the decoded path
        the app routes on are the same route."""
        raw = scope.get("raw_path") or b""
        query = scope.get("query_string") or b""
        target = raw + b"?" + query if query else raw
        if rollout_route_of(scope["method"].encode("latin-1"), target) is None:
            return False
        return raw == scope["path"].encode("latin-1")
