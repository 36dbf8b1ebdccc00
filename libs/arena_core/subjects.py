"""The subject catalog: every stream, subject, consumer and bucket Arena uses.

Subjects are code, not strings scattered through services. ``proto/subjects.json``
is generated from this module.
"""

from __future__ import annotations

import functools

import msgspec

PREFIX = "arena"


class StreamSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    subjects: list[str]
    retention: str  # "limits" | "workqueue"
    description: str
    max_age_s: float = 0.0  # 0: keep forever
    #: Publishes to this stream made in the same moment go to this subject as one ``Pack``
    #: (``arena_core.packing``); "" for none.
    packs: str = ""


#: Steps published together, as one ``Pack`` (``arena_core.packing``).
STEP_PACKS = "arena.steps"

STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        name="ARENA_ROLLOUTS",
        subjects=["arena.rollout.submitted.*", "arena.rollout.state.*"],
        retention="limits",
        description="Rollout submissions and every state transition.",
    ),
    StreamSpec(
        name="ARENA_SANDBOX_JOBS",
        subjects=["arena.sandbox.run.*"],
        retention="workqueue",
        description="Sandbox jobs, one subject per provider.",
    ),
    StreamSpec(
        name="ARENA_STEPS",
        subjects=["arena.step.*", STEP_PACKS],
        retention="limits",
        description="Every LLM call captured by the proxy: one step per message on arena.step.{rollout_id}, "
                    "or steps published together as one Pack on arena.steps.",
        packs=STEP_PACKS,
    ),
    StreamSpec(
        name="ARENA_VERIFY_JOBS",
        subjects=["arena.verify.run"],
        retention="workqueue",
        description="Verification jobs.",
    ),
    StreamSpec(
        name="ARENA_RESULTS",
        subjects=["arena.sandbox.started.*", "arena.sandbox.done.*", "arena.verify.done.*"],
        retention="limits",
        description="Sandbox and verification outcomes.",
    ),
    StreamSpec(
        name="ARENA_TRAJECTORIES",
        subjects=["arena.trajectory.*.*", "arena.group.*"],
        retention="limits",
        description="Completed trajectories and groups: the training log.",
    ),
    StreamSpec(
        name="ARENA_DEAD",
        subjects=["arena.dead.*"],
        retention="limits",
        description="Messages that could not be processed, with the error.",
    ),
)

KV_ROLLOUTS = "arena_rollouts"
KV_BACKENDS = "arena_backends"
#: Tasks' private parts (verifiers), keyed by the sha256 of their JSON: read by verification only.
KV_VERIFIERS = "arena_verifiers"
KV_API_KEYS = "arena_api_keys"  # API key id -> ApiKey (hashed; arena_core.apikeys)
#: Environments served over OpenEnv's protocol: name -> EnvironmentRecord (docs/openenv.md).
KV_ENVIRONMENTS = "arena_environments"
#: Sandbox workers and the providers they serve, refreshed by each (arena_core.workers).
KV_WORKERS = "arena_workers"
#: A multi-step task's steps as its step gate graded them: ``{rollout_id}.{index}`` -> StepGrade
#: (arena_core.step_gate), written by verification only and read by its final verification.
KV_STEP_GRADES = "arena_step_grades"
#: Buckets whose entries expire (seconds, by the NATS server's clock).
KV_TTL_S = {KV_WORKERS: 20.0, KV_STEP_GRADES: 3 * 86400.0}
OBJECT_ARTIFACTS = "arena_artifacts"
#: Tasks' private parts too large for their bucket (verifiers over ``private.INLINE_MAX``):
#: written by rollout, read by verification only (``arena_core.access``), apart from the
#: artifacts every service reads.
OBJECT_PRIVATE = "arena_private"
OBJECT_STORES = (OBJECT_ARTIFACTS, OBJECT_PRIVATE)
#: Every KV bucket, as the topology step creates them (``Bus.ensure_topology``).
KV_BUCKETS = (KV_ROLLOUTS, KV_BACKENDS, KV_VERIFIERS, KV_API_KEYS, KV_ENVIRONMENTS, KV_WORKERS, KV_STEP_GRADES)

# Durable consumer names, one per (service, purpose).
CONSUMER_ROLLOUT_RESULTS = "rollout-results"
CONSUMER_SANDBOX = "sandbox-{provider}"
CONSUMER_VERIFIER = "verifier"
CONSUMER_TRAJ_STEPS = "trajectory-steps"
CONSUMER_TRAJ_RESULTS = "trajectory-results"
CONSUMER_TRAJ_STATES = "trajectory-states"


def rollout_submitted(rollout_id: str) -> str:
    return f"arena.rollout.submitted.{rollout_id}"


def rollout_state(rollout_id: str) -> str:
    return f"arena.rollout.state.{rollout_id}"


def sandbox_run(provider: str) -> str:
    return f"arena.sandbox.run.{provider}"


def sandbox_started(rollout_id: str) -> str:
    return f"arena.sandbox.started.{rollout_id}"


def sandbox_done(rollout_id: str) -> str:
    return f"arena.sandbox.done.{rollout_id}"


def step(rollout_id: str) -> str:
    return f"arena.step.{rollout_id}"


VERIFY_RUN = "arena.verify.run"


def verify_done(rollout_id: str) -> str:
    return f"arena.verify.done.{rollout_id}"


def verify_step(rollout_id: str) -> str:
    """A multi-step task's step gate: grade a step now (core NATS request/reply, ``arena_core.step_gate``)."""
    return f"arena.verify.step.{rollout_id}"


