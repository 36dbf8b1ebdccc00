"""Analytics routes of the trajectory API over a chDB store: rewards, pass rates, tokens,
latency per plane, filters, export paging."""

from __future__ import annotations

import httpx
import pytest

from arena_core.schemas import (
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    StateTransition,
    Step,
    Timings,
    Usage,
    VerificationResult,
)
from arena_trajectory import assembler
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore

T0 = 1_700_000_000.0


def step(rid: str, i: int, version: str, *, prompt: int, completion: int, logprobs) -> Step:
    return Step(rollout_id=rid, step_index=i, model="m", backend="b", policy_version=version,
                prompt_token_ids=list(range(prompt)), completion_token_ids=list(range(completion)),
                logprobs=logprobs, usage=Usage(prompt_tokens=prompt, completion_tokens=completion),
                timings=Timings(queued_ms=1.0, first_token_ms=10.0 * (i + 1), total_ms=100.0 * (i + 1)),
                started_at=T0 + i)


def make(rid, task, *, group, index, reward, version="1", state=RolloutState.COMPLETED):
    event = RolloutStateChanged(rollout_id=rid, task_id=task, from_state=RolloutState.VERIFYING, to_state=state,
                                at=T0 + 60, steps=2, group_id=group, group_index=index, group_size=2)
    steps = [step(rid, 0, version, prompt=10, completion=4, logprobs=[-1.0, -1.0, -1.0, -1.0]),
             step(rid, 1, version, prompt=20, completion=2, logprobs=[-0.5, -0.5])]
    sandbox = SandboxDone(rollout_id=rid, sandbox_id="s", provider="local", outcome=SandboxOutcome.COMPLETED,
                          reason="", started_at=T0 + 2, finished_at=T0 + 32)
    verification = VerificationResult(rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0,
                                      started_at=T0 + 40, finished_at=T0 + 45)
    history = [StateTransition(from_state=None, to_state=RolloutState.PENDING, at=T0),
               StateTransition(from_state=RolloutState.PROVISIONING, to_state=RolloutState.RUNNING, at=T0 + 2)]
    return assembler.assemble(event, steps, sandbox, verification, history=history), steps, sandbox, verification


@pytest.fixture
async def client(tmp_path):
    store = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await store.init()
    rows = [make("a0", "add", group="ga", index=0, reward=1.0), make("a1", "add", group="ga", index=1, reward=0.0),
            make("b0", "sub", group="gb", index=0, reward=0.0, version="2"),
            make("b1", "sub", group="gb", index=1, reward=0.0, version="2")]
    for t, steps, sandbox, verification in rows:
        await store.insert_trajectory(t)
        await store.insert_steps(steps)
        await store.insert_sandbox_result(sandbox)
        await store.insert_verification(verification)
        await store.insert_states([RolloutStateChanged(rollout_id=t.rollout_id, task_id=t.task_id, from_state=h.from_state,
                                                       to_state=h.to_state, at=h.at) for h in t.history])
    await store.insert_trajectory(rows[0][0])  # a redelivery: never counted twice
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store)), base_url="http://t") as c:
        yield c
    await store.close()


