"""Trace export: the OTLP exporters ``telemetry.setup`` builds from the settings, and spans
reaching a real OTLP/gRPC receiver from a process set up with ``ARENA_OTLP_PROTOCOL=grpc``."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from arena_core import telemetry
from arena_core.settings import Settings, SettingsError


@pytest.mark.parametrize("endpoint,protocol,expected", [
    ("http://127.0.0.1:4318", "http/protobuf", "http://127.0.0.1:4318/v1/traces"),
    ("http://collector:4318/v1/traces", "http/protobuf", "http://collector:4318/v1/traces"),
    ("https://tempo.example/otlp/", "http/protobuf", "https://tempo.example/otlp/v1/traces"),
])
def test_otlp_http_endpoints_get_the_traces_path(endpoint, protocol, expected):
    exporter = telemetry.otlp_exporter(endpoint, protocol)
    assert exporter._endpoint == expected  # noqa: SLF001


def test_otlp_settings_are_checked():
    with pytest.raises(telemetry.TelemetryError):
        telemetry.otlp_exporter("http://127.0.0.1:4317", "thrift")
    with pytest.raises(SettingsError, match="ARENA_OTLP_ENDPOINT"):
        Settings.from_env({"ARENA_OTLP_ENDPOINT": "127.0.0.1:4318"})
    with pytest.raises(SettingsError, match="ARENA_OTLP_PROTOCOL"):
        Settings.from_env({"ARENA_OTLP_PROTOCOL": "udp"})
    over_grpc = Settings.from_env({"ARENA_OTLP_ENDPOINT": "http://127.0.0.1:4317", "ARENA_OTLP_PROTOCOL": "grpc"})
    exporter = telemetry.otlp_exporter(over_grpc.otlp_endpoint, over_grpc.otlp_protocol)
    assert type(exporter).__module__.endswith("grpc.trace_exporter")


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str]] = []  # (service.name, span name, parent span id)

    def Export(self, request, context):  # noqa: N802 - the gRPC service's method name
        for resource_spans in request.resource_spans:
            service = next(a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name")
            for scope_spans in resource_spans.scope_spans:
                self.spans += [(service, s.name, s.parent_span_id.hex()) for s in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


CHILD = """
from arena_core import telemetry
telemetry.setup("probe")
assert telemetry.enabled()
with telemetry.tracer().start_as_current_span("parent"):
    telemetry.record_span("queue", parent=None, start=1.0, end=2.0, attributes={"arena.rollout_id": "r-1"})
telemetry.shutdown()
"""


def test_spans_reach_an_otlp_grpc_receiver():
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {**os.environ, "ARENA_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "ARENA_OTLP_PROTOCOL": "grpc"}
        subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, timeout=60)
    finally:
        server.stop(None)
    names = {name: parent for _, name, parent in receiver.spans}
    assert {service for service, _, _ in receiver.spans} == {"arena-probe"}
    assert set(names) == {"parent", "queue"} and names["parent"] == "" and names["queue"] != ""


def test_health_probes_start_no_trace():
    sampler = telemetry.NoProbes()
    assert not sampler.should_sample(None, 1, "GET /healthz", attributes={"url.path": "/healthz"}).decision.is_sampled()
    assert sampler.should_sample(None, 1, "POST /v1/rollouts", attributes={"url.path": "/v1/rollouts"}
                                 ).decision.is_sampled()
    assert sampler.should_sample(None, 1, "submission").decision.is_sampled()
