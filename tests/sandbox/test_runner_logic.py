"""The sandbox runner's pure pieces: contract env, URLs, outcome, result.json, log tail."""

from __future__ import annotations

import os

import msgspec
import pytest

from arena_core.schemas import AgentSpec, SandboxJob, SandboxOutcome, Task, TestsVerifier
from arena_sandbox import runner
from arena_sandbox_providers.local import ProxyForward, RunResult


def _job(proxy_url: str = "http://127.0.0.1:9090/proxy/r1/v1", **agent_env) -> SandboxJob:
    task = Task(
        id="t1",
        repo="/nowhere",
        instructions="fix it",
        agent=AgentSpec(command=["python3", "agent.py"], env=agent_env),
        verifier=TestsVerifier(),
    )
    return SandboxJob(rollout_id="r1", task=task, proxy_url=proxy_url, api_key="ak-secret")


def _run(exit_code=0, *, timed_out=False, killed=False) -> RunResult:
    return RunResult(exit_code=exit_code, timed_out=timed_out, killed=killed, duration_s=12.3)


def test_agent_env_follows_the_contract():
    env = runner.agent_env(_job(EXTRA="1", OPENAI_API_KEY="overridden-by-task"))
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9090/proxy/r1/v1"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9090/proxy/r1"
    assert env["ANTHROPIC_API_KEY"] == "ak-secret"
    assert env["ARENA_ROLLOUT_ID"] == "r1"
    assert env["EXTRA"] == "1"
    assert env["OPENAI_API_KEY"] == "overridden-by-task"  # task env comes last


@pytest.mark.parametrize(
    ("url", "forward"),
    [
        ("http://127.0.0.1:9090/proxy/r/v1", ProxyForward("127.0.0.1", 9090, routes="/proxy/r")),
        ("http://localhost/v1", ProxyForward("localhost", 80, routes="")),
        ("https://proxy.internal/v1", ProxyForward("proxy.internal", 443, routes="")),
        ("http://[::1]:8000/v1", ProxyForward("::1", 8000, routes="")),
        ("http://arena.internal/api/proxy/r-1/v1/", ProxyForward("arena.internal", 80, routes="/api/proxy/r-1")),
    ],
)
def test_proxy_forward_lets_through_the_rollouts_proxy_routes(url, forward):
    assert runner.proxy_forward(url) == forward


def test_proxy_forward_rejects_non_http():
    with pytest.raises(ValueError):
        runner.proxy_forward("nats://127.0.0.1:4222")


def test_sandbox_proxy_url_keeps_loopback_and_rewrites_other_hosts():
    assert runner.sandbox_proxy_url("http://localhost:9090/proxy/r/v1") == "http://localhost:9090/proxy/r/v1"
    assert runner.sandbox_proxy_url("http://10.1.2.3:9090/proxy/r/v1") == "http://127.0.0.1:9090/proxy/r/v1"
    # the sandbox user cannot listen on a privileged port: 80 -> 10080 inside
    assert runner.sandbox_proxy_url("http://localhost/v1") == "http://127.0.0.1:10080/v1"
    assert runner.sandbox_proxy_url("https://proxy.internal/v1") == "https://127.0.0.1:10443/v1"
    assert runner.proxy_forward("http://localhost/v1").inside_port == 10080


def test_anthropic_base_url():
    assert runner.anthropic_base_url("http://h:1/proxy/r/v1") == "http://h:1/proxy/r"
    assert runner.anthropic_base_url("http://h:1/proxy/r/v1/") == "http://h:1/proxy/r"
    assert runner.anthropic_base_url("http://h:1/api") == "http://h:1/api"


def test_task_json_holds_the_public_task_only():
    job = _job()
    assert job.task.verifier is not None
    decoded = msgspec.json.decode(runner.task_json(job))
    assert decoded["rollout_id"] == "r1"
    assert "verifier" not in decoded["task"]
    assert msgspec.convert(decoded["task"], Task) == job.task.public()


def test_log_tail():
    data = b"".join(b"line %d\n" % i for i in range(100))
    tail = runner.log_tail(data, lines=3)
    assert tail == "line 97\nline 98\nline 99"
    assert runner.log_tail(b"x" * 100, max_chars=10) == "x" * 10
    assert runner.log_tail(b"bad \xff byte") == "bad \ufffd byte"


@pytest.mark.parametrize(
    ("run", "done", "outcome", "reason_part"),
    [
        (_run(0), True, SandboxOutcome.COMPLETED, "wrote /sandbox/.arena/done"),
        (_run(2), True, SandboxOutcome.COMPLETED, "exited with code 2"),
        (_run(None, timed_out=True, killed=True), True, SandboxOutcome.COMPLETED, "wall clock"),
        (_run(None, timed_out=True, killed=True), False, SandboxOutcome.TIMED_OUT, "wall clock of 12s"),
        (_run(None, killed=True), True, SandboxOutcome.CANCELLED, "cancelled"),
        (_run(None, killed=True), False, SandboxOutcome.CANCELLED, "cancelled"),
        (_run(3), False, SandboxOutcome.FAILED, "agent exited with code 3 without writing /sandbox/.arena/done"),
        (_run(0), False, SandboxOutcome.FAILED, "code 0 without writing"),
    ],
)
def test_decide_outcome(run, done, outcome, reason_part):
    got, reason = runner.decide_outcome(run, done=done, tail="boom")
    assert got is outcome
    assert reason_part in reason


