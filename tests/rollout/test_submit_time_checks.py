"""What would fail at run time is refused at submission, naming what exists: a bad enum value in
a request lists the valid names (arena_core.bodies); an unknown OpenEnv environment is a 404
naming the registered ones, over HTTP and on the WebSocket; a model no backend replica serves is
a 422 naming the served ones; a scaffold preset no sandbox worker can launch is a 422 naming
those it can and how to install it."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest
import websockets

from arena_core import subjects
from arena_core.bodies import decode_body
from arena_core.errors import InvalidRequest
from arena_core.runtime import serve
from arena_core.scaffolds.install import launchable
from arena_core.schemas import BackendReplica, SubmitGroupRequest, SubmitRolloutRequest
from arena_core.settings import Settings
from arena_core.workers import Advertiser, Workers
from arena_rollout.app import create_app
from arena_rollout.service import RolloutService, model_problem
from arena_rollout.store import RolloutStore
from arena_stack.natsserver import free_port


def body(**task_changes) -> dict:
    task = {"id": "t", "instructions": "x", "agent": {"command": ["true"]}, **task_changes}
    return {"task": task}


@pytest.mark.parametrize(("changes", "where", "valid"), [
    ({"provider": "dockr"}, "$.provider", "docker, local, mock"),
    ({"task": body(agent={"scaffold": {"name": "mini-swe"}})["task"]}, "$.task.agent.scaffold.name",
     "claude-code, codex, gemini-cli, mini-swe-agent, opencode, openhands, qwen-code, terminus-2"),
    ({"task": body(verifier={"type": "tests", "command": "pytest", "parser": "pytset"})["task"]},
     "$.task.verifier.parser", "pytest"),
])
def test_a_bad_enum_value_is_refused_with_the_valid_names(changes, where, valid):
    for type_ in (SubmitRolloutRequest, SubmitGroupRequest):
        data = {**body(), "n": 2, **changes} if type_ is SubmitGroupRequest else {**body(), **changes}
        with pytest.raises(InvalidRequest) as err:
            decode_body(json.dumps(data).encode(), type_)
        message = str(err.value)
        assert f"at `{where}` (valid: " in message and valid in message, message


def test_other_problems_keep_their_message():
    with pytest.raises(InvalidRequest) as err:
        decode_body(json.dumps({**body(), "provider": 3}).encode(), SubmitRolloutRequest)
    assert "valid:" not in str(err.value) and "$.provider" in str(err.value)


@pytest.fixture
async def rollout_server(bus):
    """The rollout service's app served by uvicorn (a WebSocket refusal needs a real server)."""
    port, stop = free_port(), asyncio.Event()
    settings = Settings(nats_url="nats://127.0.0.1:1", backend_url="http://127.0.0.1:1/v1", allow_host_paths=True)
    service = RolloutService(bus=bus, store=RolloutStore(await bus.kv(subjects.KV_ROLLOUTS)), settings=settings,
                             http=httpx.AsyncClient())
    server = asyncio.create_task(serve(stop, app=create_app(service), port=port))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        for _ in range(200):
            try:
                await http.get("/healthz")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.05)
        try:
            yield port, http, service
        finally:
            stop.set()
            await server
            await service.upstream.aclose()


async def test_an_unknown_environment_is_a_404_naming_the_registered_ones(rollout_server):
    port, http, service = rollout_server
    kv = await service.bus.kv(subjects.KV_ENVIRONMENTS)
    await kv.put("calc", b"{}")  # only its name is read here
    health = await http.get("/openenv/calcc/health")
    assert health.status_code == 404, health.text
    assert "no environment 'calcc' (registered: calc;" in health.json()["error"]["message"]
    # the WebSocket an OpenEnv client opens: a 404 with the same answer, not a bare 403
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(f"ws://127.0.0.1:{port}/openenv/calcc/ws"):
            pass
    assert refused.value.response.status_code == 404
    assert b"registered: calc" in refused.value.response.body


