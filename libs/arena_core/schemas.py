"""Every message Arena puts on the wire, as msgspec Structs: the contract between the planes.

``proto/`` is generated from it (``python -m arena_core.proto``) and a test fails when the two
drift. The evolution rules (defaults, unknown fields) are in docs/schemas.md.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any, Literal

import msgspec

from arena_core import scaffolds

SCHEMA_VERSION = 2  # 2: reward may be null (an infrastructure outcome), docs/schemas.md


#: The project of everything made by a key without one, stored before projects existed, or
#: made while keys are off (docs/projects.md).
DEFAULT_PROJECT = "default"
#: A project's name: 1-64 letters, digits, ``_`` and ``-``, a letter or digit first (no dots, no ``/``).
PROJECT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"

#: One grammar for every identifier that enters over HTTP or NATS (rollout, group, task,
#: trajectory, key ids; subject tokens): 1-128 characters, an ASCII letter or digit first, then
#: letters, digits, ``_`` and ``-``, with single dots between non-empty parts (an id becomes a
#: NATS subject token and a KV key: no empty token). No look-around here: FastAPI's validator
#: (Rust's regex, where ``$`` is the end of the text) lacks it.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]*(?:\.[A-Za-z0-9_-]+)*$"
ID_MAX = 128
ID_RE = re.compile(ID_PATTERN)


def whole(pattern: str) -> str:
    """``pattern`` (anchored by ``^...$``) matched against the whole value by msgspec, which
    searches with Python's ``re``, where ``$`` also matches before a final newline ("abc\\n"
    would pass): a look-ahead refuses that newline. ECMA-262 has it too, so the JSON Schema in
    ``proto/`` stays valid for other languages."""
    return pattern + r"(?!\n)"


#: An identifier in a message or request body (msgspec): :data:`ID_PATTERN`, matched whole.
Id = Annotated[str, msgspec.Meta(pattern=whole(ID_PATTERN), max_length=128)]
#: Submitters' labels: at most 64, keys 1-128 characters, values up to 4 KiB.
Labels = Annotated[dict[Annotated[str, msgspec.Meta(min_length=1, max_length=128)],
                        Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(max_length=64)]
#: The longest wall clock any task may ask for; an operator lowers it (ARENA_MAX_WALL_CLOCK_S).
MAX_WALL_CLOCK_S = 7 * 86400.0
#: The longest hard lifetime (queue + run + verify) a rollout may ask for.
MAX_LIFETIME_S = 8 * 86400.0


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
    #: Alternatives per token to capture (backends that support it: vLLM, SGLang).
    top_logprobs: int | None = None
    #: How the values above meet the agent's own: ``override`` replaces them, ``default``
    #: fills only what the agent left unset, ``clamp`` lets the agent go lower but never
    #: above the rollout's value for numeric fields (``seed`` and ``stop`` override).
    policy: Literal["override", "default", "clamp"] = "override"


class Budget(Request, kw_only=True):
    """Per-rollout limits. ``None`` means unlimited (wall clock always has a limit)."""

    max_total_tokens: Annotated[int, msgspec.Meta(ge=1, le=10**10)] | None = None
    max_turns: Annotated[int, msgspec.Meta(ge=1, le=10**6)] | None = None
    wall_clock_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_WALL_CLOCK_S)] = 600.0
    #: The rollout's hard lifetime from submission (queue + run + verify), seconds: past it the
    #: reaper ends it and all it holds is reclaimed. ``None``: the server's default
    #: (``ARENA_ROLLOUT_MAX_LIFETIME_S``). Must be at least ``wall_clock_s``.
    max_lifetime_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_LIFETIME_S)] | None = None


#: A content-addressed bundle: ``sha256:`` and the hex digest of the bundle's bytes.
BundleDigest = Annotated[str, msgspec.Meta(pattern=whole(r"^sha256:[0-9a-f]{64}$"))]


#: Agent scaffolds Arena launches from a preset (``arena_core.scaffolds``, docs/agents.md).
ScaffoldName = Literal["mini-swe-agent", "claude-code", "opencode", "openhands", "terminus-2", "qwen-code", "codex",
                       "gemini-cli"]


class ScaffoldSpec(Request, kw_only=True):
    """A known agent scaffold, launched with Arena's preset for it (docs/agents.md).

    ``model`` is the model name the scaffold sends (the proxy replaces it with the rollout's
    ``model`` unless that is ``default``); ``config`` holds the scaffold's own settings on top of
    the preset's (for mini-swe-agent: merged into its config, e.g. ``{"agent": {"step_limit": 20}}``).
    """

    name: ScaffoldName
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    config: dict[str, Any] = {}


class AgentSpec(Request, kw_only=True):
    """The program run inside the sandbox under the sandbox contract: a raw ``command``, a
    ``scaffold`` preset, or ``external`` (exactly one of the three).

    ``external``: no program runs; an OpenEnv client outside Arena drives the sandbox one
    action at a time through the environment endpoint (docs/openenv.md).

    Its files, if any, are mounted read-only at ``/sandbox/agent``: ``bundle`` (uploaded
    with ``arena tasks push`` / the SDK, docs/tasks.md) or, in embedded mode only
    (``ARENA_ALLOW_HOST_PATHS``), ``path``, a directory on the sandbox host. ``command``
    runs with ``/sandbox/workspace`` as working directory.
    """

    command: list[str] = []
    scaffold: ScaffoldSpec | None = None
    external: bool = False
    path: str | None = None
    bundle: BundleDigest | None = None
    env: dict[str, str] = {}

    def __post_init__(self) -> None:
        if bool(self.command) + (self.scaffold is not None) + self.external != 1:
            raise ValueError("agent: give exactly one of `command` (the program to run), `scaffold` "
                             "(a preset such as {\"name\": \"mini-swe-agent\", \"model\": ...}) and "
                             "`external: true` (an OpenEnv client drives the rollout, docs/openenv.md)")
        if self.scaffold is not None and (problem := scaffolds.unavailable(self.scaffold.name)) is not None:
            raise ValueError(f"agent.scaffold: {problem}")


class BundleSource(Request, kw_only=True, tag="bundle"):
    """The repository is a bundle in Arena's object store (``POST /v1/bundles``)."""

    digest: BundleDigest


