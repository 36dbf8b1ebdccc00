"""``python -m arena_verification``: verification workers until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from pathlib import Path

from arena_core import access, logs, metrics, subjects, telemetry
from arena_core.health import health_app
from arena_core.scratch import Sweeper
from arena_core.bus import Bus, TopologyError
from arena_core.runtime import freeze_startup, serve, stop_on_signals
from arena_core.settings import Settings, SettingsError
from arena_core.sources import SourceCache, git_policy, unpack_limits
from arena_verification.gate import StepGates
from arena_verification.sandboxes import ProviderSandboxes
from arena_verification.worker import VerificationWorker


async def main(settings: Settings) -> int:
    log = logs.setup("verification", settings.log_level)
    telemetry.setup("verification", otlp_endpoint=settings.otlp_endpoint, otlp_protocol=settings.otlp_protocol)
    sandboxes = ProviderSandboxes.from_settings(settings)
    problem = await sandboxes.local.health()
    if problem is not None:
        log.error("cannot run sandboxes: %s", problem)
        raise SystemExit(f"arena-verification: cannot run sandboxes: {problem}")
    scratch = Path(settings.data_dir) / "verify"
    reaped = await sandboxes.reap() + await asyncio.to_thread(_reap_scratch, scratch)
    if reaped:
        log.warning("reaped %d sandbox(es) and scratch directories an earlier process left", reaped)
    stop = stop_on_signals()
    bus = await Bus.connect(settings.nats_url, "verification")
    try:
        try:  # the topology step (admin) created them: this service's user binds, never creates
            await bus.bind_topology(access.SERVICES['verification'].streams())
        except TopologyError as exc:
            await bus.close()
            raise SystemExit(f"arena-verification: {exc}") from None
        sources = SourceCache(Path(settings.data_dir) / "verify-sources", bus=bus,
                              allow_paths=settings.allow_host_paths, docker_url=settings.docker_url,
                              limits=unpack_limits(settings), git=git_policy(settings),
                              budget_bytes=settings.source_cache_bytes)
        sources.reap()
        worker = VerificationWorker(bus, scratch_dir=scratch, job_timeout_s=_job_timeout_from_env(),
                                    sandboxes=sandboxes, sources=sources)
        log.info("verification workers running (concurrency %d)", settings.verify_concurrency)
        try:
            async def verifiers_readable() -> str | None:
                try:
                    await bus.kv(subjects.KV_VERIFIERS)
                except Exception as exc:  # noqa: BLE001 - any failure means not ready
                    return f"verifier bucket unreachable: {type(exc).__name__}"
                return None

            async def sandboxes_work() -> str | None:
                return await sandboxes.local.health()

            health = health_app(bus, streams=["ARENA_VERIFY_JOBS"], checks=[verifiers_readable, sandboxes_work])
            queues = metrics.QueueDepths(bus.js, [("ARENA_VERIFY_JOBS", subjects.CONSUMER_VERIFIER)])
            metrics.install("verification", queues)
            health = metrics.metrics_route(health, refresh=[queues.refresh])
            # a verification lives no longer than the rollout service lets a rollout verify
            sweeper = Sweeper([scratch], older_than_s=(settings.verify_deadline_s or 86400) + 600,
                              what="verification scratch")
            freeze_startup()
            gates = StepGates(worker)  # a multi-step task's steps graded during its rollout
            code = await serve(stop, consumers=[worker.consumer(concurrency=settings.verify_concurrency), gates,
                                                sweeper, bus.watch()],
                               app=health if settings.verification_health_port else None, host=settings.host,
                               port=settings.verification_health_port)
        finally:
            await worker.close()
    finally:
        await bus.close()
        telemetry.shutdown()
    log.info("verification service stopped")
    return code


def _reap_scratch(scratch: Path) -> int:
    """Scratch directories of verifications a crash (``kill -9``) cut short: this worker
    installation's own (its data directory), so all of them are leftovers at start."""
    if not scratch.is_dir():
        return 0
    count = 0
    for path in scratch.iterdir():
        shutil.rmtree(path, ignore_errors=True)
        count += 1
    return count


def _job_timeout_from_env() -> float | None:
    """``ARENA_VERIFY_JOB_TIMEOUT_S``: one budget for every job (default: per verifier)."""
    raw = os.environ.get("ARENA_VERIFY_JOB_TIMEOUT_S", "")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"ARENA_VERIFY_JOB_TIMEOUT_S={raw!r} is not a number") from None
    if value <= 0:
        raise SettingsError(f"ARENA_VERIFY_JOB_TIMEOUT_S={raw!r} must be positive")
    return value


if __name__ == "__main__":
    try:
        settings = Settings.from_env()
        _job_timeout_from_env()
    except SettingsError as exc:
        sys.exit(f"arena-verification: {exc}")
    sys.exit(asyncio.run(main(settings)))
