"""Sidecar services of a compose environment on the docker provider (Podman's Docker API): on the
sandbox's own internal network, reached by name from the agent's container, no route out, all
removed with the sandbox; the local provider refuses such a task with the reason."""

from __future__ import annotations

import json

import pytest

from arena_core.schemas import AgentSpec, Budget, SandboxJob, SandboxOutcome, SidecarService, Task
from arena_sandbox import runner
from arena_sandbox_providers import local
from arena_sandbox_providers.provider import CreateSpec
from arena_sandbox_providers.testing import make_provider

from tests.e2e.scaffold_stacks import require_image

IMAGE = "arena/quickstart:latest"
WEB = SidecarService(name="web", image=IMAGE, command=["python3", "-m", "http.server", "8000", "--directory",
                                                      "/etc"])
PROBE = """
import json, time, urllib.request
seen = {}
for _ in range(60):
    try:
        seen['web'] = urllib.request.urlopen('http://web:8000/hostname', timeout=2).read().decode().strip()
        break
    except OSError as exc:
        seen['web'] = repr(exc)
        time.sleep(0.5)
try:
    urllib.request.urlopen('http://1.1.1.1/', timeout=3)
    seen['outside'] = 'reached'
except OSError as exc:
    seen['outside'] = 'unreachable'
print(json.dumps(seen))
"""


async def test_a_sidecar_is_reached_by_name_on_a_private_network_and_removed_with_the_sandbox(docker_url, tmp_path):
    require_image(docker_url, IMAGE)
    provider = make_provider("docker", tmp_path / "data", docker_url=docker_url)
    engine = provider.client
    sandbox = await provider.create(CreateSpec(image=IMAGE, services=(WEB,)))
    out = bytearray()
    try:
        run = await sandbox.exec(["python3", "-c", PROBE], env={}, workdir="/tmp", timeout_s=120.0,
                                 on_output=out.extend)
        assert run.exit_code == 0, out.decode()
        seen = json.loads(out.decode().strip().splitlines()[-1])
        assert seen == {"web": "web", "outside": "unreachable"}  # the sidecar's own /etc/hostname
        network = f"arena-{provider.owner}-{sandbox.id}"
        assert engine.api.inspect_network(network)["Internal"] is True
    finally:
        await sandbox.destroy()
    left = engine.api.containers(all=True, filters={"label": [f"arena.sandbox_id={sandbox.id}"]})
    assert left == []
    assert engine.api.networks(names=[network]) == []
    await provider.close()


@pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}")
async def test_the_local_provider_refuses_a_task_with_sidecars(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README").write_text("x\n")
    task = Task(id="compose", repo=str(repo), instructions="talk to web", services=[WEB],
                agent=AgentSpec(command=["sh", "-c", "touch /sandbox/.arena/done"]), budget=Budget(wall_clock_s=30))
    job = SandboxJob(rollout_id="r1", task=task, proxy_url="http://127.0.0.1:9/proxy/r1/v1", api_key="ak")
    done = (await runner.run_job(provider=make_provider("local", tmp_path / "data"), job=job,
                                 data_dir=tmp_path / "data")).done
    assert done.outcome is SandboxOutcome.ERROR  # an infrastructure outcome: no reward, never a silent run
    assert "sidecar services (web): the local provider cannot run them (submit it with provider docker)" in done.reason
