"""Every message Arena puts on the wire, as msgspec Structs.

This module is the contract between the planes; ``proto/`` is generated from it
(``python -m arena.proto``) and a test fails when the two drift.

Evolution rules (see docs/schemas.md):
- a new field always has a default, so old messages still decode;
- a field never changes type or meaning; retire it and add a new one instead;
- decoders of internal messages skip unknown fields, so newer producers can talk
  to older consumers; the public HTTP request bodies (``Submit*``) forbid unknown
  fields instead, so a user's typo is a 422 and not a silently ignored setting.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 1


class Base(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Internal message: immutable, keyword-only, unknown fields skipped."""


class Request(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Public request body: unknown fields are rejected with a clear error."""


# --------------------------------------------------------------------------- rollout state


class RolloutState(str, enum.Enum):
    """The rollout lifecycle. A final state is never left."""

    PENDING = "pending"
    PROVISIONING = "provisioning"
    RUNNING = "running"
    VERIFYING = "verifying"
    COMPLETED = "completed"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    BUDGET_EXHAUSTED = "budget_exhausted"

    @property
    def is_final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = frozenset(
    {
        RolloutState.COMPLETED,
        RolloutState.FAILED,
        RolloutState.TIMED_OUT,
        RolloutState.CANCELLED,
        RolloutState.BUDGET_EXHAUSTED,
    }
)


# --------------------------------------------------------------------------- tasks


class SamplingParams(Request, kw_only=True):
    """Sampling parameters a rollout applies to every LLM call its agent makes.

    ``None`` means "not set by the rollout": the agent's own value (or the
    backend default) is used.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class Budget(Request, kw_only=True):
    """Per-rollout limits. ``None`` means unlimited (wall clock always has a limit)."""

    max_total_tokens: int | None = None
    max_turns: int | None = None
    wall_clock_s: float = 600.0


class AgentSpec(Request, kw_only=True):
    """The program run inside the sandbox under the sandbox contract.

    ``path`` is a directory (on the machine running the sandbox service) mounted
    read-only at ``/sandbox/agent``; ``command`` runs with ``/sandbox/workspace``
    as working directory.
    """

    command: list[str]
    path: str | None = None
    env: dict[str, str] = {}


class TestsVerifier(Request, kw_only=True, tag="tests"):
    """SWE-bench style test-suite verifier.

    The test command runs in a fresh sandbox on the pristine task with the
    agent's diff applied and ``test_files`` restored from the pristine copy.
    Reward is 1 only when every FAIL_TO_PASS and PASS_TO_PASS test passed;
    a listed test that did not run counts as failed.
    """

    __test__ = False  # not a pytest class

    command: str = "python -m pytest -rA"
    parser: Literal["pytest"] = "pytest"
    fail_to_pass: list[str] = []
    pass_to_pass: list[str] = []
    test_files: list[str] = []
    timeout_s: float = 300.0


Verifier = TestsVerifier


class Task(Request, kw_only=True):
    """What to do: the repository, the instructions, the agent, the budgets, the verifier.

    ``repo`` is a directory readable by the sandbox and verification services
    (embedded mode: a local path). Its files at submission are the base commit.
    """

    id: str
    repo: str
    instructions: str
    agent: AgentSpec
    verifier: Verifier
    workdir: str = "."
    budget: Budget = Budget()
    metadata: dict[str, str] = {}


class SubmitRolloutRequest(Request, kw_only=True):
    """``POST /v1/rollouts``."""

    task: Task
    sampling: SamplingParams = SamplingParams()
    model: str = "default"
    provider: Literal["local"] = "local"
    metadata: dict[str, str] = {}


class SubmitGroupRequest(Request, kw_only=True):
    """``POST /v1/rollout-groups``: ``n`` copies of one task sharing a ``group_id``.

    If ``sampling.seed`` is set, member ``i`` gets ``seed + i`` so a group never
    samples ``n`` identical answers.
    """

    task: Task
    n: int
    sampling: SamplingParams = SamplingParams()
    model: str = "default"
    provider: Literal["local"] = "local"
    metadata: dict[str, str] = {}


# --------------------------------------------------------------------------- rollout records


class StateTransition(Base, kw_only=True):
    from_state: RolloutState | None
    to_state: RolloutState
    at: float
    reason: str = ""


