"""The quickstart example end to end, without the bus: the example agent asks the real
scripted LLM server for a fix, applies it, and the verification runner grades the diff."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import uvicorn

from arena_stack.scripted_llm import ScriptedLLM, create_app, load_script
from arena_core.schemas import VerifyJob
from arena.tasks import load_task
from arena_sandbox_providers import local
from arena_verification.runner import verify

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no sandbox: {local.available()}")

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"
AGENT = QUICKSTART / "agent" / "agent.py"


class ScriptedServer:
    """The scripted LLM's real HTTP app under uvicorn, in a thread, on a free port."""

    def __init__(self, llm: ScriptedLLM):
        app = create_app(llm)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    access_log=False, lifespan="off"))
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            threading.Event().wait(0.025)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def only(label: str, tmp_path: Path) -> Path:
    """The example's script reduced to one of its answers."""
    script = json.loads((QUICKSTART / "llm_script.json").read_text())
    script["responses"] = [r for r in script["responses"] if r["label"] == label]
    path = tmp_path / f"{label}.json"
    path.write_text(json.dumps(script))
    return path


def sandbox_root(tmp_path: Path, task) -> Path:
    root = tmp_path / "sandbox"
    local.prepare_workspace(Path(task.repo), root / "workspace")
    (root / ".arena").mkdir()
    envelope = {"rollout_id": "r1", "task": json.loads((QUICKSTART / "task.json").read_text())}
    (root / ".arena" / "task.json").write_text(json.dumps(envelope))
    return root


async def run_agent(root: Path, base_url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ARENA_SANDBOX_ROOT": str(root), "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "k-test",
           "HOME": str(root)}
    return await asyncio.to_thread(subprocess.run, [sys.executable, str(AGENT)], env=env, capture_output=True,
                                   text=True, timeout=60)


@pytest.mark.parametrize("label,reward", [("correct", 1.0)])  # wrong diffs: test_verification_hacks.py
async def test_agent_fix_is_graded(tmp_path, label, reward):
    task = load_task(QUICKSTART)
    root = sandbox_root(tmp_path, task)
    with ScriptedServer(ScriptedLLM(load_script(only(label, tmp_path)))) as base_url:
        proc = await run_agent(root, base_url)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((root / ".arena" / "result.json").read_text()) == {"applied": True, "error": None}
    assert (root / ".arena" / "done").exists()

    diff = await local.git_diff(root / "workspace")
    assert diff.startswith("diff --git a/textstats/core.py b/textstats/core.py")
    result = await verify(VerifyJob(rollout_id="r1", task=task, diff=diff))
    assert (result.reward, result.flags) == (reward, [])


async def test_agent_sends_the_task_and_files(tmp_path):
    task = load_task(QUICKSTART)
    root = sandbox_root(tmp_path, task)
    seen: list[dict] = []
    script = load_script(only("correct", tmp_path))

    class Recording(ScriptedLLM):
        def complete(self, body):
            seen.append(body)
            return super().complete(body)

    with ScriptedServer(Recording(script)) as base_url:
        proc = await run_agent(root, base_url)
    assert proc.returncode == 0, proc.stderr
    [body] = seen
    assert body["model"] == "default" and body["max_tokens"] == 1024
    system, user = body["messages"]
    assert system["role"] == "system" and "```diff" in system["content"]
    assert user["content"].startswith(task.instructions)
    for rel in ("textstats/core.py", "textstats/__init__.py", "tests/test_textstats.py"):
        assert f"--- {rel} ---" in user["content"]
    # The whole prompt fits the task's token budget with the byte tokenizer.
    assert sum(len(m["content"].encode()) for m in body["messages"]) + 1024 < task.budget.max_total_tokens


async def test_agent_without_llm_exits_1_and_never_signals_done(tmp_path):
    task = load_task(QUICKSTART)
    root = sandbox_root(tmp_path, task)
    proc = await run_agent(root, "http://127.0.0.1:9/v1")  # discard port: nothing listens
    assert proc.returncode == 1
    assert "LLM call failed" in proc.stderr
    assert not (root / ".arena" / "done").exists()
    assert not (root / ".arena" / "result.json").exists()


async def test_answer_without_a_diff_is_reported_not_applied(tmp_path):
    task = load_task(QUICKSTART)
    root = sandbox_root(tmp_path, task)
    script = tmp_path / "chatty.json"
    script.write_text(json.dumps({"responses": [{"label": "chatty", "weight": 1, "content": "I would rather not."}]}))
    with ScriptedServer(ScriptedLLM(load_script(script))) as base_url:
        proc = await run_agent(root, base_url)
    assert proc.returncode == 0
    result = json.loads((root / ".arena" / "result.json").read_text())
    assert result["applied"] is False and "no ```diff block" in result["error"]
    assert (root / ".arena" / "done").exists()
