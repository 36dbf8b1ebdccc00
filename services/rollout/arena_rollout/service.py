"""The rollout service: submission, state transitions, result handling, and the proxy call.

Keyword-only functions of one class that takes its resources (bus, store, HTTP
client, settings); the FastAPI routes in ``app.py`` and the consumers in
``worker.py`` are thin shells around it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
import msgspec

from arena_core import metrics, owners, private, quotas, sources, subjects, telemetry
from arena_core.apikeys import ApiKey
from arena_core.bus import Bus, Delivery
from arena_core.errors import Conflict, Forbidden, InvalidRequest, NotFound, Retryable, Unauthorized
from arena_core.schemas import (
    LABEL_DUEL,
    LABEL_DUEL_POLICY,
    LABEL_DUEL_SEED,
    LABEL_DUEL_SIDE,
    BackendReplica,
    BundleSource,
    DeadLetter,
    EnvRewardVerifier,
    GitSource,
    DuelSubmitted,
    PathSource,
    GroupCompletion,
    GroupSubmitted,
    RolloutRecord,
    RolloutState,
    RolloutStateChanged,
    RolloutSubmitted,
    RolloutView,
    SandboxDone,
    SandboxJob,
    SandboxOutcome,
    SandboxStarted,
    StateTransition,
    SubmitDuelRequest,
    SubmitGroupRequest,
    SubmitRolloutRequest,
    TestsVerifier,
    VerificationResult,
)
from arena_core.settings import Settings

from arena_rollout import groups, scheduler, state
from arena_rollout.admission import Admission, Reservation
from arena_rollout.proxy.backends import default_replica
from arena_rollout.reaper import verifier_budget_s
from arena_rollout.proxy.handler import ProxyHandler
from arena_rollout.proxy.routing import Router
from arena_rollout.proxy.upstream import UpstreamClient
from arena_rollout.store import RolloutStore

log = logging.getLogger("arena.rollout")

S = RolloutState
#: The states of a rollout waiting for its sandbox: the queue.
QUEUED = frozenset({S.PENDING, S.PROVISIONING})
MAX_GROUP = 1024

_state_decoder = msgspec.json.Decoder(RolloutStateChanged)


class _JobRef(msgspec.Struct):
    rollout_id: str


_job_decoder = msgspec.json.Decoder(_JobRef)


class SandboxEnded(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of a ``SandboxDone`` the rollout plane acts on. Decoding a message into it
    skips the rest (the agent's diff, up to ``ARENA_MAX_DIFF_BYTES``, its log tail) without
    making a string of them."""

    rollout_id: str
    sandbox_id: str
    outcome: SandboxOutcome
    reason: str


_SANDBOX_TO_STATE = {
    SandboxOutcome.FAILED: S.FAILED,
    SandboxOutcome.TIMED_OUT: S.TIMED_OUT,
    SandboxOutcome.CANCELLED: S.CANCELLED,
    SandboxOutcome.ERROR: S.FAILED,
}


def view(record: RolloutRecord) -> RolloutView:
    return RolloutView(
        rollout_id=record.rollout_id,
        task_id=record.task.id,
        state=record.state,
        reason=record.reason,
        created_at=record.created_at,
        updated_at=record.updated_at,
        group_id=record.group_id,
        group_index=record.group_index,
        group_size=record.group_size,
        steps=record.steps,
        total_tokens=record.total_tokens,
        reward=record.reward,
        history=record.history,
        metadata=record.metadata,
        infrastructure=record.infrastructure,
        owner=record.owner,
        group_cancelled=record.group_cancelled,
        project=record.project,
    )


