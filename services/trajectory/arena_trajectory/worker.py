"""Wiring of the trajectory plane: three batch consumers, store first, then publish, then ack.

``trajectory-steps``, ``trajectory-results`` and ``trajectory-states`` (assembly and publishing
on a final state), and ``GroupTimeouts`` for partial groups. See docs/trajectory.md (Messages, Assembly).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
from nats.js.errors import NotFoundError

from arena_core import metrics, subjects, telemetry
from arena_core.bus import Bus, Delivery
from arena_core.errors import Permanent
from arena_core.runtime import every
from arena_core.schemas import GroupCompleted, RolloutStateChanged, SandboxDone, Step, Trajectory, VerificationResult
from arena_trajectory import assembler, diffs, duels
from arena_trajectory.batching import BatchConsumer, Dead, Item, Retry, Verdict
from arena_trajectory.caches import (
    MemberCache,
    RawSteps,
    RecentSet,
    ResultCache,
    StepCache,
    StoredStep,
    first_per_index,
)
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import RowError, group_row, step_row
from arena_trajectory.wire import encode_group, encode_trajectory

log = logging.getLogger("arena.trajectory")

TRAJECTORIES_STREAM = "ARENA_TRAJECTORIES"
SANDBOX_DONE_PREFIX = "arena.sandbox.done."
VERIFY_DONE_PREFIX = "arena.verify.done."

_step_decoder = msgspec.json.Decoder(Step)
_verification_decoder = msgspec.json.Decoder(VerificationResult)


class TrajectoryWorker:
    """The batch handlers of the three consumers, sharing one store and one bus."""

    def __init__(
        self,
        bus: Bus,
        store: TrajectoryStore,
        *,
        retry_delay: float = 0.25,
        give_up_after: int = 60,
        max_deliver: int = 80,
        ack_wait: float = 10.0,
        batch_size: int = 2000,
        state_batch_size: int = 1024,
        state_concurrency: int = 2,  # a batch of final states waits on its parts, stores, publishes: overlap two
        group_timeout: float = 0.0,
        wait_for_parts: float = 2.0,
        linger: float = 0.2,  # a ClickHouse insert costs milliseconds of CPU however small: few, large ones
    ):
        if give_up_after >= max_deliver:
            raise ValueError("give_up_after must be below max_deliver, or states are dead-lettered instead")
        self.bus = bus
        self.store = store
        self.retry_delay = retry_delay
        self.give_up_after = give_up_after
        self.max_deliver = max_deliver
        self.ack_wait = ack_wait
        self.batch_size = batch_size
        self.state_batch_size = state_batch_size
        self.state_concurrency = state_concurrency
        self.group_timeout = group_timeout
        self.wait_for_parts = wait_for_parts
        self.linger = linger
        self._members = MemberCache()
        self._steps = StepCache()
        self._results = ResultCache()
        #: rollouts whose trajectory message this process saw stored (a group refers to them)
        self._on_stream = RecentSet(200_000)
        #: one trajectory with its large diff read back at a time (``_publish_trajectory``)
        self._restoring = asyncio.Lock()
        self._progress = asyncio.Event()  # set whenever steps or results were stored
        #: one set per waiting ``_waves``: the rollouts whose steps or results were stored since it last looked
        self._touched: list[set[str]] = []

    def consumers(self) -> list:
        out: list = [
            BatchConsumer(self.bus, stream="ARENA_STEPS", durable=subjects.CONSUMER_TRAJ_STEPS,
                          filter_subjects=["arena.step.*", subjects.STEP_PACKS], message_type=msgspec.Raw,
                          handler=self.on_steps,
                          batch_size=self.batch_size, max_deliver=self.max_deliver, ack_wait=self.ack_wait,
                          linger=self.linger, concurrency=2),
            BatchConsumer(self.bus, stream="ARENA_RESULTS", durable=subjects.CONSUMER_TRAJ_RESULTS,
                          filter_subjects=[SANDBOX_DONE_PREFIX + "*", VERIFY_DONE_PREFIX + "*"],
                          message_type=msgspec.Raw, handler=self.on_results, batch_size=self.batch_size,
                          max_deliver=self.max_deliver, ack_wait=self.ack_wait, linger=self.linger),
            BatchConsumer(self.bus, stream="ARENA_ROLLOUTS", durable=subjects.CONSUMER_TRAJ_STATES,
                          filter_subjects=["arena.rollout.state.*"], message_type=RolloutStateChanged,
                          handler=self.on_states, batch_size=self.state_batch_size, max_deliver=self.max_deliver,
                          ack_wait=self.ack_wait, linger=self.linger, concurrency=self.state_concurrency),
        ]
        if self.group_timeout > 0:
            out.append(GroupTimeouts(self))
        return out

    # ----------------------------------------------------------------- handlers

    async def on_steps(self, items: list[Item]) -> list[Verdict]:
        """Store the steps as they arrived (their JSON is the row's body); an invalid one is
        dead-lettered."""
        verdicts: list[Verdict] = []
        steps: list[StoredStep] = []
        rows: list[bytes] = []
        for raw, delivery in items:
            try:
                step = _step_decoder.decode(raw)
                rows.append(step_row(step, body=raw))
            except msgspec.DecodeError as exc:  # includes ValidationError
                verdicts.append(Dead(f"undecodable message on {delivery.subject}: {exc}"))
            except RowError as exc:
                verdicts.append(Dead(str(exc)))
            else:
                steps.append(StoredStep(step, raw))
                verdicts.append(None)
        await self.store.insert_step_rows(rows)
        metrics.STEPS_STORED.inc(len(steps))
        self._steps.add(steps)  # only once stored
        self._stored({s.step.rollout_id for s in steps})
        return verdicts

    async def on_results(self, items: list[Item]) -> list[Verdict]:
        """Two message types share this consumer; the subject says which one it is."""
        verdicts: list[Verdict] = []
        sandboxes: list[SandboxDone] = []
        verifications: list[VerificationResult] = []
        for raw, delivery in items:
            verdict: Verdict = None
            try:
                if delivery.subject.startswith(SANDBOX_DONE_PREFIX):
                    # a large diff goes to the object store as the bytes it has in ``raw``, its
                    # reference into the rows and the cache (docs/trajectory.md, Large diffs)
                    sandboxes.append(await diffs.decode_sandbox_done(self.bus, raw))
                elif delivery.subject.startswith(VERIFY_DONE_PREFIX):
                    verifications.append(_verification_decoder.decode(raw))
                else:
                    verdict = Dead(f"unexpected subject {delivery.subject}")
            except msgspec.DecodeError as exc:  # includes ValidationError
                verdict = Dead(f"undecodable message on {delivery.subject}: {exc}")
            verdicts.append(verdict)
        await self.store.insert_sandbox_results(sandboxes)
        await self.store.insert_verifications(verifications)
        self._results.add(sandboxes, verifications)  # only once stored
        self._stored({r.rollout_id for r in sandboxes} | {r.rollout_id for r in verifications})
        return verdicts

    def _stored(self, rollout_ids: set[str]) -> None:
        """Parts of ``rollout_ids`` were stored: wake the waiting final states."""
        for touched in self._touched:
            touched |= rollout_ids
        self._progress.set()

    async def on_states(self, items: list[Item]) -> list[Verdict]:
        await self.store.insert_states([event for event, _ in items])
        finals: dict[str, tuple[RolloutStateChanged, Delivery]] = {}
        for event, delivery in items:
            if event.to_state.is_final:
                finals.setdefault(event.rollout_id, (event, delivery))
        outcome = await self._finish(finals) if finals else {}
        return [outcome.get(event.rollout_id) if event.to_state.is_final else None for event, _ in items]

    # ----------------------------------------------------------------- assembly

    async def _finish(self, finals: dict[str, tuple[RolloutStateChanged, Delivery]]) -> dict[str, Verdict]:
        """Assemble, store and publish the trajectories of ``finals``; a verdict per rollout.
        Rollouts whose parts are all at hand go first, the others as their parts arrive
        (``_waves``), so a trajectory never waits for an unrelated rollout of its batch."""
        rids = list(finals)
        already = await self.store.stored_rollouts(rids)
        verdicts: dict[str, Verdict] = {}
        first = True
        first_tries = {rid for rid in rids if finals[rid][1].num_delivered == 1}
        async for todo in self._waves({rid: finals[rid][0] for rid in rids if rid not in already}, first_tries):
            if todo or (first and already):
                verdicts.update(await self._complete(finals, todo, already=already if first else set()))
            first = False
        return verdicts

    async def _complete(self, finals: dict[str, tuple[RolloutStateChanged, Delivery]], todo: list[str], *,
                        already: set[str]) -> dict[str, Verdict]:
        """Assemble, store and publish ``todo`` (not stored yet) and publish ``already`` (stored
        before: a redelivery after a crash between store and ack) again."""
        t0 = time.perf_counter()
        stored = await self.store.trajectories_many(sorted(already)) if already else {}
        # what this process stored is at hand; the rest (stored before a restart, or by
        # another replica, or not yet) is read from the store
        steps = {rid: self._steps.pop(rid) for rid in todo if self._steps.count(rid) >= finals[rid][0].steps}
        steps.update(await self.store.stored_steps_many([rid for rid in todo if rid not in steps]))
        sandboxes = {rid: got for rid in todo if (got := self._results.sandboxes.get(rid))}
        verifications = {rid: got for rid in todo if (got := self._results.verifications.get(rid))}
        unsure = [rid for rid in todo if self._missing_in_cache(finals[rid][0], steps=len(steps.get(rid, ())))]
        if unsure:
            sandboxes.update(_latest(sandboxes, await self.store.sandbox_results_many(unsure)))
            verifications.update(_latest(verifications, await self.store.verifications_many(unsure)))
        need_history = [rid for rid in todo if not finals[rid][0].history]  # a final event carries it
        histories = await self.store.histories_many(need_history) if need_history else {}
        verdicts: dict[str, Verdict] = {}
        new: list[Trajectory] = []
        raw: dict[str, RawSteps] = {}
        for rid in todo:
            event, delivery = finals[rid]
            kept = first_per_index(steps.get(rid, []))
            ordered = [s.step for s in kept]
            missing = assembler.missing_parts(event, ordered, sandboxes.get(rid), verifications.get(rid))
            if missing and delivery.num_delivered < self.give_up_after:
                # grows to 1 s: with the defaults the wait spans ~1 minute, longer than a
                # crashed consumer's redelivery (ack_wait) plus a restart
                delay = min(self.retry_delay * delivery.num_delivered, max(self.retry_delay, 1.0))
                verdicts[rid] = Retry(f"waiting for {', '.join(missing)}", delay)
                self._steps.add(kept)  # still stored; keep them at hand for the next try
                continue
            if missing:
                log.warning("rollout %s: assembling without %s after %d deliveries", rid, ", ".join(missing),
                            delivery.num_delivered, extra={"rollout_id": rid})
            new.append(assembler.assemble(event, ordered, sandboxes.get(rid), verifications.get(rid),
                                          incomplete=missing, history=histories.get(rid, []),
                                          merge_sequences=False))  # derived: readers assemble them
            raw[rid] = {s.step.step_index: s.raw for s in kept}
            self._results.forget(rid)
        t1, stored_from = time.perf_counter(), time.time()
        await self.store.insert_trajectories(new, steps_stored=True)  # read from ``steps`` above
        t2 = time.perf_counter()
        _measure_stored(new, finals, start=stored_from, end=time.time())
        for t in new:
            log.info("trajectory %s: %s, reward %s, %d steps", t.rollout_id, t.final_state.value, t.reward,
                     len(t.steps), extra={"rollout_id": t.rollout_id, "group_id": t.group_id})
        await self._announce_duels(new)
        # (Nats-Msg-Id and the look-up in ``_publish_once`` keep a re-published one from doubling)
        ready = [*(stored[rid] for rid in finals if rid in stored), *new]
        self._members.add(ready, raw)
        results = await asyncio.gather(*(self._publish_trajectory(t, raw.get(t.rollout_id), look_up=t.rollout_id in already)
                                         for t in ready), return_exceptions=True)
        for t, result in zip(ready, results):
            verdicts[t.rollout_id] = _verdict(result, self.retry_delay)
        group_ids = sorted({t.group_id for t in ready if t.group_id is not None and verdicts[t.rollout_id] is None})
        t3 = time.perf_counter()
        # a group with a member stored for the first time just now cannot have been published
        fresh = {t.group_id for t in new if t.group_id is not None}
        completed = await self._complete_groups(group_ids, fresh=fresh)
        log.debug("finished %d rollouts: gathered %.3f s, stored %.3f s, published trajectories %.3f s, groups %.3f s",
                  len(new), t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        for gid, result in zip(group_ids, completed):
            if result is not None:  # the group is retried through its members' states
                for t in ready:
                    if t.group_id == gid and verdicts[t.rollout_id] is None:
                        verdicts[t.rollout_id] = result
        return verdicts

    async def _announce_duels(self, new: list[Trajectory]) -> None:
        """A ``DuelRoundDone`` notice on core NATS for each duel round ``new`` decided. A notice,
        not data (the rounds are stored): one that cannot be sent is logged, never retried."""
        try:
            for notice in await duels.decided_rounds(self.store, new):
                await self.bus.nc.publish(subjects.duel_done(notice.duel_id), msgspec.json.encode(notice))
        except Exception as exc:  # noqa: BLE001 - the trajectories are stored; readers can poll the API
            log.warning("duel notice not sent: %s: %s", type(exc).__name__, exc)

    def _missing_in_cache(self, event: RolloutStateChanged, *, steps: int | None = None) -> bool:
        """Whether a part of the rollout is not among what this process stored (``steps``:
        how many steps are at hand, if not the cached ones)."""
        rid = event.rollout_id
        return bool(assembler.missing_counts(
            event, self._steps.count(rid) if steps is None else steps,
            has_sandbox=rid in self._results.sandboxes, has_verification=rid in self._results.verifications))

    async def _waves(self, events: dict[str, RolloutStateChanged], may_wait: set[str]) -> AsyncIterator[list[str]]:
        """The rollouts of ``events`` in waves, each once: first those whose parts this
        process has at hand, whose steps are already in the store (stored before a
        restart, or by another replica) or that are not in ``may_wait`` (a redelivered
        state: it waited once already), then, while the other consumers of this process
        keep storing (a final state usually overtakes its last steps and results: they come
        on other streams), those whose parts arrive, for up to ``wait_for_parts`` seconds;
        last whatever is still missing (retried, or given up on, as before). So a rollout
        whose parts never come holds its batch once, not on every retry."""
        touched: set[str] = set()  # stored since the last look: only these can have become complete
        self._touched.append(touched)
        try:
            missing = {rid for rid, event in events.items() if rid in may_wait and self._missing_in_cache(event)}
            waiting = [rid for rid in events if rid in missing]
            ready = [rid for rid in events if rid not in missing]
            if waiting and self.wait_for_parts > 0:
                stored = await self.store.step_counts(waiting)
                ready += [rid for rid in waiting if stored.get(rid, 0) >= events[rid].steps]
                waiting = [rid for rid in waiting if stored.get(rid, 0) < events[rid].steps]
            else:
                ready, waiting = list(events), []
            yield ready
            deadline = time.monotonic() + self.wait_for_parts
            while waiting:
                self._progress.clear()  # before looking: what is stored from now on sets it again
                candidates = touched.intersection(waiting)
                touched.clear()
                arrived = {rid for rid in candidates if not self._missing_in_cache(events[rid])}
                if arrived:
                    waiting = [rid for rid in waiting if rid not in arrived]
                    yield [rid for rid in events if rid in arrived]
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._progress.wait(), min(left, 0.25))
                except asyncio.TimeoutError:
                    break  # nothing stored for a while: stop waiting
            if waiting:
                yield waiting
        finally:
            self._touched.remove(touched)

    async def _publish_trajectory(self, t: Trajectory, raw: RawSteps | None, *, look_up: bool) -> None:
        """Publish ``t`` (its steps as the JSON they arrived as, where ``raw`` has it). A
        trajectory is published only after it is stored, so one that was not stored before
        this batch was never published: only redeliveries need the look-up. A diff kept in
        the object store (``diffs``) is read back into the message: one such trajectory at a
        time, its copies freed before the next."""
        subject = subjects.trajectory(t.task_id, t.rollout_id)
        if look_up and await self._on_trajectories(subject):
            self._on_stream.add(t.rollout_id)
            return
        msg_id = subjects.msg_id(t.rollout_id, "trajectory", 0)
        if diffs.spilled(t.sandbox):
            async with self._restoring:  # one such diff in memory at a time
                diff = await diffs.diff_json(self.bus, t.sandbox)
                if diff is not None:  # the message around the diff, and the diff's JSON as it arrived: never joined
                    head, tail = diffs.split_at_mark(encode_trajectory(
                        msgspec.structs.replace(t, sandbox=diffs.marked(t.sandbox)), raw))
                    await self.bus.publish_parts(subject, [head, diff, tail], msg_id=msg_id)
                    del diff, head, tail
                    self._on_stream.add(t.rollout_id)
                    return
        await self._publish_once(subject, encode_trajectory(t, raw), msg_id, look_up=False)
        self._on_stream.add(t.rollout_id)

    async def _complete_groups(self, group_ids: list[str], *, allow_partial: bool = False,
                               fresh: set[str] = frozenset()) -> list[Verdict]:
        """Publish a ``GroupCompleted`` for each whole (or, with ``allow_partial``, any)
        group not published yet. Members store their trajectory before their group is
        read, so the batch holding a group's last member always sees it whole. ``fresh``:
        groups that cannot be on the stream yet (no look-up before publishing them)."""
        if not group_ids:
            return []
        done = await self.store.published_groups([g for g in group_ids if g not in fresh])
        todo = [g for g in group_ids if g not in done]
        cached = {g: got for g in todo if (got := self._members.whole(g)) is not None}  # stored by us: whole
        if not allow_partial:  # only groups whose every member is stored, by any replica
            whole = await self.store.whole_groups([g for g in todo if g not in cached])
            todo = [g for g in todo if g in whole or g in cached]
        members = {g: cached.get(g) for g in todo}
        members.update(await self.store.groups_many([g for g, m in members.items() if m is None or allow_partial]))
        groups = [assembler.complete_group(members[g], allow_partial=allow_partial) if g in members else None
                  for g in group_ids]
        results = await asyncio.gather(*(self._publish_group(g, look_up=g.group_id not in fresh)
                                         for g in groups if g is not None),
                                       return_exceptions=True)
        outcome = iter(results)
        verdicts: list[Verdict] = []
        rows = []
        for group in groups:
            if group is None:
                verdicts.append(None)
                continue
            result = next(outcome)
            verdicts.append(_verdict(result, self.retry_delay))
            if not isinstance(result, BaseException):
                rows.append(group_row(group_id=group.group_id, task_id=group.task_id, size=group.size,
                                      members=len(group.trajectories), partial=group.partial))
        await self.store.insert_groups(rows)
        for row in rows:
            self._members.forget(row["group_id"])
        return verdicts

    async def _publish_group(self, group: GroupCompleted, *, look_up: bool = True) -> None:
        """Publish ``group``, which refers to its members' trajectory messages: each member
        not known to be on the stream (published by another replica, before a restart, or
        its publish failed) is published first (unless the stream holds it)."""
        unsure = [t for t in group.trajectories if t.rollout_id not in self._on_stream]
        await asyncio.gather(*(self._publish_trajectory(t, self._members.raw(t.rollout_id), look_up=True)
                               for t in unsure))
        published = await self._publish_once(subjects.group(group.group_id), encode_group(group),
                                             f"{group.group_id}:group:0", look_up=look_up)
        if published:
            log.info("group %s %s: rewards %s", group.group_id,
                     f"partial, missing {group.missing_indexes}" if group.partial else "complete", group.rewards,
                     extra={"group_id": group.group_id})

    async def _publish_once(self, subject: str, data: bytes, msg_id: str, *, look_up: bool = True) -> bool:
        """Publish unless the stream already holds a message on ``subject``.

        The ``Nats-Msg-Id`` only de-duplicates inside the server's window (minutes); the
        look-up keeps a much later redelivery from putting a second copy on the
        training stream. Returns whether a new message was stored.
        """
        if look_up and await self._on_trajectories(subject):
            return False
        ack = await self.bus.publish(subject, data, msg_id=msg_id)
        return not ack.duplicate

    async def _on_trajectories(self, subject: str) -> bool:
        """Whether the trainer stream holds a message on ``subject``."""
        try:
            await self.bus.js.get_last_msg(TRAJECTORIES_STREAM, subject)
        except NotFoundError:
            return False
        return True


def _measure_stored(new: list[Trajectory], finals: dict[str, tuple[RolloutStateChanged, Delivery]], *,
                    start: float, end: float) -> None:
    """Stored trajectories in the metrics, and a ``storage`` span each in its rollout's trace
    (the final state's message carries it): the batch's insert, from ``start`` to ``end``."""
    for t in new:
        metrics.TRAJECTORIES_STORED.labels(final_state=t.final_state.value).inc()
    if not telemetry.enabled():
        return
    for t in new:
        telemetry.record_span("storage", parent=finals[t.rollout_id][1].headers, start=start, end=end,
                              attributes={"arena.rollout_id": t.rollout_id, "arena.steps": len(t.steps),
                                          "arena.final_state": t.final_state.value, "arena.batch": len(new)})


def _latest(cached: dict, stored: dict) -> dict:
    """Per rollout, the later (by ``finished_at``) of the cached and the stored result."""
    return {rid: got for rid, got in stored.items() if rid not in cached or got.finished_at > cached[rid].finished_at}


def _verdict(result: object, delay: float) -> Verdict:
    if isinstance(result, Permanent):
        return Dead(str(result))
    if isinstance(result, BaseException):
        return Retry(f"{type(result).__name__}: {result}", max(delay, 1.0))
    return None


class GroupTimeouts:
    """Publishes a ``partial`` group for every group whose first member was stored more
    than ``group_timeout`` seconds ago and that has no group message yet."""

    def __init__(self, worker: TrajectoryWorker):
        self.worker = worker
        self.interval = min(max(worker.group_timeout / 4, 0.2), 10.0)

    async def run(self, stop: asyncio.Event) -> None:
        await every(stop, self.interval, self.sweep, what="group timeout sweep")

    async def sweep(self) -> int:
        overdue = await self.worker.store.overdue_groups(older_than=time.time() - self.worker.group_timeout)
        if overdue:
            await self.worker._complete_groups(overdue, allow_partial=True)  # noqa: SLF001 - same plane
        return len(overdue)
