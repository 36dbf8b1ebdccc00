"""The trajectory query API: thin routes over ``TrajectoryStore``, msgspec-encoded JSON.

- ``GET /healthz``
- ``GET /v1/trajectories/{rollout_id}``               -> ``Trajectory``
- ``GET /v1/trajectories?task_id=&group_id=&state=&limit=`` -> ``{"trajectories": [TrajectorySummary]}``
- ``GET /v1/groups/{group_id}``                       -> ``GroupView``

Errors are ``{"error": {"code", "message"}}`` like every Arena API.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI, Query
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from arena.errors import ArenaError, InvalidRequest, NotFound
from arena.grpo import group_advantages
from arena.schemas import ErrorBody, ErrorResponse, RolloutState, Trajectory, encode
from arena_trajectory import assembler
from arena_trajectory.store import TrajectoryStore, TrajectorySummary

MAX_LIMIT = 1000


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
    rewards: list[float]
    advantages: list[float]
    trajectories: list[Trajectory]


def group_view(group_id: str, trajectories: list[Trajectory]) -> GroupView:
    members = assembler.group_members(trajectories)
    if not members:
        raise NotFound(f"no trajectories in group {group_id!r}")
    rewards = [t.reward for t in members]
    return GroupView(
        group_id=group_id,
        task_id=members[0].task_id,
        size=members[0].group_size,
        complete=assembler.complete_group(members) is not None,
        rollout_ids=[t.rollout_id for t in members],
        rewards=rewards,
        advantages=group_advantages(rewards),
        trajectories=members,
    )


def _json(body: Any, status: int = 200) -> Response:
    return Response(content=encode(body), status_code=status, media_type="application/json")


def _error(exc: ArenaError) -> Response:
    return _json(ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message)), exc.status)


def create_app(store: TrajectoryStore) -> FastAPI:
    app = FastAPI(title="Arena trajectories", docs_url=None, redoc_url=None)

    @app.exception_handler(ArenaError)
    async def on_arena_error(request, exc: ArenaError) -> Response:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return _error(InvalidRequest(problems))

    @app.get("/healthz")
    async def healthz() -> Response:
        await store.ping()
        return _json({"status": "ok"})

    @app.get("/v1/trajectories/{rollout_id}")
    async def get_trajectory(rollout_id: str) -> Response:
        trajectory = await store.trajectory(rollout_id)
        if trajectory is None:
            raise NotFound(f"no trajectory for rollout {rollout_id!r}")
        return _json(trajectory)

    @app.get("/v1/trajectories")
    async def list_trajectories(
        task_id: str | None = None,
        group_id: str | None = None,
        state: RolloutState | None = None,
        limit: int = Query(100, ge=1, le=MAX_LIMIT),
    ) -> Response:
        rows = await store.list_trajectories(task_id=task_id, group_id=group_id, state=state, limit=limit)
        return _json(TrajectoryList(trajectories=rows))

    @app.get("/v1/groups/{group_id}")
    async def get_group(group_id: str) -> Response:
        return _json(group_view(group_id, await store.group(group_id)))

    return app
