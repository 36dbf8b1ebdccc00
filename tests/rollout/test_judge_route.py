"""The judge route: the real ``llm_judge`` verifier code calls the real rollout app (uvicorn)
in front of a real scripted vLLM-shaped backend (uvicorn), with a real nats-server. The
judge's call is answered through the proxy's router but never becomes a step of the
rollout, never counts against its budgets, and needs the verification service's key."""

from __future__ import annotations

import asyncio
import socket

import httpx
import msgspec
import pytest

from arena_core import subjects
from arena_core.errors import VerificationError
from arena_core.runtime import serve
from arena_core.schemas import (AgentSpec, BackendReplica, Budget, LlmJudgeVerifier, RolloutState, Step,
                           SubmitRolloutRequest, Task, TestsVerifier, VerifyJob)
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse
from arena_stack.scripted_llm import create_app as create_llm_app
from arena_core.settings import Settings
from arena_rollout.app import create_app
from arena_rollout.proxy.routing import Router
from arena_rollout.proxy.upstream import UpstreamClient
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore
from arena_verification import judge
from arena_verification.runner import verify
from tests.steps_reader import read_steps

JUDGE_KEY = "judge-secret-for-tests"
SCRIPT = Script(responses=[ScriptedResponse(label="grade", content="Correct and explained.\nSCORE: 0.75")])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start(app, stops: list) -> str:
    port, stop = free_port(), asyncio.Event()
    stops.append((stop, asyncio.create_task(serve(stop, app=app, port=port))))
    for _ in range(500):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return f"http://127.0.0.1:{port}"
        except OSError:
            await asyncio.sleep(0.02)
    raise RuntimeError("server did not start")


@pytest.fixture
async def arena(bus, tmp_path):
    stops: list = []
    http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=2.0))
    pool = UpstreamClient(connect_timeout=2.0, read_timeout=30.0)
    backend = await start(create_llm_app(ScriptedLLM(SCRIPT, policy_version="v1")), stops)
    replica = BackendReplica(replica_id="r0", url=backend + "/v1", policy_version="v1")
    settings = Settings(
        allow_host_paths=True, nats_url="nats://127.0.0.1:1", backend_url=replica.url, judge_key=JUDGE_KEY)
    kv = await bus.kv(subjects.KV_ROLLOUTS)
    store = RolloutStore(kv)
    service = RolloutService(bus=bus, store=store, settings=settings, http=http, router=Router([replica]),
                             upstream=pool)
    url = await start(create_app(service), stops)
    repo = tmp_path / "repo"
    repo.mkdir()
    task = Task(id="t", repo=str(repo), instructions="fix", agent=AgentSpec(command=["true"]),
                verifier=TestsVerifier(fail_to_pass=["t::x"]), budget=Budget(max_turns=1, max_total_tokens=100_000))
    record = await service.submit(SubmitRolloutRequest(task=task))
    await service.transition(record.rollout_id, RolloutState.RUNNING, reason="test")
    try:
        yield service, url, record, task
    finally:
        for stop, _ in stops:
            stop.set()
        await asyncio.gather(*(t for _, t in stops), return_exceptions=True)
        await pool.aclose()
        await http.aclose()


async def steps_of(bus, rid: str) -> list[Step]:
    return await read_steps(bus, rid, within=3)


def env(url: str, key: str = JUDGE_KEY) -> dict[str, str]:
    return {"ARENA_JUDGE_KEY": key, "ARENA_PUBLIC_URL": url}


