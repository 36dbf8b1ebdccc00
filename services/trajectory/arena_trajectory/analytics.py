"""Analytics over the stored trajectories: rewards, pass rates, token statistics, latency
per plane. Each function is one or two SQL statements over ``FINAL`` tables, returning
msgspec Structs that the HTTP API serves as they are.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from arena_trajectory.listing import TrajectoryFilter
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import DATABASE, SCORED

T = f"{DATABASE}.trajectories FINAL"


class RewardRow(msgspec.Struct, frozen=True, kw_only=True):
    """Rewards of the trajectories sharing ``key`` (a task id or a policy version)."""

    key: str
    trajectories: int
    mean_reward: float
    min_reward: float
    max_reward: float
    pass_rate: float  # share of trajectories whose verification passed (completed only)
    completed_rate: float  # share that ended ``completed``
    #: Trajectories Arena could not run or verify: no reward, left out of the reward figures
    #: (as are rollouts that ended unverified: their agent failed or timed out before it).
    infrastructure_errors: int = 0


class PassRateRow(msgspec.Struct, frozen=True, kw_only=True):
    """Per task: rollout pass rate and, over complete groups, pass@k (any member passed)."""

    task_id: str
    trajectories: int
    passed: int
    pass_rate: float
    groups: int
    groups_any_passed: int
    pass_at_k: float  # groups_any_passed / groups (0 without groups)


class Distribution(msgspec.Struct, frozen=True, kw_only=True):
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


class TokenStats(msgspec.Struct, frozen=True, kw_only=True):
    """Per-step token statistics: lengths, and the step-mean / step-minimum logprob."""

    steps: int
    prompt_tokens: Distribution
    completion_tokens: Distribution
    mean_logprob: Distribution  # over steps that carry logprobs
    min_logprob: Distribution
    token_mean_logprob: float  # sum of all logprobs / number of logprobs
    steps_without_logprobs: int


class LatencyStats(msgspec.Struct, frozen=True, kw_only=True):
    """Milliseconds, by plane. ``rollout``: first state -> final state; ``queue``: pending ->
    running; ``llm_*``: the proxy's step timings; ``sandbox``/``verification``: each run;
    ``trajectory``: final state -> trajectory stored."""

    rollout: Distribution
    queue: Distribution
    llm_total: Distribution
    llm_first_token: Distribution
    llm_queued: Distribution
    sandbox: Distribution
    verification: Distribution
    trajectory: Distribution


_DIST = ("count() AS count, ifNotFinite(avg({x}), 0) AS mean, "
         "ifNotFinite(quantile(0.5)({x}), 0) AS p50, ifNotFinite(quantile(0.9)({x}), 0) AS p90, "
         "ifNotFinite(quantile(0.99)({x}), 0) AS p99, ifNotFinite(toFloat64(max({x})), 0) AS max")


def _dist(expr: str) -> str:
    return _DIST.format(x=expr)


_dist_decoder = msgspec.json.Decoder(Distribution, strict=False)


def _subfilter(f: TrajectoryFilter) -> tuple[str, dict]:
    """``rollout_id IN (...)`` restricting another table to the filtered trajectories."""
    where, params = f.where()
    if not where:
        return "", params
    return f" rollout_id IN (SELECT rollout_id FROM {T}{where})", params


async def rewards(store: TrajectoryStore, f: TrajectoryFilter, *, by: Literal["task", "policy_version"]
                  ) -> list[RewardRow]:
    """Reward by task, or by policy version (a trajectory counts under every version it used)."""
    where, params = f.where()
    key = "task_id" if by == "task" else "arrayJoin(if(empty(policy_versions), [''], policy_versions))"
    sql = (f"SELECT {key} AS key, count() AS trajectories, "
           f"ifNotFinite(avgIf(reward, {SCORED}), 0) AS mean_reward, "
           f"if(countIf({SCORED}) = 0, 0, minIf(reward, {SCORED})) AS min_reward, "
           f"if(countIf({SCORED}) = 0, 0, maxIf(reward, {SCORED})) AS max_reward, "
           "avg(passed) AS pass_rate, avg(final_state = 'completed') AS completed_rate, "
           "countIf(infrastructure) AS infrastructure_errors "
           f"FROM {T}{where} GROUP BY key ORDER BY key")
    dec = msgspec.json.Decoder(RewardRow, strict=False)
    return [dec.decode(line) for line in await store.select(sql, params)]


async def pass_rates(store: TrajectoryStore, f: TrajectoryFilter) -> list[PassRateRow]:
    where, params = f.where()
    sql = (
        "SELECT task_id, sum(n) AS trajectories, sum(p) AS passed, if(trajectories = 0, 0, passed / trajectories) "
        "AS pass_rate, countIf(is_group AND whole) AS groups, countIf(is_group AND whole AND p > 0) "
        "AS groups_any_passed, if(groups = 0, 0, groups_any_passed / groups) AS pass_at_k FROM ("
        "  SELECT task_id, if(group_id = '', rollout_id, group_id) AS unit, group_id != '' AS is_group, "
        "  count() AS n, toUInt64(sum(passed)) AS p, count() >= any(group_size) AS whole "
        f"  FROM {T}{where} GROUP BY task_id, unit, is_group"
        ") GROUP BY task_id ORDER BY task_id"
    )
    dec = msgspec.json.Decoder(PassRateRow, strict=False)
    return [dec.decode(line) for line in await store.select(sql, params)]


async def _distributions(store: TrajectoryStore, table: str, exprs: dict[str, str], where: str, params: dict
                         ) -> dict[str, Distribution]:
    out = {}
    for name, expr in exprs.items():
        [line] = await store.select(f"SELECT {_dist(expr)} FROM {table}{where}", params)
        out[name] = _dist_decoder.decode(line)
    return out


async def token_stats(store: TrajectoryStore, f: TrajectoryFilter) -> TokenStats:
    sub, params = _subfilter(f)
    where = f" WHERE{sub}" if sub else ""
    steps_table = f"{DATABASE}.steps FINAL"
    d = await _distributions(store, steps_table, {
        "prompt_tokens": "prompt_tokens", "completion_tokens": "completion_tokens"}, where, params)
    lp_where = f"{where} AND num_logprobs > 0" if where else " WHERE num_logprobs > 0"
    d.update(await _distributions(store, steps_table, {
        "mean_logprob": "assumeNotNull(mean_logprob)", "min_logprob": "assumeNotNull(min_logprob)"}, lp_where, params))
    [line] = await store.select(
        f"SELECT count() AS steps, countIf(num_logprobs = 0) AS without, "
        f"if(sum(num_logprobs) = 0, 0, sum(sum_logprob) / sum(num_logprobs)) AS token_mean FROM {steps_table}{where}",
        params)
    row = msgspec.json.decode(line)
    return TokenStats(steps=int(row["steps"]), steps_without_logprobs=int(row["without"]),
                      token_mean_logprob=float(row["token_mean"]), **d)


async def latency(store: TrajectoryStore, f: TrajectoryFilter) -> LatencyStats:
    sub, params = _subfilter(f)
    where = f" WHERE{sub}" if sub else ""
    traj_where, traj_params = f.where()
    params = {**params, **traj_params}
    ms = "toUnixTimestamp64Milli"
    out = await _distributions(store, T, {
        "rollout": f"{ms}(completed_at) - {ms}(started_at)",
        "trajectory": f"greatest({ms}(stored_at) - {ms}(completed_at), 0)",
    }, traj_where, params)
    out.update(await _distributions(store, f"{DATABASE}.steps FINAL", {
        "llm_total": "total_ms", "llm_first_token": "first_token_ms", "llm_queued": "queued_ms"}, where, params))
    out.update(await _distributions(store, f"{DATABASE}.sandbox_results FINAL", {
        "sandbox": f"{ms}(finished_at) - {ms}(started_at)"}, where, params))
    out.update(await _distributions(store, f"{DATABASE}.verifications FINAL", {
        "verification": f"{ms}(finished_at) - JSONExtractFloat(body, 'started_at') * 1000"}, where, params))
    queue_sql = (
        f"(SELECT rollout_id, {ms}(minIf(at, to_state = 'running')) - {ms}(minIf(at, to_state = 'pending')) AS q "
        f"FROM {DATABASE}.rollout_states FINAL{where} GROUP BY rollout_id "
        "HAVING countIf(to_state = 'running') > 0 AND countIf(to_state = 'pending') > 0)")
    out.update(await _distributions(store, queue_sql, {"queue": "q"}, "", params))
    return LatencyStats(**out)
