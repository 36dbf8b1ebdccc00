"""The attack: an agent that writes 150 MB of random bytes into its workspace. Its 203 MB
diff was stored whole (the trajectory service peaked at 2.2 GB, verification at 716 MB).
Now the diff is streamed and only its first ``ARENA_MAX_DIFF_BYTES`` (default 10 MiB) kept:
the rollout ends ``failed`` saying how large the diff was, those first bytes are the
artifact ``diff.truncated``, nothing of it travels on the bus, and the services' memory
stays flat, the largest allowed diff included (peak RSS measured on the real stack: the
trajectory, verification and rollout services each at most 3 times the cap over a warm-up)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import msgspec
import pytest
from nats.js.errors import NotFoundError

from arena_core import apikeys, subjects
from arena_core.bus import Bus
from arena_core.schemas import (AgentSpec, Budget, ExactVerifier, SandboxDone, SandboxJob, SandboxOutcome,
                                SubmitRolloutRequest, Task)
from arena_core.settings import Settings
from arena_sandbox import runner
from arena_sandbox_providers import local
from arena_sandbox_providers.testing import make_provider
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}")

MIB = 1024 * 1024
CAP = Settings().max_diff_bytes
RANDOM_150MB = (
    "import os\n"
    "with open('/sandbox/workspace/noise.bin', 'wb') as f:\n"
    "    for _ in range(150):\n"
    "        f.write(os.urandom(1000 * 1000))\n"
    "open('/sandbox/.arena/done', 'w').close()\n"
)
#: just under the limit: 8 MiB of text, a diff of ~8.2 MiB (the largest allowed outputs)
TEXT_8MIB = (
    "import base64, os\n"
    "with open('/sandbox/workspace/big.txt', 'w') as f:\n"
    "    for _ in range(8 * 1024 * 1024 // 77):\n"
    "        f.write(base64.b64encode(os.urandom(57)).decode() + '\\n')\n"
    "open('/sandbox/.arena/done', 'w').close()\n"
)


def task_of(repo: Path, code: str, name: str) -> Task:
    return Task(id=name, repo=str(repo), instructions="write", agent=AgentSpec(command=["python3", "-c", code]),
                verifier=ExactVerifier(answers=["42"]), budget=Budget(wall_clock_s=300))


def repo_in(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    (repo / "README").write_text("a repository\n")
    return repo


async def test_the_runner_fails_the_agent_and_keeps_the_first_bytes(tmp_path):
    job = SandboxJob(rollout_id="r1", task=task_of(repo_in(tmp_path), RANDOM_150MB, "noise"),
                     proxy_url="http://127.0.0.1:9/proxy/r1/v1", api_key="ak")
    out = await runner.run_job(job, data_dir=tmp_path / "data", provider=make_provider("local", tmp_path / "data"),
                               config=runner.RunnerConfig(diff_timeout_s=300))
    done = out.done
    assert done.outcome is SandboxOutcome.FAILED, done.reason
    assert done.reason.startswith("the agent's diff is ") and "over the 10.0 MiB limit (ARENA_MAX_DIFF_BYTES)" in done.reason
    size_mib = float(done.reason.removeprefix("the agent's diff is ").split(" MiB")[0])
    assert 170 < size_mib < 215  # 150 MB of random bytes, base85 in a binary diff (~193 MB)
    assert done.diff == ""
    head = out.artifacts[runner.DIFF_TRUNCATED]
    assert len(head) == CAP and head.startswith(b"diff --git a/noise.bin b/noise.bin")


def vm_peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


async def _done(stack: Stack, rollout_id: str) -> tuple[SandboxDone, bytes | None]:
    bus = await Bus.connect(stack.settings.nats_url, "test")
    try:
        msg = await bus.js.get_last_msg("ARENA_RESULTS", subjects.sandbox_done(rollout_id))
        done = msgspec.json.decode(await bus.body(msg), type=SandboxDone)  # a large one is in the object store
        artifact = None
        if "diff.truncated" in done.artifacts:
            store = await bus.artifacts()
            artifact = bytes((await store.get(done.artifacts["diff.truncated"])).data)
        return done, artifact
    finally:
        await bus.close()


async def _on_stream(stack: Stack, subject: str, timeout: float = 60.0) -> None:
    bus = await Bus.connect(stack.settings.nats_url, "test")
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            try:
                await bus.js.get_last_msg("ARENA_TRAJECTORIES", subject)
                return
            except NotFoundError:
                assert asyncio.get_running_loop().time() < deadline, f"nothing on {subject} after {timeout}s"
                await asyncio.sleep(0.05)
    finally:
        await bus.close()


def test_on_the_real_stack_the_rollout_fails_and_memory_stays_flat(tmp_path, capsys):
    rollout_port = free_port()
    settings = Settings(
        auth="keys", allow_host_paths=True, nats_url=f"nats://127.0.0.1:{free_port()}",
        data_dir=str(tmp_path / "arena"), rollout_port=rollout_port, trajectory_port=free_port(),
        dashboard_port=free_port(),
        public_url=f"http://127.0.0.1:{rollout_port}", backend_url=f"http://127.0.0.1:{free_port()}/v1",
        sandbox_provider="local", sandbox_owner=f"diff-{uuid.uuid4().hex[:8]}", sandbox_concurrency=2,
        verify_concurrency=1,
    )
    stack = Stack(settings, nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start(timeout=180))
    try:
        pids = {c.name: c.pid for c in stack.children if c.name in ("rollout", "sandbox", "trajectory", "verification")}
        headers = {"content-type": "application/json", **apikeys.auth_headers(stack.api_key)}
        repo = repo_in(tmp_path)

        def run(name: str, code: str) -> tuple[str, dict]:
            body = msgspec.json.encode(SubmitRolloutRequest(task=task_of(repo, code, name)))
            reply = httpx.post(f"{stack.settings.rollout_url}/v1/rollouts", content=body, headers=headers, timeout=30)
            assert reply.status_code == 201, reply.text
            rid = reply.json()["rollout_id"]
            reply = httpx.get(f"{stack.settings.rollout_url}/v1/rollouts/{rid}/wait", params={"timeout": 290},
                              headers=headers, timeout=300)
            # the trajectory service is done with the rollout once its trajectory is on the
            # trainer stream (stored, then published): only then are its peaks measured
            asyncio.run(_on_stream(stack, subjects.trajectory(name, rid)))
            return rid, reply.json()

        def peaks() -> dict[str, int]:
            return {name: vm_peak_rss(pid) for name, pid in pids.items()}

        # a small diff first: what any rollout costs the services (the first insert, the caches)
        _, view = run("warm-up", "open('/sandbox/workspace/a.txt', 'w').write('a\\n')\n"
                                 "open('/sandbox/.arena/done', 'w').close()\n")
        assert view["state"] == "completed", view
        figures = [("warm-up", peaks())]
        noise, view = run("noise", RANDOM_150MB)
        figures.append(("150 MB of random bytes", peaks()))
        assert view["state"] == "failed", view
        assert "over the 10.0 MiB limit (ARENA_MAX_DIFF_BYTES)" in view["reason"]
        largest, view = run("largest-allowed", TEXT_8MIB)
        figures.append(("an 8.2 MiB diff", peaks()))
        assert view["state"] == "completed", view  # verified (a reward of 0): the diff went everywhere
        done, artifact = asyncio.run(_done(stack, noise))
        assert done.diff == "" and artifact is not None and len(artifact) == CAP
        big, _ = asyncio.run(_done(stack, largest))
        assert 8 * MIB < len(big.diff) < CAP
        with capsys.disabled():
            print("\npeak RSS (VmHWM), MiB, after each rollout:")
            for label, peak in figures:
                print(f"  {label:<24} " + ", ".join(f"{n} {peak[n] / MIB:.0f}" for n in pids))
        (_, warm), (_, after_noise), (_, after_largest) = figures
        for name in ("sandbox", "trajectory", "verification"):
            # the 150 MB agent: nothing of its diff beyond the cap is held anywhere
            assert after_noise[name] - warm[name] < 48 * MIB, (name, figures)
            # the largest allowed diff: a bounded cost, far from the 2.2 GB a 203 MB diff once took
            assert after_largest[name] - warm[name] < 256 * MIB, (name, figures)
        for name in ("trajectory", "verification", "rollout"):
            # and flat: at most 3 times the largest allowed diff over a warm service (an 8.2 MiB
            # diff measured +13 to +21 MiB in the trajectory service, +26 to +27 in verification,
            # +12 to +13 in the rollout service; +81 (measured before the trajectory was even
            # published), +46 and +26 before the large diff went to the object store and the
            # bodies were read without copies: docs/trajectory.md, Large diffs)
            # verification decodes its VerifyJob whole (body, msgspec's buffer, the diff: ~3x the
            # diff), so its bound has a margin over its measured +27 MiB that allocator noise needs
            bound = 4 * CAP if name == "verification" else 3 * CAP
            assert after_largest[name] - warm[name] < bound, (name, figures)
    finally:
        stack.stop()
