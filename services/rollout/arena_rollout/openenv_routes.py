"""HTTP and WebSocket routes of the environments: ``/v1/environments`` (register, list, read,
delete) and OpenEnv's server at ``/openenv/{name}`` (``/ws``, ``/health``, ``/metadata``,
``/schema``, ``/openapi.json``, ``/mcp`` and the stateless ``/reset``, ``/step``, ``/state``).
Thin: the protocol is :mod:`arena_rollout.openenv`. docs/openenv.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from fastapi import FastAPI, Path, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from arena_core import apikeys, envtools, openapi, owners
from arena_core.errors import ArenaError, NotFound
from arena_core.schemas import ID_PATTERN, PROJECT_PATTERN, EnvironmentRequest, EnvironmentView

from arena_rollout import openenv
from arena_rollout.environments import Environments, storage_key, view

log = logging.getLogger("arena.rollout.openenv")


def _json(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


class _Unprocessable(Exception):
    def __init__(self, detail: list[dict]):
        self.detail = detail


async def _body_object(request: Request, read_body, limit: int, *, empty_ok: bool) -> dict:
    """The body as a JSON object; :class:`_Unprocessable` (FastAPI's 422 shape) otherwise."""
    body = await read_body(request, limit)
    if not body and empty_ok:
        return {}
    try:
        data = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _Unprocessable([{"type": "json_invalid", "loc": ["body"], "msg": str(exc) or "nested too deeply"}]) from None
    if not isinstance(data, dict):
        raise _Unprocessable([{"type": "dict_type", "loc": ["body"], "msg": "Input should be a valid dictionary"}])
    return data


async def _end(episode: openenv.Episode, attempts: int = 10, *,
               reason: str = "the OpenEnv client disconnected") -> None:
    """Cancel the episode's rollout if it is not final, trying again through a NATS outage
    (else it would hold its sandbox until the episode's idle time)."""
    for attempt in range(attempts):
        try:
            await episode.end(reason)
            return
        except Exception as exc:  # noqa: BLE001 - the store unreachable for now
            if attempt == attempts - 1:
                log.warning("could not end the episode's rollout: %s", exc)
                return
            await asyncio.sleep(1.0)


#: Rollouts of departed clients being cancelled (kept referenced until done).
endings: set[asyncio.Future] = set()


def install(app: FastAPI, service, *, read_body, decode, limit: int) -> Environments:
    environments = Environments(service)
    capacity = openenv.Capacity()
    name_param = Path(..., pattern=ID_PATTERN, max_length=128)
    project_param = Query(None, pattern=PROJECT_PATTERN, description="another project's (an admin key's only; "
                          "docs/projects.md)")
    obj = {"type": "object"}
    public_url = service.settings.public_url
    theirs = {403: {**openapi.errors(403)[403], "description": "the environment belongs to another API key "
                    "(only it or an admin key may replace or delete it)"}}

    @app.exception_handler(_Unprocessable)
    async def unprocessable(request: Request, exc: _Unprocessable) -> Response:
        """OpenEnv's stateless routes answer a body they cannot read as FastAPI does: 422 ``detail``."""
        return _json({"detail": exc.detail}, 422)

    # ------------------------------------------------------------------ registry

    @app.put("/v1/environments/{name}", openapi_extra=openapi.request_body(EnvironmentRequest),
             responses={200: openapi.answer(EnvironmentView), **openapi.errors(409, 413), **theirs})
    async def put_environment(request: Request, name: str = name_param) -> Response:
        """Serve a task over OpenEnv's protocol at ``/openenv/{name}`` (replacing one of that name:
        only the key that registered it, or an admin key, may)."""
        req = decode(await read_body(request, limit), EnvironmentRequest)
        return _json(view(await environments.put(name, req, apikeys.caller(request.scope)), public_url))

    @app.get("/v1/environments", responses={200: openapi.answer(obj)})
    async def list_environments(request: Request) -> Response:
        """The caller's project's environments (an admin key's listing: every project's)."""
        project = owners.listing_project(apikeys.caller(request.scope))
        return _json({"environments": [view(r, public_url) for r in await environments.list(project)]})

    @app.get("/v1/environments/{name}", responses={200: openapi.answer(EnvironmentView), **openapi.errors(404)})
    async def get_environment(request: Request, name: str = name_param,
                              project: str | None = project_param) -> Response:
        """The caller's project's environment ``name`` (names are per project; an admin key may
        name another project with ``?project=``)."""
        return _json(view(await environments.get(name, apikeys.caller(request.scope), project), public_url))

    @app.delete("/v1/environments/{name}", status_code=204, responses={**openapi.errors(404, 409), **theirs})
    async def delete_environment(request: Request, name: str = name_param,
                                 project: str | None = project_param) -> Response:
        """New episodes are refused; running ones go on to their end. Only the key that
        registered it, or an admin key, may."""
        await environments.delete(name, apikeys.caller(request.scope), project)
        return Response(status_code=204)

    # ------------------------------------------------------------------ OpenEnv's server

    @app.get("/openenv/{name}/health", responses={200: openapi.answer(obj), **openapi.errors(404)})
    async def env_health(request: Request, name: str = name_param) -> Response:
        await environments.get(name, apikeys.caller(request.scope))
        return _json({"status": "healthy"})

    @app.get("/openenv/{name}/metadata", responses={200: openapi.answer(obj), **openapi.errors(404)})
    async def env_metadata(request: Request, name: str = name_param) -> Response:
        return _json(openenv.metadata(await environments.get(name, apikeys.caller(request.scope))))

    @app.get("/openenv/{name}/schema", responses={200: openapi.answer(obj), **openapi.errors(404)})
    async def env_schema(request: Request, name: str = name_param) -> Response:
        return _json(openenv.schema(await environments.get(name, apikeys.caller(request.scope))))

    @app.get("/openenv/{name}/openapi.json", responses={200: openapi.answer(obj), **openapi.errors(404)})
    async def env_openapi(request: Request, name: str = name_param) -> Response:
        return _json(openenv.openapi(await environments.get(name, apikeys.caller(request.scope))))

    @app.post("/openenv/{name}/mcp", responses={200: openapi.answer(obj), **openapi.errors(404)},
              openapi_extra=openapi.request_body_schema(obj))
    async def env_mcp(request: Request, name: str = name_param) -> Response:
        env = await environments.get(name, apikeys.caller(request.scope))
        try:
            body = msgspec.json.decode(await read_body(request, limit))
        except (msgspec.DecodeError, RecursionError) as exc:
            return _json({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": f"Parse error: {exc}",
                                                                  "data": None}})
        return _json(openenv.mcp_answer(body, hosted=env.request.task.environment is not None))

    @app.post("/openenv/{name}/reset", responses={200: openapi.answer(obj), **openapi.errors(404)},
              openapi_extra=openapi.request_body_schema(obj))
    async def env_reset(request: Request, name: str = name_param) -> Response:
        """Stateless, as in OpenEnv's own server: the first observation, no episode (that is ``/ws``)."""
        env = await environments.get(name, apikeys.caller(request.scope))
        data = await _body_object(request, read_body, limit, empty_ok=True)
        seed = data.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
            return _json({"detail": [{"type": "greater_than_equal", "loc": ["body", "seed"],
                                      "msg": "Input should be greater than or equal to 0"}]}, 422)
        return _json(openenv.initial_observation(env))

    @app.post("/openenv/{name}/step", responses={200: openapi.answer(obj), **openapi.errors(404, 422, 502)},
              openapi_extra=openapi.request_body_schema(obj))
    async def env_step(request: Request, name: str = name_param) -> Response:
        """Stateless, as in OpenEnv's own server: the action is checked (422), then run on a fresh
        environment (a rollout of its own, ended after this step) and its observation answered. An
        episode of several steps is the WebSocket ``/ws``."""
        env = await environments.get(name, apikeys.caller(request.scope))
        data = await _body_object(request, read_body, limit, empty_ok=False)
        if not isinstance(data.get("action"), dict):
            return _json({"detail": [{"type": "missing", "loc": ["body", "action"], "msg": "Field required"}]}, 422)
        if env.request.task.environment is None:
            try:
                envtools.parse_action(data["action"])
            except envtools.ActionError as exc:
                return _json({"detail": exc.errors}, 422)
        episode = openenv.Episode(service, env, caller=apikeys.caller(request.scope))
        hosted = env.request.task.environment
        # the sandbox's start, a hosted server's own start, and a margin for a queue
        start_wait_s = float(service.settings.openenv_start_timeout_s) * 2 + (hosted.ready_timeout_s if hosted else 0.0)
        try:
            frame = await openenv.stateless_step(episode, data["action"], start_wait_s=start_wait_s)
        finally:
            ending = asyncio.ensure_future(_end(episode, reason="a stateless POST /step: its environment is "
                                                                "discarded after the one action"))
            endings.add(ending)
            ending.add_done_callback(endings.discard)
            with contextlib.suppress(BaseException):
                await asyncio.shield(ending)
        if frame["type"] == "observation":
            return _json(frame["data"])
        error = frame["data"]
        if error.get("code") == "VALIDATION_ERROR":  # a hosted environment's own check of the action
            return _json({"detail": error.get("errors") or [{"type": "value_error", "loc": ["body", "action"],
                                                             "msg": error.get("message", "")}]}, 422)
        return _json({"error": {"code": error.get("code", "EXECUTION_ERROR"), "message": error.get("message", "")}},
                     502)

    @app.get("/openenv/{name}/state", responses={200: openapi.answer(obj), **openapi.errors(404)})
    async def env_state(request: Request, name: str = name_param) -> Response:
        await environments.get(name, apikeys.caller(request.scope))
        return _json({"episode_id": None, "step_count": 0})

    @app.websocket("/openenv/{name}/ws")
    async def env_ws(websocket: WebSocket, name: str) -> None:
        try:
            env = await environments.get(name, apikeys.caller(websocket.scope))
        except NotFound as exc:
            # a 404 naming the environments that exist (closing before accepting reads as a 403)
            if "websocket.http.response" in websocket.scope.get("extensions", {}):
                await websocket.send_denial_response(_json({"error": {"code": exc.code, "message": exc.message}}, 404))
            else:
                await websocket.close(code=1008, reason=exc.message[:120])
            return
        await websocket.accept()
        held = storage_key(env.project, name)  # names are per project: so are their sessions
        if not capacity.take(held, env.request.max_concurrent):
            active = capacity.open.get(held, 0)
            await websocket.send_text(msgspec.json.encode(openenv.error_frame(
                "CAPACITY_REACHED", f"Server at capacity: {active}/{env.request.max_concurrent} sessions active. "
                "Cannot accept new connections.", active_sessions=active,
                max_sessions=env.request.max_concurrent)).decode())
            await websocket.close(code=1000)
            return
        episode = openenv.Episode(service, env, caller=apikeys.caller(websocket.scope))
        # frames are read while one is answered, so a client that leaves mid-step (a long
        # command) is noticed at once: its rollout is cancelled, not left to finish the step
        inbox: asyncio.Queue = asyncio.Queue(maxsize=4)  # OpenEnv's clients wait for each answer

        async def read() -> None:
            try:
                while True:
                    message = await websocket.receive()
                    if message["type"] == "websocket.disconnect":
                        return
                    if inbox.full():  # frames piling up unanswered: not OpenEnv's client
                        with contextlib.suppress(Exception):
                            await websocket.close(code=1008, reason="frames sent without waiting for answers")
                        return
                    inbox.put_nowait(message)
            except Exception:  # noqa: BLE001 - the connection is gone, whatever the library says
                return
            finally:
                with contextlib.suppress(asyncio.QueueFull):
                    inbox.put_nowait({"type": "websocket.disconnect"})

        reader = asyncio.create_task(read())
        try:
            while True:
                message = await inbox.get()
                if message["type"] == "websocket.disconnect":
                    break
                raw = message.get("text") if message.get("text") is not None else message.get("bytes") or b""
                answer = asyncio.create_task(episode.handle(raw))
                if not openenv.is_close(raw):  # a client may leave right after its close frame
                    await asyncio.wait({answer, reader}, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.wait({answer})
                if not answer.done():  # the client left while its frame was being answered
                    answer.cancel()
                    with contextlib.suppress(BaseException):
                        await answer
                    break
                try:
                    reply = answer.result()
                except ArenaError as exc:
                    reply = openenv.error_frame("EXECUTION_ERROR", exc.message)
                if reply is None:  # close
                    await websocket.close(code=1000)
                    break
                await websocket.send_text(msgspec.json.encode(reply).decode())
        except WebSocketDisconnect:
            pass
        except Exception:  # noqa: BLE001 - one episode's failure never takes the service down
            log.exception("OpenEnv episode on %s failed", name)
            with contextlib.suppress(Exception):
                await websocket.close(code=1011)
        finally:
            reader.cancel()
            capacity.give(held)
            ending = asyncio.ensure_future(_end(episode))  # runs whole even if this handler is cancelled
            endings.add(ending)
            ending.add_done_callback(endings.discard)
            with contextlib.suppress(BaseException):
                await asyncio.shield(ending)
    return environments
