"""HTTP edge of the rollout plane: the rollout API and the per-rollout LLM proxy.

Routes are thin: parse, call ``RolloutService``, encode. Every error is
``{"error": {"code", "message"}}`` with a 4xx/5xx status, never a stack trace.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

from arena_core import sources, subjects
from arena_core.errors import ArenaError, InvalidRequest, NotFound, PayloadTooLarge
from arena_core.fastroutes import BodyTooLarge, ClientGone, Exchange
from arena_core.schemas import (
    ID_PATTERN,
    ErrorBody,
    ErrorResponse,
    RolloutState,
    SubmitGroupRequest,
    SubmitRolloutRequest,
    encode,
    valid_id,
)

from arena_rollout.proxy.handler import Relay
from arena_rollout.proxy.policy import Api
from arena_rollout.service import RolloutService, view

log = logging.getLogger("arena.rollout.http")

T = TypeVar("T")
_STATES = {s.value for s in RolloutState}


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(encode(obj), status_code=status, media_type="application/json")


def error_response(exc: ArenaError) -> Response:
    return json_response(ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message)), exc.status)


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


def decode(data: bytes, type_: type[T]) -> T:
    if not data:
        raise InvalidRequest("request body is empty; send a JSON object")
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


def create_app(service: RolloutService) -> RolloutApp:
    app = FastAPI(title="Arena rollout API", version="0.1.0")
    limit = service.settings.max_body_bytes

    @app.exception_handler(ArenaError)
    async def on_arena_error(_request: Request, exc: ArenaError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return error_response(InvalidRequest(problems))

    @app.middleware("http")
    async def ids_at_the_edge(request: Request, call_next):
        """Every rollout id in a path follows the id grammar before any bus or store call."""
        parts = request.url.path.split("/")
        if len(parts) > 3 and parts[1] in ("v1", "proxy", "judge") and (
                parts[1] != "v1" or parts[2] == "rollouts") and not valid_id(parts[3 if parts[1] == "v1" else 2]):
            return error_response(InvalidRequest(f"a rollout id must match {ID_PATTERN} (1-128 characters)"))
        return await call_next(request)

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return json_response(ErrorResponse(error=ErrorBody(code="internal", message=f"internal error: {type(exc).__name__}")), 500)

    @app.get("/healthz")
    async def healthz() -> Response:
        """Liveness: 503 once the bus connection is gone for good (the supervisor restarts us)."""
        connected = service.bus.nc.is_connected or service.bus.nc.is_reconnecting
        return json_response({"status": "ok" if connected else "unhealthy", "nats": service.bus.nc.is_connected},
                             200 if connected else 503)

    @app.get("/readyz")
    async def readyz() -> Response:
        """Readiness: NATS connected and the rollout bucket reachable, else 503."""
        problem = ""
        if not service.bus.nc.is_connected:
            problem = "not connected to NATS"
        else:
            try:
                await asyncio.wait_for(service.bus.kv(subjects.KV_ROLLOUTS), 2.0)
            except Exception as exc:  # noqa: BLE001 - any failure means not ready
                problem = f"rollout bucket unreachable: {type(exc).__name__}"
        return json_response({"status": "ready" if not problem else "not ready", "problem": problem},
                             503 if problem else 200)

    @app.post("/v1/rollouts")
    async def submit_rollout(request: Request) -> Response:
        req = decode(await read_body(request, limit), SubmitRolloutRequest)
        record = await service.submit(req)
        return json_response(view(record), 201)

    @app.post("/v1/rollout-groups")
    async def submit_group(request: Request) -> Response:
        req = decode(await read_body(request, limit), SubmitGroupRequest)
        return json_response(await service.submit_group(req), 201)

    @app.post("/v1/bundles")
    async def push_bundle(request: Request) -> Response:
        """A task bundle (a tar, gzipped or not) into the object store under its sha256;
        the answer's ``digest`` is what a task's ``source``/``agent.bundle`` names."""
        data = await read_body(request, service.settings.max_bundle_bytes)
        if not data:
            raise InvalidRequest("request body is empty; send the bundle's bytes (a tar or tar.gz)")
        try:
            await asyncio.to_thread(sources.check_bundle, data)
        except sources.SourceError as exc:
            raise InvalidRequest(str(exc)) from None
        digest = await sources.push_bundle(service.bus, data)
        return json_response({"digest": digest, "size": len(data)}, 201)

    @app.get("/v1/bundles/{digest}")
    async def bundle_info(digest: str) -> Response:
        if not sources.DIGEST.fullmatch(digest):
            raise InvalidRequest("a bundle digest is sha256: followed by 64 lower-case hex digits")
        if not await sources.bundle_exists(service.bus, digest):
            raise NotFound(f"bundle {digest} is not stored")
        return json_response({"digest": digest})

    @app.get("/v1/rollouts")
    async def list_rollouts(state: str | None = None, group_id: str | None = None, limit_: int = 1000) -> Response:
        if group_id is not None and not valid_id(group_id):
            raise InvalidRequest(f"group_id must match {ID_PATTERN}")
        if not 1 <= limit_ <= 100_000:
            raise InvalidRequest("limit_ must be between 1 and 100000")
        if state is not None and state not in _STATES:
            raise InvalidRequest(f"unknown state {state!r}; one of {', '.join(sorted(_STATES))}")
        records = await service.store.list(state=state, limit=limit_)
        if group_id is not None:
            records = [r for r in records if r.group_id == group_id]
        return json_response({"rollouts": [view(r) for r in records]})

    @app.get("/v1/rollouts/{rollout_id}")
    async def get_rollout(rollout_id: str) -> Response:
        record, _ = await service.store.get(rollout_id)
        return json_response(view(record))

    @app.get("/v1/rollouts/{rollout_id}/wait")
    async def wait_rollout(rollout_id: str, timeout: float = 30.0) -> Response:
        if not 0 <= timeout <= 300:
            raise InvalidRequest("timeout must be between 0 and 300 seconds")
        record = await service.wait(rollout_id, timeout)
        return json_response(view(record))

    @app.post("/v1/rollouts/{rollout_id}/cancel")
    async def cancel_rollout(rollout_id: str) -> Response:
        return json_response(view(await service.cancel(rollout_id)))

    @app.get("/v1/rollouts/{rollout_id}/events")
    async def rollout_events(rollout_id: str) -> StreamingResponse:
        await service.store.get(rollout_id)  # 404 before the stream starts

        async def sse():
            async for event in service.events(rollout_id):
                if event is None:
                    yield b": keep-alive\n\n"
                else:
                    yield b"event: state\ndata: " + encode(event) + b"\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    # -------------------------------------------------------------- the proxy

    @app.get("/proxy/{rollout_id}/v1/models")
    async def proxy_models(rollout_id: str, request: Request) -> Response:
        record = await service.authorize(rollout_id, request.headers.get("authorization"),
                                         request.headers.get("x-api-key"))
        return json_response(models_answer(record.model, record.created_at))

    # documented here; served by ``RolloutApp`` before FastAPI routing (the hot path)
    @app.post("/proxy/{rollout_id}/v1/chat/completions")
    async def proxy_chat(rollout_id: str, request: Request) -> Response:
        return await proxied(service, rollout_id, request, "openai.chat")

    @app.post("/proxy/{rollout_id}/v1/completions")
    async def proxy_completions(rollout_id: str, request: Request) -> Response:
        return await proxied(service, rollout_id, request, "openai.completions")

    @app.post("/proxy/{rollout_id}/v1/messages")
    async def proxy_messages(rollout_id: str, request: Request) -> Response:
        return await proxied(service, rollout_id, request, "anthropic.messages")

    # -------------------------------------------------------------- the judge route

    @app.post("/judge/{rollout_id}/v1/chat/completions")
    async def judge_chat(rollout_id: str, request: Request) -> Response:
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


async def proxied(service: RolloutService, rollout_id: str, request: Request, api: Api) -> Response:
    """The FastAPI form of a proxied call (documents the routes; ``RolloutApp`` serves them)."""
    record = await service.authorize(rollout_id, request.headers.get("authorization"),
                                     request.headers.get("x-api-key"))
    payload = _payload(await read_body(request, service.settings.max_body_bytes))
    answer = await service.proxy.call(record, api, payload)
    if isinstance(answer, (bytes, dict)):
        return Response(answer if isinstance(answer, bytes) else encode(answer), media_type="application/json")
    return RelayResponse(answer, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def models_answer(model: str, created: float) -> dict[str, Any]:
    """``GET /v1/models``: the rollout's model, in a shape both SDKs read (OpenAI's list
    fields, and Anthropic's ``type`` / ``display_name`` / ``created_at`` and paging)."""
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    entry = {"id": model, "object": "model", "created": int(created), "owned_by": "arena",
             "type": "model", "display_name": model, "created_at": created_at}
    return {"object": "list", "data": [entry], "has_more": False, "first_id": model, "last_id": model}


