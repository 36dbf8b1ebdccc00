"""Duels over the stored trajectories: rounds paired up in SQL by ``(duel_id, duel_seed)``, duel
summaries, the games of every decided round and the leaderboard rated from them. docs/trajectory.md (Duels).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Literal

import msgspec

from arena_core.ratings import Game, Rating, rate
from arena_core.schemas import DEFAULT_PROJECT, DuelRoundDone, Trajectory
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import DATABASE, duel_columns

Winner = Literal["a", "b", "draw", "void", "pending"]

#: One row per round (a duel's seed): both sides side by side. A side with an infrastructure
#: outcome voids the round; a round with a side not stored yet is ``pending``.
_ROUNDS = (
    "SELECT duel_id, duel_seed AS seed, any(task_id) AS task_id, max(group_size) AS seeds, "
    "anyIf(duel_policy, duel_side = 'a') AS policy_a, anyIf(duel_policy, duel_side = 'b') AS policy_b, "
    "anyIf(rollout_id, duel_side = 'a') AS rollout_a, anyIf(rollout_id, duel_side = 'b') AS rollout_b, "
    "countIf(duel_side = 'a') > 0 AS has_a, countIf(duel_side = 'b') > 0 AS has_b, "
    "anyIf(reward, duel_side = 'a') AS reward_a, anyIf(reward, duel_side = 'b') AS reward_b, "
    "anyIf(infrastructure, duel_side = 'a') AS infra_a, anyIf(infrastructure, duel_side = 'b') AS infra_b, "
    "anyIf(verified, duel_side = 'a') AS verified_a, anyIf(verified, duel_side = 'b') AS verified_b, "
    "anyIf(final_state = 'cancelled', duel_side = 'a') AS cancelled_a, "
    "anyIf(final_state = 'cancelled', duel_side = 'b') AS cancelled_b, "
    "multiIf(NOT (has_a AND has_b), 'pending', infra_a OR infra_b OR cancelled_a OR cancelled_b, 'void', "
    "reward_a > reward_b, 'a', "
    "reward_b > reward_a, 'b', 'draw') AS winner, "
    "toFloat64(toUnixTimestamp64Milli(min(started_at))) / 1000 AS started_at, "
    "toFloat64(toUnixTimestamp64Milli(max(completed_at))) / 1000 AS completed_at "
    f"FROM {DATABASE}.trajectories FINAL WHERE duel_id != '' {{where}} GROUP BY duel_id, duel_seed"
)


class Round(msgspec.Struct, frozen=True, kw_only=True):
    """One seed of a duel: each side's rollout and reward (``None``: not stored yet, an
    infrastructure outcome, or ended unverified: it then ranks as a 0 in the round) and who
    won it."""

    seed: int
    rollout_ids: list[str | None]
    rewards: list[float | None]
    winner: Winner


class DuelSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A duel as stored so far. ``seeds``: the rounds it runs; ``wins``: by side (a, b);
    ``complete``: every round decided (or void); ``winner``: the policy with more wins once
    complete, else ``None`` (also on a tie)."""

    duel_id: str
    task_id: str
    policies: list[str]
    seeds: int
    wins: list[int]
    draws: int
    void: int
    complete: bool
    winner: str | None
    started_at: float
    completed_at: float


class DuelView(DuelSummary, frozen=True, kw_only=True):
    """A duel with its rounds, by seed (a round shows once either side is stored)."""

    rounds: list[Round]


class DuelList(msgspec.Struct, frozen=True, kw_only=True):
    duels: list[DuelSummary]


class Leaderboard(msgspec.Struct, frozen=True, kw_only=True):
    """Bradley–Terry ratings over every decided round of every duel (``arena_core.ratings``)."""

    method: str
    games: int
    ratings: list[Rating]


class _RoundRow(msgspec.Struct, kw_only=True):
    duel_id: str
    seed: int
    task_id: str
    seeds: int
    policy_a: str
    policy_b: str
    rollout_a: str
    rollout_b: str
    has_a: bool
    has_b: bool
    reward_a: float
    reward_b: float
    infra_a: bool
    infra_b: bool
    verified_a: bool = True
    verified_b: bool = True
    winner: Winner
    started_at: float
    completed_at: float


class _GameRow(msgspec.Struct, kw_only=True):
    a: str
    b: str
    score: float
    count: int


_round_decoder = msgspec.json.Decoder(_RoundRow, strict=False)
_game_decoder = msgspec.json.Decoder(_GameRow, strict=False)


def _in_project(project: str | None) -> tuple[str, dict]:
    """SQL restricting ``trajectories`` to ``project`` (``None``: every project), and its parameter."""
    return ("", {}) if project is None else (" AND project = {project:String}", {"project": project})


async def _rounds(store: TrajectoryStore, duel_ids: Sequence[str],
                  project: str | None = None) -> dict[str, list[_RoundRow]]:
    """The rounds of each of ``duel_ids`` (those with a stored trajectory of ``project``), by seed."""
    out: dict[str, list[_RoundRow]] = {}
    if duel_ids:
        mine, params = _in_project(project)
        lines = await store.select(_ROUNDS.format(where="AND duel_id IN {ids:Array(String)}" + mine)
                                   + " ORDER BY duel_id, seed", {"ids": list(duel_ids), **params})
        for line in lines:
            row = _round_decoder.decode(line)
            out.setdefault(row.duel_id, []).append(row)
    return out


