"""Dashboard aggregates over the stored trajectories: overview, live counts, verification,
tasks, token usage, training curves, and trainer logprobs. Every answer is computed in
ClickHouse from columns (never from every row's body) and returned as a msgspec Struct.
Shapes and definitions: docs/trajectory.md (Dashboard aggregates).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

import msgspec

from arena_core.errors import Conflict, NotFound
from arena_core.schemas import Id
from arena_trajectory.listing import TrajectoryFilter
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import DATABASE, SCORED, trainer_logprobs_row

T = f"{DATABASE}.trajectories FINAL"
S = f"{DATABASE}.steps FINAL"
V = f"{DATABASE}.verifications FINAL"

NON_FINAL = ("pending", "provisioning", "running", "verifying")
FINAL = ("completed", "failed", "timed_out", "cancelled", "budget_exhausted")
#: The flag a verifier raises when it could not read a complete test report (verification/tests_verifier.py).
PARSE_FAILED = "parse_failed"
FLAG_EXAMPLES = 20
MAX_SEQUENCE_TOKENS = 1 << 17

_MS = "toUnixTimestamp64Milli"
HAS_PARSER = "parser != ''"
IN_GROUP = "group_id != ''"


def _and(where: str, *conditions: str) -> str:
    """``where`` (a ``TrajectoryFilter`` clause, maybe '') with ``conditions`` added."""
    parts = [where.removeprefix(" WHERE ")] if where else []
    parts += conditions
    return " WHERE " + " AND ".join(parts) if parts else ""


def _subfilter(f: TrajectoryFilter) -> tuple[str, dict]:
    """A ``WHERE`` restricting a per-rollout table to the filtered trajectories ('' if no filter)."""
    where, params = f.where()
    return (f" WHERE rollout_id IN (SELECT rollout_id FROM {T}{where})" if where else ""), params


def _joined(*parts: str) -> str:
    """One statement of single-row ``parts`` side by side (their column names differ): the
    store runs one statement at a time, so each one more waits behind the inserts once more."""
    return "SELECT * FROM " + " CROSS JOIN ".join(f"({p}) AS p{i}" for i, p in enumerate(parts))


def _collected(sql: str, columns: str, name: str) -> str:
    """A single-row query holding the rows of ``sql`` as ``name``: an array of ``columns`` tuples."""
    return f"SELECT groupArray(({columns})) AS {name} FROM ({sql})"


def _fields(value: list | dict) -> list:
    """A tuple from the JSON output: an array, or an object for a named tuple."""
    return list(value.values()) if isinstance(value, dict) else value


async def _rows(store: TrajectoryStore, sql: str, params: dict) -> list[dict]:
    return [msgspec.json.decode(line) for line in await store.select(sql, params)]


async def _row(store: TrajectoryStore, sql: str, params: dict) -> dict:
    return (await _rows(store, sql, params))[0]


# --------------------------------------------------------------------------- overview


class Latency(msgspec.Struct, frozen=True, kw_only=True):
    p50: float
    p95: float
    count: int


class OverviewLatency(msgspec.Struct, frozen=True, kw_only=True):
    """Milliseconds. ``rollout``: first transition -> final; ``queue``: pending -> running;
    ``sandbox``/``verification``: the run; ``llm``: one LLM call (``Step.timings.total_ms``)."""

    rollout: Latency
    queue: Latency
    sandbox: Latency
    verification: Latency
    llm: Latency


class ByState(msgspec.Struct, frozen=True, kw_only=True):
    completed: int
    failed: int
    timed_out: int
    cancelled: int
    budget_exhausted: int


class Overview(msgspec.Struct, frozen=True, kw_only=True):
    """Final rollouts in the window (``since``/``until`` as asked; null: open)."""

    since: float | None
    until: float | None
    rollouts: int
    rollouts_per_s: float  # rollouts / window (until - since; open ends: the first/last completed_at)
    by_state: ByState
    success_rate: float  # passed / rollouts
    error_rate: float  # failed (not an infrastructure outcome) / rollouts
    timeout_rate: float  # likewise: the policy's, infrastructure outcomes left out
    budget_exhausted_rate: float
    infrastructure_error_rate: float  # no reward: Arena could not run or verify
    mean_reward: float | None  # over rollouts with a reward (the verified; infrastructure outcomes left out)
    mean_reward_first: float | None  # the same over the first tenth of the window
    reward_change: float | None  # mean_reward - mean_reward_first
    latency_ms: OverviewLatency


def _quantiles(expr: str, cond: str, name: str) -> str:
    return (f"quantilesIf(0.5, 0.95)({expr}, {cond}) AS {name}_q, countIf({cond}) AS {name}_n")


def _latency(row: dict, name: str) -> Latency:
    n = int(row[f"{name}_n"])
    q = row[f"{name}_q"] if n else [0.0, 0.0]
    return Latency(p50=float(q[0]), p95=float(q[1]), count=n)


def _rate(n: int, total: int) -> float:
    return n / total if total else 0.0


async def overview(store: TrajectoryStore, f: TrajectoryFilter) -> Overview:
    where, params = f.where()
    sub, _ = _subfilter(f)
    states = ", ".join(f"countIf(final_state = '{s}') AS {s}, countIf(final_state = '{s}' AND NOT infrastructure) "
                       f"AS {s}_policy" for s in FINAL)
    # the first tenth of the window, [start, start + span / 10); an open end is the first/last
    # completed_at (no FINAL needed: a duplicate row has the same time)
    plain = f"{DATABASE}.trajectories{where}"
    start = "{since_ms:Int64}" if f.since is not None else f"(SELECT {_MS}(min(completed_at)) FROM {plain})"
    end = "{until_ms:Int64}" if f.until is not None else f"(SELECT {_MS}(max(completed_at)) FROM {plain})"
    cutoff = f"{start} + greatest(round(({end} - {start}) / 10), 1)"
    row = await _row(store, _joined(
        f"SELECT count() AS rollouts, {states}, countIf(passed) AS n_passed, countIf(infrastructure) AS infra, "
        f"countIf({SCORED}) AS scored, avgIf(reward, {SCORED}) AS mean_reward, "
        f"{_MS}(min(completed_at)) AS first_ms, {_MS}(max(completed_at)) AS last_ms, "
        + ", ".join((_quantiles(f"{_MS}(completed_at) - {_MS}(started_at)", "true", "rollout"),
                     _quantiles("queue_ms", "queue_ms >= 0", "queue"),
                     _quantiles("sandbox_ms", "sandbox_ms >= 0", "sandbox"),
                     _quantiles("verification_ms", "verification_ms >= 0", "verification")))
        + f" FROM {T}{where}",
        f"SELECT {_quantiles('total_ms', 'true', 'llm')} FROM {S}{sub}",
        f"SELECT countIf({SCORED}) AS first_n, avgIf(reward, {SCORED}) AS first_mean "
        f"FROM {T}{_and(where, f'{_MS}(completed_at) < {cutoff}')}"), params)
    rollouts, scored = int(row["rollouts"]), int(row["scored"])
    start_s = f.since if f.since is not None else (row["first_ms"] / 1000 if rollouts else None)
    end_s = f.until if f.until is not None else (row["last_ms"] / 1000 if rollouts else None)
    span = (end_s - start_s) if start_s is not None and end_s is not None else 0.0
    mean = float(row["mean_reward"]) if scored else None
    first = float(row["first_mean"]) if int(row["first_n"]) else None
    by_state = ByState(**{s: int(row[s]) for s in FINAL})
    return Overview(
        since=f.since, until=f.until, rollouts=rollouts,
        rollouts_per_s=rollouts / span if span > 0 else 0.0, by_state=by_state,
        success_rate=_rate(int(row["n_passed"]), rollouts), error_rate=_rate(int(row["failed_policy"]), rollouts),
        timeout_rate=_rate(int(row["timed_out_policy"]), rollouts),
        budget_exhausted_rate=_rate(int(row["budget_exhausted_policy"]), rollouts),
        infrastructure_error_rate=_rate(int(row["infra"]), rollouts),
        mean_reward=mean, mean_reward_first=first,
        reward_change=None if mean is None or first is None else mean - first,
        latency_ms=OverviewLatency(rollout=_latency(row, "rollout"), queue=_latency(row, "queue"),
                                   sandbox=_latency(row, "sandbox"), verification=_latency(row, "verification"),
                                   llm=_latency(row, "llm")),
    )


# --------------------------------------------------------------------------- live


class Live(msgspec.Struct, frozen=True, kw_only=True):
    """Rollouts whose latest transition (in the last 24 h) is not final, by that state."""

    at: float
    pending: int
    provisioning: int
    running: int
    verifying: int


LIVE_WINDOW_S = 86400.0


async def live(store: TrajectoryStore, *, now: float | None = None, project: str | None = None) -> Live:
    """Rollouts by live state (of ``project``, when given)."""
    now = time.time() if now is None else now
    finals = ", ".join(f"'{s}'" for s in FINAL)
    mine = "" if project is None else " AND project = {project:String}"
    lines = await _rows(store, (
        "SELECT state, count() AS n FROM ("
        f"  SELECT argMax(to_state, (at, to_state IN ({finals}))) AS state FROM {DATABASE}.rollout_states "
        f"  WHERE at >= fromUnixTimestamp64Milli(toInt64({{from_ms:Int64}})){mine} GROUP BY rollout_id"
        ") WHERE state NOT IN (" + finals + ") GROUP BY state"),
        {"from_ms": int((now - LIVE_WINDOW_S) * 1000), **({"project": project} if project is not None else {})})
    counts = {r["state"]: int(r["n"]) for r in lines}
    return Live(at=now, **{s: counts.get(s, 0) for s in NON_FINAL})


# --------------------------------------------------------------------------- verification


class Verdicts(msgspec.Struct, frozen=True, kw_only=True):
    """Per final rollout: passed; failed (verified, not passed); infrastructure (no reward);
    unverified (ended without a verification: failed, timed out, cancelled before it)."""

    passed: int
    failed: int
    infrastructure: int
    unverified: int


class TestTotals(msgspec.Struct, frozen=True, kw_only=True):
    """Sums of ``VerificationResult.counts`` (SWE-bench FAIL_TO_PASS / PASS_TO_PASS)."""

    __test__ = False

    f2p_passed: int
    f2p_failed: int
    p2p_passed: int
    p2p_failed: int


class FlagCount(msgspec.Struct, frozen=True, kw_only=True):
    flag: str
    count: int
    rollout_ids: list[str]  # up to 20, the most recently verified first


class ParserCount(msgspec.Struct, frozen=True, kw_only=True):
    parser: str
    count: int


class VerifierLatency(msgspec.Struct, frozen=True, kw_only=True):
    verifier: str
    count: int
    p50: float  # ms, started_at -> finished_at
    p95: float


class VerificationStats(msgspec.Struct, frozen=True, kw_only=True):
    verdicts: Verdicts
    tests: TestTotals
    flags: list[FlagCount]
    parser_failures: int  # verifications flagged ``parse_failed``: no complete test report
    parsers: list[ParserCount]
    latency_ms: list[VerifierLatency]


async def verification(store: TrajectoryStore, f: TrajectoryFilter) -> VerificationStats:
    where, params = f.where()
    sub, _ = _subfilter(f)
    row = await _row(store, _joined(
        "SELECT countIf(passed AND NOT infrastructure) AS n_passed, countIf(infrastructure) AS n_infrastructure, "
        "countIf(NOT verified AND NOT infrastructure) AS n_unverified, "
        f"countIf(verified AND NOT passed AND NOT infrastructure) AS n_failed FROM {T}{where}",
        "SELECT sum(f2p_passed) AS f2p_passed, sum(f2p_failed) AS f2p_failed, sum(p2p_passed) AS p2p_passed, "
        f"sum(p2p_failed) AS p2p_failed, countIf(has(flags, '{PARSE_FAILED}')) AS parser_failures FROM {V}{sub}",
        _collected("SELECT flag, count() AS n, arraySlice(arrayMap(x -> x.2, "
                   "arrayReverseSort(groupArray((finished_at, rollout_id)))), 1, {examples:UInt32}) AS ids "
                   f"FROM {V} ARRAY JOIN flags AS flag{sub} GROUP BY flag", "flag, n, ids", "flag_rows"),
        _collected(f"SELECT parser, count() AS n FROM {V}{_and(sub, HAS_PARSER)} GROUP BY parser",
                   "parser, n", "parser_rows"),
        _collected(f"SELECT verifier, count() AS n, quantiles(0.5, 0.95)({_MS}(finished_at) - {_MS}(started_at)) "
                   f"AS q FROM {V}{sub} GROUP BY verifier", "verifier, n, q", "latency_rows")),
        {**params, "examples": FLAG_EXAMPLES})
    flags = sorted((FlagCount(flag=flag, count=int(n), rollout_ids=ids)
                    for flag, n, ids in map(_fields, row["flag_rows"])), key=lambda r: (-r.count, r.flag))
    parsers = sorted((ParserCount(parser=p, count=int(n)) for p, n in map(_fields, row["parser_rows"])),
                     key=lambda r: (-r.count, r.parser))
    latency = sorted((VerifierLatency(verifier=v, count=int(n), p50=float(q[0]), p95=float(q[1]))
                      for v, n, q in map(_fields, row["latency_rows"])), key=lambda r: r.verifier)
    return VerificationStats(
        verdicts=Verdicts(**{k: int(row[f"n_{k}"]) for k in ("passed", "failed", "infrastructure", "unverified")}),
        tests=TestTotals(**{k: int(row[k]) for k in ("f2p_passed", "f2p_failed", "p2p_passed", "p2p_failed")}),
        flags=flags, parser_failures=int(row["parser_failures"]), parsers=parsers, latency_ms=latency)


# --------------------------------------------------------------------------- tasks


class TaskRow(msgspec.Struct, frozen=True, kw_only=True):
    """One task over its attempts (rollouts with a reward; infrastructure outcomes are none)."""

    task_id: str
    attempts: int
    passed: int
    success_rate: float
    mean_reward: float
    reward_variance: float  # population variance of the rewards
    saturated: bool  # every attempt passed (attempts >= min_attempts)
    never_solved: bool  # no attempt passed (attempts >= min_attempts)
    last_seen: float  # the latest completed_at


class TaskPage(msgspec.Struct, frozen=True, kw_only=True):
    total: int  # tasks with an attempt matching the filters
    rows: list[TaskRow]


TaskOrder = Literal["attempts", "success_rate", "reward_variance", "task_id", "last_seen"]
#: Each order, ties broken by task id: most attempts, hardest, most signal, A-Z, most recent first.
TASK_ORDERS: dict[str, str] = {
    "attempts": "attempts DESC", "success_rate": "success_rate ASC, attempts DESC",
    "reward_variance": "reward_variance DESC", "task_id": "task_id ASC", "last_seen": "last_ms DESC",
}


async def tasks(store: TrajectoryStore, f: TrajectoryFilter, *, limit: int = 100, offset: int = 0,
                order: TaskOrder = "attempts", min_attempts: int = 5) -> TaskPage:
    where, params = f.where()
    where = _and(where, "NOT infrastructure")
    rows = await _rows(store, (
        "SELECT task_id, count() AS attempts, toUInt64(countIf(passed)) AS n_passed, n_passed / attempts AS "
        f"success_rate, ifNotFinite(avgIf(reward, {SCORED}), 0) AS mean_reward, "
        f"ifNotFinite(varPopIf(reward, {SCORED}), 0) AS reward_variance, "
        f"{_MS}(max(completed_at)) AS last_ms, count() OVER () AS total FROM {T}{where} GROUP BY task_id "
        f"ORDER BY {TASK_ORDERS[order]}, task_id LIMIT {{limit:UInt32}} OFFSET {{offset:UInt32}}"),
        {**params, "limit": int(limit), "offset": int(offset)})
    if rows:
        total = int(rows[0]["total"])
    else:
        total = int((await _row(store, f"SELECT uniqExact(task_id) AS n FROM {T}{where}", params))["n"])
    out = []
    for r in rows:
        attempts, passed = int(r["attempts"]), int(r["n_passed"])
        enough = attempts >= min_attempts
        out.append(TaskRow(task_id=r["task_id"], attempts=attempts, passed=passed,
                           success_rate=float(r["success_rate"]), mean_reward=float(r["mean_reward"]),
                           reward_variance=float(r["reward_variance"]), saturated=enough and passed == attempts,
                           never_solved=enough and passed == 0, last_seen=int(r["last_ms"]) / 1000))
    return TaskPage(total=total, rows=out)


# --------------------------------------------------------------------------- token usage


class Bucket(msgspec.Struct, frozen=True, kw_only=True):
    le: float  # values in (le / 2, le]; 0 holds the zeros
    count: int


class TokenDistribution(msgspec.Struct, frozen=True, kw_only=True):
    mean: float
    p50: float
    p95: float
    max: float
    buckets: list[Bucket]


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    mean: float
    p50: float
    p95: float
    max: float


class BackendUsage(msgspec.Struct, frozen=True, kw_only=True):
    backend: str
    steps: int
    completion_tokens: int
    tokens_per_s: float  # sum(completion_tokens) / sum(total_ms) * 1000


class VersionUsage(msgspec.Struct, frozen=True, kw_only=True):
    policy_version: str
    steps: int
    completion_tokens: int
    tokens_per_s: float


class TokenUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Per LLM call (step): token counts; per rollout: turns (steps) and tool calls."""

    prompt_tokens: TokenDistribution
    completion_tokens: TokenDistribution
    steps: int
    truncation_rate: float  # share of steps with finish_reason 'length'
    turns: Summary
    tool_calls: Summary
    by_backend: list[BackendUsage]
    by_policy_version: list[VersionUsage]


