"""Prometheus metrics of the four services and ``/metrics`` in front of a service's ASGI app.

Every metric is defined here, unregistered; ``install(service)`` puts the ones a service
owns in its process's default registry, so each ``/metrics`` shows its own. The list, with
types and labels: docs/observability.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("arena_core.metrics")

#: Seconds, from a cached answer to a long agent turn.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# ------------------------------------------------------------------ rollout service

ROLLOUT_TRANSITIONS = Counter(
    "arena_rollout_transitions", "Rollout state transitions, by the state entered (pending: submitted).",
    ["state"], registry=None)
ROLLOUTS_QUEUED = Gauge(
    "arena_rollouts_queued", "Rollouts waiting for their sandbox (pending, provisioning), as this replica sees them.",
    registry=None)
PROXY_CALLS = Counter(
    "arena_proxy_calls", "LLM calls through the proxy, by API flavour and outcome (ok, incomplete).",
    ["api", "outcome"], registry=None)
PROXY_TOKENS = Counter(
    "arena_proxy_tokens", "Tokens of LLM calls through the proxy, by API flavour and kind (prompt, completion).",
    ["api", "kind"], registry=None)
PROXY_LATENCY = Histogram(
    "arena_proxy_latency_seconds", "Whole LLM calls through the proxy, from the request to the answer's end.",
    ["api"], buckets=LATENCY_BUCKETS, registry=None)
PROXY_FIRST_TOKEN = Histogram(
    "arena_proxy_first_token_seconds", "LLM calls through the proxy, from the request to the first token.",
    ["api"], buckets=LATENCY_BUCKETS, registry=None)


class _ApiMetrics:
    """The proxy's metric children of one API flavour, looked up once (``labels`` costs
    microseconds a call; the proxy records every call)."""

    __slots__ = ("ok", "incomplete", "latency", "first_token", "prompt", "completion")

    def __init__(self, api: str):
        self.ok = PROXY_CALLS.labels(api=api, outcome="ok")
        self.incomplete = PROXY_CALLS.labels(api=api, outcome="incomplete")
        self.latency = PROXY_LATENCY.labels(api=api)
        self.first_token = PROXY_FIRST_TOKEN.labels(api=api)
        self.prompt = PROXY_TOKENS.labels(api=api, kind="prompt")
        self.completion = PROXY_TOKENS.labels(api=api, kind="completion")


_by_api: dict[str, _ApiMetrics] = {}


def proxy_call(api: str, *, incomplete: bool, total_s: float, first_token_s: float, prompt_tokens: int,
               completion_tokens: int) -> None:
    """One LLM call through the proxy in its counters and latency histograms."""
    m = _by_api.get(api)
    if m is None:
        m = _by_api[api] = _ApiMetrics(api)
    (m.incomplete if incomplete else m.ok).inc()
    m.latency.observe(total_s)
    m.first_token.observe(first_token_s)
    if prompt_tokens:
        m.prompt.inc(prompt_tokens)
    if completion_tokens:
        m.completion.inc(completion_tokens)


# ------------------------------------------------------------------ sandbox service

SANDBOXES_IN_FLIGHT = Gauge(
    "arena_sandboxes_in_flight", "Sandbox jobs this worker is running now, by provider.", ["provider"], registry=None)
SANDBOX_RUNS = Counter(
    "arena_sandbox_runs", "Sandbox jobs finished, by provider and outcome (completed, failed, timed_out, ...).",
    ["provider", "outcome"], registry=None)

# ------------------------------------------------------------------ verification service

VERIFICATIONS = Counter(
    "arena_verifications", "Verifications published, by verifier type and outcome (passed, failed, infrastructure).",
    ["verifier", "outcome"], registry=None)

# ------------------------------------------------------------------ trajectory service

STEPS_STORED = Counter("arena_steps_stored", "Steps (LLM calls) stored; steps/s is its rate.", registry=None)
TRAJECTORIES_STORED = Counter(
    "arena_trajectories_stored", "Trajectories assembled and stored, by final state.", ["final_state"], registry=None)


class QueueDepths(Collector):
    """``arena_queue_pending_messages`` (not yet delivered) and ``arena_queue_ack_pending_messages``
    (delivered, not acknowledged) of JetStream consumers, read at scrape time: ``refresh``
    asks the server for each consumer's info (within ``timeout``), ``collect`` reports what
    the last refresh got. A consumer whose info could not be read is left out, not reported stale."""

    def __init__(self, js: Any, consumers: Sequence[tuple[str, str]], *, timeout: float = 0.5):
        self.js = js
        self.consumers = list(consumers)  # (stream, durable)
        self.timeout = timeout
        self.values: dict[tuple[str, str], tuple[int, int]] = {}

    async def refresh(self) -> None:
        async def one(stream: str, durable: str) -> None:
            try:
                info = await asyncio.wait_for(self.js.consumer_info(stream, durable), self.timeout)
            except Exception as exc:  # noqa: BLE001 - not declared yet, NATS away: no value
                log.debug("no consumer info for %s/%s: %s", stream, durable, exc)
                self.values.pop((stream, durable), None)
                return
            self.values[(stream, durable)] = (info.num_pending or 0, info.num_ack_pending or 0)

        await asyncio.gather(*(one(s, d) for s, d in self.consumers))

    def collect(self) -> Iterable[GaugeMetricFamily]:
        pending = GaugeMetricFamily("arena_queue_pending_messages",
                                    "Messages a JetStream consumer has not delivered yet.", labels=["stream", "consumer"])
        acking = GaugeMetricFamily("arena_queue_ack_pending_messages",
                                   "Messages a JetStream consumer delivered that are not acknowledged yet.",
                                   labels=["stream", "consumer"])
        for (stream, durable), (waiting, unacked) in sorted(self.values.items()):
            pending.add_metric([stream, durable], waiting)
            acking.add_metric([stream, durable], unacked)
        yield pending
        yield acking


class BackendLoad(Collector):
    """The proxy's hold on its backends, read at scrape time from ``snapshot``: per replica the
    calls in flight (``arena_backend_inflight``) and its declared bound
    (``arena_backend_max_inflight``), and the calls waiting in the proxy's queue for a slot
    (``arena_proxy_queued_calls``). ``snapshot()`` returns ``([(replica_id, inflight, limit), ...],
    queued)``; no I/O."""

    def __init__(self, snapshot: Callable[[], tuple[Sequence[tuple[str, int, int]], int]]):
        self.snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
        replicas, queued = self.snapshot()
        inflight = GaugeMetricFamily("arena_backend_inflight", "LLM calls this proxy has in flight at a backend "
                                     "replica.", labels=["replica"])
        bound = GaugeMetricFamily("arena_backend_max_inflight", "The most calls this proxy sends a backend replica "
                                  "at once (its declared max_inflight).", labels=["replica"])
        for replica, held, limit in sorted(replicas):
            inflight.add_metric([replica], held)
            bound.add_metric([replica], limit)
        yield inflight
        yield bound
        yield GaugeMetricFamily("arena_proxy_queued_calls", "LLM calls waiting in this proxy's queue for a backend "
                                "slot.", value=queued)


#: The metrics each service serves.
SERVICE_METRICS: dict[str, tuple[Collector, ...]] = {
    "rollout": (ROLLOUT_TRANSITIONS, ROLLOUTS_QUEUED, PROXY_CALLS, PROXY_TOKENS, PROXY_LATENCY, PROXY_FIRST_TOKEN),
    "sandbox": (SANDBOXES_IN_FLIGHT, SANDBOX_RUNS),
    "verification": (VERIFICATIONS,),
    "trajectory": (STEPS_STORED, TRAJECTORIES_STORED),
}


def install(service: str, *extra: Collector, registry: CollectorRegistry = REGISTRY) -> None:
    """Register ``service``'s metrics and ``extra`` collectors (its ``QueueDepths``) in
    ``registry`` (the process's default); what is registered already is kept."""
    for collector in (*SERVICE_METRICS.get(service, ()), *extra):
        try:
            registry.register(collector)
        except ValueError:  # registered before (a second install)
            pass


def verification_outcome(reward: float | None, passed: bool) -> str:
    """``infrastructure`` when Arena could not verify (no reward), else ``passed`` or ``failed``."""
    if reward is None:
        return "infrastructure"
    return "passed" if passed else "failed"


Refresh = Callable[[], Awaitable[None]]


class MetricsRoute:
    """ASGI: ``GET /metrics`` answers the registry in Prometheus' text format (each of
    ``refresh`` awaited first, at most ``refresh_timeout`` seconds in all); any other request
    goes to ``app`` unchanged. Put it outside an API-key guard: scrapers carry no key."""

    def __init__(self, app: Any, *, refresh: Sequence[Refresh] = (), registry: CollectorRegistry = REGISTRY,
                 refresh_timeout: float = 1.0):
        self.app = app
        self.refresh = list(refresh)
        self.registry = registry
        self.refresh_timeout = refresh_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("path") != "/metrics":
            await self.app(scope, receive, send)
            return
        if scope.get("method", "GET") not in ("GET", "HEAD"):
            await _answer(send, 405, b"only GET /metrics\n", b"text/plain; charset=utf-8", [(b"allow", b"GET, HEAD")])
            return
        if self.refresh:
            try:
                await asyncio.wait_for(asyncio.gather(*(r() for r in self.refresh)), self.refresh_timeout)
            except Exception as exc:  # noqa: BLE001 - serve what there is
                log.debug("metrics refresh failed: %s", exc)
        body = generate_latest(self.registry)
        await _answer(send, 200, body, CONTENT_TYPE_LATEST.encode())  # uvicorn sends no body to a HEAD


def metrics_route(app: Any, *, refresh: Sequence[Refresh] = ()) -> MetricsRoute:
    """``app`` with ``GET /metrics`` in front of it (``MetricsRoute``)."""
    return MetricsRoute(app, refresh=refresh)


async def _answer(send, status: int, body: bytes, content_type: bytes,
                  headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
