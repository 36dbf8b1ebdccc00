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


def test_sandbox_slots_are_sized_from_memory_unless_set():
    from arena_core import capacity

    assert Settings(sandbox_concurrency=3).sandbox_slots == 3
    assert Settings(sandbox_concurrency=3).sandbox_capacity().reason == "ARENA_SANDBOX_CONCURRENCY"
    gib, mib = 1024**3, 1024**2
    # 24 GiB free, a 1 GiB reserve, 20 MiB per waiting sandbox: 1,177 agents, not 4 per core
    sized = capacity.size(budget_mb=20, reserve_mb=1024, memory_bytes=24 * gib, fds=1 << 20)
    assert sized.slots == (23 * gib) // (20 * mib) == 1177
    assert "GiB free" in sized.reason and "20 MiB per waiting sandbox" in sized.reason
    # a heavier budget holds fewer; a small host still runs a few
    assert capacity.size(budget_mb=512, reserve_mb=1024, memory_bytes=24 * gib, fds=1 << 20).slots == 46
    assert capacity.size(budget_mb=20, reserve_mb=1024, memory_bytes=gib, fds=1 << 20).slots == capacity.MIN_SLOTS
    # file descriptors bound it, and the reason says how to lift it
    by_fds = capacity.size(budget_mb=20, reserve_mb=1024, memory_bytes=24 * gib, fds=1024)
    assert by_fds.slots == (1024 - capacity.FDS_RESERVED) // capacity.FDS_PER_SANDBOX == 32
    assert "ulimit -n" in by_fds.reason
    # a huge host stops at the cap (a setting goes past it)
    assert capacity.size(budget_mb=1, reserve_mb=0, memory_bytes=1024 * gib, fds=1 << 30).slots == capacity.MAX_SLOTS
    # the default sizes from this machine's memory, not its cores
    here = Settings().sandbox_capacity()
    assert here.slots == capacity.size(budget_mb=20, reserve_mb=1024, memory_bytes=here.memory_bytes).slots
    with pytest.raises(SettingsError, match="ARENA_SANDBOX_MEMORY_MB"):
        Settings.from_env({"ARENA_SANDBOX_MEMORY_MB": "0"})


def test_a_sandbox_waits_while_the_host_is_short_of_memory():
    from arena_core import capacity

    assert capacity.memory_free_for_sandboxes(0)  # some memory is free
    assert not capacity.memory_free_for_sandboxes(1 << 30)  # a reserve of 1 PiB is never free
    assert capacity.memory_available() > 0
