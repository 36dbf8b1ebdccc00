"""An agent's large diff is kept once, in the ``arena_artifacts`` object store, not in ClickHouse.

A diff over ``INLINE_DIFF_BYTES`` (up to ``ARENA_MAX_DIFF_BYTES``, 10 MiB) cost the trajectory
service about 12 times its size at its peak when it went into the ``sandbox_results`` and
``trajectories`` rows: a JSON string inside a JSON row twice over, and chDB's own buffers
for each insert (~4x the row). So ``decode_sandbox_done`` stores it as the rollout's artifact
``diff`` (key ``{rollout_id}/diff.json``: the diff as a JSON string, exactly the bytes it
had in the ``SandboxDone`` message, never decoded here) and the rows keep a ``SandboxDone``
with ``diff == ""`` and that reference in ``artifacts``. Where a whole trajectory leaves
the service it is put back: spliced into the trainer-stream message as those same bytes
(``raw_sandbox``), decoded for the API (``restored``), so what a trainer or an API reader
sees is unchanged. See docs/trajectory.md (Storage, Large diffs).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec
import nats
from nats.js.errors import ObjectDeletedError, ObjectNotFoundError

from arena_core.bus import Bus, PartsReader
from arena_core.errors import Unavailable
from arena_core.schemas import SandboxDone, Trajectory

log = logging.getLogger("arena.trajectory.diffs")

#: A diff longer than this (bytes of its JSON string) is kept in the object store.
INLINE_DIFF_BYTES = 64 * 1024
#: The artifact name a spilled diff is recorded under in ``SandboxDone.artifacts``.
DIFF_ARTIFACT = "diff"


class RawDiffDone(SandboxDone, kw_only=True):
    """A ``SandboxDone`` whose diff is its JSON string as it is on the wire (``msgspec.Raw``):
    decoding into it makes no string of the diff, encoding it copies those bytes as they are."""

    diff: msgspec.Raw = msgspec.Raw(b'""')  # type: ignore[assignment]


_raw_diff_decoder = msgspec.json.Decoder(RawDiffDone)
_done_decoder = msgspec.json.Decoder(SandboxDone)
_FIELDS = tuple(f for f in SandboxDone.__struct_fields__ if f not in ("diff", "artifacts"))


#: Where a message's diff goes: no JSON encoder writes a raw NUL byte (a string's control
#: characters are escaped), so this ``msgspec.Raw`` is found in the encoded message exactly once.
MARK = b"\x00arena:diff\x00"


def diff_key(rollout_id: str) -> str:
    """The object-store key of a rollout's spilled diff (the sandbox plane's ``{rollout_id}/{name}``)."""
    return f"{rollout_id}/{DIFF_ARTIFACT}.json"


def spilled(done: SandboxDone | None) -> bool:
    """Whether ``done``'s diff is kept in the object store (``decode_sandbox_done``)."""
    return done is not None and not done.diff and done.artifacts.get(DIFF_ARTIFACT) == diff_key(done.rollout_id)


async def decode_sandbox_done(bus: Bus, data: bytes) -> SandboxDone:
    """The ``SandboxDone`` message ``data``; a diff over ``INLINE_DIFF_BYTES`` is stored in the
    object store (its JSON bytes, read from ``data`` in place) and replaced by its reference.
    Storing again (a redelivery) writes the same bytes. Raises ``msgspec.DecodeError``."""
    head = _raw_diff_decoder.decode(data)  # the diff stays a view of ``data``
    if len(head.diff) <= INLINE_DIFF_BYTES or DIFF_ARTIFACT in head.artifacts:
        return _done_decoder.decode(data)
    key = diff_key(head.rollout_id)
    try:
        store = await bus.artifacts()
        await store.put(key, PartsReader([memoryview(head.diff)]))
    except (nats.errors.Error, TimeoutError) as exc:
        raise Unavailable(f"cannot store the diff of rollout {head.rollout_id} as {key}: {exc}") from exc
    return SandboxDone(**{f: getattr(head, f) for f in _FIELDS}, diff="",
                       artifacts={**head.artifacts, DIFF_ARTIFACT: key})


async def diff_json(bus: Bus, done: SandboxDone) -> bytes | None:
    """The JSON string of ``done``'s spilled diff; ``None`` (logged) if it is gone from the store."""
    key = done.artifacts[DIFF_ARTIFACT]
    try:
        return await bus.read_object(key)
    except (ObjectNotFoundError, ObjectDeletedError):
        log.warning("rollout %s: its diff %s is not in the object store", done.rollout_id, key,
                    extra={"rollout_id": done.rollout_id})
        return None
    except (nats.errors.Error, TimeoutError) as exc:
        raise Unavailable(f"cannot read the diff of rollout {done.rollout_id} ({key}): {exc}") from exc


def _unreferenced(done: SandboxDone) -> dict[str, str]:
    return {k: v for k, v in done.artifacts.items() if k != DIFF_ARTIFACT}


def marked(done: SandboxDone) -> SandboxDone:
    """``done`` for a message whose diff is spliced in at ``MARK`` (``Bus.publish_parts``):
    its JSON is the ``SandboxDone`` the sandbox sent with ``MARK`` in place of the diff."""
    return RawDiffDone(**{f: getattr(done, f) for f in _FIELDS}, diff=msgspec.Raw(MARK), artifacts=_unreferenced(done))


def split_at_mark(data: bytes) -> tuple[memoryview, memoryview]:
    """The encoded message ``data`` before and after ``MARK`` (views, no copies)."""
    at = data.index(MARK)
    view = memoryview(data)
    return view[:at], view[at + len(MARK):]


async def raw_sandbox(bus: Bus, done: SandboxDone) -> SandboxDone:
    """``done`` for a message: a spilled diff as the JSON bytes it arrived as (a ``RawDiffDone``,
    which encodes as the ``SandboxDone`` the sandbox sent); ``done`` itself if not spilled or gone."""
    if not spilled(done):
        return done
    data = await diff_json(bus, done)
    if data is None:
        return done
    return RawDiffDone(**{f: getattr(done, f) for f in _FIELDS}, diff=msgspec.Raw(data),
                       artifacts=_unreferenced(done))


async def restore(bus: Bus, done: SandboxDone) -> SandboxDone:
    """``done`` as the sandbox sent it, its spilled diff decoded (a diff gone stays a reference)."""
    if not spilled(done):
        return done
    data = await diff_json(bus, done)
    if data is None:
        return done
    diff = msgspec.json.decode(data, type=str)
    del data
    return msgspec.structs.replace(done, diff=diff, artifacts=_unreferenced(done))


async def restored(bus: Bus | None, t: Trajectory) -> Trajectory:
    """``t`` with its sandbox's diff restored (``t`` itself without a bus or a spilled diff)."""
    if bus is None or t.sandbox is None or not spilled(t.sandbox):
        return t
    return msgspec.structs.replace(t, sandbox=await restore(bus, t.sandbox))


async def restored_all(bus: Bus | None, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """``restored`` of each, one at a time."""
    return [await restored(bus, t) for t in trajectories]