class GitSource(Request, kw_only=True, tag="git"):
    """The repository is ``commit`` of the git repository at ``url`` (fetched by each worker)."""

    url: Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]
    commit: Annotated[str, msgspec.Meta(pattern=whole(r"^[0-9a-f]{7,64}$"))]


class ImageSource(Request, kw_only=True, tag="image"):
    """The repository is the directory ``path`` inside ``image`` (SWE-bench style); the
    agent and the verifier run in that image unless the task names another."""

    image: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    path: str = "/testbed"


class PathSource(Request, kw_only=True, tag="path"):
    """A directory on the workers' own disk: embedded mode only (``ARENA_ALLOW_HOST_PATHS``)."""

    path: str


Source = BundleSource | GitSource | ImageSource | PathSource


class OpenEnvServer(Request, kw_only=True):
    """An unmodified OpenEnv environment server the task runs, one per episode (docs/openenv.md).

    The sandbox starts it (``docker``: ``image`` with its own command; ``local``: uvicorn
    serving ``app`` from ``path``/``bundle``, under bubblewrap), waits for ``GET /health``,
    then relays each action of the rollout to it over one WebSocket ``/ws`` and records
    every reply. The rollout's reward is the sum (or the last) of the rewards it returned.
    """

    image: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] | None = None
    #: The ASGI app uvicorn serves (``module:attribute``), from the environment's directory.
    app: Annotated[str, msgspec.Meta(pattern=whole(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"), max_length=256)] = "server.app:app"
    #: The environment's directory (the ``openenv init`` layout), mounted at ``/sandbox/agent``:
    #: a bundle in Arena's object store, or a host path (embedded mode only).
    bundle: BundleDigest | None = None
    path: str | None = None
    #: The command that serves the environment on ``127.0.0.1:port`` inside the sandbox; empty:
    #: the image's own command (docker) or ``python -m uvicorn {app}`` (local).
    command: list[str] = []
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000
    env: dict[str, str] = {}
    ready_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 120.0
    step_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    #: Keyword arguments every ``reset`` gets (the client's own win).
    reset: dict[str, Any] = {}
    #: Keep a started server for the next episode of this environment on the same worker
    #: (OpenEnv's server makes a fresh environment per WebSocket); false: a server per episode.
    reuse: bool = True

    def __post_init__(self) -> None:
        if self.image is None and self.bundle is None and self.path is None and not self.command:
            raise ValueError("environment: give its `image` (docker), or its directory as `bundle` or `path` "
                             "(local), or the `command` that serves it")


ParserName = Literal[
    "pytest", "pytest_junit", "unittest", "go_test", "go_test_json", "cargo",
    "node_spec", "node_tap", "jest", "vitest", "mocha", "junit",
    "cargo_json", "jest_json", "vitest_json", "mocha_json", "tap", "node_junit",
]


class TestsVerifier(Request, kw_only=True, tag="tests"):
    """SWE-bench style test-suite verifier.

    The test command runs in a fresh sandbox on the pristine task with the
    agent's diff applied and ``test_files`` restored from the pristine copy.
    Reward is 1 only when every FAIL_TO_PASS and PASS_TO_PASS test passed;
    a listed test that did not run counts as failed.
    """

    __test__ = False  # not a pytest class

    #: ``{report}`` in the command is replaced by a fresh path outside the workspace; the
    #: run's structured report is read from there (with ``parser``) instead of the log.
    command: str = "python -m pytest -rA"
    parser: ParserName = "pytest"
    #: With ``{report}``: the parser for the log when the report is missing or incomplete.
    fallback_parser: ParserName | None = None
    fail_to_pass: list[str] = []
    pass_to_pass: list[str] = []
    #: Test files reset to their base version before the run (the agent's edits undone).
    test_files: list[str] = []
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 300.0
    report_file: str | None = None  # parse this file (relative to workdir, e.g. JUnit XML) instead of the log
    #: Hidden tests: a git diff applied after the reset (SWE-bench's ``test_patch``); the
    #: files it touches are reset first as well.
    test_patch: str = ""
    #: Hidden test files: a bundle whose files are copied over the repository after the reset.
    hidden_files: BundleDigest | None = None
    #: In-process tamper checks (pytest parsers): canary tests (one must fail, one must pass) beside
    #: the listed tests, and the guard plug-in that observes every test apart from pytest's reports;
    #: a runner that misreports either flags ``runner_tampered`` (docs/verification.md).
    canaries: bool = True
    #: Exact-match grading (R2E-Gym's rule) instead of FAIL_TO_PASS/PASS_TO_PASS: reward 1 only
    #: when the run's tests and their statuses (``PASSED``, ``FAILED``, ``ERROR``) equal this map,
    #: no test more or less. Keys are R2E-Gym's: the node id after its file, ``::`` read as ``.``
    #: (``TestX.test_a[1]``), cut at `` - ``.
    expected_statuses: dict[str, str] = {}


class RubricItem(Request, kw_only=True):
    """One rubric line: a phrase (or regex) the text must contain, or must not."""

    pattern: str
    regex: bool = False
    forbidden: bool = False  # True: the text must NOT match
    weight: float = 1.0
    name: str = ""


class RubricVerifier(Request, kw_only=True, tag="rubric"):
    """Weighted required / forbidden phrases over the agent's answer (or its diff).

    Reward is the weight of satisfied items over the total weight; ``passed`` when all are.
    """

    items: list[RubricItem]
    source: Literal["answer", "diff"] = "answer"
    case_sensitive: bool = False


class ExactVerifier(Request, kw_only=True, tag="exact"):
    """The answer equals one of ``answers`` after normalisation (numbers compared as numbers)."""

    answers: list[str]
    mode: Literal["auto", "number", "string"] = "auto"
    rel_tolerance: float = 1e-9
    case_sensitive: bool = False


class LlmJudgeVerifier(Request, kw_only=True, tag="llm_judge"):
    """A judge model grades the answer against ``rubric`` through an OpenAI-compatible API.

    The judge's call is recorded on the result (``judge_calls``), never in the policy's steps.
    ``base_url`` empty: the verification service's ``ARENA_JUDGE_BASE_URL``, else Arena's
    proxy (the rollout service's judge route, with ``ARENA_JUDGE_KEY``).
    """

    rubric: str
    model: str = "judge"
    base_url: str = ""
    source: Literal["answer", "diff"] = "answer"
    max_tokens: int = 512
    temperature: float = 0.0
    timeout_s: float = 120.0


class PythonVerifier(Request, kw_only=True, tag="python"):
    """A plug-in: the entry point ``name`` in group ``arena.verifiers``, given ``config``."""

    name: str
    config: dict[str, Any] = {}


LeafVerifier = TestsVerifier | RubricVerifier | ExactVerifier | LlmJudgeVerifier | PythonVerifier


class WeightedVerifier(Request, kw_only=True):
    """One part of a composite: its reward is component ``name``, weighted by ``weight``."""

    name: str
    verifier: LeafVerifier
    weight: float = 1.0


class CompositeVerifier(Request, kw_only=True, tag="composite"):
    """Weighted mean of several verifiers; each part's reward is a named component."""

    verifiers: list[WeightedVerifier]


class EnvRewardVerifier(Request, kw_only=True, tag="env_reward"):
    """The reward an OpenEnv environment gave: the ``sum`` of its step rewards (the return), or
    the ``last`` one. ``passed`` when it reaches ``pass_threshold``. An episode the environment
    never ended (``done``) still scores what it returned so far unless ``require_done``."""

    reduce: Literal["sum", "last"] = "sum"
    pass_threshold: float = 1.0
    require_done: bool = False


#: Thresholds on a step's rewards: a number gates the ``reward`` key, a map each named key.
MinReward = float | dict[str, float]


class RewardFileStep(Request, kw_only=True):
    """One step of a multi-step reward-file task (Harbor's ``[[steps]]``): its own tests (laid
    over the task's shared ones) and the minimum its rewards must reach for the next step to count."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    #: The step's test files, by path under ``/tests`` (over the task's shared ``files``).
    files: dict[str, bytes] = {}
    script: str = "test.sh"
    min_reward: MinReward | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] | None = None


class RewardFileVerifier(Request, kw_only=True, tag="reward_file"):
    """Harbor's rule (Terminal-Bench v1 tasks are mapped onto it as Harbor maps them): in a fresh
    sandbox of the task's image holding the agent's diff, the test files are put at ``/tests``,
    ``/tests/<script>`` runs from the task's working directory, and the reward is read from
    ``/logs/verifier/reward.json`` (named numbers; it wins) or ``reward.txt`` (one number). Every
    named number is kept as a component; the scalar reward is ``reward``, else the only one.
    A missing, empty or malformed reward file, or several numbers without ``reward``: no reward
    (Arena could not verify), never a 0. docs/tasks.md ("Harbor tasks")."""

    #: The task's test files, by path under ``/tests`` (``tests/`` of a Harbor task).
    files: dict[str, bytes] = {}
    script: str = "test.sh"
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 600.0
    env: dict[str, str] = {}
    #: ``passed`` when the scalar reward reaches this.
    pass_threshold: float = 1.0
    #: Terminal-Bench v1's own rule as well: the script's output must hold pytest's short test
    #: summary (``-rA``) listing at least one test, each passed (skipped and xfailed count as
    #: passed, as Terminal-Bench's parser counts them); otherwise the reward is 0, whatever the file says.
    pytest_summary: bool = False
    #: Multi-step tasks: each step's tests run in order on the agent's final state; grading stops
    #: at the first step under its ``min_reward``; the reward follows ``strategy`` (Harbor's
    #: ``multi_step_reward_strategy``: the per-key ``mean`` over the steps graded, or the ``final`` one).
    steps: list[RewardFileStep] = []
    strategy: Literal["mean", "final"] = "mean"


Verifier = (TestsVerifier | RubricVerifier | ExactVerifier | LlmJudgeVerifier | PythonVerifier | CompositeVerifier
            | EnvRewardVerifier | RewardFileVerifier)


class SidecarService(Request, kw_only=True):
    """A service the task's environment runs beside the agent (a compose file's other services):
    on the ``docker`` provider, a container on the sandbox's own internal network, reached by
    ``name``; other providers refuse such a task (docs/tasks.md, "Compose environments")."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=63, pattern=whole(r"^[a-z0-9][a-z0-9_-]*$"))]
    image: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    #: The container's command ([]: the image's own).
    command: list[str] = []
    env: dict[str, str] = {}


class TaskStep(Request, kw_only=True):
    """One step of a multi-step task (Harbor's ``[[steps]]``; public): the agent gets a turn per
    step, in order, in the same sandbox, with this step's instruction in ``task.json`` (and
    ``ARENA_STEP``); its tests (the verifier's step of the same name) grade the state it leaves."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=whole(r"^[A-Za-z0-9][A-Za-z0-9._-]*$"))]
    instructions: Annotated[str, msgspec.Meta(max_length=1024 * 1024)]
    #: This turn's wall clock (``None``: what is left of the task's ``budget.wall_clock_s``).
    wall_clock_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_WALL_CLOCK_S)] | None = None


class Task(Request, kw_only=True):
    """What to do: the source, the instructions, the agent, the budgets (the public part),
    and the verifier (the private part: never in the agent's sandbox nor in API views).

    ``source`` says where the repository comes from (docs/tasks.md); ``repo`` is the older
    spelling of a :class:`PathSource` (embedded mode only). The source's files are the
    base commit; the agent's copy has no other history.
    """

    id: Id
    instructions: Annotated[str, msgspec.Meta(max_length=1024 * 1024)]
    agent: AgentSpec
    source: Source | None = None
    repo: str = ""
    verifier: Verifier | None = None
    workdir: str = "."
    budget: Budget = Budget()
    metadata: dict[str, str] = {}
    #: Container image the agent and the verifier run in (``docker`` provider); ``None``: an
    #: image source's image, else the provider's default (``ARENA_SANDBOX_IMAGE``). Ignored by
    #: ``local`` (the host's ``/usr``) and ``mock``.
    image: str | None = None
    #: An unmodified OpenEnv environment the rollout plays (the agent is then ``external``).
    environment: OpenEnvServer | None = None
    #: A multi-step task: one agent turn per step, in order, in one sandbox (docs/tasks.md,
    #: "Multi-step tasks"); ``instructions`` is then their overview. Empty: one turn.
    steps: Annotated[list[TaskStep], msgspec.Meta(max_length=64)] = []
    #: Sidecar services on the sandbox's private network (``docker`` provider only).
    services: Annotated[list[SidecarService], msgspec.Meta(max_length=16)] = []

    def __post_init__(self) -> None:
        if self.environment is not None and not self.agent.external:
            raise ValueError("a task with an `environment` is played by an OpenEnv client: its agent must be "
                             "{\"external\": true} (docs/openenv.md)")
        if self.steps and (self.environment is not None or self.agent.external):
            raise ValueError("a task with `steps` gives a turn to its own agent per step; an OpenEnv episode has none")
        if len({s.name for s in self.steps}) != len(self.steps):
            raise ValueError("two of the task's `steps` have the same name")

    def source_of(self) -> Source | None:
        """The task's source, with ``repo`` read as a :class:`PathSource`."""
        if self.source is not None:
            return self.source
        return PathSource(path=self.repo) if self.repo else None

    def image_of(self) -> str:
        """The image the task runs in ("" = the provider's default)."""
        if self.image:
            return self.image
        if self.environment is not None and self.environment.image:
            return self.environment.image
        return self.source.image if isinstance(self.source, ImageSource) else ""

    def workspace_mount(self) -> str:
        """Where the image expects the repository (an image source's path), else ""."""
        return self.source.path if isinstance(self.source, ImageSource) else ""

    def public(self) -> Task:
        """The task without its private part (what the agent and API views may see)."""
        return msgspec.structs.replace(self, verifier=None)


class SubmitRolloutRequest(Request, kw_only=True):
    """``POST /v1/rollouts``."""

    task: Task
    sampling: SamplingParams = SamplingParams()
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] = "default"
    provider: Literal["local", "docker", "mock"] = "local"  # mock: no process runs (demos)
    metadata: Labels = {}


class GroupCompletion(Request, kw_only=True):
    """When a group is done (docs/rollout.md, Group completion). Unset fields: wait for every
    member. ``first_k``: once ``k`` members ended with a verifier's reward (a verified 0 counts;
    an infrastructure outcome or a never-verified failure does not), the rest are cancelled.
    ``deadline_s``: that long after submission, the members not yet ended are cancelled. Both
    set: whichever comes first. Members cancelled so are marked (``group_cancelled``) and never
    carry a reward: the group goes out with the others (``GroupCompleted.cancelled_indexes``)."""

    first_k: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    deadline_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_LIFETIME_S)] | None = None