def test_timeout_reason_names_the_budget_not_the_time_the_kill_took():
    run = RunResult(exit_code=None, timed_out=True, killed=True, duration_s=2.7)
    assert runner.decide_outcome(run, done=False, tail="", wall_clock_s=2.0) == (
        SandboxOutcome.TIMED_OUT, "wall clock of 2s exceeded")
    assert runner.decide_outcome(run, done=False, tail="", wall_clock_s=1.5)[1] == "wall clock of 1.5s exceeded"


def test_failed_reason_carries_the_log_tail():
    _, reason = runner.decide_outcome(_run(1), done=False, tail="Traceback\nValueError: nope")
    assert reason.endswith("last output:\nTraceback\nValueError: nope")


def test_read_result(tmp_path):
    assert runner.read_result(tmp_path) == (None, "")
    (tmp_path / "result.json").write_text('{"answer": 42}')
    assert runner.read_result(tmp_path) == ({"answer": 42}, "")
    (tmp_path / "result.json").write_text("{not json")
    value, note = runner.read_result(tmp_path)
    assert value is None and note.startswith("result.json ignored: invalid JSON")
    (tmp_path / "result.json").write_text("[1, 2]")
    assert runner.read_result(tmp_path) == (None, "result.json ignored: not a JSON object")
    (tmp_path / "result.json").write_text('{"big": "' + "x" * 100 + '"}')
    assert runner.read_result(tmp_path, max_bytes=50)[1] == "result.json ignored: larger than 50 bytes"


def test_read_result_never_follows_a_symlink(tmp_path):
    secret = tmp_path / "host-secret.json"
    secret.write_text('{"secret": "host data"}')
    arena = tmp_path / "arena"
    arena.mkdir()
    os.symlink(secret, arena / "result.json")
    value, note = runner.read_result(arena)
    assert value is None and "cannot open" in note


def test_read_result_ignores_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "result.json")
    assert runner.read_result(tmp_path) == (None, "result.json ignored: not a regular file")


def test_done_written(tmp_path):
    assert not runner.done_written(tmp_path)
    os.symlink("/nonexistent", tmp_path / "done")  # any entry named done counts
    assert runner.done_written(tmp_path)


def test_new_sandbox_id():
    a, b = runner.new_sandbox_id("r1"), runner.new_sandbox_id("r1")
    assert a.startswith("r1-") and len(a) == len("r1-") + 8 and a != b


# --------------------------------------------------------------------------- providers (issue 4)

from arena_core.settings import Settings, SettingsError  # noqa: E402
from arena_sandbox_providers import factory  # noqa: E402
from arena_sandbox_providers.provider import ExecResult  # noqa: E402


def test_oom_kill_is_reported_as_such():
    run = ExecResult(exit_code=137, oom_killed=True, duration_s=1.0)
    outcome, reason = runner.decide_outcome(run, done=False, tail="MemoryError?", memory_bytes=256 * 2**20)
    assert outcome is SandboxOutcome.FAILED
    assert reason.startswith("out of memory: the OOM killer fired (memory limit of 256 MiB)")
    assert "exited with code 137" in reason and "MemoryError?" in reason
    # done wins: the workspace is final, verification judges it
    assert runner.decide_outcome(run, done=True, tail="")[0] is SandboxOutcome.COMPLETED


def test_parse_result():
    assert runner.parse_result(None) == (None, "")
    assert runner.parse_result(b'{"a": 1}') == ({"a": 1}, "")
    assert "invalid JSON" in runner.parse_result(b"{")[1]
    assert "not a JSON object" in runner.parse_result(b"[1]")[1]
    assert "larger than 4 bytes" in runner.parse_result(b'{"a": 1}', max_bytes=4)[1]


def test_log_buffer_keeps_the_last_bytes():
    buf = runner._LogBuffer(10)
    for chunk in (b"aaaa", b"bbbb", b"cccc", b"dd"):
        buf(chunk)
    data = buf.data()
    assert data.endswith(b"bbbbccccdd"[-10:]) and data.startswith(b"[arena: log truncated")
    small = runner._LogBuffer(100)
    small(b"hi")
    assert small.data() == b"hi"


def test_factory_builds_each_provider_and_rejects_unknown(tmp_path):
    settings = Settings(data_dir=str(tmp_path), sandbox_provider="local, docker,mock,local", sandbox_owner="a b")
    assert [p.name for p in factory.build_providers(settings)] == ["local", "docker", "mock"]
    assert factory.owner_of(settings) == "a-b"
    with pytest.raises(SettingsError, match="unknown provider 'firecracker'"):
        factory.build_providers(Settings(sandbox_provider="firecracker"))
    with pytest.raises(SettingsError, match="ARENA_SANDBOX_POOL_SIZE"):
        Settings.from_env({"ARENA_SANDBOX_POOL_SIZE": "-1"})
