"""The ClickHouse tables of the trajectory plane (DDL, ``MIGRATIONS``, ``TUNING``) and their rows.

Every table is a ``ReplacingMergeTree`` keyed by the identity of the message it stores and read
with ``FINAL``, so a redelivery is never seen twice. See docs/trajectory.md (Storage).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence

import msgspec

from arena_core.schemas import DEFAULT_PROJECT, LABEL_DUEL, LABEL_DUEL_POLICY, LABEL_DUEL_SEED, LABEL_DUEL_SIDE
from arena_core.schemas import RolloutStateChanged, SandboxDone, Step, TrainerMetrics, Trajectory, VerificationResult

DATABASE = "arena"

#: Tables, in creation order.
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
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.rollout_states (
        rollout_id String,
        task_id String,
        from_state LowCardinality(String),
        to_state LowCardinality(String),
        at DateTime64(3, 'UTC'),
        reason String
    ) ENGINE = ReplacingMergeTree
    PARTITION BY toDate(at)
    ORDER BY (rollout_id, to_state, at)""",
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.groups (
        group_id String,
        task_id String,
        size UInt32,
        members UInt32,
        partial Bool,
        published_at DateTime64(3, 'UTC')
    ) ENGINE = ReplacingMergeTree(published_at)
    ORDER BY group_id""",
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.trainer_metrics (
        run String,
        step UInt64,
        policy_version String,
        at DateTime64(3, 'UTC'),
        body String
    ) ENGINE = ReplacingMergeTree(at)
    ORDER BY (run, step)""",
    # a trainer's own logprob of each token of a trajectory's training sequence (insights.py)
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.trainer_logprobs (
        rollout_id String,
        sequence_index UInt32,
        run String,
        policy_version String,
        at DateTime64(3, 'UTC'),
        logprobs Array(Float32)
    ) ENGINE = ReplacingMergeTree(at)
    ORDER BY (rollout_id, sequence_index, run)""",
    # an ``arena eval`` report as the client posted it, per job and grading version (evals.py)
    f"""CREATE TABLE IF NOT EXISTS {DATABASE}.eval_reports (
        job_id String,
        version UInt32,
        created_at DateTime64(3, 'UTC'),
        stored_at DateTime64(3, 'UTC'),
        dataset String,
        agent String,
        k UInt32,
        tasks UInt32,
        models String,
        body String
    ) ENGINE = ReplacingMergeTree(stored_at)
    ORDER BY (job_id, version)""",
)

#: SQL over ``trajectories``: the row has a reward (the verifier's): verified, and not an
#: infrastructure outcome. The ``reward`` column of any other row is a stored 0 that means none.
SCORED = "(verified AND NOT infrastructure)"

#: Columns added after the first release of a table (idempotent).
MIGRATIONS: tuple[str, ...] = (
    f"ALTER TABLE {DATABASE}.steps ADD COLUMN IF NOT EXISTS min_logprob Nullable(Float64) AFTER mean_logprob",
    f"ALTER TABLE {DATABASE}.steps ADD COLUMN IF NOT EXISTS sum_logprob Float64 DEFAULT 0 AFTER min_logprob",
    f"ALTER TABLE {DATABASE}.steps ADD COLUMN IF NOT EXISTS num_logprobs UInt32 DEFAULT 0 AFTER sum_logprob",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS policy_versions Array(String) AFTER reward",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS passed Bool DEFAULT false AFTER policy_versions",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS started_at DateTime64(3, 'UTC') "
    "DEFAULT completed_at AFTER completion_tokens",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS stored_at DateTime64(3, 'UTC') "
    "DEFAULT completed_at AFTER completed_at",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS step_indexes Array(UInt32) AFTER num_steps",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS infrastructure Bool DEFAULT false AFTER reward",
    # dashboard aggregates (insights.py): columns instead of JSON extraction; a row stored
    # before a column existed gets it from its body where the body holds it
    f"ALTER TABLE {DATABASE}.steps ADD COLUMN IF NOT EXISTS tool_calls UInt32 DEFAULT 0 AFTER num_logprobs",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS task_set String "
    "DEFAULT JSONExtractString(body, 'metadata', 'task_set')",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS verified Bool DEFAULT JSONHas(body, 'verification')",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS queue_ms Float64 DEFAULT -1",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS tool_calls UInt32 DEFAULT 0",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS sandbox_ms Float64 DEFAULT "
    "if(JSONHas(body, 'sandbox'), 1000 * (JSONExtractFloat(body, 'sandbox', 'finished_at') "
    "- JSONExtractFloat(body, 'sandbox', 'started_at')), -1)",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS verification_ms Float64 DEFAULT "
    "if(JSONHas(body, 'verification'), 1000 * (JSONExtractFloat(body, 'verification', 'finished_at') "
    "- JSONExtractFloat(body, 'verification', 'started_at')), -1)",
    f"ALTER TABLE {DATABASE}.verifications ADD COLUMN IF NOT EXISTS started_at DateTime64(3, 'UTC') "
    "DEFAULT fromUnixTimestamp64Milli(toInt64(1000 * JSONExtractFloat(body, 'started_at')))",
    f"ALTER TABLE {DATABASE}.verifications ADD COLUMN IF NOT EXISTS parser LowCardinality(String) "
    "DEFAULT JSONExtractString(body, 'parser')",
    *(f"ALTER TABLE {DATABASE}.verifications ADD COLUMN IF NOT EXISTS {name} UInt32 "
      f"DEFAULT JSONExtractUInt(body, 'counts', '{name}')"
      for name in ("f2p_passed", "f2p_failed", "p2p_passed", "p2p_failed")),
    # duels (duels.py): a member's labels as columns, so rounds pair up in SQL
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS duel_id String "
    "DEFAULT JSONExtractString(body, 'metadata', 'arena.duel')",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS duel_side LowCardinality(String) "
    "DEFAULT JSONExtractString(body, 'metadata', 'arena.duel.side')",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS duel_policy String "
    "DEFAULT JSONExtractString(body, 'metadata', 'arena.duel.policy')",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS duel_seed Int64 "
    "DEFAULT toInt64OrZero(JSONExtractString(body, 'metadata', 'arena.duel.seed'))",
    f"ALTER TABLE {DATABASE}.trajectories ADD INDEX IF NOT EXISTS idx_duel duel_id TYPE bloom_filter GRANULARITY 4",
    # prompt tokens the backend served from its prefix cache (``Usage.cached_tokens``)
    f"ALTER TABLE {DATABASE}.steps ADD COLUMN IF NOT EXISTS cached_tokens UInt32 DEFAULT 0 AFTER completion_tokens",
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS cached_tokens UInt64 DEFAULT 0 "
    "AFTER completion_tokens",
    # projects (docs/projects.md): every row of a project's data says whose it is; a row stored
    # before projects existed is the default project's
    f"ALTER TABLE {DATABASE}.trajectories ADD COLUMN IF NOT EXISTS project LowCardinality(String) "
    f"DEFAULT if(JSONHas(body, 'project'), JSONExtractString(body, 'project'), '{DEFAULT_PROJECT}')",
    f"ALTER TABLE {DATABASE}.rollout_states ADD COLUMN IF NOT EXISTS project LowCardinality(String) "
    f"DEFAULT '{DEFAULT_PROJECT}'",
    f"ALTER TABLE {DATABASE}.trainer_metrics ADD COLUMN IF NOT EXISTS project LowCardinality(String) "
    f"DEFAULT '{DEFAULT_PROJECT}'",
    f"ALTER TABLE {DATABASE}.eval_reports ADD COLUMN IF NOT EXISTS project LowCardinality(String) "
    f"DEFAULT '{DEFAULT_PROJECT}'",
    f"ALTER TABLE {DATABASE}.eval_reports ADD COLUMN IF NOT EXISTS owner String DEFAULT ''",
)

#: Storage tuning, applied after the migrations; a server too old to know a setting keeps
#: its default (logged), nothing else changes. ``steps`` takes every step of every rollout
#: in batches of up to a few thousand rows: merging parts only once about 20 of a size have
#: gathered (the default is 5) rewrites each row about half as often (merging was about a
#: sixth of the trajectory service's CPU at 20,000 steps/s), for a few more parts to read (``FINAL``).
TUNING: tuple[str, ...] = (
    f"ALTER TABLE {DATABASE}.steps MODIFY SETTING merge_selector_base = 20",
)

TABLES = ("steps", "sandbox_results", "verifications", "trajectories", "rollout_states", "groups")


# --------------------------------------------------------------------------- rows


#: The ``steps`` columns in the order ``step_row`` writes them.
STEP_COLUMNS: tuple[str, ...] = (
    "rollout_id", "step_index", "model", "backend", "policy_version", "prompt_tokens", "completion_tokens",
    "cached_tokens", "finish_reason", "total_ms", "first_token_ms", "queued_ms", "mean_logprob", "min_logprob", "sum_logprob",
    "num_logprobs", "tool_calls", "started_at", "body",
)
#: ``steps`` rows go in as ``RowBinary``: a step's body is copied as it arrived instead of
#: being escaped into a JSON string and parsed back (chDB takes a 2,000-row batch at
#: ~3.5 us/row this way, ~10-14 us/row as ``JSONEachRow``).
STEP_FORMAT = "RowBinary"


class RowError(ValueError):
    """A value the table's column cannot hold (e.g. a negative ``step_index``)."""


