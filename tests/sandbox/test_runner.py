"""The job runner with real sandboxes of each provider (bubblewrap; docker via the
test engine) and tiny inline agents."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from pathlib import Path

import pytest

from arena_core.schemas import AgentSpec, Budget, SandboxJob, SandboxOutcome, Task, TestsVerifier
from arena_sandbox import runner

from arena_sandbox_providers import local

from arena_sandbox_providers.testing import make_provider


@pytest.fixture(params=["local", "docker"])
def provider(request, tmp_path):
    if request.param == "local":
        if local.available() is not None:
            pytest.skip(f"no bubblewrap: {local.available()}")
        return make_provider("local", tmp_path / "data")
    return make_provider("docker", tmp_path / "data", docker_url=request.getfixturevalue("docker_url"))


class _Echo(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        reply = json.dumps({"path": self.path, "auth": self.headers.get("Authorization"),
                            "body": body.decode()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def proxy_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def make_job(tmp_path: Path, agent_code: str, *, port: int = 9, wall_clock_s: float = 30.0,
             repo: Path | None = None) -> SandboxJob:
    if repo is None:
        repo = tmp_path / "repo"
        (repo / "src").mkdir(parents=True)
        (repo / "src" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    agent = tmp_path / "agent"
    agent.mkdir(exist_ok=True)
    (agent / "agent.py").write_text(agent_code)
    task = Task(
        id="calc",
        repo=str(repo),
        instructions="make add add",
        agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(agent), env={"MODE": "test"}),
        verifier=TestsVerifier(),
        budget=Budget(wall_clock_s=wall_clock_s),
    )
    return SandboxJob(rollout_id="r1", task=task, proxy_url=f"http://127.0.0.1:{port}/proxy/r1/v1",
                      api_key="ak-test")


COMPLETING_AGENT = """
import json, os, urllib.request
task = json.load(open('/sandbox/.arena/task.json'))
req = urllib.request.Request(os.environ['OPENAI_BASE_URL'] + '/chat/completions', data=b'{"m": 1}',
                             headers={'Authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})
answer = json.load(urllib.request.urlopen(req, timeout=10))
req = urllib.request.Request(os.environ['ANTHROPIC_BASE_URL'] + '/v1/messages', data=b'{"a": 1}',
                             headers={'Authorization': 'Bearer ' + os.environ['ANTHROPIC_API_KEY']})
anthropic = json.load(urllib.request.urlopen(req, timeout=10))
open('src/calc.py', 'w').write('def add(a, b):\\n    return a + b\\n')
open('NOTES.md', 'w').write('new file\\n')
print('agent log line')
json.dump({'task_id': task['task']['id'], 'rid': task['rollout_id'], 'mode': os.environ['MODE'],
           'proxy': answer, 'anthropic': anthropic, 'cwd': os.getcwd(), 'env_rid': os.environ['ARENA_ROLLOUT_ID']},
          open('/sandbox/.arena/result.json', 'w'))
open('/sandbox/.arena/done', 'w').close()
"""


async def test_completed_with_diff_result_and_proxy(tmp_path, proxy_port, provider):
    data_dir = tmp_path / "data"
    job = make_job(tmp_path, COMPLETING_AGENT, port=proxy_port)
    out = await runner.run_job(provider=provider, job=job, data_dir=data_dir)
    done = out.done
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason
    assert done.exit_code == 0
    assert "-    return a - b\n+    return a + b" in done.diff
    assert "diff --git a/NOTES.md b/NOTES.md\nnew file mode" in done.diff
    assert done.result == {
        "task_id": "calc", "rid": "r1", "mode": "test", "cwd": "/sandbox/workspace", "env_rid": "r1",
        "proxy": {"path": "/proxy/r1/v1/chat/completions", "auth": "Bearer ak-test", "body": '{"m": 1}'},
        "anthropic": {"path": "/proxy/r1/v1/messages", "auth": "Bearer ak-test", "body": '{"a": 1}'},
    }
    assert "agent log line" in done.log_tail and b"agent log line" in out.log
    assert done.sandbox_id.startswith("r1-") and done.provider == provider.name
    assert done.started_at <= done.finished_at
    assert list(provider.base.iterdir()) == []  # always cleaned up


async def test_exit_without_done_is_failed(tmp_path, provider):
    code = ("import sys\nprint('working hard')\nopen('half.txt', 'w').write('partial\\n')\n"
            "print('giving up', file=sys.stderr)\nsys.exit(3)\n")
    out = await runner.run_job(provider=provider, job=make_job(tmp_path, code), data_dir=tmp_path / "data")
    done = out.done
    assert done.outcome is SandboxOutcome.FAILED
    assert done.exit_code == 3
    assert "agent exited with code 3 without writing /sandbox/.arena/done" in done.reason
    assert "giving up" in done.reason and "giving up" in done.log_tail
    assert "b/half.txt\nnew file mode" in done.diff  # kept for analytics, not verified


async def test_wall_clock_timeout(tmp_path, provider):
    out = await runner.run_job(provider=provider, job=make_job(tmp_path, "import time\ntime.sleep(1000)\n", wall_clock_s=1.0),
                               data_dir=tmp_path / "data")
    assert out.done.outcome is SandboxOutcome.TIMED_OUT
    assert out.done.exit_code is None
    assert out.run is not None and out.run.duration_s < 2.5


async def test_cancel(tmp_path, provider):
    cancel = asyncio.Event()
    task = asyncio.create_task(runner.run_job(provider=provider, job=make_job(tmp_path, "import time\ntime.sleep(1000)\n"),
                                              data_dir=tmp_path / "data", cancel=cancel))
    await asyncio.sleep(0.5)
    cancel.set()
    out = await asyncio.wait_for(task, 5)
    assert out.done.outcome is SandboxOutcome.CANCELLED
    assert not provider.base.exists() or list(provider.base.iterdir()) == []


@pytest.mark.parametrize("provider", ["local"], indirect=True)  # runner logic: one provider is enough
async def test_invalid_result_json_is_ignored_with_a_note(tmp_path, provider):
    code = "open('/sandbox/.arena/result.json', 'w').write('{oops')\nopen('/sandbox/.arena/done', 'w')\n"
    out = await runner.run_job(provider=provider, job=make_job(tmp_path, code), data_dir=tmp_path / "data")
    assert out.done.outcome is SandboxOutcome.COMPLETED
    assert out.done.result is None
    assert "result.json ignored: invalid JSON" in out.done.reason


@pytest.mark.parametrize("provider", ["local"], indirect=True)
async def test_missing_repo_is_an_error_not_a_crash(tmp_path, provider):
    job = make_job(tmp_path, "pass\n", repo=tmp_path / "no-such-repo")
    out = await runner.run_job(provider=provider, job=job, data_dir=tmp_path / "data")
    assert out.done.outcome is SandboxOutcome.ERROR
    assert "no-such-repo" in out.done.reason
    assert out.run is None
    assert not provider.base.exists() or list(provider.base.iterdir()) == []


@pytest.mark.parametrize("provider", ["local"], indirect=True)
async def test_result_json_link_is_not_followed(tmp_path, provider):
    code = ("import os\nos.symlink('/etc/passwd', '/sandbox/.arena/result.json')\n"
            "open('/sandbox/.arena/done', 'w')\n")
    out = await runner.run_job(provider=provider, job=make_job(tmp_path, code), data_dir=tmp_path / "data")
    assert out.done.outcome is SandboxOutcome.COMPLETED
    assert out.done.result is None
    assert "result.json ignored: not a regular file" in out.done.reason


GIT_TAMPERING_AGENT = """
import os, subprocess
open('src/calc.py', 'w').write('def add(a, b):\\n    return a + b\\n')
git = ['git', '-c', 'user.name=a', '-c', 'user.email=a@b']
if os.environ['MODE'] == 'replace':  # swap the base commit for another through a replace ref
    base = subprocess.check_output(['git', 'rev-parse', 'HEAD']).decode().strip()
    os.makedirs('.git/refs/replace', exist_ok=True)
    open('.git/refs/replace/' + base, 'w').write(base + '\\n')
elif os.environ['MODE'] == 'hook':
    open('.git/hooks/post-checkout', 'w').write('#!/bin/sh\\necho hi\\n')
elif os.environ['MODE'] == 'alternates':
    os.makedirs('.git/objects/info', exist_ok=True)
    open('.git/objects/info/alternates', 'w').write('/elsewhere/objects\\n')
elif os.environ['MODE'] == 'filter':
    subprocess.check_call(git + ['config', 'filter.x.clean', 'cat'])
else:  # harmless: an identity in the repository's config, a commit of the agent's own
    subprocess.check_call(git + ['config', 'user.email', 'agent@example.com'])
    subprocess.check_call(git + ['commit', '-qam', 'wip'])
open('/sandbox/.arena/done', 'w').close()
"""


@pytest.mark.parametrize("mode, flagged", [("replace", True), ("hook", True), ("alternates", True), ("filter", True),
                                           ("benign", False)])
async def test_changes_to_git_metadata_are_flagged(tmp_path, mode, flagged):
    if local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    job = make_job(tmp_path, GIT_TAMPERING_AGENT)
    task = job.task
    job = SandboxJob(rollout_id="r1", task=Task(**{**{f: getattr(task, f) for f in task.__struct_fields__},
                                                   "agent": AgentSpec(command=task.agent.command, path=task.agent.path,
                                                                      env={"MODE": mode})}),
                     proxy_url=job.proxy_url, api_key=job.api_key)
    done = (await runner.run_job(provider=make_provider("local", tmp_path / "data"), job=job,
                                 data_dir=tmp_path / "data")).done
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason
    assert done.flags == (["git_tampered"] if flagged else []), done.reason
    if flagged:
        assert "changed the repository's git metadata" in done.reason


async def test_an_agent_that_deletes_its_git_directory_failed_it_is_no_infrastructure_error(tmp_path):
    if local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    agent = "import shutil\nshutil.rmtree('.git')\nopen('/sandbox/.arena/done', 'w').close()\n"
    done = (await runner.run_job(provider=make_provider("local", tmp_path / "data"), job=make_job(tmp_path, agent),
                                 data_dir=tmp_path / "data")).done
    # an infrastructure outcome would take the rollout out of training: the agent's doing is a 0
    assert done.outcome is SandboxOutcome.FAILED
    assert done.reason.startswith("cannot extract the diff (the agent broke the repository)")
