"""Rollout records in the ``arena_rollouts`` KV bucket, updated by compare-and-set.

``RecordCache`` is an in-process replica of the bucket's live (non-final) records, fed
by a KV watch and by this process's own writes, so the proxy's hot path (key and
budget checks) needs no round trip to NATS. It answers only while its watch runs;
a final record is dropped and never comes back, so an ended rollout's key is refused.

To keep an ended rollout out, the cache remembers which rollouts ended (a stale,
non-final revision of one can still arrive through a lagging watch after this process
wrote its final revision). That memory is bounded: the ``max_ended`` most recently ended,
the oldest forgotten first. Forgetting one is safe once the watch has delivered its final
revision (the watch is in revision order, so nothing older of it can still come), which
takes milliseconds; forgetting one the watch has not reached yet is logged as a warning:
the bound is then too small for the watch's lag.

A caller can await a rollout's final record (``until_final``): the cache hands it over as it
learns it, from this process's own write or from the watch, so waiting for a rollout to end
costs no subscription and no read of the bucket.

The cache also remembers the project of each group it has seen a member of, ended or not
(``group_project``; the ``max_ended`` most recent groups): a group id an OpenEnv client names
is then refused to another project even after its members ended (docs/projects.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from arena_core.bus import follow_kv
from arena_core.errors import ArenaError, Conflict, InvalidRequest, NotFound
from arena_core.schemas import ID_PATTERN, valid_id, RolloutRecord

log = logging.getLogger("arena.rollout.store")

_decoder = msgspec.json.Decoder(RolloutRecord)
_encoder = msgspec.json.Encoder()


#: Ended rollouts a ``RecordCache`` remembers by default (``ARENA_ROLLOUT_CACHE_ENDED``).
MAX_ENDED = 100_000


class RecordCache:
    def __init__(self, *, max_ended: int = MAX_ENDED) -> None:
        if max_ended < 1:
            raise ValueError("RecordCache: max_ended must be >= 1")
        #: called with each final record as the cache learns it (once per rollout; no I/O)
        self.on_final: list[Callable[[RolloutRecord], None]] = []
        self._live: dict[str, tuple[RolloutRecord, int]] = {}
        #: ended rollouts -> the revision that ended them, oldest first (bounded by ``max_ended``)
        self._final: OrderedDict[str, int] = OrderedDict()
        self.max_ended = max_ended
        self.seen_revision = 0  # the highest revision the watch has delivered
        self.watching = False
        #: rollout id -> futures waiting for its final record (``until_final``)
        self._waiters: dict[str, set[asyncio.Future[RolloutRecord | None]]] = {}
        #: group id -> the project of its first member seen, most recently seen last (bounded)
        self._groups: OrderedDict[str, str] = OrderedDict()

    def group_project(self, group_id: str) -> str | None:
        """The project of ``group_id``'s members (None: no member seen, or forgotten)."""
        return self._groups.get(group_id)

    def _saw_group(self, record: RolloutRecord) -> None:
        if record.group_id is None:
            return
        if record.group_id in self._groups:
            self._groups.move_to_end(record.group_id)
            return
        self._groups[record.group_id] = record.project
        while len(self._groups) > self.max_ended:
            self._groups.popitem(last=False)

    def get(self, rollout_id: str) -> RolloutRecord | None:
        if not self.watching:
            return None
        entry = self._live.get(rollout_id)
        return entry[0] if entry is not None else None

    def entry(self, rollout_id: str) -> tuple[RolloutRecord, int] | None:
        """(record, revision) of a live rollout, or None."""
        return self._live.get(rollout_id) if self.watching else None

    def live(self) -> list[RolloutRecord]:
        """Every live (non-final) rollout the cache holds; empty until its watch has caught up."""
        return [record for record, _ in self._live.values()] if self.watching else []

    def newer(self, rollout_id: str, revision: int) -> bool:
        """Whether ``revision`` of ``rollout_id`` could change what the cache holds."""
        if rollout_id in self._final:
            return False
        current = self._live.get(rollout_id)
        return current is None or revision > current[1]

    def ended(self, rollout_id: str) -> bool:
        """Whether the cache remembers ``rollout_id`` as ended."""
        return rollout_id in self._final

    def until_final(self, rollout_id: str) -> asyncio.Future[RolloutRecord | None] | None:
        """A future of ``rollout_id``'s final record, set when the cache learns it; ``None``
        when the cache cannot promise that (not watching, or the rollout is not one of its live
        ones: ended already, or not seen yet). The future's result is ``None`` when the watch
        stops first: look in the bucket then. Cancel it (or let it end) when no longer needed."""
        if not self.watching or rollout_id not in self._live:
            return None
        future: asyncio.Future[RolloutRecord | None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(rollout_id, set()).add(future)
        future.add_done_callback(lambda f: self._forget_waiter(rollout_id, f))
        return future

    def _forget_waiter(self, rollout_id: str, future: asyncio.Future) -> None:
        waiting = self._waiters.get(rollout_id)
        if waiting is not None:
            waiting.discard(future)
            if not waiting:
                del self._waiters[rollout_id]

    def _wake(self, rollout_id: str, record: RolloutRecord | None) -> None:
        for future in list(self._waiters.pop(rollout_id, ())):
            if not future.done():
                future.set_result(record)

    def put(self, record: RolloutRecord, revision: int) -> None:
        rid = record.rollout_id
        if rid in self._final:
            return
        self._saw_group(record)
        if record.state.is_final:
            self._final[rid] = revision
            self._live.pop(rid, None)
            self._wake(rid, record)
            for listener in self.on_final:
                listener(record)
            while len(self._final) > self.max_ended:
                old, ended_at = self._final.popitem(last=False)
                if ended_at > self.seen_revision:
                    log.warning("forgot ended rollout %s before the KV watch passed its final revision %d "
                                "(at %d): raise ARENA_ROLLOUT_CACHE_ENDED (now %d)", old, ended_at,
                                self.seen_revision, self.max_ended)
            return
        current = self._live.get(rid)
        if current is None or revision > current[1]:
            self._live[rid] = (record, revision)

    async def watch(self, kv, stop: asyncio.Event) -> None:
        """Follow the bucket until ``stop``; the cache answers once the initial values are in."""

        def on_entry(entry) -> None:
            if entry.revision > self.seen_revision:
                self.seen_revision = entry.revision
            if entry.value is None or entry.operation is not None:
                return  # records are never deleted by Arena
            if not self.newer(entry.key, entry.revision):
                return  # this process's own write, already in (no need to decode it again)
            try:
                self.put(_decoder.decode(entry.value), entry.revision)
            except msgspec.DecodeError as exc:
                log.error("arena_rollouts key %s is not a RolloutRecord: %s", entry.key, exc)

        def on_ready() -> None:
            self.watching = True

        try:
            await follow_kv(kv, stop, on_entry, on_ready)
        finally:
            self.watching = False
            for rid in list(self._waiters):  # nothing will tell them now: they look for themselves
                self._wake(rid, None)


class RolloutStore:
    def __init__(self, kv, *, cache: RecordCache | None = None, publisher: object = None):
        """Compare-and-set writes are nats-py's ``kv.update`` (a JetStream publish with
        ``Nats-Expected-Last-Subject-Sequence``). ``publisher`` is accepted and not used:
        callers written for the bus's former lean connection still pass ``Bus.publisher``."""
        del publisher
        self.kv = kv
        self.cache = cache if cache is not None else RecordCache()

    async def create(self, record: RolloutRecord) -> int:
        try:
            revision = await self.kv.create(record.rollout_id, _encoder.encode(record))
        except KeyWrongLastSequenceError:
            raise Conflict(f"rollout {record.rollout_id} already exists") from None
        self.cache.put(record, revision)
        return revision

    async def get(self, rollout_id: str) -> tuple[RolloutRecord, int]:
        if not valid_id(rollout_id):  # never a key the bucket would refuse, never a bus call
            raise InvalidRequest(f"a rollout id must match {ID_PATTERN} (1-128 characters)")
        try:
            entry = await self.kv.get(rollout_id)
        except KeyNotFoundError:
            raise NotFound(f"no rollout {rollout_id!r}") from None
        if entry.value is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        return _decoder.decode(entry.value), entry.revision

    async def current(self, rollout_id: str) -> RolloutRecord:
        """The record from the cache when it is watching, else from the bucket."""
        cached = self.cache.get(rollout_id)
        if cached is not None:
            return cached
        record, _ = await self.get(rollout_id)
        return record

    async def update(
        self, rollout_id: str, change: Callable[[RolloutRecord], RolloutRecord], *, attempts: int = 50
    ) -> tuple[RolloutRecord, RolloutRecord]:
        """Apply ``change`` with compare-and-set, retrying on a lost race.

        ``change`` may raise (e.g. ``Conflict`` for a forbidden transition); that
        propagates. Returns (before, after). The first attempt starts from the cached
        record when there is one (a stale one only costs a retry: the revision guards it).
        """
        cached = self.cache.entry(rollout_id)
        for _ in range(attempts):
            if cached is not None:
                (before, revision), cached = cached, None
                try:
                    after = change(before)
                except ArenaError:
                    continue  # decided on a stale record perhaps: decide again on the stored one
                if after is before:
                    continue
            else:
                before, revision = await self.get(rollout_id)
                after = change(before)
                if after is before:
                    return before, after
            try:
                new_revision = await self._compare_and_set(rollout_id, _encoder.encode(after), revision)
            except KeyWrongLastSequenceError:
                continue
            self.cache.put(after, new_revision)
            return before, after
        raise Conflict(f"rollout {rollout_id}: too much contention updating the record")

    async def _compare_and_set(self, rollout_id: str, data: bytes, revision: int) -> int:
        """Write ``data`` if the key is still at ``revision``; the new revision. Raises
        ``KeyWrongLastSequenceError`` when another writer got there first."""
        return await self.kv.update(rollout_id, data, last=revision)

    async def list(self, *, state: str | None = None, limit: int = 1000,
                   project: str | None = None) -> list[RolloutRecord]:
        """Up to ``limit`` records (of ``project`` only, when given)."""
        try:
            keys = await self.kv.keys()
        except Exception:  # noqa: BLE001 - nats raises NoKeysError on an empty bucket
            return []
        out: list[RolloutRecord] = []
        for key in keys:
            try:
                record, _ = await self.get(key)
            except NotFound:
                continue
            if (state is None or record.state.value == state) and (project is None or record.project == project):
                out.append(record)
        out.sort(key=lambda r: r.created_at)
        return out[-limit:]
