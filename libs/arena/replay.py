"""``arena verify``: re-verify a stored rollout with a new or changed verifier.

The stored diff and ``result.json`` go to the verification workers in a ``VerifyJob`` with the
new verifier; its result is stored beside the original and the final rollout is left alone.
See docs/verification.md ("Replay").
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import msgspec

from arena_core import subjects
from arena_core.errors import InvalidRequest, NotFound, Unavailable
from arena_core.schemas import RolloutRecord, Task, Trajectory, VerificationResult, Verifier, VerifyJob

_verifier_decoder = msgspec.json.Decoder(Verifier)
_record_decoder = msgspec.json.Decoder(RolloutRecord)
_result_decoder = msgspec.json.Decoder(VerificationResult)


def parse_verifier(arg: str) -> Verifier:
    """A verifier spec from a JSON file path or inline JSON; a clear error otherwise."""
    text = arg
    path = Path(arg)
    if not arg.lstrip().startswith(("{", "[")):
        try:
            text = path.read_text()
        except OSError as exc:
            raise InvalidRequest(f"--verifier {arg!r} is neither JSON nor a readable file: {exc.strerror}") from None
    try:
        raw = msgspec.json.decode(text)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"--verifier is not valid JSON: {exc}") from None
    if isinstance(raw, dict) and "verifier" in raw and "type" not in raw:
        raw = raw["verifier"]  # a whole task.json: take its verifier
    try:
        return _verifier_decoder.decode(msgspec.json.encode(raw))
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"--verifier is not a verifier spec: {exc}") from None


def replay_name(spec: Verifier) -> str:
    """A stable default name: ``replay-<type>-<hash of the spec>``."""
    digest = hashlib.sha256(msgspec.json.encode(spec)).hexdigest()[:10]
    return f"replay-{type(spec).__struct_config__.tag}-{digest}"


def build_job(trajectory: Trajectory, task: Task, spec: Verifier, name: str) -> VerifyJob:
    if trajectory.sandbox is None:
        raise InvalidRequest(f"rollout {trajectory.rollout_id} has no sandbox result: nothing to verify")
    return VerifyJob(
        rollout_id=trajectory.rollout_id,
        task=msgspec.structs.replace(task, verifier=spec),
        diff=trajectory.sandbox.diff,
        result=trajectory.sandbox.result,
        name=name,
        step_turns=list(trajectory.sandbox.step_turns),
    )


async def rollout_task(bus, rollout_id: str) -> Task:
    """The task a rollout ran, from its record in the ``arena_rollouts`` bucket."""
    from nats.js.errors import KeyNotFoundError

    kv = await bus.kv(subjects.KV_ROLLOUTS)
    try:
        entry = await kv.get(rollout_id)
    except KeyNotFoundError:
        raise NotFound(f"no rollout record for {rollout_id}") from None
    if entry.value is None:
        raise NotFound(f"no rollout record for {rollout_id}")
    return _record_decoder.decode(entry.value).task


async def replay(bus, job: VerifyJob, *, timeout: float) -> VerificationResult:
    """Queue ``job`` for the verification workers and wait for its named result."""
    done: asyncio.Future[VerificationResult] = asyncio.get_running_loop().create_future()

    async def on_result(msg) -> None:
        try:
            result = _result_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        if result.verifier == job.name and not done.done():
            done.set_result(result)

    sub = await bus.nc.subscribe(subjects.verify_done(job.rollout_id), cb=on_result)
    try:
        nonce = f"{job.name}-{time.time_ns()}"  # each replay is a new job, never a duplicate
        await bus.publish(subjects.VERIFY_RUN, job, msg_id=subjects.msg_id(job.rollout_id, "verify-replay", nonce))
        try:
            return await asyncio.wait_for(done, timeout)
        except asyncio.TimeoutError:
            raise Unavailable(f"no verification result for {job.rollout_id} within {timeout:g}s "
                              "(is the verification service running?)") from None
    finally:
        await sub.unsubscribe()
