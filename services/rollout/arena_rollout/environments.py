"""Environments: tasks served over OpenEnv's protocol at ``/openenv/{name}``, kept in the
``arena_environments`` bucket (their private part in ``arena_verifiers``, as a rollout's).
docs/openenv.md.

Names are per project (docs/projects.md): the ``default`` project's environment ``name`` is kept
under the key ``name`` (as before projects), another project's under ``{project}/{name}`` (a
name never holds a ``/``). A key resolves a name in its own project; a listing by an admin key
shows every project's.
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
                           hosted=task.environment is not None, created_at=record.created_at, owner=record.owner,
                           project=record.project)


#: where ``project``'s environment ``name`` is kept in the bucket, and (project, name) of a key
storage_key, split_key = owners.scoped_name, owners.split_scoped


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
        project = owners.project_of(caller)
        key = storage_key(project, name)
        _, revision = await self._checked(kv, key, caller)  # refused before anything is stored
        accepted, (ref, budget) = await self.service._accept(as_submission(req), external=True, project=project)
        public = msgspec.structs.replace(req, task=accepted.task)
        record = EnvironmentRecord(name=name, request=public, verifier_ref=ref, verify_budget_s=budget,
                                   created_at=time.time(), owner=owners.owner_of(caller), project=project)
        try:
            if revision is None:
                await kv.create(key, msgspec.json.encode(record))
            else:
                await kv.update(key, msgspec.json.encode(record), last=revision)
        except KeyWrongLastSequenceError:
            raise Conflict(f"environment {name!r} changed while it was being replaced; try again") from None
        self._cache[key] = (time.monotonic(), record)
        return record

    async def _checked(self, kv, key: str, caller: ApiKey | None) -> tuple[EnvironmentRecord | None, int | None]:
        """The stored environment (under bucket key ``key``, of the caller's project) and its
        revision (``None``s when there is none), read afresh (never the cache), once ``caller``
        may change it; 403 otherwise."""
        name = split_key(key)[1]
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None:
            return None, entry.revision if entry is not None else None
        record = _decoder.decode(entry.value)
        owners.check(record.owner, caller, f"environment {name!r}")
        return record, entry.revision

    async def get(self, name: str, caller: ApiKey | None = None, project: str | None = None) -> EnvironmentRecord:
        """``caller``'s project's environment ``name`` (404 naming that project's others when none);
        ``project``: another project's, for a key that sees it (an admin key)."""
        asked = project
        project = owners.named_in(caller, asked)
        if project is None:  # a project this key does not see: as for an unknown name
            raise NotFound(f"no environment {name!r}")
        if not valid_id(name):
            raise NotFound(await self.not_found(name, project))
        key = storage_key(project, name)
        hit = self._cache.get(key)
        if hit is not None and time.monotonic() - hit[0] < CACHE_S:
            return hit[1]
        try:
            entry = await (await self._kv()).get(key)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None:
            self._cache.pop(key, None)
            raise NotFound(await self.not_found(name, project))
        record = _decoder.decode(entry.value)
        self._cache[key] = (time.monotonic(), record)
        return record

    async def keys(self) -> list[str]:
        try:
            return sorted(await (await self._kv()).keys())
        except Exception:  # noqa: BLE001 - nats raises NoKeysError on an empty bucket
            return []

    async def names(self, project: str = owners.DEFAULT_PROJECT) -> list[str]:
        """The names of ``project``'s registered environments, sorted."""
        return sorted(name for p, name in map(split_key, await self.keys()) if p == project)

    async def not_found(self, name: str, project: str = owners.DEFAULT_PROJECT) -> str:
        """Why ``name`` is not served, naming the environments of ``project`` that are (at most 20)."""
        names = await self.names(project)
        shown = ", ".join(names[:20]) + (f", … ({len(names)} in all)" if len(names) > 20 else "")
        return (f"no environment {name!r} (registered: {shown or 'none'}; "
                f"PUT /v1/environments/{name} registers one)")

    async def list(self, project: str | None = None) -> list[EnvironmentRecord]:
        """The environments of ``project`` (``None``: of every project)."""
        kv = await self._kv()
        out = []
        for key in await self.keys():
            if project is not None and split_key(key)[0] != project:
                continue
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                continue
            if entry is not None and entry.value is not None:
                out.append(_decoder.decode(entry.value))
        return out

    async def delete(self, name: str, caller: ApiKey | None = None, project: str | None = None) -> None:
        """The caller's project's environment (``project``'s, for a key that sees it); only its
        owner or an admin key may delete it (403 otherwise)."""
        project = owners.named_in(caller, project)
        if not valid_id(name) or project is None:
            raise NotFound(f"no environment {name!r}")
        kv = await self._kv()
        key = storage_key(project, name)
        record, revision = await self._checked(kv, key, caller)
        if record is None:
            raise NotFound(f"no environment {name!r}")
        try:
            await kv.delete(key, last=revision)
        except KeyWrongLastSequenceError:
            raise Conflict(f"environment {name!r} changed while it was being deleted; try again") from None
        self._cache.pop(key, None)
