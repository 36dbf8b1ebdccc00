"""Trajectory storage in ClickHouse: embedded chDB or a ClickHouse server, same SQL for both.

Every table is a ``ReplacingMergeTree`` keyed so that a redelivered message replaces its
own row; reads use ``FINAL``, so a duplicate is never visible. Rows keep a few columns
for analytics and the whole message as JSON in ``body`` (the source of truth).

Values never go into SQL text: reads bind ``{name:Type}`` query parameters and inserts
send ``JSONEachRow`` data, whose JSON string escaping is done by msgspec.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from arena.schemas import RolloutState, SandboxDone, Step, Trajectory, VerificationResult
from arena.settings import Settings
from arena_trajectory.clickhouse import Backend, ChdbBackend, ClickHouseConnectBackend

DATABASE = "arena"

#: Tables, in creation order. ``rollout_id`` bloom filters serve per-rollout lookups on
#: tables whose sort key does not start with it.
DDL: tuple[str, ...] = (
    f"CREATE DATABASE IF NOT EXISTS {DATABASE}",
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.steps (
        rollout_id String,
        step_index UInt32,
        model String,
        backend String,
        policy_version String,
        prompt_tokens UInt32,
        completion_tokens UInt32,
        finish_reason String,
        total_ms Float64,
        first_token_ms Float64,
        queued_ms Float64,
        mean_logprob Nullable(Float64),
        started_at DateTime64(3, 'UTC'),
        body String
    ) ENGINE = ReplacingMergeTree
    PARTITION BY toDate(started_at)
    ORDER BY (rollout_id, step_index)""",
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.sandbox_results (
        rollout_id String,
        sandbox_id String,
        provider String,
        outcome LowCardinality(String),
        exit_code Nullable(Int32),
        reason String,
        started_at DateTime64(3, 'UTC'),
        finished_at DateTime64(3, 'UTC'),
        body String
    ) ENGINE = ReplacingMergeTree(finished_at)
    ORDER BY rollout_id""",
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.verifications (
        rollout_id String,
        verifier LowCardinality(String),
        reward Float64,
        passed Bool,
        flags Array(String),
        finished_at DateTime64(3, 'UTC'),
        body String
    ) ENGINE = ReplacingMergeTree(finished_at)
    ORDER BY (rollout_id, verifier)""",
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.trajectories (
        rollout_id String,
        task_id String,
        group_id String,
        group_index UInt32,
        group_size UInt32,
        final_state LowCardinality(String),
        reward Float64,
        num_steps UInt32,
        prompt_tokens UInt64,
        completion_tokens UInt64,
        completed_at DateTime64(3, 'UTC'),
        body String,
        INDEX idx_rollout rollout_id TYPE bloom_filter GRANULARITY 4,
        INDEX idx_group group_id TYPE bloom_filter GRANULARITY 4
    ) ENGINE = ReplacingMergeTree
    PARTITION BY toDate(completed_at)
    ORDER BY (task_id, rollout_id)""",
)

TABLES = ("steps", "sandbox_results", "verifications", "trajectories")


class TrajectorySummary(msgspec.Struct, frozen=True, kw_only=True):
    """One row of ``GET /v1/trajectories``: a trajectory without its steps."""

    rollout_id: str
    task_id: str
    group_id: str | None
    group_index: int
    group_size: int
    final_state: RolloutState
    reward: float
    num_steps: int
    prompt_tokens: int
    completion_tokens: int
    completed_at: float  # unix seconds


# --------------------------------------------------------------------------- rows


def _mean(values: Sequence[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def step_row(step: Step) -> dict:
    return {
        "rollout_id": step.rollout_id,
        "step_index": step.step_index,
        "model": step.model,
        "backend": step.backend,
        "policy_version": step.policy_version or "",
        "prompt_tokens": step.usage.prompt_tokens,
        "completion_tokens": step.usage.completion_tokens,
        "finish_reason": step.finish_reason or "",
        "total_ms": step.timings.total_ms,
        "first_token_ms": step.timings.first_token_ms,
        "queued_ms": step.timings.queued_ms,
        "mean_logprob": _mean(step.logprobs),
        "started_at": step.started_at,
        "body": _json(step),
    }


def sandbox_row(done: SandboxDone) -> dict:
    return {
        "rollout_id": done.rollout_id,
        "sandbox_id": done.sandbox_id,
        "provider": done.provider,
        "outcome": done.outcome.value,
        "exit_code": done.exit_code,
        "reason": done.reason,
        "started_at": done.started_at,
        "finished_at": done.finished_at,
        "body": _json(done),
    }


def verification_row(result: VerificationResult) -> dict:
    return {
        "rollout_id": result.rollout_id,
        "verifier": result.verifier,
        "reward": result.reward,
        "passed": result.passed,
        "flags": list(result.flags),
        "finished_at": result.finished_at,
        "body": _json(result),
    }


def trajectory_row(t: Trajectory) -> dict:
    return {
        "rollout_id": t.rollout_id,
        "task_id": t.task_id,
        "group_id": t.group_id or "",
        "group_index": t.group_index,
        "group_size": t.group_size,
        "final_state": t.final_state.value,
        "reward": t.reward,
        "num_steps": len(t.steps),
        "prompt_tokens": sum(s.usage.prompt_tokens for s in t.steps),
        "completion_tokens": sum(s.usage.completion_tokens for s in t.steps),
        "completed_at": t.completed_at,
        "body": _json(t),
    }


_encoder = msgspec.json.Encoder()


def _json(message: msgspec.Struct) -> str:
    return _encoder.encode(message).decode()


def _rows_bytes(rows: Sequence[dict]) -> bytes:
    return b"\n".join(_encoder.encode(r) for r in rows)


def _lines(data: bytes) -> list[bytes]:
    return [line for line in data.split(b"\n") if line]


class _Body(msgspec.Struct):
    body: str


_body_decoder = msgspec.json.Decoder(_Body)
_step_decoder = msgspec.json.Decoder(Step)
_sandbox_decoder = msgspec.json.Decoder(SandboxDone)
_verification_decoder = msgspec.json.Decoder(VerificationResult)
_trajectory_decoder = msgspec.json.Decoder(Trajectory)

_SUMMARY_COLUMNS = (
    "rollout_id, task_id, group_id, group_index, group_size, final_state, reward, num_steps, "
    "prompt_tokens, completion_tokens, toUnixTimestamp64Milli(completed_at) AS completed_ms"
)


class _SummaryRow(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    task_id: str
    group_id: str
    group_index: int
    group_size: int
    final_state: RolloutState
    reward: float
    num_steps: int
    prompt_tokens: int
    completion_tokens: int
    completed_ms: int

    def summary(self) -> TrajectorySummary:
        return TrajectorySummary(
            rollout_id=self.rollout_id,
            task_id=self.task_id,
            group_id=self.group_id or None,
            group_index=self.group_index,
            group_size=self.group_size,
            final_state=self.final_state,
            reward=self.reward,
            num_steps=self.num_steps,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            completed_at=self.completed_ms / 1000,
        )


# strict=False: a ClickHouse server may quote 64-bit integers in JSON output
_summary_decoder = msgspec.json.Decoder(_SummaryRow, strict=False)


# --------------------------------------------------------------------------- the store


class TrajectoryStore:
    """Async facade over a ``Backend``: typed inserts and queries, run in a thread."""

    def __init__(self, backend: Backend):
        self.backend = backend

    @classmethod
    def open(cls, settings: Settings) -> TrajectoryStore:
        """A ClickHouse server if ``settings.clickhouse_url`` is set, else embedded chDB
        under ``{data_dir}/clickhouse``."""
        if settings.clickhouse_url:
            return cls(ClickHouseConnectBackend.from_url(settings.clickhouse_url))
        return cls(ChdbBackend(Path(settings.data_dir) / "clickhouse"))

    async def init(self) -> None:
        """Create the database and tables. Idempotent."""
        for sql in DDL:
            await asyncio.to_thread(self.backend.execute, sql)

    async def close(self) -> None:
        await asyncio.to_thread(self.backend.close)

    async def ping(self) -> None:
        await self._select("SELECT 1 AS ok")

    # ----------------------------------------------------------------- inserts

    async def _insert(self, table: str, rows: Sequence[dict]) -> None:
        if rows:
            await asyncio.to_thread(self.backend.insert, f"{DATABASE}.{table}", _rows_bytes(rows))

    async def insert_step(self, step: Step) -> None:
        await self._insert("steps", [step_row(step)])

    async def insert_steps(self, steps: Sequence[Step]) -> None:
        await self._insert("steps", [step_row(s) for s in steps])

    async def insert_sandbox_result(self, done: SandboxDone) -> None:
        await self._insert("sandbox_results", [sandbox_row(done)])

    async def insert_verification(self, result: VerificationResult) -> None:
        await self._insert("verifications", [verification_row(result)])

    async def insert_trajectory(self, trajectory: Trajectory) -> None:
        await self._insert("trajectories", [trajectory_row(trajectory)])

    # ----------------------------------------------------------------- queries

    async def _select(self, sql: str, params: Mapping[str, str | int | float] | None = None) -> list[bytes]:
        return _lines(await asyncio.to_thread(self.backend.select, sql, dict(params or {})))

    async def _bodies(self, sql: str, params: Mapping[str, str | int | float]) -> list[str]:
        return [_body_decoder.decode(line).body for line in await self._select(sql, params)]

    async def steps_for(self, rollout_id: str) -> list[Step]:
        """The rollout's stored steps, by ``step_index``, one per index."""
        bodies = await self._bodies(
            f"SELECT body FROM {DATABASE}.steps FINAL WHERE rollout_id = {{rid:String}} ORDER BY step_index",
            {"rid": rollout_id},
        )
        return [_step_decoder.decode(b) for b in bodies]

    async def sandbox_result(self, rollout_id: str) -> SandboxDone | None:
        bodies = await self._bodies(
            f"SELECT body FROM {DATABASE}.sandbox_results FINAL WHERE rollout_id = {{rid:String}} LIMIT 1",
            {"rid": rollout_id},
        )
        return _sandbox_decoder.decode(bodies[0]) if bodies else None

    async def verification(self, rollout_id: str) -> VerificationResult | None:
        """The rollout's latest verification (by ``finished_at``) if any."""
        bodies = await self._bodies(
            f"SELECT body FROM {DATABASE}.verifications FINAL WHERE rollout_id = {{rid:String}} "
            "ORDER BY finished_at DESC LIMIT 1",
            {"rid": rollout_id},
        )
        return _verification_decoder.decode(bodies[0]) if bodies else None

    async def trajectory(self, rollout_id: str) -> Trajectory | None:
        bodies = await self._bodies(
            f"SELECT body FROM {DATABASE}.trajectories FINAL WHERE rollout_id = {{rid:String}} LIMIT 1",
            {"rid": rollout_id},
        )
        return _trajectory_decoder.decode(bodies[0]) if bodies else None

    async def group(self, group_id: str) -> list[Trajectory]:
        """The stored trajectories of a group, by ``group_index``."""
        bodies = await self._bodies(
            f"SELECT body FROM {DATABASE}.trajectories FINAL WHERE group_id = {{gid:String}} "
            "ORDER BY group_index, rollout_id",
            {"gid": group_id},
        )
        return [_trajectory_decoder.decode(b) for b in bodies]

    async def list_trajectories(
        self,
        *,
        task_id: str | None = None,
        group_id: str | None = None,
        state: RolloutState | str | None = None,
        limit: int = 100,
    ) -> list[TrajectorySummary]:
        """Summaries, newest first."""
        where, params = [], {"limit": int(limit)}
        if task_id is not None:
            where.append("task_id = {task_id:String}")
            params["task_id"] = task_id
        if group_id is not None:
            where.append("group_id = {group_id:String}")
            params["group_id"] = group_id
        if state is not None:
            where.append("final_state = {state:String}")
            params["state"] = RolloutState(state).value
        sql = (
            f"SELECT {_SUMMARY_COLUMNS} FROM {DATABASE}.trajectories FINAL"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY completed_at DESC, rollout_id LIMIT {limit:UInt32}"
        )
        return [_summary_decoder.decode(line).summary() for line in await self._select(sql, params)]

    async def count_rows(self, table: str, *, rollout_id: str | None = None, final: bool = True) -> int:
        """Rows in ``table`` (as queries see them with ``final``; physical rows without)."""
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}")
        sql = f"SELECT count() AS n FROM {DATABASE}.{table}" + (" FINAL" if final else "")
        params: dict[str, str | int | float] = {}
        if rollout_id is not None:
            sql += " WHERE rollout_id = {rid:String}"
            params["rid"] = rollout_id
        rows = await self._select(sql, params)
        return int(msgspec.json.decode(rows[0])["n"])
