"""HTTP edge of the rollout plane: the rollout API and the per-rollout LLM proxy.

Routes are thin: parse, call ``RolloutService``, encode. Every error is
``{"error": {"code", "message"}}`` with a 4xx/5xx status, never a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from typing import Any, TypeVar
from urllib.parse import parse_qs

import msgspec
from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from arena_core import apikeys, health, openapi, owners, quotas, sources, subjects
from arena_core.bodies import decode_body
from arena_core.errors import ArenaError, Forbidden, InvalidRequest, NotFound, Overloaded, PayloadTooLarge
from arena_core.schemas import (
    ID_PATTERN,
    DuelSubmitted,
    ErrorBody,
    ErrorResponse,
    GroupSubmitted,
    RolloutState,
    RolloutView,
    SubmitDuelRequest,
    SubmitGroupRequest,
    SubmitRolloutRequest,
    encode,
    valid_id,
)

from arena_rollout import openenv_routes
from arena_rollout.proxy import errors, gemini
from arena_rollout.proxy.delivery import Delivery, Orphan, Orphans
from arena_rollout.proxy.flavours import error_flavor
from arena_rollout.proxy.handler import Relay
from arena_rollout.proxy.policy import Api
from arena_rollout.service import RolloutService, view

log = logging.getLogger("arena.rollout.http")

T = TypeVar("T")


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type="application/json")


def error_response(exc: ArenaError, request: Request | None = None) -> Response:
    """Arena's ``{"error": {"code", "message"}}``; on the proxy's paths, the shape of the API
    the agent speaks (proxy/errors.py)."""
    path = request.url.path if request is not None else ""
    if path.startswith("/proxy/"):
        flavor = errors.flavor_of(path, "anthropic-version" in request.headers)
        status, body, headers = errors.of(exc, flavor, errors.request_id())
        return Response(body, status_code=status, media_type="application/json",
                        headers={k.decode(): v.decode() for k, v in headers})
    response = json_response(ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message)), exc.status)
    if isinstance(exc, Overloaded):
        response.headers["retry-after"] = str(int(exc.retry_after))
    return response


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


class RelayResponse(StreamingResponse):
    """A relayed stream whose iterator is always closed, so a client that disconnects
    mid-stream still gets its step recorded (``incomplete``)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def bundle_project(request: Request) -> str | None:
    """The project whose bundles the caller sees; ``None``: every project's (keys off, an admin key)."""
    return owners.listing_project(apikeys.caller(request.scope))


def decode(data: bytes, type_: type[T]) -> T:
    return decode_body(data, type_)