#: What the verification workers listen on for step gates (one queue group: each request to one worker).
VERIFY_STEP_ALL = "arena.verify.step.*"


def trajectory(task_id: str, rollout_id: str) -> str:
    return f"arena.trajectory.{token(task_id)}.{rollout_id}"


def group(group_id: str) -> str:
    return f"arena.group.{group_id}"


def dead(stream: str) -> str:
    return f"arena.dead.{stream}"


def trainer_metrics(run: str) -> str:
    """A trainer's step metrics, live (core NATS, no stream: the trajectory service stores them)."""
    return f"arena.trainer.metrics.{token(run)}"


def duel_done(duel_id: str) -> str:
    """A duel's round (or the whole duel) was decided: a ``DuelRoundDone`` notice (core NATS, no stream)."""
    return f"arena.duel.done.{duel_id}"


def env_exchange(rollout_id: str) -> str:
    """An OpenEnv episode's exchanges with the sandbox worker holding it (core NATS request/reply)."""
    return f"arena.env.{rollout_id}"


def msg_id(rollout_id: str, kind: str, seq: int | str = 0) -> str:
    """The ``Nats-Msg-Id`` of a publish: ``{rollout_id}:{kind}:{seq}``."""
    return f"{rollout_id}:{kind}:{seq}"


def stream_of(subject: str) -> str | None:
    """The stream of :data:`STREAMS` that takes ``subject`` (NATS wildcards), or ``None``.
    On every publish: the answer depends only on the subject's first three tokens and its
    length (every pattern is literal in those and wildcards after), so it is cached by them."""
    parts = subject.split(".")
    return _stream_by_shape(tuple(parts[:3]), len(parts))


@functools.lru_cache(maxsize=1024)
def _stream_by_shape(head: tuple[str, ...], length: int) -> str | None:
    parts = [*head, *("_" * (length - len(head)))]
    for spec in STREAMS:
        for pattern in spec.subjects:
            want = pattern.split(".")
            if (want[-1] == ">" and len(parts) >= len(want) and all(w in ("*", p) for w, p in zip(want[:-1], parts))
                    or len(want) == len(parts) and all(w in ("*", p) for w, p in zip(want, parts))):
                return spec.name
    return None


assert all(w in ("*", ">") for spec in STREAMS for p in spec.subjects for w in p.split(".")[3:]), \
    "stream_of caches by a subject's first three tokens: no pattern may be literal past them"


def token(value: str) -> str:
    """Make ``value`` safe as one subject token (no dots, spaces or wildcards)."""
    out = []
    for ch in value:
        out.append(ch if ch.isalnum() or ch in "-_" else "_")
    return "".join(out) or "_"


def catalog() -> dict:
    """The catalog as plain data, for ``proto/subjects.json``."""
    return {
        "streams": [msgspec.to_builtins(s) for s in STREAMS],
        "subjects": {
            "rollout_submitted": "arena.rollout.submitted.{rollout_id}",
            "rollout_state": "arena.rollout.state.{rollout_id}",
            "sandbox_run": "arena.sandbox.run.{provider}",
            "sandbox_started": "arena.sandbox.started.{rollout_id}",
            "sandbox_done": "arena.sandbox.done.{rollout_id}",
            "step": "arena.step.{rollout_id}",
            "step_packs": STEP_PACKS,
            "verify_run": VERIFY_RUN,
            "verify_done": "arena.verify.done.{rollout_id}",
            "verify_step": "arena.verify.step.{rollout_id}",
            "trajectory": "arena.trajectory.{task_id}.{rollout_id}",
            "group": "arena.group.{group_id}",
            "dead": "arena.dead.{stream}",
            "trainer_metrics": "arena.trainer.metrics.{run}",
            "duel_done": "arena.duel.done.{duel_id}",
            "env_exchange": "arena.env.{rollout_id}",
        },
        "messages": {
            "arena.rollout.submitted.{rollout_id}": "RolloutSubmitted",
            "arena.rollout.state.{rollout_id}": "RolloutStateChanged",
            "arena.sandbox.run.{provider}": "SandboxJob",
            "arena.sandbox.started.{rollout_id}": "SandboxStarted",
            "arena.sandbox.done.{rollout_id}": "SandboxDone",
            "arena.step.{rollout_id}": "Step",
            STEP_PACKS: "Pack",
            "arena.verify.run": "VerifyJob",
            "arena.verify.done.{rollout_id}": "VerificationResult",
            "arena.verify.step.{rollout_id}": "StepVerifyRequest",
            "arena.trajectory.{task_id}.{rollout_id}": "Trajectory",
            "arena.group.{group_id}": "GroupCompleted",
            "arena.dead.{stream}": "DeadLetter",
            "arena.trainer.metrics.{run}": "TrainerMetrics",
            "arena.duel.done.{duel_id}": "DuelRoundDone",
            "arena.env.{rollout_id}": "EnvRequest",
        },
        "kv_buckets": list(KV_BUCKETS),
        "object_stores": list(OBJECT_STORES),
        "msg_id": "{rollout_id}:{kind}:{seq}",
        "headers": {
            "Nats-Msg-Id": "de-duplication key",
            "traceparent": "W3C trace context",
            "Arena-Body-Object": "the body was over the server's max_payload: it is this object in the "
                                 f"{OBJECT_ARTIFACTS} object store and the message payload is empty",
        },
    }