async def test_the_judge_goes_through_the_proxy_but_is_never_a_step(arena, bus):
    service, url, record, _ = arena
    rid = record.rollout_id
    async with httpx.AsyncClient(timeout=30) as client:  # the agent's one allowed step
        r = await client.post(f"{url}/proxy/{rid}/v1/chat/completions", headers={"authorization": f"Bearer {record.api_key}"},
                              json={"model": "default", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    await service.proxy.drain()
    before = await service.store.current(rid)
    assert before.steps == 1 and before.total_tokens > 0
    await service.transition(rid, RolloutState.VERIFYING, reason="sandbox finished")  # the key is now dead

    spec = LlmJudgeVerifier(rubric="The answer must be explained.", model="judge-model")
    for _ in range(3):  # past the rollout's max_turns=1: the judge is not counted
        outcome, call = await judge.judge(spec, "it is 2.5", rollout_id=rid, env=env(url))
        assert outcome.reward == 0.75 and outcome.components == {"judge": 0.75}
        assert call.base_url == f"{url}/judge/{rid}/v1" and call.completion_text.endswith("SCORE: 0.75")
        assert call.usage is not None and call.usage.completion_tokens > 0
    await service.proxy.drain()
    after = await service.store.current(rid)
    assert (after.steps, after.total_tokens, after.state) == (1, before.total_tokens, RolloutState.VERIFYING)
    steps = await steps_of(bus, rid)
    assert [s.step_index for s in steps] == [0]  # only the agent's call is on ARENA_STEPS


async def test_the_runner_defaults_to_the_proxy_and_records_the_call(arena, monkeypatch):
    service, url, record, task = arena
    monkeypatch.delenv("ARENA_JUDGE_BASE_URL", raising=False)
    monkeypatch.delenv("ARENA_JUDGE_API_KEY", raising=False)
    monkeypatch.setenv("ARENA_JUDGE_KEY", JUDGE_KEY)
    monkeypatch.setenv("ARENA_PUBLIC_URL", url)
    spec = LlmJudgeVerifier(rubric="Explain.", model="judge-model")
    result = await verify(VerifyJob(rollout_id=record.rollout_id, task=msgspec.structs.replace(task, verifier=spec), diff=""))
    assert result.reward == 0.75 and len(result.judge_calls) == 1
    assert result.judge_calls[0].base_url == f"{url}/judge/{record.rollout_id}/v1"
    assert (await service.store.current(record.rollout_id)).steps == 0


async def test_the_judge_route_needs_the_judge_key_and_an_existing_rollout(arena):
    _, url, record, _ = arena
    rid = record.rollout_id
    body = {"model": "judge-model", "messages": [{"role": "user", "content": "grade"}]}
    async with httpx.AsyncClient(timeout=30) as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Bearer {record.api_key}"}):
            r = await client.post(f"{url}/judge/{rid}/v1/chat/completions", headers=headers, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        good = {"authorization": f"Bearer {JUDGE_KEY}"}
        r = await client.post(f"{url}/judge/nope/v1/chat/completions", headers=good, json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await client.post(f"{url}/judge/{rid}/v1/chat/completions", headers=good, json={**body, "stream": True})
        assert r.status_code == 422 and "stream" in r.json()["error"]["message"]
        r = await client.post(f"{url}/judge/{rid}/v1/chat/completions", headers=good, json=body)
        assert r.status_code == 200
        choice = r.json()["choices"][0]
        assert choice["message"]["content"].endswith("SCORE: 0.75") and choice["logprobs"]["content"]
    with pytest.raises(VerificationError, match="HTTP 401"):
        await judge.judge(LlmJudgeVerifier(rubric="x"), "y", rollout_id=rid, env=env(url, key="wrong"))


def test_an_explicit_endpoint_wins_over_the_proxy():
    spec = LlmJudgeVerifier(rubric="x")
    proxy = {"ARENA_JUDGE_KEY": "k", "ARENA_PUBLIC_URL": "http://arena:9090/"}
    assert judge.endpoint_of(spec, "r1", proxy) == ("http://arena:9090/judge/r1/v1", "k")
    assert judge.endpoint_of(spec, "r1", {**proxy, "ARENA_JUDGE_BASE_URL": "http://j/v1/", "ARENA_JUDGE_API_KEY": "a"}
                             ) == ("http://j/v1", "a")
    explicit = msgspec.structs.replace(spec, base_url="http://other/v1")
    assert judge.endpoint_of(explicit, "r1", proxy) == ("http://other/v1", "")
    with pytest.raises(VerificationError, match="ARENA_JUDGE_KEY"):
        judge.endpoint_of(spec, "r1", {})
