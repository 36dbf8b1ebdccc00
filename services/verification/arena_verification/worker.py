"""Wiring: verify jobs from ``arena.verify.run`` in, results to ``arena.verify.done.{id}`` out."""

from __future__ import annotations

import logging
from pathlib import Path

from arena import subjects
from arena.bus import Bus, Consumer, Delivery
from arena.errors import Permanent
from arena.schemas import VerifyJob
from arena_verification import runner
from arena_verification.restore import InvalidTask

log = logging.getLogger("arena.verification")

STREAM = "ARENA_VERIFY_JOBS"
MAX_DELIVER = 3
MSG_KIND = "verify-done"


class VerificationWorker:
    """Runs one verification per job and publishes its ``VerificationResult``.

    A failing test suite is a result (reward 0). An exception from the runner means
    Arena could not verify: it propagates, so the bus naks and redelivers, and
    dead-letters the job after ``MAX_DELIVER`` attempts; an invalid task is
    dead-lettered at once. Re-verifying a redelivered job publishes with the same
    ``Nats-Msg-Id``, so JetStream drops the duplicate.
    """

    def __init__(self, bus: Bus, *, scratch_dir: Path | None = None):
        self.bus = bus
        self.scratch_dir = scratch_dir

    async def handle(self, job: VerifyJob, delivery: Delivery) -> None:
        log.info("verifying (delivery %d)", delivery.num_delivered,
                 extra={"rollout_id": job.rollout_id, "subject": delivery.subject})
        try:
            result = await runner.verify(job, scratch_dir=self.scratch_dir)
        except InvalidTask as exc:
            raise Permanent(f"invalid task {job.task.id}: {exc}") from exc
        await self.bus.publish(
            subjects.verify_done(job.rollout_id),
            result,
            msg_id=subjects.msg_id(job.rollout_id, MSG_KIND),
        )

    def consumer(self, *, concurrency: int) -> Consumer[VerifyJob]:
        return Consumer(
            self.bus,
            stream=STREAM,
            durable=subjects.CONSUMER_VERIFIER,
            filter_subjects=[subjects.VERIFY_RUN],
            message_type=VerifyJob,
            handler=self.handle,
            concurrency=concurrency,
            max_deliver=MAX_DELIVER,
        )
