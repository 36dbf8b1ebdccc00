"""ClickHouse storage on embedded chDB, through both backends (same SQL).

The clickhouse-connect backend is exercised with clickhouse-connect's own ``chdb://``
transport: the real client library (parameter binding, raw inserts) on a real engine.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from arena_core.schemas import (
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    Step,
    Timings,
    ToolCall,
    Usage,
    VerificationResult,
)
from arena_trajectory import assembler
from arena_trajectory.clickhouse import ChdbBackend, ClickHouseConnectBackend, escape_param
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import RowError, step_row

NASTY = "it's a \"quote\", a back\\slash \\n (not a newline), a\nnewline, a\ttab, \r\0 and ünïcødé ☃ 🚀 {x:String}"


def step(rid: str, i: int, *, text: str = "", version: str = "7", logprobs=(-0.5, -1.5)) -> Step:
    return Step(rollout_id=rid, step_index=i, model="m", backend="b0", policy_version=version,
                request_messages=[{"role": "user", "content": text or "hi"}], completion_text=text or f"s{i}",
                prompt_token_ids=[1, 2], completion_token_ids=[3, 4], logprobs=list(logprobs),
                finish_reason="stop", usage=Usage(prompt_tokens=2, completion_tokens=2, total_tokens=4),
                timings=Timings(queued_ms=1.0, first_token_ms=5.0, total_ms=9.5), started_at=1_700_000_000.125 + i)


def trajectory(rid: str, *, task="t1", group=None, index=0, size=1, reward=1.0, state=RolloutState.COMPLETED,
               at=1_700_000_100.5, steps=2):
    event = RolloutStateChanged(rollout_id=rid, task_id=task, from_state=RolloutState.VERIFYING, to_state=state,
                                at=at, steps=steps, group_id=group, group_index=index, group_size=size)
    verification = VerificationResult(rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0,
                                      started_at=at - 2, finished_at=at - 1)
    return assembler.assemble(event, [step(rid, i) for i in range(steps)], None, verification)


@pytest.fixture(params=["chdb", "clickhouse-connect"])
async def store(request, tmp_path):
    if request.param == "chdb":
        backend = ChdbBackend(tmp_path / "clickhouse")
    else:
        import clickhouse_connect

        backend = ClickHouseConnectBackend(clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'clickhouse'}"),
                                           async_insert=False)
    s = TrajectoryStore(backend)
    await s.init()
    await s.init()  # idempotent
    try:
        yield s
    finally:
        await s.close()


async def test_redelivered_step_is_one_visible_row(store):
    s0 = step("r1", 0)
    await store.insert_step(s0)
    await store.insert_step(s0)
    await store.insert_steps([step("r1", 1), s0])
    assert await store.count_rows("steps", rollout_id="r1") == 2
    assert await store.count_rows("steps", rollout_id="r1", final=False) == 4
    steps = await store.steps_for("r1")
    assert [s.step_index for s in steps] == [0, 1]
    assert steps[0] == s0  # the full message round-trips through the body column


async def test_strings_with_quotes_backslashes_newlines_and_unicode_round_trip(store):
    rid = "r-" + NASTY
    nasty = step(rid, 0, text=NASTY)
    await store.insert_step(nasty)
    assert await store.steps_for(rid) == [nasty]
    assert await store.steps_for("r-") == []
    t = trajectory(rid, task=NASTY, group=NASTY)
    await store.insert_trajectory(t)
    assert await store.trajectory(rid) == t
    assert await store.group(NASTY) == [t]
    [summary] = await store.list_trajectories(task_id=NASTY)
    assert summary.rollout_id == rid and summary.group_id == NASTY


async def test_step_columns_hold_what_analytics_read(store):
    """Steps go in as RowBinary: every analytics column holds the step's value, a step
    without logprobs has NULL statistics, and a long body (multi-byte length) is intact."""
    import json

    long_text = "x" * 20_000 + NASTY
    with_lp = msgspec.structs.replace(step("cols", 0, text=long_text, logprobs=(-0.25, -1.75, -1.0)),
                                      tool_calls=[ToolCall(id="c1", name="f"), ToolCall(id="c2", name="g")])
    without = msgspec.structs.replace(step("cols", 1), logprobs=None, finish_reason=None, policy_version=None)
    await store.insert_steps([with_lp, without])
    rows = [json.loads(line) for line in await store.select(
        "SELECT * EXCEPT body, toUnixTimestamp64Milli(started_at) AS ms, length(body) AS body_len "
        "FROM arena.steps FINAL WHERE rollout_id = {r:String} ORDER BY step_index", {"r": "cols"})]
    assert rows[0] | {"started_at": None} == {
        "rollout_id": "cols", "step_index": 0, "model": "m", "backend": "b0", "policy_version": "7",
        "prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0, "finish_reason": "stop", "total_ms": 9.5,
        "first_token_ms": 5.0, "queued_ms": 1.0, "mean_logprob": -1.0, "min_logprob": -1.75, "sum_logprob": -3.0,
        "num_logprobs": 3, "tool_calls": 2, "started_at": None, "ms": 1_700_000_000_125, "body_len": len(msgspec.json.encode(with_lp))}
    assert rows[1]["mean_logprob"] is None and rows[1]["min_logprob"] is None and rows[1]["num_logprobs"] == 0
    assert rows[1]["tool_calls"] == 0
    assert rows[1]["policy_version"] == "" and rows[1]["finish_reason"] == "" and rows[1]["ms"] == 1_700_000_001_125
    assert await store.steps_for("cols") == [with_lp, without]


async def test_cached_tokens_are_columns_of_steps_and_trajectories_and_an_older_table_gains_them(tmp_path):
    """Tables made before ``cached_tokens`` existed gain the columns on ``init`` (their rows read 0);
    a step's prefix-cache hits land in ``steps.cached_tokens`` and their sum in ``trajectories``."""
    import json

    from arena_trajectory.tables import DDL, MIGRATIONS

    backend = ChdbBackend(tmp_path / "clickhouse")
    older = TrajectoryStore(backend)
    for sql in DDL + tuple(m for m in MIGRATIONS if "cached_tokens" not in m):  # an earlier release's tables
        await asyncio.to_thread(backend.execute, sql)
    old_row = {"rollout_id": "old", "step_index": 0, "model": "m", "backend": "b0", "policy_version": "",
               "prompt_tokens": 9, "completion_tokens": 1, "finish_reason": "stop", "total_ms": 1.0,
               "first_token_ms": 1.0, "queued_ms": 0.0, "started_at": 1_700_000_000.0,
               "body": json.dumps(msgspec.to_builtins(step("old", 0)))}
    await older._insert("steps", [old_row])  # noqa: SLF001 - a row as the earlier release wrote it
    await older.init()  # the migrations: the columns are added
    cached = msgspec.structs.replace(step("new", 0), usage=Usage(prompt_tokens=40, completion_tokens=2,
                                                                 total_tokens=42, cached_tokens=32))
    await older.insert_steps([cached])
    t = assembler.assemble(RolloutStateChanged(rollout_id="new", task_id="t1", from_state=RolloutState.VERIFYING,
                                               to_state=RolloutState.COMPLETED, at=1_700_000_100.0, steps=2),
                           [cached, msgspec.structs.replace(step("new", 1), usage=Usage(
                               prompt_tokens=50, completion_tokens=2, total_tokens=52, cached_tokens=48))], None, None)
    await older.insert_trajectory(t)
    rows = {(r["rollout_id"], r["step_index"]): r["cached_tokens"] for r in map(json.loads, await older.select(
        "SELECT rollout_id, step_index, cached_tokens FROM arena.steps FINAL"))}
    assert rows == {("new", 0): 32, ("new", 1): 48, ("old", 0): 0}
    [row] = [json.loads(r) for r in await older.select("SELECT cached_tokens FROM arena.trajectories FINAL")]
    assert int(row["cached_tokens"]) == 80
    assert [s.usage.cached_tokens for s in (await older.trajectory("new")).steps] == [32, 48]
    await older.close()


