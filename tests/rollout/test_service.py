"""The rollout service against a real nats-server: the real FastAPI app (in-process through
httpx's ASGI transport) and the real scripted LLM served on a real port, reached by the
proxy's own upstream client."""

from __future__ import annotations

import asyncio
import httpx
import msgspec
import pytest

from arena_core import subjects
from arena_core.bus import Consumer
from arena_core.errors import Unavailable
from arena_stack.natsserver import free_port
from arena_core.runtime import serve
from arena_core.schemas import (
    DeadLetter,
    AgentSpec,
    Budget,
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxJob,
    SandboxOutcome,
    SandboxStarted,
    Step,
    Task,
    TestCounts,
    TestsVerifier,
    VerificationResult,
)
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse
from arena_stack.scripted_llm import create_app as create_llm_app
from arena_core.settings import Settings
from arena_rollout.app import create_app
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore
from arena_rollout.worker import consumers


def task_json(tmp_path, **budget) -> dict:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    task = Task(id="t1", repo=str(repo), instructions="fix it", agent=AgentSpec(command=["true"]),
                verifier=TestsVerifier(fail_to_pass=["tests/test_a.py::test_a"]), budget=Budget(**budget))
    return msgspec.to_builtins(task)


@pytest.fixture
async def rollout(bus, tmp_path):
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="the answer")]), policy_version="3")
    port, stop = free_port(), asyncio.Event()
    llm_server = asyncio.create_task(serve(stop, app=create_llm_app(llm), port=port))
    backend = httpx.AsyncClient()
    for _ in range(200):
        try:
            if (await backend.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 200:
                break
        except httpx.TransportError:
            await asyncio.sleep(0.02)
    settings = Settings(allow_host_paths=True, nats_url="nats://127.0.0.1:1", backend_url=f"http://127.0.0.1:{port}/v1",
                        public_url="http://arena:9090", backend_policy_version="3", max_body_bytes=64 * 1024)
    store = RolloutStore(await bus.kv(subjects.KV_ROLLOUTS))  # as the service runs it
    service = RolloutService(bus=bus, store=store, settings=settings, http=backend)
    runner = asyncio.create_task(serve(stop, consumers=consumers(bus, service)))
    api = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)), base_url="http://arena")
    try:
        yield api, service
    finally:
        stop.set()
        await runner
        await llm_server
        await api.aclose()
        await service.upstream.aclose()
        await backend.aclose()


async def fetch_all(bus, stream: str, subject: str, type_):
    sub = await bus.js.pull_subscribe(subject, stream=stream)
    out = []
    try:
        while True:
            msgs = await sub.fetch(batch=100, timeout=0.5)
            out += [msgspec.json.decode(m.data, type=type_) for m in msgs]
    except Exception:  # noqa: BLE001 - fetch timeout: drained
        pass
    await sub.unsubscribe()
    return out


