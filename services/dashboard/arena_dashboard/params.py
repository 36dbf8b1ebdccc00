"""The dashboard's ``/api`` routes as data: each names the trajectory API path it reads and the
query parameters it accepts, each with a validator. Nothing else is forwarded."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import msgspec

from arena_core.errors import InvalidRequest
from arena_core.schemas import RolloutState, valid_id

#: A validator: the raw query value -> the value to forward (a string); raises ``ValueError``.
Validator = Callable[[str], str]

MAX_TIME = 1e10  # unix seconds, as the trajectory API bounds them


def ident(raw: str) -> str:
    if not valid_id(raw):
        raise ValueError("must be an identifier (letters, digits, '-', '_', '.'; at most 128)")
    return raw


def text(max_length: int) -> Validator:
    def check(raw: str) -> str:
        if not 1 <= len(raw) <= max_length or any(ord(c) < 32 for c in raw):
            raise ValueError(f"must be 1 to {max_length} printable characters")
        return raw
    return check


def number(low: float, high: float) -> Validator:
    def check(raw: str) -> str:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("must be a number") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise ValueError(f"must be between {low:g} and {high:g}")
        return repr(value) if value != int(value) else str(int(value))
    return check


def integer(low: int, high: int) -> Validator:
    def check(raw: str) -> str:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError("must be an integer") from None
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return str(value)
    return check


def one_of(*choices: str) -> Validator:
    def check(raw: str) -> str:
        if raw not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return raw
    return check


state = one_of(*(s.value for s in RolloutState))

#: The filters every aggregate and listing of the trajectory API takes.
FILTERS: dict[str, Validator] = {
    "task_id": ident,
    "group_id": ident,
    "state": state,
    "policy_version": text(256),
    "min_reward": number(-1e9, 1e9),
    "max_reward": number(-1e9, 1e9),
    "since": number(0, MAX_TIME),
    "until": number(0, MAX_TIME),
}


class Route(msgspec.Struct, frozen=True):
    """``/api/<name>`` reads ``upstream`` (``{id}`` filled from the path) with ``params``."""

    upstream: str
    params: dict[str, Validator] = {}


ROUTES: dict[str, Route] = {
    "stats/overview": Route("/v1/stats/overview", FILTERS),
    "stats/live": Route("/v1/stats/live", {}),  # no filters: the trajectory API takes none
    "stats/verification": Route("/v1/stats/verification", FILTERS),
    "stats/tasks": Route("/v1/stats/tasks", {
        **FILTERS, "limit": integer(1, 1000), "offset": integer(0, 1_000_000),
        "order": one_of("attempts", "success_rate", "reward_variance", "task_id", "last_seen"),
        "min_attempts": integer(1, 1_000_000)}),
    "stats/token-usage": Route("/v1/stats/token-usage", FILTERS),
    "stats/training": Route("/v1/stats/training", {**FILTERS, "run": text(256)}),
    "trajectories": Route("/v1/trajectories", {
        **FILTERS, "limit": integer(1, 200), "before_completed_at": number(0, MAX_TIME),
        "before_rollout": ident}),
    "trainer-metrics": Route("/v1/trainer-metrics", {"run": text(256), "limit": integer(1, 100_000)}),
    "duels": Route("/v1/duels", {"limit": integer(1, 200)}),
    "leaderboard": Route("/v1/leaderboard", {}),
    "evals": Route("/v1/evals", {"limit": integer(1, 200)}),
}

#: ``/api/<name>/{id}`` routes: the id must be an identifier; the query, as the route's ``params`` allow.
ITEM_ROUTES: dict[str, Route] = {
    "trajectories": Route("/v1/trajectories/{id}"),
    "groups": Route("/v1/groups/{id}"),
    "duels": Route("/v1/duels/{id}"),
    "evals": Route("/v1/evals/{id}", {"version": integer(1, 10_000)}),
}


def clean(route: Route, query: Mapping[str, str] | list[tuple[str, str]]) -> dict[str, str]:
    """The query parameters to forward for ``route``: each known one validated and normalised.
    An unknown, repeated or invalid parameter raises ``InvalidRequest`` naming it."""
    items = list(query.items()) if isinstance(query, Mapping) else list(query)
    out: dict[str, str] = {}
    for name, raw in items:
        check = route.params.get(name)
        if check is None:
            known = ", ".join(sorted(route.params)) or "none"
            raise InvalidRequest(f"unknown query parameter {name[:64]!r} (this route takes: {known})")
        if name in out:
            raise InvalidRequest(f"query parameter {name!r} given twice")
        if raw == "":
            continue  # an empty filter box: no filter
        try:
            out[name] = check(raw)
        except ValueError as exc:
            raise InvalidRequest(f"{name}: {exc}") from None
    return out


def item_path(route: Route, item_id: str) -> str:
    """``route.upstream`` for ``item_id``; ``InvalidRequest`` unless it is an identifier."""
    if not valid_id(item_id):
        raise InvalidRequest("the id must be an identifier (letters, digits, '-', '_', '.'; at most 128)")
    return route.upstream.format(id=item_id)
