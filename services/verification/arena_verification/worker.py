"""Wiring: verify jobs from ``arena.verify.run`` in, results to ``arena.verify.done.{id}`` out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
from nats.js.errors import NotFoundError

from arena_core import metrics, private, subjects, telemetry
from arena_core.bus import Bus, Consumer, Delivery
from arena_core.errors import Permanent, VerificationError
from arena_core.schemas import RewardFileVerifier, RolloutStateChanged, VerificationResult, VerifyJob
from arena_core.sources import SourceCache
from arena_verification import gate, runner
from arena_verification.plugins import InvalidPlugin
from arena_verification.restore import InvalidTask
from arena_verification.sandboxes import Sandboxes

log = logging.getLogger("arena.verification")

STREAM = "ARENA_VERIFY_JOBS"
MAX_DELIVER = 3
MSG_KIND = "verify-done"
RESULTS_STREAM = "ARENA_RESULTS"


class _AgentResult(msgspec.Struct):
    """The one field of a ``SandboxDone`` an answer verifier reads: decoding into it skips
    the rest (the agent's diff, up to ``ARENA_MAX_DIFF_BYTES``) without making a string of it."""

    result: dict[str, Any] | None = None


_sandbox_done_decoder = msgspec.json.Decoder(_AgentResult)
_state_decoder = msgspec.json.Decoder(RolloutStateChanged)


class InvalidVerifierRef(InvalidTask):
    """The job's verifier is neither in the job nor stored under its key."""


def _verifier_name(job: VerifyJob) -> str:
    spec = job.task.verifier
    return runner.verifier_type(spec) if spec is not None else "unknown"


def result_msg_id(job: VerifyJob) -> str:
    """``{rid}:verify-done:0`` for the rollout's own verification; a replay named ``N``
    publishes ``{rid}:verify-done-N:0`` so JetStream never drops it as a duplicate."""
    kind = MSG_KIND if not job.name else f"{MSG_KIND}-{subjects.token(job.name)}"
    return subjects.msg_id(job.rollout_id, kind)


class VerificationWorker:
    """Runs one verification per job and publishes its ``VerificationResult``.

    A failing test suite is a result (reward 0). An exception from the runner means
    Arena could not verify: it propagates, so the bus naks and redelivers, and
    dead-letters the job after ``MAX_DELIVER`` attempts; an invalid task or plug-in is
    dead-lettered at once. A job taking longer than its budget (``job_timeout_s``, else
    :func:`runner.time_budget_s` of its verifier) is cancelled and counts as a failure.
    Re-verifying a redelivered job publishes with the same ``Nats-Msg-Id``, so JetStream
    drops the duplicate.
    """

    def __init__(self, bus: Bus, *, scratch_dir: Path | None = None, job_timeout_s: float | None = None,
                 sandboxes: Sandboxes | None = None, sources: SourceCache | None = None):
        self.bus = bus
        self.scratch_dir = scratch_dir
        self.job_timeout_s = job_timeout_s
        self.sandboxes = sandboxes
        self.sources = sources
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0))

    async def handle(self, job: VerifyJob, delivery: Delivery) -> None:
        # A rollout that ends meanwhile (cancelled, its hard lifetime passed, its group's completion
        # policy) no longer wants this verification: it is abandoned, its sandbox killed, nothing
        # published. Subscribed before the work starts, so no transition falls in between.
        ended = asyncio.Event()

        async def on_state(msg) -> None:
            try:
                change = _state_decoder.decode(msg.data)
            except msgspec.DecodeError:
                return
            if change.to_state.is_final:
                ended.set()

        sub = await self.bus.nc.subscribe(subjects.rollout_state(job.rollout_id), cb=on_state)
        try:
            with telemetry.tracer().start_as_current_span("verification", attributes={
                    "arena.rollout_id": job.rollout_id, "arena.task_id": job.task.id,
                    "arena.delivery": delivery.num_delivered}) as span:
                work = asyncio.ensure_future(self._verify(job, delivery))
                stop = asyncio.ensure_future(ended.wait())
                try:
                    await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stop.cancel()
                    if not work.done():
                        work.cancel()
                if not work.done() or work.cancelled():
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await work  # the verifier's sandbox is killed before this returns
                    log.info("the rollout ended while it was being verified: verification abandoned",
                             extra={"rollout_id": job.rollout_id})
                    span.set_attribute("arena.outcome", "abandoned")
                    return
                result = work.result()
                span.set_attribute("arena.verifier", result.verifier)
                span.set_attribute("arena.outcome", metrics.verification_outcome(result.reward, result.passed))
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _verify(self, job: VerifyJob, delivery: Delivery) -> VerificationResult:
        log.info("verifying (delivery %d)", delivery.num_delivered,
                 extra={"rollout_id": job.rollout_id, "subject": delivery.subject})
        started = time.time()
        try:
            job = await self._with_verifier(job)
            if job.result is None and runner.grades_answer(job.task.verifier):
                job = msgspec.structs.replace(job, result=await self._agent_result(job.rollout_id))
            budget = self.job_timeout_s or runner.time_budget_s(job.task.verifier)
            # a multi-step task's steps its step gates graded during the rollout: taken as they are
            kept = await gate.kept_grades(self.bus, job) if isinstance(job.task.verifier, RewardFileVerifier) else {}
            try:
                result = await asyncio.wait_for(
                    runner.verify(job, scratch_dir=self.scratch_dir, http=self.http, sandboxes=self.sandboxes,
                                  sources=self.sources, kept=kept),
                    timeout=budget,
                )
            except asyncio.TimeoutError as exc:
                raise VerificationError(f"verification took longer than its {budget:g}s budget") from exc
        except (InvalidTask, InvalidPlugin, InvalidVerifierRef) as exc:
            await self._publish_error(job, f"invalid task {job.task.id}: {exc}", started)
            raise Permanent(f"invalid task {job.task.id}: {exc}") from exc
        except Exception as exc:
            if delivery.num_delivered >= MAX_DELIVER:  # the last attempt: say so, with no reward
                await self._publish_error(job, str(exc) or type(exc).__name__, started)
            raise
        await self.bus.publish(subjects.verify_done(job.rollout_id), result, msg_id=result_msg_id(job))
        metrics.VERIFICATIONS.labels(verifier=_verifier_name(job),
                                     outcome=metrics.verification_outcome(result.reward, result.passed)).inc()
        return result

    async def _with_verifier(self, job: VerifyJob) -> VerifyJob:
        """The job with its task's private part, read from ``arena_verifiers`` by its key."""
        if job.task.verifier is not None:
            return job
        if not job.verifier_ref:
            raise InvalidVerifierRef("the verify job names no verifier")
        try:
            verifier = await private.get_verifier(self.bus, job.verifier_ref)
        except private.VerifierMissing as exc:
            raise InvalidVerifierRef(str(exc)) from None
        return msgspec.structs.replace(job, task=msgspec.structs.replace(job.task, verifier=verifier))

    async def _publish_error(self, job: VerifyJob, error: str, started: float) -> None:
        """Arena could not verify: a result with no reward (never a 0), the error in it."""
        log.error("cannot verify: %s", error, extra={"rollout_id": job.rollout_id})
        result = VerificationResult(
            rollout_id=job.rollout_id, verifier=job.name or _verifier_name(job), reward=None, passed=False,
            started_at=started, finished_at=time.time(), error=error, reason=f"not verified: {error}",
            flags=["infrastructure_error"],
        )
        await self.bus.publish(subjects.verify_done(job.rollout_id), result, msg_id=result_msg_id(job))
        metrics.VERIFICATIONS.labels(verifier=_verifier_name(job), outcome="infrastructure").inc()

    async def _agent_result(self, rollout_id: str) -> dict[str, Any] | None:
        """The agent's ``result.json`` from the rollout's ``SandboxDone`` (``None`` if absent).

        Jobs from the sandbox plane carry the diff but not the result; answer verifiers
        (``rubric``/``exact``/``llm_judge`` on ``source: "answer"``, plug-ins) need it.
        """
        try:
            raw = await self.bus.js.get_last_msg(RESULTS_STREAM, subjects.sandbox_done(rollout_id))
        except NotFoundError:
            return None
        return _sandbox_done_decoder.decode(await self.bus.body(raw)).result  # a large one is in the object store

    async def close(self) -> None:
        await self.http.aclose()
        if self.sandboxes is not None:
            await self.sandboxes.close()

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
