"""OpenEnv's own client (``openenv-core``, unmodified) against Arena's environment endpoint,
on the real stack (nats-server, the four services as processes, bubblewrap sandboxes):
whole episodes, sync and async, typed, generic and MCP clients, concurrency, capacity,
bad actions, raw frames, a dropped connection, groups on the trainer stream, ``openenv
validate``, and the ``openenv init`` echo environment hosted as a task."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import websockets
from openenv.core import EnvClient, GenericEnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import Observation, State
from openenv.core.mcp_client import MCPToolClient

from arena.sdk import ArenaClient
from arena.stream import TrajectoryStream
from arena.tasks import load_task
from arena_core.schemas import AgentSpec, Budget, OpenEnvServer, Task
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
ECHO_ENV = ROOT / "examples" / "openenv-echo"
BUG = "    return (ordered[mid] + ordered[mid + 1]) / 2\n"
FIX = "    return (ordered[mid - 1] + ordered[mid]) / 2\n"

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-openenv")
    rp = free_port()
    settings = Settings(
        nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data_dir), rollout_port=rp,
        trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0", sandbox_concurrency=4,
        allow_host_paths=True, openenv_idle_s=60,
        # the OpenEnv protocol is under test here, its clients without headers; keys on its
        # routes (the key in the base URL): tests/e2e/test_api_keys_on_every_route.py
        auth="off",
    )
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        task = msgspec.structs.replace(load_task(QUICKSTART), id="quickstart-env", agent=AgentSpec(external=True))
        body = msgspec.to_builtins(task)
        for name, limit in (("quickstart", 8), ("solo", 1)):
            got = httpx.put(f"{settings.rollout_url}/v1/environments/{name}",
                            json={"task": body, "max_concurrent": limit})
            assert got.status_code == 200, got.text
        # through the SDK: the environment's directory travels as a bundle, as it would to another machine
        echo = Task(id="echo", instructions="Say long things.", agent=AgentSpec(external=True),
                    environment=OpenEnvServer(path=str(ECHO_ENV)), budget=Budget(wall_clock_s=120))
        with ArenaClient(settings.rollout_url, settings.trajectory_url) as client:
            view = client.put_environment("echo", echo)
        assert view.hosted and view.url == f"{settings.rollout_url}/openenv/echo"
        yield stack.settings  # its NATS URL carries the administrator's credentials
    finally:
        stack.stop()


def url(settings: Settings, name: str = "quickstart") -> str:
    return f"{settings.rollout_url}/openenv/{name}"


def rollout(settings: Settings, rid: str) -> dict:
    return httpx.get(f"{settings.rollout_url}/v1/rollouts/{rid}").json()


def wait_final(settings: Settings, rid: str, timeout: float = 60) -> dict:
    return httpx.get(f"{settings.rollout_url}/v1/rollouts/{rid}/wait", params={"timeout": timeout},
                     timeout=timeout + 10).json()


def trajectory(settings: Settings, rid: str):
    return ArenaClient(settings.rollout_url, settings.trajectory_url).wait_trajectory(rid, timeout=30)


#: What the endpoint answers when an episode's sandbox is not up within ``openenv_start_timeout_s``
#: (under OpenEnv's 60 s client timeout): reset again and it waits for the same episode
#: (docs/openenv.md). On a loaded 2-core host a fresh server's start can take that long.
STILL_STARTING = "still starting"


def reset(env, tries: int = 4, **kwargs):
    """``env.reset()`` as a client following docs/openenv.md does it: again while still starting."""
    for attempt in range(tries):
        try:
            return env.reset(**kwargs)
        except RuntimeError as error:
            if STILL_STARTING not in str(error) or attempt == tries - 1:
                raise


async def areset(env, tries: int = 4, **kwargs):
    for attempt in range(tries):
        try:
            return await env.reset(**kwargs)
        except RuntimeError as error:
            if STILL_STARTING not in str(error) or attempt == tries - 1:
                raise


def call(tool: str, **arguments) -> dict:
    return {"type": "call_tool", "tool_name": tool, "arguments": arguments}


class AnyObservation(Observation):
    model_config = {"extra": "allow"}


class TypedClient(EnvClient[dict, AnyObservation, State]):
    """What an environment's author ships: a typed client (cf. ``openenv init``'s client.py)."""

    def _step_payload(self, action: dict) -> dict:
        return dict(action)

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[AnyObservation]:
        obs = AnyObservation(**payload.get("observation", {}), done=payload.get("done", False),
                             reward=payload.get("reward"))
        return StepResult(observation=obs, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


def test_openenv_validate_passes_against_an_arena_environment(arena):
    openenv_cli = Path(sys.executable).parent / "openenv"
    done = subprocess.run([str(openenv_cli), "validate", "--url", url(arena)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout[done.stdout.index("{"):])
    assert report["passed"] is True
    assert {c["id"] for c in report["criteria"] if c["passed"]} >= {
        "openapi_version_available", "health_endpoint", "metadata_endpoint", "schema_endpoint", "mcp_endpoint",
        "mode_endpoint_consistency"}


def test_a_sync_episode_fixes_the_bug_and_gets_the_verifiers_reward(arena):
    with GenericEnvClient(base_url=url(arena)).sync() as env:
        first = reset(env, seed=3)
        obs = first.observation
        assert first.done is False and first.reward is None
        assert "median" in obs["prompt"] and obs["llm_base_url"].endswith(f"/proxy/{obs['rollout_id']}/v1")
        # the client's own LLM call, through the rollout's proxy: a captured step of this rollout
        answer = httpx.post(f"{obs['llm_base_url']}/chat/completions", timeout=30,
                            headers={"authorization": f"Bearer {obs['llm_api_key']}"},
                            json={"model": "default", "messages": [{"role": "user", "content": obs["prompt"]}]})
        assert answer.status_code == 200, answer.text
        listing = env.step(call("read_file", path="textstats/core.py"))
        assert BUG in listing.observation["result"]["content"]
        edited = env.step(call("edit_file", path="textstats/core.py", old_str=BUG, new_str=FIX))
        assert edited.observation["result"] == {"replacements": 1}
        tests = env.step(call("shell", command="python -m pytest -q -p no:cacheprovider tests 2>&1 | tail -1"))
        assert "passed" in tests.observation["result"]["output"]
        state = env.state()
        assert state["rollout_state"] == "running" and state["step_count"] == 3
        final = env.step(call("submit"))
        assert final.done is True and final.reward == 1.0
        assert final.observation["verification"]["rollout_state"] == "completed"
        rid = obs["rollout_id"]
    view = rollout(arena, rid)
    assert view["state"] == "completed" and view["reward"] == 1.0
    assert view["metadata"]["arena.openenv.environment"] == "quickstart"
    traj = trajectory(arena, rid)
    steps = traj.sandbox.env_steps
    assert [s.kind for s in steps] == ["reset", "step", "step", "step", "step"]
    assert steps[2].action["tool_name"] == "edit_file" and steps[-1].done is True
    assert FIX.strip() in traj.sandbox.diff and traj.reward == 1.0
    assert len(traj.steps) == 1 and traj.steps[0].completion_token_ids  # the LLM call, token ids and all


async def test_typed_mcp_and_generic_clients_run_episodes_at_once_async_and_sync(arena):
    def typed_sync() -> str:
        with TypedClient(base_url=url(arena)).sync() as env:
            reset(env)
            step = env.step(call("shell", command="echo typed"))
            assert isinstance(step.observation, AnyObservation) and step.observation.result["output"] == "typed\n"
            assert env.step(call("submit")).done is True
            return env.state().episode_id

    async def typed() -> str:
        async with TypedClient(base_url=url(arena)) as env:
            first = await areset(env)
            assert isinstance(first.observation, AnyObservation)
            step = await env.step(call("write_file", path="answer.txt", content="42\n"))
            assert step.observation.result == {"bytes_written": 3}
            state = await env.state()
            assert isinstance(state, State) and state.step_count == 1
            end = await env.step(call("submit", answer="42"))
            assert end.done is True
            return state.episode_id

    async def mcp() -> str:
        async with MCPToolClient(base_url=url(arena)) as env:
            await areset(env)
            tools = await env.list_tools()
            assert [t.name for t in tools] == ["shell", "read_file", "write_file", "edit_file", "submit"]
            out = await env.call_tool("shell", command="echo $((6 * 7))")
            assert out["output"].strip() == "42" and out["exit_code"] == 0
            with pytest.raises(RuntimeError, match="tool_not_found"):
                await env.call_tool("format_disk")
            await env.call_tool("submit")
            return (await env.state()).episode_id

    async def generic() -> str:
        async with GenericEnvClient(base_url=url(arena)) as env:
            await areset(env)
            await env.step(call("shell", command="sleep 1"))
            result = await env.step(call("submit"))
            assert result.done
            return (await env.state())["rollout_id"]

    ids = await asyncio.gather(typed(), mcp(), generic(), generic(), asyncio.to_thread(typed_sync))
    assert len(set(ids)) == 5
    views = [rollout(arena, rid) for rid in ids]
    assert all(v["state"] == "completed" for v in views), [(v["state"], v["reason"]) for v in views]
    assert [v["reward"] for v in views] == [0.0] * 5  # nothing fixed


def test_bad_actions_are_validation_errors_and_the_episode_goes_on(arena):
    with GenericEnvClient(base_url=url(arena)).sync() as env:
        reset(env)
        for bad in ({"type": "call_tool"}, {"type": "teleport"}, {"type": "call_tool", "tool_name": "x", "y": 1}):
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                env.step(bad)
        wrong_args = env.step(call("read_file", path=7))
        assert wrong_args.observation["error"]["error_type"] == "invalid_args"
        escape = env.step(call("read_file", path="../../etc/passwd"))
        assert escape.observation["error"]["error_type"] == "invalid_args"
        assert env.step(call("shell", command="true")).observation["result"]["exit_code"] == 0
        env.step(call("submit"))


async def test_raw_frames_follow_openenvs_error_codes(arena):
    ws_url = url(arena).replace("http://", "ws://") + "/ws"
    async with websockets.connect(ws_url) as ws:
        async def rt(message) -> dict:
            await ws.send(message if isinstance(message, str) else json.dumps(message))
            return json.loads(await asyncio.wait_for(ws.recv(), 60))

        assert (await rt("{not json"))["data"]["code"] == "INVALID_JSON"
        assert (await rt("[" * 5000 + "]" * 5000))["data"]["code"] == "INVALID_JSON"  # nested too deeply
        assert (await rt({"type": "bogus"}))["data"]["code"] == "UNKNOWN_TYPE"
        assert (await rt({"type": "step"}))["data"]["code"] == "VALIDATION_ERROR"  # no data
        assert (await rt({"type": "step", "data": call("shell", command="true")}))["data"]["code"] == "EXECUTION_ERROR"
        assert await rt({"type": "state"}) == {"type": "state", "data": {"episode_id": None, "step_count": 0}}
        reset = await rt({"type": "reset", "data": {"seed": 1, "episode_id": "e-1"}})
        assert reset["type"] == "observation" and set(reset["data"]) == {"observation", "reward", "done"}
        mcp = await rt({"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}})
        assert [t["name"] for t in mcp["data"]["result"]["tools"]][0] == "shell"
        rid = reset["data"]["observation"]["rollout_id"]
        assert rollout(arena, rid)["metadata"]["arena.openenv.episode_id"] == "e-1"
        await ws.send(json.dumps({"type": "close"}))
        with pytest.raises(websockets.ConnectionClosedOK):
            await asyncio.wait_for(ws.recv(), 30)
    # a close frame ends the episode and what was done is verified
    assert wait_final(arena, rid)["state"] == "completed"


async def test_a_second_episode_beyond_capacity_gets_capacity_reached(arena):
    ws_url = url(arena, "solo").replace("http://", "ws://") + "/ws"
    async with websockets.connect(ws_url) as first:
        await first.send(json.dumps({"type": "state"}))
        assert json.loads(await first.recv())["type"] == "state"
        async with websockets.connect(ws_url) as second:
            frame = json.loads(await asyncio.wait_for(second.recv(), 10))
            assert frame["type"] == "error" and frame["data"]["code"] == "CAPACITY_REACHED"
            assert frame["data"]["active_sessions"] == 1 and frame["data"]["max_sessions"] == 1
            with pytest.raises(websockets.ConnectionClosedOK):
                await asyncio.wait_for(second.recv(), 10)
        client = GenericEnvClient(base_url=url(arena, "solo"))
        with pytest.raises(Exception):  # OpenEnv's client: the closed socket, or the error frame
            await client.connect()
            await client.reset()
        await client.disconnect()
    # the slot is free again once the first leaves
    async with GenericEnvClient(base_url=url(arena, "solo")) as env:
        assert (await env.state())["step_count"] == 0


async def test_a_client_that_drops_mid_episode_cancels_the_rollout_and_its_sandbox_is_reaped(arena):
    ws_url = url(arena).replace("http://", "ws://") + "/ws"
    ws = await websockets.connect(ws_url)
    await ws.send(json.dumps({"type": "reset", "data": {}}))
    rid = json.loads(await asyncio.wait_for(ws.recv(), 60))["data"]["observation"]["rollout_id"]
    await ws.send(json.dumps({"type": "step", "data": call("shell", command="echo started > /tmp/mark; sleep 30")}))
    await asyncio.sleep(1.0)
    ws.transport.abort()  # gone without a close frame (the socket closes on this loop's next turn)
    started = time.monotonic()
    view = await asyncio.to_thread(wait_final, arena, rid)
    assert time.monotonic() - started < 20  # noticed mid-step, not after the 30 s command
    assert view["state"] == "cancelled" and view["reason"] == "the OpenEnv client disconnected"
    sandboxes = Path(arena.data_dir) / "sandboxes"
    traj = await asyncio.to_thread(trajectory, arena, rid)
    assert traj.final_state.value == "cancelled" and traj.sandbox.outcome.value == "cancelled"
    assert not list(sandboxes.glob("*/*/workspace"))  # no sandbox left behind (every episode ended)


async def test_episodes_of_one_group_reach_the_trainer_stream_with_advantages(arena):
    group = "g-openenv-1"

    async def member(index: int) -> str:
        async with GenericEnvClient(base_url=url(arena)) as env:
            first = await areset(env, group_id=group, group_size=2, group_index=index)
            if index == 1:
                await env.step(call("edit_file", path="textstats/core.py", old_str=BUG, new_str=FIX))
            await env.step(call("submit"))
            return first.observation["rollout_id"]

    ids = await asyncio.gather(member(0), member(1))
    async with TrajectoryStream(arena.nats_url, name="openenv-test") as stream:
        async def first_group():
            async for batch in stream.groups(1):
                for done in batch:
                    if done.group_id == group:
                        await batch.commit()
                        return done
                await batch.commit()

        done = await asyncio.wait_for(first_group(), 60)
    assert [t.rollout_id for t in done.trajectories] == ids
    assert done.rewards == [0.0, 1.0] and done.advantages[1] > 0 > done.advantages[0]
    assert all(t.sandbox.env_steps for t in done.trajectories)


def test_http_routes_answer_like_an_openenv_server(arena):
    base = url(arena)
    assert httpx.get(f"{base}/health").json() == {"status": "healthy"}
    meta = httpx.get(f"{base}/metadata").json()
    assert meta["name"] == "quickstart" and meta["description"].startswith("The `textstats` package")
    schema = httpx.get(f"{base}/schema").json()
    assert set(schema) == {"action", "observation", "state"}
    assert httpx.post(f"{base}/mcp", json={}).json()["error"]["code"] == -32600
    reset = httpx.post(f"{base}/reset", json={}).json()
    assert reset["done"] is False and "median" in reset["observation"]["prompt"]
    assert httpx.post(f"{base}/reset", json={"seed": -1}).status_code == 422
    bad = httpx.post(f"{base}/step", json={"action": {"type": "nope"}})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"]
    assert httpx.get(f"{base}/state").json() == {"episode_id": None, "step_count": 0}
    missing = httpx.get(f"{arena.rollout_url}/openenv/nothing-here/health")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    listed = httpx.get(f"{arena.rollout_url}/v1/environments").json()["environments"]
    assert {e["name"] for e in listed} >= {"quickstart", "solo", "echo"}


@pytest.mark.timeout(900)  # three fresh environments, two of them hosted servers started from scratch
def test_stateless_step_runs_the_action_on_a_fresh_environment_as_openenvs_server_does(arena):
    """OpenEnv's ``POST /step`` builds a fresh environment, steps it once and closes it: 200 with
    the observation, for Arena's own task and a hosted one; a bad action is 422 in both."""
    ran = httpx.post(f"{url(arena)}/step", json={"action": call("shell", command="cat textstats/__init__.py | wc -l"),
                                                "timeout_s": 30}, timeout=180)
    assert ran.status_code == 200, ran.text
    body = ran.json()
    assert set(body) == {"observation", "reward", "done"} and body["done"] is False
    assert body["observation"]["result"]["exit_code"] == 0 and int(body["observation"]["result"]["output"]) > 0
    # the fresh environment is discarded: its rollout is cancelled, nothing left running
    cancelled = httpx.get(f"{arena.rollout_url}/v1/rollouts", params={"state": "cancelled"}).json()["rollouts"]
    assert [r for r in cancelled if "stateless POST /step" in (r["reason"] or "")
            and r["metadata"]["arena.openenv.environment"] == "quickstart"]
    # a hosted environment's action runs on its own server (the echo environment's reward is its length / 10)
    echoed = httpx.post(f"{url(arena, 'echo')}/step", json={"action": {"message": "hello"}}, timeout=400)
    assert echoed.status_code == 200, echoed.text
    assert echoed.json()["observation"]["echoed_message"] == "hello" and echoed.json()["reward"] == pytest.approx(0.5)
    # and its own check of the action is a 422 with its pydantic errors, as its server answers
    wrong = httpx.post(f"{url(arena, 'echo')}/step", json={"action": {"text": "wrong field"}}, timeout=400)
    assert wrong.status_code == 422, wrong.text
    assert {e["type"] for e in wrong.json()["detail"]} >= {"extra_forbidden"}