class SubmitGroupRequest(Request, kw_only=True):
    """``POST /v1/rollout-groups``: ``n`` copies of one task sharing a ``group_id``.

    If ``sampling.seed`` is set, member ``i`` gets ``seed + i`` so a group never
    samples ``n`` identical answers. ``completion``: when the group is done (default: every
    member ended).
    """

    task: Task
    n: Annotated[int, msgspec.Meta(ge=1, le=1024)]
    completion: GroupCompletion = GroupCompletion()
    sampling: SamplingParams = SamplingParams()
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] = "default"
    provider: Literal["local", "docker", "mock"] = "local"  # mock: no process runs (demos)
    metadata: Labels = {}


#: Labels a duel puts on every member rollout (and so on its trajectory): the duel's id, the
#: side (``a`` / ``b``), the side's model name and the member's seed. Refused in submitted metadata.
LABEL_DUEL = "arena.duel"
LABEL_DUEL_SIDE = "arena.duel.side"
LABEL_DUEL_POLICY = "arena.duel.policy"
LABEL_DUEL_SEED = "arena.duel.seed"
#: The most seeds one duel runs.
MAX_DUEL_SEEDS = 64
PolicyName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class SubmitDuelRequest(Request, kw_only=True):
    """``POST /v1/duels``: the same task for two policies (model names the backends serve, a
    checkpoint or LoRA adapter under its own name) on the same ``n`` seeds.

    Two groups are submitted, one per policy; member ``i`` of each samples with seed
    ``sampling.seed + i`` (``sampling.seed`` unset: 0), so seed ``s`` is one round, decided by
    the verifier's rewards (docs/rollout.md, Duels).
    """

    task: Task
    policies: Annotated[list[PolicyName], msgspec.Meta(min_length=2, max_length=2)]
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_DUEL_SEEDS)]
    sampling: SamplingParams = SamplingParams()
    provider: Literal["local", "docker", "mock"] = "local"
    metadata: Labels = {}


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
    #: steps whose answer never reached the agent (``Step.abandoned``): counted in ``steps``
    #: and their tokens in ``total_tokens``, but not against ``max_turns``
    abandoned_steps: int = 0
    reward: float | None = None
    history: list[StateTransition] = []
    metadata: dict[str, str] = {}
    #: Key of the task's private part in the ``arena_verifiers`` bucket (``task`` here is public).
    verifier_ref: str = ""
    #: The verifier's own timeouts, seconds (the reaper's verification deadline uses it).
    verify_budget_s: float = 0.0
    #: The rollout ended because Arena could not run or verify it: no reward, not a policy failure.
    infrastructure: bool = False
    #: W3C ``traceparent`` of the rollout's submission span ("" when tracing is off): the
    #: proxy's spans join the rollout's trace through it (docs/observability.md).
    traceparent: str = ""
    #: The id of the API key that made it ("anonymous" with keys off): only it or an admin key
    #: may cancel it (``arena_core.owners``).
    owner: str = "anonymous"
    #: The group's completion policy (group members only; default: every member) and when the
    #: group was submitted (its ``deadline_s`` counts from then).
    completion: GroupCompletion = GroupCompletion()
    group_submitted_at: float = 0.0
    #: Cancelled by its group's completion policy: no reward, left out of the group's rewards.
    group_cancelled: bool = False
    #: The hard lifetime from ``created_at`` (queue + run + verify), seconds; 0: none.
    lifetime_s: float = 0.0
    #: The project of the key that made it ("default" with keys off, and for records stored
    #: before projects existed): a key of another project never sees it (docs/projects.md).
    project: str = DEFAULT_PROJECT


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
    infrastructure: bool = False  # ended by an infrastructure error: no reward
    owner: str = ""  # the id of the API key that made it ("anonymous" with keys off)
    group_cancelled: bool = False  # cancelled by its group's completion policy: no reward
    project: str = DEFAULT_PROJECT  # the project it belongs to (docs/projects.md)


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
    #: On a final state: every transition of the rollout, from its record (the
    #: authoritative order). Empty on other states and from older producers.
    history: list[StateTransition] = []
    #: On a final state: Arena could not run or verify the rollout (no reward, not a 0).
    infrastructure: bool = False
    #: On a final state: cancelled by its group's completion policy (no reward, not a 0).
    group_cancelled: bool = False
    #: The rollout's project (the trajectory keeps it: docs/projects.md).
    project: str = DEFAULT_PROJECT


