"""The attack: a task whose git source points at the worker's own machine, with a password
in the URL. Git once connected to any host and port (its error told what listens on
127.0.0.1) and the rollout's reason echoed the password to anyone with a read key. Now a
host that resolves to a loopback, link-local or private address is refused before git runs
(nothing connects), only https is allowed by default, and no message holds the password."""

from __future__ import annotations

import socket
import threading

import pytest

from arena_core import sources
from arena_core.schemas import AgentSpec, Budget, GitSource, SandboxJob, SandboxOutcome, Task, TestsVerifier
from arena_core.settings import Settings
from arena_sandbox import runner
from arena_sandbox_providers.testing import make_provider

SECRET = "s3cret-Pa55"


@pytest.fixture
def listener():
    """Something listening on 127.0.0.1 (as a worker's NATS, a database, a metadata proxy
    would): the connections it accepted."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[tuple] = []

    def serve():
        while True:
            try:
                conn, peer = server.accept()
            except OSError:
                return
            accepted.append(peer)
            conn.sendall(b"HTTP/1.0 200 OK\r\ncontent-length: 5\r\n\r\nhello")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        server.close()
        thread.join(timeout=5)


def job(url: str) -> SandboxJob:
    task = Task(id="t", source=GitSource(url=url, commit="a" * 40), instructions="x",
                agent=AgentSpec(command=["true"]), verifier=TestsVerifier(), budget=Budget(wall_clock_s=10))
    return SandboxJob(rollout_id="r1", task=task, proxy_url="http://127.0.0.1:9/proxy/r1/v1", api_key="ak")


async def test_a_git_source_on_the_workers_loopback_ends_without_connecting_or_leaking(listener, tmp_path):
    port, accepted = listener
    cache = sources.SourceCache(tmp_path / "sources", git=sources.git_policy(Settings()),
                                limits=sources.unpack_limits(Settings()))
    reasons = []
    for url in (f"https://attacker:{SECRET}@127.0.0.1:{port}/repo.git",
                f"https://{SECRET}@localhost:{port}/repo.git",
                f"https://attacker:{SECRET}@[::1]:{port}/repo.git",
                f"https://x:{SECRET}@169.254.169.254/latest/meta-data.git",
                f"https://x:{SECRET}@10.0.0.7/repo.git?private_token={SECRET}"):
        out = await runner.run_job(job(url), data_dir=tmp_path / "data", provider=make_provider("mock", tmp_path),
                                   sources=cache)
        assert out.done.outcome is SandboxOutcome.ERROR
        assert "not a public address" in out.done.reason and "ARENA_GIT_ALLOW_PRIVATE_HOSTS" in out.done.reason
        reasons.append(out.done.reason)
    assert accepted == []  # git never ran: nothing was asked of what listens there
    assert not any(SECRET in reason for reason in reasons), reasons
    assert all("***@" in reason for reason in reasons)


@pytest.mark.parametrize("url", ["http://{cred}@example.com/r.git", "git://example.com/r.git",
                                 "ssh://git:{cred}@example.com/r.git", "ext::sh -c touch% /tmp/pwned",
                                 "file:///etc", "-uhttps://{cred}@example.com/r.git"])
def test_only_https_is_allowed_by_default(url):
    with pytest.raises(sources.SourceError) as caught:
        sources.check_git_url(url.format(cred=f"u:{SECRET}"), allow_file=False,
                              policy=sources.git_policy(Settings()), resolve=False)
    assert SECRET not in str(caught.value)


def test_a_host_outside_the_allowed_hosts_is_refused():
    policy = sources.git_policy(Settings(git_allowed_hosts="github.com,*.example.org"))
    with pytest.raises(sources.SourceError, match="ARENA_GIT_ALLOWED_HOSTS"):
        sources.check_git_url("https://gitlab.com/a/b.git", allow_file=False, policy=policy, resolve=False)
    with pytest.raises(sources.SourceError, match="ARENA_GIT_ALLOWED_HOSTS"):
        sources.check_git_url("https://example.org.evil.com/a.git", allow_file=False, policy=policy, resolve=False)
    for url in ("https://github.com/a/b.git", "https://git.example.org/a.git"):
        sources.check_git_url(url, allow_file=False, policy=policy, resolve=False)


def test_gits_own_errors_do_not_echo_the_password(listener, tmp_path):
    """Allowed to reach a private host (an operator's choice), git fails against what answers
    there: its message, and ours, hold no credentials."""
    port, accepted = listener
    policy = sources.GitPolicy(schemes=frozenset({"http"}), allow_private=True)
    with pytest.raises(sources.SourceError) as caught:
        sources.fetch_git(GitSource(url=f"http://attacker:{SECRET}@127.0.0.1:{port}/repo.git?token={SECRET}",
                                    commit="a" * 40), tmp_path / "tree", policy=policy)
    assert accepted, "git should have connected here"
    assert SECRET not in str(caught.value) and "***" in str(caught.value)


async def test_the_api_refuses_a_loopback_git_source_at_submission(api, listener):
    port, accepted = listener
    task = {"id": "t", "instructions": "x", "agent": {"command": ["true"]},
            "source": {"type": "git", "url": f"https://a:{SECRET}@127.0.0.1:{port}/r.git", "commit": "a" * 40},
            "verifier": {"type": "exact", "answers": ["1"]}}
    r = await api.post("/v1/rollouts", json={"task": task})
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert "not a public address" in message and SECRET not in message
    assert accepted == []


def test_redact_hides_user_info_and_secret_parameters():
    text = f"fatal: unable to access 'https://bob:{SECRET}@h/r.git/?access_token={SECRET}&x=1': 403"
    assert sources.redact(text) == "fatal: unable to access 'https://***@h/r.git/?access_token=***&x=1': 403"
