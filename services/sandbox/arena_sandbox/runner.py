"""One sandbox job, start to finish, without the bus (``run_job``).

Prepare the workspace, run the agent under the sandbox contract, decide the outcome, read
``result.json``, extract the diff, always destroy the sandbox. See docs/sandbox.md ("One job").
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import stat
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from arena_core import scaffolds, telemetry
from arena_core.schemas import AgentSpec, OpenEnvServer, SandboxDone, SandboxJob, SandboxOutcome, Task
from arena_core.sources import DiffTooLarge, Lease, SourceCache, SourceError
from arena_sandbox_providers import local
from arena_sandbox_providers.local import ProxyForward, RunResult
from arena_sandbox import episode, hosted, turns
from arena_sandbox.gate import StepGate
from arena_sandbox.pool import WarmPool
from arena_sandbox_providers.provider import CreateSpec, ExecResult, Sandbox, SandboxError, SandboxLimits, SandboxProvider

log = logging.getLogger("arena.sandbox.runner")

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
#: The artifact that keeps the first ``max_diff_bytes`` of a diff over the limit.
DIFF_TRUNCATED = "diff.truncated"


class RunnerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the job runner (defaults suit the embedded stack)."""

    log_tail_lines: int = 40
    log_tail_chars: int = 4000
    #: The full log kept for the artifact store; a longer log keeps its last bytes.
    max_log_bytes: int = 16 * 1024 * 1024
    max_result_bytes: int = 1024 * 1024
    #: A scaffold's artifact (its trajectory file) larger than this is not kept (the reason says so).
    max_artifact_bytes: int = 64 * 1024 * 1024
    diff_timeout_s: float = 120.0
    #: The largest diff kept (``ARENA_MAX_DIFF_BYTES``): past it the agent fails, its diff's first
    #: ``max_diff_bytes`` kept as the artifact ``diff.truncated``.
    max_diff_bytes: int = 10 * 1024 * 1024
    sandbox_limits: SandboxLimits = SandboxLimits()


class JobRun(msgspec.Struct, frozen=True, kw_only=True):
    """What a job ended with: the message to publish and the agent's full log."""

    done: SandboxDone
    log: bytes
    run: RunResult | None = None  # None if the sandbox never started
    #: The scaffold's artifacts read from the sandbox: name -> bytes (``SandboxDone.artifacts``
    #: names their keys once the worker has stored them).
    artifacts: dict[str, bytes] = {}


class TaskFile(msgspec.Struct, frozen=True, kw_only=True):
    """``/sandbox/.arena/task.json``."""

    rollout_id: str
    task: Task
    #: A multi-step task's turn: its step's name and 1-based index (the task's ``instructions`` are that step's).
    step: str = ""
    step_index: int = 0


# --------------------------------------------------------------------------- pure pieces


def new_sandbox_id(rollout_id: str) -> str:
    return f"{rollout_id}-{uuid.uuid4().hex[:8]}"


def proxy_forward(proxy_url: str) -> ProxyForward:
    """The proxy's host:port on the host, from the job's ``proxy_url``, and the rollout's proxy
    routes the relay lets through: the URL's path without its ``/v1`` (``/proxy/{rollout_id}``)."""
    url = urlsplit(proxy_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"proxy_url {proxy_url!r} is not an http(s) URL")
    port = url.port or (443 if url.scheme == "https" else 80)
    routes = url.path.rstrip("/")
    routes = routes[: -len("/v1")] if routes.endswith("/v1") else routes
    return ProxyForward(host=url.hostname, port=port, routes=routes)


def sandbox_proxy_url(proxy_url: str) -> str:
    """The proxy URL as the agent uses it inside the sandbox.

    Inside, only loopback ``:<inside_port>`` leads to the proxy: a loopback URL on an
    unprivileged port is kept as is; otherwise the host becomes ``127.0.0.1`` and the
    port :attr:`ProxyForward.inside_port` (same path).
    """
    url = urlsplit(proxy_url)
    forward = proxy_forward(proxy_url)
    if url.hostname in _LOOPBACK_HOSTS and url.port == forward.inside_port:
        return proxy_url
    return urlunsplit((url.scheme, f"127.0.0.1:{forward.inside_port}", url.path, url.query, url.fragment))