_U32 = struct.Struct("<I")
_U32x3 = struct.Struct("<III")
# total_ms, first_token_ms, queued_ms, [not null, mean_logprob], [not null, min_logprob], sum, n,
# tool_calls, started_at (ms)
_TAIL_LOGPROBS = struct.Struct("<dddBdBddIIq")
_TAIL_NO_LOGPROBS = struct.Struct("<dddBBdIIq")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _length(n: int) -> bytes:
    """A RowBinary length: LEB128."""
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    return _varint(n)


def _string(value: bytes) -> bytes:
    """A ``String`` in RowBinary: its length, then the bytes."""
    return _length(len(value)) + value


_short: dict[str, bytes] = {}


def _label(value: str) -> bytes:
    """``_string`` of a short text that repeats from row to row (a rollout id, a model, a
    replica URL, a policy version), encoded once and kept (up to 10,000 of them)."""
    got = _short.get(value)
    if got is None:
        got = _string(value.encode())
        if len(_short) >= 10_000:
            _short.clear()
        _short[value] = got
    return got


def step_row(step: Step, *, body: msgspec.Raw | bytes | None = None) -> bytes:
    """One ``steps`` row, ``RowBinary`` in ``STEP_COLUMNS`` order. ``body``: the step's JSON
    if at hand (as it arrived), else it is encoded here. Raises ``RowError`` for a value
    the columns cannot hold."""
    logprobs = step.logprobs or []
    timings, usage = step.timings, step.usage
    body = _encoder.encode(step) if body is None else body
    try:
        started_ms = round(step.started_at * 1000)
        if logprobs:
            total = sum(logprobs)
            tail = _TAIL_LOGPROBS.pack(timings.total_ms, timings.first_token_ms, timings.queued_ms,
                                       0, total / len(logprobs), 0, min(logprobs), total, len(logprobs),
                                       len(step.tool_calls), started_ms)
        else:
            tail = _TAIL_NO_LOGPROBS.pack(timings.total_ms, timings.first_token_ms, timings.queued_ms,
                                          1, 1, 0.0, 0, len(step.tool_calls), started_ms)
        return b"".join((
            _label(step.rollout_id), _U32.pack(step.step_index), _label(step.model), _label(step.backend),
            _label(step.policy_version or ""), _U32x3.pack(usage.prompt_tokens, usage.completion_tokens,
                                                                     usage.cached_tokens),
            _label(step.finish_reason or ""), tail, _length(len(body)), body,  # body joined as it is, not copied first
        ))
    except (struct.error, OverflowError, ValueError) as exc:  # out of range, inf/NaN time, lone surrogate
        raise RowError(f"step {step.rollout_id}/{step.step_index} does not fit the steps table: {exc}") from exc


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
        "body": json_text(done),
    }