async def test_group_lifecycle_through_the_api(rollout, bus, tmp_path):
    api, service = rollout
    resp = await api.post("/v1/rollout-groups", json={"task": task_json(tmp_path), "n": 2, "sampling": {"seed": 5}})
    assert resp.status_code == 201, resp.text
    group = resp.json()
    rids = group["rollout_ids"]
    assert len(rids) == 2
    for rid in rids:
        view = (await api.get(f"/v1/rollouts/{rid}")).json()
        assert view["state"] == "provisioning" and view["group_id"] == group["group_id"]
        assert "api_key" not in view
    jobs = await fetch_all(bus, "ARENA_SANDBOX_JOBS", "arena.sandbox.run.local", SandboxJob)
    assert sorted(j.rollout_id for j in jobs) == sorted(rids)
    seeds = sorted([(await service.store.get(rid))[0].sampling.seed for rid in rids])
    assert seeds == [5, 6]

    rid = rids[0]
    job = next(j for j in jobs if j.rollout_id == rid)
    assert job.proxy_url == f"http://arena:9090/proxy/{rid}/v1"
    await bus.publish(subjects.sandbox_started(rid), SandboxStarted(rollout_id=rid, sandbox_id="s1", provider="local",
                                                                    at=1.0), msg_id=subjects.msg_id(rid, "started"))
    for _ in range(100):
        if (await api.get(f"/v1/rollouts/{rid}")).json()["state"] == "running":
            break
        await asyncio.sleep(0.05)

    # the agent's call through the proxy, with its per-rollout key
    chat = await api.post(f"/proxy/{rid}/v1/chat/completions", headers={"authorization": f"Bearer {job.api_key}"},
                          json={"model": "x", "messages": [{"role": "user", "content": "hello"}],
                                "return_token_ids": True, "logprobs": True})
    assert chat.status_code == 200, chat.text
    assert chat.headers["x-request-id"].startswith("req_")
    answer = chat.json()
    assert answer["choices"][0]["message"]["content"] == "the answer"
    steps = await fetch_all(bus, "ARENA_STEPS", f"arena.step.{rid}", Step)
    assert len(steps) == 1
    assert steps[0].completion_token_ids == answer["choices"][0]["token_ids"]
    assert steps[0].prompt_token_ids == answer["prompt_token_ids"]
    record, _ = await service.store.get(rid)
    assert steps[0].policy_version == "3" and steps[0].sampling.seed == record.sampling.seed
    assert steps[0].logprobs == [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]

    # another rollout's key is refused
    other = next(j for j in jobs if j.rollout_id != rid)
    bad = await api.post(f"/proxy/{rid}/v1/chat/completions", headers={"authorization": f"Bearer {other.api_key}"},
                         json={"messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "unauthorized"

    await bus.publish(subjects.sandbox_done(rid), SandboxDone(
        rollout_id=rid, sandbox_id="s1", provider="local", outcome=SandboxOutcome.COMPLETED, reason="done written",
        started_at=1.0, finished_at=2.0, diff="d"), msg_id=subjects.msg_id(rid, "sandbox-done"))
    await bus.publish(subjects.verify_done(rid), VerificationResult(
        rollout_id=rid, verifier="tests", reward=1.0, passed=True, started_at=2.0, finished_at=3.0,
        counts=TestCounts(f2p_passed=1)), msg_id=subjects.msg_id(rid, "verify-done"))
    waited = (await api.get(f"/v1/rollouts/{rid}/wait", params={"timeout": 10})).json()
    assert waited["state"] == "completed" and waited["reward"] == 1.0 and waited["steps"] == 1
    assert [h["to_state"] for h in waited["history"]] == ["pending", "provisioning", "running", "verifying",
                                                          "completed"]
    # the key dies with the rollout
    late = await api.post(f"/proxy/{rid}/v1/chat/completions", headers={"authorization": f"Bearer {job.api_key}"},
                          json={"messages": [{"role": "user", "content": "x"}]})
    assert late.status_code == 401

    states = await fetch_all(bus, "ARENA_ROLLOUTS", f"arena.rollout.state.{rid}", RolloutStateChanged)
    assert [s.to_state.value for s in states] == ["pending", "provisioning", "running", "verifying", "completed"]
    assert states[-1].steps == 1 and states[-1].reward == 1.0
    # the final event carries the whole history, so the trajectory never misses a transition
    assert [h.to_state.value for h in states[-1].history] == ["pending", "provisioning", "running", "verifying",
                                                              "completed"]
    assert all(not s.history for s in states[:-1])

    # cancel the other one; the SSE stream ends with it
    cancelled = await api.post(f"/v1/rollouts/{other.rollout_id}/cancel")
    assert cancelled.json()["state"] == "cancelled"
    again = await api.post(f"/v1/rollouts/{other.rollout_id}/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
    events = (await api.get(f"/v1/rollouts/{other.rollout_id}/events")).text
    assert events.count("event: state") == 3 and '"to_state":"cancelled"' in events
    listed = (await api.get("/v1/rollouts", params={"state": "cancelled"})).json()["rollouts"]
    assert [r["rollout_id"] for r in listed] == [other.rollout_id]


async def test_sandbox_failure_ends_the_rollout_with_the_reason(rollout, bus, tmp_path):
    api, _ = rollout
    rid = (await api.post("/v1/rollouts", json={"task": task_json(tmp_path)})).json()["rollout_id"]
    await bus.publish(subjects.sandbox_done(rid), SandboxDone(
        rollout_id=rid, sandbox_id="s", provider="local", outcome=SandboxOutcome.TIMED_OUT,
        reason="wall clock of 60s exceeded", started_at=1.0, finished_at=61.0),
        msg_id=subjects.msg_id(rid, "sandbox-done"))
    view = (await api.get(f"/v1/rollouts/{rid}/wait", params={"timeout": 10})).json()
    assert view["state"] == "timed_out" and view["reason"] == "wall clock of 60s exceeded"
    assert not view.get("infrastructure", False)  # the agent ran out of time: a policy outcome


async def test_a_sandbox_that_could_not_run_is_an_infrastructure_outcome_with_no_reward(rollout, bus, tmp_path):
    api, _ = rollout
    rid = (await api.post("/v1/rollouts", json={"task": task_json(tmp_path)})).json()["rollout_id"]
    await bus.publish(subjects.sandbox_done(rid), SandboxDone(
        rollout_id=rid, sandbox_id="s", provider="docker", outcome=SandboxOutcome.ERROR,
        reason="cannot prepare the sandbox: image arena/x is not present", started_at=1.0, finished_at=1.0),
        msg_id=subjects.msg_id(rid, "sandbox-done"))
    view = (await api.get(f"/v1/rollouts/{rid}/wait", params={"timeout": 10})).json()
    assert view["state"] == "failed" and view["infrastructure"] is True and view.get("reward") is None
    assert view["reason"] == "infrastructure: cannot prepare the sandbox: image arena/x is not present"


async def test_budget_exhaustion_refuses_the_call_and_ends_the_rollout(rollout, bus, tmp_path):
    api, service = rollout
    rid = (await api.post("/v1/rollouts", json={"task": task_json(tmp_path, max_turns=1)})).json()["rollout_id"]
    key = (await service.store.get(rid))[0].api_key
    body = {"messages": [{"role": "user", "content": "x"}]}
    first = await api.post(f"/proxy/{rid}/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, json=body)
    assert first.status_code == 200
    second = await api.post(f"/proxy/{rid}/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                            json=body)
    # 403 with x-should-retry: false: no SDK or scaffold retries it into a confusing 401
    assert second.status_code == 403 and second.headers["x-should-retry"] == "false"
    assert second.json()["error"] == {"code": "budget_exhausted", "type": "permission_error", "param": None,
                                      "message": "turn budget exhausted: 1 of 1 LLM calls used"}
    view = (await api.get(f"/v1/rollouts/{rid}")).json()
    assert view["state"] == "budget_exhausted" and view["steps"] == 1


async def test_bad_requests_get_clear_4xx(rollout, tmp_path):
    api, _ = rollout
    good = task_json(tmp_path)
    cases = [
        (b"{not json", 422, "not valid JSON"),
        (b"", 422, "empty"),
        (msgspec.json.encode({"task": {**good, "colour": "red"}}), 422, "unknown field `colour` - at `$.task`"),
        (msgspec.json.encode({"task": {**good, "repo": "/nonexistent"}}), 422, "is not a directory"),
        (msgspec.json.encode({"task": {k: v for k, v in good.items() if k != "agent"}}), 422,
         "missing required field `agent`"),
        (msgspec.json.encode({"task": good, "sampling": {"temperature": "hot"}}), 422, "Expected `float | null`"),
        (b"x" * (64 * 1024 + 1), 413, "exceeds"),
    ]
    for body, status, message in cases:
        resp = await api.post("/v1/rollouts", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == status, (body[:60], resp.text)
        assert message in resp.json()["error"]["message"]
    group = await api.post("/v1/rollout-groups", json={"task": good, "n": 0})
    assert group.status_code == 422 and "Expected `int` >= 1 - at `$.n`" in group.json()["error"]["message"]
    missing = await api.get("/v1/rollouts/r-nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    bad_state = await api.get("/v1/rollouts", params={"state": "bogus"})
    assert bad_state.status_code == 422
    nokey = await api.post("/proxy/r-nope/v1/chat/completions", json={"messages": []})
    assert nokey.status_code == 401


async def test_a_dead_lettered_verify_job_fails_the_rollout(rollout, bus, tmp_path):
    api, _ = rollout
    rid = (await api.post("/v1/rollouts", json={"task": task_json(tmp_path)})).json()["rollout_id"]
    letter = DeadLetter(stream="ARENA_VERIFY_JOBS", subject="arena.verify.run", consumer="verifier",
                        error="RuntimeError: sandbox broke", num_delivered=3,
                        data=msgspec.json.encode({"rollout_id": rid, "task": task_json(tmp_path), "diff": ""}), at=1.0)
    await bus.publish(subjects.dead("ARENA_VERIFY_JOBS"), letter, msg_id=f"dead:{rid}")
    view = (await api.get(f"/v1/rollouts/{rid}/wait", params={"timeout": 10})).json()
    assert view["state"] == "failed"
    # Arena could not verify it: an infrastructure outcome with no reward, never a 0
    assert view["reason"] == "infrastructure: verification gave up after 3 deliveries: RuntimeError: sandbox broke"
    assert view["infrastructure"] is True and view.get("reward") is None


async def test_a_task_with_a_non_test_verifier_is_accepted(rollout, tmp_path):
    api, _ = rollout
    task = {**task_json(tmp_path), "verifier": {"type": "exact", "answers": ["42"]}}
    resp = await api.post("/v1/rollouts", json={"task": task})
    assert resp.status_code == 201, resp.text
    assert resp.json()["state"] == "provisioning"


async def test_compare_and_set_loses_races_and_retries(bus, tmp_path):
    """Two stores (two service replicas) on one bucket, writing with nats-py's ``kv.update``:
    a write from a stale revision is refused, ``update`` retries it, nothing is lost."""
    from nats.js.errors import KeyWrongLastSequenceError

    from arena_core.schemas import RolloutRecord, RolloutState, SamplingParams

    kv = await bus.kv(subjects.KV_ROLLOUTS)
    a, b = RolloutStore(kv), RolloutStore(kv)
    task = msgspec.convert(task_json(tmp_path), Task)
    revision = await a.create(RolloutRecord(rollout_id="cas", task=task, sampling=SamplingParams(), model="m",
                                            provider="local", api_key="k", state=RolloutState.RUNNING,
                                            created_at=1.0, updated_at=1.0))
    with pytest.raises(KeyWrongLastSequenceError):
        await a._compare_and_set("cas", b"{}", revision - 1)  # noqa: SLF001 - the write itself

    def bump(r: RolloutRecord) -> RolloutRecord:
        return msgspec.structs.replace(r, steps=r.steps + 1)

    await asyncio.gather(*(store.update("cas", bump) for _ in range(10) for store in (a, b)))
    record, _ = await a.get("cas")
    assert record.steps == 20


async def test_a_duel_whose_second_side_cannot_be_submitted_leaves_no_side_running(rollout, tmp_path):
    """A duel runs whole or not at all: when side b's submission fails (the store or the bus
    refusing it here), side a's rollouts are cancelled and the caller gets the error."""
    api, service = rollout
    submitted: list[list[str]] = []
    submit_members = service._submit_members

    async def second_side_fails(req, private, **kw):
        if submitted:
            raise Unavailable("the bus refused side b")
        group = await submit_members(req, private, **kw)
        submitted.append(group.rollout_ids)
        return group

    service._submit_members = second_side_fails
    # the backend serves both policies by name (one listing no models would be refused: same_backend)
    default = service.router.replicas["default"].replica
    service.router.upsert(msgspec.structs.replace(default, models=["pa", "pb"]))
    resp = await api.post("/v1/duels", json={"task": task_json(tmp_path), "policies": ["pa", "pb"], "n": 2})
    assert resp.status_code == 503, resp.text
    [side_a] = submitted
    for rid in side_a:
        record, _ = await service.store.get(rid)
        assert record.state == RolloutState.CANCELLED and "could not be submitted whole" in record.reason