def anthropic_base_url(openai_base_url: str) -> str:
    """Anthropic SDKs append ``/v1/messages`` themselves: drop a trailing ``/v1``."""
    base = openai_base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def agent_env(job: SandboxJob, scaffold_env: dict[str, str] | None = None) -> dict[str, str]:
    """The sandbox contract's environment, then a scaffold preset's, then the task's own ``agent.env``."""
    base_url = sandbox_proxy_url(job.proxy_url)
    env = {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": job.api_key,
        "ANTHROPIC_BASE_URL": anthropic_base_url(base_url),
        "ANTHROPIC_API_KEY": job.api_key,
        "ARENA_ROLLOUT_ID": job.rollout_id,
    }
    env.update(scaffold_env or {})
    env.update(job.task.agent.env)
    return env


def scaffold_launch(job: SandboxJob, workdir: str, home: str = "") -> scaffolds.Launch:
    """The launch of the task's scaffold (``task.agent.scaffold``) in this job's sandbox."""
    base_url = sandbox_proxy_url(job.proxy_url)
    context = scaffolds.Context(
        instructions=job.task.instructions, openai_base_url=base_url, anthropic_base_url=anthropic_base_url(base_url),
        api_key=job.api_key, workdir=workdir, home=home,
    )
    return scaffolds.preset(job.task.agent, context)


def scaffold_home(provider: SandboxProvider | WarmPool, name: str) -> str:
    """Where the provider's sandboxes find scaffold ``name`` installed (the local provider binds
    its scaffolds directory), or "": on the sandbox's ``PATH`` (an image that ships it)."""
    base = getattr(provider.provider if isinstance(provider, WarmPool) else provider, "scaffolds_dir", None)
    if base is None or not (Path(base) / name / "bin").is_dir():
        return ""
    return str(Path(base) / name)


def task_json(job: SandboxJob, task: Task | None = None, step_index: int | None = None) -> bytes:
    """The public part of the task only: the verifier never enters the agent's sandbox. A
    multi-step task's turn ``step_index`` (0-based) has that step's ``task``."""
    task = (task or job.task).public()
    if step_index is None:
        return msgspec.json.encode(TaskFile(rollout_id=job.rollout_id, task=task))
    return msgspec.json.encode(TaskFile(rollout_id=job.rollout_id, task=task, step=task.steps[step_index].name,
                                        step_index=step_index + 1))


def log_tail(data: bytes, *, lines: int = 40, max_chars: int = 4000) -> str:
    text = data.decode("utf-8", errors="replace")
    tail = "\n".join(text.rstrip("\n").split("\n")[-lines:])
    return tail[-max_chars:]


def read_result(arena_dir: Path, *, max_bytes: int = 1024 * 1024) -> tuple[dict[str, Any] | None, str]:
    """The agent's optional ``result.json``: ``(value, note)``; note says why it was ignored.

    The file is opened without following symlinks: the agent wrote this directory,
    and a link to a host file must not leak that file into the result.
    """
    path = arena_dir / "result.json"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"result.json ignored: cannot open it ({exc.strerror})"
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
            return None, "result.json ignored: not a regular file"
        data = fh.read(max_bytes + 1)
    return parse_result(data, max_bytes=max_bytes)


def parse_result(data: bytes | None, *, max_bytes: int = 1024 * 1024) -> tuple[dict[str, Any] | None, str]:
    """``result.json`` as read from a sandbox (``None``: absent or not a regular file)."""
    if data is None:
        return None, ""
    if len(data) > max_bytes:
        return None, f"result.json ignored: larger than {max_bytes} bytes"
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        return None, f"result.json ignored: invalid JSON ({exc})"
    if not isinstance(value, dict):
        return None, "result.json ignored: not a JSON object"
    return value, ""


def done_written(arena_dir: Path) -> bool:
    return os.path.lexists(arena_dir / "done")