async def test_rewards_by_task_and_by_policy_version(client):
    by_task = (await client.get("/v1/stats/rewards", params={"by": "task"})).json()["rows"]
    assert [(r["key"], r["trajectories"], r["mean_reward"], r["pass_rate"]) for r in by_task] == [
        ("add", 2, 0.5, 0.5), ("sub", 2, 0.0, 0.0)]
    by_version = (await client.get("/v1/stats/rewards", params={"by": "policy_version"})).json()["rows"]
    assert [(r["key"], r["trajectories"]) for r in by_version] == [("1", 2), ("2", 2)]
    bad = await client.get("/v1/stats/rewards", params={"by": "nope"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"


async def test_pass_rates_with_pass_at_k(client):
    rows = (await client.get("/v1/stats/pass-rates")).json()["rows"]
    assert [(r["task_id"], r["pass_rate"], r["groups"], r["pass_at_k"]) for r in rows] == [
        ("add", 0.5, 1, 1.0), ("sub", 0.0, 1, 0.0)]


async def test_token_statistics(client):
    stats = (await client.get("/v1/stats/tokens", params={"task_id": "add"})).json()
    assert stats["steps"] == 4
    assert stats["prompt_tokens"]["mean"] == 15 and stats["completion_tokens"]["max"] == 4
    assert stats["mean_logprob"]["count"] == 4 and stats["min_logprob"]["mean"] == pytest.approx(-0.75)
    assert stats["token_mean_logprob"] == pytest.approx((-4 - 1) / 6)


async def test_latency_per_plane(client):
    lat = (await client.get("/v1/stats/latency")).json()
    assert lat["rollout"]["p50"] == pytest.approx(60_000)
    assert lat["queue"]["count"] == 4 and lat["queue"]["p50"] == pytest.approx(2000)
    assert lat["sandbox"]["p50"] == pytest.approx(30_000)
    assert lat["verification"]["p50"] == pytest.approx(5000)
    assert lat["llm_total"]["count"] == 8 and lat["llm_total"]["max"] == 200
    assert lat["trajectory"]["count"] == 4


async def test_listing_filters_and_export_paging(client):
    listed = (await client.get("/v1/trajectories", params={"policy_version": "2", "min_reward": 0})).json()
    assert sorted(t["rollout_id"] for t in listed["trajectories"]) == ["b0", "b1"]
    assert (await client.get("/v1/trajectories", params={"min_reward": 0.5})).json()["trajectories"][0]["passed"]
    seen, params = [], {"limit": 3}
    while True:
        page = (await client.get("/v1/export/trajectories", params=params)).json()
        seen += [t["rollout_id"] for t in page["trajectories"]]
        if page["next"] is None:
            break
        params = {"limit": 3, "after_group": page["next"][0], "after_rollout": page["next"][1]}
    assert seen == ["a0", "a1", "b0", "b1"]
    counts = (await client.get("/v1/counts")).json()
    assert counts["trajectories"] == 4 and counts["steps"] == 8 and counts["rollout_states"] == 12  # pending, running, completed


async def test_infrastructure_outcomes_are_counted_apart_from_rewards(tmp_path):
    store = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await store.init()
    scored, *_ = make("s0", "add", group="g", index=0, reward=1.0)
    event = RolloutStateChanged(rollout_id="i0", task_id="add", from_state=RolloutState.VERIFYING,
                                to_state=RolloutState.FAILED, at=T0 + 60, group_id="g", group_index=1, group_size=2,
                                reason="infrastructure: could not verify: image missing", infrastructure=True)
    infra = assembler.assemble(event, [], None, None)
    assert infra.reward is None
    for t in (scored, infra):
        await store.insert_trajectory(t)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store)), base_url="http://t") as c:
            [row] = (await c.get("/v1/stats/rewards", params={"by": "task"})).json()["rows"]
            stored = (await c.get("/v1/trajectories/i0")).json()
    finally:
        await store.close()
    # the reward figures are the scored rollouts'; the one Arena could not verify is counted apart
    assert (row["trajectories"], row["mean_reward"], row["min_reward"], row["infrastructure_errors"]) == (2, 1.0, 1.0, 1)
    assert stored["reward"] is None and stored["infrastructure"] is True


@pytest.mark.parametrize("path", ["/v1/trajectories", "/v1/stats/rewards", "/v1/stats/pass-rates", "/v1/stats/tokens",
                                  "/v1/stats/latency", "/v1/export/trajectories"])
async def test_time_ranges_and_ids_are_bounded_with_a_4xx(client, path):
    for params in ({"since": "-1e308"}, {"until": "-1e308"}, {"since": "1e308"}, {"task_id": "a b"},
                   {"group_id": "x" * 300}, {"min_reward": "1e308"}):
        r = await client.get(path, params=params)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", (params, r.text)
    for bad in ("x" * 5000, "a b", "%00"):
        for route in ("/v1/trajectories/", "/v1/groups/"):
            r = await client.get(route + bad)
            assert r.status_code == 422, (route, r.status_code)
