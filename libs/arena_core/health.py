"""Liveness and readiness of a service: ``/healthz`` and ``/readyz`` as a tiny ASGI app, for the
services with no HTTP API of their own (sandbox, verification). See docs/reliability.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from arena_core.bus import Bus

#: A readiness check: ``None`` when it holds, else what is wrong.
Check = Callable[[], Awaitable[str | None]]


class Health(msgspec.Struct):
    status: str
    problem: str = ""


def live(bus: Bus) -> str | None:
    """Liveness: ``None`` while the bus is connected or reconnecting; a closed connection (nats-py
    gave up, e.g. after a protocol error) is for good, and the supervisor must restart us."""
    nc = bus.nc
    if nc.is_connected or nc.is_reconnecting or nc.is_connecting:
        return None
    return "the NATS connection is closed"


async def ready(bus: Bus, *, streams: Sequence[str] = (), checks: Sequence[Check] = (),
                timeout: float = 2.0) -> str | None:
    """Readiness: NATS connected, ``streams`` present, each of ``checks`` holding (within ``timeout``)."""
    if not bus.nc.is_connected:
        return "not connected to NATS"
    try:
        async with asyncio.timeout(timeout):
            for stream in streams:
                try:
                    await bus.js.stream_info(stream)
                except Exception as exc:  # noqa: BLE001 - any failure means not ready
                    return f"stream {stream} unavailable: {type(exc).__name__}"
            for check in checks:
                problem = await check()
                if problem:
                    return problem
    except TimeoutError:
        return f"readiness checks took over {timeout:.0f} s"
    return None


def health_app(bus: Bus, *, streams: Sequence[str] = (), checks: Sequence[Check] = ()):
    """An ASGI app answering ``GET /healthz`` and ``GET /readyz`` (200 or 503 with a ``Health``
    body); any other path is 404."""
    encoder = msgspec.json.Encoder()

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope.get("path", "")
        if path == "/healthz":
            problem = live(bus)
            body = Health(status="ok" if problem is None else "unhealthy", problem=problem or "")
        elif path == "/readyz":
            problem = await ready(bus, streams=streams, checks=checks)
            body = Health(status="ready" if problem is None else "not ready", problem=problem or "")
        else:
            problem = "not found"
            body = Health(status="not found", problem=f"no route {path}; try /healthz or /readyz")
        status = 200 if problem is None else 404 if body.status == "not found" else 503
        data = encoder.encode(body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app
