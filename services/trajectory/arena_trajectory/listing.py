"""Filters and summaries shared by listing, analytics and exports: ``TrajectoryFilter``
(a ``WHERE`` clause over ``trajectories`` with bound parameters) and ``TrajectorySummary``
(a trajectory without its steps)."""

from __future__ import annotations

import msgspec

from arena_core.schemas import RolloutState
from arena_trajectory.clickhouse import Param
from arena_trajectory.tables import SCORED


class TrajectorySummary(msgspec.Struct, frozen=True, kw_only=True):
    """One row of ``GET /v1/trajectories``: a trajectory without its steps."""

    rollout_id: str
    task_id: str
    group_id: str | None
    group_index: int
    group_size: int
    final_state: RolloutState
    reward: float | None  # the verifier's; None: not verified, or an infrastructure outcome
    num_steps: int
    prompt_tokens: int
    completion_tokens: int
    completed_at: float  # unix seconds
    policy_versions: list[str] = []
    passed: bool = False
    infrastructure: bool = False  # Arena could not run or verify it: no reward
    verified: bool = False  # a verification is stored (false with no reward: ended unverified)
    reason: str = ""  # why it ended: its final transition's reason ("" if that row is not stored)
    flags: list[str] = []  # its verification's flags (tests_tampered, parse_failed, …)


SUMMARY_COLUMNS = (
    "rollout_id, task_id, group_id, group_index, group_size, final_state, "
    f"if({SCORED}, reward, NULL) AS reward, num_steps, "
    "prompt_tokens, completion_tokens, toUnixTimestamp64Milli(completed_at) AS completed_ms, policy_versions, passed, "
    "infrastructure, verified"
)


class _SummaryRow(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    task_id: str
    group_id: str
    group_index: int
    group_size: int
    final_state: RolloutState
    reward: float | None  # the verifier's; None: not verified, or an infrastructure outcome
    num_steps: int
    prompt_tokens: int
    completion_tokens: int
    completed_ms: int
    policy_versions: list[str] = []
    passed: bool = False
    infrastructure: bool = False
    verified: bool = False

    def summary(self) -> TrajectorySummary:
        return TrajectorySummary(
            rollout_id=self.rollout_id, task_id=self.task_id, group_id=self.group_id or None,
            group_index=self.group_index, group_size=self.group_size, final_state=self.final_state,
            reward=self.reward, num_steps=self.num_steps, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, completed_at=self.completed_ms / 1000,
            policy_versions=self.policy_versions, passed=self.passed,
            infrastructure=self.infrastructure, verified=self.verified,
        )


# strict=False: a ClickHouse server may quote 64-bit integers in JSON output
summary_decoder = msgspec.json.Decoder(_SummaryRow, strict=False)


class TrajectoryFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Filters shared by listing, analytics and exports (``None``: no filter)."""

    task_id: str | None = None
    group_id: str | None = None
    state: RolloutState | None = None
    policy_version: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    since: float | None = None  # completed_at >= since (unix seconds)
    until: float | None = None  # completed_at < until
    #: the caller's project (set from its API key, never from the query; None: every project)
    project: str | None = None

    def where(self) -> tuple[str, dict[str, Param]]:
        """A ``WHERE`` clause over ``trajectories`` ('' if no filter) and its parameters."""
        where: list[str] = []
        params: dict[str, Param] = {}
        if self.project is not None:
            where.append("project = {project:String}")
            params["project"] = self.project
        if self.task_id is not None:
            where.append("task_id = {task_id:String}")
            params["task_id"] = self.task_id
        if self.group_id is not None:
            where.append("group_id = {group_id:String}")
            params["group_id"] = self.group_id
        if self.state is not None:
            where.append("final_state = {state:String}")
            params["state"] = RolloutState(self.state).value
        if self.policy_version is not None:
            where.append("has(policy_versions, {pv:String})")
            params["pv"] = self.policy_version
        if self.min_reward is not None:
            where.append(f"{SCORED} AND reward >= {{min_reward:Float64}}")
            params["min_reward"] = float(self.min_reward)
        if self.max_reward is not None:
            where.append(f"{SCORED} AND reward <= {{max_reward:Float64}}")
            params["max_reward"] = float(self.max_reward)
        if self.since is not None:
            where.append("completed_at >= fromUnixTimestamp64Milli(toInt64({since_ms:Int64}))")
            params["since_ms"] = int(self.since * 1000)
        if self.until is not None:
            where.append("completed_at < fromUnixTimestamp64Milli(toInt64({until_ms:Int64}))")
            params["until_ms"] = int(self.until * 1000)
        return (" WHERE " + " AND ".join(where) if where else ""), params