class GroupSubmitted(Base, kw_only=True):
    """Response of ``POST /v1/rollout-groups``."""

    group_id: str
    rollout_ids: list[str]


class DuelSubmitted(Base, kw_only=True):
    """Response of ``POST /v1/duels``: side ``a`` is ``policies[0]``, side ``b`` ``policies[1]``;
    ``groups[k]`` and ``rollout_ids[k]`` (by seed) are side ``k``'s."""

    duel_id: str
    task_id: str
    policies: list[str]
    groups: list[str]
    rollout_ids: list[list[str]]


# --------------------------------------------------------------------------- sandbox plane


class SandboxJob(Base, kw_only=True):
    """``arena.sandbox.run.{provider}``: run the agent for one rollout.

    ``proxy_url`` is the rollout's OpenAI base URL as the sandbox host reaches it;
    the sandbox forwards it inside and gives the agent an in-sandbox URL.
    """

    rollout_id: str
    task: Task  # the public part: never the verifier
    proxy_url: str
    api_key: str
    attempt: int = 1
    #: Key of the task's private part in ``arena_verifiers``, handed on to the verify job.
    verifier_ref: str = ""


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


class EnvStep(Base, kw_only=True):
    """One exchange of an OpenEnv episode, as the sandbox relayed it (docs/openenv.md).

    ``index`` 0 is the ``reset``; then one per ``step``. ``observation`` is what the
    environment answered (strings over the recording cap are cut and ``truncated`` is set);
    ``error`` is an error frame's ``code: message`` (the action was refused; the episode goes on).
    """

    index: int
    kind: Literal["reset", "step"]
    action: dict[str, Any] = {}
    observation: dict[str, Any] = {}
    reward: float | None = None
    done: bool = False
    error: str = ""
    truncated: bool = False
    started_at: float = 0.0
    duration_ms: float = 0.0


