"""The trajectory query API over a chDB store, through httpx's ASGI transport."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from arena_core.schemas import RolloutState, RolloutStateChanged, Step, VerificationResult
from arena_trajectory import assembler
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore


def trajectory(rid: str, *, group=None, index=0, size=1, reward=1.0, state=RolloutState.COMPLETED, at=100.0):
    event = RolloutStateChanged(rollout_id=rid, task_id="calc.add", from_state=RolloutState.VERIFYING, to_state=state,
                                at=at, steps=1, group_id=group, group_index=index, group_size=size)
    steps = [Step(rollout_id=rid, step_index=0, model="m", backend="b", policy_version="2", completion_text="ok")]
    verification = VerificationResult(rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0,
                                      started_at=1.0, finished_at=2.0)
    return assembler.assemble(event, steps, None, verification)


@pytest.fixture
async def client(tmp_path):
    store = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await store.init()
    for t in (trajectory("a", group="g", index=0, size=3, reward=1.0, at=101.0),
              trajectory("b", group="g", index=1, size=3, reward=0.0, at=102.0),
              trajectory("solo", state=RolloutState.TIMED_OUT, at=103.0)):
        await store.insert_trajectory(t)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store)), base_url="http://t") as c:
        yield c, store
    await store.close()


async def test_health_and_readiness_without_a_bus_follow_the_store(client):
    c, store = client
    r = await c.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "problem": ""}
    r = await c.get("/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    await store.close()  # the store is gone: alive, but not ready
    r = await c.get("/readyz")
    assert r.status_code == 503 and r.json()["problem"].startswith("store unreachable")


async def test_get_one_trajectory(client):
    c, _ = client
    r = await c.get("/v1/trajectories/a")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["rollout_id"] == "a" and body["reward"] == 1.0 and body["group_id"] == "g"
    assert body["steps"][0]["completion_text"] == "ok" and body["policy_versions"] == ["2"]


async def test_unknown_trajectory_is_a_404_with_an_error_code(client):
    c, _ = client
    r = await c.get("/v1/trajectories/nope")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found" and "nope" in r.json()["error"]["message"]


async def test_list_and_filter(client):
    c, _ = client
    r = await c.get("/v1/trajectories")
    assert [t["rollout_id"] for t in r.json()["trajectories"]] == ["solo", "b", "a"]
    first = r.json()["trajectories"][0]
    assert first["final_state"] == "timed_out" and first["group_id"] is None and first["num_steps"] == 1
    r = await c.get("/v1/trajectories", params={"group_id": "g", "limit": 1})
    assert [t["rollout_id"] for t in r.json()["trajectories"]] == ["b"]
    r = await c.get("/v1/trajectories", params={"state": "timed_out", "task_id": "calc.add"})
    assert [t["rollout_id"] for t in r.json()["trajectories"]] == ["solo"]
    for bad in ({"state": "nonsense"}, {"limit": 0}, {"limit": 100000}):
        r = await c.get("/v1/trajectories", params=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"


async def test_group_view_grows_until_complete(client):
    c, store = client
    r = await c.get("/v1/groups/g")
    body = r.json()
    assert body["complete"] is False and body["size"] == 3 and body["rollout_ids"] == ["a", "b"]
    assert body["rewards"] == [1.0, 0.0] and body["advantages"] == pytest.approx([1.0, -1.0], abs=1e-5)
    await store.insert_trajectory(trajectory("c", group="g", index=2, size=3, reward=0.5, at=104.0))
    body = (await c.get("/v1/groups/g")).json()
    assert body["complete"] is True and body["rollout_ids"] == ["a", "b", "c"]
    assert body["advantages"] == pytest.approx([1.2247, -1.2247, 0.0], abs=1e-3)
    assert [t["rollout_id"] for t in body["trajectories"]] == ["a", "b", "c"]
    r = await c.get("/v1/groups/unknown")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_trainer_metrics_round_trip(tmp_path):
    import msgspec

    from arena_core.schemas import TrainerMetrics

    store = TrajectoryStore(ChdbBackend(str(tmp_path / "ch")))
    await store.init()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store)), base_url="http://t") as api:
            for step, loss in ((1, 0.5), (2, 0.25), (2, 0.125)):  # step 2 posted again: replaced
                body = TrainerMetrics(run="r1", step=step, at=float(step), policy_version=str(step),
                                      metrics={"loss": loss})
                resp = await api.post("/v1/trainer-metrics", content=msgspec.json.encode(body))
                assert resp.status_code == 201, resp.text
            got = (await api.get("/v1/trainer-metrics", params={"run": "r1"})).json()["steps"]
            assert [(s["step"], s["metrics"]["loss"]) for s in got] == [(1, 0.5), (2, 0.125)]
            assert (await api.get("/v1/trainer-metrics", params={"run": "other"})).json()["steps"] == []
            bad = await api.post("/v1/trainer-metrics", content=b'{"run": "r1"}')
            assert bad.status_code == 422 and "missing required field" in bad.json()["error"]["message"]
    finally:
        await store.close()


async def test_trainer_metrics_are_published_live_on_their_subject(tmp_path, nats_server):
    import msgspec

    from arena_core import subjects
    from arena_core.bus import Bus
    from arena_core.schemas import TrainerMetrics

    store = TrajectoryStore(ChdbBackend(str(tmp_path / "ch")))
    await store.init()
    bus = await Bus.connect(nats_server.url, "trajectory")
    assert subjects.trainer_metrics("chat.ppo") == "arena.trainer.metrics.chat_ppo"  # one subject token
    dashboard = await Bus.connect(nats_server.url, "dashboard")  # another client, as a dashboard is
    live = await dashboard.nc.subscribe("arena.trainer.metrics.>")
    await dashboard.nc.flush()  # the subscription is at the server before anything is published
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store, bus)),
                                     base_url="http://t") as api:
            body = TrainerMetrics(run="chat.ppo", step=3, at=3.0, policy_version="3", metrics={"kl": 0.01})
            assert (await api.post("/v1/trainer-metrics", content=msgspec.json.encode(body))).status_code == 201
        msg = await live.next_msg(timeout=5)
        assert msg.subject == "arena.trainer.metrics.chat_ppo"  # the run name made one subject token
        assert msgspec.json.decode(msg.data, type=TrainerMetrics) == body
    finally:
        await dashboard.close()
        await bus.close()
        await store.close()


async def test_counts_of_every_table_or_of_the_ones_asked_for(client):
    c, _ = client
    everything = (await c.get("/v1/counts")).json()
    assert everything["trajectories"] == 3 and everything["steps"] == 3 and set(everything) >= {"groups", "verifications"}
    assert (await c.get("/v1/counts", params={"table": ["steps", "trajectories"]})).json() == {
        "steps": 3, "trajectories": 3}
    r = await c.get("/v1/counts", params={"table": "nope"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request" and "query.table.0" in r.text and "steps" in r.text


async def test_counts_without_final_are_the_rows_stored_duplicates_included(client):
    c, store = client
    await asyncio.to_thread(store.backend.execute, "SYSTEM STOP MERGES arena.steps")  # keep the duplicate's part
    redelivered = (await store.trajectory("a")).steps[0]
    await store.insert_steps([redelivered])  # a step delivered twice: one row for queries, two stored
    assert (await c.get("/v1/counts", params={"table": "steps"})).json() == {"steps": 3}
    assert (await c.get("/v1/counts", params={"table": "steps", "final": "false"})).json() == {"steps": 4}
    tuned = await store.select("SELECT value FROM system.merge_tree_settings WHERE name = 'merge_selector_base'")
    assert tuned  # the setting exists in the embedded ClickHouse, so TUNING applies there
    create = await store.select("SHOW CREATE TABLE arena.steps")
    assert "merge_selector_base = 20" in create[0].decode()
