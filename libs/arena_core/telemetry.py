"""OpenTelemetry set-up, OTLP export, and W3C trace context carried in NATS message headers.

One rollout is one trace: the rollout service starts it at submission, every message
published on the rollout's behalf carries ``traceparent``, and the rollout record keeps it
for the proxy (whose HTTP callers, the agents, send none). docs/observability.md.

Without an exporter (``ARENA_OTLP_ENDPOINT``) or ``ARENA_OTEL_CONSOLE=1`` no SDK provider is
installed: spans are OpenTelemetry's no-op ones, and ``enabled()`` lets hot paths skip even those.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult

log = logging.getLogger("arena_core.telemetry")

PROTOCOLS = ("http/protobuf", "grpc")
#: Seconds one OTLP export may take; a service's exit waits at most ``SHUTDOWN_S`` for the last spans.
EXPORT_TIMEOUT_S = 5.0
SHUTDOWN_S = 5.0

_provider: TracerProvider | None = None
_enabled = False


class TelemetryError(ValueError):
    """The OTLP endpoint or protocol is not usable; the message names the variable."""


def otlp_exporter(endpoint: str, protocol: str = "http/protobuf") -> SpanExporter:
    """An OTLP span exporter: ``http/protobuf`` to ``endpoint`` (``http://host:4318``; the
    ``/v1/traces`` path is added unless given) or ``grpc`` (``http://host:4317``, plaintext
    for ``http://``, TLS for ``https://``). Headers, certificates and compression come from
    the standard ``OTEL_EXPORTER_OTLP_*`` variables, which the exporters read themselves."""
    url = urlparse(endpoint)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise TelemetryError(f"ARENA_OTLP_ENDPOINT={endpoint!r} must be an http(s) URL")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=url.netloc, insecure=url.scheme == "http", timeout=EXPORT_TIMEOUT_S)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        path = url.path.rstrip("/")
        full = endpoint if path.endswith("/v1/traces") else url._replace(path=f"{path}/v1/traces").geturl()
        return HttpExporter(endpoint=full, timeout=EXPORT_TIMEOUT_S)
    raise TelemetryError(f"ARENA_OTLP_PROTOCOL={protocol!r} must be one of {', '.join(PROTOCOLS)}")


def setup(service: str, *, otlp_endpoint: str | None = None, otlp_protocol: str | None = None) -> None:
    """Install a tracer provider for ``arena-{service}`` (its ``service.name``) when spans go
    somewhere: to ``otlp_endpoint`` (default ``ARENA_OTLP_ENDPOINT``) over ``otlp_protocol``
    (default ``ARENA_OTLP_PROTOCOL``, else ``http/protobuf``) through a ``BatchSpanProcessor``,
    and/or to stdout with ``ARENA_OTEL_CONSOLE=1``. Idempotent; ``shutdown`` flushes."""
    global _provider, _enabled
    if _provider is not None:
        return
    endpoint = os.environ.get("ARENA_OTLP_ENDPOINT", "") if otlp_endpoint is None else otlp_endpoint
    protocol = (os.environ.get("ARENA_OTLP_PROTOCOL", "") if otlp_protocol is None else otlp_protocol) or PROTOCOLS[0]
    console = os.environ.get("ARENA_OTEL_CONSOLE") == "1"
    if not endpoint and not console:
        return
    # OTEL_TRACES_SAMPLER, when set, is the SDK's to read
    sampler = None if os.environ.get("OTEL_TRACES_SAMPLER") else ParentBased(root=NoProbes())
    provider = TracerProvider(resource=Resource.create({"service.name": f"arena-{service}"}), sampler=sampler)
    if endpoint:
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter(endpoint, protocol)))
        log.info("exporting traces to %s (OTLP %s)", endpoint, protocol)
    if console:
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider, _enabled = provider, True


#: Request paths whose traces are dropped: supervisors and load balancers poll them every second.
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


class NoProbes(Sampler):
    """Samples every root span but a request to one of ``PROBES`` (FastAPI's server span
    names its ``url.path``)."""

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        if attributes and attributes.get("url.path") in PROBES:
            return SamplingResult(Decision.DROP)
        return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return "NoProbes"


def shutdown(timeout_s: float = SHUTDOWN_S) -> None:
    """Export the spans still queued and stop the exporter, waiting at most ``timeout_s``
    (an unreachable collector must not hold a stopping service)."""
    global _enabled
    provider = _provider
    if provider is None:
        return
    _enabled = False
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        log.warning("the last spans were not exported within %.0f s", timeout_s)


def enabled() -> bool:
    """Whether spans are recorded (an exporter is installed): hot paths skip tracing work otherwise."""
    return _enabled


def tracer() -> trace.Tracer:
    return trace.get_tracer("arena")


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add ``traceparent`` of the current span to ``headers`` (in place) and return them."""
    if context.get_current():  # an empty context (no span, no baggage) has nothing to add: every publish asks
        propagate.inject(headers)
    return headers


def traceparent() -> str:
    """The current span's ``traceparent`` (to store beside what it describes), "" when there is none."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def trace_id() -> str | None:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def _parent(parent: Mapping[str, str] | str | None) -> context.Context:
    """The context of message headers, or of a bare ``traceparent`` string."""
    carrier = {"traceparent": parent} if isinstance(parent, str) else dict(parent or {})
    return propagate.extract(carrier)


@contextmanager
def span_from_headers(name: str, headers: Mapping[str, str] | str | None, **attributes) -> Iterator[trace.Span]:
    """Run a block in a span that continues the trace found in message ``headers`` (or a
    stored ``traceparent``)."""
    token = context.attach(_parent(headers))
    try:
        with tracer().start_as_current_span(name, attributes=attributes) as span:
            yield span
    finally:
        context.detach(token)


def record_span(name: str, *, parent: Mapping[str, str] | str | None, start: float, end: float,
                attributes: Mapping[str, Any] | None = None) -> None:
    """A finished span with explicit wall-clock ``start`` and ``end`` (seconds since the
    epoch), child of ``parent`` (message headers, a ``traceparent``, or none: the current
    span): a wait nobody was inside of (the queue), or work done for many rollouts at once
    (storing a batch). A no-op when tracing is off."""
    if not _enabled:
        return
    ctx = _parent(parent) if parent else None
    span = tracer().start_span(name, context=ctx, attributes=attributes, start_time=_ns(start))
    span.end(end_time=_ns(max(end, start)))


@contextmanager
def started_span(name: str, *, parent: Mapping[str, str] | str | None, start: float, end: float | None = None,
                 attributes: Mapping[str, Any] | None = None) -> Iterator[trace.Span]:
    """Like ``record_span``, but current for the block (messages published in it carry it);
    it ends at ``end`` if given, else when the block does."""
    if not _enabled:
        yield trace.INVALID_SPAN
        return
    ctx = _parent(parent) if parent else None
    span = tracer().start_span(name, context=ctx, attributes=attributes, start_time=_ns(start))
    try:
        with trace.use_span(span, end_on_exit=False, record_exception=True, set_status_on_exception=True):
            yield span
    finally:
        span.end(end_time=None if end is None else _ns(max(end, start)))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