class StepTurn(Base, kw_only=True):
    """One step's agent turn of a multi-step task, as the sandbox plane ran it."""

    name: str
    #: The workspace's diff against the base commit when the turn ended (what this step's tests grade).
    diff: str = ""
    #: The agent wrote ``/sandbox/.arena/done`` in this turn (else it exited, timed out or could
    #: not start: the turns end here, this step is still graded on the state it left).
    completed: bool = False
    reason: str = ""


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
    oom_killed: bool = False  # the kernel's OOM killer fired in the sandbox during the run
    #: What the agent did to the sandbox that verification must know (``git_tampered``: it
    #: changed the repository's git metadata: replace refs, grafts, alternates, hooks, config).
    flags: list[str] = []
    #: What the agent's scaffold left beside its log (e.g. ``mini-swe-agent.traj.json``, its own
    #: trajectory): name -> key in the ``arena_artifacts`` object store (docs/agents.md).
    artifacts: dict[str, str] = {}
    #: An OpenEnv episode (``agent.external``): every reset and step, in order.
    env_steps: list[EnvStep] = []
    #: Why an LLM call of the agent was cut on Arena's side ("" if none was): the sandbox's relay
    #: saw the proxy refuse the connection or break it before the answer ended. The outcome is
    #: then ``error``: an infrastructure outcome, no reward (docs/reliability.md).
    proxy_fault: str = ""
    #: A multi-step task (``task.steps``): each turn the agent had, in order; a step after the
    #: last one listed had none (docs/tasks.md, "Multi-step tasks").
    step_turns: list[StepTurn] = []


# --------------------------------------------------------------------------- verification plane