def _summary_sql(expr: str, name: str) -> str:
    return (f"ifNotFinite(avg({expr}), 0) AS {name}_mean, "
            f"arrayMap(x -> ifNotFinite(x, 0), quantiles(0.5, 0.95)({expr})) AS {name}_q, "
            f"toFloat64(max({expr})) AS {name}_max")


def _summary(row: dict, name: str) -> Summary:
    q = row[f"{name}_q"] or [0.0, 0.0]
    return Summary(mean=float(row[f"{name}_mean"]), p50=float(q[0]), p95=float(q[1]), max=float(row[f"{name}_max"]))


def _bucket_sql(column: str) -> str:
    """``column``'s power-of-two bucket (0 for 0)."""
    return f"toFloat64(if({column} = 0, 0, exp2(ceil(log2({column})))))"


async def token_usage(store: TrajectoryStore, f: TrajectoryFilter) -> TokenUsage:
    where, params = f.where()
    sub, _ = _subfilter(f)
    # one statement: step totals, step counts by key (one scan), per rollout (columns of trajectories)
    row = await _row(store, _joined(
        f"SELECT count() AS steps, countIf(finish_reason = 'length') AS truncated, "
        f"{_summary_sql('prompt_tokens', 'prompt')}, {_summary_sql('completion_tokens', 'completion')} "
        f"FROM {S}{sub}",
        _collected(f"SELECT backend, policy_version, {_bucket_sql('prompt_tokens')} AS prompt, "
                   f"{_bucket_sql('completion_tokens')} AS completion, count() AS n, "
                   "sum(completion_tokens) AS tokens, sum(total_ms) AS ms, "
                   f"grouping(backend, policy_version, prompt, completion) AS g FROM {S}{sub} "
                   "GROUP BY GROUPING SETS ((backend), (policy_version), (prompt), (completion))",
                   "backend, policy_version, prompt, completion, n, tokens, ms, g", "group_rows"),
        f"SELECT {_summary_sql('num_steps', 'turns')}, {_summary_sql('tool_calls', 'tools')} FROM {T}{where}"),
        params)
    per_rollout = row
    groups = [dict(zip(("backend", "policy_version", "prompt", "completion", "steps", "tokens", "ms", "g"),
                       _fields(r), strict=True)) for r in row["group_rows"]]
    steps = int(row["steps"])
    # grouping(...): a bit per argument, clear when the row is grouped by it (standard SQL; set
    # under ClickHouse's older convention): 0111b or 1000b is by backend
    by = {key: sorted((r for r in groups if int(r["g"]) in (1 << (3 - i), 15 ^ (1 << (3 - i)))), key=lambda r: r[key])
          for i, key in enumerate(("backend", "policy_version", "prompt", "completion"))}

    def dist(name: str) -> TokenDistribution:
        s = _summary(row, name)
        return TokenDistribution(mean=s.mean, p50=s.p50, p95=s.p95, max=s.max,
                                 buckets=[Bucket(le=float(r[name]), count=int(r["steps"])) for r in by[name]])

    def speed(r: dict) -> float:
        return int(r["tokens"]) / (float(r["ms"]) / 1000) if float(r["ms"]) > 0 else 0.0

    return TokenUsage(
        prompt_tokens=dist("prompt"), completion_tokens=dist("completion"), steps=steps,
        truncation_rate=_rate(int(row["truncated"]), steps),
        turns=_summary(per_rollout, "turns"), tool_calls=_summary(per_rollout, "tools"),
        by_backend=[BackendUsage(backend=r["backend"], steps=int(r["steps"]),
                                 completion_tokens=int(r["tokens"]), tokens_per_s=speed(r))
                    for r in by["backend"]],
        by_policy_version=[VersionUsage(policy_version=r["policy_version"], steps=int(r["steps"]),
                                        completion_tokens=int(r["tokens"]), tokens_per_s=speed(r))
                           for r in by["policy_version"]],
    )