@pytest.mark.parametrize("bad", [{"step_index": -1}, {"step_index": 2**32}, {"started_at": float("inf")},
                                 {"usage": Usage(prompt_tokens=-5)}])
def test_a_step_the_columns_cannot_hold_is_refused_by_name(bad):
    with pytest.raises(RowError, match="does not fit the steps table"):
        step_row(msgspec.structs.replace(step("r", 0), **bad))


def test_escape_param_escapes_what_clickhouse_reads_as_escapes():
    assert escape_param("a\\b\nc\td'e") == "a\\\\b\\nc\\td'e"


async def test_sandbox_and_verification_results(store):
    assert await store.sandbox_result("r1") is None
    assert await store.verification("r1") is None
    done = SandboxDone(rollout_id="r1", sandbox_id="sb", provider="local", outcome=SandboxOutcome.FAILED,
                       reason="exit 1", started_at=10.0, finished_at=12.5, exit_code=1, diff=NASTY,
                       result={"answer": NASTY})
    await store.insert_sandbox_result(done)
    await store.insert_sandbox_result(done)
    assert await store.sandbox_result("r1") == done
    assert await store.count_rows("sandbox_results") == 1
    v = VerificationResult(rollout_id="r1", verifier="tests", reward=0.5, passed=False, started_at=13.0,
                           finished_at=14.0, flags=["tests_missing", NASTY])
    await store.insert_verification(v)
    await store.insert_verification(v)
    assert await store.verification("r1") == v
    assert await store.count_rows("verifications") == 1


