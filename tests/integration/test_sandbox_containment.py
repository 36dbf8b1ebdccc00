"""Containment suite, run against each real provider (local = bubblewrap, docker =
the test engine): hostile agents are contained and reported with the right final
state, every sandbox is gone afterwards and the host is unharmed. Plus the contract:
the quickstart agent completes the example task through the proxy relay."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from arena.schemas import AgentSpec, Budget, SandboxJob, SandboxOutcome, Task, TestsVerifier
from arena_sandbox import local, runner
from arena_sandbox.provider import SandboxLimits
from arena_sandbox.runner import RunnerConfig
from arena_sandbox.testing import make_provider

REPO_ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = REPO_ROOT / "examples" / "quickstart"
LIMITS = SandboxLimits(memory_bytes=256 * 2**20, pids=64, cpus=1.0, open_files=256)
CONFIG = RunnerConfig(sandbox_limits=LIMITS, diff_timeout_s=60)


@pytest.fixture(params=["local", "docker"])
def provider(request, tmp_path):
    if request.param == "local":
        if local.available() is not None:
            pytest.skip(f"no bubblewrap: {local.available()}")
        return make_provider("local", tmp_path / "data")
    return make_provider("docker", tmp_path / "data", docker_url=request.getfixturevalue("docker_url"))


def make_job(tmp_path: Path, code: str, *, wall_clock_s: float = 30.0, port: int = 9, repo: Path | None = None,
             image: str | None = None) -> SandboxJob:
    if repo is None:
        repo = tmp_path / "repo"
        repo.mkdir(exist_ok=True)
        (repo / "a.txt").write_text("base\n")
    agent = tmp_path / "agent"
    agent.mkdir(exist_ok=True)
    (agent / "agent.py").write_text(code)
    task = Task(id="hostile", repo=str(repo), instructions="-", verifier=TestsVerifier(), image=image,
                agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(agent)),
                budget=Budget(wall_clock_s=wall_clock_s))
    return SandboxJob(rollout_id="r1", task=task, proxy_url=f"http://127.0.0.1:{port}/v1", api_key="ak")


def _gone(provider) -> bool:
    """No directory of the provider's sandboxes left (docker: nor any container)."""
    if provider.name == "docker" and provider.client.api.containers(
            all=True, filters={"label": f"arena.owner={provider.owner}"}):
        return False
    return not provider.base.exists() or list(provider.base.iterdir()) == []


def _host_healthy() -> None:
    assert subprocess.run(["true"], check=False).returncode == 0  # the host can still fork


async def test_fork_bomb_is_contained(tmp_path, provider):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    out = await runner.run_job(make_job(tmp_path, code, wall_clock_s=2), provider=provider,
                               data_dir=tmp_path / "data", config=CONFIG)
    assert out.done.outcome is SandboxOutcome.TIMED_OUT, out.done.reason
    assert _gone(provider)
    _host_healthy()


async def test_memory_hog_is_oom_killed_and_reported(tmp_path, provider):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 * 2**20))\n"
    out = await runner.run_job(make_job(tmp_path, code), provider=provider, data_dir=tmp_path / "data", config=CONFIG)
    assert out.done.outcome is SandboxOutcome.FAILED
    assert out.done.oom_killed, out.done.reason
    assert out.done.reason.startswith("out of memory") and out.done.exit_code == 137
    assert _gone(provider)


async def test_infinite_loop_times_out(tmp_path, provider):
    out = await runner.run_job(make_job(tmp_path, "while True:\n    pass\n", wall_clock_s=2), provider=provider,
                               data_dir=tmp_path / "data", config=CONFIG)
    assert out.done.outcome is SandboxOutcome.TIMED_OUT
    assert out.done.exit_code is None and out.run.duration_s < 60  # generous: 2 busy cores
    assert _gone(provider)