def validate_submission(req: SubmitRolloutRequest | SubmitGroupRequest, *, check_paths: bool,
                        allow_host_paths: bool = True, max_wall_clock_s: float = 86400.0,
                        external: bool = False, git: sources.GitPolicy | None = None,
                        max_lifetime_s: float = 0.0) -> None:
    """``external``: the submission comes from the environment endpoint, the one place an
    ``external`` agent (an OpenEnv client) can drive a rollout. ``git``: where a git source may
    come from (its scheme, host and any address written in it; workers also check the addresses
    the host resolves to). ``max_lifetime_s``: the server's default hard lifetime (0: none)."""
    task = req.task
    problems = []
    if task.verifier is None:
        problems.append("task.verifier is required (the task's private part)")
    if task.source is not None and task.repo:
        problems.append("task.source and task.repo are two spellings of one thing: set only task.source")
    source = task.source_of()
    if source is None and task.environment is None:
        problems.append("task.source is required (a bundle, a git URL + commit, or an image)")
    if task.agent.external and not external:
        problems.append("task.agent.external: an OpenEnv client drives such a task through the environment "
                        "endpoint (PUT /v1/environments/{name}, then /openenv/{name}/ws; docs/openenv.md), "
                        "not a rollout submission")
    env = task.environment
    host_path = isinstance(source, PathSource) or task.agent.path is not None or (env is not None and env.path)
    if host_path and not allow_host_paths:
        problems.append("host paths (task.repo, source.type=path, agent.path) are not accepted by this server "
                        "(ARENA_ALLOW_HOST_PATHS is off): upload the directory as a bundle "
                        "(`arena tasks push DIR`, POST /v1/bundles) and name it as source {type: bundle, digest}")
    if not allow_host_paths and getattr(source, "url", "").lower().startswith("file:"):
        problems.append("a file:// git URL is a host path (ARENA_ALLOW_HOST_PATHS is off)")
    elif isinstance(source, GitSource) and git is not None:
        try:
            sources.check_git_url(source.url, allow_file=allow_host_paths, policy=git, resolve=False)
        except sources.SourceError as exc:
            problems.append(str(exc))
    if not task.id.strip():
        problems.append("task.id must not be empty")
    if not task.agent.command and task.agent.scaffold is None and not task.agent.external:
        problems.append("task.agent needs a command or a scaffold")
    if env is not None and env.image is None and req.provider == "docker" and not env.command:
        problems.append("task.environment.image is required on the docker provider")
    if env is not None and env.image is not None and req.provider == "local" and not (env.bundle or env.path):
        problems.append("task.environment: the local provider cannot run an image; give the environment's "
                        "directory (bundle or path) or use the docker provider")
    if task.budget.wall_clock_s <= 0:
        problems.append("task.budget.wall_clock_s must be > 0")
    if task.budget.wall_clock_s > max_wall_clock_s:
        problems.append(f"task.budget.wall_clock_s must be <= {max_wall_clock_s:g} on this server "
                        "(ARENA_MAX_WALL_CLOCK_S)")
    lifetime = lifetime_s(task.budget, max_lifetime_s)
    if lifetime and task.budget.wall_clock_s > lifetime:
        origin = ("task.budget.max_lifetime_s" if task.budget.max_lifetime_s is not None
                  else "ARENA_ROLLOUT_MAX_LIFETIME_S on this server")
        problems.append(f"task.budget.wall_clock_s ({task.budget.wall_clock_s:g} s) is longer than the rollout's "
                        f"hard lifetime ({lifetime:g} s, from {origin}): set task.budget.max_lifetime_s to at "
                        "least the wall clock")
    for name in ("max_turns", "max_total_tokens"):
        value = getattr(task.budget, name)
        if value is not None and value < 1:
            problems.append(f"task.budget.{name} must be >= 1")
    if (isinstance(task.verifier, TestsVerifier) and not task.verifier.fail_to_pass and not task.verifier.pass_to_pass
            and not task.verifier.expected_statuses):
        problems.append("task.verifier needs at least one test in fail_to_pass, pass_to_pass or expected_statuses")
    if check_paths and allow_host_paths:
        if isinstance(source, PathSource) and not os.path.isdir(source.path):
            problems.append(f"task repository {source.path!r} is not a directory on the sandbox host")
        if task.agent.path is not None and not os.path.isdir(task.agent.path):
            problems.append(f"task.agent.path {task.agent.path!r} is not a directory on the sandbox host")
        if env is not None and env.path is not None and not os.path.isdir(env.path):
            problems.append(f"task.environment.path {env.path!r} is not a directory on the sandbox host")
    if isinstance(req, SubmitGroupRequest) and not 1 <= req.n <= MAX_GROUP:
        problems.append(f"n must be between 1 and {MAX_GROUP}, got {req.n}")
    if isinstance(req, SubmitGroupRequest):
        problems.extend(groups.completion_problems(req.completion, req.n))
    reserved = sorted(k for k in req.metadata if k == LABEL_DUEL or k.startswith(LABEL_DUEL + "."))
    if reserved:
        problems.append(f"metadata labels {', '.join(reserved)} are reserved for duels (POST /v1/duels sets them)")
    if problems:
        raise InvalidRequest("; ".join(problems))


def lifetime_s(budget, default_s: float) -> float:
    """A rollout's hard lifetime (queue + run + verify), seconds: its budget's, else the
    server's ``default_s``; 0: none."""
    return budget.max_lifetime_s if budget.max_lifetime_s is not None else float(default_s)


def duel_problems(req: SubmitDuelRequest, *, serves, replicas: Sequence[BackendReplica] = ()) -> list[str]:
    """What makes a duel unrunnable beyond its task (checked as a group's): ``serves(model)``
    says whether a backend replica serves a model name; ``replicas``, the registered ones, show
    whether the two names reach two models at all (``same_backend``)."""
    problems = []
    a, b = req.policies
    if a == b:
        problems.append(f"policies must be two distinct model names, got {a!r} twice")
    elif (same := same_backend(a, b, replicas)) is not None:
        problems.append(same)
    for name in dict.fromkeys(req.policies):
        if name == "default":
            problems.append("a policy must name a model: 'default' leaves the choice to the agent")
        elif not serves(name):
            problems.append(f"no backend replica serves model {name!r} (register one: `arena backend register`)")
    seed = req.sampling.seed or 0
    if not -(1 << 63) <= seed <= (1 << 63) - req.n:  # each seed keys a round in an Int64 column
        problems.append(f"sampling.seed must leave seed .. seed + n - 1 within Int64, got {seed}")
    if len(req.metadata) > 64 - 4:
        problems.append("a duel's metadata holds at most 60 labels (the duel adds 4)")
    return problems


def model_problem(req: SubmitRolloutRequest | SubmitGroupRequest, replicas: Sequence[BackendReplica]) -> str | None:
    """Why no registered replica would answer the model the agent's calls are routed by (the
    rollout's ``model``, else its scaffold's), or ``None``. Only replicas that list their models
    can refuse a name (one listing none serves any), so this is only ever a problem when every
    replica lists its models; a raw command's model (unknown before it runs) is not checked."""
    model = req.model
    if model == "default" and req.task.agent.scaffold is not None:
        model = req.task.agent.scaffold.model
    if model in ("", "default") or not replicas or any(not r.models or model in r.models for r in replicas):
        return None
    served = sorted({m for r in replicas for m in r.models})
    return (f"no backend replica serves model {model!r} (served: {', '.join(served)}); submit with one of "
            "them as `model`, or register a replica for it (`arena backend register --id ID --url URL "
            f"--model {model}`)")