class RolloutRecord(Base, kw_only=True):
    """The rollout as stored in the ``arena_rollouts`` KV bucket (compare-and-set)."""

    rollout_id: str
    task: Task
    sampling: SamplingParams
    model: str
    provider: str
    api_key: str
    state: RolloutState
    created_at: float
    updated_at: float
    group_id: str | None = None
    group_index: int = 0
    group_size: int = 1
    reason: str = ""
    steps: int = 0
    total_tokens: int = 0
    reward: float | None = None
    history: list[StateTransition] = []
    metadata: dict[str, str] = {}


class RolloutView(Base, kw_only=True):
    """A rollout as the HTTP API returns it (the API key is never shown)."""

    rollout_id: str
    task_id: str
    state: RolloutState
    reason: str
    created_at: float
    updated_at: float
    group_id: str | None = None
    group_index: int = 0
    group_size: int = 1
    steps: int = 0
    total_tokens: int = 0
    reward: float | None = None
    history: list[StateTransition] = []
    metadata: dict[str, str] = {}


class RolloutSubmitted(Base, kw_only=True):
    """``arena.rollout.submitted.{rollout_id}``."""

    rollout_id: str
    task_id: str
    group_id: str | None = None
    group_index: int = 0
    group_size: int = 1
    at: float


class RolloutStateChanged(Base, kw_only=True):
    """``arena.rollout.state.{rollout_id}``: one per transition.

    ``steps`` is the number of steps the proxy captured so far; on a final state it
    is the total, so the trajectory plane knows when it has them all.
    """

    rollout_id: str
    task_id: str
    from_state: RolloutState | None
    to_state: RolloutState
    at: float
    reason: str = ""
    steps: int = 0
    group_id: str | None = None
    group_index: int = 0
    group_size: int = 1
    reward: float | None = None
    metadata: dict[str, str] = {}


class GroupSubmitted(Base, kw_only=True):
    """Response of ``POST /v1/rollout-groups``."""

    group_id: str
    rollout_ids: list[str]


# --------------------------------------------------------------------------- sandbox plane


class SandboxJob(Base, kw_only=True):
    """``arena.sandbox.run.{provider}``: run the agent for one rollout.

    ``proxy_url`` is the rollout's OpenAI base URL as the sandbox host reaches it;
    the sandbox forwards it inside and gives the agent an in-sandbox URL.
    """

    rollout_id: str
    task: Task
    proxy_url: str
    api_key: str
    attempt: int = 1


class SandboxOutcome(str, enum.Enum):
    COMPLETED = "completed"  # the agent wrote /sandbox/.arena/done
    FAILED = "failed"  # exited (or crashed) without done
    TIMED_OUT = "timed_out"  # wall clock exceeded
    CANCELLED = "cancelled"  # the rollout was cancelled while running
    ERROR = "error"  # Arena could not run the sandbox at all


class SandboxStarted(Base, kw_only=True):
    """``arena.sandbox.started.{rollout_id}``."""

    rollout_id: str
    sandbox_id: str
    provider: str
    at: float


class SandboxDone(Base, kw_only=True):
    """``arena.sandbox.done.{rollout_id}``: what the sandbox ended with."""

    rollout_id: str
    sandbox_id: str
    provider: str
    outcome: SandboxOutcome
    reason: str
    started_at: float
    finished_at: float
    exit_code: int | None = None
    diff: str = ""  # final diff of /sandbox/workspace against the base commit
    result: dict[str, Any] | None = None  # /sandbox/.arena/result.json, if written
    log_tail: str = ""  # the last lines of the agent's stdout+stderr
    log_artifact: str | None = None  # full log: key in the arena_artifacts object store


# --------------------------------------------------------------------------- verification plane


class VerifyJob(Base, kw_only=True):
    """``arena.verify.run``: verify the agent's diff against the pristine task."""

    rollout_id: str
    task: Task
    diff: str


