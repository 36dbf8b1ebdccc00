"""The sandbox worker against a real nats-server and real bubblewrap sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import msgspec
import pytest
from nats.js.errors import NotFoundError

from arena_core import subjects
from arena_core.schemas import (
    AgentSpec,
    Budget,
    RolloutRecord,
    RolloutState,
    RolloutStateChanged,
    SamplingParams,
    SandboxDone,
    SandboxJob,
    SandboxOutcome,
    SandboxStarted,
    Task,
    TestsVerifier,
    VerifyJob,
)
from arena_core.settings import Settings
from arena_sandbox_providers import local
from arena_sandbox_providers.local_provider import LocalProvider, LocalSandbox
from arena_sandbox.pool import WarmPool
from arena_sandbox_providers.provider import CreateSpec
from arena_sandbox.runner import RunnerConfig
from arena_sandbox.worker import SandboxWorker

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}")

def make_job(tmp_path: Path, agent_code: str, *, repo: Path | None = None) -> SandboxJob:
    if repo is None:
        repo = tmp_path / "repo"
        (repo / "src").mkdir(parents=True)
        (repo / "src" / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "agent.py").write_text(agent_code)
    task = Task(
        id="calc", repo=str(repo), instructions="make add add", verifier=TestsVerifier(),
        agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(agent)),
        budget=Budget(wall_clock_s=30),
    )
    # Nothing listens on this port: these agents never call the LLM.
    return SandboxJob(rollout_id="r1", task=task, proxy_url="http://127.0.0.1:9/proxy/r1/v1", api_key="ak-test")


DONE_AGENT = """
open('src/calc.py', 'w').write('def add(a, b):\\n    return a + b\\n')
open('EXTRA.txt', 'w').write('untracked\\n')
print('agent says hi')
open('/sandbox/.arena/result.json', 'w').write('{"answer": "42"}')
open('/sandbox/.arena/done', 'w').close()
"""


async def _put_record(bus, job: SandboxJob, state: RolloutState) -> None:
    now = time.time()
    record = RolloutRecord(
        rollout_id=job.rollout_id, task=job.task, sampling=SamplingParams(), model="m", provider="local",
        api_key=job.api_key, state=state, created_at=now, updated_at=now,
    )
    kv = await bus.kv(subjects.KV_ROLLOUTS)
    await kv.put(job.rollout_id, msgspec.json.encode(record))


async def _last(bus, stream: str, subject: str, type_, timeout: float = 20.0, *, decode: bool = True):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = await bus.js.get_last_msg(stream, subject)
            return msgspec.json.decode(msg.data, type=type_) if decode else msg
        except NotFoundError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"nothing on {subject} within {timeout}s")


async def _absent(bus, stream: str, subject: str) -> bool:
    try:
        await bus.js.get_last_msg(stream, subject)
    except NotFoundError:
        return True
    return False


@contextlib.asynccontextmanager
async def running_worker(bus, tmp_path, *, provider: LocalProvider | None = None, concurrency: int = 2,
                         pool: WarmPool | None = None):
    settings = Settings(allow_host_paths=True, data_dir=str(tmp_path / "data"), sandbox_concurrency=concurrency)
    stop = asyncio.Event()
    provider = provider or LocalProvider(data_dir=tmp_path / "data", owner="w")
    worker = SandboxWorker(bus, settings, provider, pool=pool, stop=stop)
    task = asyncio.create_task(worker.consumer().run(stop))
    try:
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_job_runs_and_publishes_started_done_and_verify_job(bus, tmp_path):
    job = make_job(tmp_path, DONE_AGENT)
    await _put_record(bus, job, RolloutState.PROVISIONING)
    async with running_worker(bus, tmp_path):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        started = await _last(bus, "ARENA_RESULTS", subjects.sandbox_started("r1"), SandboxStarted)
        done = await _last(bus, "ARENA_RESULTS", subjects.sandbox_done("r1"), SandboxDone)
        verify = await _last(bus, "ARENA_VERIFY_JOBS", subjects.VERIFY_RUN, VerifyJob)
    assert started.sandbox_id == done.sandbox_id and started.provider == "local"
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason
    assert "+    return a + b" in done.diff and "b/EXTRA.txt\nnew file mode" in done.diff
    assert verify.rollout_id == "r1" and verify.diff == done.diff and verify.task == job.task
    assert done.result == verify.result == {"answer": "42"}  # answer verifiers need no lookup
    assert done.log_artifact == "r1/agent.log"
    artifact = await (await bus.artifacts()).get("r1/agent.log")
    assert b"agent says hi" in artifact.data
    info = await bus.js.stream_info("ARENA_SANDBOX_JOBS")
    assert info.state.messages == 0  # acked: the work queue is empty
    assert list((tmp_path / "data" / "sandboxes" / "w").iterdir()) == []


async def test_a_sandbox_waits_for_memory_before_it_starts(bus, tmp_path, monkeypatch):
    # the host short of its reserve: the job is taken but its sandbox does not start (nothing is
    # refused, nothing fails) until memory is free again
    from arena_core import capacity

    free = {"now": False}
    monkeypatch.setattr(capacity, "memory_free_for_sandboxes", lambda reserve_mb: free["now"])
    job = make_job(tmp_path, DONE_AGENT)
    await _put_record(bus, job, RolloutState.PROVISIONING)
    async with running_worker(bus, tmp_path):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        await asyncio.sleep(1.5)
        assert await _absent(bus, "ARENA_RESULTS", subjects.sandbox_started("r1"))
        assert list((tmp_path / "data" / "sandboxes").glob("w/*")) == []
        free["now"] = True
        done = await _last(bus, "ARENA_RESULTS", subjects.sandbox_done("r1"), SandboxDone)
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason


async def test_rollout_cancel_kills_the_sandbox(bus, tmp_path):
    job = make_job(tmp_path, "import time\nprint('sleeping', flush=True)\ntime.sleep(1000)\n")
    await _put_record(bus, job, RolloutState.PROVISIONING)
    async with running_worker(bus, tmp_path):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        await _last(bus, "ARENA_RESULTS", subjects.sandbox_started("r1"), SandboxStarted)
        await asyncio.sleep(0.5)
        change = RolloutStateChanged(rollout_id="r1", task_id="calc", from_state=RolloutState.RUNNING,
                                     to_state=RolloutState.CANCELLED, at=time.time(), reason="user")
        await bus.publish(subjects.rollout_state("r1"), change, msg_id=subjects.msg_id("r1", "state", 9))
        done = await _last(bus, "ARENA_RESULTS", subjects.sandbox_done("r1"), SandboxDone, timeout=10)
    assert done.outcome is SandboxOutcome.CANCELLED
    assert done.reason == "rollout became cancelled while the agent was running"
    assert await _absent(bus, "ARENA_VERIFY_JOBS", subjects.VERIFY_RUN)


async def test_job_of_a_final_rollout_is_skipped(bus, tmp_path):
    job = make_job(tmp_path, DONE_AGENT)
    await _put_record(bus, job, RolloutState.CANCELLED)
    async with running_worker(bus, tmp_path):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        deadline = time.monotonic() + 10
        while (await bus.js.stream_info("ARENA_SANDBOX_JOBS")).state.messages and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    assert (await bus.js.stream_info("ARENA_SANDBOX_JOBS")).state.messages == 0
    assert await _absent(bus, "ARENA_RESULTS", subjects.sandbox_started("r1"))
    assert await _absent(bus, "ARENA_RESULTS", subjects.sandbox_done("r1"))


async def test_missing_repo_publishes_an_error_outcome(bus, tmp_path):
    job = make_job(tmp_path, DONE_AGENT, repo=tmp_path / "gone")
    await _put_record(bus, job, RolloutState.PROVISIONING)
    async with running_worker(bus, tmp_path):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        done = await _last(bus, "ARENA_RESULTS", subjects.sandbox_done("r1"), SandboxDone)
    assert done.outcome is SandboxOutcome.ERROR and "gone" in done.reason
    assert await _absent(bus, "ARENA_VERIFY_JOBS", subjects.VERIFY_RUN)
    assert await _absent(bus, "ARENA_DEAD", "arena.dead.ARENA_SANDBOX_JOBS")


async def test_worker_shutdown_returns_the_running_job_to_the_queue(bus, tmp_path):
    job = make_job(tmp_path, "import time\ntime.sleep(1000)\n")
    await _put_record(bus, job, RolloutState.PROVISIONING)
    started_at = time.monotonic()
    async with running_worker(bus, tmp_path):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        await _last(bus, "ARENA_RESULTS", subjects.sandbox_started("r1"), SandboxStarted)
    assert time.monotonic() - started_at < 10  # the sleeping sandbox did not hold the shutdown
    assert await _absent(bus, "ARENA_RESULTS", subjects.sandbox_done("r1"))
    assert (await bus.js.stream_info("ARENA_SANDBOX_JOBS")).state.messages == 1  # redelivered later
    assert list((tmp_path / "data" / "sandboxes" / "w").iterdir()) == []


async def test_a_large_log_goes_to_the_object_store_whole(bus, tmp_path, nats_server):
    """9 MiB of output, more than a NATS message may carry (``max_payload``): the whole
    log is an artifact in the object store, the SandboxDone keeps only its tail."""
    assert nats_server.max_payload < 9 * 2**20
    code = ("import sys\n"
            "for i in range(9 * 1024):\n"
            "    sys.stdout.write(f'{i:08d} ' + 'x' * 1014 + '\\n')\n"  # 1 KiB a line
            "sys.exit(4)\n")
    job = make_job(tmp_path, code)
    async with running_worker(bus, tmp_path):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        msg = None
        deadline = time.monotonic() + 60
        while msg is None:
            assert time.monotonic() < deadline, "no SandboxDone"
            try:
                msg = await bus.js.get_last_msg("ARENA_RESULTS", subjects.sandbox_done("r1"))
            except NotFoundError:
                await asyncio.sleep(0.1)
    done = msgspec.json.decode(msg.data, type=SandboxDone)
    assert done.outcome is SandboxOutcome.FAILED and done.exit_code == 4
    assert len(msg.data) < 16 * 1024  # the message carries a tail, not the log
    assert done.log_tail.endswith("x" * 100) and "00009215 " in done.log_tail
    artifact = await (await bus.artifacts()).get(done.log_artifact)
    lines = artifact.data.split(b"\n")
    assert len(artifact.data) == 9 * 2**20 and lines[0].startswith(b"00000000 ") and lines[-2].startswith(b"00009215 ")


class CountingProvider(LocalProvider):
    """A local provider that counts its live sandboxes (the peak is the worker's concurrency)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.live = self.peak = self.created = 0

    async def create(self, spec: CreateSpec) -> LocalSandbox:
        sandbox = await super().create(spec)
        self.created += 1
        self.live += 1
        self.peak = max(self.peak, self.live)
        destroy = sandbox.destroy

        async def counted() -> None:
            if not sandbox._destroyed:
                self.live -= 1
            await destroy()

        sandbox.destroy = counted  # type: ignore[method-assign]
        return sandbox


class GatedDestroyProvider(LocalProvider):
    """A local provider whose sandboxes' destroy waits for ``gate``."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gate = asyncio.Event()

    async def create(self, spec: CreateSpec) -> LocalSandbox:
        sandbox = await super().create(spec)
        destroy = sandbox.destroy

        async def gated() -> None:
            await self.gate.wait()
            await destroy()

        sandbox.destroy = gated  # type: ignore[method-assign]
        return sandbox


async def test_the_result_goes_out_before_the_sandbox_is_destroyed(bus, tmp_path):
    """SandboxDone and the verify job are published first; the sandbox is destroyed after, within
    the job (acked only then)."""
    job = make_job(tmp_path, DONE_AGENT)
    await _put_record(bus, job, RolloutState.PROVISIONING)
    provider = GatedDestroyProvider(data_dir=tmp_path / "data", owner="w")
    async with running_worker(bus, tmp_path, provider=provider):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        done = await _last(bus, "ARENA_RESULTS", subjects.sandbox_done("r1"), SandboxDone)
        verify = await _last(bus, "ARENA_VERIFY_JOBS", subjects.VERIFY_RUN, VerifyJob)
        assert done.outcome is SandboxOutcome.COMPLETED and verify.rollout_id == "r1"
        assert len(list(provider.base.iterdir())) == 1  # still there: its destroy waits for the gate
        provider.gate.set()
    assert list(provider.base.iterdir()) == []
    assert (await bus.js.stream_info("ARENA_SANDBOX_JOBS")).state.messages == 0


async def test_workers_share_the_queue_each_within_its_concurrency(bus, tmp_path):
    """Two workers (two processes' worth: own providers and owners) on one durable
    consumer: every job runs exactly once, both take jobs, neither runs more sandboxes
    at a time than its ARENA_SANDBOX_CONCURRENCY."""
    code = "import time\ntime.sleep(1.0)\nopen('/sandbox/.arena/done', 'w')\n"
    base = make_job(tmp_path, code)
    first = CountingProvider(data_dir=tmp_path / "data", owner="w1")
    second = CountingProvider(data_dir=tmp_path / "data", owner="w2")
    rids = [f"r{i}" for i in range(8)]
    async with running_worker(bus, tmp_path, provider=first, concurrency=2), \
            running_worker(bus, tmp_path, provider=second, concurrency=1):
        for rid in rids:
            await bus.publish(subjects.sandbox_run("local"), msgspec.structs.replace(base, rollout_id=rid),
                              msg_id=subjects.msg_id(rid, "sandbox-job"))
        dones = [await _last(bus, "ARENA_RESULTS", subjects.sandbox_done(rid), SandboxDone, timeout=90)
                 for rid in rids]
    assert [d.outcome for d in dones] == [SandboxOutcome.COMPLETED] * len(rids)
    assert first.created + second.created == len(rids)  # each job ran once
    assert first.created >= 1 and second.created >= 1
    assert first.peak == 2 and second.peak == 1
    assert first.live == second.live == 0
    assert (await bus.js.stream_info("ARENA_SANDBOX_JOBS")).state.messages == 0


async def test_worker_runs_jobs_in_warm_sandboxes(bus, tmp_path):
    provider = LocalProvider(data_dir=tmp_path / "data", owner="w")
    pool = WarmPool(provider, size=1)
    spec = CreateSpec(limits=RunnerConfig().sandbox_limits)
    await pool.prefill(spec)
    warm = {p.name for p in provider.base.iterdir()}
    assert len(warm) == 1
    job = make_job(tmp_path, DONE_AGENT)
    try:
        async with running_worker(bus, tmp_path, provider=provider, pool=pool):
            await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
            done = await _last(bus, "ARENA_RESULTS", subjects.sandbox_done("r1"), SandboxDone)
            deadline = time.monotonic() + 30
            while pool.idle(spec) < 1:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert done.outcome is SandboxOutcome.COMPLETED, done.reason
        left = {p.name for p in provider.base.iterdir()}
        assert len(left) == 1 and not left & warm  # the warm one ran the job and is gone; a new one waits
    finally:
        await pool.close()
    assert list(provider.base.iterdir()) == []


async def test_a_diff_larger_than_a_message_is_delivered_whole(bus, tmp_path, nats_server):
    """An agent that leaves more data in the workspace than a NATS message may carry:
    SandboxDone and VerifyJob still reach their readers whole (the bus puts such a body
    in the object store, ``Bus.body`` reads it back), instead of a job that fails to
    publish, runs the agent again and is dead-lettered. 7 MiB of random bytes make a diff of
    about 9 MiB: over the 8 MiB message, under the 10 MiB diff cap (``ARENA_MAX_DIFF_BYTES``)."""
    code = ("import os\n"
            "open('blob.bin', 'wb').write(os.urandom(7 * 2**20))\n"
            "open('/sandbox/.arena/done', 'w')\n")
    job = make_job(tmp_path, code)
    async with running_worker(bus, tmp_path):
        await bus.publish(subjects.sandbox_run("local"), job, msg_id=subjects.msg_id("r1", "sandbox-job"))
        await _last(bus, "ARENA_VERIFY_JOBS", subjects.VERIFY_RUN, object, decode=False)
        done_msg = await bus.js.get_last_msg("ARENA_RESULTS", subjects.sandbox_done("r1"))
        verify_msg = await bus.js.get_last_msg("ARENA_VERIFY_JOBS", subjects.VERIFY_RUN)
        done = msgspec.json.decode(await bus.body(done_msg), type=SandboxDone)
        verify = msgspec.json.decode(await bus.body(verify_msg), type=VerifyJob)
    assert done.outcome is SandboxOutcome.COMPLETED, done.reason
    assert "diff --git a/blob.bin b/blob.bin\nnew file mode" in done.diff and "GIT binary patch" in done.diff
    assert len(done.diff) > nats_server.max_payload and verify.diff == done.diff
    assert (await bus.js.stream_info("ARENA_SANDBOX_JOBS")).state.messages == 0  # acked once


async def test_the_providers_health_is_asked_once_for_jobs_arriving_together():
    """``CachedHealth``: one probe answers the jobs that wait for it, a healthy answer holds
    a while, an unhealthy one briefly (jobs of a broken provider never queue behind probes)."""
    from arena_sandbox.worker import CachedHealth

    class Slow:
        name = "slow"

        def __init__(self, answer):
            self.answer, self.probes = answer, 0

        async def health(self):
            self.probes += 1
            await asyncio.sleep(0.3)
            return self.answer

    for answer in (None, "the engine is down"):
        provider = Slow(answer)
        health = CachedHealth(provider, ttl_s=60, failure_ttl_s=60)
        started = asyncio.get_running_loop().time()
        got = await asyncio.gather(*(health.check() for _ in range(5)))
        assert got == [answer] * 5 and provider.probes == 1
        assert asyncio.get_running_loop().time() - started < 1.0  # one probe's time, not five
        assert await health.check() == answer and provider.probes == 1