def _summary(rows: list[_RoundRow]) -> DuelSummary:
    first = rows[0]
    policies = [next((r.policy_a for r in rows if r.has_a), ""), next((r.policy_b for r in rows if r.has_b), "")]
    wins = [sum(r.winner == "a" for r in rows), sum(r.winner == "b" for r in rows)]
    seeds = max(r.seeds for r in rows)
    complete = sum(r.winner != "pending" for r in rows) >= seeds
    winner = None
    if complete and wins[0] != wins[1]:
        winner = policies[0] if wins[0] > wins[1] else policies[1]
    return DuelSummary(duel_id=first.duel_id, task_id=first.task_id, policies=policies, seeds=seeds, wins=wins,
                       draws=sum(r.winner == "draw" for r in rows), void=sum(r.winner == "void" for r in rows),
                       complete=complete, winner=winner, started_at=min(r.started_at for r in rows),
                       completed_at=max(r.completed_at for r in rows))


def _round(r: _RoundRow) -> Round:
    return Round(seed=r.seed, rollout_ids=[r.rollout_a if r.has_a else None, r.rollout_b if r.has_b else None],
                 rewards=[r.reward_a if r.has_a and r.verified_a and not r.infra_a else None,
                          r.reward_b if r.has_b and r.verified_b and not r.infra_b else None],
                 winner=r.winner)


async def duels(store: TrajectoryStore, *, limit: int = 50, project: str | None = None) -> list[DuelSummary]:
    """The latest ``limit`` duels (of ``project``, when given), newest (by first start) first."""
    mine, params = _in_project(project)
    lines = await store.select(
        f"SELECT duel_id FROM {DATABASE}.trajectories FINAL WHERE duel_id != ''{mine} GROUP BY duel_id "
        "ORDER BY min(started_at) DESC, duel_id LIMIT {limit:UInt32}", {"limit": limit, **params})
    ids = [msgspec.json.decode(line)["duel_id"] for line in lines]
    rounds = await _rounds(store, ids, project)
    return [_summary(rounds[i]) for i in ids if i in rounds]


async def duel(store: TrajectoryStore, duel_id: str, project: str | None = None) -> DuelView | None:
    rows = (await _rounds(store, [duel_id], project)).get(duel_id)
    if not rows:
        return None
    return DuelView(**msgspec.structs.asdict(_summary(rows)), rounds=[_round(r) for r in rows])


async def games(store: TrajectoryStore, project: str | None = None) -> list[Game]:
    """Every decided round of every duel (of ``project``, when given; not void, not pending),
    counted by (a, b, score)."""
    mine, params = _in_project(project)
    lines = await store.select(
        "SELECT policy_a AS a, policy_b AS b, multiIf(winner = 'a', 1.0, winner = 'b', 0.0, 0.5) AS score, "
        f"count() AS count FROM ({_ROUNDS.format(where=mine)}) WHERE winner IN ('a', 'b', 'draw') "
        "AND policy_a != policy_b GROUP BY a, b, score ORDER BY a, b, score", params)
    return [Game(a=g.a, b=g.b, score=g.score, count=g.count) for g in map(_game_decoder.decode, lines)]


#: The last games rated and their ratings: every open dashboard asks again after each duel
#: notice, and the bootstrap refits 200 times (0.3 s at 50 policies, 8 s at 100).
_last_rated: tuple[tuple, list[Rating]] | None = None


async def leaderboard(store: TrajectoryStore, project: str | None = None) -> Leaderboard:
    """The ratings over ``project``'s duels (``None``: every project's)."""
    global _last_rated
    played = await games(store, project)
    key = tuple((g.a, g.b, g.score, g.count) for g in played)
    if _last_rated is not None and _last_rated[0] == key:
        ratings = _last_rated[1]
    else:
        ratings = await asyncio.to_thread(rate, played)  # the bootstrap is CPU work: off the event loop
        _last_rated = (key, ratings)
    return Leaderboard(method="bradley-terry", games=sum(g.count for g in played), ratings=ratings)


async def decided_rounds(store: TrajectoryStore, stored: Sequence[Trajectory]) -> list[DuelRoundDone]:
    """The rounds that ``stored`` (trajectories just stored) decided: both sides now stored. No
    query when none of them is a duel's."""
    keys = {(c["duel_id"], c["duel_seed"]) for c in (duel_columns(t.metadata) for t in stored) if c["duel_id"]}
    if not keys:
        return []
    projects = {duel_columns(t.metadata)["duel_id"]: t.project for t in stored}
    rounds = await _rounds(store, sorted({duel_id for duel_id, _ in keys}))
    now = time.time()
    out = []
    for duel_id, rows in rounds.items():
        complete = _summary(rows).complete
        out += [DuelRoundDone(duel_id=duel_id, seed=r.seed, winner=r.winner, complete=complete, at=now,
                              project=projects.get(duel_id, DEFAULT_PROJECT))
                for r in rows if (duel_id, r.seed) in keys and r.winner != "pending"]
    return out
