"""One sandbox job, start to finish, without the bus.

``run_job`` prepares ``{data_dir}/sandboxes/{sandbox_id}/`` (``workspace/``: the task
repository committed as the base; ``arena/``: ``task.json``), runs the agent in a
local sandbox under the sandbox contract, decides the outcome, reads the optional
``result.json``, extracts the final diff (except for a cancelled sandbox) and always
removes the directory. The small
functions it is made of are pure and unit-tested on their own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from arena.schemas import SandboxDone, SandboxJob, SandboxOutcome, Task
from arena_sandbox import local
from arena_sandbox.local import ProxyForward, ResourceLimits, RunResult, SandboxSpec

log = logging.getLogger("arena.sandbox.runner")

PROVIDER = "local"
_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class RunnerConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of the job runner (defaults suit the embedded stack)."""

    log_tail_lines: int = 40
    log_tail_chars: int = 4000
    #: The full log kept for the artifact store; a longer log keeps its last bytes.
    max_log_bytes: int = 16 * 1024 * 1024
    max_result_bytes: int = 1024 * 1024
    diff_timeout_s: float = 120.0
    limits: ResourceLimits = ResourceLimits()


class JobRun(msgspec.Struct, frozen=True, kw_only=True):
    """What a job ended with: the message to publish and the agent's full log."""

    done: SandboxDone
    log: bytes
    run: RunResult | None = None  # None if the sandbox never started


class TaskFile(msgspec.Struct, frozen=True, kw_only=True):
    """``/sandbox/.arena/task.json``."""

    rollout_id: str
    task: Task


# --------------------------------------------------------------------------- pure pieces


def new_sandbox_id(rollout_id: str) -> str:
    return f"{rollout_id}-{uuid.uuid4().hex[:8]}"


def proxy_forward(proxy_url: str) -> ProxyForward:
    """The proxy's host:port on the host, from the job's ``proxy_url``."""
    url = urlsplit(proxy_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"proxy_url {proxy_url!r} is not an http(s) URL")
    port = url.port or (443 if url.scheme == "https" else 80)
    return ProxyForward(host=url.hostname, port=port)


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


def agent_env(job: SandboxJob) -> dict[str, str]:
    """The sandbox contract's environment, then the task's own ``agent.env``."""
    base_url = sandbox_proxy_url(job.proxy_url)
    env = {
        "OPENAI_BASE_URL": base_url,
        "OPENAI_API_KEY": job.api_key,
        "ANTHROPIC_BASE_URL": anthropic_base_url(base_url),
        "ANTHROPIC_API_KEY": job.api_key,
        "ARENA_ROLLOUT_ID": job.rollout_id,
    }
    env.update(job.task.agent.env)
    return env


def task_json(job: SandboxJob) -> bytes:
    return msgspec.json.encode(TaskFile(rollout_id=job.rollout_id, task=job.task))


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


