"""OpenEnv's protocol at ``/openenv/{name}``: one WebSocket is one episode is one rollout.

:class:`Episode` answers one connection's frames (``reset`` / ``step`` / ``state`` /
``close`` / ``mcp`` in; ``observation`` / ``state`` / ``error`` out, with OpenEnv's error
codes); each exchange with the sandbox goes to the worker that holds it over
``arena.env.{rollout_id}``. The stateless HTTP routes and ``/openapi.json`` follow OpenEnv's
server. docs/openenv.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
import nats.errors
from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

from arena_core import envtools, owners, subjects
from arena_core.apikeys import ApiKey
from arena_core.errors import ArenaError
from arena_core.schemas import (
    EnvError,
    EnvironmentRecord,
    EnvReply,
    EnvRequest,
    RolloutRecord,
    valid_id,
)

from arena_rollout.environments import as_submission

log = logging.getLogger("arena.rollout.openenv")

#: Keys of ``reset``'s data that Arena reads itself (the rest go to the environment).
ARENA_RESET_KEYS = ("group_id", "group_size", "group_index")
_reply_decoder = msgspec.json.Decoder(EnvReply)
VERSION = "1.0.0"


def error_frame(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "data": {"message": message, "code": code, **extra}}


def is_close(raw: str | bytes) -> bool:
    """Whether a frame is OpenEnv's ``close`` (its client does not wait for an answer)."""
    try:
        frame = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return False
    return isinstance(frame, dict) and frame.get("type") == "close"


def observation_frame(reply: EnvReply) -> dict[str, Any]:
    return {"type": "observation", "data": {"observation": reply.observation, "reward": reply.reward,
                                            "done": reply.done}}


