"""The trajectory query API: thin routes over ``TrajectoryStore``, msgspec-encoded JSON.

Trajectories, groups, statistics, export pages, row counts and trainer metrics, with shared
filters; errors are ``{"error": {"code", "message"}}``. Routes: docs/trajectory.md (HTTP API).
Every answer is limited to the caller's project (its API key's; an admin key's: every project's;
keys off: everything): another project's trajectory, group, duel, evaluation job or trainer run
is not found (404), and lists, statistics and exports leave it out. docs/projects.md.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from arena_core import apikeys, health, openapi, owners, subjects
from arena_core.bodies import decode_body
from arena_core.bus import Bus
from arena_core.errors import ArenaError, InvalidRequest, NotFound, PayloadTooLarge
from arena_core.grpo import group_advantages
from arena_core.schemas import (
    ID_PATTERN,
    PROJECT_PATTERN,
    ErrorBody,
    ErrorResponse,
    RolloutState,
    TrainerMetrics,
    Trajectory,
    encode,
    valid_id,
)
from arena_trajectory import analytics, assembler, insights
from arena_trajectory import diffs, duels, evals
from arena_trajectory.listing import TrajectoryFilter, TrajectorySummary
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import TABLES

MAX_METRICS_BODY = 1 << 20
MAX_LOGPROBS_BODY = 4 << 20

MAX_LIMIT = 1000
#: The latest time a query may name (unix seconds, year 2286): ClickHouse's DateTime64 range.
MAX_TIME = 1e10
MAX_EXPORT_PAGE = 2000


class ExportPage(msgspec.Struct, frozen=True, kw_only=True):
    """Full trajectories ordered by ``(group_id, rollout_id)``; pass ``next`` back as
    ``after_group``/``after_rollout`` for the following page (``None``: no more)."""

    trajectories: list[Trajectory]
    next: list[str] | None = None
    total: int | None = None  # trajectories matching the filters; on the first page only


def mine(request: Request) -> str | None:
    """The project the caller sees (``None``: every project: keys off, or an admin key)."""
    return owners.listing_project(apikeys.caller(request.scope))


def trajectory_filter(
    request: Request,
    task_id: str | None = Query(None, pattern=ID_PATTERN, max_length=128),
    group_id: str | None = Query(None, pattern=ID_PATTERN, max_length=128),
    state: RolloutState | None = None,
    policy_version: str | None = Query(None, max_length=256),
    min_reward: float | None = Query(None, ge=-1e9, le=1e9),
    max_reward: float | None = Query(None, ge=-1e9, le=1e9),
    since: float | None = Query(None, ge=0, le=MAX_TIME, description="completed_at >= since (unix seconds)"),
    until: float | None = Query(None, ge=0, le=MAX_TIME, description="completed_at < until (unix seconds)"),
) -> TrajectoryFilter:
    for name, value in (("task_id", task_id), ("group_id", group_id)):
        if value is not None and not valid_id(value):
            raise InvalidRequest(f"{name} must match {ID_PATTERN}")
    return TrajectoryFilter(task_id=task_id, group_id=group_id, state=state, policy_version=policy_version,
                            min_reward=min_reward, max_reward=max_reward, since=since, until=until,
                            project=mine(request))


class TrajectoryList(msgspec.Struct, frozen=True, kw_only=True):
    trajectories: list[TrajectorySummary]


class GroupView(msgspec.Struct, frozen=True, kw_only=True):
    """A group as stored so far. ``complete`` is false while members are still running;
    ``rewards``/``advantages`` then cover the stored members only."""

    group_id: str
    task_id: str
    size: int
    complete: bool
    rollout_ids: list[str]
    rewards: list[float | None]  # None: an infrastructure outcome, out of the advantages
    advantages: list[float]
    trajectories: list[Trajectory]


def group_view(group_id: str, trajectories: list[Trajectory]) -> GroupView:
    members = assembler.group_members(trajectories)
    if not members:
        raise NotFound(f"no trajectories in group {group_id!r}")
    rewards = [t.reward for t in members]
    scored = iter(group_advantages([r for r in rewards if r is not None]))
    advantages = [0.0 if r is None else next(scored) for r in rewards]
    return GroupView(
        group_id=group_id,
        task_id=members[0].task_id,
        size=members[0].group_size,
        complete=assembler.complete_group(members) is not None,
        rollout_ids=[t.rollout_id for t in members],
        rewards=rewards,
        advantages=advantages,
        trajectories=members,
    )


def _json(body: Any, status: int = 200) -> Response:
    return Response(content=encode(body), status_code=status, media_type="application/json")


def _error(exc: ArenaError) -> Response:
    return _json(ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message)), exc.status)


def create_app(store: TrajectoryStore, bus: Bus | None = None) -> FastAPI:
    app = FastAPI(title="Arena trajectories", docs_url=None, redoc_url=None, responses=openapi.errors(422, 503))
    openapi.install(app, [Trajectory, TrajectoryList, ExportPage, GroupView, TrainerMetrics, health.Health,
                        *insights.SCHEMAS])
    openapi.install(app, [duels.DuelList, duels.DuelView, duels.Leaderboard, evals.EvalList, evals.EvalReportPost])
    obj = {"type": "object"}

    @app.exception_handler(ArenaError)
    async def on_arena_error(request, exc: ArenaError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return _error(InvalidRequest(problems))

    @app.get("/healthz", responses={200: openapi.answer(health.Health), 503: openapi.answer(health.Health, "unhealthy")})
    async def healthz() -> Response:
        """Liveness: 503 once the bus connection is closed for good (the supervisor restarts us)."""
        problem = health.live(bus) if bus is not None else None
        return _json(health.Health(status="ok" if problem is None else "unhealthy", problem=problem or ""),
                     200 if problem is None else 503)

    @app.get("/readyz", responses={200: openapi.answer(health.Health), 503: openapi.answer(health.Health, "not ready")})
    async def readyz() -> Response:
        """Readiness: the store answers, NATS is connected and the plane's streams exist; else 503."""
        problem = None
        try:
            await asyncio.wait_for(store.ping(), 2.0)
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            problem = f"store unreachable: {type(exc).__name__}"
        if problem is None and bus is not None:
            problem = await health.ready(bus, streams=["ARENA_STEPS", "ARENA_RESULTS", "ARENA_TRAJECTORIES"])
        return _json(health.Health(status="ready" if problem is None else "not ready", problem=problem or ""),
                     200 if problem is None else 503)

    @app.get("/v1/trajectories/{rollout_id}", responses={200: openapi.answer(Trajectory), **openapi.errors(404)})
    async def get_trajectory(request: Request, rollout_id: str = Path(..., pattern=ID_PATTERN, max_length=128)) -> Response:
        trajectory = await store.trajectory(rollout_id)
        if trajectory is None or not owners.sees(trajectory.project, apikeys.caller(request.scope)):
            raise NotFound(f"no trajectory for rollout {rollout_id!r}")
        return _json(await diffs.restored(bus, trajectory))  # a large diff is kept in the object store

    @app.get("/v1/trajectories", responses={200: openapi.answer(TrajectoryList)})
    async def list_trajectories(
        f: TrajectoryFilter = Depends(trajectory_filter),
        limit: int = Query(100, ge=1, le=MAX_LIMIT),
        offset: int = Query(0, ge=0),
        before_completed_at: float | None = Query(None, ge=0, le=MAX_TIME,
                                                  description="keyset: the previous page's last completed_at"),
        before_rollout: str | None = Query(None, pattern=ID_PATTERN, max_length=128,
                                           description="keyset: its rollout_id (only with before_completed_at)"),
    ) -> Response:
        before = (before_completed_at, before_rollout) if before_completed_at is not None else None
        rows = await store.list_trajectories(filter=f, limit=limit, offset=offset, before=before)
        return _json(TrajectoryList(trajectories=rows))

    @app.get("/v1/stats/rewards", responses={200: openapi.answer(obj)})
    async def reward_stats(f: TrajectoryFilter = Depends(trajectory_filter),
                           by: Literal["task", "policy_version"] = "task") -> Response:
        return _json({"by": by, "rows": await analytics.rewards(store, f, by=by)})

    @app.get("/v1/stats/pass-rates", responses={200: openapi.answer(obj)})
    async def pass_rate_stats(f: TrajectoryFilter = Depends(trajectory_filter)) -> Response:
        return _json({"rows": await analytics.pass_rates(store, f)})

    @app.get("/v1/stats/tokens", responses={200: openapi.answer(obj)})
    async def token_stats(f: TrajectoryFilter = Depends(trajectory_filter)) -> Response:
        return _json(await analytics.token_stats(store, f))

    @app.get("/v1/stats/latency", responses={200: openapi.answer(obj)})
    async def latency_stats(f: TrajectoryFilter = Depends(trajectory_filter)) -> Response:
        return _json(await analytics.latency(store, f))

    @app.get("/v1/counts", responses={200: openapi.answer(obj)})
    async def counts(request: Request, table: list[Literal[TABLES]] = Query([]),  # type: ignore[valid-type]
                     final: bool = True) -> Response:
        """Rows per table (of the caller's project's rollouts; every project's for an admin key)."""
        try:
            return _json(await store.count_all(table or TABLES, final=final, project=mine(request)))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    @app.get("/v1/export/trajectories", responses={200: openapi.answer(ExportPage)})
    async def export_trajectories(
        f: TrajectoryFilter = Depends(trajectory_filter),
        after_group: str | None = Query(None, max_length=128),
        after_rollout: str | None = Query(None, max_length=128),
        limit: int = Query(500, ge=1, le=MAX_EXPORT_PAGE),
    ) -> Response:
        # a solo rollout's group is "": one half of the keyset alone means the other is ""
        after = (after_group or "", after_rollout or "") if (after_group, after_rollout) != (None, None) else None
        page = await diffs.restored_all(bus, await store.export_page(f, after=after, limit=limit))
        nxt = [page[-1].group_id or "", page[-1].rollout_id] if len(page) == limit else None
        total = await store.count_filtered(f) if after is None else None
        return _json(ExportPage(trajectories=page, next=nxt, total=total))

    @app.post("/v1/trainer-metrics", status_code=201, openapi_extra=openapi.request_body(TrainerMetrics),
              responses={201: openapi.answer(obj, "stored")})
    async def post_trainer_metrics(request: Request) -> Response:
        """One trainer step's metrics, stored and published live on ``arena.trainer.metrics.{run}``
        for the dashboard (``TrainerMetrics``)."""
        body = await request.body()
        if len(body) > MAX_METRICS_BODY:
            raise InvalidRequest(f"trainer metrics body over {MAX_METRICS_BODY} bytes")
        metrics = decode_body(body, TrainerMetrics, what="trainer metrics")
        project = owners.project_of(apikeys.caller(request.scope))
        await store.insert_trainer_metrics(metrics, project)
        if bus is not None:  # the project in a header: a dashboard of another project never shows them
            await bus.nc.publish(subjects.trainer_metrics(metrics.run), msgspec.json.encode(metrics),
                                 headers={owners.PROJECT_HEADER: project})
        return _json({"stored": True}, 201)

    @app.get("/v1/trainer-metrics", responses={200: openapi.answer(obj)})
    async def get_trainer_metrics(request: Request, run: str = Query(..., min_length=1, max_length=256),
                                  limit: int = Query(10_000, ge=1, le=100_000)) -> Response:
        """A run's steps, as the caller's project posted them."""
        return _json({"run": run, "steps": await store.trainer_metrics(run, limit=limit, project=mine(request))})

    # ----------------------------------------------------------------- dashboard (insights.py)

    @app.get("/v1/stats/overview", responses={200: openapi.answer(insights.Overview)})
    async def overview_stats(f: TrajectoryFilter = Depends(trajectory_filter)) -> Response:
        return _json(await insights.overview(store, f))

    @app.get("/v1/stats/live", responses={200: openapi.answer(insights.Live)})
    async def live_stats(request: Request) -> Response:
        return _json(await insights.live(store, project=mine(request)))

    @app.get("/v1/stats/verification", responses={200: openapi.answer(insights.VerificationStats)})
    async def verification_stats(f: TrajectoryFilter = Depends(trajectory_filter)) -> Response:
        return _json(await insights.verification(store, f))

    @app.get("/v1/stats/tasks", responses={200: openapi.answer(insights.TaskPage)})
    async def task_stats(f: TrajectoryFilter = Depends(trajectory_filter), limit: int = Query(100, ge=1, le=MAX_LIMIT),
                         offset: int = Query(0, ge=0, le=10_000_000), order: insights.TaskOrder = "attempts",
                         min_attempts: int = Query(5, ge=1, le=1_000_000)) -> Response:
        return _json(await insights.tasks(store, f, limit=limit, offset=offset, order=order,
                                          min_attempts=min_attempts))

    @app.get("/v1/stats/token-usage", responses={200: openapi.answer(insights.TokenUsage)})
    async def token_usage_stats(f: TrajectoryFilter = Depends(trajectory_filter)) -> Response:
        return _json(await insights.token_usage(store, f))

    @app.get("/v1/stats/training", responses={200: openapi.answer(insights.Training)})
    async def training_stats(f: TrajectoryFilter = Depends(trajectory_filter),
                             run: str | None = Query(None, min_length=1, max_length=256)) -> Response:
        return _json(await insights.training(store, f, run=run))

    @app.post("/v1/trainer-logprobs", status_code=201, openapi_extra=openapi.request_body(insights.TrainerLogprobs),
              responses={201: openapi.answer(obj, "stored"), **openapi.errors(404, 409, 413)})
    async def post_trainer_logprobs(request: Request) -> Response:
        """A trainer's logprobs of one training sequence of a stored trajectory (409 if they
        do not align with its ``token_ids``; 404 for an unknown rollout)."""
        body = await request.body()
        if len(body) > MAX_LOGPROBS_BODY:
            raise PayloadTooLarge(f"trainer logprobs body over {MAX_LOGPROBS_BODY} bytes")
        posted = decode_body(body, insights.TrainerLogprobs, what="trainer logprobs")
        await insights.store_trainer_logprobs(store, posted, mine(request))
        return _json({"stored": True}, 201)

    @app.get("/v1/trajectories/{rollout_id}/trainer-logprobs",
             responses={200: openapi.answer(insights.TrajectoryLogprobs), **openapi.errors(404)})
    async def get_trainer_logprobs(request: Request,
                                   rollout_id: str = Path(..., pattern=ID_PATTERN, max_length=128)) -> Response:
        return _json(await insights.trainer_logprobs(store, rollout_id, mine(request)))

    # ----------------------------------------------------------------- duels (duels.py)

    @app.get("/v1/duels", responses={200: openapi.answer(duels.DuelList)})
    async def list_duels(request: Request, limit: int = Query(50, ge=1, le=MAX_LIMIT)) -> Response:
        """The latest duels, newest first, each as stored so far."""
        return _json(duels.DuelList(duels=await duels.duels(store, limit=limit, project=mine(request))))

    @app.get("/v1/duels/{duel_id}", responses={200: openapi.answer(duels.DuelView), **openapi.errors(404)})
    async def get_duel(request: Request, duel_id: str = Path(..., pattern=ID_PATTERN, max_length=128)) -> Response:
        found = await duels.duel(store, duel_id, mine(request))
        if found is None:
            raise NotFound(f"no trajectories of duel {duel_id!r}")
        return _json(found)

    @app.get("/v1/leaderboard", responses={200: openapi.answer(duels.Leaderboard)})
    async def leaderboard(request: Request) -> Response:
        """Bradley–Terry ratings (Elo scale, 95% bootstrap intervals) over every decided round
        (of the caller's project's duels)."""
        return _json(await duels.leaderboard(store, mine(request)))

    # ----------------------------------------------------------------- evaluations (evals.py)

    @app.post("/v1/evals", status_code=201, openapi_extra=openapi.request_body(evals.EvalReportPost),
              responses={201: openapi.answer(obj, "stored"), **openapi.errors(403, 413, 422)})
    async def post_eval_report(request: Request) -> Response:
        """An ``arena eval`` report (its ``report.json``), kept for the dashboard by job and grading
        version, as the caller's project's job (job ids are per project). A job of the project that
        another key posted is refused (403) unless the caller is an admin key."""
        body = await request.body()
        if len(body) > evals.MAX_REPORT_BODY:
            raise PayloadTooLarge(f"evaluation report body over {evals.MAX_REPORT_BODY} bytes")
        job_id, version = await evals.store_report(store, body, apikeys.caller(request.scope))
        return _json({"stored": True, "job_id": job_id, "version": version}, 201)

    @app.get("/v1/evals", responses={200: openapi.answer(evals.EvalList)})
    async def list_evals(request: Request, limit: int = Query(50, ge=1, le=MAX_LIMIT)) -> Response:
        """Evaluation jobs (the caller's project's), newest first, with their latest version's headline figures."""
        return _json(await evals.list_jobs(store, limit=limit, project=mine(request)))

    @app.get("/v1/evals/{job_id}", responses={200: openapi.answer(obj), **openapi.errors(404)})
    async def get_eval(request: Request, job_id: str = Path(..., pattern=ID_PATTERN, max_length=128),
                       version: int | None = Query(None, ge=1, le=10_000),
                       project: str | None = Query(None, pattern=PROJECT_PATTERN, description=(
                           "another project's job (an admin key's only; docs/projects.md)"))) -> Response:
        """The caller's project's job's report of ``version`` (default its latest) as posted, with the
        versions it has; an admin key may name another project with ``?project=``."""
        project = owners.named_in(apikeys.caller(request.scope), project)
        if project is None:  # a project this key does not see: as for an unknown job
            raise NotFound(f"no evaluation job {job_id!r} (`arena eval report` stores its report here)")
        return Response(content=await evals.job_report(store, job_id, version, project),
                        media_type="application/json")

    @app.get("/v1/groups/{group_id}", responses={200: openapi.answer(GroupView), **openapi.errors(404)})
    async def get_group(request: Request, group_id: str = Path(..., pattern=ID_PATTERN, max_length=128)) -> Response:
        caller = apikeys.caller(request.scope)
        members = [t for t in await store.group(group_id) if owners.sees(t.project, caller)]
        return _json(group_view(group_id, await diffs.restored_all(bus, members)))

    return app
