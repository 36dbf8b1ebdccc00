"""Backends for duels in tests: the quickstart's scripted LLM narrowed to one answer, started as a
process of its own, and registered in ``arena_backends`` under a model name. Used by
tests/e2e/test_duels.py and tests/dashboard/test_dashboard_browser.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec

from arena_core import subjects
from arena_core.bus import Bus
from arena_core.schemas import BackendReplica
from arena_stack.natsserver import wait_port

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart"


def script(tmp_path: Path, label: str) -> Path:
    """The quickstart script with only its ``label`` answer (``correct``, ``wrong``): every seed gets it."""
    whole = json.loads((QUICKSTART / "llm_script.json").read_text())
    path = tmp_path / f"{label}.json"
    path.write_text(json.dumps({"responses": [r for r in whole["responses"] if r["label"] == label]}))
    return path


def start_scripted_llm(script_path: Path, port: int, log_path: Path) -> subprocess.Popen:
    """``python -m arena_stack.scripted_llm`` on ``port``, answering from ``script_path``; returns once
    it listens. The caller stops it (``stop``)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "arena_stack.scripted_llm", "--script", str(script_path),
                                 "--port", str(port)], stdout=log, stderr=log)
    try:
        wait_port("127.0.0.1", port, 30, proc)
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: subprocess.Popen | None) -> None:
    """Terminate one child by its PID and reap it."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def replica(replica_id: str, url: str, *models: str, policy_version: str = "0") -> BackendReplica:
    """A replica serving only ``models`` (none: any model name)."""
    return BackendReplica(replica_id=replica_id, url=url, models=list(models), policy_version=policy_version)


async def register(nats_url: str, *replicas: BackendReplica) -> None:
    """Put the replicas in ``arena_backends``; the rollout service follows the bucket."""
    bus = await Bus.connect(nats_url, "test-duel-backends")
    try:
        kv = await bus.kv(subjects.KV_BACKENDS)
        for r in replicas:
            await kv.put(r.replica_id, msgspec.json.encode(r))
    finally:
        await bus.close()


async def unregister(nats_url: str, *replica_ids: str) -> None:
    """Delete the replicas from ``arena_backends`` (``default`` falls back to ``ARENA_BACKEND_URL``)."""
    bus = await Bus.connect(nats_url, "test-duel-backends")
    try:
        kv = await bus.kv(subjects.KV_BACKENDS)
        for replica_id in replica_ids:
            await kv.delete(replica_id)
    finally:
        await bus.close()