PROBE = r"""
import json, os, socket, subprocess
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except Exception as exc:
        out[name] = type(exc).__name__
for name, addr in {"internet": ("1.1.1.1", 80), "host_port": ("127.0.0.1", HOST_PORT),
                   "host_port_v6": ("::1", HOST_PORT), "dns": ("example.com", 80)}.items():
    attempt("tcp_" + name, lambda a=addr: socket.create_connection(a, timeout=2).close())
attempt("tcp_proxy", lambda: socket.create_connection(("127.0.0.1", PROXY_PORT), timeout=2).close())
for path in ("/etc/shadow", "/root/.bashrc", "SECRET", "/work/main/pyproject.toml", "/var/run/docker.sock"):
    attempt("read_" + path, lambda p=path: open(p).read())
for path in ("/usr/pwned", "/etc/pwned", "/pwned", "/sandbox/pwned", "/sandbox/agent/pwned"):
    attempt("write_" + path, lambda p=path: open(p, "w").write("x"))
attempt("write_/tmp/ok", lambda: open("/tmp/ok", "w").write("x"))
log = subprocess.run(["git", "log", "--all", "--format=%s"], capture_output=True, text=True).stdout.split()
out["git_commits"] = log
every_object = subprocess.run(["git", "cat-file", "--batch-all-objects", "--batch"], capture_output=True).stdout
out["history_secret"] = b"hunter2" in every_object  # any object in .git, reachable or not
out["uid"] = os.getuid()
out["caps"] = [l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1]
json.dump(out, open("/sandbox/.arena/result.json", "w"))
open("/sandbox/.arena/done", "w").close()
"""


async def test_network_files_and_history_are_contained(tmp_path, provider):
    listener = socket.create_server(("127.0.0.1", 0))  # a host service the sandbox must not reach
    proxy = socket.create_server(("127.0.0.1", 0))  # stands in for the LLM proxy
    secret = tmp_path / "SECRET"
    secret.write_text("host secret")
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_AUTHOR_NAME": "x", "GIT_AUTHOR_EMAIL": "x@x",
           "GIT_COMMITTER_NAME": "x", "GIT_COMMITTER_EMAIL": "x@x"}
    (repo / "a.txt").write_text("password = hunter2\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "leak"]):
        subprocess.run(["git", *args], cwd=repo, env=env, check=True)
    (repo / "a.txt").write_text("password = <redacted>\n")
    subprocess.run(["git", "commit", "-qam", "redact"], cwd=repo, env=env, check=True)
    code = PROBE.replace("HOST_PORT", str(listener.getsockname()[1])).replace("PROXY_PORT", str(proxy.getsockname()[1]))
    try:
        out = await runner.run_job(make_job(tmp_path, code, repo=repo, port=proxy.getsockname()[1]),
                                   provider=provider, data_dir=tmp_path / "data", config=CONFIG)
    finally:
        listener.close()
        proxy.close()
    assert out.done.outcome is SandboxOutcome.COMPLETED, out.done.reason
    r = out.done.result
    assert r["tcp_proxy"] == "allowed"
    for name in ("tcp_internet", "tcp_host_port", "tcp_host_port_v6", "tcp_dns"):
        assert r[name] != "allowed", (name, r)
    for key, value in r.items():
        if key.startswith("read_") or (key.startswith("write_") and key != "write_/tmp/ok"):
            assert value != "allowed", (key, r)
    assert r["write_/tmp/ok"] == "allowed"
    assert r["git_commits"] == ["base"] and r["history_secret"] is False
    assert r["uid"] == 1000 and int(r["caps"], 16) == 0
    assert not Path("/usr/pwned").exists() and not Path("/pwned").exists() and not Path("/etc/pwned").exists()
    assert _gone(provider)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def scripted_llm():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "arena.scripted_llm", "--script",
                             str(QUICKSTART / "llm_script.json"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


async def test_quickstart_agent_completes_through_the_proxy(tmp_path, provider, scripted_llm):
    task = json.loads((QUICKSTART / "task.json").read_text())
    task["repo"] = str(QUICKSTART / task["repo"])
    task["agent"]["path"] = str(QUICKSTART / task["agent"]["path"])
    task["image"] = "arena/quickstart:latest"
    import msgspec

    job = SandboxJob(rollout_id="qs1", task=msgspec.convert(task, Task),
                     proxy_url=f"http://127.0.0.1:{scripted_llm}/v1", api_key="ak-qs")
    out = await runner.run_job(job, provider=provider, data_dir=tmp_path / "data")
    assert out.done.outcome is SandboxOutcome.COMPLETED, out.done.reason
    assert "diff --git a/textstats/core.py b/textstats/core.py" in out.done.diff
    assert "+    return (ordered[mid - 1] + ordered[mid])" in out.done.diff
    assert _gone(provider)
