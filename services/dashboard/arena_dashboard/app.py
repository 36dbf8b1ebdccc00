"""The dashboard's HTTP side (Starlette): the single-page app, ``/api`` over the trajectory API
(only the routes and parameters of ``params``), ``/events`` (Server-Sent Events from the
``Hub``), sign-in when keys are enforced, ``/healthz`` and ``/readyz``. Errors are
``{"error": {"code", "message"}}``, never a stack trace."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from urllib.parse import parse_qs

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from arena_core.apikeys import SignInRefused
from arena_core.errors import ArenaError, NotFound, Unauthorized, Unavailable
from arena_dashboard import auth, params
from arena_dashboard.fanout import Hub, TooManyStreams
from arena_dashboard.upstream import TrajectoryApi

log = logging.getLogger("arena.dashboard")

STATIC = Path(__file__).parent / "static"
MAX_LOGIN_BODY = 4096


def _json(body, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json",
                    headers={"cache-control": "no-store"})


def _error(exc: ArenaError) -> Response:
    return _json({"error": {"code": exc.code, "message": exc.message}}, exc.status)


def create_app(api: TrajectoryApi, hub: Hub, *, gate: auth.Gate | None = None, liveness=None,
               readiness=None) -> Starlette:
    """``liveness``/``readiness``: async callables answering None or what is wrong (the bus)."""
    gate = gate or auth.Gate(None)

    def key_for(request: Request) -> str | None:
        """The request's key when it may see the dashboard; raises ``Unauthorized`` otherwise."""
        headers = request.scope.get("headers") or []
        key = gate.key_of(headers)
        if not gate.enforced:
            return None
        if not gate.ready():
            raise Unavailable("API keys are not loaded yet; retry shortly")
        if not gate.allows_request(headers):
            raise Unauthorized("sign in: the one-time link `arena up` prints, or a read-only API key (/login)"
                               if not key else "unknown, revoked or expired API key, or one without the read "
                               "scope (in the cookie: a read-only one)")
        return key

    def own_origin(request: Request) -> str:
        return f"{request.url.scheme}://{request.url.netloc}"

    async def index(request: Request) -> Response:
        if gate.enforced:
            if "key" in request.query_params:
                return _login(request, "An API key is never taken from an address (it would stay in the "
                                       "browser's history): open the one-time sign-in link, or use the form.", 400)
            token = request.query_params.get("token")
            if token is not None:
                return await sign_in_with_token(request, token)
            try:
                key_for(request)
            except ArenaError as exc:
                return _login(request, "" if exc.status == 401 else exc.message, exc.status)
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    async def sign_in_with_token(request: Request, token: str) -> Response:
        """``/?token=``: the one-time token used (never again), the read-only session key it
        opens set in the cookie, and the address bar cleared by a redirect."""
        why = auth.cross_site(request.scope.get("headers") or [], own_origin(request), form=False)
        if why is not None:
            return _login(request, f"Sign-in refused: {why}. Open the link yourself.", 403)
        if not gate.ready() or gate.redeem is None:
            return _login(request, "Sign-in links are not available yet; retry shortly.", 503)
        try:
            session = await gate.redeem(token[:200])
        except SignInRefused as exc:
            return _login(request, f"That sign-in link cannot be used: {exc}.", 401)
        for _ in range(100):  # the session key was stored with the token: the key watch brings it
            if gate.signs_in(session):
                break
            await asyncio.sleep(0.05)
        resp = RedirectResponse("/", 303)
        resp.headers["set-cookie"] = auth.set_cookie(session, secure=request.url.scheme == "https")
        return resp

    def _login(request: Request, problem: str, status: int) -> Response:
        note = f'<p class="problem">{problem}</p>' if problem else ""
        return HTMLResponse(auth.LOGIN_PAGE.replace("{problem}", note), status,
                            headers={"cache-control": "no-store"})

    async def login(request: Request) -> Response:
        body = await request.body()
        if len(body) > MAX_LOGIN_BODY:
            return _login(request, "That is not an API key.", 413)
        key = (parse_qs(body.decode("utf-8", "replace")).get("key") or [""])[0].strip()
        if not gate.enforced:
            return RedirectResponse("/", 303)
        why = auth.cross_site(request.scope.get("headers") or [], own_origin(request), form=True)
        if why is not None:
            return _login(request, f"Sign-in refused: {why}.", 403)
        if not (gate.ready() and gate.signs_in(key)):
            return _login(request, "That key is unknown, revoked or expired, or not read-only (the dashboard "
                                   "takes keys with the read scope only).", 401)
        resp = RedirectResponse("/", 303)
        resp.headers["set-cookie"] = auth.set_cookie(key, secure=request.url.scheme == "https")
        return resp

    async def logout(request: Request) -> Response:
        resp = RedirectResponse("/", 303)
        resp.headers["set-cookie"] = auth.clear_cookie()
        return resp

    async def api_list(request: Request) -> Response:
        try:
            key = key_for(request)
            name = request.path_params["name"]
            if "kind" in request.path_params:
                name = f"{name}/{request.path_params['kind']}"
            route = params.ROUTES.get(name)
            if route is None:
                raise NotFound(f"no dashboard route /api/{name[:100]}")
            query = params.clean(route, request.query_params.multi_items())
            body = await api.get_raw(route.upstream, query, browser_key=key)
        except ArenaError as exc:
            return _error(exc)
        return Response(body, media_type="application/json", headers={"cache-control": "no-store"})

    async def api_item(request: Request) -> Response:
        try:
            key = key_for(request)
            route = params.ITEM_ROUTES.get(request.path_params["name"])
            if route is None:
                raise NotFound(f"no dashboard route /api/{request.path_params['name'][:100]}/{{id}}")
            query = params.clean(route, request.query_params.multi_items())
            path = params.item_path(route, request.path_params["item"])
            body = await api.get_raw(path, query, browser_key=key)
        except ArenaError as exc:
            return _error(exc)
        return Response(body, media_type="application/json", headers={"cache-control": "no-store"})

    async def api_rollout(request: Request) -> Response:
        """A rollout page in one answer: its trajectory, the trainer's logprobs where there are
        any, and its group's rewards and advantages (never the group's other trajectories)."""
        try:
            key = key_for(request)
            params.clean(params.Route(""), request.query_params.multi_items())
            rid = request.path_params["item"]
            path = params.item_path(params.ITEM_ROUTES["trajectories"], rid)
            trajectory = await api.get(path, browser_key=key)
        except ArenaError as exc:
            return _error(exc)

        async def optional(upstream: str):
            try:
                return await api.get(upstream, browser_key=key), None
            except ArenaError as exc:
                return None, None if exc.status == 404 else f"{exc.code}: {exc.message}"

        group_id = trajectory.get("group_id")
        (trainer, trainer_problem), (group, group_problem) = await asyncio.gather(
            optional(f"{path}/trainer-logprobs"),
            optional(params.item_path(params.ITEM_ROUTES["groups"], group_id)) if group_id else _none())
        if group is not None:
            group = {k: group.get(k) for k in ("group_id", "task_id", "size", "complete", "rollout_ids", "rewards",
                                               "advantages")}
        return _json({"trajectory": trajectory, "trainer_logprobs": trainer, "group": group,
                      "problems": [p for p in (trainer_problem, group_problem) if p]})

    async def events(request: Request) -> Response:
        try:
            key = key_for(request)
            sub = hub.subscribe(gate.project_of(key))  # the session's project's events only
        except TooManyStreams as exc:
            return _error(Unavailable(str(exc)))
        except ArenaError as exc:
            return _error(exc)

        async def stream():
            try:
                yield b"retry: 3000\n\nevent: hello\ndata: {}\n\n"
                async for frame in sub.frames():
                    if gate.enforced and not gate.allows(key):  # revoked while the stream is open
                        return
                    yield frame
            finally:
                hub.unsubscribe(sub)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})

    async def healthz(request: Request) -> Response:
        problem = await liveness() if liveness else None
        return _json({"status": "ok" if problem is None else "unhealthy", "problem": problem or ""},
                     200 if problem is None else 503)

    async def readyz(request: Request) -> Response:
        problem = await readiness() if readiness else None
        if problem is None and not gate.ready():
            problem = "API keys are not loaded yet"
        if problem is None:
            problem = await api.healthy()
        return _json({"status": "ready" if problem is None else "not ready", "problem": problem or ""},
                     200 if problem is None else 503)

    async def not_found(request: Request, exc) -> Response:
        return _error(NotFound(f"no route {request.url.path[:200]}"))

    async def crashed(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return _json({"error": {"code": "internal", "message": f"the dashboard failed: {type(exc).__name__}"}}, 500)

    async def static_guarded(scope, receive, send) -> None:
        path = scope.get("path", "")
        if gate.enforced and path not in auth.PUBLIC and "/static" + path not in auth.PUBLIC:
            request = Request(scope, receive)
            try:
                key_for(request)
            except ArenaError as exc:
                await _error(exc)(scope, receive, send)
                return
        await static(scope, receive, send)

    static = StaticFiles(directory=STATIC)
    app = Starlette(routes=[
        Route("/", index, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/events", events, methods=["GET"]),
        Route("/api/rollout/{item}", api_rollout, methods=["GET"]),
        Route("/api/stats/{kind}", _stats(api_list), methods=["GET"]),
        Route("/api/{name}/{item}", api_item, methods=["GET"]),
        Route("/api/{name}", api_list, methods=["GET"]),
        Mount("/static", app=static_guarded),
    ], exception_handlers={404: not_found, 405: not_found, Exception: crashed})
    return with_headers(app, SECURITY_HEADERS)


def create_app_without_bus(trajectory_url: str, *, gate: auth.Gate | None = None,
                           transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The dashboard reading the trajectory API at ``trajectory_url`` with no NATS connection
    (tests, benchmarks): the page, ``/api`` and ``/healthz`` answer as in the service;
    ``/events`` streams nothing past its greeting. ``transport``: an in-process one (tests)."""
    return create_app(TrajectoryApi(trajectory_url, transport=transport), Hub(), gate=gate)


#: Everything the page loads is its own (no inline script, nothing from elsewhere), and no
#: other site may frame it.
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                                 b"img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; "
                                 b"form-action 'self'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


def with_headers(app, headers: list[tuple[bytes, bytes]]):
    """``app`` with ``headers`` on every HTTP response."""
    async def wrapped(scope, receive, send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_with(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *headers]}
            await send(message)

        await app(scope, receive, send_with)
    return wrapped


def _stats(handler):
    """``/api/stats/{kind}``: the route named ``stats/<kind>``."""
    async def wrapped(request: Request) -> Response:
        request.path_params["name"] = "stats"
        return await handler(request)
    return wrapped


async def _none():
    return None, None