def create_app(service: RolloutService) -> RolloutApp:
    app = FastAPI(title="Arena rollout API", version="0.1.0", responses=openapi.errors(422, 503))
    openapi.install(app, [SubmitRolloutRequest, SubmitGroupRequest, RolloutView, GroupSubmitted, SubmitDuelRequest,
                          DuelSubmitted, health.Health])
    limit = service.settings.max_body_bytes
    obj = {"type": "object"}
    sse = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}  # per event
    rid = Path(..., pattern=ID_PATTERN, max_length=128)
    one = {200: openapi.answer(RolloutView), **openapi.errors(404)}
    llm = {200: {"description": "the backend's answer, as JSON or as server-sent events",
                 "content": {"application/json": {"schema": obj}, "text/event-stream": {"schema": sse}}},
           **openapi.api_errors(400, 401, 403, 404, 405, 413, 429, 502)}

    @app.exception_handler(ArenaError)
    async def on_arena_error(request: Request, exc: ArenaError) -> Response:
        return error_response(exc, request)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(InvalidRequest(problems), request)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        """Unrouted paths (404) and wrong methods (405), in the error shape of the path's API."""
        error = ArenaError(str(exc.detail))
        error.status, error.code = exc.status_code, {404: "not_found", 405: "method_not_allowed"}.get(
            exc.status_code, "http_error")
        if exc.status_code == 404:
            error.message = f"no route for {request.method} {request.url.path}"
        response = error_response(error, request)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    app.add_middleware(IdsAtTheEdge)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        error = ArenaError(f"internal error: {type(exc).__name__}")
        error.code = "internal"
        response = error_response(error, request)
        response.headers["x-request-id"] = errors.request_id()
        return response

    @app.get("/healthz", responses={200: openapi.answer(health.Health), 503: openapi.answer(health.Health, "unhealthy")})
    async def healthz() -> Response:
        """Liveness: 503 once the bus connection is gone for good (the supervisor restarts us)."""
        problem = health.live(service.bus)
        return json_response(health.Health(status="ok" if problem is None else "unhealthy", problem=problem or ""),
                             200 if problem is None else 503)

    @app.get("/readyz", responses={200: openapi.answer(health.Health), 503: openapi.answer(health.Health, "not ready")})
    async def readyz() -> Response:
        """Readiness: NATS connected, the rollout streams present and the rollout bucket reachable, else 503."""

        async def bucket() -> str | None:
            try:
                await service.bus.kv(subjects.KV_ROLLOUTS)
            except Exception as exc:  # noqa: BLE001 - any failure means not ready
                return f"rollout bucket unreachable: {type(exc).__name__}"
            return None

        problem = await health.ready(service.bus, streams=["ARENA_ROLLOUTS", "ARENA_SANDBOX_JOBS"], checks=[bucket])
        return json_response(health.Health(status="ready" if problem is None else "not ready", problem=problem or ""),
                             503 if problem else 200)

    @app.post("/v1/rollouts", status_code=201, openapi_extra=openapi.request_body(SubmitRolloutRequest),
              responses={201: {**openapi.answer(RolloutView, "created"), "links": {
                  name: {"operationId": name, "parameters": {"rollout_id": "$response.body#/rollout_id"}}
                  for name in ("get_rollout", "wait_rollout", "cancel_rollout", "rollout_events")}},
                  **openapi.errors(413, 429)})
    async def submit_rollout(request: Request) -> Response:
        req = decode(await read_body(request, limit), SubmitRolloutRequest)
        record = await service.submit(req, caller=apikeys.caller(request.scope))
        return json_response(view(record), 201)

    @app.post("/v1/rollout-groups", status_code=201, openapi_extra=openapi.request_body(SubmitGroupRequest),
              responses={201: openapi.answer(GroupSubmitted, "created"), **openapi.errors(413, 429)})
    async def submit_group(request: Request) -> Response:
        req = decode(await read_body(request, limit), SubmitGroupRequest)
        return json_response(await service.submit_group(req, caller=apikeys.caller(request.scope)), 201)

    @app.post("/v1/duels", status_code=201, openapi_extra=openapi.request_body(SubmitDuelRequest),
              responses={201: openapi.answer(DuelSubmitted, "created"), **openapi.errors(413, 429)})
    async def submit_duel(request: Request) -> Response:
        """One task for two policies on the same seeds: two groups, each member labelled
        ``arena.duel``, ``arena.duel.side``, ``arena.duel.policy``, ``arena.duel.seed``."""
        req = decode(await read_body(request, limit), SubmitDuelRequest)
        return json_response(await service.submit_duel(req, caller=apikeys.caller(request.scope)), 201)

    @app.post("/v1/bundles", status_code=201,
              openapi_extra={"requestBody": {"required": True, "content": {
                  "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
              responses={201: openapi.answer(obj, "stored"), **openapi.errors(413)})
    async def push_bundle(request: Request) -> Response:
        """A task bundle (a tar, gzipped or not) into the object store under its sha256;
        the answer's ``digest`` is what a task's ``source``/``agent.bundle`` names."""
        data = await read_body(request, service.settings.max_bundle_bytes)
        if not data:
            raise InvalidRequest("request body is empty; send the bundle's bytes (a tar or tar.gz)")
        try:
            await asyncio.to_thread(sources.check_bundle, data, sources.unpack_limits(service.settings))
        except sources.BundleTooLarge as exc:
            raise PayloadTooLarge(str(exc)) from None
        except sources.SourceError as exc:
            raise InvalidRequest(str(exc)) from None
        digest = await sources.push_bundle(service.bus, data, owners.project_of(apikeys.caller(request.scope)))
        return json_response({"digest": digest, "size": len(data)}, 201)

    @app.get("/v1/bundles/{digest}", responses={200: openapi.answer(obj), **openapi.errors(404)})
    async def bundle_info(request: Request, digest: str = Path(..., pattern=r"^sha256:[0-9a-f]{64}$")) -> Response:
        """Whether the caller's project uploaded this bundle (another project's is not found)."""
        if not sources.DIGEST.fullmatch(digest):
            raise InvalidRequest("a bundle digest is sha256: followed by 64 lower-case hex digits")
        if not await sources.bundle_exists(service.bus, digest, bundle_project(request)):
            raise NotFound(f"bundle {digest} is not stored")
        return json_response({"digest": digest})

    @app.get("/v1/bundles/{digest}/archive", responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
              "description": "the bundle's bytes, as uploaded"}, **openapi.errors(404)})
    async def bundle_archive(request: Request, digest: str = Path(..., pattern=r"^sha256:[0-9a-f]{64}$")) -> Response:
        """A bundle's bytes (``arena tasks shell`` unpacks a task's source from them); the
        ``submit`` scope, as uploading: a task's files are not for read-only keys, nor for
        another project's."""
        if not sources.DIGEST.fullmatch(digest):
            raise InvalidRequest("a bundle digest is sha256: followed by 64 lower-case hex digits")
        if not await sources.bundle_exists(service.bus, digest, bundle_project(request)):
            raise NotFound(f"bundle {digest} is not stored")
        data = await sources.fetch_bundle(service.bus, digest)  # checked against its digest
        return Response(data, media_type="application/octet-stream")

    @app.get("/v1/rollouts", responses={200: openapi.answer(obj)})
    async def list_rollouts(request: Request, state: RolloutState | None = None,
                            group_id: str | None = Query(None, pattern=ID_PATTERN, max_length=128),
                            limit_: int = Query(1000, ge=1, le=100_000)) -> Response:
        if group_id is not None and not valid_id(group_id):
            raise InvalidRequest(f"group_id must match {ID_PATTERN}")
        if not 1 <= limit_ <= 100_000:
            raise InvalidRequest("limit_ must be between 1 and 100000")
        records = await service.store.list(state=state.value if state is not None else None, limit=limit_,
                                           project=owners.listing_project(apikeys.caller(request.scope)))
        if group_id is not None:
            records = [r for r in records if r.group_id == group_id]
        return json_response({"rollouts": [view(r) for r in records]})

    @app.get("/v1/projects", responses={200: openapi.answer(obj)})
    async def list_projects(request: Request) -> Response:
        """Projects' quotas and priorities (docs/projects.md) and what each holds now: an admin key
        sees every project (those with settings stored, and those with live rollouts), a project's
        key its own project's (its settings, or the defaults)."""
        return json_response({"projects": await service.quota_listing(caller=apikeys.caller(request.scope)),
                              "defaults": msgspec.to_builtins(quotas.defaults("any"))})

    @app.put("/v1/projects/{project}", responses={200: openapi.answer(obj), **openapi.errors(403)},
             openapi_extra=openapi.request_body_schema(obj))
    async def set_project(request: Request, project: str = Path(..., max_length=64)) -> Response:
        """Set a project's quotas and priority (an admin key): ``max_sandboxes``, ``max_queued``
        (0: no limit of its own), ``priority`` (high, normal, low), ``weight`` (> 0); fields left
        out keep their stored value (or the default)."""
        body = await request.body()
        try:
            fields = msgspec.json.decode(body or b"{}")
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"the body is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise InvalidRequest("the body is a JSON object of max_sandboxes, max_queued, priority, weight")
        unknown = sorted(set(fields) - {"max_sandboxes", "max_queued", "priority", "weight"})
        if unknown:
            raise InvalidRequest(f"unknown field(s) {', '.join(unknown)}: max_sandboxes, max_queued, priority, "
                                 "weight are a project's settings")
        caller = apikeys.caller(request.scope)
        if caller is not None and "admin" not in caller.scopes:
            raise Forbidden("setting a project's quotas needs an admin key")
        try:
            apikeys.check_project(project)
            current = await quotas.get(service.bus, project)
            quota = msgspec.convert({**msgspec.to_builtins(current), **fields, "project": project},
                                    quotas.ProjectQuota)
        except (ValueError, msgspec.ValidationError) as exc:
            raise InvalidRequest(str(exc)) from None
        return json_response(msgspec.to_builtins(await service.set_quota(quota, caller=caller)))

    @app.get("/v1/rollouts/{rollout_id}", responses=one, operation_id="get_rollout")
    async def get_rollout(request: Request, rollout_id: str = rid) -> Response:
        return json_response(view(await service.visible(rollout_id, apikeys.caller(request.scope))))

    @app.get("/v1/rollouts/{rollout_id}/wait", responses=one, operation_id="wait_rollout")
    async def wait_rollout(request: Request, rollout_id: str = rid,
                           timeout: float = Query(30.0, ge=0, le=300)) -> Response:
        if not 0 <= timeout <= 300:
            raise InvalidRequest("timeout must be between 0 and 300 seconds")
        await service.visible(rollout_id, apikeys.caller(request.scope))  # another project's: 404 at once
        record = await service.wait(rollout_id, timeout)
        return json_response(view(record))

    @app.post("/v1/rollouts/{rollout_id}/cancel", responses={**one, **openapi.errors(409), 403: {
        **openapi.errors(403)[403], "description": "the rollout belongs to another API key (only it or an admin "
                                                  "key may cancel it)"}}, operation_id="cancel_rollout")
    async def cancel_rollout(request: Request, rollout_id: str = rid) -> Response:
        """Only the key that submitted the rollout, or an admin key, may cancel it (403 otherwise;
        another project's rollout is not found, 404)."""
        return json_response(view(await service.cancel(rollout_id, caller=apikeys.caller(request.scope))))

    @app.get("/v1/rollouts/{rollout_id}/events", operation_id="rollout_events", responses={
        200: {"description": "state changes as server-sent events",
              "content": {"text/event-stream": {"schema": sse}}}, **openapi.errors(404)})
    async def rollout_events(request: Request, rollout_id: str = rid) -> StreamingResponse:
        await service.visible(rollout_id, apikeys.caller(request.scope))  # 404 before the stream starts

        async def sse():
            async for event in service.events(rollout_id):
                if event is None:
                    yield b": keep-alive\n\n"
                else:
                    yield b"event: state\ndata: " + encode(event) + b"\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    # -------------------------------------------------------------- the proxy

    @app.get("/proxy/{rollout_id}/v1/models", responses={200: openapi.answer(obj), **openapi.api_errors(400, 401, 404)})
    async def proxy_models(request: Request, rollout_id: str = rid) -> Response:
        record = await authorize(service, rollout_id, request)
        return json_response(models_answer(service.models_of(record), record.created_at))

    @app.post("/proxy/{rollout_id}/v1/messages/count_tokens", responses={200: openapi.answer(obj),
              **openapi.api_errors(400, 401, 404, 413, 502, 503)}, openapi_extra=openapi.request_body_schema(obj))
    async def proxy_count_tokens(request: Request, rollout_id: str = rid) -> Response:
        """Anthropic's token count of a Messages request, by the backend that serves the
        rollout (its ``/tokenize``); not a step and not counted against any budget."""
        record = await authorize(service, rollout_id, request)
        payload = _payload(await read_body(request, limit))
        return json_response({"input_tokens": await service.proxy.count_tokens(record, payload)})

    @app.post("/proxy/{rollout_id}/v1beta/models/{model}:countTokens", responses={200: openapi.answer(obj),
              **openapi.api_errors(400, 401, 404, 413, 502, 503)}, openapi_extra=openapi.request_body_schema(obj))
    async def proxy_gemini_count_tokens(request: Request, rollout_id: str = rid, model: str = Path(...)) -> Response:
        """The Gemini API's ``countTokens`` (``contents`` or a ``generateContentRequest``), by the
        backend that serves the rollout (its ``/tokenize``); not a step. Also under ``/v1/``."""
        record = await authorize(service, rollout_id, request)
        payload = gemini.route_payload(_payload(await read_body(request, limit)), model=model, stream=False, sse=False)
        return json_response({"totalTokens": await service.proxy.count_tokens(record, payload,
                                                                              "gemini.generate_content")})

    app.post("/proxy/{rollout_id}/v1/models/{model}:countTokens", include_in_schema=False)(proxy_gemini_count_tokens)

    async def passthrough(request: Request, rollout_id: str, what: str) -> Response:
        record = await authorize(service, rollout_id, request)
        payload = _payload(await read_body(request, limit))
        status, data = await service.proxy.passthrough(record, what, payload)
        return Response(data, status_code=status, media_type="application/json")

    for what in ("tokenize", "detokenize"):
        def route(what: str = what):
            async def serve(request: Request, rollout_id: str = rid) -> Response:
                return await passthrough(request, rollout_id, what)
            serve.__name__ = f"proxy_{what}"
            serve.__doc__ = (f"vLLM's ``/{what}``, passed to the backend that serves the rollout; a clear 404 "
                             "when it has none. Not a step.")
            return serve
        for path in (f"/proxy/{{rollout_id}}/{what}", f"/proxy/{{rollout_id}}/v1/{what}"):
            app.post(path, responses={200: openapi.answer(obj), **openapi.api_errors(400, 401, 404, 413, 502, 503)},
                     openapi_extra=openapi.request_body_schema(obj), operation_id=f"proxy_{what}_"
                     + ("v1" if "/v1/" in path else "root"))(route())

    # documented here; served by ``RolloutApp`` before FastAPI routing (the hot path)
    @app.post("/proxy/{rollout_id}/v1/chat/completions", responses=llm, openapi_extra=openapi.request_body_schema(obj))
    async def proxy_chat(request: Request, rollout_id: str = rid) -> Response:
        return await proxied(service, rollout_id, request, "openai.chat")

    @app.post("/proxy/{rollout_id}/v1/completions", responses=llm, openapi_extra=openapi.request_body_schema(obj))
    async def proxy_completions(request: Request, rollout_id: str = rid) -> Response:
        return await proxied(service, rollout_id, request, "openai.completions")

    @app.post("/proxy/{rollout_id}/v1/messages", responses=llm, openapi_extra=openapi.request_body_schema(obj))
    async def proxy_messages(request: Request, rollout_id: str = rid) -> Response:
        return await proxied(service, rollout_id, request, "anthropic.messages")

    @app.post("/proxy/{rollout_id}/v1/responses", responses=llm, openapi_extra=openapi.request_body_schema(obj))
    async def proxy_responses(request: Request, rollout_id: str = rid) -> Response:
        """The OpenAI Responses API, translated to the backend's chat completions (docs/rollout.md)."""
        return await proxied(service, rollout_id, request, "openai.responses")

    gemini_answer = {200: {"description": "the answer as JSON, or as server-sent events (?alt=sse) or a JSON array",
                           "content": {"application/json": {"schema": obj}, "text/event-stream": {"schema": sse}}},
                     **openapi.api_errors(400, 401, 403, 404, 405, 413, 429, 502)}

    @app.post("/proxy/{rollout_id}/v1beta/models/{model}:generateContent", responses=gemini_answer,
              openapi_extra=openapi.request_body_schema(obj))
    async def proxy_gemini_generate(request: Request, rollout_id: str = rid, model: str = Path(...)) -> Response:
        """The Gemini API, translated to the backend's chat completions (docs/rollout.md). Also
        under ``/v1/``; the key as ``x-goog-api-key`` or ``?key=``."""
        return await proxied(service, rollout_id, request, "gemini.generate_content", gemini_route=(model, False))

    @app.post("/proxy/{rollout_id}/v1beta/models/{model}:streamGenerateContent", responses=gemini_answer,
              openapi_extra=openapi.request_body_schema(obj))
    async def proxy_gemini_stream(request: Request, rollout_id: str = rid, model: str = Path(...)) -> Response:
        """``generateContent`` streamed: server-sent events with ``?alt=sse``, else one JSON array."""
        return await proxied(service, rollout_id, request, "gemini.generate_content", gemini_route=(model, True))

    # -------------------------------------------------------------- environments (OpenEnv)

    openenv_routes.install(app, service, read_body=read_body, decode=decode, limit=limit)

    # -------------------------------------------------------------- the judge route

    @app.post("/judge/{rollout_id}/v1/chat/completions", responses=llm, openapi_extra=openapi.request_body_schema(obj))
    async def judge_chat(request: Request, rollout_id: str = rid) -> Response:
        """A verifier's judge call about a rollout: the verification service's key, routed like
        the agent's calls, never a step of the rollout nor counted against its budgets."""
        record = await service.authorize_judge(rollout_id, request.headers.get("authorization"),
                                               request.headers.get("x-api-key"))
        body = await read_body(request, limit)
        try:
            payload = msgspec.json.decode(body)
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
        return Response(await service.proxy.judge(record, payload), media_type="application/json")

    return RolloutApp(service, app)


async def proxied(service: RolloutService, rollout_id: str, request: Request, api: Api,
                  gemini_route: tuple[str, bool] | None = None) -> Response:
    """The FastAPI form of a proxied call (documents the routes; ``RolloutApp`` serves them)."""
    record = await authorize(service, rollout_id, request)
    payload = _payload(await read_body(request, service.settings.max_body_bytes))
    if gemini_route is not None:
        payload = gemini.route_payload(payload, model=gemini_route[0], stream=gemini_route[1],
                                       sse=request.query_params.get("alt") == "sse")
    answer = await service.proxy.call(record, api, payload)
    if isinstance(answer, (bytes, dict)):
        return Response(answer if isinstance(answer, bytes) else encode(answer), media_type="application/json")
    return RelayResponse(answer, media_type=answer.content_type.decode(),
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def rollout_key(authorization: str | None, api_key: str | None, goog_key: str | None,
                query: str) -> tuple[str | None, str | None]:
    """(``Authorization``, the key sent otherwise) of a call on a proxy route: ``x-api-key``
    (Anthropic), ``x-goog-api-key`` or ``?key=`` (Gemini)."""
    other = api_key or goog_key
    if other is None and "key=" in query:
        other = next(iter(parse_qs(query).get("key") or ()), None)
    return authorization, other


async def authorize(service: RolloutService, rollout_id: str, request: Request):
    """The rollout's record, if the call carries its key in one of the forms the APIs use."""
    h = request.headers
    return await service.authorize(rollout_id, *rollout_key(h.get("authorization"), h.get("x-api-key"),
                                                            h.get("x-goog-api-key"), request.url.query))


def models_answer(models: list[str], created: float) -> dict[str, Any]:
    """``GET /v1/models``: the model names the rollout may use, in a shape both SDKs read
    (OpenAI's list fields, and Anthropic's ``type`` / ``display_name`` / ``created_at`` and paging)."""
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    data = [{"id": m, "object": "model", "created": int(created), "owned_by": "arena",
             "type": "model", "display_name": m, "created_at": created_at} for m in models]
    return {"object": "list", "data": data, "has_more": False, "first_id": models[0] if models else None,
            "last_id": models[-1] if models else None}


def _payload(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


_PROXY_PATH = re.compile(r"/proxy/([^/]+)/v1/(chat/completions|completions|messages|responses)")
_APIS: dict[str, Api] = {"chat/completions": "openai.chat", "completions": "openai.completions",
                         "messages": "anthropic.messages", "responses": "openai.responses"}
#: the Gemini API's generation routes: (rollout id, model, method)
_GEMINI_PATH = re.compile(r"/proxy/([^/]+)/v1(?:beta)?/models/([^/:]+):(generateContent|streamGenerateContent)")
_JSON_HEAD = [(b"content-type", b"application/json")]
_STREAM_HEAD = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
#: after an answer's last write, give the CPU to the client it woke (see ``_answered``)
_YIELD = hasattr(os, "sched_yield")


class IdsAtTheEdge:
    """Every rollout id in a path follows the id grammar before any bus or store call; every
    answer carries ``x-request-id``. Plain ASGI: ``@app.middleware("http")`` (Starlette's
    ``BaseHTTPMiddleware``) ran each request through a task group and memory streams."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parts = scope["path"].split("/")
        if len(parts) > 3 and parts[1] in ("v1", "proxy", "judge") and (
                parts[1] != "v1" or parts[2] == "rollouts") and not valid_id(parts[3 if parts[1] == "v1" else 2]):
            response = error_response(
                InvalidRequest(f"a rollout id must match {ID_PATTERN} (1-128 characters)"), Request(scope))
            if "x-request-id" not in response.headers:
                response.headers["x-request-id"] = errors.request_id()
            await response(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers") or []
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-request-id", errors.request_id().encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class RolloutApp:
    """The ASGI app. The proxy's POST routes (every LLM call of every agent) are served
    here in plain ASGI: no routing, request objects, dependency solving or middleware.
    Everything else goes to FastAPI."""

    def __init__(self, service: RolloutService, api: FastAPI):
        self.service = service
        self.api = api
        self.limit = service.settings.max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _PROXY_PATH.fullmatch(scope["path"])
            if match is not None:
                await self._proxy(match[1], _APIS[match[2]], scope, receive, send)
                return
            match = _GEMINI_PATH.fullmatch(scope["path"])
            if match is not None:
                await self._proxy(match[1], "gemini.generate_content", scope, receive, send,
                                  gemini_route=(match[2], match[3] == "streamGenerateContent"))
                return
        if scope["type"] in ("http", "websocket") and scope["path"].startswith(apikeys.OPENENV_KEYED):
            scope = apikeys.without_path_key(scope)  # checked by the key guard in front, when keys are on
        await self.api(scope, receive, send)

    async def _proxy(self, rollout_id: str, api: Api, scope, receive, send,
                     gemini_route: tuple[str, bool] | None = None) -> None:
        """One proxied call: the key checked, then the body read, then the call made (or a
        retry given the answer of an identical call whose client left). Errors in the
        shape of the API called. ``gemini_route``: the model and whether it streams, from
        a Gemini route's path."""
        request_id = errors.request_id()
        flavor = error_flavor(api)
        headers = dict(scope["headers"])
        try:
            if not valid_id(rollout_id):
                raise InvalidRequest(f"a rollout id must match {ID_PATTERN} (1-128 characters)")
            query = scope.get("query_string") or b""
            record = await self.service.authorize(rollout_id, *rollout_key(
                *(_latin1(headers.get(n)) for n in (b"authorization", b"x-api-key", b"x-goog-api-key")),
                query.decode("latin-1")))
            body = await self._body(receive, headers.get(b"content-length"))
            payload = _payload(body)
            if gemini_route is not None:
                payload = gemini.route_payload(payload, model=gemini_route[0], stream=gemini_route[1],
                                               sse=b"alt=sse" in query.split(b"&"))
            if isinstance(payload, dict) and payload.get("stream"):
                relay = await self.service.proxy.call(record, api, payload)
                await _send_stream(send, receive, relay, request_id)
                return
            orphans = self.service.proxy.orphans
            if orphans.has(rollout_id):
                key = orphans.key(rollout_id, api, body)
                orphan = orphans.take(key)
                if orphan is not None:
                    await self._retry(send, receive, orphans, key, orphan, request_id)
                    return
            answer = await self._whole(record, api, payload, body, receive)
            if answer is None:
                return  # the client left; the answer waits for its retry
            status, data, extra, delivery = answer
        except ArenaError as exc:
            status, data, extra = errors.of(exc, flavor, request_id)
            delivery = None
        try:
            await _send_whole(send, status, data, extra or _request_headers(request_id))
        except BaseException:
            if delivery is not None:
                delivery.settle(False)
            raise
        if delivery is not None:
            delivery.settle(True)

    async def _whole(self, record, api: Api, payload: Any, body: bytes, receive):
        """A call for a whole answer, watching its client: (status, body, headers,
        delivery) to send, or None when the client left first (the call is an orphan)."""
        delivery = Delivery()
        orphans = self.service.proxy.orphans
        orphan: list = []

        def gone(watch: asyncio.Task) -> None:
            if not watch.cancelled() and not answered:
                key = orphans.key(record.rollout_id, api, body)
                orphan.append(orphans.adopt(key, delivery))

        answered = False
        watch = asyncio.get_running_loop().create_task(receive())
        watch.add_done_callback(gone)
        try:
            answer = await self.service.proxy.call(record, api, payload, delivery)
            result = 200, answer if isinstance(answer, bytes) else encode(answer), None, delivery
        except ArenaError as exc:
            status, data, extra = errors.of(exc, error_flavor(api), errors.request_id())
            result = status, data, extra, None
        except Exception as exc:  # noqa: BLE001 - never a stack trace to the client
            log.exception("unhandled error on a proxied %s call of rollout %s", api, record.rollout_id)
            rid = errors.request_id()
            result = 500, errors.body(error_flavor(api), 500, "internal", f"internal error: {type(exc).__name__}"), \
                errors.headers(rid, retry=True), None
        except BaseException:  # cancelled (the server is stopping): nobody will get this answer
            delivery.settle(False)
            if orphan:
                orphan[0].answer.cancel()
            watch.cancel()
            raise
        finally:
            answered = True
        if orphan:
            orphan[0].answer.set_result(result)
            if result[3] is None:  # an error: no step waits for its delivery
                delivery.settle(False)
            return None
        watch.remove_done_callback(gone)
        watch.cancel()
        return result

    async def _retry(self, send, receive, orphans: Orphans, key, orphan: Orphan, request_id: str) -> None:
        """A retry of a call whose client left: it takes that call's answer (one step, not two)."""
        watch = asyncio.get_running_loop().create_task(receive())
        try:
            await asyncio.wait([watch, orphan.answer], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not watch.done():
                watch.cancel()
        if orphan.answer.cancelled():
            return  # the call it retried was cancelled: the client gets no answer, as from a stopping server
        if not orphan.answer.done() or (watch.done() and not watch.cancelled()):
            orphans.put_back(key, orphan)  # this client left too
            return
        status, data, extra, delivery = orphan.answer.result()
        await _send_whole(send, status, data, extra or _request_headers(request_id))
        if delivery is not None:
            delivery.settle(True)

    async def _body(self, receive, declared: bytes | None) -> bytes:
        limit = self.limit
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared.decode()} bytes exceeds the {limit}-byte limit")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise InvalidRequest("the client went away before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if not body:
            raise InvalidRequest("request body is empty; send a JSON object")
        return body


def _latin1(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


def _answered() -> None:
    """The client this answer's last write woke is often queued on this CPU and would wait
    for what the proxy does next (recording the call, which can wait): yield it the CPU
    (returns at once when nothing else is runnable here). docs/rollout.md, Performance."""
    if _YIELD:
        os.sched_yield()


def _request_headers(request_id: str) -> list[tuple[bytes, bytes]]:
    return [(b"x-request-id", request_id.encode())]


async def _send_whole(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEAD, (b"content-length", str(len(body)).encode()), *extra]})
    await send({"type": "http.response.body", "body": body})
    _answered()


async def _send_stream(send, receive, relay: Relay, request_id: str) -> None:
    """Relay SSE pieces as they come (the response's end goes with the last piece); a
    client that goes away stops the relay at once (its step is still recorded,
    ``incomplete``), and the relay is always closed."""
    # the pump runs in this task; a watcher answers http.disconnect when the client goes
    # away and cancels it (one task fewer per stream than pumping in a task of its own)
    this = asyncio.current_task()
    pumping, gone = True, False

    def on_receive(_watch: asyncio.Task) -> None:
        nonlocal gone
        if pumping:
            gone = True
            this.cancel()

    watching = asyncio.get_running_loop().create_task(receive())
    watching.add_done_callback(on_receive)
    try:
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", relay.content_type), *_STREAM_HEAD, *_request_headers(request_id)]})
        ended = False
        async for piece in relay:  # after the last piece, one more turn lets the relay finish
            ended = relay.final
            await send({"type": "http.response.body", "body": piece, "more_body": not ended})
            if ended:
                _answered()
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            _answered()
    except asyncio.CancelledError:
        if not gone:
            raise
        this.uncancel()
    except Exception as exc:  # noqa: BLE001 - the client's connection broke mid-write: nothing to answer
        log.debug("stream to the client ended: %s: %s", type(exc).__name__, exc)
    finally:
        pumping = False
        watching.remove_done_callback(on_receive)
        watching.cancel()
        await relay.aclose()
