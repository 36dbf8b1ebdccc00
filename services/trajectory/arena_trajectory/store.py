"""Trajectory storage in ClickHouse: embedded chDB or a ClickHouse server, same SQL for both.

Batch inserts and batch reads; values never go into SQL text. Tables and rows are in
``arena_trajectory.tables``, analytics in ``arena_trajectory.analytics``. See docs/trajectory.md (Storage).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

from arena_core.schemas import (
    DEFAULT_PROJECT,
    TrainerMetrics,
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    StateTransition,
    Step,
    Trajectory,
    VerificationResult,
)
from arena_core.sequences import with_sequences
from arena_core.settings import Settings
from arena_trajectory.caches import StoredStep
from arena_trajectory.clickhouse import Backend, ChdbBackend, ClickHouseConnectBackend, Param
from arena_trajectory.listing import SUMMARY_COLUMNS, TrajectoryFilter, TrajectorySummary, summary_decoder
from arena_trajectory.tables import (  # noqa: F401 - re-exported
    DATABASE,
    DDL,
    MIGRATIONS,
    STEP_COLUMNS,
    STEP_FORMAT,
    TABLES,
    TUNING,
    group_row,
    rows_bytes,
    sandbox_row,
    state_row,
    step_row,
    trainer_logprobs_row,
    trainer_metrics_row,
    trajectory_row,
    verification_row,
)

log = logging.getLogger("arena.trajectory.store")


class _KeyedBody(msgspec.Struct):
    key: str
    body: str


class _TrajectoryRow(msgspec.Struct):
    body: str
    step_indexes: list[int] = []


class _State(msgspec.Struct, kw_only=True):
    rollout_id: str
    from_state: str
    to_state: RolloutState
    at_ms: int
    reason: str


_keyed_decoder = msgspec.json.Decoder(_KeyedBody)
_trajectory_row_decoder = msgspec.json.Decoder(_TrajectoryRow, strict=False)
_state_decoder = msgspec.json.Decoder(_State, strict=False)
_step_decoder = msgspec.json.Decoder(Step)
_sandbox_decoder = msgspec.json.Decoder(SandboxDone)
_verification_decoder = msgspec.json.Decoder(VerificationResult)
_trainer_metrics_decoder = msgspec.json.Decoder(TrainerMetrics)
_trajectory_decoder = msgspec.json.Decoder(Trajectory)

def _lines(data: bytes) -> list[bytes]:
    return [line for line in data.split(b"\n") if line]


class TrajectoryStore:
    """Async facade over a ``Backend``: typed batch inserts and queries, run in a thread."""

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
        """Create the database and tables, add newer columns and tune storage. Idempotent."""
        for sql in DDL + MIGRATIONS:
            await asyncio.to_thread(self.backend.execute, sql)
        for sql in TUNING:
            try:
                await asyncio.to_thread(self.backend.execute, sql)
            except Exception as exc:  # noqa: BLE001 - each driver raises its own type; defaults stay
                log.warning("storage tuning not applied (%s): %s", sql, str(exc).splitlines()[0][:300])

    async def close(self) -> None:
        await asyncio.to_thread(self.backend.close)

    async def ping(self) -> None:
        await self.select("SELECT 1 AS ok")

    # ----------------------------------------------------------------- inserts

    async def _insert(self, table: str, rows: Sequence[dict | msgspec.Struct]) -> None:
        if rows:
            await asyncio.to_thread(self.backend.insert, f"{DATABASE}.{table}", rows_bytes(rows))

    async def insert_step(self, step: Step) -> None:
        await self.insert_steps([step])

    async def insert_steps(self, steps: Sequence[Step]) -> None:
        await self.insert_step_rows([step_row(s) for s in steps])

    async def insert_stored_steps(self, steps: Sequence[StoredStep]) -> None:
        """Store steps with the JSON they arrived as for ``body`` (not encoded again)."""
        await self.insert_step_rows([step_row(s.step, body=s.raw) for s in steps])

    async def insert_step_rows(self, rows: Sequence[bytes]) -> None:
        """Rows made by ``tables.step_row`` (``RowBinary``)."""
        if rows:
            await asyncio.to_thread(self.backend.insert, f"{DATABASE}.steps", b"".join(rows), fmt=STEP_FORMAT,
                                    columns=STEP_COLUMNS)

    async def insert_sandbox_result(self, done: SandboxDone) -> None:
        await self.insert_sandbox_results([done])

    async def insert_sandbox_results(self, results: Sequence[SandboxDone]) -> None:
        await self._insert("sandbox_results", [sandbox_row(d) for d in results])

    async def insert_verification(self, result: VerificationResult) -> None:
        await self.insert_verifications([result])

    async def insert_verifications(self, results: Sequence[VerificationResult]) -> None:
        await self._insert("verifications", [verification_row(r) for r in results])

    async def insert_states(self, events: Sequence[RolloutStateChanged]) -> None:
        await self._insert("rollout_states", [state_row(e) for e in events])

    async def insert_trajectory(self, trajectory: Trajectory) -> None:
        await self.insert_trajectories([trajectory])

    async def insert_trajectories(self, trajectories: Sequence[Trajectory], *, steps_stored: bool = False) -> None:
        """Store trajectories. Their steps are kept in ``steps`` only (see ``tables``):
        unless ``steps_stored`` says they came from there, they are written there too."""
        if not steps_stored:
            await self.insert_steps([s for t in trajectories for s in t.steps])
        await self._insert("trajectories", [trajectory_row(t) for t in trajectories])

    async def insert_trainer_metrics(self, metrics: TrainerMetrics, project: str = DEFAULT_PROJECT) -> None:
        await self._insert("trainer_metrics", [trainer_metrics_row(metrics, project)])

    async def trainer_metrics(self, run: str, *, limit: int = 10_000, project: str | None = None) -> list[TrainerMetrics]:
        """A trainer run's metrics by step (a re-posted step shows once, its latest); with
        ``project``, the steps that project posted only."""
        mine = "" if project is None else " AND project = {project:String}"
        lines = await self.select(
            f"SELECT body FROM {DATABASE}.trainer_metrics FINAL WHERE run = {{run:String}}{mine} "
            "ORDER BY step LIMIT {limit:UInt32}", {"run": run, "limit": limit,
                                                   **({"project": project} if project is not None else {})})
        return [_trainer_metrics_decoder.decode(msgspec.json.decode(line)["body"]) for line in lines]

    async def insert_trainer_logprobs(self, rows: Sequence[dict]) -> None:
        """Rows from ``tables.trainer_logprobs_row``: ``(rollout_id, sequence_index, run)``
        is the key, posting one again replaces it."""
        await self._insert("trainer_logprobs", rows)

    async def trainer_logprobs(self, rollout_id: str, *, limit: int = 1000) -> list[dict]:
        """A rollout's trainer logprobs, by sequence then run: ``{sequence_index, run,
        policy_version, logprobs}`` each."""
        lines = await self.select(
            f"SELECT sequence_index, run, policy_version, logprobs FROM {DATABASE}.trainer_logprobs FINAL "
            "WHERE rollout_id = {rid:String} ORDER BY sequence_index, run LIMIT {limit:UInt32}",
            {"rid": rollout_id, "limit": int(limit)})
        return [msgspec.json.decode(line) for line in lines]

    async def insert_groups(self, rows: Sequence[dict]) -> None:
        """Rows from ``tables.group_row``: which groups were published, partial or not."""
        await self._insert("groups", rows)

    # ----------------------------------------------------------------- queries

    async def select(self, sql: str, params: Mapping[str, Param] | None = None) -> list[bytes]:
        """Raw JSONEachRow lines of ``sql`` (bound ``{name:Type}`` parameters)."""
        return _lines(await asyncio.to_thread(self.backend.select, sql, dict(params or {})))

    _select = select  # the name tests and older callers use

    async def _keyed(self, sql: str, params: Mapping[str, Param]) -> list[tuple[str, str]]:
        out = []
        for line in await self.select(sql, params):
            row = _keyed_decoder.decode(line)
            out.append((row.key, row.body))
        return out

    async def steps_for(self, rollout_id: str) -> list[Step]:
        """The rollout's stored steps, by ``step_index``, one per index."""
        return (await self.steps_for_many([rollout_id])).get(rollout_id, [])

    async def steps_for_many(self, rollout_ids: Sequence[str]) -> dict[str, list[Step]]:
        """Stored steps of each rollout, by ``step_index`` (rollouts without steps absent)."""
        return {rid: [s.step for s in got] for rid, got in (await self.stored_steps_many(rollout_ids)).items()}

    async def stored_steps_many(self, rollout_ids: Sequence[str]) -> dict[str, list[StoredStep]]:
        """``steps_for_many`` with each step's stored JSON beside it."""
        out: dict[str, list[StoredStep]] = defaultdict(list)
        if rollout_ids:
            rows = await self._keyed(
                f"SELECT rollout_id AS key, body FROM {DATABASE}.steps FINAL "
                "WHERE rollout_id IN {rids:Array(String)} ORDER BY rollout_id, step_index",
                {"rids": list(rollout_ids)},
            )
            for rid, body in rows:
                raw = body.encode()
                out[rid].append(StoredStep(_step_decoder.decode(raw), raw))
        return dict(out)

    async def step_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        """How many distinct steps of each rollout are stored (no bodies read)."""
        if not rollout_ids:
            return {}
        lines = await self.select(
            f"SELECT rollout_id AS key, uniqExact(step_index) AS n FROM {DATABASE}.steps "
            "WHERE rollout_id IN {rids:Array(String)} GROUP BY rollout_id",
            {"rids": list(rollout_ids)},
        )
        return {row["key"]: int(row["n"]) for row in map(msgspec.json.decode, lines)}

    async def sandbox_result(self, rollout_id: str) -> SandboxDone | None:
        return (await self.sandbox_results_many([rollout_id])).get(rollout_id)

    async def sandbox_results_many(self, rollout_ids: Sequence[str]) -> dict[str, SandboxDone]:
        if not rollout_ids:
            return {}
        rows = await self._keyed(
            f"SELECT rollout_id AS key, body FROM {DATABASE}.sandbox_results FINAL "
            "WHERE rollout_id IN {rids:Array(String)} ORDER BY rollout_id, finished_at",
            {"rids": list(rollout_ids)},
        )
        return {rid: _sandbox_decoder.decode(body) for rid, body in rows}  # the latest wins

    async def verification(self, rollout_id: str) -> VerificationResult | None:
        """The rollout's latest verification (by ``finished_at``) if any."""
        return (await self.verifications_many([rollout_id])).get(rollout_id)

    async def verifications_many(self, rollout_ids: Sequence[str]) -> dict[str, VerificationResult]:
        if not rollout_ids:
            return {}
        rows = await self._keyed(
            f"SELECT rollout_id AS key, body FROM {DATABASE}.verifications FINAL "
            "WHERE rollout_id IN {rids:Array(String)} ORDER BY rollout_id, finished_at",
            {"rids": list(rollout_ids)},
        )
        return {rid: _verification_decoder.decode(body) for rid, body in rows}  # the latest wins

    async def histories_many(self, rollout_ids: Sequence[str]) -> dict[str, list[StateTransition]]:
        """Stored state transitions of each rollout, oldest first."""
        out: dict[str, list[StateTransition]] = defaultdict(list)
        if rollout_ids:
            lines = await self.select(
                f"SELECT rollout_id, from_state, to_state, toUnixTimestamp64Milli(at) AS at_ms, reason "
                f"FROM {DATABASE}.rollout_states FINAL WHERE rollout_id IN {{rids:Array(String)}} "
                "ORDER BY rollout_id, at",
                {"rids": list(rollout_ids)},
            )
            for line in lines:
                s = _state_decoder.decode(line)
                out[s.rollout_id].append(StateTransition(
                    from_state=RolloutState(s.from_state) if s.from_state else None, to_state=s.to_state,
                    at=s.at_ms / 1000, reason=s.reason))
        return dict(out)

    async def _trajectories(self, sql: str, params: Mapping[str, Param]) -> list[Trajectory]:
        """Trajectories from ``SELECT body, step_indexes ...`` rows, their steps joined back
        and their training sequences assembled from them (the body leaves both out)."""
        rows = [_trajectory_row_decoder.decode(line) for line in await self.select(sql, params)]
        out = [(_trajectory_decoder.decode(r.body), r.step_indexes) for r in rows]
        need = [t.rollout_id for t, indexes in out if indexes and not t.steps]
        steps = await self.steps_for_many(need) if need else {}
        result = []
        for t, indexes in out:
            if indexes and not t.steps:  # rows written before step_indexes carry their steps in the body
                wanted = set(indexes)
                t = msgspec.structs.replace(t, steps=[s for s in steps.get(t.rollout_id, []) if s.step_index in wanted])
            result.append(with_sequences(t) if t.steps else t)
        return result

    async def trajectory(self, rollout_id: str) -> Trajectory | None:
        return (await self.trajectories_many([rollout_id])).get(rollout_id)

    async def trajectories_many(self, rollout_ids: Sequence[str]) -> dict[str, Trajectory]:
        if not rollout_ids:
            return {}
        found = await self._trajectories(
            f"SELECT body, step_indexes FROM {DATABASE}.trajectories FINAL WHERE rollout_id IN {{rids:Array(String)}}",
            {"rids": list(rollout_ids)},
        )
        return {t.rollout_id: t for t in found}

    async def project_of(self, rollout_id: str) -> str | None:
        """The project of ``rollout_id``'s stored trajectory (None: none stored)."""
        lines = await self.select(f"SELECT project FROM {DATABASE}.trajectories FINAL WHERE rollout_id = {{rid:String}} "
                                  "LIMIT 1", {"rid": rollout_id})
        return msgspec.json.decode(lines[0])["project"] if lines else None

    async def stored_rollouts(self, rollout_ids: Sequence[str]) -> set[str]:
        """Which of ``rollout_ids`` have a stored trajectory (no bodies read)."""
        if not rollout_ids:
            return set()
        lines = await self.select(
            f"SELECT rollout_id AS key FROM {DATABASE}.trajectories FINAL WHERE rollout_id IN {{rids:Array(String)}}",
            {"rids": list(rollout_ids)},
        )
        return {msgspec.json.decode(line)["key"] for line in lines}

    async def group(self, group_id: str) -> list[Trajectory]:
        """The stored trajectories of a group, by ``group_index``."""
        return (await self.groups_many([group_id])).get(group_id, [])

    async def groups_many(self, group_ids: Sequence[str]) -> dict[str, list[Trajectory]]:
        out: dict[str, list[Trajectory]] = defaultdict(list)
        if group_ids:
            found = await self._trajectories(
                f"SELECT body, step_indexes FROM {DATABASE}.trajectories FINAL "
                "WHERE group_id IN {gids:Array(String)} ORDER BY group_id, group_index, rollout_id",
                {"gids": list(group_ids)},
            )
            for t in found:
                out[t.group_id or ""].append(t)
        return dict(out)

    async def whole_groups(self, group_ids: Sequence[str]) -> set[str]:
        """Which of ``group_ids`` have a stored trajectory for every member (no bodies read)."""
        if not group_ids:
            return set()
        lines = await self.select(
            f"SELECT group_id AS key FROM {DATABASE}.trajectories FINAL WHERE group_id IN {{gids:Array(String)}} "
            "GROUP BY group_id HAVING uniqExact(group_index) >= any(group_size)",
            {"gids": list(group_ids)},
        )
        return {msgspec.json.decode(line)["key"] for line in lines}

    async def published_groups(self, group_ids: Sequence[str]) -> set[str]:
        """Which of ``group_ids`` already have a group message recorded."""
        if not group_ids:
            return set()
        lines = await self.select(
            f"SELECT group_id AS key FROM {DATABASE}.groups FINAL WHERE group_id IN {{gids:Array(String)}}",
            {"gids": list(group_ids)},
        )
        return {msgspec.json.decode(line)["key"] for line in lines}

    async def overdue_groups(self, *, older_than: float, limit: int = 100, window: float = 7 * 86400) -> list[str]:
        """Groups with a stored member but no group message whose first member was stored
        before ``older_than`` (unix seconds): candidates for a partial group. Only members
        stored within ``window`` seconds before that are scanned."""
        lines = await self.select(
            f"SELECT group_id FROM {DATABASE}.trajectories FINAL WHERE group_id != '' "
            "AND stored_at > fromUnixTimestamp64Milli(toInt64({from_ms:Int64})) "
            f"AND group_id NOT IN (SELECT group_id FROM {DATABASE}.groups FINAL) "
            "GROUP BY group_id HAVING min(stored_at) < fromUnixTimestamp64Milli(toInt64({before_ms:Int64})) "
            "ORDER BY group_id LIMIT {limit:UInt32}",
            {"before_ms": int(older_than * 1000), "from_ms": int((older_than - window) * 1000), "limit": int(limit)},
        )
        return [msgspec.json.decode(line)["group_id"] for line in lines]

    async def list_trajectories(
        self,
        *,
        task_id: str | None = None,
        group_id: str | None = None,
        state: RolloutState | str | None = None,
        limit: int = 100,
        offset: int = 0,
        filter: TrajectoryFilter | None = None,  # noqa: A002 - the natural name
        before: tuple[float, str | None] | None = None,
    ) -> list[TrajectorySummary]:
        """Summaries, newest first (``completed_at DESC, rollout_id``). ``filter`` adds to
        the keyword filters. ``before``: the keyset ``(completed_at, rollout_id)`` of the
        last row of the previous page; the page starts after it (without a rollout id:
        strictly older than ``completed_at``), so deep pages need no large ``OFFSET``."""
        base = filter or TrajectoryFilter()
        f = msgspec.structs.replace(
            base,
            task_id=task_id if task_id is not None else base.task_id,
            group_id=group_id if group_id is not None else base.group_id,
            state=RolloutState(state) if state is not None else base.state,
        )
        where, params = f.where()
        if before is not None:
            at_ms, rid = round(before[0] * 1000), before[1]
            older = "completed_at < fromUnixTimestamp64Milli(toInt64({before_ms:Int64}))"
            if rid is not None:
                older = (f"({older} OR (completed_at = fromUnixTimestamp64Milli(toInt64({{before_ms:Int64}})) "
                         "AND rollout_id > {before_rollout:String}))")
                params["before_rollout"] = rid
            params["before_ms"] = at_ms
            where += (" AND " if where else " WHERE ") + older
        params.update(limit=int(limit), offset=int(offset))
        sql = (
            f"SELECT {SUMMARY_COLUMNS} FROM {DATABASE}.trajectories FINAL{where}"
            " ORDER BY completed_at DESC, rollout_id LIMIT {limit:UInt32} OFFSET {offset:UInt32}"
        )
        summaries = [summary_decoder.decode(line).summary() for line in await self.select(sql, params)]
        return await self._with_reasons_and_flags(summaries)

    async def _with_reasons_and_flags(self, summaries: list[TrajectorySummary]) -> list[TrajectorySummary]:
        """The summaries with why each ended (its final transition's reason, from ``rollout_states``)
        and its verification flags: two look-ups by the page's rollout ids (the tables' keys)."""
        if not summaries:
            return summaries
        ids = {"ids": [t.rollout_id for t in summaries]}
        finals = ", ".join(f"'{s.value}'" for s in RolloutState if s.is_final)
        reasons = {row["rollout_id"]: row["reason"] for row in map(msgspec.json.decode, await self.select(
            f"SELECT rollout_id, argMax(reason, at) AS reason FROM {DATABASE}.rollout_states "
            f"WHERE rollout_id IN {{ids:Array(String)}} AND to_state IN ({finals}) GROUP BY rollout_id", ids))}
        flags = {row["rollout_id"]: sorted(row["flags"]) for row in map(msgspec.json.decode, await self.select(
            f"SELECT rollout_id, groupUniqArrayArray(flags) AS flags FROM {DATABASE}.verifications FINAL "
            "WHERE rollout_id IN {ids:Array(String)} GROUP BY rollout_id", ids))}
        return [msgspec.structs.replace(t, reason=reasons.get(t.rollout_id, ""), flags=flags.get(t.rollout_id, []))
                for t in summaries]

    async def export_page(self, f: TrajectoryFilter, *, after: tuple[str, str] | None, limit: int
                          ) -> list[Trajectory]:
        """Full trajectories ordered by ``(group_id, rollout_id)`` after the keyset ``after``:
        members of a group come together, so exports can page without splitting groups."""
        where, params = f.where()
        if after is not None:
            where += (" AND " if where else " WHERE ") + "(group_id, rollout_id) > ({ag:String}, {ar:String})"
            params.update(ag=after[0], ar=after[1])
        params["limit"] = int(limit)
        return await self._trajectories(
            f"SELECT body, step_indexes FROM {DATABASE}.trajectories FINAL{where} ORDER BY group_id, rollout_id "
            "LIMIT {limit:UInt32}", params)

    async def count_filtered(self, f: TrajectoryFilter) -> int:
        """Trajectories matching ``f``."""
        where, params = f.where()
        rows = await self.select(f"SELECT count() AS n FROM {DATABASE}.trajectories FINAL{where}", params)
        return int(msgspec.json.decode(rows[0])["n"])

    async def count_all(self, tables: Sequence[str] = TABLES, *, final: bool = True,
                        project: str | None = None) -> dict[str, int]:
        """Rows in each of ``tables`` (default: all) as queries see them (``FINAL``), in one
        statement; with ``final=False`` the rows stored, duplicates included: an upper bound
        read from the parts' metadata, cheap enough to poll. With ``project``, the rows of that
        project's rollouts only (its rollouts are those of its ``rollout_states`` rows)."""
        unknown = [t for t in tables if t not in TABLES]
        if unknown or not tables:
            raise ValueError(f"unknown tables {unknown}: choose from {', '.join(TABLES)}")
        mode = " FINAL" if final else ""
        params: dict[str, Param] = {}
        where = dict.fromkeys(tables, "")
        if project is not None:
            params["project"] = project
            rollouts = f"rollout_id IN (SELECT rollout_id FROM {DATABASE}.rollout_states WHERE project = {{project:String}})"
            where = {t: f" WHERE {rollouts}" for t in tables}
            where.update({t: " WHERE project = {project:String}" for t in ("trajectories", "rollout_states")
                          if t in tables})
            if "groups" in tables:
                where["groups"] = (f" WHERE group_id IN (SELECT group_id FROM {DATABASE}.trajectories "
                                   "WHERE project = {project:String})")
        sql = "SELECT " + ", ".join(f"(SELECT count() FROM {DATABASE}.{t}{mode}{where[t]}) AS {t}" for t in tables)
        row = msgspec.json.decode((await self.select(sql, params))[0])
        return {t: int(row[t]) for t in tables}

    async def count_rows(self, table: str, *, rollout_id: str | None = None, final: bool = True) -> int:
        """Rows in ``table`` (as queries see them with ``final``; physical rows without)."""
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}")
        sql = f"SELECT count() AS n FROM {DATABASE}.{table}" + (" FINAL" if final else "")
        params: dict[str, Param] = {}
        if rollout_id is not None:
            sql += " WHERE rollout_id = {rid:String}"
            params["rid"] = rollout_id
        rows = await self.select(sql, params)
        return int(msgspec.json.decode(rows[0])["n"])
