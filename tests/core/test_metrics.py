"""The metrics module: which service serves what, ``/metrics`` in front of an app, and queue
depths read from a real JetStream consumer."""

from __future__ import annotations

import httpx
from nats.js import api as jsapi
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from arena_core import metrics


def families(registry: CollectorRegistry) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_each_service_registers_its_own_metrics_once():
    for service, owned in metrics.SERVICE_METRICS.items():
        registry = CollectorRegistry()
        metrics.install(service, registry=registry)
        metrics.install(service, registry=registry)  # a second install keeps what is there
        names = set(registry._names_to_collectors)  # noqa: SLF001 - every name a collector exposes
        assert names and all(n.startswith("arena_") for n in names), names
        others = {c for s, cs in metrics.SERVICE_METRICS.items() if s != service for c in cs}
        assert not others & set(owned)
    assert "arena_proxy_calls_total" in metrics_of("rollout")
    assert {"arena_verifications_total"} <= metrics_of("verification")
    assert {"arena_steps_stored_total", "arena_trajectories_stored_total"} <= metrics_of("trajectory")
    assert "arena_sandboxes_in_flight" in metrics_of("sandbox")


def metrics_of(service: str) -> set[str]:
    registry = CollectorRegistry()
    metrics.install(service, registry=registry)
    return set(registry._names_to_collectors)  # noqa: SLF001


def test_verification_outcomes():
    assert metrics.verification_outcome(None, False) == "infrastructure"
    assert metrics.verification_outcome(1.0, True) == "passed"
    assert metrics.verification_outcome(0.0, False) == "failed"


async def test_the_route_answers_metrics_and_passes_everything_else_on():
    registry = CollectorRegistry()
    counter = metrics.PROXY_CALLS  # module-level, unregistered: registered here only
    registry.register(counter)
    counter.labels(api="openai.chat", outcome="ok").inc(2)
    refreshed = []

    async def refresh() -> None:
        refreshed.append(1)

    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"the app"})

    route = metrics.MetricsRoute(app, refresh=[refresh], registry=registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=route), base_url="http://t") as http:
        answer = await http.get("/metrics")
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain; version=")
        got = {f.name: f for f in text_string_to_metric_families(answer.text)}
        sample = got["arena_proxy_calls"].samples[0]
        assert sample.labels == {"api": "openai.chat", "outcome": "ok"} and sample.value >= 2
        assert refreshed == [1]
        assert (await http.post("/metrics")).status_code == 405
        assert (await http.get("/healthz")).text == "the app"
        assert (await http.get("/metrics/x")).text == "the app"


async def test_queue_depths_come_from_the_consumers(bus):
    await bus.js.add_consumer("ARENA_VERIFY_JOBS", jsapi.ConsumerConfig(
        durable_name="verifier", ack_policy=jsapi.AckPolicy.EXPLICIT, filter_subject="arena.verify.run"))
    for i in range(3):
        await bus.js.publish("arena.verify.run", b"{}", headers={"Nats-Msg-Id": f"m{i}"})
    sub = await bus.js.pull_subscribe_bind("verifier", "ARENA_VERIFY_JOBS")
    (taken,) = await sub.fetch(1, timeout=5)  # delivered, not acknowledged

    depths = metrics.QueueDepths(bus.js, [("ARENA_VERIFY_JOBS", "verifier"), ("ARENA_STEPS", "no-such-consumer")])
    registry = CollectorRegistry()
    registry.register(depths)
    await depths.refresh()
    got = families(registry)
    pending = {(s.labels["stream"], s.labels["consumer"]): s.value for s in got["arena_queue_pending_messages"].samples}
    acking = {(s.labels["stream"], s.labels["consumer"]): s.value for s in got["arena_queue_ack_pending_messages"].samples}
    assert pending == {("ARENA_VERIFY_JOBS", "verifier"): 2}  # an unknown consumer is left out
    assert acking == {("ARENA_VERIFY_JOBS", "verifier"): 1}
    await taken.ack()


def test_a_proxy_call_counts_in_its_flavour():
    registry = CollectorRegistry()
    metrics.install("rollout", registry=registry)

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, labels) or 0.0

    before = (value("arena_proxy_calls_total", api="anthropic.messages", outcome="incomplete"),
              value("arena_proxy_tokens_total", api="anthropic.messages", kind="completion"),
              value("arena_proxy_first_token_seconds_count", api="anthropic.messages"))
    metrics.proxy_call("anthropic.messages", incomplete=True, total_s=0.3, first_token_s=0.1, prompt_tokens=7,
                       completion_tokens=5)
    after = (value("arena_proxy_calls_total", api="anthropic.messages", outcome="incomplete"),
             value("arena_proxy_tokens_total", api="anthropic.messages", kind="completion"),
             value("arena_proxy_first_token_seconds_count", api="anthropic.messages"))
    assert [a - b for a, b in zip(after, before)] == [1, 5, 1]