class VerifyJob(Base, kw_only=True):
    """``arena.verify.run``: verify the agent's diff against the pristine task."""

    rollout_id: str
    task: Task  # public; a replay carries its verifier here
    diff: str
    result: dict[str, Any] | None = None  # the agent's result.json (its ``answer`` is graded)
    name: str = ""  # name the result is stored under (replays); "" = the verifier's type
    #: Key of the task's private part in the ``arena_verifiers`` bucket (when ``task.verifier`` is None).
    verifier_ref: str = ""
    #: What the sandbox plane saw the agent do that the verdict must know (``git_tampered``).
    flags: list[str] = []
    #: A multi-step task's turns (``SandboxDone.step_turns``): each step is graded on the diff its
    #: own turn left. Empty: every step is graded on ``diff`` (a replay, a single-turn run).
    step_turns: list[StepTurn] = []


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
    ``tests_tampered``, ``tests_missing``, ``timeout``, ``parse_failed``,
    ``parse_suspect``, ``test_config_touched``, ``runner_tampered``,
    ``reward_file_written``, ``no_answer``, ``judge_unparseable`` (docs/verification.md).
    ``verifier`` is the verifier's type, ``composite``, or a replay's name.
    """

    rollout_id: str
    verifier: str
    #: ``None``: Arena could not verify (``error`` says why): no reward, never a 0.
    reward: float | None
    passed: bool
    started_at: float
    finished_at: float
    components: dict[str, float] = {}
    tests: list[TestResult] = []
    counts: TestCounts = TestCounts()
    flags: list[str] = []
    reason: str = ""
    log_tail: str = ""
    judge_calls: list[JudgeCall] = []  # LLM-judge calls, kept apart from the policy's steps
    parser: str = ""  # the test-output parser used, if any
    error: str = ""  # Arena could not verify (infrastructure): why; ``reward`` is then None


class JudgeCall(Base, kw_only=True):
    """One call to a judge model made by the ``llm_judge`` verifier."""

    model: str
    base_url: str
    request_messages: list[dict[str, Any]] = []
    completion_text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    latency_ms: float = 0.0
    started_at: float = 0.0
    error: str = ""


# --------------------------------------------------------------------------- OpenEnv episodes


class EnvError(Base, kw_only=True):
    """An OpenEnv error frame's data: ``code`` is one of OpenEnv's (``VALIDATION_ERROR``,
    ``EXECUTION_ERROR``, ...); ``errors`` the validation problems, pydantic-shaped."""

    code: str
    message: str
    errors: list[dict[str, Any]] | None = None


class EnvRequest(Base, kw_only=True):
    """``arena.env.{rollout_id}`` (core NATS request/reply): the environment endpoint asks the
    sandbox worker that holds the rollout's sandbox for one exchange. ``seq`` numbers them
    from 0 (the reset); a repeated ``seq`` gets the stored reply again, never a second run.
    ``close``: the client ended the episode (OpenEnv's ``close`` frame): what it did is verified."""

    rollout_id: str
    seq: int
    kind: Literal["reset", "step", "state", "close"]
    data: dict[str, Any] = {}
    timeout_s: float = 60.0


class EnvReply(Base, kw_only=True):
    """The answer to an :class:`EnvRequest`: an observation (with ``reward`` and ``done``),
    the state (``kind`` state), or an ``error`` (OpenEnv's error frame)."""

    seq: int
    observation: dict[str, Any] = {}
    reward: float | None = None
    done: bool = False
    state: dict[str, Any] | None = None
    error: EnvError | None = None
    #: A hosted environment's reset: its server's action JSON Schema (its ``GET /schema``), with
    #: which the environment endpoint checks each action as the server would, in any state.
    action_schema: dict[str, Any] | None = None


class EnvironmentRequest(Request, kw_only=True):
    """``PUT /v1/environments/{name}``: serve ``task`` as an OpenEnv environment at
    ``/openenv/{name}`` (docs/openenv.md). Each WebSocket episode is one rollout of it, with
    this model, sampling, provider and labels; ``max_concurrent`` episodes at once per
    rollout-service replica (more get OpenEnv's ``CAPACITY_REACHED``)."""

    task: Task
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] = "default"
    sampling: SamplingParams = SamplingParams()
    provider: Literal["local", "docker", "mock"] = "local"
    max_concurrent: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    metadata: Labels = {}


class EnvironmentRecord(Base, kw_only=True):
    """An environment in the ``arena_environments`` bucket: the request with its public task,
    and where its private part (the verifier) is kept."""

    name: str
    request: EnvironmentRequest
    verifier_ref: str = ""
    verify_budget_s: float = 0.0
    created_at: float = 0.0
    #: The id of the API key that registered it ("anonymous" with keys off): only it or an
    #: admin key may replace or delete it (``arena_core.owners``).
    owner: str = "anonymous"
    #: The project it serves: its name is that project's (another project's key never sees it).
    project: str = DEFAULT_PROJECT


class WorkerInfo(Base, kw_only=True):
    """``arena_workers`` entry (key ``{provider}.{worker}``): a sandbox worker serving ``provider``
    with ``slots`` sandboxes at once, refreshed at ``at`` (``arena_core.workers``)."""

    provider: str
    worker: str
    slots: int
    at: float
    #: The scaffold presets its sandboxes can launch (installed for the local provider, or
    #: shipping no install); ``None``: not known here (an image ships its own; an older worker).
    scaffolds: list[str] | None = None


class EnvironmentView(Base, kw_only=True):
    """An environment as the API shows it (no private part)."""

    name: str
    task_id: str
    url: str  # the OpenEnv base URL: clients connect to ``{url}/ws``
    provider: str
    max_concurrent: int
    hosted: bool = False  # an unmodified OpenEnv environment relayed (``task.environment``)
    created_at: float = 0.0
    owner: str = ""  # the id of the API key that registered it ("anonymous" with keys off)
    project: str = DEFAULT_PROJECT  # the project it belongs to (docs/projects.md)


# --------------------------------------------------------------------------- captured steps


class TopLogprob(Base, kw_only=True):
    token: str
    logprob: float
    token_id: int | None = None


class PolicySpan(Base, kw_only=True):
    """Completion tokens from ``start`` on (to the next span) were sampled by ``version``."""

    version: str
    start: int


