"""Tasks' private parts (their verifiers), stored apart from everything the agent or the API sees.

``put_verifier`` stores one in the KV bucket ``arena_verifiers`` under the sha256 of its JSON
(a group shares one entry); one over :data:`INLINE_MAX` bytes (a large hidden test patch) goes
to the ``arena_private`` object store (which only rollout writes and verification reads; the
artifacts every service reads never hold it) and the bucket holds a pointer. docs/tasks.md.
"""

from __future__ import annotations

import hashlib

import msgspec

from arena_core import subjects
from arena_core.schemas import Verifier

#: Verifiers up to this size live in the KV bucket itself (below NATS' default 1 MiB payload).
INLINE_MAX = 512 * 1024
OBJECT_PREFIX = "verifiers/"


class Pointer(msgspec.Struct, frozen=True, kw_only=True):
    object: str


class VerifierMissing(LookupError):
    """No verifier is stored under the key."""


async def put_verifier(bus, verifier: Verifier) -> str:
    data = msgspec.json.encode(verifier)
    key = hashlib.sha256(data).hexdigest()
    kv = await bus.kv(subjects.KV_VERIFIERS)
    if len(data) > INLINE_MAX:
        store = await bus.objects(subjects.OBJECT_PRIVATE)
        await store.put(OBJECT_PREFIX + key, data)
        data = msgspec.json.encode(Pointer(object=OBJECT_PREFIX + key))
    await kv.put(key, data)
    return key


async def get_verifier(bus, key: str) -> Verifier:
    from nats.js.errors import KeyNotFoundError

    kv = await bus.kv(subjects.KV_VERIFIERS)
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        raise VerifierMissing(f"verifier {key} is not stored") from None
    data = entry.value or b""
    raw = msgspec.json.decode(data)
    if isinstance(raw, dict) and "type" not in raw and "object" in raw:
        name = msgspec.convert(raw, Pointer).object
        try:
            data = await _object(bus, name)
        except Exception as exc:  # noqa: BLE001 - not found, or the store is unreachable
            raise VerifierMissing(f"verifier {key}: its object is not readable ({type(exc).__name__})") from exc
    return msgspec.json.decode(data, type=Verifier)


async def _object(bus, name: str) -> bytes:
    """The private object ``name``: from ``arena_private``, else (a verifier stored before that
    store existed) from ``arena_artifacts``."""
    from nats.js.errors import ObjectNotFoundError

    try:
        return bytes((await (await bus.objects(subjects.OBJECT_PRIVATE)).get(name)).data or b"")
    except ObjectNotFoundError:
        return bytes((await (await bus.artifacts()).get(name)).data or b"")
