"""OpenTelemetry set-up and W3C trace context carried in NATS message headers.

One rollout is one trace: the rollout service starts it at submission and every
message published on the rollout's behalf carries ``traceparent``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

_configured = False


def setup(service: str) -> None:
    """Install a tracer provider. Spans print only with ``ARENA_OTEL_CONSOLE=1``;
    point a real exporter at it with the standard OTEL_* variables in production."""
    global _configured
    if _configured:
        return
    provider = TracerProvider(resource=Resource.create({"service.name": f"arena-{service}"}))
    if os.environ.get("ARENA_OTEL_CONSOLE") == "1":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True


def tracer() -> trace.Tracer:
    return trace.get_tracer("arena")


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add ``traceparent`` of the current span to ``headers`` (in place) and return them."""
    propagate.inject(headers)
    return headers


def trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


@contextmanager
def span_from_headers(name: str, headers: Mapping[str, str] | None, **attributes) -> Iterator[trace.Span]:
    """Run a block in a span that continues the trace found in message ``headers``."""
    ctx = propagate.extract(dict(headers or {}))
    token = context.attach(ctx)
    try:
        with tracer().start_as_current_span(name, attributes=attributes) as span:
            yield span
    finally:
        context.detach(token)
