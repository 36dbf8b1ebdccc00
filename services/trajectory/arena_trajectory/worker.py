"""Wiring of the trajectory plane: three batch consumers, store first, then publish, then ack.

- ``trajectory-steps``   ARENA_STEPS    ``arena.step.*``           -> one INSERT per fetch batch
- ``trajectory-results`` ARENA_RESULTS  ``arena.sandbox.done.*``,
                                        ``arena.verify.done.*``    -> one INSERT per table per batch
- ``trajectory-states``  ARENA_ROLLOUTS ``arena.rollout.state.*``  -> store every transition; for the
  final ones: assemble, store and publish the ``Trajectory``s, then publish each
  ``GroupCompleted`` that became whole.
- ``GroupTimeouts`` (no consumer): publishes a ``partial`` group once a group has waited
  ``group_timeout`` seconds for its last members.

Every batch is acked only after its effect is stored, so the ack means "stored"; a
redelivered batch rewrites the same rows (ReplacingMergeTree). The three streams are read
independently, so a final state can overtake the last steps or results: that state is
retried until they are stored, and after ``give_up_after`` deliveries assembled with what
is there (``Trajectory.incomplete`` says what is missing).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.js.errors import NotFoundError

from arena import subjects
from arena.bus import Bus, Delivery
from arena.errors import Permanent
from arena.schemas import GroupCompleted, RolloutStateChanged, SandboxDone, Step, Trajectory, VerificationResult, encode
from arena_trajectory import assembler
from arena_trajectory.batching import BatchConsumer, Dead, Item, Retry, Verdict
from arena_trajectory.store import TrajectoryStore
from arena_trajectory.tables import group_row

log = logging.getLogger("arena.trajectory")

TRAJECTORIES_STREAM = "ARENA_TRAJECTORIES"
SANDBOX_DONE_PREFIX = "arena.sandbox.done."
VERIFY_DONE_PREFIX = "arena.verify.done."

_sandbox_decoder = msgspec.json.Decoder(SandboxDone)
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
        batch_size: int = 1000,
        state_batch_size: int = 256,
        group_timeout: float = 0.0,
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
        self.group_timeout = group_timeout
        self._members = MemberCache()
        self._steps = StepCache()

    def consumers(self) -> list:
        out: list = [
            BatchConsumer(self.bus, stream="ARENA_STEPS", durable=subjects.CONSUMER_TRAJ_STEPS,
                          filter_subjects=["arena.step.*"], message_type=Step, handler=self.on_steps,
                          batch_size=self.batch_size, max_deliver=self.max_deliver, ack_wait=self.ack_wait),
            BatchConsumer(self.bus, stream="ARENA_RESULTS", durable=subjects.CONSUMER_TRAJ_RESULTS,
                          filter_subjects=[SANDBOX_DONE_PREFIX + "*", VERIFY_DONE_PREFIX + "*"],
                          message_type=msgspec.Raw, handler=self.on_results, batch_size=self.batch_size,
                          max_deliver=self.max_deliver, ack_wait=self.ack_wait),
            BatchConsumer(self.bus, stream="ARENA_ROLLOUTS", durable=subjects.CONSUMER_TRAJ_STATES,
                          filter_subjects=["arena.rollout.state.*"], message_type=RolloutStateChanged,
                          handler=self.on_states, batch_size=self.state_batch_size, max_deliver=self.max_deliver,
                          ack_wait=self.ack_wait),
        ]
        if self.group_timeout > 0:
            out.append(GroupTimeouts(self))
        return out

    # ----------------------------------------------------------------- handlers

    async def on_steps(self, items: list[Item]) -> None:
        steps = [step for step, _ in items]
        await self.store.insert_steps(steps)
        self._steps.add(steps)  # only once stored

    async def on_results(self, items: list[Item]) -> list[Verdict]:
        """Two message types share this consumer; the subject says which one it is."""
        verdicts: list[Verdict] = []
        sandboxes: list[SandboxDone] = []
        verifications: list[VerificationResult] = []
        for raw, delivery in items:
            verdict: Verdict = None
            try:
                if delivery.subject.startswith(SANDBOX_DONE_PREFIX):
                    sandboxes.append(_sandbox_decoder.decode(raw))
                elif delivery.subject.startswith(VERIFY_DONE_PREFIX):
                    verifications.append(_verification_decoder.decode(raw))
                else:
                    verdict = Dead(f"unexpected subject {delivery.subject}")
            except msgspec.DecodeError as exc:  # includes ValidationError
                verdict = Dead(f"undecodable message on {delivery.subject}: {exc}")
            verdicts.append(verdict)
        await self.store.insert_sandbox_results(sandboxes)
        await self.store.insert_verifications(verifications)
        return verdicts

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
        """Assemble, store and publish the trajectories of ``finals``; a verdict per rollout."""
        rids = list(finals)
        already = await self.store.stored_rollouts(rids)
        stored = await self.store.trajectories_many(sorted(already)) if already else {}
        todo = [rid for rid in rids if rid not in already]
        steps = {rid: self._steps.pop(rid) for rid in todo}
        steps = {rid: got for rid, got in steps.items() if len(got) >= finals[rid][0].steps}
        steps.update(await self.store.steps_for_many([rid for rid in todo if rid not in steps]))
        sandboxes = await self.store.sandbox_results_many(todo)
        verifications = await self.store.verifications_many(todo)
        histories = await self.store.histories_many(todo)
        verdicts: dict[str, Verdict] = {}
        new: list[Trajectory] = []
        for rid in todo:
            event, delivery = finals[rid]
            ordered = assembler.dedupe_steps(steps.get(rid, []))
            missing = assembler.missing_parts(event, ordered, sandboxes.get(rid), verifications.get(rid))
            if missing and delivery.num_delivered < self.give_up_after:
                # grows to 1 s: with the defaults the wait spans ~1 minute, longer than a
                # crashed consumer's redelivery (ack_wait) plus a restart
                delay = min(self.retry_delay * delivery.num_delivered, max(self.retry_delay, 1.0))
                verdicts[rid] = Retry(f"waiting for {', '.join(missing)}", delay)
                continue
            if missing:
                log.warning("rollout %s: assembling without %s after %d deliveries", rid, ", ".join(missing),
                            delivery.num_delivered, extra={"rollout_id": rid})
            new.append(assembler.assemble(event, ordered, sandboxes.get(rid), verifications.get(rid),
                                          incomplete=missing, history=histories.get(rid, [])))
        await self.store.insert_trajectories(new, steps_stored=True)  # read from ``steps`` above
        for t in new:
            log.info("trajectory %s: %s, reward %s, %d steps", t.rollout_id, t.final_state.value, t.reward,
                     len(t.steps), extra={"rollout_id": t.rollout_id, "group_id": t.group_id})
        # a stored one is a redelivery after a crash between store and ack: publish it again
        # (Nats-Msg-Id and the look-up in ``_publish_once`` keep the stream free of doubles)
        ready = [*(stored[rid] for rid in rids if rid in stored), *new]
        self._members.add(ready)
        results = await asyncio.gather(*(self._publish_trajectory(t, look_up=t.rollout_id in already) for t in ready),
                                       return_exceptions=True)
        for t, result in zip(ready, results):
            verdicts[t.rollout_id] = _verdict(result, self.retry_delay)
        group_ids = sorted({t.group_id for t in ready if t.group_id is not None and verdicts[t.rollout_id] is None})
        for gid, result in zip(group_ids, await self._complete_groups(group_ids)):
            if result is not None:  # the group is retried through its members' states
                for t in ready:
                    if t.group_id == gid and verdicts[t.rollout_id] is None:
                        verdicts[t.rollout_id] = result
        return verdicts

    async def _publish_trajectory(self, t: Trajectory, *, look_up: bool) -> None:
        """Publish ``t``. A trajectory is published only after it is stored, so one that was
        not stored before this batch was never published: only redeliveries need the look-up."""
        await self._publish_once(subjects.trajectory(t.task_id, t.rollout_id), t,
                                 subjects.msg_id(t.rollout_id, "trajectory", 0), look_up=look_up)

    async def _complete_groups(self, group_ids: list[str], *, allow_partial: bool = False) -> list[Verdict]:
        """Publish a ``GroupCompleted`` for each whole (or, with ``allow_partial``, any)
        group not published yet. Members store their trajectory before their group is
        read, so the batch holding a group's last member always sees it whole."""
        if not group_ids:
            return []
        done = await self.store.published_groups(group_ids)
        todo = [g for g in group_ids if g not in done]
        if not allow_partial:  # only groups whose every member is stored, by any replica
            whole = await self.store.whole_groups(todo)
            todo = [g for g in todo if g in whole]
        members = {g: self._members.whole(g) for g in todo}
        members.update(await self.store.groups_many([g for g, m in members.items() if m is None or allow_partial]))
        groups = [assembler.complete_group(members[g], allow_partial=allow_partial) if g in members else None
                  for g in group_ids]
        results = await asyncio.gather(*(self._publish_group(g) for g in groups if g is not None),
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

    async def _publish_group(self, group: GroupCompleted) -> None:
        published = await self._publish_once(subjects.group(group.group_id), group, f"{group.group_id}:group:0")
        if published:
            log.info("group %s %s: rewards %s", group.group_id,
                     f"partial, missing {group.missing_indexes}" if group.partial else "complete", group.rewards,
                     extra={"group_id": group.group_id})

    async def _publish_once(self, subject: str, message: msgspec.Struct, msg_id: str, *, look_up: bool = True) -> bool:
        """Publish unless the stream already holds a message on ``subject``.

        The ``Nats-Msg-Id`` only de-duplicates inside the server's window (minutes); the
        look-up keeps a much later redelivery from putting a second copy on the
        training stream. Returns whether a new message was stored.
        """
        data = encode(message)
        if len(data) > self.bus.nc.max_payload:
            # retrying cannot help; dead-letter the state with a clear reason (docs/trajectory.md, limits)
            raise Permanent(f"{subject}: {len(data)} bytes exceed the NATS max_payload of {self.bus.nc.max_payload}")
        if look_up:
            try:
                await self.bus.js.get_last_msg(TRAJECTORIES_STREAM, subject)
                return False
            except NotFoundError:
                pass
        ack = await self.bus.publish(subject, data, msg_id=msg_id)
        return not ack.duplicate


class StepCache:
    """Steps this process stored, by rollout, until its trajectory is assembled: the
    final state usually finds them here instead of reading them back. A rollout's
    cached steps are used only if they are all there (else the store is read). Bounded."""

    def __init__(self, max_steps: int = 50_000):
        self.max_steps = max_steps
        self._rollouts: dict[str, dict[int, Step]] = {}
        self._count = 0

    def add(self, steps: list[Step]) -> None:
        for step in steps:
            got = self._rollouts.setdefault(step.rollout_id, {})
            if step.step_index not in got:
                self._count += 1
            got[step.step_index] = step
        while self._count > self.max_steps and self._rollouts:
            self._count -= len(self._rollouts.pop(next(iter(self._rollouts))))  # the oldest rollout

    def pop(self, rollout_id: str) -> list[Step]:
        got = self._rollouts.pop(rollout_id, {})
        self._count -= len(got)
        return [got[i] for i in sorted(got)]


class MemberCache:
    """Trajectories this process assembled, by group, until their group is published:
    the batch that completes a group usually finds its members here instead of reading
    them back from ClickHouse. Bounded; on a miss the store is read."""

    def __init__(self, max_trajectories: int = 20_000):
        self.max_trajectories = max_trajectories
        self._groups: dict[str, dict[int, Trajectory]] = {}
        self._count = 0

    def add(self, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            if t.group_id is None:
                continue
            members = self._groups.setdefault(t.group_id, {})
            if t.group_index not in members:
                self._count += 1
            members[t.group_index] = t
        while self._count > self.max_trajectories and self._groups:
            self.forget(next(iter(self._groups)))  # the oldest group

    def whole(self, group_id: str) -> list[Trajectory] | None:
        members = self._groups.get(group_id)
        if not members:
            return None
        size = next(iter(members.values())).group_size
        return [members[i] for i in sorted(members)] if len(members) >= size else None

    def forget(self, group_id: str) -> None:
        self._count -= len(self._groups.pop(group_id, {}))


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
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
                break
            except asyncio.TimeoutError:
                pass
            try:
                await self.sweep()
            except Exception as exc:  # noqa: BLE001 - the next sweep retries
                log.warning("group timeout sweep failed: %s: %s", type(exc).__name__, exc)

    async def sweep(self) -> int:
        overdue = await self.worker.store.overdue_groups(older_than=time.time() - self.worker.group_timeout)
        if overdue:
            await self.worker._complete_groups(overdue, allow_partial=True)  # noqa: SLF001 - same plane
        return len(overdue)
