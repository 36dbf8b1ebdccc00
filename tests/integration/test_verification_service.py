"""``python -m arena_verification`` as a process: verifies a job, stops cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from arena import subjects
from arena.schemas import VerificationResult, VerifyJob
from arena.tasks import load_task
from arena_sandbox import local

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no sandbox: {local.available()}")

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


async def test_service_process_verifies_and_exits_0_on_sigterm(bus, nats_server, tmp_path):
    env = {**os.environ, "ARENA_NATS_URL": nats_server.url, "ARENA_DATA_DIR": str(tmp_path / "data"),
           "ARENA_VERIFY_CONCURRENCY": "1"}
    log = open(tmp_path / "service.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "arena_verification"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        script = json.loads((QUICKSTART / "llm_script.json").read_text())
        diff = script["responses"][0]["content"].split("```diff\n", 1)[1].split("```", 1)[0]
        job = VerifyJob(rollout_id="svc", task=load_task(QUICKSTART), diff=diff)
        await bus.publish(subjects.VERIFY_RUN, job, msg_id=subjects.msg_id("svc", "verify-job"))
        sub = await bus.js.pull_subscribe(subjects.verify_done("svc"), durable="svc-test", stream="ARENA_RESULTS")
        result = None
        for _ in range(60):
            try:
                [msg] = await sub.fetch(batch=1, timeout=0.5)
            except Exception:  # noqa: BLE001 - fetch timeout: not yet
                continue
            result = msgspec.json.decode(msg.data, type=VerificationResult)
            break
        assert result is not None, (tmp_path / "service.log").read_text()
        assert (result.rollout_id, result.reward) == ("svc", 1.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(proc.wait, 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        log.close()
    assert code == 0, (tmp_path / "service.log").read_text()
    lines = [json.loads(line) for line in (tmp_path / "service.log").read_text().splitlines() if line.startswith("{")]
    assert any(line.get("rollout_id") == "svc" and line["msg"].startswith("verified: reward=1.00") for line in lines)
    assert lines[-1]["msg"] == "verification service stopped"
