"""Wiring of the trajectory plane: three durable consumers, store first, then publish.

- ``trajectory-steps``   ARENA_STEPS    ``arena.step.*``           -> store the step
- ``trajectory-results`` ARENA_RESULTS  ``arena.sandbox.done.*``,
                                        ``arena.verify.done.*``    -> store the result
- ``trajectory-states``  ARENA_ROLLOUTS ``arena.rollout.state.*``  -> on a final state: assemble,
  store and publish the ``Trajectory``; publish ``GroupCompleted`` once the group is whole.

Every handler returns only after its effect is stored, so the ack means "stored". A store
outage is ridden out with the bus's backoff (``max_deliver`` deliveries, up to 30 s apart)
before anything is dead-lettered.
The three streams are read independently, so a final state can overtake the last steps
or results: the state is retried until they are stored, and after ``give_up_after``
deliveries assembled with what is there (``metadata["incomplete"]`` says what is missing).
"""

from __future__ import annotations

import logging

import msgspec
from nats.js.errors import NotFoundError

from arena import subjects
from arena.bus import Bus, Consumer, Delivery
from arena.errors import Permanent, Retryable
from arena.schemas import (
    GroupCompleted,
    RolloutStateChanged,
    SandboxDone,
    Step,
    Trajectory,
    VerificationResult,
    encode,
)
from arena_trajectory import assembler
from arena_trajectory.store import TrajectoryStore

log = logging.getLogger("arena.trajectory")

TRAJECTORIES_STREAM = "ARENA_TRAJECTORIES"
SANDBOX_DONE_PREFIX = "arena.sandbox.done."
VERIFY_DONE_PREFIX = "arena.verify.done."

_sandbox_decoder = msgspec.json.Decoder(SandboxDone)
_verification_decoder = msgspec.json.Decoder(VerificationResult)