def _payload(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None


_PROXY_PATH = re.compile(r"^/proxy/([^/]+)/v1/(chat/completions|completions|messages)$")
#: the same routes as sent on the wire (a percent-encoded target is left to ASGI, which decodes it)
_PROXY_TARGET = re.compile(rb"^/proxy/([^/%?]+)/v1/(chat/completions|completions|messages)(?:\?[^#]*)?$")
_APIS: dict[str, Api] = {"chat/completions": "openai.chat", "completions": "openai.completions",
                         "messages": "anthropic.messages"}
_JSON_HEAD = [(b"content-type", b"application/json")]
_SSE_HEAD = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
             (b"x-accel-buffering", b"no")]


class RolloutApp:
    """The ASGI app. The proxy's POST routes are served here in plain ASGI (no routing,
    request objects, dependency solving or middleware on every LLM call); everything
    else goes to FastAPI. Under ``arena_core.runtime.serve`` the server's protocol answers
    the proxy's routes itself (``fast_routes``, no ASGI cycle at all); both ways run
    ``_answer``."""

    def __init__(self, service: RolloutService, api: FastAPI):
        self.service = service
        self.api = api
        self.limit = service.settings.max_body_bytes
        self.fast_routes = _ProxyRoutes(self)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _PROXY_PATH.match(scope["path"])
            if match is not None:
                headers = dict(scope["headers"])
                answer = await self._answer(match[1], _APIS[match[2]], headers.get(b"authorization"),
                                            headers.get(b"x-api-key"),
                                            partial(self._body, receive, headers.get(b"content-length")))
                if isinstance(answer, Relay):
                    await _send_stream(send, receive, answer)
                else:
                    await _send_whole(send, *answer)
                return
        await self.api(scope, receive, send)

    async def _answer(self, rollout_id: str, api: Api, authorization: bytes | None, api_key: bytes | None,
                      read_body: Callable[[], Awaitable[bytes]]) -> tuple[int, bytes] | Relay:
        """One proxied call: the key checked, then the body read, then the call made. A
        whole answer or an error is ``(status, JSON body)``; a stream is its ``Relay``."""
        try:
            if not valid_id(rollout_id):
                raise InvalidRequest(f"a rollout id must match {ID_PATTERN} (1-128 characters)")
            record = await self.service.authorize(rollout_id, authorization and authorization.decode("latin-1"),
                                                  api_key and api_key.decode("latin-1"))
            answer = await self.service.proxy.call(record, api, _payload(await read_body()))
        except ArenaError as exc:
            return exc.status, encode(ErrorResponse(error=ErrorBody(code=exc.code, message=exc.message)))
        except Exception as exc:  # noqa: BLE001 - never a stack trace to the client
            log.exception("unhandled error on a proxied %s call of rollout %s", api, rollout_id)
            return 500, encode(ErrorResponse(error=ErrorBody(code="internal",
                                                             message=f"internal error: {type(exc).__name__}")))
        if isinstance(answer, bytes):
            return 200, answer
        if isinstance(answer, dict):
            return 200, encode(answer)
        return answer

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
        return _nonempty(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    async def _fast(self, exchange: Exchange, rollout_id: str, api: Api) -> None:
        answer = await self._answer(rollout_id, api, exchange.header(b"authorization"), exchange.header(b"x-api-key"),
                                    partial(self._exchange_body, exchange))
        if isinstance(answer, Relay):
            await _fast_stream(exchange, answer)
        else:
            await exchange.respond(answer[0], answer[1])

    @staticmethod
    async def _exchange_body(exchange: Exchange) -> bytes:
        try:
            return _nonempty(await exchange.read())
        except BodyTooLarge as exc:
            raise PayloadTooLarge(str(exc)) from None
        except ClientGone as exc:
            raise InvalidRequest(str(exc)) from None


class _ProxyRoutes:
    """The proxy's POST routes, for the server's protocol (``arena_core.fastroutes``)."""

    def __init__(self, app: RolloutApp):
        self._app = app
        self.body_limit = app.limit

    def match(self, method: bytes, target: bytes) -> Callable[[Exchange], Awaitable[None]] | None:
        if method != b"POST":
            return None
        match = _PROXY_TARGET.match(target)
        if match is None:
            return None
        return partial(self._app._fast, rollout_id=match[1].decode("latin-1"), api=_APIS[match[2].decode()])


def _nonempty(body: bytes) -> bytes:
    if not body:
        raise InvalidRequest("request body is empty; send a JSON object")
    return body


async def _send_whole(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEAD, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _pump(relay: Relay, write: Callable[[bytes, bool], Awaitable[None]]) -> None:
    """Hand a relay's pieces to ``write(piece, last)``: the response's head goes out with
    the first piece and its end with the last (the client wakes once for each)."""
    ended = False
    async for piece in relay:  # after the last piece, one more turn lets the relay finish
        ended = relay.final
        await write(piece, ended)
    if not ended:
        await write(b"", True)


async def _send_stream(send, receive, relay: Relay) -> None:
    """Relay SSE pieces as they come; a client that goes away stops the relay at once (its
    step is still recorded, ``incomplete``), and the relay is always closed."""
    started = False

    async def write(piece: bytes, last: bool) -> None:
        nonlocal started
        if not started:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEAD})
            started = True
        await send({"type": "http.response.body", "body": piece, "more_body": not last})

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
        await _pump(relay, write)
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


async def _fast_stream(exchange: Exchange, relay: Relay) -> None:
    """``_send_stream`` on the server's protocol: the exchange cancels this task when the
    client goes away mid-stream."""
    this = asyncio.current_task()
    try:
        if exchange.disconnected:  # gone while the call was being made: nothing to relay
            return
        exchange.begin_stream(200, _SSE_HEAD)
        exchange.cancel_on_disconnect = True
        await _pump(relay, exchange.write)
    except asyncio.CancelledError:
        if not exchange.disconnected:
            raise
        this.uncancel()
    finally:
        exchange.cancel_on_disconnect = False
        await relay.aclose()