class Capacity:
    """Episodes open at once per environment on this replica."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def take(self, name: str, limit: int) -> bool:
        if self.open.get(name, 0) >= limit:
            return False
        self.open[name] = self.open.get(name, 0) + 1
        return True

    def give(self, name: str) -> None:
        self.open[name] = max(0, self.open.get(name, 1) - 1)


class Episode:
    """One WebSocket's episodes (a ``reset`` ends the one before and starts another rollout).
    ``caller``: the key that opened the WebSocket (``None`` with keys off): its episodes'
    rollouts record it as their owner, and it may join only groups it may change."""

    def __init__(self, service, env: EnvironmentRecord, caller: ApiKey | None = None):
        self.service = service
        self.env = env
        self.caller = caller
        self.record: RolloutRecord | None = None
        self.pending: str | None = None  # a rollout whose reset was not answered yet
        self.pending_data: dict[str, Any] = {}
        self.seq = 0
        self.steps = 0
        self.done = False
        #: a hosted environment's action check, from its server's schema (its first reset tells it)
        self.action_check: ActionCheck | None = _KNOWN_CHECKS.get(_env_key(env))

    @property
    def hosted(self) -> bool:
        return self.env.request.task.environment is not None

    # ------------------------------------------------------------------ frames

    async def handle(self, raw: str | bytes) -> dict[str, Any] | None:
        """The reply to one frame; ``None`` for ``close`` (the server closes the socket)."""
        try:
            frame = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError) as exc:
            return error_frame("INVALID_JSON", f"Invalid JSON: {exc if isinstance(exc, msgspec.DecodeError) else 'nested too deeply'}")
        if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
            return error_frame("VALIDATION_ERROR", "Invalid message", errors=[
                {"type": "missing", "loc": ["type"], "msg": "Field required", "input": frame}])
        kind = frame["type"]
        extra = sorted(set(frame) - {"type", "data"})
        if kind not in ("reset", "step", "state", "close", "mcp"):
            return error_frame("UNKNOWN_TYPE", f"Unknown message type: {kind}")
        if extra:
            return error_frame("VALIDATION_ERROR", "Invalid message", errors=[
                {"type": "extra_forbidden", "loc": [k], "msg": "Extra inputs are not permitted"} for k in extra])
        data = frame.get("data", {} if kind in ("reset", "state", "close") else None)
        if kind in ("step", "mcp") and data is None:
            return error_frame("VALIDATION_ERROR", "Invalid message", errors=[
                {"type": "missing", "loc": ["data"], "msg": "Field required", "input": frame}])
        if data is not None and not isinstance(data, dict):
            return error_frame("VALIDATION_ERROR", "Invalid message", errors=[
                {"type": "dict_type", "loc": ["data"], "msg": "Input should be a valid dictionary"}])
        try:
            if kind == "close":
                await self.close()
                return None
            if kind == "reset":
                return await self.reset(data or {})
            if kind == "step":
                return await self.step(data)
            if kind == "state":
                return {"type": "state", "data": await self.state()}
            return {"type": "mcp", "data": await self.mcp(data)}
        except ArenaError as exc:
            return error_frame("EXECUTION_ERROR", exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - one frame's trouble is an error frame, as OpenEnv's server answers
            log.exception("OpenEnv %s frame on %s failed", kind, self.env.name)
            return error_frame("EXECUTION_ERROR", f"{type(exc).__name__}: {exc}")

    async def reset(self, data: dict[str, Any]) -> dict[str, Any]:
        if self.done:
            self.record = None  # over: its outcome stands
        if self.pending is not None and self.record is not None and self.record.rollout_id == self.pending:
            # the last reset was not answered in time: this one waits for the same episode
            return await self._reset_answer(self.pending_data)
        await self.end("reset: the client started a new episode")
        try:
            group = _group_of(data)
        except ValueError as exc:
            return error_frame("VALIDATION_ERROR", "Invalid message", errors=[
                {"type": "value_error", "loc": ["data"], "msg": str(exc)}])
        env_data = {k: v for k, v in data.items() if k not in ARENA_RESET_KEYS}
        # the submission runs whole even if the client leaves meanwhile: its rollout is then cancelled
        submission = asyncio.ensure_future(self._submit(data, group))
        try:
            record = await asyncio.shield(submission)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                made = await submission
                await self.service.cancel(made.rollout_id, reason="the OpenEnv client disconnected")
            raise
        self.record, self.seq, self.steps, self.done = record, 0, 0, False
        self.pending, self.pending_data = record.rollout_id, env_data
        return await self._reset_answer(env_data)

    async def _reset_answer(self, env_data: dict[str, Any]) -> dict[str, Any]:
        """The reset's observation once the sandbox answers; if it is not up within the answer
        budget (under OpenEnv's client timeout), an error asking to reset again, which then
        waits for the same episode rather than starting another."""
        budget = float(self.service.settings.openenv_start_timeout_s)
        reply = await self._exchange("reset", env_data, timeout_s=budget, give_up=True)
        if reply.error is not None and reply.error.code == "STILL_STARTING":
            return error_frame("EXECUTION_ERROR", f"episode {self.record.rollout_id} is still starting (its sandbox "
                               "is queued or starting): send reset again to wait for it")
        self.pending = None
        if reply.error is not None:
            return error_frame(reply.error.code, reply.error.message,
                               **({"errors": reply.error.errors} if reply.error.errors is not None else {}))
        if reply.action_schema is not None and self.hosted:
            self.action_check = ActionCheck.of(reply.action_schema)
            _KNOWN_CHECKS[_env_key(self.env)] = self.action_check
        observation = dict(reply.observation)
        if not self.hosted:  # Arena's own observation: where the client's LLM calls are captured
            observation.update(self._llm())
        return observation_frame(msgspec.structs.replace(reply, observation=observation))

    async def step(self, data: dict[str, Any]) -> dict[str, Any]:
        # the action is checked first, whatever the episode's state, as OpenEnv's server
        # deserializes it before it touches the environment
        action = None
        if not self.hosted:
            try:
                action = envtools.parse_action(data)
            except envtools.ActionError as exc:
                return error_frame("VALIDATION_ERROR", str(exc), errors=exc.errors)
        elif self.action_check is not None and (errors := self.action_check.errors(data)):
            return error_frame("VALIDATION_ERROR", "Invalid action", errors=errors)
        if self.record is None:
            return error_frame("EXECUTION_ERROR", "no episode: send reset first")
        if self.done:
            return error_frame("EXECUTION_ERROR", f"episode {self.record.rollout_id} is over: send reset to start "
                                                  "another")
        timeout_s = self.env.request.task.environment.step_timeout_s if self.hosted else 120.0
        if not self.hosted:
            if isinstance(action, envtools.CallTool) and action.tool_name == "shell":
                shell_timeout = action.arguments.get("timeout_s")
                if isinstance(shell_timeout, (int, float)) and not isinstance(shell_timeout, bool):
                    # never past the task's wall clock: the sandbox ends the episode there
                    budget = self.env.request.task.budget.wall_clock_s
                    timeout_s = max(timeout_s, min(float(shell_timeout), 3600.0, budget))
        self.seq += 1
        reply = await self._exchange("step", data, timeout_s=timeout_s + 30)
        if reply.error is not None:
            return error_frame(reply.error.code, reply.error.message,
                               **({"errors": reply.error.errors} if reply.error.errors is not None else {}))
        self.steps += 1
        if reply.done:
            self.done = True
            if not self.hosted:  # the verifier's reward, when it comes in time
                reply = await self._verified(reply)
        return observation_frame(reply)

    async def _verified(self, reply: EnvReply) -> EnvReply:
        rid = self.record.rollout_id
        record = await self.service.wait(rid, float(self.service.settings.openenv_submit_wait_s))
        self.record = record
        verification = {"rollout_state": record.state.value, "reason": record.reason}
        reward = record.reward if record.state.is_final else None
        if not record.state.is_final:
            verification["pending"] = True
        return msgspec.structs.replace(reply, reward=reward,
                                       observation={**reply.observation, "verification": verification})

    async def state(self) -> dict[str, Any]:
        if self.record is None:
            return {"episode_id": None, "step_count": 0}
        record, _ = await self.service.store.get(self.record.rollout_id)
        self.record = record
        out: dict[str, Any] = {}
        if self.hosted and not record.state.is_final and not self.done:
            reply = await self._exchange("state", {}, timeout_s=self.env.request.task.environment.step_timeout_s + 30)
            if reply.error is None and reply.state is not None:
                out.update(reply.state)
        out.setdefault("episode_id", record.rollout_id)
        out.setdefault("step_count", self.steps)
        out.update({"rollout_id": record.rollout_id, "rollout_state": record.state.value, "reward": record.reward,
                    "reason": record.reason, **self._llm()})
        return out

    async def mcp(self, request: dict[str, Any]) -> dict[str, Any]:
        return mcp_answer(request, hosted=self.hosted)

    async def close(self) -> None:
        """The client closed the episode: the sandbox ends it and what it did is verified
        (an abrupt disconnect cancels it instead)."""
        if self.record is None or self.done:
            self.record = None
            return
        self.seq += 1
        reply = await self._exchange("close", {}, timeout_s=30.0)
        if reply.error is None:
            self.record, self.done = None, True
        # else: the rollout is ended by ``end`` (cancelled)

    async def end(self, reason: str) -> None:
        """Cancel the current rollout unless it is final (the client left or reset). Raises
        when the store cannot be reached (the caller tries again)."""
        record = self.record
        if record is None:
            return
        try:
            await self.service.cancel(record.rollout_id, reason=reason)
        except ArenaError:
            pass  # final already: its outcome stands
        self.record, self.pending = None, None

    # ------------------------------------------------------------------ plumbing

    def _llm(self) -> dict[str, Any]:
        record = self.record
        base = f"{self.service.settings.public_url.rstrip('/')}/proxy/{record.rollout_id}/v1"
        return {"rollout_id": record.rollout_id, "llm_base_url": base, "llm_api_key": record.api_key}

    async def _submit(self, data: dict[str, Any], group: tuple[str | None, int, int]) -> RolloutRecord:
        req = self.env.request
        sampling = req.sampling
        seed = data.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool) and -(1 << 63) <= seed < (1 << 63):
            sampling = msgspec.structs.replace(sampling, seed=seed)
        labels = {**req.metadata, "arena.openenv.environment": self.env.name}
        episode_id = data.get("episode_id")
        if isinstance(episode_id, str) and 0 < len(episode_id) <= 255:
            labels["arena.openenv.episode_id"] = episode_id
        service = self.service
        group_id, index, size = group
        if group_id is not None:
            service.check_group(group_id, self.caller)  # naming another key's group is taking it over
        single = msgspec.structs.replace(as_submission(req), sampling=sampling, metadata=labels)
        quota = await service.quotas.of(self.env.project)  # the environment's project's queue limit too
        with service.admit(1, req.task.budget.wall_clock_s, quota):
            return await service._create(single, (self.env.verifier_ref, self.env.verify_budget_s),
                                         group_id=group_id, index=index, size=size, sampling=sampling,
                                         owner=owners.owner_of(self.caller), project=self.env.project)

    async def _exchange(self, kind: str, data: dict[str, Any], *, timeout_s: float,
                        give_up: bool = False) -> EnvReply:
        """One exchange with the sandbox worker, retried (same ``seq``) until it answers, the
        rollout ends, or ``timeout_s`` passes (then ``STILL_STARTING`` with ``give_up``)."""
        rid = self.record.rollout_id
        seq = -1 if kind == "state" else self.seq
        payload = msgspec.json.encode(EnvRequest(rollout_id=rid, seq=seq, kind=kind, data=data, timeout_s=timeout_s))
        nc = self.service.bus.nc
        if len(payload) > nc.max_payload - 16 * 1024:
            return _failed("VALIDATION_ERROR", f"the frame is too large to relay ({len(payload)} bytes; at most "
                                               f"{nc.max_payload - 16 * 1024})")
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if give_up:
                    return _failed("STILL_STARTING", "")
                return _failed("EXECUTION_ERROR", f"no answer from the sandbox of {rid} within {timeout_s:g}s")
            try:
                msg = await nc.request(subjects.env_exchange(rid), payload, timeout=min(left, 2.0))
                return _reply_decoder.decode(msg.data)
            except NoRespondersError:
                await asyncio.sleep(0.1)
            except NatsTimeout:
                pass
            except msgspec.DecodeError as exc:
                return _failed("EXECUTION_ERROR", f"the sandbox answered something that is not an EnvReply: {exc}")
            except (nats.errors.Error, OSError) as exc:  # an outage: the episode may still be there
                log.warning("exchange with the sandbox of %s: %s", rid, exc)
                await asyncio.sleep(0.2)
            try:
                record, _ = await self.service.store.get(rid)
            except ArenaError:
                raise
            except Exception:  # noqa: BLE001 - the store is unreachable now: keep trying until the deadline
                continue
            if record.state.is_final:
                self.record, self.done = record, True
                return _failed("EXECUTION_ERROR", f"episode {rid} ended: {record.state.value}: {record.reason}")


async def stateless_step(episode: Episode, action: dict[str, Any], *, start_wait_s: float) -> dict[str, Any]:
    """OpenEnv's stateless ``POST /step``: ``action`` run on a fresh environment (a rollout of its
    own: reset, this one step; the caller ends it). The answer is the step's frame: an
    observation, or the reset's or the step's error. A sandbox still starting is waited for up to
    ``start_wait_s`` (each reset waits for the same episode)."""
    deadline = time.monotonic() + start_wait_s
    while True:
        first = await episode.reset({})
        if first["type"] != "error" or episode.pending is None or episode.record is None \
                or time.monotonic() >= deadline:
            break  # up, failed, or waited long enough
    if first["type"] == "error":
        return first
    return await episode.step(action)


def _failed(code: str, message: str) -> EnvReply:
    return EnvReply(seq=-1, error=EnvError(code=code, message=message))


def _group_of(data: dict[str, Any]) -> tuple[str | None, int, int]:
    """``group_id``, ``group_index``, ``group_size`` from a reset's data (Arena's extension:
    episodes of one group get GRPO advantages together on the trainer stream)."""
    group_id = data.get("group_id")
    if group_id is None:
        return None, 0, 1
    if not isinstance(group_id, str) or not valid_id(group_id):
        raise ValueError("group_id must follow the id grammar (letters, digits, _ - and single dots)")
    size, index = data.get("group_size"), data.get("group_index")
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= 1024:
        raise ValueError("group_size must be an integer from 1 to 1024 when group_id is given")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < size:
        raise ValueError("group_index must be an integer from 0 to group_size - 1 when group_id is given")
    return group_id, index, size


# --------------------------------------------------------------------------- HTTP


def metadata(env: EnvironmentRecord) -> dict[str, Any]:
    task = env.request.task
    first = next((line.strip() for line in task.instructions.splitlines() if line.strip()), task.id)
    return {"name": env.name, "description": first[:500], "readme_content": task.instructions or None,
            "version": VERSION, "author": None, "documentation_url": None}


class ActionCheck:
    """A hosted environment's actions checked against its server's action JSON Schema, as its
    server checks them (``model_validate``), with errors shaped as pydantic's: the endpoint answers a
    bad action ``VALIDATION_ERROR`` in any state of the episode, before, during and after it."""

    def __init__(self, schema: dict[str, Any], validator):
        self.schema, self.validator = schema, validator

    @classmethod
    def of(cls, schema: dict[str, Any]) -> ActionCheck | None:
        """``None`` for a schema that is not valid JSON Schema (the server then decides alone)."""
        import jsonschema

        try:
            kind = jsonschema.validators.validator_for(schema)
            kind.check_schema(schema)
        except jsonschema.exceptions.SchemaError as exc:
            log.info("a hosted environment's action schema is not JSON Schema: %s", exc.message)
            return None
        return cls(schema, kind(schema))

    def errors(self, data: dict[str, Any]) -> list[dict[str, Any]]:
        """Pydantic-shaped errors of ``data`` ([] when valid). MCP actions (``list_tools``,
        ``call_tool``) are the server's to route, as OpenEnv's ``deserialize_action`` does."""
        if data.get("type") in ("list_tools", "call_tool"):
            return []
        out: list[dict[str, Any]] = []
        for error in sorted(self.validator.iter_errors(data), key=lambda e: list(e.absolute_path)):
            loc = list(error.absolute_path)
            if error.validator == "additionalProperties":
                known = set((error.schema or {}).get("properties", {}))
                extra = sorted(k for k in (error.instance or {}) if k not in known) or ["?"]
                out += [{"type": "extra_forbidden", "loc": [*loc, k], "msg": "Extra inputs are not permitted"}
                        for k in extra]
            elif error.validator == "required":
                missing = error.message.split("'")[1] if "'" in error.message else "?"
                out.append({"type": "missing", "loc": [*loc, missing], "msg": "Field required"})
            elif error.validator == "type":
                out.append({"type": f"{error.validator_value}_type" if isinstance(error.validator_value, str)
                            else "type_error", "loc": loc, "msg": error.message})
            else:
                out.append({"type": "value_error", "loc": loc, "msg": error.message})
        return out


#: The checks learnt from hosted servers' schemas, per environment (its project, name and
#: registration): a new session of the same environment checks its first action too.
_KNOWN_CHECKS: dict[tuple[str, str, float], ActionCheck | None] = {}


def _env_key(env: EnvironmentRecord) -> tuple[str, str, float]:
    return env.project, env.name, env.created_at


def schema(env: EnvironmentRecord) -> dict[str, Any]:
    state = {"title": "State", "type": "object", "additionalProperties": True, "properties": {
        "episode_id": {"type": ["string", "null"]}, "step_count": {"type": "integer", "minimum": 0},
        "rollout_id": {"type": "string"}, "rollout_state": {"type": "string"},
        "reward": {"type": ["number", "null"]}}}
    if env.request.task.environment is not None:
        opaque = {"type": "object", "additionalProperties": True,
                  "description": "the hosted environment's own (its /schema): Arena relays it unchanged"}
        known = _KNOWN_CHECKS.get(_env_key(env))
        action = known.schema if known is not None else {"title": "Action", **opaque}
        return {"action": action, "observation": {"title": "Observation", **opaque}, "state": state}
    return {"action": envtools.action_schema(), "observation": envtools.observation_schema(), "state": state}


def openapi(env: EnvironmentRecord) -> dict[str, Any]:
    """An OpenAPI document in the shape of an OpenEnv server's (simulation mode)."""
    obj = {"application/json": {"schema": {"type": "object"}}}
    answer = {"200": {"description": "OK", "content": obj}}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"{env.name} (Arena environment)", "version": VERSION,
                 "description": "OpenEnv's protocol; episodes over the WebSocket /ws (docs/openenv.md)."},
        "paths": {
            "/reset": {"post": {"summary": "Stateless reset (an episode needs /ws)", "requestBody": {"content": obj},
                                "responses": answer}},
            "/step": {"post": {"summary": "Stateless step (an episode needs /ws)", "requestBody": {"content": obj},
                               "responses": answer}},
            "/state": {"get": {"summary": "A fresh environment's state", "responses": answer}},
            "/health": {"get": {"summary": "Health", "responses": answer}},
            "/metadata": {"get": {"summary": "Metadata", "responses": answer}},
            "/schema": {"get": {"summary": "Action, observation and state schemas", "responses": answer}},
            "/mcp": {"post": {"summary": "MCP JSON-RPC", "requestBody": {"content": obj}, "responses": answer}},
        },
    }


