"""End to end: one rollout is one trace across the four services, exported over OTLP/HTTP to a
real receiver in this test, and each service's ``/metrics`` (no API key, with keys enforced)
counts what the rollout did."""

from __future__ import annotations

import asyncio
import gzip
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from prometheus_client.parser import text_string_to_metric_families

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
SERVICES = {"arena-rollout", "arena-sandbox", "arena-verification", "arena-trajectory"}
REQUIRED = {"submission", "queue", "sandbox.start", "sandbox.run", "llm.call", "verification", "storage"}

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


class Span:
    __slots__ = ("service", "trace_id", "span_id", "parent_id", "name", "attributes")

    def __init__(self, service: str, span, attributes: dict[str, object]):
        self.service = service
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_id = span.parent_span_id.hex()
        self.name = span.name
        self.attributes = attributes

    def __repr__(self) -> str:
        return f"{self.service}:{self.name}({self.span_id}<-{self.parent_id or 'root'})"


def _value(any_value) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver:
    """An OTLP/HTTP trace receiver: ``POST /v1/traces`` with an ``ExportTraceServiceRequest``
    (protobuf, gzipped or not); keeps every span it gets."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                receiver.add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest) -> None:
        got = []
        for resource_spans in request.resource_spans:
            service = next((_value(a.value) for a in resource_spans.resource.attributes if a.key == "service.name"), "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    got.append(Span(str(service), span, {a.key: _value(a.value) for a in span.attributes}))
        with self.lock:
            self.spans += got

    def trace(self, rollout_id: str) -> list[Span]:
        """Every span of the trace of ``rollout_id``'s submission span ([] before it came)."""
        with self.lock:
            spans = list(self.spans)
        root = next((s for s in spans if s.name == "submission" and s.attributes.get("arena.rollout_id") == rollout_id),
                    None)
        return [] if root is None else [s for s in spans if s.trace_id == root.trace_id]

    def __enter__(self) -> OtlpReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def whole(spans: list[Span]) -> bool:
    """Every required span is in, and every parent a span names has arrived."""
    ids = {s.span_id for s in spans}
    return REQUIRED <= {s.name for s in spans} and all(not s.parent_id or s.parent_id in ids for s in spans)


def scrape(url: str) -> dict[str, list]:
    """``/metrics`` of one service: family name -> samples (no API key sent)."""
    answer = httpx.get(url, timeout=10)
    assert answer.status_code == 200, (url, answer.status_code, answer.text[:300])
    return {f.name: f.samples for f in text_string_to_metric_families(answer.text)}


def total(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def test_a_rollout_is_one_trace_and_every_service_counts_it(tmp_path, receiver, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # the services export every 0.2 s, not 5 s
    settings = Settings(
        nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
        rollout_port=(rp := free_port()), trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
        auth="keys",  # /metrics must answer without a key all the same
        otlp_endpoint=receiver.endpoint,
    )
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        key = stack.api_key  # issued at start, once the services accepted it
        client = ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=key)

        rid = client.submit(load_task(QUICKSTART)).rollout_id
        view = client.wait(rid, timeout=120)
        assert view.state.value == "completed", (view.state, view.reason)
        client.wait_trajectory(rid, timeout=30)

        deadline = time.monotonic() + 30
        while not whole(spans := receiver.trace(rid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        # one trace: every span about this rollout is in it
        with receiver.lock:
            about = [s for s in receiver.spans if s.attributes.get("arena.rollout_id") == rid]
        assert about and {s.trace_id for s in about} == {spans[0].trace_id}, about
        names = [s.name for s in spans]
        assert REQUIRED <= set(names), sorted(names)
        assert names.count("llm.call") >= 1 and SERVICES <= {s.service for s in spans}, spans
        by_name = {s.name: s for s in spans}
        assert {by_name[n].service for n in ("submission", "llm.call")} == {"arena-rollout"}
        assert {by_name[n].service for n in ("queue", "sandbox.start", "sandbox.run")} == {"arena-sandbox"}
        assert by_name["verification"].service == "arena-verification"
        assert by_name["storage"].service == "arena-trajectory"
        # parent links: one root, the POST's (FastAPI's server span, where FastAPI traces
        # requests, else the submission), and every other span's parent in the trace
        ids = {s.span_id: s for s in spans}
        roots = [s for s in spans if not s.parent_id]
        assert len(roots) == 1 and roots[0].service == "arena-rollout", roots
        assert roots[0].name in ("submission", "POST /v1/rollouts"), roots
        assert all(s.parent_id in ids for s in spans if s.parent_id), spans
        ancestor = by_name["submission"]
        while ancestor.parent_id:
            ancestor = ids[ancestor.parent_id]
            assert ancestor.service == "arena-rollout", ancestor
        call = by_name["llm.call"]
        assert call.attributes["arena.step_index"] == 0 and call.attributes["arena.backend_replica"]
        assert call.attributes["gen_ai.usage.output_tokens"] > 0 and call.attributes["gen_ai.request.model"]

        host = f"http://{settings.host}"
        rollout = scrape(f"{settings.rollout_url}/metrics")
        assert total(rollout["arena_proxy_calls"], "arena_proxy_calls_total", outcome="ok") >= 1
        assert total(rollout["arena_proxy_tokens"], "arena_proxy_tokens_total", kind="completion") >= 1
        assert total(rollout["arena_proxy_latency_seconds"], "arena_proxy_latency_seconds_count") >= 1
        assert total(rollout["arena_proxy_first_token_seconds"], "arena_proxy_first_token_seconds_count") >= 1
        assert total(rollout["arena_rollout_transitions"], "arena_rollout_transitions_total", state="completed") >= 1
        assert "arena_rollouts_queued" in rollout
        # the proxy's hold on its backend: its bound, what is in flight now (nothing), the queue
        assert [(s.labels, s.value) for s in rollout["arena_backend_max_inflight"]] == [({"replica": "default"}, 64)]
        assert [s.value for s in rollout["arena_backend_inflight"]] == [0] and "arena_proxy_queued_calls" in rollout
        sandbox = scrape(f"{host}:{stack.settings.sandbox_health_port}/metrics")
        assert [s.labels for s in sandbox["arena_sandboxes_in_flight"]] == [{"provider": "local"}]
        assert total(sandbox["arena_sandbox_runs"], "arena_sandbox_runs_total", outcome="completed") >= 1
        assert any(s.labels["consumer"] == "sandbox-local" for s in sandbox["arena_queue_pending_messages"])
        verification = scrape(f"{host}:{stack.settings.verification_health_port}/metrics")
        outcomes = {s.labels["outcome"] for s in verification["arena_verifications"] if s.value >= 1
                    and s.name == "arena_verifications_total"}
        assert outcomes and outcomes <= {"passed", "failed"}, outcomes
        trajectory = scrape(f"{settings.trajectory_url}/metrics")
        assert total(trajectory["arena_trajectories_stored"], "arena_trajectories_stored_total",
                     final_state="completed") >= 1
        assert total(trajectory["arena_steps_stored"], "arena_steps_stored_total") >= 1
        assert {s.labels["consumer"] for s in trajectory["arena_queue_pending_messages"]} >= {"trajectory-steps"}
    finally:
        stack.stop()