def verification_row(result: VerificationResult) -> dict:
    return {
        "rollout_id": result.rollout_id,
        "verifier": result.verifier,
        "reward": 0.0 if result.reward is None else result.reward,  # None: flags name infrastructure_error
        "passed": result.passed,
        "flags": list(result.flags),
        "started_at": result.started_at,
        "finished_at": result.finished_at,
        "parser": result.parser,
        "f2p_passed": result.counts.f2p_passed,
        "f2p_failed": result.counts.f2p_failed,
        "p2p_passed": result.counts.p2p_passed,
        "p2p_failed": result.counts.p2p_failed,
        "body": json_text(result),
    }


def state_row(event: RolloutStateChanged) -> dict:
    return {
        "rollout_id": event.rollout_id,
        "task_id": event.task_id,
        "from_state": event.from_state.value if event.from_state else "",
        "to_state": event.to_state.value,
        "at": event.at,
        "reason": event.reason,
        "project": event.project,
    }


def _queue_ms(t: Trajectory) -> float:
    """Milliseconds from the first ``pending`` to the first ``running`` transition (-1: unknown)."""
    pending = min((h.at for h in t.history if h.to_state.value == "pending"), default=None)
    running = min((h.at for h in t.history if h.to_state.value == "running"), default=None)
    return -1.0 if pending is None or running is None else max(running - pending, 0.0) * 1000