def decide_outcome(run: RunResult, *, done: bool, tail: str) -> tuple[SandboxOutcome, str]:
    """The outcome and its reason.

    A cancel (Arena killed it, not for the wall clock) wins; otherwise writing ``done`` means completed, even if the agent then
    exited non-zero or ran out of time (its workspace is final either way, and
    verification judges it); then the timeout; anything else is a failure.
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
        return SandboxOutcome.TIMED_OUT, f"wall clock of {run.duration_s:.0f}s exceeded"
    reason = f"agent exited with code {run.exit_code} without writing /sandbox/.arena/done"
    if tail:
        reason += "; last output:\n" + tail
    return SandboxOutcome.FAILED, reason


def _read_log(path: Path, max_bytes: int) -> bytes:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return b""
    with open(path, "rb") as fh:
        if size > max_bytes:
            fh.seek(size - max_bytes)
            return b"[arena: log truncated to its last %d bytes]\n" % max_bytes + fh.read()
        return fh.read()


# --------------------------------------------------------------------------- the job


async def run_job(
    job: SandboxJob,
    *,
    data_dir: Path,
    config: RunnerConfig = RunnerConfig(),
    sandbox_id: str | None = None,
    cancel: asyncio.Event | None = None,
) -> JobRun:
    """Run ``job`` in a fresh local sandbox; never raises for a problem of the job itself
    (a missing repository, a broken workspace): that is a ``SandboxDone`` with outcome
    ``error``."""
    sandbox_id = sandbox_id or new_sandbox_id(job.rollout_id)
    root = Path(data_dir) / "sandboxes" / sandbox_id
    extra = {"rollout_id": job.rollout_id, "sandbox_id": sandbox_id}
    started_at = time.time()

    def finish(outcome: SandboxOutcome, reason: str, **fields: Any) -> SandboxDone:
        return SandboxDone(
            rollout_id=job.rollout_id,
            sandbox_id=sandbox_id,
            provider=PROVIDER,
            outcome=outcome,
            reason=reason,
            started_at=started_at,
            finished_at=time.time(),
            **fields,
        )

    try:
        try:
            spec, base = await asyncio.to_thread(_prepare, job, root, config)  # copy + git: off the loop
        except (OSError, ValueError, local.GitError) as exc:
            log.warning("cannot prepare the sandbox: %s", exc, extra=extra)
            return JobRun(done=finish(SandboxOutcome.ERROR, f"cannot prepare the sandbox: {exc}"), log=b"")
        log.info("sandbox starting", extra=extra)
        run = await local.run(spec, cancel=cancel)
        full_log = _read_log(root / "agent.log", config.max_log_bytes)
        tail = log_tail(full_log, lines=config.log_tail_lines, max_chars=config.log_tail_chars)
        outcome, reason = decide_outcome(run, done=done_written(root / "arena"), tail=tail)
        result, note = read_result(root / "arena", max_bytes=config.max_result_bytes)
        if note:
            reason = f"{reason}; {note}"
        diff = ""
        if outcome is not SandboxOutcome.CANCELLED:
            # Failed and timed-out rollouts keep their diff too (analytics); only a
            # completed one needs it, so only there is a broken diff an error.
            try:
                diff = await local.git_diff(root / "workspace", base, timeout_s=config.diff_timeout_s)
            except local.GitError as exc:
                if outcome is SandboxOutcome.COMPLETED:
                    outcome, reason = SandboxOutcome.ERROR, f"cannot extract the diff: {exc}"
                else:
                    reason = f"{reason}; no diff: {exc}"
        log.info("sandbox finished: %s", outcome.value, extra=extra)
        done = finish(outcome, reason, exit_code=run.exit_code, diff=diff, result=result, log_tail=tail)
        return JobRun(done=done, log=full_log, run=run)
    finally:
        await asyncio.to_thread(shutil.rmtree, root, True)


def _prepare(job: SandboxJob, root: Path, config: RunnerConfig) -> tuple[SandboxSpec, str]:
    task = job.task
    forward = proxy_forward(job.proxy_url)
    agent_dir = Path(task.agent.path) if task.agent.path else None
    if agent_dir is not None and not agent_dir.is_dir():
        raise ValueError(f"agent path {agent_dir} is not a directory")
    if not task.agent.command:
        raise ValueError("the task's agent has an empty command")
    workdir = os.path.normpath(task.workdir)
    if os.path.isabs(workdir) or workdir.startswith(".."):
        raise ValueError(f"workdir {task.workdir!r} must be a path inside the repository")
    env = agent_env(job)
    local.validate_env(env)
    root.mkdir(parents=True)
    base = local.prepare_workspace(Path(task.repo), root / "workspace")
    if not (root / "workspace" / workdir).is_dir():
        raise ValueError(f"workdir {task.workdir!r} is not a directory of the repository")
    (root / "arena").mkdir()
    (root / "arena" / "task.json").write_bytes(task_json(job))
    spec = SandboxSpec(
        command=list(task.agent.command),
        workspace=root / "workspace",
        arena_dir=root / "arena",
        agent_dir=agent_dir,
        env=env,
        timeout_s=task.budget.wall_clock_s,
        proxy=forward,
        log_path=root / "agent.log",
        workdir=workdir,
        limits=config.limits,
    )
    return spec, base
