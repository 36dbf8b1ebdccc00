"""Scaffold presets: the registry, the schema's rule (a command or a scaffold), the mini-swe-agent
preset, and how the runner turns a preset into the sandbox's command, environment and files."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import msgspec
import pytest
import yaml

from arena_core import scaffolds
from arena_core.bodies import decode_body
from arena_core.errors import InvalidRequest
from arena_core.scaffolds import mini_swe_agent
from arena_core.schemas import AgentSpec, SandboxJob, ScaffoldName, ScaffoldSpec, SubmitRolloutRequest, Task
from arena_sandbox import runner
from arena_sandbox_providers import local
from arena_sandbox_providers.local_provider import LocalProvider

MINI = ScaffoldSpec(name="mini-swe-agent", model="qwen-coder")
CONTEXT = scaffolds.Context(instructions="Fix median.\nIt's wrong: \"quotes\" and $HOME stay as they are.",
                            openai_base_url="http://127.0.0.1:9090/proxy/r1/v1",
                            anthropic_base_url="http://127.0.0.1:9090/proxy/r1", api_key="ak-secret",
                            workdir="/sandbox/workspace/pkg", home="/opt/scaffolds/mini-swe-agent")


def body(agent: dict) -> bytes:
    task = {"id": "t", "instructions": "x", "repo": "/r", "agent": agent, "verifier": {"type": "exact", "answers": ["1"]}}
    return json.dumps({"task": task}).encode()


def test_the_registry_names_what_the_schema_accepts():
    assert set(typing.get_args(ScaffoldName)) == set(scaffolds.SCAFFOLDS)
    assert scaffolds.unavailable("mini-swe-agent") is None
    assert "unknown scaffold 'aider'" in scaffolds.unavailable("aider")


def test_an_agent_is_a_command_or_a_scaffold_never_both_nor_neither():
    assert decode_body(body({"command": ["python3", "a.py"]}), SubmitRolloutRequest).task.agent.scaffold is None
    spec = decode_body(body({"scaffold": {"name": "mini-swe-agent", "model": "m", "config": {"a": 1}}}),
                       SubmitRolloutRequest).task.agent.scaffold
    assert spec == ScaffoldSpec(name="mini-swe-agent", model="m", config={"a": 1})
    for agent, message in (
        ({}, "exactly one of `command`"),
        ({"command": ["a"], "scaffold": {"name": "mini-swe-agent", "model": "m"}}, "exactly one of `command`"),
        ({"scaffold": {"name": "aider", "model": "m"}}, "aider"),
        ({"scaffold": {"name": "mini-swe-agent"}}, "model"),
        ({"scaffold": {"name": "mini-swe-agent", "model": "m", "extra": 1}}, "extra"),
    ):
        with pytest.raises(InvalidRequest, match=message) as err:
            decode_body(body(agent), SubmitRolloutRequest)
        assert "task.agent" in str(err.value) or "$.task.agent" in str(err.value)


def test_a_scaffold_without_a_preset_module_is_refused_at_submission(monkeypatch):
    monkeypatch.setitem(scaffolds.SCAFFOLDS, "openhands", "not_written_yet")
    problem = scaffolds.unavailable("openhands")
    assert "has no preset yet" in problem and "mini-swe-agent" in problem
    with pytest.raises(InvalidRequest, match="no preset yet"):
        decode_body(body({"scaffold": {"name": "openhands", "model": "m"}}), SubmitRolloutRequest)
    agent = AgentSpec(scaffold=MINI)  # accepted here, but a worker whose code lacks the preset:
    monkeypatch.setitem(scaffolds.SCAFFOLDS, "mini-swe-agent", "not_written_yet")
    with pytest.raises(scaffolds.ScaffoldUnavailable, match="no preset yet"):
        scaffolds.preset(agent, CONTEXT)


def test_the_mini_swe_agent_preset_runs_mini_unattended_against_the_proxy():
    launch = scaffolds.preset(AgentSpec(scaffold=MINI), CONTEXT)
    assert launch.command == ["sh", mini_swe_agent.WRAPPER]
    wrapper = launch.files[mini_swe_agent.WRAPPER].decode()
    assert ("/opt/scaffolds/mini-swe-agent/bin/mini -y --exit-immediately -c mini.yaml "
            f"-c {mini_swe_agent.CONFIG} -o {mini_swe_agent.TRAJECTORY} </dev/null") in wrapper
    assert f"/opt/scaffolds/mini-swe-agent/bin/python {mini_swe_agent.FINISH}" in wrapper
    assert launch.env["MSWEA_CONFIGURED"] == "true" and launch.env["MSWEA_COST_TRACKING"] == "ignore_errors"
    assert launch.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    config = yaml.safe_load(launch.files[mini_swe_agent.CONFIG])  # JSON, read by mini as YAML
    assert config["run"]["task"] == CONTEXT.instructions  # the task text, unquoted, no argv limit
    assert config["model"]["model_name"] == "qwen-coder"
    assert config["model"]["model_kwargs"] == {"api_base": CONTEXT.openai_base_url, "custom_llm_provider": "openai"}
    assert config["environment"]["environment_class"] == "local"
    assert config["environment"]["cwd"] == "/sandbox/workspace/pkg" and config["environment"]["timeout"] == 120
    assert config["agent"]["mode"] == "yolo" and config["agent"]["confirm_exit"] is False
    registry = json.loads(launch.files[config["model"]["litellm_model_registry"]])
    assert registry["qwen-coder"]["input_cost_per_token"] == 0.0
    assert all(b"ak-secret" not in data for data in launch.files.values())  # the key stays in the environment
    assert launch.artifacts == {"mini-swe-agent.traj.json": "/sandbox/.arena/mini-swe-agent.traj.json"}


def test_mini_swe_agent_config_overrides_merge_over_the_preset():
    spec = ScaffoldSpec(name="mini-swe-agent", model="m", config={
        "config_files": ["mini_textbased.yaml"], "model": {"model_class": "litellm_textbased",
                                                          "model_kwargs": {"temperature": 0.2}},
        "agent": {"step_limit": 7}})
    launch = scaffolds.preset(AgentSpec(scaffold=spec), msgspec.structs.replace(CONTEXT, home=""))
    wrapper = launch.files[mini_swe_agent.WRAPPER].decode()
    assert "\nmini -y --exit-immediately -c mini_textbased.yaml -c " in wrapper  # on PATH (an image)
    assert f"\npython3 {mini_swe_agent.FINISH}" in wrapper
    config = json.loads(launch.files[mini_swe_agent.CONFIG])
    assert "config_files" not in config
    assert config["model"]["model_class"] == "litellm_textbased" and config["agent"]["step_limit"] == 7
    assert config["model"]["model_kwargs"] == {"api_base": CONTEXT.openai_base_url, "custom_llm_provider": "openai",
                                               "temperature": 0.2}
    with pytest.raises(ValueError, match="config_files"):
        scaffolds.preset(AgentSpec(scaffold=ScaffoldSpec(name="mini-swe-agent", model="m",
                                                         config={"config_files": "mini.yaml"})), CONTEXT)


def finish(tmp_path: Path, trajectory: dict | None) -> tuple[bool, dict | None]:
    """Run the preset's finishing step on a trajectory file, ``/sandbox/.arena`` mapped to tmp_path."""
    tmp_path.mkdir()
    code = mini_swe_agent._FINISH.replace('"/sandbox/.arena"', repr(str(tmp_path)))
    traj = tmp_path / "t.json"
    if trajectory is not None:
        traj.write_text(json.dumps(trajectory))
    subprocess.run([sys.executable, "-c", code, str(traj)], check=True, capture_output=True)
    result = tmp_path / "result.json"
    return (tmp_path / "done").exists(), json.loads(result.read_text()) if result.exists() else None