def decide_outcome(
    run: RunResult | ExecResult, *, done: bool, tail: str, memory_bytes: int | None = None,
    wall_clock_s: float | None = None,
) -> tuple[SandboxOutcome, str]:
    """The outcome and its reason.

    A cancel (Arena killed it, not for the wall clock) wins; otherwise writing ``done`` means completed, even if the agent then
    exited non-zero or ran out of time (its workspace is final either way, and
    verification judges it); then the timeout (the reason names ``wall_clock_s``, the
    budget, else the measured duration); anything else is a failure.
    """
    if run.killed and not run.timed_out:
        return SandboxOutcome.CANCELLED, "rollout cancelled while the agent was running"
    if done:
        if run.timed_out:
            return SandboxOutcome.COMPLETED, "agent wrote /sandbox/.arena/done, then hit the wall clock"
        if run.exit_code:
            return SandboxOutcome.COMPLETED, f"agent wrote /sandbox/.arena/done and exited with code {run.exit_code}"
        return SandboxOutcome.COMPLETED, "agent wrote /sandbox/.arena/done"
    if run.timed_out:
        budget = f"{wall_clock_s:g}" if wall_clock_s is not None else f"{run.duration_s:.0f}"
        return SandboxOutcome.TIMED_OUT, f"wall clock of {budget}s exceeded"
    if getattr(run, "oom_killed", False):
        limit = f" of {memory_bytes // 2**20} MiB" if memory_bytes else ""
        reason = f"out of memory: the OOM killer fired (memory limit{limit}); agent exited with code {run.exit_code}"
        return SandboxOutcome.FAILED, reason + (f"; last output:\n{tail}" if tail else "")
    reason = f"agent exited with code {run.exit_code} without writing /sandbox/.arena/done"
    if tail:
        reason += "; last output:\n" + tail
    return SandboxOutcome.FAILED, reason


# --------------------------------------------------------------------------- the job


