"""The Terminus-2 preset: its command, environment, files and artifacts, and its driver's completion
rule, run in a bubblewrap sandbox against a stand-in ``harbor`` package whose Terminus2 drives a real
tmux session through the driver's local environment and writes the records the real one writes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch, preset, terminus2
from arena_core.schemas import AgentSpec, ScaffoldSpec
from arena_sandbox_providers import local

KEY = "ak-rollout-secret"
CONTEXT = Context(instructions="Fix `median` in textstats/core.py.\n\"quotes\" and $HOME stay.",
                  openai_base_url="http://127.0.0.1:9090/proxy/r1/v1", anthropic_base_url="http://127.0.0.1:9090/proxy/r1",
                  api_key=KEY, workdir="/sandbox/workspace/pkg", home="/opt/scaffolds/terminus-2")


def launch(context: Context = CONTEXT, **config) -> Launch:
    return preset(AgentSpec(scaffold=ScaffoldSpec(name="terminus-2", model="qwen-7b", config=config)), context)


def test_the_preset_runs_its_driver_with_the_scaffolds_python_against_the_proxy():
    out = launch()
    assert out.command == ["/opt/scaffolds/terminus-2/bin/python", terminus2.DRIVER, terminus2.CONFIG]
    # the docker provider names no installation (home ""): arena/terminus-2 holds it in /opt/terminus-2
    assert launch(msgspec.structs.replace(CONTEXT, home="")).command[0] == "/opt/terminus-2/bin/python"
    assert set(out.files) == {terminus2.DRIVER, terminus2.CONFIG}
    assert all(path.startswith(f"{SCAFFOLD_DIR}/") for path in out.files)
    assert out.artifacts == {"terminus-2.trajectory.json": "/sandbox/.arena/terminus-2.trajectory.json",
                             "terminus-2.rollout-details.json": "/sandbox/.arena/terminus-2.rollout-details.json"}
    assert out.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True" and out.env["HF_HUB_OFFLINE"] == "1"
    config = json.loads(out.files[terminus2.CONFIG])
    assert config["instruction"] == CONTEXT.instructions and config["workdir"] == "/sandbox/workspace/pkg"
    agent = config["agent"]
    assert agent["model_name"] == "openai/qwen-7b" and agent["api_base"] == CONTEXT.openai_base_url
    assert agent["parser_name"] == "json" and agent["collect_rollout_details"] is True
    assert agent["record_terminal_session"] is False
    assert agent["model_info"]["input_cost_per_token"] == 0.0
    everything = json.dumps([out.command, out.env]) + b"".join(out.files.values()).decode()
    assert KEY not in everything  # litellm reads it from OPENAI_API_KEY


def test_config_sets_terminus2_options_and_refuses_unknown_keys():
    agent = json.loads(launch(max_turns=30, parser_name="xml", collect_rollout_details=False,
                              model_info={"max_input_tokens": 32768}).files[terminus2.CONFIG])["agent"]
    assert agent["max_turns"] == 30 and agent["parser_name"] == "xml" and agent["collect_rollout_details"] is False
    assert agent["model_info"] == {"max_input_tokens": 32768}
    with pytest.raises(ValueError, match="unknown config keys \\['api_base', 'logs_dir'\\]"):
        launch(api_base="http://elsewhere/v1", logs_dir="/x")


# A stand-in harbor: the public names the driver imports. Its Terminus2 starts tmux through the
# environment (as the real TmuxSession does), types a command, reads the pane, and writes an ATIF
# trajectory whose agent steps carry mark_task_complete per FAKE_MODE.
FAKE_HARBOR = {
    "harbor/__init__.py": "",
    "harbor/agents/__init__.py": "",
    "harbor/agents/terminus_2/__init__.py": '''\
import json, os
from pathlib import Path

class Terminus2:
    def __init__(self, logs_dir, **kwargs):
        self.logs_dir, self.kwargs = Path(logs_dir), kwargs

    async def setup(self, environment):
        self.env = environment
        r = await environment.exec("tmux new-session -x 80 -y 20 -d -s terminus-2 'bash --login'")
        assert r.return_code == 0, r.stderr

    async def run(self, instruction, environment, context):
        mode = os.environ["FAKE_MODE"]
        if mode == "crash":
            raise RuntimeError("the LLM call failed")
        await self.env.exec("tmux send-keys -t terminus-2 -- 'echo pwd-is-$(pwd)' Enter")
        await self.env.exec("sleep 0.5")
        pane = (await self.env.exec("tmux capture-pane -p -t terminus-2")).stdout
        marks = {"confirmed": [False, True, True], "unconfirmed": [False, False, True],
                 "max-turns": [True, False]}[mode]
        steps = [{"step_id": 1, "source": "user", "message": instruction}]
        for i, mark in enumerate(marks):
            calls = [{"tool_call_id": f"call_{i}_1", "function_name": "bash_command", "arguments": {}}]
            calls += [{"tool_call_id": f"call_{i}_task_complete", "function_name": "mark_task_complete",
                       "arguments": {}}] if mark else []
            steps.append({"step_id": i + 2, "source": "agent", "tool_calls": calls,
                          "observation": {"results": [{"content": pane}]}})
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        (self.logs_dir / "trajectory.json").write_text(json.dumps({"schema_version": "ATIF-v1.7", "steps": steps,
                                                                   "kwargs": self.kwargs}))
        context.rollout_details = [{"completion_token_ids": [[1, 2]], "logprobs": [[-0.5, -0.1]]}]
        context.metadata = {"n_episodes": len(marks)}
        context.n_input_tokens, context.n_output_tokens = 100, 20
''',
    "harbor/environments/__init__.py": "",
    "harbor/environments/base.py": '''\
class ExecResult:
    def __init__(self, stdout=None, stderr=None, return_code=0):
        self.stdout, self.stderr, self.return_code = stdout, stderr, return_code

class BaseEnvironment:
    def __init__(self, environment_dir, environment_name, session_id, trial_paths, task_env_config, **kw):
        self.trial_paths, self.default_user = trial_paths, None
''',
    "harbor/models/__init__.py": "",
    "harbor/models/agent/__init__.py": "",
    "harbor/models/agent/context.py": '''\
class AgentContext:
    rollout_details = None
    metadata = None
    n_input_tokens = n_output_tokens = None
''',
    "harbor/models/task/__init__.py": "",
    "harbor/models/task/config.py": "class EnvironmentConfig:\n    pass\n",
    "harbor/models/trial/__init__.py": "",
    "harbor/models/trial/paths.py": '''\
from pathlib import Path
class TrialPaths:
    def __init__(self, trial_dir):
        self.agent_dir = Path(trial_dir) / "agent"
''',
}


def run_driver(tmp_path: Path, mode: str) -> tuple[int | None, Path, str]:
    """The preset's launch in a bubblewrap sandbox, harbor replaced by the stand-in."""
    if local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed")
    out = launch(CONTEXT)
    command = ["python3", *out.command[1:]]  # the host's Python, harbor being the stand-in below
    workspace, arena, agent = tmp_path / "workspace", tmp_path / "arena", tmp_path / "agent"
    (workspace / "pkg").mkdir(parents=True)
    for path, data in out.files.items():
        host = arena / os.path.relpath(path, "/sandbox/.arena")
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)
    for name, text in FAKE_HARBOR.items():
        (agent / name).parent.mkdir(parents=True, exist_ok=True)
        (agent / name).write_text(text)
    log = tmp_path / "log"
    result = asyncio.run(local.run(local.SandboxSpec(
        command=command, workspace=workspace, arena_dir=arena, agent_dir=agent, log_path=log, timeout_s=60,
        workdir="pkg", env={**local._base_env(), **out.env, "PYTHONPATH": "/sandbox/agent", "FAKE_MODE": mode})))
    return result.exit_code, arena, log.read_text()


