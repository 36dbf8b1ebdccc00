"""Duel rounds paired up in SQL (duels.py) over a chDB store: each seed is its own round,
whatever the seed's size, and the leaderboard rates only decided rounds."""

from __future__ import annotations

import pytest

from arena_core.schemas import (
    LABEL_DUEL,
    LABEL_DUEL_POLICY,
    LABEL_DUEL_SEED,
    LABEL_DUEL_SIDE,
    RolloutState,
    RolloutStateChanged,
    VerificationResult,
)
from arena_trajectory import assembler, duels
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import duel_columns


def member(duel_id: str, side: str, policy: str, seed: int, reward: float, at: float,
           state: RolloutState = RolloutState.COMPLETED):
    rid = f"{duel_id}-{side}-{seed}"
    event = RolloutStateChanged(rollout_id=rid, task_id="calc.add", from_state=RolloutState.VERIFYING,
                                to_state=state, at=at, steps=0, group_id=f"{duel_id}-{side}",
                                group_index=0, group_size=2,
                                metadata={LABEL_DUEL: duel_id, LABEL_DUEL_SIDE: side, LABEL_DUEL_POLICY: policy,
                                          LABEL_DUEL_SEED: str(seed)})
    verification = VerificationResult(rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0,
                                      started_at=at - 2, finished_at=at - 1)
    return assembler.assemble(event, [], None, verification)


@pytest.mark.parametrize("seed", [0, -7, 10**18, 2**63 - 2, -(2**63)])
def test_a_duel_seed_is_stored_as_given_over_the_whole_int64_range(seed):
    assert duel_columns({LABEL_DUEL: "d", LABEL_DUEL_SEED: str(seed)})["duel_seed"] == seed


def test_a_seed_that_is_no_int64_is_stored_as_zero():
    for bad in ("", "x", str(2**63), str(-(2**63) - 1), "9" * 5000):
        assert duel_columns({LABEL_DUEL: "d", LABEL_DUEL_SEED: bad})["duel_seed"] == 0


async def test_rounds_on_large_seeds_stay_apart(tmp_path):
    store = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await store.init()
    base = 10**18  # 19 digits: each of the two seeds must stay its own round
    # round 1: a wins; round 2: b wins -> one win each, never a single merged round
    for t in (member("d1", "a", "pa", base, 1.0, 100.0), member("d1", "b", "pb", base, 0.0, 101.0),
              member("d1", "a", "pa", base + 1, 0.0, 102.0), member("d1", "b", "pb", base + 1, 1.0, 103.0)):
        await store.insert_trajectory(t)
    try:
        view = await duels.duel(store, "d1")
        assert view is not None
        assert [r.seed for r in view.rounds] == [base, base + 1]
        assert [r.winner for r in view.rounds] == ["a", "b"] and view.wins == [1, 1] and view.complete
        board = await duels.leaderboard(store)
        assert board.games == 2
    finally:
        await store.close()


async def test_a_cancelled_side_voids_its_round(tmp_path):
    """A side cancelled before it finished (reward 0 in storage) loses nothing: the round is
    void and no game for the leaderboard."""
    store = TrajectoryStore(ChdbBackend(tmp_path / "clickhouse"))
    await store.init()
    for t in (member("d2", "a", "pa", 0, 1.0, 100.0), member("d2", "b", "pb", 0, 0.0, 101.0, RolloutState.CANCELLED),
              member("d2", "a", "pa", 1, 1.0, 102.0), member("d2", "b", "pb", 1, 0.0, 103.0)):
        await store.insert_trajectory(t)
    try:
        view = await duels.duel(store, "d2")
        assert [r.winner for r in view.rounds] == ["void", "a"] and view.void == 1 and view.wins == [1, 0]
        assert (await duels.leaderboard(store)).games == 1
    finally:
        await store.close()