def same_backend(a: str, b: str, replicas: Sequence[BackendReplica]) -> str | None:
    """Why policies ``a`` and ``b`` would be one model (``None``: they reach different ones).

    A replica that lists no models serves any name, so a name does not pick a model there: when
    neither name is listed by a replica and both would go to the same such replicas, both sides
    of the duel ask the same server, which answers with whatever model it runs, and the duel
    compares that model with itself."""
    if any(a in r.models or b in r.models for r in replicas):
        return None  # at least one name is a model a replica says it serves by name
    wildcards = sorted(r.replica_id for r in replicas if not r.models)
    if not wildcards:
        return None  # nothing serves either: the "no backend replica serves" problem says so
    return (f"policies {a!r} and {b!r} both resolve to backend replica(s) {', '.join(wildcards)}, which list no "
            "models (they serve any name with the one model they run): the duel would compare a model with "
            "itself. Register each policy on the replica that serves it by name, e.g. "
            f"`arena backend register --id {a} --url URL_A --model {a}` and the same for {b!r}")


def _bundles_of(task) -> list[str]:
    """Every bundle a task names (its source, its agent, its hidden test files)."""
    found = []
    if isinstance(task.source, BundleSource):
        found.append(task.source.digest)
    if task.agent.bundle:
        found.append(task.agent.bundle)
    if task.environment is not None and task.environment.bundle:
        found.append(task.environment.bundle)
    for spec in _leaf_verifiers(task.verifier):
        if isinstance(spec, TestsVerifier) and spec.hidden_files:
            found.append(spec.hidden_files)
    return found


def _leaf_verifiers(verifier) -> list:
    if verifier is None:
        return []
    parts = getattr(verifier, "verifiers", None)
    if parts is not None:
        return [part.verifier for part in parts]
    return [verifier]


