"""One meaning of reward (docs/trajectory.md): the verifier's, or none. A group whose members
ended four ways (completed, failed but verified, timed out unverified, an infrastructure
outcome) is assembled, stored in a chDB store and read back through the trajectory API (the
listing, each trajectory, the group, the overview) and the GRPO export: all say the same."""

from __future__ import annotations

import httpx
import msgspec
import pytest

from arena.export import ExportOptions, ExportStats, export_rows
from arena_core.schemas import RolloutState, RolloutStateChanged, Step, Trajectory, VerificationResult
from arena_trajectory import assembler
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore

S = RolloutState


def member(rid: str, index: int, state: RolloutState, verified: float | None, *, infrastructure: bool = False
           ) -> Trajectory:
    event = RolloutStateChanged(rollout_id=rid, task_id="calc.add", from_state=S.RUNNING, to_state=state,
                                at=100.0 + index, steps=1, group_id="g", group_index=index, group_size=4,
                                infrastructure=infrastructure, reason=f"{rid} ended")
    steps = [Step(rollout_id=rid, step_index=0, model="m", backend="b", policy_version="1", completion_text="x")]
    verification = None if verified is None else VerificationResult(
        rollout_id=rid, verifier="tests", reward=verified, passed=verified == 1.0, started_at=1.0, finished_at=2.0,
        flags=["parse_failed"] if verified == 0.5 else [])
    return assembler.assemble(event, steps, None, verification)


#: rollout id -> (the trajectory, the one reward every reader must show)
GROUP = {
    "done": (member("done", 0, S.COMPLETED, 1.0), 1.0),
    "failed-verified": (member("failed-verified", 1, S.FAILED, 0.5), 0.5),
    "timed-out": (member("timed-out", 2, S.TIMED_OUT, None), None),
    "infra": (member("infra", 3, S.FAILED, 1.0, infrastructure=True), None),
}


@pytest.fixture
async def client(tmp_path):
    store = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await store.init()
    for t, _ in GROUP.values():
        await store.insert_trajectory(t)
        await store.insert_states([RolloutStateChanged(rollout_id=t.rollout_id, task_id=t.task_id, from_state=h.from_state,
                                                       to_state=h.to_state, at=h.at, reason=h.reason) for h in t.history])
        if t.verification is not None:
            await store.insert_verification(t.verification)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store)), base_url="http://t") as c:
        yield c
    await store.close()


async def test_the_listing_each_trajectory_the_group_the_overview_and_the_grpo_export_agree(client):
    expected = {rid: reward for rid, (_, reward) in GROUP.items()}
    assert {rid: t.reward for rid, (t, _) in GROUP.items()} == expected  # as assembled
    assert GROUP["timed-out"][0].infrastructure is False and GROUP["infra"][0].infrastructure is True

    listed = (await client.get("/v1/trajectories", params={"group_id": "g"})).json()["trajectories"]
    assert {t["rollout_id"]: t["reward"] for t in listed} == expected
    flags = {t["rollout_id"]: (t["infrastructure"], t["verified"]) for t in listed}
    assert flags["timed-out"] == (False, False) and flags["infra"][0] is True
    # the dashboard's rollout list: state, reason and flags
    assert {t["rollout_id"]: (t["final_state"], t["reason"], t["flags"]) for t in listed} == {
        "done": ("completed", "done ended", []), "failed-verified": ("failed", "failed-verified ended", ["parse_failed"]),
        "timed-out": ("timed_out", "timed-out ended", []), "infra": ("failed", "infra ended", [])}

    stored = [msgspec.convert((await client.get(f"/v1/trajectories/{rid}")).json(), Trajectory) for rid in GROUP]
    assert {t.rollout_id: t.reward for t in stored} == expected

    group = (await client.get("/v1/groups/g")).json()
    assert group["rewards"] == [1.0, 0.5, None, None]
    # the two with a reward make the advantages; the others get none
    assert group["advantages"] == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)

    overview = (await client.get("/v1/stats/overview")).json()
    assert overview["mean_reward"] == pytest.approx(0.75)  # (1.0 + 0.5) / 2: no made-up 0 in it
    assert overview["infrastructure_error_rate"] == pytest.approx(1 / 4)

    stats = ExportStats()
    rows = list(export_rows(sorted(stored, key=lambda t: t.group_index), "grpo", ExportOptions(), stats))
    assert {r["rollout_id"]: r["reward"] for r in rows} == {"done": 1.0, "failed-verified": 0.5}, stats.skipped
    assert stats.skipped == {"no reward (an infrastructure outcome, or ended unverified)": 2}

    # the reward filters see only the rewards that exist: the unverified 0 stored is no reward
    low = (await client.get("/v1/trajectories", params={"max_reward": 0.5})).json()["trajectories"]
    assert [t["rollout_id"] for t in low] == ["failed-verified"]