# --------------------------------------------------------------------------- training


class RewardPoint(msgspec.Struct, frozen=True, kw_only=True):
    """Rollouts with a reward of one (policy version, task set): a trajectory counts under
    the first policy version that served it; ``task_set`` is its ``metadata["task_set"]``."""

    policy_version: str
    task_set: str
    rollouts: int
    mean_reward: float
    pass_rate: float
    first_completed_at: float


class ZeroVariance(msgspec.Struct, frozen=True, kw_only=True):
    """Complete groups whose rewards (infrastructure outcomes left out) are all equal: no
    GRPO signal. A group counts under its first member's (group_index 0) first policy version."""

    policy_version: str
    groups: int
    zero_variance_groups: int
    rate: float


class TrainerPoint(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    at: float
    policy_version: str
    metrics: dict[str, float]


class TimePoint(msgspec.Struct, frozen=True, kw_only=True):
    """Rollouts with a reward that ended in ``[at, at + width_s)``."""

    at: float
    width_s: float
    rollouts: int
    mean_reward: float


class Training(msgspec.Struct, frozen=True, kw_only=True):
    reward_curve: list[RewardPoint]  # by first_completed_at
    zero_variance: list[ZeroVariance]  # by the first completion of the version's groups
    trainer: list[TrainerPoint]  # the run's stored TrainerMetrics, by step
    run: str | None = None  # the trainer run shown (the latest one unless asked for)
    #: Mean reward over time (up to TIME_BUCKETS even buckets of completed_at), filled only when
    #: no rollout has a policy version (the backends report none): the curve to draw then.
    reward_over_time: list[TimePoint] = []


TIME_BUCKETS = 50


async def reward_over_time(store: TrajectoryStore, where: str, params: dict) -> list[TimePoint]:
    """Mean reward of the rollouts with one, in up to ``TIME_BUCKETS`` even buckets of ``completed_at``."""
    scored = _and(where, SCORED)
    span = await _row(store, f"SELECT count() AS n, {_MS}(min(completed_at)) AS lo, {_MS}(max(completed_at)) AS hi "
                             f"FROM {T}{scored}", params)
    if not int(span["n"]):
        return []
    lo, hi = int(span["lo"]), int(span["hi"])
    width = max(-(-(hi - lo + 1) // TIME_BUCKETS), 1000)  # ms, at least a second
    rows = await _rows(store, (
        f"SELECT intDiv({_MS}(completed_at) - {lo}, {width}) AS bucket, count() AS rollouts, avg(reward) AS mean_reward "
        f"FROM {T}{scored} GROUP BY bucket ORDER BY bucket"), params)
    return [TimePoint(at=(lo + int(r["bucket"]) * width) / 1000, width_s=width / 1000, rollouts=int(r["rollouts"]),
                      mean_reward=float(r["mean_reward"])) for r in rows]


FIRST_VERSION = "if(empty(policy_versions), '', policy_versions[1])"


async def training(store: TrajectoryStore, f: TrajectoryFilter, *, run: str | None = None,
                   trainer_limit: int = 10_000) -> Training:
    where, params = f.where()
    row = await _row(store, _joined(
        _collected(f"SELECT {FIRST_VERSION} AS policy_version, task_set, count() AS rollouts, "
                   f"ifNotFinite(avgIf(reward, {SCORED}), 0) AS mean_reward, avg(passed) AS pass_rate, {_MS}(min(completed_at)) AS first_ms "
                   f"FROM {T}{_and(where, 'NOT infrastructure')} GROUP BY policy_version, task_set",
                   "policy_version, task_set, rollouts, mean_reward, pass_rate, first_ms", "curve"),
        _collected("SELECT policy_version, count() AS groups, countIf(zero) AS zero_groups, min(first_ms) AS first "
                   f"FROM (SELECT group_id, argMin({FIRST_VERSION}, group_index) AS policy_version, "
                   f"countIf({SCORED}) AS scored, "
                   f"minIf(reward, {SCORED}) = maxIf(reward, {SCORED}) AS zero, "
                   f"{_MS}(min(completed_at)) AS first_ms FROM {T}{_and(where, IN_GROUP)} GROUP BY group_id "
                   "HAVING count() >= any(group_size) AND scored > 0) GROUP BY policy_version",
                   "policy_version, groups, zero_groups, first", "zero"),
        f"SELECT groupArray(run) AS latest FROM (SELECT run FROM {DATABASE}.trainer_metrics"
        + ("" if f.project is None else " WHERE project = {project:String}") + " ORDER BY at DESC LIMIT 1)"),
        params)
    curve = sorted(map(_fields, row["curve"]), key=lambda r: (int(r[5]), r[0], r[1]))
    zero = sorted(map(_fields, row["zero"]), key=lambda r: (int(r[3]), r[0]))
    if run is None and row["latest"]:
        run = row["latest"][0]
    trainer = await store.trainer_metrics(run, limit=trainer_limit, project=f.project) if run is not None else []
    over_time = [] if any(version for version, *_ in curve) else await reward_over_time(store, where, params)
    return Training(
        reward_over_time=over_time,
        reward_curve=[RewardPoint(policy_version=version, task_set=task_set, rollouts=int(n), mean_reward=float(mean),
                                  pass_rate=float(rate), first_completed_at=int(first_ms) / 1000)
                      for version, task_set, n, mean, rate, first_ms in curve],
        zero_variance=[ZeroVariance(policy_version=version, groups=int(groups), zero_variance_groups=int(zero_groups),
                                    rate=int(zero_groups) / int(groups))
                       for version, groups, zero_groups, _ in zero],
        trainer=[TrainerPoint(step=m.step, at=m.at, policy_version=m.policy_version, metrics=m.metrics)
                 for m in trainer],
        run=run,
    )


# --------------------------------------------------------------------------- trainer logprobs


class TrainerLogprobs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/trainer-logprobs``: a trainer's own logprob of each token of a
    trajectory's training sequence ``sequence_index`` (aligned with its ``token_ids``; the
    first token, which has no context, and context tokens as the trainer computes them or
    0.0). ``(rollout_id, sequence_index, run)`` is the key: posting again replaces it."""

    run: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    policy_version: Annotated[str, msgspec.Meta(max_length=256)] = ""  # the weights that computed them
    rollout_id: Id
    sequence_index: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]
    logprobs: Annotated[list[Annotated[float, msgspec.Meta(ge=-3e38, le=3e38)]],
                        msgspec.Meta(max_length=MAX_SEQUENCE_TOKENS)]  # finite, and within Float32


class SequenceLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    sequence_index: int
    run: str
    policy_version: str
    logprobs: list[float]  # stored as Float32


class TrajectoryLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    sequences: list[SequenceLogprobs]  # by sequence_index, then run


async def store_trainer_logprobs(store: TrajectoryStore, posted: TrainerLogprobs, project: str | None = None) -> None:
    """Store ``posted`` after checking it against the trajectory: ``NotFound`` for an unknown
    rollout (or one not of ``project``, when given), ``Conflict`` for a sequence it lacks or
    logprobs not one per token."""
    trajectory = await store.trajectory(posted.rollout_id)
    if trajectory is None or (project is not None and trajectory.project != project):
        raise NotFound(f"no trajectory for rollout {posted.rollout_id!r}")
    if posted.sequence_index >= len(trajectory.sequences):
        raise Conflict(f"rollout {posted.rollout_id!r} has {len(trajectory.sequences)} training sequences; "
                             f"no sequence_index {posted.sequence_index}")
    tokens = len(trajectory.sequences[posted.sequence_index].token_ids)
    if len(posted.logprobs) != tokens:
        raise Conflict(f"{len(posted.logprobs)} logprobs for a sequence of {tokens} tokens: one per token")
    await store.insert_trainer_logprobs([trainer_logprobs_row(
        rollout_id=posted.rollout_id, sequence_index=posted.sequence_index, run=posted.run,
        policy_version=posted.policy_version, logprobs=posted.logprobs)])


async def trainer_logprobs(store: TrajectoryStore, rollout_id: str, project: str | None = None) -> TrajectoryLogprobs:
    """The logprobs trainers posted for ``rollout_id`` (none for a rollout not of ``project``, when
    given: its trajectory is not there for the caller, 404 ``not_found``)."""
    if project is not None and await store.project_of(rollout_id) not in (project, None):
        raise NotFound(f"no trajectory for rollout {rollout_id!r}")
    rows = await store.trainer_logprobs(rollout_id)
    return TrajectoryLogprobs(rollout_id=rollout_id, sequences=[
        SequenceLogprobs(sequence_index=int(r["sequence_index"]), run=r["run"], policy_version=r["policy_version"],
                         logprobs=[float(x) for x in r["logprobs"]]) for r in rows])

#: The answers and bodies above, for the API's OpenAPI document.
SCHEMAS = (Overview, Live, VerificationStats, TaskPage, TokenUsage, Training, TrainerLogprobs, TrajectoryLogprobs)