async def test_an_invalid_action_is_a_validation_error_before_reset_and_after_the_episode_is_done(arena):
    ws_url = url(arena).replace("http://", "ws://") + "/ws"
    async with websockets.connect(ws_url) as ws:
        async def rt(message) -> dict:
            await ws.send(json.dumps(message))
            return json.loads(await asyncio.wait_for(ws.recv(), 90))

        bad = {"type": "step", "data": {"type": "teleport"}}
        assert (await rt(bad))["data"]["code"] == "VALIDATION_ERROR"  # no episode yet
        assert (await rt({"type": "step", "data": call("shell", command="true")}))["data"]["code"] == "EXECUTION_ERROR"
        assert (await rt({"type": "reset", "data": {}}))["type"] == "observation"
        submitted = await rt({"type": "step", "data": call("submit")})
        assert submitted["data"]["done"] is True
        after = await rt(bad)
        assert after["data"]["code"] == "VALIDATION_ERROR" and after["data"]["errors"], after
        over = await rt({"type": "step", "data": call("shell", command="true")})
        assert over["data"]["code"] == "EXECUTION_ERROR" and "is over" in over["data"]["message"]


def test_registering_a_task_that_is_not_external_is_refused(arena):
    task = msgspec.to_builtins(load_task(QUICKSTART))
    named_k = httpx.put(f"{arena.rollout_url}/v1/environments/k", json={"task": {**task, "agent": {"external": True}}})
    assert named_k.status_code == 422 and "/openenv/k/" in named_k.json()["error"]["message"]
    got = httpx.put(f"{arena.rollout_url}/v1/environments/not-external", json={"task": task})
    assert got.status_code == 422 and "external" in got.json()["error"]["message"]
    direct = httpx.post(f"{arena.rollout_url}/v1/rollouts",
                        json={"task": {**task, "agent": {"external": True}}})
    assert direct.status_code == 422 and "environment endpoint" in direct.json()["error"]["message"]