class _LogBuffer:
    """The agent's output as it streams: the last ``max_bytes`` are kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.chunks: list[bytes] = []
        self.size = 0
        self.dropped = 0

    def __call__(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)
        while self.size > self.max_bytes and len(self.chunks) > 1:
            first = self.chunks.pop(0)
            self.size -= len(first)
            self.dropped += len(first)

    def data(self) -> bytes:
        data = b"".join(self.chunks)
        if self.dropped or len(data) > self.max_bytes:
            data = data[-self.max_bytes :]
            return b"[arena: log truncated to its last %d bytes]\n" % self.max_bytes + data
        return data


async def run_job(
    job: SandboxJob,
    *,
    data_dir: Path,
    provider: SandboxProvider | WarmPool,
    config: RunnerConfig = RunnerConfig(),
    sandbox_id: str | None = None,
    cancel: asyncio.Event | None = None,
    sources: SourceCache | None = None,
    exchanges: episode.Exchanges | None = None,
    idle_s: float = 900.0,
    servers: hosted.EnvServers | None = None,
    destroy_later: list[Sandbox] | None = None,
    lease: Lease | None = None,
    gate: StepGate | None = None,
) -> JobRun:
    """Run ``job`` in a fresh sandbox from ``provider`` (or its warm pool); never raises
    for a problem of the job itself (a missing repository, a broken workspace): that is
    a ``SandboxDone`` with outcome ``error``. The sandbox is destroyed on every path, here, or
    by the caller when ``destroy_later`` is given: it is appended to it, so the result can be
    published first (the caller must destroy it, on every path).

    An OpenEnv episode (``agent.external``) serves ``exchanges``; a hosted environment's
    started server may come from, and go back to, ``servers``.

    The sources the job reads are held by ``lease`` (none is evicted from the cache while the
    sandbox may still read or mount them): the caller's, released by it after the sandbox is
    destroyed (with ``destroy_later``), else one of the job's own, released on return.

    A multi-step task's ``gate`` decides after each turn whether the next one runs (``turns.run_steps``)."""
    sandbox_id = sandbox_id or new_sandbox_id(job.rollout_id)
    name = provider.provider.name if isinstance(provider, WarmPool) else provider.name
    staging = Path(data_dir) / "staging" / sandbox_id
    extra = {"rollout_id": job.rollout_id, "sandbox_id": sandbox_id}
    started_at = time.time()

    def finish(outcome: SandboxOutcome, reason: str, **fields: Any) -> SandboxDone:
        if name == "mock":
            reason = f"mock provider (no process was run): {reason}"
        return SandboxDone(
            rollout_id=job.rollout_id, sandbox_id=sandbox_id, provider=name, outcome=outcome, reason=reason,
            started_at=started_at, finished_at=time.time(), **fields,
        )

    cache = sources if sources is not None else SourceCache(Path(data_dir) / "sources", allow_paths=True)
    own_lease = lease is None
    lease = cache.lease() if lease is None else lease
    if job.task.environment is not None:
        try:
            return await _run_hosted(job, provider=provider, config=config, cache=cache, finish=finish,
                                     exchanges=exchanges, idle_s=idle_s, cancel=cancel, servers=servers, lease=lease)
        finally:
            if own_lease:
                lease.release()
    sandbox: Sandbox | None = None
    attributes = {"arena.rollout_id": job.rollout_id, "arena.sandbox_id": sandbox_id, "arena.provider": name}
    try:
        try:
            with telemetry.tracer().start_as_current_span("sandbox.start", attributes=attributes):
                tree = await cache.tree(job.task.source_of(), lease)
                prepared = await cache.workspace(job.task.source_of(), lease)  # committed once per source on this worker
                agent_tree = await agent_files(job.task.agent, cache, lease)
                home = scaffold_home(provider, job.task.agent.scaffold.name) if job.task.agent.scaffold else ""
                plan, base, workspace = await asyncio.to_thread(  # copy + git: off the loop
                    _prepare, job, staging, tree, agent_tree, home, prepared)
                if job.task.services and name != "docker":
                    raise ValueError(f"the task has sidecar services ({', '.join(s.name for s in job.task.services)})"
                                     f": the {name} provider cannot run them (submit it with provider docker)")
                spec = CreateSpec(image=job.task.image_of(), limits=config.sandbox_limits,
                                  workspace_mount=job.task.workspace_mount() if name == "docker" else "",
                                  services=tuple(job.task.services),
                                  # an OpenEnv client's actions: many short commands, one sandbox process
                                  session=bool(job.task.agent.external))
                if spec.services:  # its own network and sidecars: never a warm pool's
                    base_provider = provider.provider if isinstance(provider, WarmPool) else provider
                    sandbox = await base_provider.create(spec)
                else:
                    sandbox = await (provider.acquire(spec) if isinstance(provider, WarmPool)
                                     else provider.create(spec))
                # the cached base is never modified nor removed: a provider may mount it instead of copying
                await sandbox.put_dir(workspace, local.WORKSPACE, src_stable=prepared is not None)
                if plan.agent_dir is not None:
                    await sandbox.put_dir(plan.agent_dir, local.AGENT_DIR)
                await sandbox.put_files({f"{local.ARENA_DIR}/task.json": task_json(job), **plan.files})
                git_config = await sandbox.read_file(f"{local.WORKSPACE}/.git/config", max_bytes=GIT_CONFIG_MAX)
        except (OSError, ValueError, local.GitError, SandboxError, SourceError) as exc:
            log.warning("cannot prepare the sandbox: %s", exc, extra=extra)
            return JobRun(done=finish(SandboxOutcome.ERROR, f"cannot prepare the sandbox: {exc}"), log=b"")
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)
        log.info("sandbox starting (%s %s)", name, sandbox.id, extra=extra)
        output = _LogBuffer(config.max_log_bytes)
        ended: episode.EpisodeEnd | None = None
        steps: turns.StepRuns | None = None
        try:
            with telemetry.tracer().start_as_current_span("sandbox.run", attributes=attributes) as span:
                if job.task.agent.external:
                    ended = await _episode(job, sandbox, plan, provider, exchanges, cancel, idle_s)
                    output(ended.log)
                    run = ExecResult(exit_code=None if ended.failed else 0, timed_out=ended.timed_out,
                                     killed=ended.cancelled, duration_s=ended.duration_s)
                elif job.task.steps:
                    steps = await turns.run_steps(
                        job, sandbox, launch=lambda task: _turn_launch(job, task, plan, home),
                        task_file=lambda task, i: task_json(job, task, i), base=base, workdir=plan.workdir,
                        proxy=plan.proxy, cancel=cancel, on_output=output, diff_timeout_s=config.diff_timeout_s,
                        max_diff_bytes=config.max_diff_bytes, gate=gate)
                    run = steps.run
                else:
                    run = await sandbox.exec(
                        plan.command, env=plan.env, workdir=plan.workdir, timeout_s=job.task.budget.wall_clock_s,
                        proxy=plan.proxy, cancel=cancel, on_output=output,
                    )
                span.set_attribute("arena.exit_code", run.exit_code if run.exit_code is not None else -1)
        except SandboxError as exc:
            return JobRun(done=finish(SandboxOutcome.ERROR, str(exc)), log=output.data())
        full_log = output.data()
        tail = log_tail(full_log, lines=config.log_tail_lines, max_chars=config.log_tail_chars)
        if ended is not None:
            done_seen = ended.done
        elif steps is not None:
            done_seen = steps.first_done
        else:
            done_seen = await sandbox.exists(f"{local.ARENA_DIR}/done")
        outcome, reason = decide_outcome(run, done=done_seen, tail=tail, memory_bytes=config.sandbox_limits.memory_bytes,
                                         wall_clock_s=job.task.budget.wall_clock_s)
        if steps is not None:
            reason = f"{reason}; turns: " + ", ".join(f"{t.name}: {t.reason}" for t in steps.turns)
            if steps.failure and outcome is SandboxOutcome.COMPLETED:
                outcome, reason = SandboxOutcome.FAILED, f"{steps.failure}; {reason}"
            if steps.gate_error and cancel is not None and cancel.is_set():
                outcome, reason = SandboxOutcome.CANCELLED, f"cancelled during a step's gate; {reason}"
            elif steps.gate_error:
                # Arena could not grade a step mid-rollout: no reward, never a 0 (docs/tasks.md)
                outcome, reason = SandboxOutcome.ERROR, f"{steps.gate_error}; {reason}"
        if ended is not None and not run.killed:
            reason = ended.reason
            if ended.failed:  # the environment broke, not the policy: no reward (an infrastructure outcome)
                outcome = SandboxOutcome.ERROR
                reason += f"; last output:\n{tail}" if tail and tail not in reason else ""
        result_path = f"{local.ARENA_DIR}/result.json"
        raw = await sandbox.read_file(result_path, max_bytes=config.max_result_bytes)
        result, note = parse_result(raw, max_bytes=config.max_result_bytes)
        if raw is None and await sandbox.exists(result_path):
            note = "result.json ignored: not a regular file (links are not followed)"
        if ended is not None and ended.answer is not None:
            result, note = {**(result or {}), "answer": ended.answer}, ""
        if note:
            reason = f"{reason}; {note}"
        artifacts: dict[str, bytes] = {}
        for artifact, path in plan.artifacts.items():
            data = await sandbox.read_file(path, max_bytes=config.max_artifact_bytes)
            if data is not None and len(data) <= config.max_artifact_bytes:
                artifacts[artifact] = data
            elif data is not None:
                reason = f"{reason}; {artifact} not kept: larger than {config.max_artifact_bytes} bytes"
        flags: list[str] = []
        changed = await git_tampering(sandbox, git_config)
        if changed:
            flags.append(FLAG_GIT_TAMPERED)
            reason = f"{reason}; the agent changed the repository's git metadata ({', '.join(changed)})"
        diff = ""
        if outcome is not SandboxOutcome.CANCELLED:
            # Failed and timed-out rollouts keep their diff too (analytics); only a
            # completed one needs it, so only there is a broken diff an error.
            try:
                # the workspace was put as a clean checkout of base (prepared or committed above)
                diff = await sandbox.diff(base, timeout_s=config.diff_timeout_s, put_at_base=True,
                                          max_bytes=config.max_diff_bytes)
            except DiffTooLarge as exc:
                # the diff's first bytes stay as an artifact; nothing of it travels on the bus
                artifacts[DIFF_TRUNCATED] = exc.head
                kept = f"{exc}; its first {exc.limit:,} bytes are kept as the artifact {DIFF_TRUNCATED}"
                if outcome in (SandboxOutcome.COMPLETED, SandboxOutcome.FAILED):
                    outcome, reason = SandboxOutcome.FAILED, f"{kept}; {reason}" if reason else kept
                else:
                    reason = f"{reason}; {kept}"
            except local.GitError as exc:
                if outcome is SandboxOutcome.COMPLETED:
                    # the agent owned the repository: a diff that cannot be had is its doing
                    # (a deleted or broken .git), a failure of the policy, never "no reward"
                    outcome, reason = SandboxOutcome.FAILED, f"cannot extract the diff (the agent broke the repository): {exc}"
                else:
                    reason = f"{reason}; no diff: {exc}"
        if run.proxy_fault and outcome is not SandboxOutcome.CANCELLED:
            # Arena's proxy died under a call of the agent's: whatever the agent did next, its
            # trajectory is Arena's failure, not the policy's (an infrastructure outcome, no reward)
            outcome, reason = SandboxOutcome.ERROR, f"an LLM call was cut on Arena's side ({run.proxy_fault}); {reason}"
        log.info("sandbox finished: %s", outcome.value, extra=extra)
        done = finish(outcome, reason, exit_code=run.exit_code, diff=diff, result=result, log_tail=tail,
                      oom_killed=run.oom_killed, flags=flags, env_steps=ended.steps if ended is not None else [],
                      proxy_fault=run.proxy_fault, step_turns=steps.turns if steps is not None else [])
        return JobRun(done=done, log=full_log, run=run, artifacts=artifacts)
    finally:
        if sandbox is not None:
            if destroy_later is not None:
                destroy_later.append(sandbox)
            else:
                await asyncio.shield(sandbox.destroy())
        if own_lease:
            lease.release()