def _run_ms(started_at: float, finished_at: float) -> float:
    return max(finished_at - started_at, 0.0) * 1000


def trajectory_row(t: Trajectory, *, stored_at: float | None = None) -> dict:
    started = min((h.at for h in t.history), default=t.completed_at)
    return {
        "rollout_id": t.rollout_id,
        "task_id": t.task_id,
        "group_id": t.group_id or "",
        "group_index": t.group_index,
        "group_size": t.group_size,
        "final_state": t.final_state.value,
        # None (stored 0, read back as none): an infrastructure outcome (column below) or a rollout
        # never verified (``verified`` false); ``SCORED`` is the SQL of "has a reward"
        "reward": 0.0 if t.reward is None else t.reward,
        "infrastructure": t.infrastructure or (t.reward is None and t.verification is not None),
        "policy_versions": list(t.policy_versions),
        "passed": bool(t.verification and t.verification.passed and t.final_state.value == "completed"),
        "num_steps": len(t.steps),
        # the body leaves the steps out (they are in ``steps`` already); reads join them back
        # and assemble the sequences from them again (derived: the same values)
        "step_indexes": [s.step_index for s in t.steps],
        "prompt_tokens": sum(s.usage.prompt_tokens for s in t.steps),
        "completion_tokens": sum(s.usage.completion_tokens for s in t.steps),
        "cached_tokens": sum(s.usage.cached_tokens for s in t.steps),
        "started_at": started,
        "completed_at": t.completed_at,
        "stored_at": time.time() if stored_at is None else stored_at,
        **duel_columns(t.metadata),
        "task_set": t.metadata.get("task_set", ""),
        "project": t.project,
        "verified": t.verification is not None,
        "queue_ms": _queue_ms(t),
        "tool_calls": sum(len(s.tool_calls) for s in t.steps),
        "sandbox_ms": -1.0 if t.sandbox is None else _run_ms(t.sandbox.started_at, t.sandbox.finished_at),
        "verification_ms": -1.0 if t.verification is None else _run_ms(t.verification.started_at,
                                                                        t.verification.finished_at),
        "body": json_text(msgspec.structs.replace(t, steps=[], sequences=[], sequence_breaks=[])),
    }


def duel_columns(metadata: dict[str, str]) -> dict:
    """A duel member's labels (``arena.duel*``) as the ``trajectories`` columns; empty when not a duel's."""
    return {"duel_id": metadata.get(LABEL_DUEL, ""), "duel_side": metadata.get(LABEL_DUEL_SIDE, ""),
            "duel_policy": metadata.get(LABEL_DUEL_POLICY, ""), "duel_seed": _int64(metadata.get(LABEL_DUEL_SEED, ""))}


def _int64(text: str) -> int:
    """``text`` as an ``Int64`` (a seed anywhere in its range); 0 when it is not one."""
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 19:
        return 0
    value = int(text)
    return value if -(1 << 63) <= value < 1 << 63 else 0


def group_row(*, group_id: str, task_id: str, size: int, members: int, partial: bool) -> dict:
    return {"group_id": group_id, "task_id": task_id, "size": size, "members": members, "partial": partial,
            "published_at": time.time()}


_encoder = msgspec.json.Encoder()


def trainer_logprobs_row(*, rollout_id: str, sequence_index: int, run: str, policy_version: str,
                         logprobs: Sequence[float], at: float | None = None) -> dict:
    return {"rollout_id": rollout_id, "sequence_index": sequence_index, "run": run,
            "policy_version": policy_version, "at": time.time() if at is None else at, "logprobs": list(logprobs)}


def trainer_metrics_row(m: TrainerMetrics, project: str = DEFAULT_PROJECT) -> dict:
    return {"run": m.run, "step": m.step, "policy_version": m.policy_version, "at": m.at, "body": json_text(m),
            "project": project}


def json_text(message: msgspec.Struct) -> str:
    return _encoder.encode(message).decode()


def rows_bytes(rows: Sequence[dict | msgspec.Struct]) -> bytes:
    """JSONEachRow: one JSON object per line."""
    return _encoder.encode_lines(rows)
