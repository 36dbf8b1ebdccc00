"""Settings fail fast on bad values; proto/ matches the schemas."""

from __future__ import annotations

import pytest

from arena_core import proto
from arena_core.settings import Settings, SettingsError


def test_settings_from_env():
    s = Settings.from_env({"ARENA_ROLLOUT_PORT": "9999", "ARENA_NATS_URL": "nats://10.0.0.1:4222"})
    assert s.rollout_port == 9999 and s.nats_url == "nats://10.0.0.1:4222"
    assert Settings.from_env(s.to_env()) == s


@pytest.mark.parametrize("env, message", [
    ({"ARENA_ROLLOUT_PORT": "x"}, "ARENA_ROLLOUT_PORT='x' is not an integer"),
    ({"ARENA_ROLLOUT_PORT": "70000"}, "is not a TCP port"),
    ({"ARENA_NATS_URL": "http://x"}, "ARENA_NATS_URL='http://x' must be a nats/tls URL"),
    ({"ARENA_BACKEND_URL": "localhost:8000"}, "ARENA_BACKEND_URL"),
    ({"ARENA_SANDBOX_CONCURRENCY": "-1"}, "must be >= 0"),
    ({"ARENA_PROXY_PORT": "65536"}, "ARENA_PROXY_PORT=65536 is not a TCP port"),
    ({"ARENA_PROXY_PORT": "-1"}, "ARENA_PROXY_PORT=-1 is not a TCP port"),
    ({"ARENA_PROXY_PORT": "9090"}, "ARENA_PROXY_PORT=9090 must differ from ARENA_ROLLOUT_PORT"),
])
def test_bad_settings_fail_fast_naming_the_variable(env, message):
    with pytest.raises(SettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)


def test_agents_are_sent_to_the_proxy_only_port_when_there_is_one():
    assert Settings.from_env({}).proxy_port == 0
    assert Settings(public_url="http://arena:9090/").agent_url == "http://arena:9090"
    s = Settings.from_env({"ARENA_PUBLIC_URL": "http://arena-rollout.arena.svc:9090", "ARENA_PROXY_PORT": "9096"})
    assert s.agent_url == "http://arena-rollout.arena.svc:9096" and s.public_url.endswith(":9090")
    assert Settings(public_url="https://arena.example", proxy_port=9443).agent_url == "https://arena.example:9443"
    assert Settings(public_url="http://[fd00::1]:9090", proxy_port=9096).agent_url == "http://[fd00::1]:9096"


def test_proto_is_generated_from_the_schemas():
    assert proto.drift() == [], "proto/ is out of date: run `make proto`"


def test_proto_check_detects_drift(tmp_path):
    proto.write(tmp_path)
    assert proto.drift(tmp_path) == []
    (tmp_path / "schemas" / "Step.json").write_text("{}")
    assert proto.drift(tmp_path) == ["stale schemas/Step.json"]


def test_sandbox_slots_are_sized_from_the_machine_unless_set():
    import os

    assert Settings(sandbox_concurrency=3).sandbox_slots == 3
    cores = len(os.sched_getaffinity(0))
    assert Settings().sandbox_slots == max(4, 4 * cores)
