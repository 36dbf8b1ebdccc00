"""Rollout records in the ``arena_rollouts`` KV bucket, updated by compare-and-set."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from arena.errors import Conflict, NotFound
from arena.schemas import RolloutRecord

_decoder = msgspec.json.Decoder(RolloutRecord)
_encoder = msgspec.json.Encoder()


class RolloutStore:
    def __init__(self, kv):
        self.kv = kv

    async def create(self, record: RolloutRecord) -> int:
        try:
            return await self.kv.create(record.rollout_id, _encoder.encode(record))
        except KeyWrongLastSequenceError:
            raise Conflict(f"rollout {record.rollout_id} already exists") from None

    async def get(self, rollout_id: str) -> tuple[RolloutRecord, int]:
        try:
            entry = await self.kv.get(rollout_id)
        except KeyNotFoundError:
            raise NotFound(f"no rollout {rollout_id!r}") from None
        if entry.value is None:
            raise NotFound(f"no rollout {rollout_id!r}")
        return _decoder.decode(entry.value), entry.revision

    async def update(
        self, rollout_id: str, change: Callable[[RolloutRecord], RolloutRecord], *, attempts: int = 50
    ) -> tuple[RolloutRecord, RolloutRecord]:
        """Apply ``change`` with compare-and-set, retrying on a lost race.

        ``change`` may raise (e.g. ``Conflict`` for a forbidden transition); that
        propagates. Returns (before, after).
        """
        for _ in range(attempts):
            before, revision = await self.get(rollout_id)
            after = change(before)
            if after is before:
                return before, after
            try:
                await self.kv.update(rollout_id, _encoder.encode(after), last=revision)
                return before, after
            except KeyWrongLastSequenceError:
                continue
        raise Conflict(f"rollout {rollout_id}: too much contention updating the record")

    async def list(self, *, state: str | None = None, limit: int = 1000) -> list[RolloutRecord]:
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
            if state is None or record.state.value == state:
                out.append(record)
        out.sort(key=lambda r: r.created_at)
        return out[-limit:]
