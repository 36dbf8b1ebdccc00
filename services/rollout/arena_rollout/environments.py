"""Environments: tasks served over OpenEnv's protocol at ``/openenv/{name}``, kept in the
``arena_environments`` bucket (their private part in ``arena_verifiers``, as a rollout's).
docs/openenv.md.
"""

from __future__ import annotations

import time

import msgspec
from nats.js.errors import KeyNotFoundError

from arena_core import subjects
from arena_core.errors import InvalidRequest, NotFound
from arena_core.schemas import EnvironmentRecord, EnvironmentRequest, EnvironmentView, SubmitRolloutRequest, valid_id

_decoder = msgspec.json.Decoder(EnvironmentRecord)
#: Seconds a replica trusts what it read of an environment (a change reaches every replica within it).
CACHE_S = 2.0


def view(record: EnvironmentRecord, public_url: str) -> EnvironmentView:
    task = record.request.task
    return EnvironmentView(name=record.name, task_id=task.id, url=f"{public_url.rstrip('/')}/openenv/{record.name}",
                           provider=record.request.provider, max_concurrent=record.request.max_concurrent,
                           hosted=task.environment is not None, created_at=record.created_at)


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

    async def put(self, name: str, req: EnvironmentRequest) -> EnvironmentRecord:
        if not valid_id(name):
            raise InvalidRequest("an environment name follows the id grammar (letters, digits, _ - and single dots)")
        if name == "k":
            raise InvalidRequest("an environment may not be named 'k': /openenv/k/ is where a key goes")
        if not req.task.agent.external:
            raise InvalidRequest("an environment's task is played by an OpenEnv client: set task.agent to "
                                 "{\"external\": true}")
        accepted, (ref, budget) = await self.service._accept(as_submission(req), external=True)
        public = msgspec.structs.replace(req, task=accepted.task)
        record = EnvironmentRecord(name=name, request=public, verifier_ref=ref, verify_budget_s=budget,
                                   created_at=time.time())
        await (await self._kv()).put(name, msgspec.json.encode(record))
        self._cache[name] = (time.monotonic(), record)
        return record

    async def get(self, name: str) -> EnvironmentRecord:
        if not valid_id(name):
            raise NotFound(f"no environment {name!r}")
        hit = self._cache.get(name)
        if hit is not None and time.monotonic() - hit[0] < CACHE_S:
            return hit[1]
        try:
            entry = await (await self._kv()).get(name)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None:
            self._cache.pop(name, None)
            raise NotFound(f"no environment {name!r} (PUT /v1/environments/{name} registers one)")
        record = _decoder.decode(entry.value)
        self._cache[name] = (time.monotonic(), record)
        return record

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

    async def delete(self, name: str) -> None:
        await self.get(name)
        await (await self._kv()).delete(name)
        self._cache.pop(name, None)