def submission(model: str = "default", scaffold_model: str | None = None) -> SubmitRolloutRequest:
    agent = {"scaffold": {"name": "mini-swe-agent", "model": scaffold_model}} if scaffold_model else {"command": ["true"]}
    return msgspec.convert({**body(agent=agent), "model": model}, SubmitRolloutRequest)


def test_a_model_no_replica_serves_is_named_with_what_is_served():
    listing = [BackendReplica(replica_id="a", url="http://a/v1", models=["qwen-7b", "qwen-7b-lora"])]
    problem = model_problem(submission("llama"), listing)
    assert problem is not None and "no backend replica serves model 'llama' (served: qwen-7b, qwen-7b-lora)" in problem
    assert "arena backend register" in problem
    # the scaffold's model is what the calls are routed by when the rollout's is "default"
    assert "'gpt-x'" in model_problem(submission(scaffold_model="gpt-x"), listing)
    assert model_problem(submission("qwen-7b"), listing) is None
    # a replica listing no models serves any name; a raw command's model is unknown before it runs
    wildcard = [*listing, BackendReplica(replica_id="b", url="http://b/v1")]
    assert model_problem(submission("llama"), wildcard) is None
    assert model_problem(submission(), listing) is None


async def test_a_submission_for_a_model_no_replica_serves_is_a_422(rollout_server, tmp_path):
    _, http, service = rollout_server
    service.router.upsert(BackendReplica(replica_id="default", url="http://127.0.0.1:1/v1", models=["qwen-7b"]))
    (tmp_path / "repo").mkdir()
    task = {**body(repo=str(tmp_path / "repo"), verifier={"type": "tests", "fail_to_pass": ["t.py::t"]})["task"]}
    resp = await http.post("/v1/rollouts", json={"task": task, "model": "llama"})
    assert resp.status_code == 422, resp.text
    assert "no backend replica serves model 'llama' (served: qwen-7b)" in resp.json()["error"]["message"]


def test_the_local_provider_can_launch_the_scaffolds_installed_and_those_that_need_no_install(tmp_path):
    shipped = ["claude-code", "opencode", "qwen-code", "codex", "gemini-cli"]  # in their images: no install
    assert launchable(None) == shipped  # nothing installed: only those shipping no install
    (tmp_path / "mini-swe-agent" / "bin").mkdir(parents=True)
    assert launchable(tmp_path) == ["mini-swe-agent", *shipped]


async def test_a_scaffold_no_sandbox_worker_can_launch_is_refused_at_submission(bus, rollout_server, tmp_path):
    """Workers advertise the scaffolds their sandboxes can launch in ``arena_workers``; a preset
    none of them has installed is a 422 naming what is, and how to install it."""
    _, http, service = rollout_server
    service.workers = workers = Workers(bus)
    installed: list[str] = ["claude-code", "opencode"]
    advertiser = Advertiser(bus, ["local"], owner="t", slots=2, scaffolds=lambda provider: list(installed))
    await advertiser.announce()
    (tmp_path / "repo").mkdir()
    verifier = {"type": "tests", "fail_to_pass": ["t.py::t"]}
    task = body(repo=str(tmp_path / "repo"), verifier=verifier,
                agent={"scaffold": {"name": "mini-swe-agent", "model": "m"}})["task"]
    resp = await http.post("/v1/rollouts", json={"task": task})
    assert resp.status_code == 422, resp.text
    message = resp.json()["error"]["message"]
    assert "scaffold 'mini-swe-agent' is not installed on any 'local' sandbox worker" in message
    assert "(they can launch: claude-code, opencode)" in message
    assert "make scaffolds-venv" in message and "python -m arena_core.scaffolds.install mini-swe-agent" in message

    # once a worker advertises it, the same submission passes this check (and any after it)
    installed.append("mini-swe-agent")
    await advertiser.announce()
    workers.entries.clear()  # read the bucket afresh, as a watching service would have
    await workers.check("local")
    workers.check_scaffold("local", "mini-swe-agent")
    # a worker that does not say (an image ships its scaffolds) is trusted
    quiet = Advertiser(bus, ["docker"], owner="t", slots=1)
    await quiet.announce()
    await workers.check("docker")
    workers.check_scaffold("docker", "openhands")
