"""The Claude Code and OpenCode presets: their command, environment, files and artifacts, and
their wrappers' completion rule, run in a bubblewrap sandbox against stand-in ``claude`` and
``opencode`` programs that print what the real ones print (stream-json / JSON events)."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path

import pytest

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch, claude_code, opencode, preset
from arena_core.schemas import AgentSpec, ScaffoldSpec
from arena_sandbox_providers import local

KEY = "ak-rollout-secret"
CONTEXT = Context(instructions="Fix `median` in textstats/core.py.", openai_base_url="http://127.0.0.1:9090/proxy/r1/v1",
                  anthropic_base_url="http://127.0.0.1:9090/proxy/r1", api_key=KEY)


def launch(name: str, context: Context = CONTEXT, **config) -> Launch:
    return preset(AgentSpec(scaffold=ScaffoldSpec(name=name, model="qwen-7b", config=config)), context)


def argv_of(launch_: Launch) -> list[str]:
    """The scaffold's own command line, from the wrapper's argument."""
    assert launch_.command[0] == "python3" and launch_.command[1] in launch_.files
    return json.loads(launch_.command[2])[0]


@pytest.mark.parametrize("name", ["claude-code", "opencode"])
def test_files_live_in_the_arena_directory_and_the_key_in_none_of_them(name):
    out = launch(name)
    assert all(path.startswith(f"{SCAFFOLD_DIR}/") for path in out.files)
    assert all(os.path.dirname(path) == "/sandbox/.arena" for path in out.artifacts.values())
    assert all(name_ == os.path.basename(path) for name_, path in out.artifacts.items())
    everything = json.dumps([out.command, out.env]) + b"".join(out.files.values()).decode()
    assert KEY not in everything  # the key stays in the contract's environment
    assert CONTEXT.instructions.encode() in out.files.values()  # the task, as a file


def test_claude_code_runs_headless_with_every_permission_and_a_small_tool_set():
    out = launch("claude-code")
    argv = argv_of(out)
    assert argv[:5] == ["claude", "--print", "--output-format=stream-json", "--verbose",
                        "--permission-mode=bypassPermissions"]
    assert "--model=qwen-7b" in argv and "--tools=Bash,Edit,Read,Write" in argv
    # every model alias Claude Code may pick is the scaffold's model; nothing leaves the sandbox
    for var in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert out.env[var] == "qwen-7b"
    assert out.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1" and out.env["IS_SANDBOX"] == "1"
    assert out.env["DISABLE_TELEMETRY"] == out.env["DISABLE_AUTOUPDATER"] == "1"
    assert out.env["CLAUDE_CONFIG_DIR"] == "/tmp/claude-code"  # writable by the sandbox user
    assert "ANTHROPIC_BASE_URL" not in out.env  # the contract's, unchanged
    assert set(out.artifacts) == {"claude-code.events.jsonl", "claude-code.session.jsonl"}


def test_claude_code_config_options_and_refusals():
    out = launch("claude-code", tools=["Bash", "Read"], max_turns=7, max_output_tokens=4096,
                 append_system_prompt="Be brief.", args=["--fallback-model=x"])
    argv = argv_of(out)
    assert "--tools=Bash,Read" in argv and "--max-turns=7" in argv and argv[-1] == "--fallback-model=x"
    assert argv[argv.index("--append-system-prompt") + 1] == "Be brief."
    assert out.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    home = Context(**{**{f: getattr(CONTEXT, f) for f in CONTEXT.__struct_fields__}, "home": "/opt/cc"})
    assert argv_of(launch("claude-code", home))[0] == "/opt/cc/bin/claude"
    for bad in ({"tool": ["Bash"]}, {"tools": "Bash"}, {"max_turns": 0}, {"max_turns": True}, {"args": "-x"}):
        with pytest.raises(ValueError, match="claude-code"):
            launch("claude-code", **bad)


def test_claude_code_tool_set_and_permission_rules():
    # the default: a small set (docs/agents.md, "Claude Code")
    assert "--tools=Bash,Edit,Read,Write" in argv_of(launch("claude-code"))
    assert not any(a.startswith(("--allowedTools", "--disallowedTools")) for a in argv_of(launch("claude-code")))
    # Claude Code's full built-in set, its own keyword, with tools taken off it by deny rules
    argv = argv_of(launch("claude-code", tools="default", disallowed_tools=["WebFetch", "WebSearch", "Bash(curl *)"]))
    assert "--tools=default" in argv
    assert [a for a in argv if a.startswith("--disallowedTools")] == [
        "--disallowedTools=WebFetch", "--disallowedTools=WebSearch", "--disallowedTools=Bash(curl *)"]
    # any list of tool names; none at all is Claude Code's `--tools ""`; allow rules, one argument each
    argv = argv_of(launch("claude-code", tools=["Read", "Grep", "Glob"], allowed_tools=["Bash(git *)", "Read"]))
    assert "--tools=Read,Grep,Glob" in argv
    assert [a for a in argv if a.startswith("--allowedTools")] == ["--allowedTools=Bash(git *)", "--allowedTools=Read"]
    assert "--tools=" in argv_of(launch("claude-code", tools=[]))
    for bad in ({"tools": "all"}, {"tools": "Bash,Read"}, {"tools": ["Bash,Read"]}, {"tools": ["Bash(git *)"]},
                {"tools": [""]}, {"tools": None}, {"allowed_tools": "Bash"}, {"disallowed_tools": [""]},
                {"disallowed_tools": [" Bash"]}, {"allowed_tools": [3]}, {"allowedTools": ["Bash"]}):
        with pytest.raises(ValueError, match="claude-code"):
            launch("claude-code", **bad)


def test_opencode_config_names_the_proxy_as_its_only_provider():
    out = launch("opencode")
    argv = argv_of(out)
    assert argv[:3] == ["opencode", "run", "--format=json"] and argv[-1] == "--"
    assert "--model=arena/qwen-7b" in argv and "--title=arena" in argv and "--pure" in argv
    cfg = json.loads(out.files[opencode.CONFIG])
    assert out.env["OPENCODE_CONFIG"] == opencode.CONFIG
    assert cfg["model"] == cfg["small_model"] == "arena/qwen-7b"
    assert list(cfg["provider"]) == ["arena"]
    provider = cfg["provider"]["arena"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": CONTEXT.openai_base_url, "apiKey": "{env:OPENAI_API_KEY}"}
    assert provider["models"]["qwen-7b"]["tool_call"] is True
    assert cfg["permission"]["bash"] == cfg["permission"]["edit"] == "allow"
    assert cfg["autoupdate"] is False and cfg["share"] == "disabled"
    for var in ("OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_LSP_DOWNLOAD"):
        assert out.env[var] == "1"


def test_opencode_config_options_and_refusals():
    out = launch("opencode", max_output_tokens=2048, context_tokens=32768, agent="plan", args=["--variant=high"],
                 opencode={"permission": {"webfetch": "allow"}, "instructions": ["AGENTS.md"]})
    cfg = json.loads(out.files[opencode.CONFIG])
    assert cfg["provider"]["arena"]["models"]["qwen-7b"]["limit"] == {"context": 32768, "output": 2048}
    assert cfg["permission"]["webfetch"] == "allow" and cfg["permission"]["bash"] == "allow"  # merged
    assert cfg["instructions"] == ["AGENTS.md"]
    argv = argv_of(out)
    assert "--agent=plan" in argv and argv[-2:] == ["--variant=high", "--"]
    for bad in ({"model": "x"}, {"max_output_tokens": 0}, {"opencode": []}, {"agent": ""}, {"args": [1]}):
        with pytest.raises(ValueError, match="opencode"):
            launch("opencode", **bad)


# --------------------------------------------------------------------------- the wrappers, in a sandbox

FAKE_CLAUDE = r'''#!/usr/bin/env python3
import json, os, pathlib, sys
task = sys.stdin.read()
mode = os.environ["FAKE_MODE"]
sid = "5e55"
project = pathlib.Path(os.environ["CLAUDE_CONFIG_DIR"], "projects", "-sandbox-workspace")
project.mkdir(parents=True, exist_ok=True)
(project / f"{sid}.jsonl").write_text(json.dumps({"type": "user", "message": {"content": task}}) + "\n")
print(json.dumps({"type": "system", "subtype": "init", "session_id": sid, "argv": sys.argv[1:]}))
if mode == "crash":
    sys.exit(3)
error = mode == "api-error"
print(json.dumps({"type": "result", "subtype": "success", "is_error": error, "num_turns": 2, "session_id": sid,
                  "result": "API Error: 403" if error else "Fixed.", "stop_reason": "end_turn"}))
sys.exit(1 if error else 0)
'''

FAKE_OPENCODE = r'''#!/usr/bin/env python3
import json, os, sys
if sys.argv[1] == "export":
    print(json.dumps({"info": {"id": sys.argv[2]}, "messages": []}))
    sys.exit(0)
mode, message = os.environ["FAKE_MODE"], sys.argv[-1]
sid = "ses_1"
def event(kind, **fields):
    print(json.dumps({"type": kind, "sessionID": sid, **fields}), flush=True)
event("step_start", part={"type": "step-start"})
event("text", part={"type": "text", "text": message})
if mode == "api-error":
    event("error", error={"name": "APIError", "data": {"statusCode": 403}})
    sys.exit(1)
event("step_finish", part={"type": "step-finish", "reason": "stop"})
sys.exit(0)
'''


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def run_wrapper(tmp_path: Path, name: str, fake: str, mode: str) -> tuple[int, Path, str]:
    """The preset's launch in a bubblewrap sandbox, the scaffold replaced by ``fake``."""
    if local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    context = Context(**{**{f: getattr(CONTEXT, f) for f in CONTEXT.__struct_fields__}, "home": "/sandbox/agent"})
    out = launch(name, context)
    workspace, arena, agent = tmp_path / "workspace", tmp_path / "arena", tmp_path / "agent"
    workspace.mkdir()
    for path, data in out.files.items():
        host = arena / os.path.relpath(path, "/sandbox/.arena")
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)
    _executable(agent / "bin" / name.split("-")[0], fake)
    log = tmp_path / "log"
    result = asyncio.run(local.run(local.SandboxSpec(
        command=out.command, workspace=workspace, arena_dir=arena, agent_dir=agent, log_path=log, timeout_s=60,
        env={**local._base_env(), **out.env, "FAKE_MODE": mode})))
    return result.exit_code, arena, log.read_text()