class TrajectoryWorker:
    """The handlers of the three consumers, sharing one store and one bus."""

    def __init__(
        self,
        bus: Bus,
        store: TrajectoryStore,
        *,
        retry_delay: float = 0.25,
        give_up_after: int = 20,
        max_deliver: int = 40,
        step_concurrency: int = 8,
        result_concurrency: int = 4,
        state_concurrency: int = 4,
    ):
        if give_up_after >= max_deliver:
            raise ValueError("give_up_after must be below max_deliver, or states are dead-lettered instead")
        self.bus = bus
        self.store = store
        self.retry_delay = retry_delay
        self.give_up_after = give_up_after
        self.max_deliver = max_deliver
        self.step_concurrency = step_concurrency
        self.result_concurrency = result_concurrency
        self.state_concurrency = state_concurrency

    def consumers(self) -> list[Consumer]:
        return [
            Consumer(self.bus, stream="ARENA_STEPS", durable=subjects.CONSUMER_TRAJ_STEPS,
                     filter_subjects=["arena.step.*"], message_type=Step, handler=self.on_step,
                     concurrency=self.step_concurrency, max_deliver=self.max_deliver),
            Consumer(self.bus, stream="ARENA_RESULTS", durable=subjects.CONSUMER_TRAJ_RESULTS,
                     filter_subjects=[SANDBOX_DONE_PREFIX + "*", VERIFY_DONE_PREFIX + "*"],
                     message_type=msgspec.Raw, handler=self.on_result, concurrency=self.result_concurrency,
                     max_deliver=self.max_deliver),
            Consumer(self.bus, stream="ARENA_ROLLOUTS", durable=subjects.CONSUMER_TRAJ_STATES,
                     filter_subjects=["arena.rollout.state.*"], message_type=RolloutStateChanged,
                     handler=self.on_state, concurrency=self.state_concurrency, max_deliver=self.max_deliver),
        ]

    # ----------------------------------------------------------------- handlers

    async def on_step(self, step: Step, delivery: Delivery) -> None:
        await self.store.insert_step(step)

    async def on_result(self, raw: msgspec.Raw, delivery: Delivery) -> None:
        """Two message types share this consumer; the subject says which one it is."""
        try:
            if delivery.subject.startswith(SANDBOX_DONE_PREFIX):
                await self.store.insert_sandbox_result(_sandbox_decoder.decode(raw))
            elif delivery.subject.startswith(VERIFY_DONE_PREFIX):
                await self.store.insert_verification(_verification_decoder.decode(raw))
            else:
                raise Permanent(f"unexpected subject {delivery.subject}")
        except msgspec.DecodeError as exc:  # includes ValidationError
            raise Permanent(f"undecodable message on {delivery.subject}: {exc}") from exc

    async def on_state(self, event: RolloutStateChanged, delivery: Delivery) -> None:
        if not event.to_state.is_final:
            return
        rid = event.rollout_id
        trajectory = await self.store.trajectory(rid)
        if trajectory is None:
            trajectory = await self._assemble(event, delivery)
            await self.store.insert_trajectory(trajectory)
            log.info("trajectory %s: %s, reward %s, %d steps", rid, trajectory.final_state.value,
                     trajectory.reward, len(trajectory.steps), extra={"rollout_id": rid, "group_id": event.group_id})
        # already stored: a redelivery after a crash between store and ack; publish it again
        # (JetStream de-duplication and ``_publish_once`` keep the stream free of doubles)
        await self._publish_once(subjects.trajectory(trajectory.task_id, rid), trajectory,
                                 subjects.msg_id(rid, "trajectory", 0))
        if trajectory.group_id is not None:
            await self._maybe_complete_group(trajectory.group_id)

    # ----------------------------------------------------------------- helpers

    async def _assemble(self, event: RolloutStateChanged, delivery: Delivery) -> Trajectory:
        rid = event.rollout_id
        steps = assembler.dedupe_steps(await self.store.steps_for(rid))
        sandbox = await self.store.sandbox_result(rid)
        verification = await self.store.verification(rid)
        missing = assembler.missing_parts(event, steps, sandbox, verification)
        if missing and delivery.num_delivered < self.give_up_after:
            raise Retryable(f"rollout {rid} waiting for {', '.join(missing)}", delay=self.retry_delay)
        if missing:
            log.warning("rollout %s: assembling without %s after %d deliveries", rid, ", ".join(missing),
                        delivery.num_delivered, extra={"rollout_id": rid})
        return assembler.assemble(event, steps, sandbox, verification, incomplete=missing)

    async def _maybe_complete_group(self, group_id: str) -> None:
        """Publish ``GroupCompleted`` if every member is stored.

        Each member stores its trajectory before reading the group, so of two members
        finishing together at least the later reader sees both; when both do, the
        shared ``Nats-Msg-Id`` makes the second publish a no-op.
        """
        group: GroupCompleted | None = assembler.complete_group(await self.store.group(group_id))
        if group is None:
            return
        published = await self._publish_once(subjects.group(group_id), group, f"{group_id}:group:0")
        if published:
            log.info("group %s complete: rewards %s", group_id, group.rewards, extra={"group_id": group_id})

    async def _publish_once(self, subject: str, message: msgspec.Struct, msg_id: str) -> bool:
        """Publish unless the stream already holds a message on ``subject``.

        The ``Nats-Msg-Id`` only de-duplicates inside the server's window (minutes); the
        look-up keeps a much later redelivery from putting a second copy on the
        training stream. Returns whether a new message was stored.
        """
        data = encode(message)
        if len(data) > self.bus.nc.max_payload:
            # retrying cannot help; dead-letter the state with a clear reason (docs/trajectory.md, limits)
            raise Permanent(f"{subject}: {len(data)} bytes exceed the NATS max_payload of {self.bus.nc.max_payload}")
        try:
            await self.bus.js.get_last_msg(TRAJECTORIES_STREAM, subject)
            return False
        except NotFoundError:
            pass
        ack = await self.bus.publish(subject, data, msg_id=msg_id)
        return not ack.duplicate
