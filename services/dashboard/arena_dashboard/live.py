"""The NATS side of the live view: core subscriptions to rollout state changes, trainer
metrics and finished duels, handed to the ``LiveFeed`` (JetStream subjects reach core
subscribers too; nothing here is acked or durable: a missed event only costs a re-fetch)."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from arena_core import owners
from arena_core.bus import Bus
from arena_core.schemas import RolloutStateChanged, TrainerMetrics
from arena_dashboard.fanout import LiveFeed, compact_state

log = logging.getLogger("arena.dashboard.live")

STATES = "arena.rollout.state.>"
TRAINER = "arena.trainer.metrics.>"
DUELS = "arena.duel.done.>"
#: The fields of a duel notice (``DuelRoundDone``) passed on to browsers; decoded loosely, as a
#: dict: the notice only asks for a refresh, the duel itself is read from the query API.
DUEL_FIELDS = ("duel_id", "seed", "winner", "complete", "at")


class LiveSubscriptions:
    """A runner (``arena_core.runtime.serve``): subscribe, feed, unsubscribe at ``stop``."""

    def __init__(self, bus: Bus, feed: LiveFeed):
        self.bus = bus
        self.feed = feed
        self.state_decoder = msgspec.json.Decoder(RolloutStateChanged)
        self.trainer_decoder = msgspec.json.Decoder(TrainerMetrics)
        self.bad = 0

    async def on_state(self, msg) -> None:
        if not msg.data:  # the body went to the object store (never for a state change): skip it
            return
        try:
            self.feed.on_state(compact_state(self.state_decoder.decode(msg.data)))
        except msgspec.DecodeError as exc:
            self._bad(msg.subject, exc)

    async def on_trainer(self, msg) -> None:
        try:
            metrics = self.trainer_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            self._bad(msg.subject, exc)
            return
        project = (msg.headers or {}).get(owners.PROJECT_HEADER) or owners.DEFAULT_PROJECT
        self.feed.on_trainer(msgspec.to_builtins(metrics), project)

    async def on_duel(self, msg) -> None:
        try:
            notice = msgspec.json.decode(msg.data) if msg.data else {}
        except msgspec.DecodeError as exc:
            self._bad(msg.subject, exc)
            return
        if not isinstance(notice, dict):
            notice = {}
        out = {k: notice[k] for k in DUEL_FIELDS if k in notice}
        out.setdefault("duel_id", msg.subject.rsplit(".", 1)[-1])
        project = notice.get("project") if isinstance(notice.get("project"), str) else owners.DEFAULT_PROJECT
        self.feed.on_duel(out, project)

    def _bad(self, subject: str, exc: Exception) -> None:
        self.bad += 1
        if self.bad <= 10 or self.bad % 1000 == 0:
            log.warning("undecodable message on %s (%d so far): %s", subject, self.bad, exc,
                        extra={"subject": subject})

    async def run(self, stop: asyncio.Event) -> None:
        nc = self.bus.nc
        subs = [await nc.subscribe(STATES, cb=self.on_state),
                await nc.subscribe(TRAINER, cb=self.on_trainer),
                await nc.subscribe(DUELS, cb=self.on_duel)]
        reconnects = nc.stats.get("reconnects", 0)
        try:
            while not stop.is_set():  # after a NATS outage, pages re-seed what they missed
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
                if nc.stats.get("reconnects", 0) != reconnects:
                    reconnects = nc.stats.get("reconnects", 0)
                    log.info("NATS reconnected: live pages re-seed")
                    self.feed.on_reconnect()
        finally:
            for sub in subs:
                try:
                    await sub.unsubscribe()
                except Exception:  # noqa: BLE001 - the connection is closing anyway
                    pass