def test_claude_code_wrapper_writes_done_on_a_successful_result(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "claude-code", FAKE_CLAUDE, "ok")
    assert code == 0 and (arena / "done").exists(), log
    result = json.loads((arena / "result.json").read_text())
    assert result["subtype"] == "success" and result["is_error"] is False and result["num_turns"] == 2
    events = (arena / "claude-code.events.jsonl").read_text().splitlines()
    assert [json.loads(e)["type"] for e in events] == ["system", "result"]
    assert '"type": "result"' in log  # the events are in the sandbox's log too
    assert "Fix `median`" in (arena / "claude-code.session.jsonl").read_text()  # the task came on stdin


@pytest.mark.parametrize("mode", ["api-error", "crash"])
def test_claude_code_wrapper_is_not_done_after_an_error(tmp_path, mode):
    code, arena, log = run_wrapper(tmp_path, "claude-code", FAKE_CLAUDE, mode)
    assert code != 0 and not (arena / "done").exists()
    assert json.loads((arena / "result.json").read_text())["exit_code"] == code
    assert "not done" in log


def test_opencode_wrapper_writes_done_when_the_run_ends_without_error(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "opencode", FAKE_OPENCODE, "ok")
    assert code == 0 and (arena / "done").exists(), log
    result = json.loads((arena / "result.json").read_text())
    assert result == {"scaffold": "opencode", "exit_code": 0, "session_id": "ses_1", "steps": 1,
                      "finish_reason": "stop", "errors": []}
    text = [json.loads(e) for e in (arena / "opencode.events.jsonl").read_text().splitlines()][1]
    assert text["part"]["text"] == CONTEXT.instructions  # the task as the message
    assert json.loads((arena / "opencode.session.json").read_text())["info"]["id"] == "ses_1"


def test_opencode_wrapper_is_not_done_after_an_error(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "opencode", FAKE_OPENCODE, "api-error")
    assert code == 1 and not (arena / "done").exists()
    assert json.loads((arena / "result.json").read_text())["errors"][0]["name"] == "APIError"
