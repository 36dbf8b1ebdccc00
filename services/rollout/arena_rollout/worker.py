"""Wiring: the rollout plane's consumers of sandbox and verification results."""

from __future__ import annotations

from arena_core import subjects
from arena_core.bus import Bus, Consumer
from arena_core.schemas import DeadLetter, SandboxStarted, VerificationResult

from arena_rollout.service import RolloutService, SandboxEnded


def consumers(bus: Bus, service: RolloutService) -> list[Consumer]:
    common = {"stream": "ARENA_RESULTS", "concurrency": 16, "max_deliver": 40}
    return [
        Consumer(bus, durable=f"{subjects.CONSUMER_ROLLOUT_RESULTS}-started",
                 filter_subjects=["arena.sandbox.started.*"], message_type=SandboxStarted,
                 handler=service.on_sandbox_started, **common),
        Consumer(bus, durable=f"{subjects.CONSUMER_ROLLOUT_RESULTS}-sandbox",
                 filter_subjects=["arena.sandbox.done.*"], message_type=SandboxEnded,
                 handler=service.on_sandbox_done, **common),
        Consumer(bus, durable=f"{subjects.CONSUMER_ROLLOUT_RESULTS}-verify",
                 filter_subjects=["arena.verify.done.*"], message_type=VerificationResult,
                 handler=service.on_verify_done, **common),
        Consumer(bus, stream="ARENA_DEAD", durable=f"{subjects.CONSUMER_ROLLOUT_RESULTS}-dead",
                 filter_subjects=[subjects.dead("ARENA_SANDBOX_JOBS"), subjects.dead("ARENA_VERIFY_JOBS")],
                 message_type=DeadLetter, handler=service.on_dead_letter, concurrency=4, max_deliver=10),
    ]