async def test_trajectory_queries(store):
    a = trajectory("a", group="g1", index=0, size=2, reward=1.0, at=1_700_000_001.0)
    b = trajectory("b", group="g1", index=1, size=2, reward=0.0, at=1_700_000_002.0)
    c = trajectory("c", task="t2", state=RolloutState.FAILED, reward=0.0, at=1_700_000_003.0, steps=0)
    for t in (b, a, c, a):
        await store.insert_trajectory(t)
    assert await store.count_rows("trajectories") == 3
    assert await store.trajectory("a") == a
    assert await store.trajectory("nope") is None
    assert [t.rollout_id for t in await store.group("g1")] == ["a", "b"]
    assert await store.group("g-unknown") == []

    summaries = await store.list_trajectories()
    assert [s.rollout_id for s in summaries] == ["c", "b", "a"]  # newest first
    sa = summaries[2]
    assert (sa.task_id, sa.group_id, sa.group_index, sa.group_size) == ("t1", "g1", 0, 2)
    assert sa.final_state is RolloutState.COMPLETED and sa.reward == 1.0
    assert (sa.num_steps, sa.prompt_tokens, sa.completion_tokens) == (2, 4, 4)
    assert sa.completed_at == pytest.approx(1_700_000_001.0)
    assert summaries[0].group_id is None

    assert [s.rollout_id for s in await store.list_trajectories(task_id="t1")] == ["b", "a"]
    assert [s.rollout_id for s in await store.list_trajectories(group_id="g1", limit=1)] == ["b"]
    assert [s.rollout_id for s in await store.list_trajectories(state="failed")] == ["c"]
    assert [s.rollout_id for s in await store.list_trajectories(state=RolloutState.COMPLETED, task_id="t2")] == []
    with pytest.raises(ValueError):
        await store.list_trajectories(state="bogus")


async def test_step_analytics_columns(store):
    await store.insert_steps([step("r1", 0), step("r1", 1, logprobs=())])
    rows = await store._select(  # noqa: SLF001 - checking the analytic columns directly
        "SELECT step_index, policy_version, total_ms, mean_logprob, toUnixTimestamp64Milli(started_at) AS ms "
        "FROM arena.steps FINAL WHERE rollout_id = {rid:String} ORDER BY step_index", {"rid": "r1"})
    import msgspec

    decoded = [msgspec.json.decode(r) for r in rows]
    assert decoded[0] == {"step_index": 0, "policy_version": "7", "total_ms": 9.5, "mean_logprob": -1.0,
                          "ms": 1_700_000_000_125}
    assert decoded[1]["mean_logprob"] is None


async def test_count_rows_rejects_unknown_tables(store):
    with pytest.raises(ValueError):
        await store.count_rows("steps; DROP TABLE arena.steps")
