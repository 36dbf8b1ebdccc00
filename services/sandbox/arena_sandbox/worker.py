"""Wiring: sandbox jobs from ``arena.sandbox.run.{provider}`` in, sandbox results out.

Skips rollouts already past the sandbox, kills a sandbox whose rollout ended, publishes
``SandboxStarted`` / ``SandboxDone`` / ``VerifyJob``, reaps orphans. See docs/sandbox.md (Messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import msgspec
from nats.js.errors import KeyNotFoundError

from arena_core import capacity, metrics, subjects, telemetry
from arena_core.bus import Bus, Consumer, Delivery
from arena_core.errors import Retryable
from arena_core.schemas import (
    EnvError,
    EnvReply,
    EnvRequest,
    RolloutRecord,
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxJob,
    SandboxOutcome,
    SandboxStarted,
    VerifyJob,
)
from arena_core.settings import Settings
from arena_core.sources import SourceCache, git_policy, unpack_limits
from arena_sandbox import runner
from arena_sandbox.gate import NatsStepGate
from arena_sandbox.hosted import EnvServers
from arena_sandbox.pool import WarmPool
from arena_sandbox_providers.provider import SandboxProvider
from arena_sandbox.runner import RunnerConfig

log = logging.getLogger("arena.sandbox.worker")

STREAM = "ARENA_SANDBOX_JOBS"
ACK_WAIT_S = 30.0
#: Seconds between looks at the free memory while a sandbox waits for it.
MEMORY_RECHECK_S = 0.5

_record_decoder = msgspec.json.Decoder(RolloutRecord)
_state_decoder = msgspec.json.Decoder(RolloutStateChanged)


class SandboxWorker:
    """Handles sandbox jobs for one provider (``arena.sandbox.run.{provider}``).

    ``stop`` (the service's shutdown event) kills running sandboxes and returns their
    jobs to the queue unacknowledged, so another worker runs them. ``reap_pending``:
    the start-up reaping failed, so it is done before this worker's first sandbox.
    """

    def __init__(
        self,
        bus: Bus,
        settings: Settings,
        provider: SandboxProvider,
        *,
        pool: WarmPool | None = None,
        config: RunnerConfig = RunnerConfig(),
        stop: asyncio.Event | None = None,
        reap_pending: bool = False,
    ):
        self.bus = bus
        self.provider = provider
        self.pool = pool
        self.name = provider.name
        self.settings = settings
        self.config = msgspec.structs.replace(config, max_diff_bytes=settings.max_diff_bytes)
        self.data_dir = Path(settings.data_dir)
        self.stop = stop or asyncio.Event()
        self.reap_pending = reap_pending
        self._reaping = asyncio.Lock()
        self.sources = SourceCache(self.data_dir / "sources", bus=bus, allow_paths=settings.allow_host_paths,
                                   docker_url=settings.docker_url, limits=unpack_limits(settings),
                                   git=git_policy(settings), budget_bytes=settings.source_cache_bytes)
        self.sources.reap()
        self.in_flight = metrics.SANDBOXES_IN_FLIGHT.labels(provider=self.name)  # 0 until a job runs
        self.health = CachedHealth(provider)
        #: hosted OpenEnv servers kept between episodes (docs/openenv.md)
        self.env_servers = EnvServers(max_idle=settings.sandbox_slots, max_total=settings.sandbox_slots)

    async def close(self) -> None:
        """Stop the environment servers kept warm."""
        await self.env_servers.close()

    def consumer(self) -> Consumer[SandboxJob]:
        return Consumer(
            self.bus,
            stream=STREAM,
            durable=subjects.CONSUMER_SANDBOX.format(provider=self.name),
            filter_subjects=[subjects.sandbox_run(self.name)],
            message_type=SandboxJob,
            handler=self.handle,
            concurrency=self.settings.sandbox_slots,
            ack_wait=ACK_WAIT_S,
        )

    async def handle(self, job: SandboxJob, delivery: Delivery) -> None:
        if self.stop.is_set():
            raise Retryable("sandbox worker shutting down; the job goes back to the queue", 1.0)
        rid = job.rollout_id
        extra = {"rollout_id": rid}
        cancel = asyncio.Event()
        cancel_reason: list[str] = []

        async def on_state(msg) -> None:
            try:
                change = _state_decoder.decode(msg.data)
            except msgspec.DecodeError:
                return
            if change.to_state.is_final and not cancel.is_set():
                cancel_reason.append(f"rollout became {change.to_state.value} while the agent was running")
                cancel.set()

        # Subscribe before looking at the record, so no transition falls in between.
        sub = await self.bus.nc.subscribe(subjects.rollout_state(rid), cb=on_state)
        stopper = asyncio.create_task(_set_when(self.stop, cancel))
        try:
            record = await self._rollout_record(rid)
            state = record.state if record is not None else None
            if state is not None and (state.is_final or state is RolloutState.VERIFYING):
                log.info("rollout is %s: sandbox job skipped", state.value, extra=extra)
                return
            if record is not None:  # from submission until this worker took the job
                telemetry.record_span("queue", parent=delivery.headers, start=record.created_at, end=_now(),
                                      attributes={"arena.rollout_id": rid, "arena.provider": self.name,
                                                  "arena.delivery": delivery.num_delivered})
            if not await self._memory_room(cancel, rid):
                raise Retryable("sandbox worker shutting down; the job goes back to the queue", 1.0)
            await self._run(job, cancel, cancel_reason)
        finally:
            stopper.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _memory_room(self, cancel: asyncio.Event, rid: str) -> bool:
        """Wait until the host has more than ``ARENA_SANDBOX_MEMORY_RESERVE_MB`` free, so agents heavier
        than the slots' budget are held back by memory (docs/performance.md); false if the worker stops
        meanwhile. A rollout cancelled meanwhile goes on to its (skipped) run."""
        if not self.provider.uses_host_memory or capacity.memory_free_for_sandboxes(
                self.settings.sandbox_memory_reserve_mb):
            return True
        log.warning("less than %d MiB of memory free: the sandbox waits for memory",
                    self.settings.sandbox_memory_reserve_mb, extra={"rollout_id": rid})
        while not capacity.memory_free_for_sandboxes(self.settings.sandbox_memory_reserve_mb):
            if self.stop.is_set():
                return False
            if cancel.is_set():
                return True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(cancel.wait(), MEMORY_RECHECK_S)
        return True

    async def _run(self, job: SandboxJob, cancel: asyncio.Event, cancel_reason: list[str]) -> None:
        rid = job.rollout_id
        sandbox_id = runner.new_sandbox_id(rid)
        # its ack comes back while the sandbox is made; awaited before anything else is published,
        # so SandboxStarted still precedes SandboxDone (a failed publish fails the job, as before)
        started = asyncio.ensure_future(self.bus.publish(
            subjects.sandbox_started(rid),
            SandboxStarted(rollout_id=rid, sandbox_id=sandbox_id, provider=self.name, at=_now()),
            msg_id=subjects.msg_id(rid, "sandbox-started", job.attempt),
        ))
        try:
            await self._run_started(job, cancel, cancel_reason, sandbox_id, started)
        finally:
            if not started.done():
                started.cancel()
            started.add_done_callback(_retrieve)  # whatever happened: never an unobserved failure

    async def _run_started(self, job: SandboxJob, cancel: asyncio.Event, cancel_reason: list[str], sandbox_id: str,
                           started: asyncio.Future) -> None:
        rid = job.rollout_id
        unavailable = await self.health.check()
        if unavailable is None:
            unavailable = await self._reap_if_pending()
        if unavailable is not None:
            done = SandboxDone(
                rollout_id=rid, sandbox_id=sandbox_id, provider=self.name, outcome=SandboxOutcome.ERROR,
                reason=f"the {self.name} sandbox provider is unavailable: {unavailable}", started_at=_now(),
                finished_at=_now(),
            )
            await started
            await self._publish_done(job, done)
            return
        self.in_flight.inc()
        exchanges = await NatsExchanges.open(self.bus, rid) if job.task.agent.external else None
        # the sandbox is destroyed once its result is out (still within this job's slot); the
        # sources it reads stay in the cache until then
        finished: list = []
        lease = self.sources.lease()
        try:
            try:
                result = await runner.run_job(
                    job, data_dir=self.data_dir, provider=self.pool or self.provider, config=self.config,
                    sandbox_id=sandbox_id, cancel=cancel, sources=self.sources, exchanges=exchanges,
                    idle_s=self.settings.openenv_idle_s, servers=self.env_servers, destroy_later=finished,
                    lease=lease, gate=NatsStepGate(self.bus, job) if len(job.task.steps) > 1 else None,
                )
            finally:
                if exchanges is not None:
                    await exchanges.close()
            await started
            await self._finish(job, result, cancel, cancel_reason, sandbox_id)
        finally:
            for sandbox in finished:
                await asyncio.shield(sandbox.destroy())
            lease.release()
            self.in_flight.dec()

    async def _finish(self, job: SandboxJob, result: runner.JobRun, cancel: asyncio.Event, cancel_reason: list[str],
                      sandbox_id: str) -> None:
        rid = job.rollout_id
        extra = {"rollout_id": rid}
        done = result.done
        if done.outcome is SandboxOutcome.CANCELLED and not cancel_reason:
            if job.task.agent.external:  # an episode cannot move: its client's actions so far are gone
                done = msgspec.structs.replace(done, outcome=SandboxOutcome.ERROR,
                                               reason="the sandbox worker stopped during the episode")
            else:
                # Killed because this worker is stopping, not because of the rollout.
                raise Retryable("sandbox worker shutting down; the job goes back to the queue", 1.0)
        if done.outcome is SandboxOutcome.CANCELLED and cancel_reason:
            done = msgspec.structs.replace(done, reason=cancel_reason[0])
        if result.log:
            done = msgspec.structs.replace(done, log_artifact=await self._store(rid, "agent.log", result.log))
        if result.artifacts:  # a scaffold's own records (its trajectory file)
            stored = {name: await self._store(rid, name, data) for name, data in result.artifacts.items()}
            done = msgspec.structs.replace(done, artifacts={name: key for name, key in stored.items() if key})
        outcome = await self._publish_done(job, done)
        log.info("sandbox %s: %s", sandbox_id, outcome.value, extra=extra)

    async def _reap_if_pending(self) -> str | None:
        """Reap the owner's orphans if start-up could not; before any sandbox of this
        worker exists (jobs wait on the lock), so only a predecessor's are reaped.
        The reason no sandbox may be created yet, or ``None``."""
        if not self.reap_pending:
            return None
        async with self._reaping:
            if self.reap_pending:
                error = await reap_orphans(self.provider)
                if error is not None:
                    return f"cannot reap the sandboxes left by an earlier worker: {error}"
                self.reap_pending = False
        return None

    async def _publish_done(self, job: SandboxJob, done: SandboxDone) -> SandboxOutcome:
        rid = job.rollout_id
        await self.bus.publish(
            subjects.sandbox_done(rid), done, msg_id=subjects.msg_id(rid, "sandbox-done", job.attempt)
        )
        metrics.SANDBOX_RUNS.labels(provider=self.name, outcome=done.outcome.value).inc()
        if done.outcome is SandboxOutcome.COMPLETED:
            await self.bus.publish(
                subjects.VERIFY_RUN,
                VerifyJob(rollout_id=rid, task=job.task, diff=done.diff, result=done.result,
                          verifier_ref=job.verifier_ref, flags=list(done.flags), step_turns=list(done.step_turns)),
                msg_id=subjects.msg_id(rid, "verify-job", job.attempt),
            )
        return done.outcome

    async def _rollout_record(self, rollout_id: str) -> RolloutRecord | None:
        kv = await self.bus.kv(subjects.KV_ROLLOUTS)
        try:
            entry = await kv.get(rollout_id)
        except KeyNotFoundError:
            log.warning("no rollout record for this sandbox job; running it anyway",
                        extra={"rollout_id": rollout_id})
            return None
        if entry.value is None:
            return None
        return _record_decoder.decode(entry.value)

    async def _store(self, rollout_id: str, name: str, data: bytes) -> str | None:
        """``data`` in the artifact store as ``{rollout_id}/{name}``; its key, or ``None`` if it failed."""
        key = f"{rollout_id}/{name}"
        try:
            store = await self.bus.artifacts()
            await store.put(key, data)
        except Exception as exc:  # noqa: BLE001 - the result matters more than its log
            log.warning("could not store %s: %s", name, exc, extra={"rollout_id": rollout_id})
            return None
        return key


class CachedHealth:
    """A provider's health for each job without asking the engine each time: a healthy answer
    holds for ``ttl_s`` (a docker engine's ping and image lookup are two engine calls, about
    as long as the warm sandbox they guard); an unhealthy one is asked again at the next job (an
    engine that comes back is used at once), one probe at a time for the jobs waiting on it.
    A sandbox that cannot be created is still an error outcome of its own."""

    def __init__(self, provider: SandboxProvider, ttl_s: float = 5.0, failure_ttl_s: float = 0.0):
        self.provider, self.ttl_s, self.failure_ttl_s = provider, ttl_s, failure_ttl_s
        self._answer: tuple[float, str | None] = (-1e9, None)
        self._probe: asyncio.Future | None = None

    async def check(self) -> str | None:
        at, problem = self._answer
        if time.monotonic() - at < (self.ttl_s if problem is None else self.failure_ttl_s):
            return problem
        if self._probe is None or self._probe.done():  # one probe; the jobs arriving meanwhile share it
            self._probe = asyncio.ensure_future(self._ask())
        return await asyncio.shield(self._probe)

    async def _ask(self) -> str | None:
        problem = await self.provider.health()
        self._answer = (time.monotonic(), problem)
        return problem


class _NatsExchange:
    def __init__(self, request: EnvRequest, msg):
        self.request, self._msg = request, msg

    async def reply(self, answer: EnvReply) -> None:
        if self._msg.reply:
            await self._msg.respond(msgspec.json.encode(answer))


class NatsExchanges:
    """An OpenEnv episode's exchanges from ``arena.env.{rollout_id}`` (core NATS request/reply),
    subscribed before the sandbox starts so none is missed; undecodable ones are answered with
    OpenEnv's ``INVALID_JSON``."""

    def __init__(self, rollout_id: str):
        self.rollout_id = rollout_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sub = None

    @classmethod
    async def open(cls, bus: Bus, rollout_id: str) -> "NatsExchanges":
        self = cls(rollout_id)

        async def on_msg(msg) -> None:
            try:
                request = _env_request_decoder.decode(msg.data)
            except msgspec.DecodeError as exc:
                if msg.reply:
                    await msg.respond(msgspec.json.encode(EnvReply(seq=-1, error=EnvError(
                        code="INVALID_JSON", message=f"not an EnvRequest: {exc}"))))
                return
            if request.rollout_id == rollout_id:
                self.queue.put_nowait(_NatsExchange(request, msg))

        self.sub = await bus.nc.subscribe(subjects.env_exchange(rollout_id), cb=on_msg)
        return self

    async def next(self, timeout_s: float):
        try:
            return await asyncio.wait_for(self.queue.get(), timeout_s)
        except asyncio.TimeoutError:
            return None

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()


_env_request_decoder = msgspec.json.Decoder(EnvRequest)


async def reap_orphans(provider: SandboxProvider) -> str | None:
    """Reap what an earlier process of this owner left (``kill -9``, a crash); the
    error if the provider cannot be reached now (logged), else ``None``."""
    try:
        await provider.reap_orphans()
    except Exception as exc:  # noqa: BLE001 - any failure: retried before the first sandbox
        log.error("sandbox provider %s: cannot reap orphaned sandboxes now: %s", provider.name, exc)
        return str(exc) or type(exc).__name__
    return None


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def _set_when(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


def _now() -> float:
    return time.time()
