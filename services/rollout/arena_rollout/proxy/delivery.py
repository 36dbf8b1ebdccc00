"""Whether a whole answer reached the agent, and retries of a call whose client left.

The server settles a call's ``Delivery`` once it wrote the answer. A client that gave up
first (its own timeout) leaves an orphan: the call goes on, and a retry of the same
request (same rollout, API and body) within ``RETRY_WINDOW_S`` takes its answer instead of
making a second call. An orphan no retry took is abandoned: its step is recorded with
``abandoned`` (its tokens spent; no turn, no training). docs/rollout.md, "Answers the agent
never received".
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

RETRY_WINDOW_S = 30.0

Key = tuple[str, str, bytes]


class Delivery:
    """Settled True when the answer was written to a client of the call, False when none took it."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def settle(self, delivered: bool) -> None:
        if not self._future.done():
            self._future.set_result(delivered)

    @property
    def settled(self) -> bool:
        return self._future.done()

    async def delivered(self) -> bool:
        return await asyncio.shield(self._future)


class Orphan:
    """A call whose client left before its answer: ``answer`` resolves to what the call
    answered (status, body, headers), for the retry that takes it."""

    __slots__ = ("answer", "delivery", "expiry")

    def __init__(self, delivery: Delivery) -> None:
        self.answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.delivery = delivery
        self.expiry: asyncio.TimerHandle | None = None


class Orphans:
    """Orphaned calls by (rollout, API, body digest), each kept for ``window_s``."""

    def __init__(self, window_s: float = RETRY_WINDOW_S) -> None:
        self.window_s = window_s
        self._by_key: dict[Key, Orphan] = {}
        self._rollouts: dict[str, int] = {}  # orphans per rollout: no digest for the others

    @staticmethod
    def key(rollout_id: str, api: str, body: bytes) -> Key:
        return rollout_id, api, hashlib.blake2b(body, digest_size=16).digest()

    def has(self, rollout_id: str) -> bool:
        return rollout_id in self._rollouts

    def adopt(self, key: Key, delivery: Delivery) -> Orphan:
        orphan = Orphan(delivery)
        self._put(key, orphan)
        return orphan

    def take(self, key: Key) -> Orphan | None:
        orphan = self._by_key.pop(key, None)
        if orphan is not None:
            self._forget(key[0])
            if orphan.expiry is not None:
                orphan.expiry.cancel()
        return orphan

    def put_back(self, key: Key, orphan: Orphan) -> None:
        """The retry's client left too: the next retry may take the answer."""
        if orphan.delivery.settled:
            return
        self._put(key, orphan)

    def abandon(self, rollout_id: str) -> None:
        """The rollout ended: no retry will come."""
        for key in [k for k in self._by_key if k[0] == rollout_id]:
            self._expire(key)

    def _put(self, key: Key, orphan: Orphan) -> None:
        previous = self._by_key.get(key)
        if previous is not None:  # an identical call orphaned earlier: it is abandoned now
            self._expire(key)
        self._by_key[key] = orphan
        self._rollouts[key[0]] = self._rollouts.get(key[0], 0) + 1
        orphan.expiry = asyncio.get_running_loop().call_later(self.window_s, self._expire, key)

    def _expire(self, key: Key) -> None:
        orphan = self._by_key.pop(key, None)
        if orphan is not None:
            self._forget(key[0])
            if orphan.expiry is not None:
                orphan.expiry.cancel()
            orphan.delivery.settle(False)

    def _forget(self, rollout_id: str) -> None:
        left = self._rollouts.get(rollout_id, 0) - 1
        if left > 0:
            self._rollouts[rollout_id] = left
        else:
            self._rollouts.pop(rollout_id, None)