def test_done_is_written_only_when_mini_submitted(tmp_path):
    info = {"exit_status": "Submitted", "submission": "", "model_stats": {"api_calls": 3}}
    assert finish(tmp_path / "a", None) == (False, None)  # mini crashed before writing one
    done, result = finish(tmp_path / "b", {"info": info})
    assert done and result == {"scaffold": "mini-swe-agent", "exit_status": "Submitted", "submission": "",
                               "api_calls": 3}
    done, result = finish(tmp_path / "c", {"info": {**info, "exit_status": "LimitsExceeded"}})
    assert not done and result["exit_status"] == "LimitsExceeded"


def job(agent: AgentSpec, tmp_path: Path) -> SandboxJob:
    task = Task(id="t", instructions="Fix median.", agent=agent, repo=str(tmp_path), workdir="pkg")
    return SandboxJob(rollout_id="r1", task=task, proxy_url="http://10.0.0.5:80/proxy/r1/v1", api_key="ak-1")


def test_the_runner_plans_a_scaffold_with_its_files_environment_and_artifacts(tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    agent = AgentSpec(scaffold=MINI, env={"MSWEA_COST_TRACKING": "default", "EXTRA": "1"})
    plan, _, _ = runner._prepare(job(agent, repo), tmp_path / "staging", repo, None, "/opt/s/mini-swe-agent")
    assert plan.command == ["sh", mini_swe_agent.WRAPPER] and plan.workdir == "/sandbox/workspace/pkg"
    assert plan.env["OPENAI_BASE_URL"] == "http://127.0.0.1:10080/proxy/r1/v1"  # the sandbox's view
    assert plan.env["OPENAI_API_KEY"] == "ak-1" and plan.env["MSWEA_CONFIGURED"] == "true"
    assert plan.env["MSWEA_COST_TRACKING"] == "default" and plan.env["EXTRA"] == "1"  # the task's env wins
    config = json.loads(plan.files[mini_swe_agent.CONFIG])
    assert config["model"]["model_kwargs"]["api_base"] == "http://127.0.0.1:10080/proxy/r1/v1"
    assert config["environment"]["cwd"] == "/sandbox/workspace/pkg"
    assert "/opt/s/mini-swe-agent/bin/mini" in plan.files[mini_swe_agent.WRAPPER].decode()
    assert plan.artifacts == {"mini-swe-agent.traj.json": "/sandbox/.arena/mini-swe-agent.traj.json"}
    # a raw command is unchanged
    plan, _, _ = runner._prepare(job(AgentSpec(command=["python3", "a.py"]), repo), tmp_path / "staging2", repo, None)
    assert plan.command == ["python3", "a.py"] and plan.files == {} and plan.artifacts == {}


def test_a_preset_may_write_and_keep_files_only_in_the_arena_directory(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    for files, artifacts, message in (
        ({"/sandbox/workspace/x": b""}, {}, "not under /sandbox/.arena"),
        ({"/sandbox/.arena/../agent/x": b""}, {}, "not under /sandbox/.arena"),
        ({"/sandbox/.arena/done": b""}, {}, "the sandbox contract's own"),
        ({}, {"t": "/sandbox/.arena/scaffold/t.json"}, "not directly in /sandbox/.arena"),
    ):
        monkeypatch.setattr(runner.scaffolds, "preset", lambda *a, f=files, t=artifacts: scaffolds.Launch(
            command=["true"], files=f, artifacts=t))
        with pytest.raises(ValueError, match=message):
            runner._prepare(job(AgentSpec(scaffold=MINI), repo), tmp_path / "staging", repo, None)


def test_the_local_provider_binds_installed_scaffolds_read_only(tmp_path, monkeypatch):
    scaffolds_dir = tmp_path / "scaffolds"
    provider = LocalProvider(data_dir=tmp_path / "data", owner="t", use_cgroups=False)
    assert provider.scaffolds_dir is None  # <data_dir>/scaffolds does not exist
    assert runner.scaffold_home(provider, "mini-swe-agent") == ""
    (scaffolds_dir / "mini-swe-agent" / "bin").mkdir(parents=True)
    monkeypatch.setenv("ARENA_SCAFFOLDS_DIR", str(scaffolds_dir))
    provider = LocalProvider(data_dir=tmp_path / "data", owner="t", use_cgroups=False)
    assert provider.scaffolds_dir == scaffolds_dir.resolve()
    assert runner.scaffold_home(provider, "mini-swe-agent") == str(scaffolds_dir.resolve() / "mini-swe-agent")
    assert runner.scaffold_home(provider, "claude-code") == ""  # not installed here: on PATH or nowhere
    spec = local.SandboxSpec(command=["true"], workspace=tmp_path, ro_binds=(str(scaffolds_dir),))
    argv = local._bwrap_argv(spec, tmp_path, shim=None)
    i = argv.index(str(scaffolds_dir))
    assert argv[i - 1:i + 2] == ["--ro-bind", str(scaffolds_dir), str(scaffolds_dir)]
    assert argv.index("--tmpfs") < i  # after the private /tmp: a directory under /tmp stays visible