async def _episode(job: SandboxJob, sandbox: Sandbox, plan: _Plan, provider, exchanges, cancel, idle_s: float):
    """An OpenEnv client's episode on Arena's own task (``agent.external``): the tools."""
    task = job.task
    if exchanges is None:
        return episode.EpisodeEnd(done=False, failed=True, reason="no environment endpoint can reach this "
                                  "sandbox (the worker serves no exchanges)")
    kill = asyncio.Event()  # kills the command in flight: the rollout ended, or its wall clock did
    follow = asyncio.ensure_future(_set_when(cancel, kill)) if cancel is not None else None
    session = episode.ToolSession(sandbox, workdir=plan.workdir, env=plan.env, proxy=plan.proxy,
                                  instructions=task.instructions, rollout_id=job.rollout_id, cancel=kill)
    try:
        return await episode.play(session, exchanges, wall_clock_s=task.budget.wall_clock_s,
                                  idle_s=min(idle_s, task.budget.wall_clock_s), cancel=cancel)
    finally:
        if follow is not None:
            follow.cancel()


async def _set_when(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


async def _run_hosted(job: SandboxJob, *, provider, config: RunnerConfig, cache: SourceCache, finish, exchanges,
                      idle_s: float, cancel, servers: hosted.EnvServers | None, lease: Lease | None = None) -> JobRun:
    """A hosted OpenEnv environment's episode: a server (warm from ``servers``, else started in
    a new sandbox), one WebSocket, the environment's rewards as the result. The server's
    failures are infrastructure outcomes (no reward)."""
    task = job.task
    spec = task.environment
    base = provider.provider if isinstance(provider, WarmPool) else provider
    image = task.image_of()
    key = hosted.server_key(spec, image, base.name)
    extra = {"rollout_id": job.rollout_id}
    if exchanges is None:
        return JobRun(done=finish(SandboxOutcome.ERROR, "no environment endpoint can reach this sandbox"), log=b"")
    server = servers.take(key) if servers is not None and spec.reuse else None
    if server is None:
        sandbox: Sandbox | None = None
        try:
            with telemetry.tracer().start_as_current_span("sandbox.start", attributes={
                    "arena.rollout_id": job.rollout_id, "arena.provider": base.name}):
                env_tree = await agent_files(spec, cache, lease)
                image_command, image_workdir = [], ""
                if base.name == "docker" and (not spec.command or (env_tree is None and image)):
                    image_command, image_workdir = await base.image_command(image)
                command = hosted.hosted_command(spec, base.name, image_command)
                spec_create = CreateSpec(image=image, limits=config.sandbox_limits)
                sandbox = await (provider.acquire(spec_create) if isinstance(provider, WarmPool)
                                 else provider.create(spec_create))
                if env_tree is not None:
                    await sandbox.put_dir(env_tree, local.AGENT_DIR)
                workdir = hosted.server_workdir(spec, env_tree is not None, image_workdir)
                env = {**({"PYTHONPATH": local.AGENT_DIR} if base.name != "docker" and env_tree else {}), **spec.env}
                local.validate_env(env)
                server = hosted.HostedServer(sandbox, spec, command=command, workdir=workdir, env=env, proxy=None)
                await server.start()
        except (OSError, ValueError, SandboxError, SourceError, episode.EnvironmentBroken) as exc:
            log.warning("cannot start the environment: %s", exc, extra=extra)
            tail = server.tail() if server is not None else ""
            if server is not None:
                await server.close()
            elif sandbox is not None:
                await asyncio.shield(sandbox.destroy())
            reason = f"the environment did not start: {exc}"
            return JobRun(done=finish(SandboxOutcome.ERROR, reason, log_tail=tail[-4000:]), log=tail.encode())
    server.episodes += 1
    session = hosted.HostedSession(server)
    try:
        with telemetry.tracer().start_as_current_span("sandbox.run", attributes={
                "arena.rollout_id": job.rollout_id, "arena.provider": base.name, "arena.episode": server.episodes}):
            ended = await episode.play(session, exchanges, wall_clock_s=task.budget.wall_clock_s,
                                       idle_s=min(idle_s, task.budget.wall_clock_s), cancel=cancel)
    finally:
        await session.close()
        if servers is not None and spec.reuse and not session.broken and server.alive():
            await servers.give(key, server)
        else:
            await server.close()
    tail = log_tail(ended.log, lines=config.log_tail_lines, max_chars=config.log_tail_chars)
    if ended.cancelled:
        outcome = SandboxOutcome.CANCELLED
    elif ended.failed:
        outcome = SandboxOutcome.ERROR
    elif ended.done:
        outcome = SandboxOutcome.COMPLETED
    else:
        outcome = SandboxOutcome.TIMED_OUT
    reason = ended.reason + (f"; last output:\n{tail}" if ended.failed and tail else "")
    # the environment's own rewards, from its frames: never a file its server could write
    result = {"env_rewards": [s.reward for s in ended.steps if s.kind == "step" and not s.error],
              "env_done": ended.done and not ended.closed}
    done = finish(outcome, reason, exit_code=None, result=result, log_tail=tail, env_steps=ended.steps)
    return JobRun(done=done, log=ended.log)


FLAG_GIT_TAMPERED = "git_tampered"
GIT_CONFIG_MAX = 64 * 1024
#: Git metadata that changes what the repository's history says (the base commit, its
#: objects) or that runs code: an agent has no reason to create any of it.
GIT_SUSPECT_PATHS = (
    "refs/replace", "info/grafts", "objects/info/alternates", "objects/info/http-alternates", "shallow",
    *(f"hooks/{name}" for name in (
        "applypatch-msg", "pre-applypatch", "post-applypatch", "pre-commit", "pre-merge-commit",
        "prepare-commit-msg", "commit-msg", "post-commit", "pre-rebase", "post-checkout", "post-merge",
        "pre-push", "pre-receive", "update", "proc-receive", "post-receive", "post-update",
        "reference-transaction", "push-to-checkout", "pre-auto-gc", "post-rewrite", "sendemail-validate",
        "fsmonitor-watchman", "p4-changelist", "p4-prepare-changelist", "p4-post-changelist", "p4-pre-submit",
        "post-index-change")),
)


async def git_tampering(sandbox: Sandbox, config_before: bytes | None) -> list[str]:
    """What the agent changed in ``/sandbox/workspace/.git`` that it had no reason to (empty: nothing)."""
    git = f"{local.WORKSPACE}/.git"
    found = [name for name in GIT_SUSPECT_PATHS if await sandbox.exists(f"{git}/{name}")]
    config_after = await sandbox.read_file(f"{git}/config", max_bytes=GIT_CONFIG_MAX)
    if config_before is not None and config_after != config_before and _CONFIG_SUSPECT.search(config_after or b""):
        found.append("config")
    return found


#: Config that runs programs or changes what git reads (a user name or email is harmless).
_CONFIG_SUSPECT = re.compile(
    rb"(?im)^\s*(\[\s*(filter|diff|merge|include|includeif)\b|(fsmonitor|hookspath|attributesfile|worktree|"
    rb"sshcommand|gitproxy|pager|editor|askpass|excludesfile|textconv|command|clean|smudge|process)\s*=)")


#: What Arena writes or reads in /sandbox/.arena itself: no preset may write them.
_CONTRACT_FILES = {f"{local.ARENA_DIR}/{name}" for name in ("task.json", "done", "result.json")}


class _Plan(msgspec.Struct, frozen=True, kw_only=True):
    command: list[str]
    env: dict[str, str]
    workdir: str
    proxy: ProxyForward
    agent_dir: Path | None
    #: written into the sandbox before the agent starts (a scaffold's config, its wrapper)
    files: dict[str, bytes] = {}
    #: a scaffold's records to keep: artifact name -> path in the sandbox
    artifacts: dict[str, str] = {}


def _turn_launch(job: SandboxJob, task: Task, plan: _Plan, home: str) -> tuple[list[str], dict[str, str],
                                                                              dict[str, bytes]]:
    """A multi-step turn's command, environment and files: a scaffold preset is launched again
    with the turn's instruction; a raw command is the same every turn (it reads ``task.json``)."""
    if job.task.agent.scaffold is None:
        return plan.command, plan.env, plan.files
    launch = scaffold_launch(msgspec.structs.replace(job, task=task), plan.workdir, home)
    env = agent_env(job, launch.env)
    local.validate_env(env)
    return launch.command, env, launch.files


async def agent_files(owner: AgentSpec | OpenEnvServer, cache: SourceCache, lease: Lease | None = None) -> Path | None:
    """The files mounted at ``/sandbox/agent``: the agent's own, or a hosted OpenEnv
    environment's directory; its bundle, or a host path where those are allowed; ``None``
    when it has none."""
    if owner.bundle:
        return await cache.bundle_tree(owner.bundle, lease)
    if owner.path:
        if not cache.allow_paths:
            raise SourceError("agent.path: host paths are not accepted here (ARENA_ALLOW_HOST_PATHS is off)")
        return Path(owner.path)
    return None


def _prepare(job: SandboxJob, staging: Path, tree: Path, agent_dir: Path | None,
             scaffold_home: str = "", prepared: tuple[Path, str] | None = None) -> tuple[_Plan, str, Path]:
    """The launch plan, the base sha and the workspace to copy in: ``prepared`` (the source's
    base repository, cached) or one committed now under ``staging``."""
    task = job.task
    forward = proxy_forward(job.proxy_url)
    if agent_dir is not None and not agent_dir.is_dir():
        raise ValueError(f"agent path {agent_dir} is not a directory")
    workdir = os.path.normpath(task.workdir)
    if os.path.isabs(workdir) or workdir.startswith(".."):
        raise ValueError(f"workdir {task.workdir!r} must be a path inside the repository")
    sandbox_workdir = os.path.normpath(os.path.join(local.WORKSPACE, workdir))
    if task.agent.scaffold is not None:  # a preset: its command, environment and files
        launch = scaffold_launch(job, sandbox_workdir, scaffold_home)
    elif task.agent.command:
        launch = scaffolds.Launch(command=list(task.agent.command))
    elif task.agent.external:  # an OpenEnv client drives it: no program (arena_sandbox.episode)
        launch = scaffolds.Launch(command=[])
    else:
        raise ValueError("the task's agent has an empty command")
    for path in launch.files:
        if not path.startswith(f"{local.ARENA_DIR}/") or ".." in path.split("/"):
            raise ValueError(f"scaffold file {path!r} is not under {local.ARENA_DIR}")
        if path in _CONTRACT_FILES:
            raise ValueError(f"scaffold file {path!r} is one of the sandbox contract's own")
    for path in launch.artifacts.values():  # read after the agent ran: no directory of its own in the way
        if os.path.dirname(path) != local.ARENA_DIR:
            raise ValueError(f"scaffold artifact {path!r} is not directly in {local.ARENA_DIR}")
    env = agent_env(job, launch.env)
    local.validate_env(env)
    if prepared is not None:
        workspace, base = prepared
    else:
        staging.mkdir(parents=True)
        workspace = staging / "workspace"
        base = local.prepare_workspace(tree, workspace)
    if not (workspace / workdir).is_dir():
        raise ValueError(f"workdir {task.workdir!r} is not a directory of the repository")
    plan = _Plan(
        command=launch.command, env=env, workdir=sandbox_workdir, proxy=forward, agent_dir=agent_dir,
        files=launch.files, artifacts=launch.artifacts,
    )
    return plan, base, workspace