class TestStatus(str, enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    ERROR = "error"
    SKIPPED = "skipped"
    XFAILED = "xfailed"
    XPASSED = "xpassed"


class TestResult(Base, kw_only=True):
    __test__ = False

    test_id: str  # canonical id, e.g. ``tests/test_calc.py::test_add``
    status: TestStatus


class TestCounts(Base, kw_only=True):
    """SWE-bench style: FAIL_TO_PASS / PASS_TO_PASS outcomes, listed tests only."""

    __test__ = False

    f2p_passed: int = 0
    f2p_failed: int = 0
    p2p_passed: int = 0
    p2p_failed: int = 0


class VerificationResult(Base, kw_only=True):
    """``arena.verify.done.{rollout_id}``.

    ``flags`` name anything suspicious or incomplete: ``patch_failed``,
    ``tests_tampered``, ``tests_missing``, ``timeout``, ``parse_failed``.
    """

    rollout_id: str
    verifier: str
    reward: float
    passed: bool
    started_at: float
    finished_at: float
    components: dict[str, float] = {}
    tests: list[TestResult] = []
    counts: TestCounts = TestCounts()
    flags: list[str] = []
    reason: str = ""
    log_tail: str = ""


# --------------------------------------------------------------------------- captured steps


class TopLogprob(Base, kw_only=True):
    token: str
    logprob: float
    token_id: int | None = None


class Usage(Base, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Timings(Base, kw_only=True):
    """Milliseconds: waiting for a backend slot, to the first token, in total."""

    queued_ms: float = 0.0
    first_token_ms: float = 0.0
    total_ms: float = 0.0


class Step(Base, kw_only=True):
    """``arena.step.{rollout_id}``: one LLM call as the proxy saw it.

    ``token_ids_source`` is ``backend`` when the ids came from the backend and
    ``unavailable`` when it could not return them; ids are then ``None`` and never
    guessed by re-tokenizing text.
    """

    rollout_id: str
    step_index: int
    api: Literal["openai.chat"] = "openai.chat"
    model: str
    backend: str
    policy_version: str | None = None
    request_messages: list[dict[str, Any]] = []
    sampling: SamplingParams = SamplingParams()
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[TopLogprob]] | None = None
    token_ids_source: Literal["backend", "unavailable"] = "backend"
    completion_text: str = ""
    finish_reason: str | None = None
    usage: Usage = Usage()
    timings: Timings = Timings()
    started_at: float = 0.0


# --------------------------------------------------------------------------- trajectories


class Trajectory(Base, kw_only=True):
    """``arena.trajectory.{task_id}.{rollout_id}``: one finished rollout, training-grade."""

    schema_version: int = SCHEMA_VERSION
    rollout_id: str
    task_id: str
    group_id: str | None = None
    group_index: int = 0
    group_size: int = 1
    final_state: RolloutState
    reason: str = ""
    reward: float = 0.0
    steps: list[Step] = []
    sandbox: SandboxDone | None = None
    verification: VerificationResult | None = None
    policy_versions: list[str] = []
    completed_at: float = 0.0
    metadata: dict[str, str] = {}


class GroupCompleted(Base, kw_only=True):
    """``arena.group.{group_id}``: every member of a group reached a final state."""

    group_id: str
    task_id: str
    size: int
    trajectories: list[Trajectory]
    rewards: list[float]
    advantages: list[float]
    completed_at: float


class DeadLetter(Base, kw_only=True):
    """``arena.dead.{stream}``: a message that could not be processed, with why."""

    stream: str
    subject: str
    consumer: str
    error: str
    num_delivered: int
    data: bytes
    at: float


class ErrorBody(Base, kw_only=True):
    code: str
    message: str


class ErrorResponse(Base, kw_only=True):
    """Every HTTP error Arena returns: ``{"error": {"code": ..., "message": ...}}``."""

    error: ErrorBody


# --------------------------------------------------------------------------- codecs

ENCODER = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    return ENCODER.encode(obj)


#: Every wire message, by name: proto/ is generated from this table.
MESSAGES: dict[str, type] = {
    "SubmitRolloutRequest": SubmitRolloutRequest,
    "SubmitGroupRequest": SubmitGroupRequest,
    "GroupSubmitted": GroupSubmitted,
    "RolloutRecord": RolloutRecord,
    "RolloutView": RolloutView,
    "RolloutSubmitted": RolloutSubmitted,
    "RolloutStateChanged": RolloutStateChanged,
    "SandboxJob": SandboxJob,
    "SandboxStarted": SandboxStarted,
    "SandboxDone": SandboxDone,
    "VerifyJob": VerifyJob,
    "VerificationResult": VerificationResult,
    "Step": Step,
    "Trajectory": Trajectory,
    "GroupCompleted": GroupCompleted,
    "DeadLetter": DeadLetter,
    "ErrorResponse": ErrorResponse,
}