def test_the_driver_writes_done_when_terminus2_confirms_the_task_complete(tmp_path):
    code, arena, log = run_driver(tmp_path, "confirmed")
    assert code == 0 and (arena / "done").exists(), log
    assert json.loads((arena / "result.json").read_text()) == {
        "scaffold": "terminus-2", "task_complete": True, "error": None, "episodes": 3,
        "input_tokens": 100, "output_tokens": 20}
    trajectory = json.loads((arena / "terminus-2.trajectory.json").read_text())
    # tmux ran in the sandbox, in the working directory, through the driver's local environment
    assert "pwd-is-/sandbox/workspace/pkg" in trajectory["steps"][1]["observation"]["results"][0]["content"]
    assert trajectory["kwargs"]["model_name"] == "openai/qwen-7b"
    assert json.loads((arena / "terminus-2.rollout-details.json").read_text())[0]["completion_token_ids"] == [[1, 2]]


@pytest.mark.parametrize("mode", ["unconfirmed", "max-turns"])
def test_the_driver_is_not_done_without_a_confirmed_completion(tmp_path, mode):
    code, arena, log = run_driver(tmp_path, mode)
    assert code == 0 and not (arena / "done").exists()
    assert json.loads((arena / "result.json").read_text())["task_complete"] is False
    assert "did not confirm the task complete; not done" in log


def test_the_driver_is_not_done_when_terminus2_raises(tmp_path):
    code, arena, log = run_driver(tmp_path, "crash")
    assert code == 1 and not (arena / "done").exists()
    assert json.loads((arena / "result.json").read_text())["error"] == "RuntimeError: the LLM call failed"
    assert "terminus-2 raised RuntimeError" in log