def test_the_echo_environment_is_hosted_as_a_task_and_its_rewards_summed(arena):
    with GenericEnvClient(base_url=url(arena, "echo")).sync() as env:
        first = reset(env)
        assert first.observation == {"echoed_message": "Echo Env environment ready!", "message_length": 0}
        a = env.step({"message": "hello"})
        b = env.step({"message": "hi"})
        assert (a.reward, b.reward) == (pytest.approx(0.5), pytest.approx(0.2))
        with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
            env.step({"text": "wrong field"})
        state = env.state()
        assert state["step_count"] == 2 and state["rollout_state"] == "running"
        rid = state["rollout_id"]
    view = wait_final(arena, rid)
    assert view["state"] == "completed" and view["reward"] == pytest.approx(0.7)
    traj = trajectory(arena, rid)
    # the wrong field is refused by the endpoint with the server's own schema: it never reaches the server
    assert [s.observation.get("echoed_message") for s in traj.sandbox.env_steps] == [
        "Echo Env environment ready!", "hello", "hi"]
    assert traj.verification.verifier == "env_reward" and "env_not_done" in traj.verification.flags


def test_a_hosted_environment_started_by_a_relative_command_runs_in_its_own_directory(arena, tmp_path):
    """``environment.command`` ``["./serve.sh"]``: run in the environment's directory (the local
    provider, bubblewrap), where the script and the server's files are, through the real stack."""
    env_dir = tmp_path / "echo-relative"
    shutil.copytree(ECHO_ENV, env_dir, ignore=shutil.ignore_patterns("__pycache__"))
    (env_dir / "serve.sh").write_text("#!/bin/sh\n# relative paths only: this runs from the environment's directory\n"
                                      "test -f server/app.py || { echo \"not in the environment's directory: $(pwd)\" >&2; "
                                      "exit 3; }\nexec python -m uvicorn server.app:app --host 127.0.0.1 --port 8000\n")
    (env_dir / "serve.sh").chmod(0o755)
    task = Task(id="echo-relative", instructions="Echo, served by ./serve.sh.", agent=AgentSpec(external=True),
                environment=OpenEnvServer(path=str(env_dir), command=["./serve.sh"], reuse=False),
                budget=Budget(wall_clock_s=120))
    with ArenaClient(arena.rollout_url, arena.trajectory_url) as client:
        client.put_environment("echo-relative", task)
    with GenericEnvClient(base_url=url(arena, "echo-relative")).sync() as env:
        first = reset(env)
        assert first.observation["echoed_message"] == "Echo Env environment ready!"
        assert env.step({"message": "hello"}).reward == pytest.approx(0.5)
        rid = env.state()["rollout_id"]
    view = wait_final(arena, rid)
    assert view["state"] == "completed", view


