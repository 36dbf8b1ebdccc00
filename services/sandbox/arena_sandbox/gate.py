"""A multi-step task's step gate, the sandbox plane's side: after a step's turn, ask the verification
plane (``arena.verify.step.{rollout_id}``, core NATS request/reply) whether the rollout goes on.
Never raises: a verification plane that is down, slow or failing is a ``StepVerdict`` ``error`` (an
infrastructure outcome). docs/tasks.md ("Multi-step tasks")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import msgspec

from arena_core import subjects
from arena_core.bus import BODY_HEADROOM, BODY_OBJECT_HEADER, Bus, body_object_name
from arena_core.schemas import SandboxJob, encode
from arena_core.step_gate import StepVerdict, StepVerifyRequest, verdict_decoder

log = logging.getLogger("arena.sandbox")

#: How long a verification worker has to take the request (its first answer is at once).
ACCEPT_TIMEOUT_S = 15.0
#: Beyond the grading budget the worker names: its answer's way back.
VERDICT_MARGIN_S = 30.0


class StepGate(Protocol):
    async def __call__(self, index: int, step: str, diff: str, cancel: asyncio.Event | None) -> StepVerdict: ...


class NatsStepGate:
    """The step gate of one rollout over ``bus``."""

    def __init__(self, bus: Bus, job: SandboxJob, *, accept_timeout_s: float = ACCEPT_TIMEOUT_S,
                 margin_s: float = VERDICT_MARGIN_S):
        self.bus = bus
        self.job = job
        self.accept_timeout_s = accept_timeout_s
        self.margin_s = margin_s

    async def __call__(self, index: int, step: str, diff: str, cancel: asyncio.Event | None = None) -> StepVerdict:
        rid = self.job.rollout_id
        try:
            return await self._ask(index, step, diff, cancel)
        except Exception as exc:  # noqa: BLE001 - the bus failed under the request: Arena's outcome
            log.warning("step gate of step %s: %s", step, exc, extra={"rollout_id": rid})
            return _error(rid, step, f"cannot ask the verification service: {type(exc).__name__}: {exc}")

    async def _ask(self, index: int, step: str, diff: str, cancel: asyncio.Event | None) -> StepVerdict:
        rid = self.job.rollout_id
        nc = self.bus.nc
        request = StepVerifyRequest(rollout_id=rid, task=self.job.task, verifier_ref=self.job.verifier_ref,
                                    step=step, index=index, diff=diff)
        data = encode(request)
        headers = None
        if len(data) > nc.max_payload - BODY_HEADROOM:  # the diff is large: the body goes to the object store
            name = body_object_name(subjects.msg_id(rid, f"step-gate-{index}", self.job.attempt))
            await (await self.bus.artifacts()).put(name, data)
            data, headers = b"", {BODY_OBJECT_HEADER: name}
        answers: asyncio.Queue = asyncio.Queue()
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox, cb=answers.put)
        try:
            await nc.publish(subjects.verify_step(rid), data, reply=inbox, headers=headers)
            timeout = self.accept_timeout_s
            while True:
                msg = await _next(answers, timeout, cancel)
                if msg is None:
                    if cancel is not None and cancel.is_set():
                        return _error(rid, step, "cancelled while the step was being graded")
                    return _error(rid, step, f"the verification service gave no answer within {timeout:g}s")
                if msg.headers and msg.headers.get("Status") == "503":
                    return _error(rid, step, "no verification worker is listening (the verification service is down)")
                try:
                    verdict = verdict_decoder.decode(msg.data)
                except msgspec.DecodeError as exc:
                    return _error(rid, step, f"an unreadable answer from the verification service: {exc}")
                if verdict.decision != "grading":
                    return verdict
                timeout = verdict.budget_s + self.margin_s
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def _next(queue: asyncio.Queue, timeout: float, cancel: asyncio.Event | None):
    """The next message in ``queue``, or ``None`` after ``timeout`` or once ``cancel`` is set."""
    get = asyncio.ensure_future(queue.get())
    waits = {get}
    stop = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
    if stop is not None:
        waits.add(stop)
    try:
        done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waits:
            if not waiter.done():
                waiter.cancel()
    return get.result() if get in done else None


def _error(rollout_id: str, step: str, reason: str) -> StepVerdict:
    return StepVerdict(rollout_id=rollout_id, step=step, decision="error", reason=reason)