class RolloutService:
    def __init__(self, *, bus: Bus, store: RolloutStore, settings: Settings, http: httpx.AsyncClient,
                 router: Router | None = None, upstream: UpstreamClient | None = None, workers=None):
        """``workers`` (``arena_core.workers.Workers``): when given, a submission to a provider no
        sandbox worker serves is refused at once."""
        self.bus = bus
        self.workers = workers
        self.store = store
        self.settings = settings
        self.http = http
        self.router = router if router is not None else Router([default_replica(settings)])
        #: the proxy's client for its backends (aiohttp); ``http`` serves everything else
        self.upstream = upstream if upstream is not None else UpstreamClient()
        self.proxy = ProxyHandler(bus=bus, store=store, lifecycle=self, router=self.router, http=self.upstream)
        self.admission = Admission(queue_timeout_s=settings.queue_timeout_s, max_queued=settings.max_queued)
        #: projects' quotas and priorities (arena_core.quotas), read from the keys bucket
        self.quotas = quotas.Quotas(bus)
        #: sandbox-seconds each project used in slots given back (the fair share's memory)
        self.usage = scheduler.Usage()
        self._dispatching = False
        self._dispatch_again = False
        self._dispatch_task: asyncio.Task | None = None
        self._recovered = False

    # ------------------------------------------------------------------ submission

    def queued(self) -> int:
        """Rollouts waiting for their sandbox (``pending``, ``provisioning``), as the cache sees them."""
        return sum(1 for r in self.store.cache.live() if r.state in QUEUED)

    def admit(self, adding: int, wall_clock_s: float, quota: quotas.ProjectQuota | None = None) -> Reservation:
        """Admit ``adding`` rollouts of a task with this wall clock, or raise ``Overloaded``
        (429): one step with the queue count (admission.py). Release a place as each rollout
        is created (``Reservation.release``); ``with`` gives back what is left. ``quota``: the
        submitting project's (its own queue limit, docs/projects.md).

        With the sandbox slots known, the queue is the rollouts still ``pending`` (the
        scheduler moves one to ``provisioning`` only when a slot is free for it) and the busy
        slots those ``provisioning`` or ``running``."""
        live = self.store.cache.live()
        slots = self.workers.slots() if self.workers is not None else None
        if slots:
            queued = sum(1 for r in live if r.state == S.PENDING)
            running = sum(1 for r in live if r.state in scheduler.HOLDING)
        else:
            queued = sum(1 for r in live if r.state in QUEUED)
            running = sum(1 for r in live if r.state == S.RUNNING)
        if quota is None:
            return self.admission.reserve(queued=queued, adding=adding, slots=slots, running=running,
                                          hold_s=wall_clock_s)
        mine = sum(1 for r in live if r.project == quota.project and r.state == S.PENDING)
        return self.admission.reserve(queued=queued, adding=adding, slots=slots, running=running,
                                      hold_s=wall_clock_s, project=quota.project, project_queued=mine,
                                      project_max_queued=quota.max_queued,
                                      project_slots=quota.max_sandboxes or slots)

    async def submit(self, req: SubmitRolloutRequest, *, caller: ApiKey | None = None) -> RolloutRecord:
        """``caller``: the key that submits (``None`` with keys off); the rollout records it as owner."""
        quota = await self.quotas.of(owners.project_of(caller))
        with self.admit(1, req.task.budget.wall_clock_s, quota):
            req, private = await self._accept(req, project=owners.project_of(caller))
            return await self._create(req, private, group_id=None, index=0, size=1, sampling=req.sampling,
                                      owner=owners.owner_of(caller), project=owners.project_of(caller))

    async def submit_group(self, req: SubmitGroupRequest, *, caller: ApiKey | None = None) -> GroupSubmitted:
        quota = await self.quotas.of(owners.project_of(caller))
        with self.admit(req.n, req.task.budget.wall_clock_s, quota) as held:
            req, private = await self._accept(req, project=owners.project_of(caller))
            return await self._submit_members(req, private, owner=owners.owner_of(caller),
                                              project=owners.project_of(caller), held=held)

    async def submit_duel(self, req: SubmitDuelRequest, *, caller: ApiKey | None = None) -> DuelSubmitted:
        """Two groups of one task, one per policy, on the same seeds; every member labelled
        with the duel, its side, its policy and its seed."""
        problems = duel_problems(req, serves=lambda model: any(
            s.serves(model) for s in self.router.replicas.values()),
            replicas=[s.replica for s in self.router.replicas.values()])
        if problems:
            raise InvalidRequest("; ".join(problems))
        quota = await self.quotas.of(owners.project_of(caller))
        with self.admit(2 * req.n, req.task.budget.wall_clock_s, quota) as held:
            return await self._submit_duel(req, owner=owners.owner_of(caller), project=owners.project_of(caller),
                                           held=held)

    async def _submit_duel(self, req: SubmitDuelRequest, *, owner: str, project: str,
                           held: Reservation) -> DuelSubmitted:
        seed = req.sampling.seed if req.sampling.seed is not None else 0
        group = SubmitGroupRequest(task=req.task, n=req.n, sampling=msgspec.structs.replace(req.sampling, seed=seed),
                                   model=req.policies[0], provider=req.provider, metadata=req.metadata)
        group, private = await self._accept(group, project=project)  # once: both sides run the same task
        duel_id = "d-" + uuid.uuid4().hex[:16]
        sides: list[GroupSubmitted] = []
        try:
            for side, policy in zip("ab", req.policies):
                labels = [{LABEL_DUEL: duel_id, LABEL_DUEL_SIDE: side, LABEL_DUEL_POLICY: policy,
                           LABEL_DUEL_SEED: str(seed + i)} for i in range(req.n)]
                sides.append(await self._submit_members(msgspec.structs.replace(group, model=policy), private,
                                                        labels=labels, owner=owner, project=project, held=held))
        except BaseException:
            # a duel runs whole or not at all: side a's rollouts would otherwise run for a duel
            # nobody can see complete
            for rid in (r for g in sides for r in g.rollout_ids):
                try:
                    await self.cancel(rid, reason=f"duel {duel_id} could not be submitted whole")
                except Exception:  # noqa: BLE001 - already final, or the store is the failure
                    log.warning("duel %s: could not cancel %s", duel_id, rid, exc_info=True)
            raise
        log.info("duel %s: %s vs %s on %d seeds", duel_id, *req.policies, req.n)
        return DuelSubmitted(duel_id=duel_id, task_id=req.task.id, policies=list(req.policies),
                             groups=[g.group_id for g in sides], rollout_ids=[g.rollout_ids for g in sides])

    async def _submit_members(self, req: SubmitGroupRequest, private: tuple[str, float], *, owner: str,
                              held: Reservation, project: str = owners.DEFAULT_PROJECT,
                              labels: list[dict[str, str]] | None = None) -> GroupSubmitted:
        """The members of an accepted group; ``labels[i]``: member ``i``'s labels over the group's.
        Each member gives back its place in ``held`` once created (it is then in the queue count)."""
        group_id = "g-" + uuid.uuid4().hex[:16]
        submitted_at = time.time()  # a completion deadline counts from here
        single = SubmitRolloutRequest(task=req.task, sampling=req.sampling, model=req.model,
                                      provider=req.provider, metadata=req.metadata)

        async def member(i: int) -> RolloutRecord:
            try:
                return await self._create(
                    single if labels is None else msgspec.structs.replace(single, metadata={**req.metadata,
                                                                                            **labels[i]}),
                    private,
                    group_id=group_id,
                    index=i,
                    size=req.n,
                    sampling=(
                        msgspec.structs.replace(req.sampling, seed=req.sampling.seed + i)
                        if req.sampling.seed is not None
                        else req.sampling
                    ),
                    owner=owner,
                    project=project,
                    completion=req.completion,
                    group_submitted_at=submitted_at,
                )
            finally:
                held.release(1)

        records = await asyncio.gather(*(member(i) for i in range(req.n)))
        return GroupSubmitted(group_id=group_id, rollout_ids=[r.rollout_id for r in records])

    async def _accept(self, req, *, external: bool = False, project: str = owners.DEFAULT_PROJECT):
        """Validate a submission, check its bundles exist (in ``project``: another project's bundle
        is not there for it), and store its private part apart: the request with the public task,
        and the private part's (key, time budget)."""
        if req.task.environment is not None and req.task.verifier is None:  # the environment's own rewards
            req = msgspec.structs.replace(req, task=msgspec.structs.replace(req.task, verifier=EnvRewardVerifier()))
        validate_submission(req, check_paths=self.settings.sandbox_provider == "local",
                            allow_host_paths=self.settings.allow_host_paths,
                            max_wall_clock_s=self.settings.max_wall_clock_s, external=external,
                            git=sources.git_policy(self.settings),
                            max_lifetime_s=self.settings.rollout_max_lifetime_s)
        if self.workers is not None:
            await self.workers.check(req.provider)
            if req.task.agent.scaffold is not None:
                self.workers.check_scaffold(req.provider, req.task.agent.scaffold.name)
        problem = model_problem(req, [s.replica for s in self.router.replicas.values()])
        if problem is not None:
            raise InvalidRequest(problem)
        task = req.task
        for digest in _bundles_of(task):
            if not await sources.bundle_exists(self.bus, digest, project=project):
                raise InvalidRequest(f"bundle {digest} is not in Arena's object store: upload it first "
                                     "(POST /v1/bundles, `arena tasks push`)")
        ref = await self.store_verifier(task.verifier)
        return msgspec.structs.replace(req, task=task.public()), (ref, verifier_budget_s(task.verifier))

    async def store_verifier(self, verifier) -> str:
        """Put a task's private part in ``arena_verifiers`` under its digest; returns the key."""
        return await private.put_verifier(self.bus, verifier)

    async def _create(self, req: SubmitRolloutRequest, private: tuple[str, float], *, group_id: str | None,
                      index: int, size: int, sampling, owner: str = owners.ANONYMOUS,
                      project: str = owners.DEFAULT_PROJECT, completion: GroupCompletion = GroupCompletion(),
                      group_submitted_at: float = 0.0) -> RolloutRecord:
        rid = "r-" + uuid.uuid4().hex[:20]
        # one rollout is one trace: every message published below carries its traceparent
        with telemetry.tracer().start_as_current_span("submission", attributes={"arena.rollout_id": rid,
                                                                             "arena.task_id": req.task.id}):
            return await self._create_traced(req, private, rid=rid, group_id=group_id, index=index, size=size,
                                             sampling=sampling, owner=owner, project=project,
                                             completion=completion,
                                             group_submitted_at=group_submitted_at)

    async def _create_traced(self, req: SubmitRolloutRequest, private: tuple[str, float], *, rid: str, group_id: str | None, index: int,
                             size: int, sampling, owner: str, completion: GroupCompletion, project: str,
                             group_submitted_at: float) -> RolloutRecord:
        now = time.time()
        ref, verify_budget = private
        record = RolloutRecord(
            rollout_id=rid,
            task=req.task,
            sampling=sampling,
            model=req.model,
            provider=req.provider,
            api_key="ak-" + secrets.token_urlsafe(24),
            state=S.PENDING,
            created_at=now,
            updated_at=now,
            group_id=group_id,
            group_index=index,
            group_size=size,
            reason="submitted",
            history=[StateTransition(from_state=None, to_state=S.PENDING, at=now, reason="submitted")],
            metadata=req.metadata,
            verifier_ref=ref,
            verify_budget_s=verify_budget,
            traceparent=telemetry.traceparent(),  # the proxy's spans continue it
            owner=owner,
            project=project,
            completion=completion,
            group_submitted_at=group_submitted_at,
            lifetime_s=lifetime_s(req.task.budget, self.settings.rollout_max_lifetime_s),
        )
        await self.store.create(record)
        metrics.ROLLOUT_TRANSITIONS.labels(state=S.PENDING.value).inc()
        await self.bus.publish(
            subjects.rollout_submitted(rid),
            RolloutSubmitted(rollout_id=rid, task_id=req.task.id, group_id=group_id, group_index=index,
                             group_size=size, at=now),
            msg_id=subjects.msg_id(rid, "submitted"),
        )
        await self._publish_state(record, None)
        log.info("rollout submitted", extra={"rollout_id": rid, "group_id": group_id})
        if self.store.cache.watching:
            await self.dispatch()  # it starts now if a slot is free for it (scheduler.py)
        else:  # no view of the queue (the cache is not following the bucket): straight to the sandbox plane
            await self._start(record)
        return self.store.cache.get(rid) or (await self.store.get(rid))[0]

    # ------------------------------------------------------------------ projects' quotas

    async def set_quota(self, quota: quotas.ProjectQuota, *, caller: ApiKey | None) -> quotas.ProjectQuota:
        """Store a project's quotas and priority (an admin key only; keys off: anyone). Every
        replica uses them within ``Quotas.ttl_s``; this one at once, and starts what they let start."""
        if caller is not None and "admin" not in caller.scopes:
            raise Forbidden(f"API key {caller.key_id} ({caller.name}) may not set projects' quotas: "
                            "that needs an admin key")
        try:
            stored = await quotas.put(self.bus, quota)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        self.quotas.remember(stored)
        self.kick()
        return stored

    async def quota_listing(self, *, caller: ApiKey | None) -> list[dict]:
        """Each project's quotas (stored, or the defaults) with what it holds now: its rollouts
        waiting for a sandbox and the sandboxes it holds. A project's key sees its own project's."""
        stored = {q.project: q for q in await quotas.listing(self.bus)}
        live = self.store.cache.live()
        names = set(stored) | {r.project for r in live}
        if caller is not None and "admin" not in caller.scopes:
            names = {caller.project}
        out = []
        for name in sorted(names):
            quota = stored.get(name) or quotas.defaults(name)
            out.append({**msgspec.to_builtins(quota),
                        "waiting": sum(1 for r in live if r.project == name and r.state == S.PENDING),
                        "sandboxes": sum(1 for r in live if r.project == name and r.state in scheduler.HOLDING),
                        "stored": name in stored})
        return out

    # ------------------------------------------------------------------ the scheduler

    def provider_slots(self, provider: str) -> int | None:
        """Sandboxes the live workers of ``provider`` run at once (``None``: unknown)."""
        if self.workers is None:
            return None
        from arena_core.workers import STALE_S

        now = time.monotonic()
        per_worker: dict[str, int] = {}
        for key, info in self.workers.entries.items():
            if info.provider == provider and now - self.workers.seen.get(key, -1e9) < STALE_S:
                per_worker[info.worker] = max(per_worker.get(info.worker, 0), info.slots)
        return sum(per_worker.values()) or None

    async def dispatch(self) -> None:
        """Start the waiting rollouts the free slots take, chosen by priority class and weighted
        fair share (scheduler.py): each moves ``pending`` -> ``provisioning`` by compare-and-set
        (one replica wins; a rollout cancelled meanwhile stays cancelled), then its sandbox job
        is published (de-duplicated by its message id). One pass at a time per process; a call
        meanwhile makes the running pass look again when it ends. Called at each submission,
        each slot given back, and every second by the reaper (other replicas' changes, new
        workers, changed quotas)."""
        if self._dispatching:
            self._dispatch_again = True
            return
        self._dispatching = True
        try:
            if not self._recovered:
                await self._republish_unstarted()
            for _ in range(1000):
                self._dispatch_again = False
                started = await self._dispatch_pass()
                if not started and not self._dispatch_again:
                    break
        finally:
            self._dispatching = False

    def kick(self) -> None:
        """``dispatch`` soon, without waiting for it (a slot was given back)."""
        if self._dispatching:
            self._dispatch_again = True
        elif self._dispatch_task is None or self._dispatch_task.done():
            self._dispatch_task = asyncio.get_running_loop().create_task(self.dispatch())

    async def _dispatch_pass(self) -> int:
        live = self.store.cache.live()  # empty until the cache's watch caught up: nothing starts before
        pending = [r for r in live if r.state == S.PENDING]
        if not pending:
            return 0
        for name in {r.project for r in pending} | {r.project for r in live if r.state in scheduler.HOLDING}:
            await self.quotas.of(name)  # fresh within its ttl; nothing below awaits before the choice
        live = self.store.cache.live()
        slots = self.workers.slots() if self.workers is not None else None
        order = scheduler.plan(live, quotas=self.quotas.cached, slots=slots, provider_slots=self.provider_slots,
                               usage=self.usage, mean_hold_s=self.admission.hold_s() or 1.0)
        started = 0
        for record in order:
            if await self._start(record):
                started += 1
        return started

    async def _start(self, record: RolloutRecord) -> bool:
        rid = record.rollout_id
        after = await self.transition(rid, S.PROVISIONING, only_from=frozenset({S.PENDING}),
                                      reason=f"sandbox job queued for provider {record.provider}")
        if after is None:
            return False  # another replica started it, or it ended meanwhile
        await self._publish_job(after)
        return True

    async def _publish_job(self, record: RolloutRecord) -> None:
        rid = record.rollout_id
        job = SandboxJob(
            rollout_id=rid,
            task=record.task,
            proxy_url=f"{self.settings.agent_url}/proxy/{rid}/v1",  # the proxy-only port when set
            api_key=record.api_key,
            verifier_ref=record.verifier_ref,
        )
        # the job continues the rollout's trace (its submission span), whichever call dispatches it
        with telemetry.span_from_headers("dispatch", record.traceparent or None, **{"arena.rollout_id": rid}):
            await self.bus.publish(subjects.sandbox_run(record.provider), job,
                                   msg_id=subjects.msg_id(rid, "sandbox-job"))

    async def _republish_unstarted(self) -> None:
        """At a process's first pass: the sandbox job of each rollout moved to ``provisioning``
        within the bus's de-duplication window and not running yet is published again (a
        replica that stopped between the two steps left it without one; a job published
        already is dropped by its message id, so none starts twice)."""
        if not self.store.cache.watching:
            return
        self._recovered = True
        from arena_core.bus import DUPLICATE_WINDOW_S

        now = time.time()
        for record in self.store.cache.live():
            if record.state != S.PROVISIONING:
                continue
            since = scheduler.slot_since(record)
            if since is not None and now - since < DUPLICATE_WINDOW_S - 10:
                try:
                    await self._publish_job(record)
                except Exception:  # noqa: BLE001 - the reaper ends it at its queue limit
                    log.warning("could not publish the sandbox job again", exc_info=True,
                                extra={"rollout_id": record.rollout_id})

    # ------------------------------------------------------------------ transitions

    async def transition(self, rollout_id: str, target: RolloutState, *, reason: str,
                         reward: float | None = None, infrastructure: bool = False,
                         only_from: frozenset[RolloutState] | None = None,
                         group_cancelled: bool = False) -> RolloutRecord | None:
        """Move a rollout to ``target`` (compare-and-set) and publish the event.
        ``group_cancelled``: its group's completion policy cancels it (arena_rollout.groups).

        Returns the new record, or ``None`` when the rollout is already final, the
        transition is not allowed (an idempotent no-op, e.g. a redelivered event), or the
        stored state is not one of ``only_from`` (when given).
        """
        if target.is_final:  # the final event carries the step count: this process's recordings first
            await self.proxy.settle(rollout_id)
        now = time.time()

        def change(record: RolloutRecord) -> RolloutRecord:
            if record.state == target or record.state.is_final:
                return record
            if only_from is not None and record.state not in only_from:
                return record
            return state.transition(record, target, reason=reason, at=now, reward=reward,
                                    infrastructure=infrastructure, group_cancelled=group_cancelled)

        try:
            before, after = await self.store.update(rollout_id, change)
        except Conflict as exc:
            log.info("transition refused: %s", exc, extra={"rollout_id": rollout_id})
            return None
        if after is before:
            return None
        metrics.ROLLOUT_TRANSITIONS.labels(state=after.state.value).inc()
        if before.state in QUEUED and after.state not in QUEUED:
            self.admission.left_queue()
        if before.state in scheduler.HOLDING and after.state not in scheduler.HOLDING:
            # the slot was held from the worker's take (provisioning), not from the agent's start
            started = scheduler.slot_since(before)
            if started is not None:
                self.admission.released_sandbox(now - started)
                self.usage.add(before.project, now - started, now)
            self.kick()
        await self._publish_state(after, before.state)
        log.info("rollout %s -> %s: %s", before.state.value, target.value, reason, extra={"rollout_id": rollout_id})
        return after

    async def _publish_state(self, record: RolloutRecord, from_state: RolloutState | None) -> None:
        event = RolloutStateChanged(
            rollout_id=record.rollout_id,
            task_id=record.task.id,
            from_state=from_state,
            to_state=record.state,
            at=record.updated_at,
            reason=record.reason,
            steps=record.steps,
            group_id=record.group_id,
            group_index=record.group_index,
            group_size=record.group_size,
            reward=record.reward,
            metadata=record.metadata,
            history=record.history if record.state.is_final else [],
            infrastructure=record.infrastructure,
            group_cancelled=record.group_cancelled,
            project=record.project,
        )
        await self.bus.publish(
            subjects.rollout_state(record.rollout_id),
            event,
            msg_id=subjects.msg_id(record.rollout_id, "state", record.state.value),
        )

    async def cancel(self, rollout_id: str, reason: str = "cancelled by user", *,
                     caller: ApiKey | None = None) -> RolloutRecord:
        """``caller``: the key asking (``None``: keys off, or Arena itself); a rollout of another
        project is not found (404), and only the rollout's owner or an admin key may cancel it (403)."""
        record = await self.visible(rollout_id, caller)
        owners.check(record.owner, caller, f"rollout {rollout_id}")
        if record.state.is_final:
            raise Conflict(f"rollout {rollout_id} is already {record.state.value}")
        after = await self.transition(rollout_id, S.CANCELLED, reason=reason)
        if after is None:
            record, _ = await self.store.get(rollout_id)
            raise Conflict(f"rollout {rollout_id} is already {record.state.value}")
        return after

    async def visible(self, rollout_id: str, caller: ApiKey | None) -> RolloutRecord:
        """The rollout's record, or 404 as for an unknown one when it is another project's (``caller``
        a key that does not see it)."""
        record, _ = await self.store.get(rollout_id)
        owners.visible(record.project, caller, f"no rollout {rollout_id!r}")
        return record

    def check_group(self, group_id: str, caller: ApiKey | None) -> None:
        """Raise when a live member of ``group_id`` belongs to a key ``caller`` may not act for:
        joining a group (an OpenEnv reset naming one) is changing it. Another project's group is
        not found (404), another key's of the caller's project is refused (403). A group whose
        members all ended is still its project's (the cache remembers groups' projects)."""
        known = self.store.cache.group_project(group_id)
        if known is not None:
            owners.visible(known, caller, f"no group {group_id!r} to join")
        for record in self.store.cache.live():
            if record.group_id == group_id:
                owners.visible(record.project, caller, f"no group {group_id!r} to join")
                owners.check(record.owner, caller, f"group {group_id}")

    # ------------------------------------------------------------------ results from other planes

    async def _current(self, rollout_id: str, *, unless: Callable[[RolloutRecord], bool]) -> RolloutRecord:
        """The record as the cache holds it (no bus call), or from the bucket when the cache has
        none or when ``unless`` holds for the cached one: a decision to wait (a retry) is never
        taken on a cached record that may lag behind another replica's write. A decision to go
        on may: the transition's compare-and-set guards it."""
        record = self.store.cache.get(rollout_id)
        if record is None or unless(record):
            record, _ = await self.store.get(rollout_id)
        return record

    async def on_sandbox_started(self, event: SandboxStarted, delivery: Delivery) -> None:
        record = await self._current(event.rollout_id, unless=lambda r: r.state == S.PENDING)
        if record.state == S.PENDING:
            raise Retryable("sandbox started before the rollout left pending", 0.2)
        await self.transition(event.rollout_id, S.RUNNING, reason=f"sandbox {event.sandbox_id} started")

    async def on_sandbox_done(self, event: SandboxDone | SandboxEnded, delivery: Delivery) -> None:
        record = await self._current(event.rollout_id, unless=lambda r: False)
        if record.state.is_final:
            return
        if event.outcome == SandboxOutcome.COMPLETED:
            if record.state == S.PROVISIONING:  # started event not processed yet
                await self.transition(event.rollout_id, S.RUNNING, reason=f"sandbox {event.sandbox_id} started")
            await self.transition(event.rollout_id, S.VERIFYING, reason=f"agent finished: {event.reason}")
        else:
            infrastructure = event.outcome is SandboxOutcome.ERROR
            reason = f"infrastructure: {event.reason}" if infrastructure else event.reason
            await self.transition(event.rollout_id, _SANDBOX_TO_STATE[event.outcome], reason=reason,
                                  infrastructure=infrastructure)

    async def on_verify_done(self, event: VerificationResult, delivery: Delivery) -> None:
        record = await self._current(event.rollout_id, unless=lambda r: r.state != S.VERIFYING)
        if record.state.is_final:
            return
        if record.state != S.VERIFYING:
            raise Retryable(f"verification arrived while {record.state.value}; waiting for sandbox result", 0.5)
        if event.reward is None:  # Arena could not verify: an infrastructure outcome, no reward
            await self.transition(event.rollout_id, S.FAILED, infrastructure=True,
                                  reason=f"infrastructure: could not verify: {event.error or event.reason}")
            return
        reason = f"reward {event.reward:g}" + (f" ({', '.join(event.flags)})" if event.flags else "")
        await self.transition(event.rollout_id, S.COMPLETED, reason=reason, reward=event.reward)

    async def on_dead_letter(self, letter: DeadLetter, delivery: Delivery) -> None:
        """A sandbox or verify job was given up on: end its rollout ``failed`` with the error,
        rather than leaving it (and its group) waiting forever."""
        try:
            rid = _job_decoder.decode(letter.data).rollout_id
        except msgspec.DecodeError:
            log.error("dead letter on %s has no decodable rollout id: %s", letter.subject, letter.error)
            return
        plane = "sandbox" if letter.stream == "ARENA_SANDBOX_JOBS" else "verification"
        await self.transition(rid, S.FAILED, infrastructure=True,
                              reason=f"infrastructure: {plane} gave up after {letter.num_delivered} "
                                     f"deliveries: {letter.error}")

    # ------------------------------------------------------------------ waiting and events

    async def wait(self, rollout_id: str, timeout: float) -> RolloutRecord:
        """Return the rollout once final, or as it is when ``timeout`` passes.

        A rollout live in the record cache is awaited there: its final record comes from this
        process's own write or the bucket's watch, no bus call at all. Else (the cache is not
        watching, or does not hold the rollout) from the bucket, woken by the rollout's state
        messages."""
        deadline = time.monotonic() + timeout
        final = self.store.cache.until_final(rollout_id) if timeout > 0 else None
        if final is not None:
            try:
                while True:
                    remaining = deadline - time.monotonic()
                    try:  # in slices: a cache that lost its way is found out within 5 s
                        record = await asyncio.wait_for(asyncio.shield(final), min(max(remaining, 0), 5.0))
                    except asyncio.TimeoutError:
                        if not self.store.cache.watching or self.store.cache.ended(rollout_id):
                            break  # the bucket answers below
                        if remaining <= 5.0:
                            return self.store.cache.get(rollout_id) or (await self.store.get(rollout_id))[0]
                        continue
                    if record is not None:
                        return record
                    break  # the watch stopped: the bucket answers below
            finally:
                final.cancel()
            timeout = max(deadline - time.monotonic(), 0.0)
        return await self._wait_on_bus(rollout_id, timeout)

    async def _wait_on_bus(self, rollout_id: str, timeout: float) -> RolloutRecord:
        changed = asyncio.Event()

        async def on_msg(msg) -> None:
            # only a final state ends the wait: the record is read again then, not at every step
            # (each read is a round trip to the bucket; a rollout passes 3-4 states on its way)
            try:
                final = _state_decoder.decode(msg.data).to_state.is_final
            except msgspec.DecodeError:
                final = True  # not ours to judge: look at the record
            if final:
                changed.set()

        sub = await self.bus.nc.subscribe(subjects.rollout_state(rollout_id), cb=on_msg)
        try:
            deadline = time.monotonic() + timeout
            while True:
                record, _ = await self.store.get(rollout_id)
                remaining = deadline - time.monotonic()
                if record.state.is_final or remaining <= 0:
                    return record
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), min(remaining, 5.0))
                except asyncio.TimeoutError:
                    pass
        finally:
            await sub.unsubscribe()

    async def events(self, rollout_id: str, *, heartbeat: float = 15.0) -> AsyncIterator[RolloutStateChanged | None]:
        """Every transition so far, then new ones as they happen, until a final state.

        Yields ``None`` as a heartbeat when nothing happened for ``heartbeat`` seconds.
        """
        queue: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_msg(msg) -> None:
            await queue.put(msg.data)

        sub = await self.bus.nc.subscribe(subjects.rollout_state(rollout_id), cb=on_msg)
        try:
            record, _ = await self.store.get(rollout_id)
            seen = set()
            for t in record.history:
                seen.add(t.to_state)
                yield RolloutStateChanged(rollout_id=rollout_id, task_id=record.task.id, from_state=t.from_state,
                                          to_state=t.to_state, at=t.at, reason=t.reason,
                                          group_id=record.group_id, group_index=record.group_index,
                                          group_size=record.group_size,
                                          reward=record.reward if t.to_state.is_final else None,
                                          steps=record.steps if t.to_state.is_final else 0)
            if record.state.is_final:
                return
            while True:
                try:
                    data = await asyncio.wait_for(queue.get(), heartbeat)
                except asyncio.TimeoutError:
                    yield None
                    continue
                event = _state_decoder.decode(data)
                if event.to_state in seen:
                    continue
                seen.add(event.to_state)
                yield event
                if event.to_state.is_final:
                    return
        finally:
            await sub.unsubscribe()

    # ------------------------------------------------------------------ the proxy

    async def authorize(self, rollout_id: str, authorization: str | None, api_key_header: str | None) -> RolloutRecord:
        key = api_key_header
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        if not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <rollout key>'")
        try:
            record = await self.store.current(rollout_id)  # no NATS round trip while the cache watches
        except Exception:  # noqa: BLE001 - unknown rollout and bad key look the same to the caller
            raise Unauthorized("invalid API key for this rollout") from None
        if not secrets.compare_digest(key, record.api_key):
            raise Unauthorized("invalid API key for this rollout")
        if record.state not in (S.PROVISIONING, S.RUNNING):
            raise Unauthorized(f"rollout {rollout_id} is {record.state.value}; its key is no longer valid")
        return record

    def models_of(self, record: RolloutRecord) -> list[str]:
        """The model names a rollout's agent may send: the rollout's model (any name is mapped
        to it), its scaffold's, else the ones the backends serve."""
        names: list[str] = []
        scaffold = record.task.agent.scaffold
        if scaffold is not None:
            names.append(scaffold.model)
        if record.model and record.model != "default":
            names.append(record.model)
        else:
            names.extend(m for s in self.router.replicas.values() for m in s.replica.models)
        return list(dict.fromkeys(names)) or ["default"]

    async def authorize_judge(self, rollout_id: str, authorization: str | None,
                              api_key_header: str | None) -> RolloutRecord:
        """The verification service's judge key (``ARENA_JUDGE_KEY``), valid for any existing
        rollout in any state: judging happens after the rollout's sandbox finished."""
        expected = self.settings.judge_key
        if not expected:
            raise Unauthorized("the judge route is disabled: ARENA_JUDGE_KEY is not set on the rollout service")
        key = api_key_header
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        if not key or not secrets.compare_digest(key, expected):
            raise Unauthorized("invalid judge key: send 'Authorization: Bearer <ARENA_JUDGE_KEY>'")
        try:
            return await self.store.current(rollout_id)
        except NotFound:
            raise NotFound(f"rollout {rollout_id} not found") from None
