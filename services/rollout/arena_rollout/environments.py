"""Environments: tasks served over OpenEnv's protocol at ``/openenv/{name}``, kept in the
``arena_environments`` bucket (their private part in ``arena_verifiers``, as a rollout's).
docs/openenv.md.
"""

from __future__ import annotations

import time

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from arena_core import owners, subjects
from arena_core.apikeys import ApiKey
from arena_core.errors import Conflict, InvalidRequest, NotFound
from arena_core.schemas import EnvironmentRecord, EnvironmentRequest, EnvironmentView, SubmitRolloutRequest, valid_id

_decoder = msgspec.json.Decoder(EnvironmentRecord)
#: Seconds a replica trusts what it read of an environment (a change reaches every replica within it).
CACHE_S = 2.0


def view(record: EnvironmentRecord, public_url: str) -> EnvironmentView:
    task = record.request.task
    return EnvironmentView(name=record.name, task_id=task.id, url=f"{public_url.rstrip('/')}/openenv/{record.name}",
                           provider=record.request.provider, max_concurrent=record.request.max_concurrent,
                           hosted=task.environment is not None, created_at=record.created_at, owner=record.owner)


def as_submission(req: EnvironmentRequest) -> SubmitRolloutRequest:
    return SubmitRolloutRequest(task=req.task, sampling=req.sampling, model=req.model, provider=req.provider,
                                metadata=req.metadata)


class Environments:
    """The registry, read through a short cache (every WebSocket frame does not go to NATS)."""

    def __init__(self, service) -> None:
        self.service = service
        self._cache: dict[str, tuple[float, EnvironmentRecord]] = {}

    async def _kv(self):
        return await self.service.bus.kv(subjects.KV_ENVIRONMENTS)

    async def put(self, name: str, req: EnvironmentRequest, caller: ApiKey | None = None) -> EnvironmentRecord:
        """Register (or replace) ``name``, owned by ``caller``; one that exists is replaced only
        by its owner or an admin key (403 otherwise), compare-and-set against the one checked."""
        if not valid_id(name):
            raise InvalidRequest("an environment name follows the id grammar (letters, digits, _ - and single dots)")
        if name == "k":
            raise InvalidRequest("an environment may not be named 'k': /openenv/k/ is where a key goes")
        if not req.task.agent.external:
            raise InvalidRequest("an environment's task is played by an OpenEnv client: set task.agent to "
                                 "{\"external\": true}")
        kv = await self._kv()
        _, revision = await self._checked(kv, name, caller)  # refused before anything is stored
        accepted, (ref, budget) = await self.service._accept(as_submission(req), external=True)
        public = msgspec.structs.replace(req, task=accepted.task)
        record = EnvironmentRecord(name=name, request=public, verifier_ref=ref, verify_budget_s=budget,
                                   created_at=time.time(), owner=owners.owner_of(caller))
        try:
            if revision is None:
                await kv.create(name, msgspec.json.encode(record))
            else:
                await kv.update(name, msgspec.json.encode(record), last=revision)
        except KeyWrongLastSequenceError:
            raise Conflict(f"environment {name!r} changed while it was being replaced; try again") from None
        self._cache[name] = (time.monotonic(), record)
        return record

    async def _checked(self, kv, name: str, caller: ApiKey | None) -> tuple[EnvironmentRecord | None, int | None]:
        """The stored environment and its revision (``None``s when there is none), read afresh
        (never the cache), once ``caller`` may change it; 403 otherwise."""
        try:
            entry = await kv.get(name)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None:
            return None, entry.revision if entry is not None else None
        record = _decoder.decode(entry.value)
        owners.check(record.owner, caller, f"environment {name!r}")
        return record, entry.revision

    async def get(self, name: str) -> EnvironmentRecord:
        if not valid_id(name):
            raise NotFound(await self.not_found(name))
        hit = self._cache.get(name)
        if hit is not None and time.monotonic() - hit[0] < CACHE_S:
            return hit[1]
        try:
            entry = await (await self._kv()).get(name)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None:
            self._cache.pop(name, None)
            raise NotFound(await self.not_found(name))
        record = _decoder.decode(entry.value)
        self._cache[name] = (time.monotonic(), record)
        return record

    async def names(self) -> list[str]:
        """The registered environments' names, sorted."""
        try:
            return sorted(await (await self._kv()).keys())
        except Exception:  # noqa: BLE001 - nats raises NoKeysError on an empty bucket
            return []

    async def not_found(self, name: str) -> str:
        """Why ``name`` is not served, naming the environments that are (at most 20)."""
        names = await self.names()
        shown = ", ".join(names[:20]) + (f", … ({len(names)} in all)" if len(names) > 20 else "")
        return (f"no environment {name!r} (registered: {shown or 'none'}; "
                f"PUT /v1/environments/{name} registers one)")

    async def list(self) -> list[EnvironmentRecord]:
        kv = await self._kv()
        try:
            names = await kv.keys()
        except Exception:  # noqa: BLE001 - nats raises NoKeysError on an empty bucket
            return []
        out = []
        for name in sorted(names):
            try:
                out.append(await self.get(name))
            except NotFound:
                continue
        return out

    async def delete(self, name: str, caller: ApiKey | None = None) -> None:
        """Only its owner or an admin key may delete it (403 otherwise)."""
        if not valid_id(name):
            raise NotFound(f"no environment {name!r}")
        kv = await self._kv()
        record, revision = await self._checked(kv, name, caller)
        if record is None:
            raise NotFound(f"no environment {name!r}")
        try:
            await kv.delete(name, last=revision)
        except KeyWrongLastSequenceError:
            raise Conflict(f"environment {name!r} changed while it was being deleted; try again") from None
        self._cache.pop(name, None)