def mcp_answer(request: Any, *, hosted: bool) -> dict[str, Any]:
    """JSON-RPC 2.0 over ``POST /mcp`` and the ``mcp`` frame: ``tools/list`` for Arena's tasks.
    A tool call needs an episode: the WebSocket ``step`` with a ``call_tool`` action."""
    if not isinstance(request, dict) or request.get("jsonrpc") != "2.0" or not isinstance(request.get("method"), str):
        return {"jsonrpc": "2.0", "id": request.get("id") if isinstance(request, dict) else None,
                "error": {"code": -32600, "message": "Invalid request: a JSON-RPC 2.0 request object", "data": None}}
    rid, method = request.get("id"), request["method"]
    if method == "tools/list":
        if hosted:
            return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32603, "message": (
                "a hosted environment's tools are its own: list them over /ws with a list_tools action"),
                "data": None}}
        tools = [{"name": t["name"], "description": t["description"], "inputSchema": t["input_schema"]}
                 for t in envtools.tool_list()]
        return {"jsonrpc": "2.0", "id": rid, "result": {"tools": tools}}
    if method == "tools/call":
        return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32602, "message": (
            "a tool call needs an episode: open the WebSocket /ws, reset, then step a call_tool action"),
            "data": None}}
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": f"Method not found: {method}",
                                                   "data": None}}


def initial_observation(env: EnvironmentRecord) -> dict[str, Any]:
    """What a stateless ``POST /reset`` answers: the task's first observation, with no sandbox."""
    task = env.request.task
    if task.environment is not None:
        return {"observation": {}, "reward": None, "done": False}
    return {"observation": {"prompt": task.instructions, "tools": envtools.tool_list()}, "reward": None,
            "done": False}
