"""When no rollout has a policy version (the backends report none), /v1/stats/training gives the
mean reward over time instead (``reward_over_time``), the curve the dashboard draws then; with
policy versions it is left empty (the per-version curve is the one)."""

from __future__ import annotations

import httpx
import pytest

from arena_core.schemas import RolloutState, RolloutStateChanged, Step, VerificationResult
from arena_trajectory import assembler
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore

T0 = 1_700_000_000.0


def stored(rid: str, at: float, reward: float | None, version: str = ""):
    event = RolloutStateChanged(rollout_id=rid, task_id="calc.add", from_state=RolloutState.VERIFYING,
                                to_state=RolloutState.COMPLETED if reward is not None else RolloutState.TIMED_OUT,
                                at=at, steps=1)
    steps = [Step(rollout_id=rid, step_index=0, model="m", backend="b", policy_version=version, completion_text="x")]
    verification = None if reward is None else VerificationResult(
        rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0, started_at=1.0, finished_at=2.0)
    return assembler.assemble(event, steps, None, verification)


@pytest.fixture
async def store(tmp_path):
    store = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await store.init()
    yield store
    await store.close()


async def training(store) -> dict:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store)), base_url="http://t") as c:
        return (await c.get("/v1/stats/training")).json()


async def test_no_policy_version_gives_the_reward_over_time(store):
    for t in (stored("a", T0, 0.0), stored("b", T0 + 1, 1.0), stored("c", T0 + 99, 1.0), stored("d", T0 + 99.5, None)):
        await store.insert_trajectory(t)
    d = await training(store)
    assert [p["policy_version"] for p in d["reward_curve"]] == [""]
    points = d["reward_over_time"]
    # 99 s (the scored rollouts' span, both ends in) in 50 buckets: 1.981 s each
    assert points[0]["at"] == pytest.approx(T0, abs=1e-3) and points[0]["width_s"] == pytest.approx(1.981)
    # the timed-out rollout (never verified) has no reward: it is on no point
    assert [(p["rollouts"], p["mean_reward"]) for p in points] == [(2, 0.5), (1, 1.0)]
    assert points[-1]["at"] == pytest.approx(T0 + 49 * 1.981, abs=1e-3)


async def test_with_policy_versions_the_curve_is_by_version(store):
    await store.insert_trajectory(stored("a", T0, 1.0, version="1"))
    d = await training(store)
    assert [p["policy_version"] for p in d["reward_curve"]] == ["1"] and d["reward_over_time"] == []
