"""Wiring: a multi-step task's step gates (``arena.verify.step.{rollout_id}``, core NATS request/reply,
one queue group): a step with a ``min_reward`` graded now, its grade kept in ``arena_step_grades`` for
the final verification; the asker told ``grading`` at once, then the verdict. docs/tasks.md
("Multi-step tasks")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from pathlib import Path

import msgspec

from arena_core import subjects
from arena_core.errors import VerificationError
from arena_core.schemas import RewardFileVerifier, VerifyJob, encode
from arena_core.step_gate import StepGrade, StepVerdict, StepVerifyRequest, grade_decoder, grade_key, request_decoder
from arena_verification import reward_file
from arena_verification.plugins import InvalidPlugin
from arena_verification.restore import InvalidTask

log = logging.getLogger("arena.verification")

#: The verification workers' queue group on the gates' subjects: each request to one of them.
QUEUE = "verifier-gates"


def decide(request: StepVerifyRequest, grade: StepGrade | None) -> StepVerdict:
    """What the rollout does after a step graded (or not: ``None``, the step has no minimum)."""
    base = StepVerdict(rollout_id=request.rollout_id, step=request.step, decision="continue")
    if grade is None:
        return msgspec.structs.replace(base, reason="no min_reward: not graded now")
    rewards = grade.rewards or {}
    if grade.patch_error:
        return msgspec.structs.replace(base, decision="stop", reason=grade.patch_error)
    if grade.no_reward:
        return msgspec.structs.replace(base, decision="stop", reason=f"no reward: {grade.no_reward}")
    if grade.below:
        return msgspec.structs.replace(base, decision="stop", rewards=rewards,
                                       reason=f"under its minimum: {grade.below}")
    return msgspec.structs.replace(base, rewards=rewards, reason="reached its minimum: " + ", ".join(
        f"{k}={v:g}" for k, v in sorted(rewards.items())))


class StepGates:
    """Answers step gates. ``worker`` (a ``VerificationWorker``) lends its bus, sandboxes, sources,
    scratch directory and its way of reading a task's private part."""

    def __init__(self, worker):
        self.worker = worker
        self.bus = worker.bus
        self._tasks: set[asyncio.Task] = set()
        self.ready = asyncio.Event()  # subscribed

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.bus.nc.subscribe(subjects.VERIFY_STEP_ALL, queue=QUEUE, cb=self._on_msg)
        await self.bus.nc.flush()
        self.ready.set()
        try:
            await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            for task in list(self._tasks):
                task.cancel()  # the asker sees no verdict: an infrastructure outcome, never a reward
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_msg(self, msg) -> None:
        task = asyncio.ensure_future(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg) -> None:
        if not msg.reply:
            return
        try:
            request = request_decoder.decode(await self.bus.body(msg))
        except Exception as exc:  # noqa: BLE001 - a request that cannot be read is answered, never dropped
            await self._reply(msg, StepVerdict(rollout_id="", step="", decision="error",
                                               reason=f"unreadable step gate request: {exc}"))
            return
        extra = {"rollout_id": request.rollout_id, "subject": msg.subject}
        try:
            job = await self.worker._with_verifier(VerifyJob(rollout_id=request.rollout_id, task=request.task,
                                                             diff="", verifier_ref=request.verifier_ref))
        except InvalidTask as exc:
            await self._reply(msg, _error(request, f"invalid task {request.task.id}: {exc}"))
            return
        except Exception as exc:  # noqa: BLE001 - the bucket unreachable: Arena's failure
            await self._reply(msg, _error(request, f"cannot read the task's verifier: {exc}"))
            return
        spec = job.task.verifier
        if not isinstance(spec, RewardFileVerifier) or not spec.steps:
            await self._reply(msg, StepVerdict(rollout_id=request.rollout_id, step=request.step, decision="continue",
                                               reason="no step gate: the verifier is not a multi-step reward_file"))
            return
        if not 0 <= request.index < len(spec.steps) or spec.steps[request.index].name != request.step:
            await self._reply(msg, _error(request, f"invalid task {request.task.id}: its step {request.index + 1} "
                                                   f"is {request.step!r}, its verifier has no such step there"))
            return
        budget = reward_file.gate_budget_s(spec, request.index)
        if spec.steps[request.index].min_reward is not None:
            await self._reply(msg, StepVerdict(rollout_id=request.rollout_id, step=request.step, decision="grading",
                                               budget_s=budget))
        try:
            grade = await asyncio.wait_for(self._grade(job, spec, request), timeout=budget)
        except asyncio.CancelledError:  # this worker is stopping: the asker hears it now, not at its timeout
            await asyncio.shield(self._reply(msg, _error(request, "the verification worker stopped while grading")))
            raise
        except asyncio.TimeoutError:
            verdict = _error(request, f"grading step {request.step} took longer than its {budget:g}s budget")
        except (InvalidTask, InvalidPlugin) as exc:
            verdict = _error(request, f"invalid task {request.task.id}: {exc}")
        except (VerificationError, OSError, msgspec.MsgspecError) as exc:
            verdict = _error(request, f"cannot grade step {request.step}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the asker must hear of it; logged with its trace
            log.exception("step gate failed", extra=extra)
            verdict = _error(request, f"cannot grade step {request.step}: {type(exc).__name__}: {exc}")
        else:
            verdict = decide(request, grade)
        log.info("step gate %s (step %d, %s): %s", verdict.decision, request.index + 1, request.step, verdict.reason,
                 extra=extra)
        await self._reply(msg, verdict)

    async def _grade(self, job: VerifyJob, spec: RewardFileVerifier, request: StepVerifyRequest) -> StepGrade | None:
        scratch = self.worker.scratch_dir
        if scratch is not None:
            scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="arena-gate-", dir=scratch) as tmp:
            grade = await reward_file.grade_gate(job.task, spec, request.index, request.diff, Path(tmp),
                                                 sandboxes=self.worker.sandboxes, sources=self.worker.sources)
        if grade is not None:  # kept before the asker hears of it: the final verification takes it as it is
            kv = await self.bus.kv(subjects.KV_STEP_GRADES)
            await kv.put(grade_key(request.rollout_id, request.index), encode(grade))
        return grade

    async def _reply(self, msg, verdict: StepVerdict) -> None:
        try:
            await self.bus.nc.publish(msg.reply, encode(verdict))
        except Exception as exc:  # noqa: BLE001 - the asker times out: an infrastructure outcome there
            log.warning("cannot answer a step gate: %s", exc, extra={"rollout_id": verdict.rollout_id})


def _error(request: StepVerifyRequest, reason: str) -> StepVerdict:
    return StepVerdict(rollout_id=request.rollout_id, step=request.step, decision="error", reason=reason)


async def kept_grades(bus, job: VerifyJob) -> dict[int, StepGrade]:
    """The grades the step gates of ``job``'s rollout kept, by step index (a replay has none of its own)."""
    if not job.step_turns or job.name:
        return {}
    from nats.js.errors import KeyNotFoundError

    kv = await bus.kv(subjects.KV_STEP_GRADES)
    kept: dict[int, StepGrade] = {}
    for index in range(len(job.step_turns)):
        try:
            entry = await kv.get(grade_key(job.rollout_id, index))
        except KeyNotFoundError:
            continue
        if entry.value:
            kept[index] = grade_decoder.decode(entry.value)
    return kept