def test_the_trl_environment_class_plays_an_episode(arena):
    """``examples/openenv-trl``'s class, as TRL's ``environment_factory`` calls it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("arena_env", ROOT / "examples" / "openenv-trl" / "arena_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = module.ArenaToolEnv(url(arena))
    from transformers.utils import get_json_schema  # how TRL renders each tool method for the prompt

    tools = {name: get_json_schema(getattr(env, name)) for name in ("shell", "read_file", "edit_file", "submit")}
    assert tools["edit_file"]["function"]["parameters"]["required"] == ["path", "old_str", "new_str"]
    try:
        assert "median" in env.reset(seed=1, prompt="ignored")
        assert "def median" in env.read_file("textstats/core.py")
        assert env.edit_file("textstats/core.py", BUG, FIX) == "1 replacement(s)"
        assert "exit code 0" in env.shell("python -m pytest -q -p no:cacheprovider tests")
        assert env.get_reward() == 0.0
        assert env.submit() == "submitted; reward 1.0" and env.get_reward() == 1.0
        assert "median" in env.reset()  # the next episode, on the same instance
    finally:
        env._env.close()


async def test_a_hosted_environments_bad_action_is_a_validation_error_after_done_and_before_reset(arena, tmp_path):
    """A hosted server's action schema (its ``GET /schema``, read when it starts) checks every action
    as the server would: after the episode is done (the server is no longer asked) and, once the
    environment served an episode, before a new one's reset; ``/schema`` then shows the server's own."""
    env_dir = tmp_path / "echo-ends"
    shutil.copytree(ECHO_ENV, env_dir, ignore=shutil.ignore_patterns("__pycache__"))
    source = env_dir / "server" / "echo_env_environment.py"
    code = source.read_text()
    assert code.count("done=False,") == 2
    source.write_text(code.replace("done=False,", 'done=message == "bye",', 2).replace(
        'done=message == "bye",', "done=False,", 1))  # reset's stays False; step's ends on "bye"
    task = Task(id="echo-ends", instructions="Echo until bye.", agent=AgentSpec(external=True),
                environment=OpenEnvServer(path=str(env_dir)), budget=Budget(wall_clock_s=120))
    with ArenaClient(arena.rollout_url, arena.trajectory_url) as client:
        client.put_environment("echo-ends", task)
    ws_url = url(arena, "echo-ends").replace("http://", "ws://") + "/ws"
    bad = {"type": "step", "data": {"text": "wrong field"}}
    async with websockets.connect(ws_url) as ws:
        async def rt(message) -> dict:
            await ws.send(json.dumps(message))
            return json.loads(await asyncio.wait_for(ws.recv(), 90))

        first = await rt({"type": "reset", "data": {}})
        for _ in range(3):
            if first["type"] == "error" and STILL_STARTING in first["data"]["message"]:
                first = await rt({"type": "reset", "data": {}})
        assert first["type"] == "observation", first
        during = await rt(bad)
        assert during["data"]["code"] == "VALIDATION_ERROR", during
        ended = await rt({"type": "step", "data": {"message": "bye"}})
        assert ended["data"]["done"] is True, ended
        after = await rt(bad)
        assert after["data"]["code"] == "VALIDATION_ERROR", after
        assert {"type": "extra_forbidden", "loc": ["text"]}.items() <= after["data"]["errors"][0].items()
        missing = await rt({"type": "step", "data": {}})
        assert missing["data"]["code"] == "VALIDATION_ERROR" and missing["data"]["errors"][0]["type"] == "missing"
        over = await rt({"type": "step", "data": {"message": "again"}})
        assert over["data"]["code"] == "EXECUTION_ERROR" and "is over" in over["data"]["message"], over
    async with websockets.connect(ws_url) as ws:  # a new session: checked before its reset
        await ws.send(json.dumps(bad))
        before = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert before["data"]["code"] == "VALIDATION_ERROR", before
    schema = httpx.get(f"{url(arena, 'echo-ends')}/schema").json()
    assert "message" in schema["action"]["properties"] and "message" in schema["action"].get("required", [])