class Usage(Base, kw_only=True):
    """Tokens of one LLM call as the backend reported them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    #: of ``prompt_tokens``, those served from the backend's prefix cache (OpenAI's
    #: ``usage.prompt_tokens_details.cached_tokens``); 0 when the backend does not say
    cached_tokens: int = 0


class Timings(Base, kw_only=True):
    """Milliseconds: waiting for a backend slot, to the first token, in total."""

    queued_ms: float = 0.0
    first_token_ms: float = 0.0
    total_ms: float = 0.0


class ToolCall(Base, kw_only=True):
    """A tool call the model made (OpenAI ``tool_calls`` / Anthropic ``tool_use``)."""

    id: str
    name: str
    arguments: str = ""  # JSON text, exactly as the model produced it


class Failover(Base, kw_only=True):
    """A replica the proxy tried for a call and left, with why."""

    replica: str
    error: str
    at: float


class PromptCount(Base, kw_only=True):
    """How the token budget counted a call's prompt before sending it (rollouts with
    ``budget.max_total_tokens`` only; docs/rollout.md, Budgets).

    ``source``: ``ids`` (a completions prompt of token ids, counted exactly), ``tokenize``
    (counted exactly by the serving replica's ``/tokenize``), ``bound`` (not counted: an
    upper bound of the prompt plus ``max_tokens`` fitted what remained, so nothing was
    capped and no round trip was made), ``fallback`` (the serving replica could not count:
    ``max_tokens`` was capped, or the call refused, on the upper bound; ``note`` says why).
    """

    tokens: int  # the prompt's tokens as counted (an upper bound for ``bound`` / ``fallback``)
    source: Literal["ids", "tokenize", "bound", "fallback"]
    remaining: int = 0  # tokens left in the rollout's budget when the call was admitted
    replica: str | None = None  # the replica that counted (or could not count) the prompt
    note: str = ""


class BackendReplica(Base, kw_only=True):
    """An inference replica in the ``arena_backends`` KV bucket (key = ``replica_id``).

    ``models`` empty means it serves any model name. Changing ``policy_version``
    (after a weight sync) takes effect on the next call routed to it.
    """

    replica_id: str
    url: str  # OpenAI-compatible base URL, ending in /v1
    models: list[str] = []
    policy_version: str = ""
    max_inflight: int = 64
    registered_at: float = 0.0


class Step(Base, kw_only=True):
    """``arena.step.{rollout_id}``: one LLM call as the proxy saw it.

    ``token_ids_source`` is ``backend`` when the ids came from the backend and
    ``unavailable`` when it could not return them; ids are then ``None`` and never
    guessed by re-tokenizing text.
    """

    rollout_id: str
    step_index: int
    #: The client API the agent called (every one is sent to the backend as OpenAI chat or
    #: completions): ``openai.chat``, ``openai.completions``, ``openai.responses``,
    #: ``anthropic.messages`` or ``gemini.generate_content`` (docs/rollout.md).
    api: Literal["openai.chat", "openai.completions", "openai.responses", "anthropic.messages",
                 "gemini.generate_content"] = "openai.chat"
    model: str
    backend: str
    policy_version: str | None = None
    #: A partial rollout: the generation was interrupted by a weight update and continued under
    #: the new policy; each version and the completion token it took over at (empty: one
    #: version, ``policy_version``, sampled every token).
    policy_spans: list[PolicySpan] = []
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
    #: ``/v1/completions``: the prompt as sent (text or token ids); chat calls use ``request_messages``.
    request_prompt: str | list[int] | None = None
    #: Tool definitions the request offered (OpenAI ``tools`` as sent to the backend).
    tools: list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] = []
    stream: bool = False
    #: The call did not finish (client disconnected, replica died mid-stream): the
    #: ids/logprobs hold what had arrived; ``error`` says why.
    incomplete: bool = False
    error: str | None = None
    #: The answer never reached the agent (its client gave up or went away before the
    #: whole answer was written): its tokens count as spent, but it is left out of
    #: training sequences and turn budgets.
    abandoned: bool = False
    #: The replica id that served the call; ``backend`` is its URL.
    backend_replica: str | None = None
    failovers: list[Failover] = []
    #: How the token budget counted this call's prompt before sending it; None without a
    #: ``max_total_tokens`` budget.
    prompt_count: PromptCount | None = None


# --------------------------------------------------------------------------- trajectories


class TrainingSequence(Base, kw_only=True):
    """Consecutive LLM calls of one rollout as one token sequence, token-in-token-out (made by
    ``arena_core.sequences.assemble``; docs/trajectory.md, "Training sequences"). The three
    token lists have the same length."""

    token_ids: list[int]  # the backend's ids, never re-tokenized
    loss_mask: list[int]  # 1: sampled by the policy; 0: context (prompt, tool output, template)
    logprobs: list[float]  # the sampling logprob where ``loss_mask`` is 1, 0.0 elsewhere
    step_indexes: list[int]  # the steps whose completions it holds, in order
    policy_versions: list[str]  # the policy version of each of those steps ("" unknown)


class SequenceBreak(Base, kw_only=True):
    """A step where the rollout's steps did not chain into one training sequence, or that
    was left out of every sequence. ``kind``: ``prefix_mismatch`` (the prompt does not
    extend the sequence so far: a new one starts with this step), ``no_token_ids`` /
    ``no_logprobs`` (left out; the sequence so far ends), ``abandoned`` / ``incomplete``
    (left out; the chain goes on)."""

    step_index: int
    kind: Literal["prefix_mismatch", "no_token_ids", "no_logprobs", "abandoned", "incomplete"]
    #: ``prefix_mismatch``: the first token position where the prompt and the sequence differ.
    position: int | None = None
    reason: str = ""  # for people, e.g. "prefix mismatch at token 812"


class Trajectory(Base, kw_only=True):
    """``arena.trajectory.{task_id}.{rollout_id}``: one finished rollout, training-grade.

    Field by field in docs/schemas.md; the policy version of each step is on the step.
    """

    schema_version: int = SCHEMA_VERSION  # bumped only for changes a trainer must know about
    rollout_id: str
    task_id: str
    group_id: str | None = None  # None: a single rollout, not part of a group
    group_index: int = 0  # 0..group_size-1 inside the group
    group_size: int = 1
    final_state: RolloutState  # always a final state
    reason: str = ""  # why the rollout ended (the final transition's reason)
    #: verification.reward whatever the final state; ``None`` when it has none: never
    #: verified (an agent that failed or timed out first), or an infrastructure outcome
    #: (Arena could not run or verify it; ``infrastructure``). docs/trajectory.md.
    reward: float | None = 0.0
    steps: list[Step] = []  # every captured LLM call, by step_index, one per index
    sandbox: SandboxDone | None = None  # the agent run's outcome, diff and log tail
    verification: VerificationResult | None = None  # reward components, tests, flags
    policy_versions: list[str] = []  # distinct step policy versions, in order of first use
    completed_at: float = 0.0  # unix seconds of the final transition
    metadata: dict[str, str] = {}  # the rollout's metadata (submitter's labels)
    #: The rollout's state transitions as the trajectory plane stored them, oldest first.
    history: list[StateTransition] = []
    #: Parts the trajectory plane gave up waiting for (e.g. ``"steps 2/3"``,
    #: ``"verification"``); empty when the trajectory is whole. Filter these out to train.
    incomplete: list[str] = []
    #: Arena could not run or verify this rollout: ``reward`` is None; leave it out of training.
    infrastructure: bool = False
    #: Cancelled by its group's completion policy (first k of n, deadline): ``reward`` is None,
    #: and the group message leaves it out (``GroupCompleted.cancelled_indexes``).
    group_cancelled: bool = False
    #: The steps merged into token-in-token-out training sequences (docs/trajectory.md).
    sequences: list[TrainingSequence] = []
    #: Where the steps did not chain into one sequence, and the steps left out of every one.
    sequence_breaks: list[SequenceBreak] = []
    #: The project of the rollout (of the key that submitted it; docs/projects.md).
    project: str = DEFAULT_PROJECT


class MemberRef(Base, kw_only=True):
    """Where a group member's ``Trajectory`` is: the last message on ``subject``
    (``arena.trajectory.{task_id}.{rollout_id}``) of ``ARENA_TRAJECTORIES``."""

    rollout_id: str
    group_index: int
    subject: str


class GroupCompleted(Base, kw_only=True):
    """``arena.group.{group_id}``: every member of a group reached a final state, or the
    group timed out (``partial``) with the members in ``trajectories``.

    On the stream a group refers to its members instead of copying them (each trajectory's
    bytes are stored once): ``members`` lists them, in ``group_index`` order, and
    ``trajectories`` is empty. ``arena.stream.TrajectoryStream`` reads each member and hands
    the group out whole (``trajectories`` filled, ``members`` empty)."""

    group_id: str
    task_id: str
    size: int
    trajectories: list[Trajectory]
    rewards: list[float | None]  # by member, in ``trajectories`` order; None: infrastructure outcome
    #: Group-normalised over the members with a reward; 0.0 for those in ``excluded_indexes``.
    advantages: list[float]
    completed_at: float
    #: True when the group was published after its timeout without every member;
    #: ``missing_indexes`` names the absent ``group_index`` values.
    partial: bool = False
    missing_indexes: list[int] = []
    #: ``group_index`` of members without a reward (infrastructure outcomes): out of the advantages.
    excluded_indexes: list[int] = []
    #: ``group_index`` of members cancelled by the group's completion policy (first k of n, a
    #: deadline): not among the members, no reward, never in the advantages. Not ``partial``.
    cancelled_indexes: list[int] = []
    #: On the stream: the members by reference (``trajectories`` then empty); see above.
    members: list[MemberRef] = []
    #: The members' project: ``TrajectoryStream(project=...)`` hands out only that project's groups.
    project: str = DEFAULT_PROJECT


class DuelRoundDone(Base, kw_only=True):
    """``arena.duel.done.{duel_id}`` (core NATS, not a stream): the trajectory plane stored the
    last side of a duel's round; ``complete`` when it was the duel's last round. A notice to
    refresh (the dashboard's leaderboard), not a record: read the duel from the query API."""

    duel_id: str
    seed: int
    winner: Literal["a", "b", "draw", "void"]
    complete: bool = False
    at: float = 0.0
    project: str = DEFAULT_PROJECT  # the duel's project: a dashboard of another never hears of it


class TrainerMetrics(Base, kw_only=True):
    """``POST /v1/trainer-metrics`` on the trajectory service: one trainer step's metrics,
    for the dashboard (mean reward, loss, KL, clip fraction, tokens/s, staleness, ...).

    ``(run, step)`` is the key: posting a step again replaces it.
    """

    run: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    step: Annotated[int, msgspec.Meta(ge=0, le=2**53)]
    at: Annotated[float, msgspec.Meta(ge=0, le=1e11)]
    policy_version: Annotated[str, msgspec.Meta(max_length=256)] = ""
    metrics: Annotated[dict[Annotated[str, msgspec.Meta(max_length=256)], float], msgspec.Meta(max_length=1024)] = {}


class DeadLetter(Base, kw_only=True):
    """``arena.dead.{stream}``: a message that could not be processed, with why."""

    stream: str
    subject: str
    consumer: str
    error: str
    num_delivered: int
    data: bytes
    at: float
    #: The body was too big for a message: it is this object in ``arena_artifacts`` (``data`` is empty).
    body_object: str | None = None


class Packed(Base, kw_only=True):
    """One message inside a :class:`Pack`: what it would have been published as alone."""

    subject: str
    msg_id: str  # its ``Nats-Msg-Id``
    data: bytes
    headers: dict[str, str] = {}  # its other headers (trace context)


class Pack(Base, kw_only=True):
    """``arena.steps``: publishes to ``ARENA_STEPS`` made in the same moment, stored as one
    message: one write, one fsync, one delivery and one ack for all of them
    (``arena_core.packing``). Encoded as msgpack, so that any body travels as it is; each
    body is what the message would have carried alone (a ``Step``'s JSON)."""

    messages: list[Packed]


class ErrorBody(Base, kw_only=True):
    code: str
    message: str


class ErrorResponse(Base, kw_only=True):
    """Every HTTP error Arena returns: ``{"error": {"code": ..., "message": ...}}``."""

    error: ErrorBody


# --------------------------------------------------------------------------- codecs

ENCODER = msgspec.json.Encoder()


def valid_id(value: str) -> bool:
    """Whether ``value`` follows the identifier grammar (:data:`ID_PATTERN`)."""
    return len(value) <= ID_MAX and ID_RE.fullmatch(value) is not None


def encode(obj: Any) -> bytes:
    return ENCODER.encode(obj)


#: Every wire message, by name: proto/ is generated from this table.
MESSAGES: dict[str, type] = {
    "SubmitRolloutRequest": SubmitRolloutRequest,
    "SubmitGroupRequest": SubmitGroupRequest,
    "GroupSubmitted": GroupSubmitted,
    "SubmitDuelRequest": SubmitDuelRequest,
    "DuelSubmitted": DuelSubmitted,
    "DuelRoundDone": DuelRoundDone,
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
    "BackendReplica": BackendReplica,
    "Trajectory": Trajectory,
    "GroupCompleted": GroupCompleted,
    "DeadLetter": DeadLetter,
    "Pack": Pack,
    "TrainerMetrics": TrainerMetrics,
    "ErrorResponse": ErrorResponse,
    "EnvRequest": EnvRequest,
    "EnvReply": EnvReply,
    "EnvironmentRequest": EnvironmentRequest,
    "EnvironmentView": EnvironmentView,
    "WorkerInfo": WorkerInfo,
}
