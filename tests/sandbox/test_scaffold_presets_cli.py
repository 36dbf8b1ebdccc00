"""The presets of Qwen Code, Codex CLI and Gemini CLI: their command lines, environment and config
files, and their wrappers' completion rule against stand-in CLIs in a bubblewrap sandbox (the real
CLIs are tested through the stack in tests/e2e/test_agent_{qwen_code,codex,gemini_cli}.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from arena_core.scaffolds import SCAFFOLD_DIR, Context, codex
from arena_sandbox_providers import local

from tests.sandbox.test_scaffold_presets_node import CONTEXT, KEY, _executable, argv_of, launch

NAMES = ["qwen-code", "codex", "gemini-cli"]


def spec_of(name: str, **config) -> list:
    out = launch(name, **config)
    return json.loads(out.command[2])


@pytest.mark.parametrize("name", NAMES)
def test_files_live_in_the_arena_directory_and_the_key_in_none_of_them(name):
    out = launch(name)
    assert all(path.startswith(f"{SCAFFOLD_DIR}/") for path in out.files)
    assert all(os.path.dirname(path) == "/sandbox/.arena" for path in out.artifacts.values())
    assert all(name_ == os.path.basename(path) for name_, path in out.artifacts.items())
    everything = json.dumps([out.command, out.env]) + b"".join(out.files.values()).decode()
    assert KEY not in everything  # the key stays in the contract's environment
    assert CONTEXT.instructions.encode() in out.files.values()  # the task, as a file (on stdin)


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_config_key_is_refused(name):
    with pytest.raises(ValueError, match="unknown config keys"):
        launch(name, colour="blue")


def test_qwen_code_runs_headless_yolo_against_the_proxy_with_telemetry_and_updates_off():
    out = launch("qwen-code")
    argv = argv_of(out)
    assert argv[:4] == ["qwen", "--yolo", "--output-format", "stream-json"]
    assert argv[argv.index("--openai-base-url") + 1] == CONTEXT.openai_base_url
    assert argv[argv.index("--model") + 1] == "qwen-7b" and "--auth-type" in argv
    assert out.env["QWEN_TELEMETRY_ENABLED"] == out.env["QWEN_USAGE_STATISTICS_ENABLED"] == "false"
    assert out.env["QWEN_HOME"] == "/tmp/qwen-code" and "OPENAI_BASE_URL" not in out.env
    settings = json.loads(spec_of("qwen-code")[4])
    assert settings["general"]["enableAutoUpdate"] is False and settings["telemetry"]["enabled"] is False
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    more = argv_of(launch("qwen-code", max_session_turns=5, exclude_tools=["web_fetch"], max_output_tokens=4096))
    assert more[more.index("--max-session-turns") + 1] == "5" and more[more.index("--exclude-tools") + 1] == "web_fetch"
    assert launch("qwen-code", max_output_tokens=4096).env["QWEN_CODE_MAX_OUTPUT_TOKENS"] == "4096"
    assert set(out.artifacts) == {"qwen-code.events.jsonl", "qwen-code.session.jsonl"}


def test_codex_config_names_the_proxy_as_a_responses_provider_and_runs_without_approvals():
    out = launch("codex")
    argv = argv_of(out)
    assert argv[:3] == ["codex", "exec", "--json"] and argv[-1] == "-"  # the task on stdin
    assert "--dangerously-bypass-approvals-and-sandbox" in argv and "--skip-git-repo-check" in argv
    assert argv[argv.index("--cd") + 1] == "/sandbox/workspace"
    config = tomllib.loads(spec_of("codex")[4])
    assert config["model"] == "qwen-7b" and config["model_provider"] == "arena"
    assert config["model_providers"]["arena"] == {"name": "Arena", "base_url": CONTEXT.openai_base_url,
                                                  "env_key": "OPENAI_API_KEY", "wire_api": "responses"}
    assert config["approval_policy"] == "never" and config["sandbox_mode"] == "danger-full-access"
    assert config["check_for_update_on_startup"] is False
    assert config["analytics"] == {"enabled": False} and config["feedback"] == {"enabled": False}
    assert config["web_search"] == "disabled" and config["features"] == {"multi_agent": False}
    assert out.env["CODEX_HOME"] == "/sandbox/.arena/codex"
    merged = tomllib.loads(spec_of("codex", config={"model_providers": {"arena": {"stream_idle_timeout_ms": 1}}},
                                   reasoning_effort="low")[4])
    assert merged["model_providers"]["arena"]["stream_idle_timeout_ms"] == 1
    assert merged["model_providers"]["arena"]["wire_api"] == "responses" and merged["model_reasoning_effort"] == "low"
    with pytest.raises(ValueError, match="reasoning_effort"):
        launch("codex", reasoning_effort="max")


def test_codex_toml_writer_quotes_keys_and_strings():
    text = codex.to_toml({"a": 'say "hi"\n', "b": [1, True], "t": {"x.y": {"z": "w"}}})
    assert tomllib.loads(text) == {"a": 'say "hi"\n', "b": [1, True], "t": {"x.y": {"z": "w"}}}


def test_gemini_cli_points_the_gemini_api_at_the_proxy_with_yolo_and_telemetry_off():
    out = launch("gemini-cli")
    argv = argv_of(out)
    assert argv == ["gemini", "--yolo", "--output-format", "stream-json", "--model", "qwen-7b"]
    # the SDK appends /v1beta/models/{model}:streamGenerateContent to the rollout's proxy root
    assert out.env["GOOGLE_GEMINI_BASE_URL"] == CONTEXT.anthropic_base_url
    assert out.env["GEMINI_TELEMETRY_ENABLED"] == "false" and out.env["GEMINI_CLI_TRUST_WORKSPACE"] == "true"
    assert "GEMINI_API_KEY" not in out.env  # copied from OPENAI_API_KEY by the wrapper at run time
    settings = json.loads(spec_of("gemini-cli")[4])
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["general"]["enableAutoUpdate"] is False and settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["telemetry"]["enabled"] is False


# --------------------------------------------------------------------------- the wrappers, in a sandbox

FAKE_QWEN = r'''#!/usr/bin/env python3
import json, os, pathlib, sys
task, mode, sid = sys.stdin.read(), os.environ["FAKE_MODE"], "5e55"
chats = pathlib.Path(os.environ["QWEN_HOME"], "projects", "-sandbox-workspace", "chats")
chats.mkdir(parents=True, exist_ok=True)
(chats / f"{sid}.jsonl").write_text(json.dumps({"type": "user", "message": {"parts": [{"text": task}]}}) + "\n")
assert json.loads(pathlib.Path(os.environ["QWEN_HOME"], "settings.json").read_text())["telemetry"]["enabled"] is False
print(json.dumps({"type": "system", "subtype": "init", "session_id": sid}))
if mode == "crash":
    sys.exit(3)
error = mode == "api-error"
print(json.dumps({"type": "result", "subtype": "error_during_execution" if error else "success", "is_error": error,
                  "num_turns": 2, "session_id": sid, "result": "Fixed."}))
sys.exit(1 if error else 0)
'''

FAKE_CODEX = r'''#!/usr/bin/env python3
import json, os, pathlib, sys, tomllib
task, mode, tid = sys.stdin.read(), os.environ["FAKE_MODE"], "01a2-thread"
home = pathlib.Path(os.environ["CODEX_HOME"])
assert tomllib.loads((home / "config.toml").read_text())["model_providers"]["arena"]["wire_api"] == "responses"
day = home / "sessions" / "2026" / "11" / "29"
day.mkdir(parents=True, exist_ok=True)
(day / f"rollout-2026-11-29T05-00-00-{tid}.jsonl").write_text(json.dumps({"type": "user", "task": task}) + "\n")
def event(**fields):
    print(json.dumps(fields), flush=True)
event(type="thread.started", thread_id=tid)
event(type="turn.started")
if mode == "api-error":
    event(type="error", message="unexpected status 403 Forbidden")
    event(type="turn.failed", error={"message": "unexpected status 403 Forbidden"})
    sys.exit(1)
event(type="item.completed", item={"id": "item_0", "type": "agent_message", "text": "Fixed."})
event(type="turn.completed", usage={"input_tokens": 10, "output_tokens": 2})
sys.exit(0)
'''

FAKE_GEMINI = r'''#!/usr/bin/env python3
import json, os, pathlib, sys
task, mode, sid = sys.stdin.read(), os.environ["FAKE_MODE"], "0ebacfca-a084-4ea1"
assert os.environ["GEMINI_API_KEY"] == os.environ["OPENAI_API_KEY"] != ""
chats = pathlib.Path(os.environ["GEMINI_CLI_HOME"], ".gemini", "tmp", "workspace", "chats")
chats.mkdir(parents=True, exist_ok=True)
(chats / f"session-2026-11-29T05-49-{sid[:8]}.jsonl").write_text(json.dumps({"sessionId": sid, "task": task}) + "\n")
print(json.dumps({"type": "init", "session_id": sid, "model": "m"}))
error = mode == "api-error"
print(json.dumps({"type": "result", "status": "error" if error else "success", "stats": {"tool_calls": 2}}))
sys.exit(1 if error else 0)
'''


def run_wrapper(tmp_path: Path, name: str, fake: str, mode: str) -> tuple[int, Path, str]:
    """The preset's launch in a bubblewrap sandbox with the contract's key in its environment, the
    CLI replaced by ``fake`` (``<home>/bin/<command>``)."""
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
        env={**local._base_env(), "OPENAI_API_KEY": KEY, **out.env, "FAKE_MODE": mode})))
    return result.exit_code, arena, log.read_text()


def test_qwen_code_wrapper_writes_done_on_a_successful_result(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "qwen-code", FAKE_QWEN, "ok")
    assert code == 0 and (arena / "done").exists(), log
    result = json.loads((arena / "result.json").read_text())
    assert result["subtype"] == "success" and result["is_error"] is False and result["session_id"] == "5e55"
    assert [json.loads(e)["type"] for e in (arena / "qwen-code.events.jsonl").read_text().splitlines()] == \
        ["system", "result"]
    assert "Fix `median`" in (arena / "qwen-code.session.jsonl").read_text()  # the task came on stdin


@pytest.mark.parametrize("mode", ["api-error", "crash"])
def test_qwen_code_wrapper_is_not_done_after_an_error(tmp_path, mode):
    code, arena, log = run_wrapper(tmp_path, "qwen-code", FAKE_QWEN, mode)
    assert code != 0 and not (arena / "done").exists()
    assert json.loads((arena / "result.json").read_text())["exit_code"] == code
    assert "not done" in log


def test_codex_wrapper_writes_done_when_its_turn_completes(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "codex", FAKE_CODEX, "ok")
    assert code == 0 and (arena / "done").exists(), log
    result = json.loads((arena / "result.json").read_text())
    assert result == {"scaffold": "codex", "exit_code": 0, "thread_id": "01a2-thread", "turns_completed": 1,
                      "turns_failed": 0, "items": 1, "usage": {"input_tokens": 10, "output_tokens": 2}, "errors": []}
    assert "Fix `median`" in (arena / "codex.session.jsonl").read_text()


def test_codex_wrapper_is_not_done_after_a_failed_turn(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "codex", FAKE_CODEX, "api-error")
    assert code == 1 and not (arena / "done").exists()
    result = json.loads((arena / "result.json").read_text())
    assert result["turns_failed"] == 1 and "403" in result["errors"][0]


def test_gemini_cli_wrapper_writes_done_on_success_and_hands_it_the_key(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "gemini-cli", FAKE_GEMINI, "ok")
    assert code == 0 and (arena / "done").exists(), log
    result = json.loads((arena / "result.json").read_text())
    assert result["status"] == "success" and result["stats"] == {"tool_calls": 2}
    assert "Fix `median`" in (arena / "gemini-cli.session.jsonl").read_text()


def test_gemini_cli_wrapper_is_not_done_after_an_error(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "gemini-cli", FAKE_GEMINI, "api-error")
    assert code == 1 and not (arena / "done").exists()
    assert json.loads((arena / "result.json").read_text())["status"] == "error"


# --------------------------------------------------------------------------- versions beside the pins

def test_a_version_variable_pins_a_python_scaffold_at_another_release(monkeypatch):
    """``ARENA_<NAME>_VERSION``: how deploy/images/releases.py builds the newest OpenHands or harbor."""
    from arena_core.scaffolds import install

    (pinned,) = install.requirements("terminus-2")
    assert pinned.startswith("harbor==")
    monkeypatch.setenv("ARENA_TERMINUS_2_VERSION", "0.27.1")
    assert install.requirements("terminus-2") == ("harbor==0.27.1",)
    monkeypatch.setenv("ARENA_TERMINUS_2_VERSION", "0.27; rm -rf /")
    with pytest.raises(ValueError, match="not a version"):
        install.requirements("terminus-2")


def test_the_releases_script_reads_the_pins_of_the_images_and_the_presets():
    import importlib.util

    spec = importlib.util.spec_from_file_location("releases", Path(__file__).resolve().parents[2] / "deploy" /
                                                  "images" / "releases.py")
    releases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(releases)
    from arena_core.scaffolds import openhands, terminus2

    for name in releases.SCAFFOLDS:
        assert re.fullmatch(r"\d+\.\d+\.\d+", releases.pinned(name)), name
    assert f"openhands=={releases.pinned('openhands')}" in openhands.REQUIREMENTS
    assert f"harbor=={releases.pinned('terminus-2')}" in terminus2.REQUIREMENTS
    build = (Path(releases.__file__).parent / "build.sh").read_text()
    assert f'ARENA_CLAUDE_CODE_VERSION:-{releases.pinned("claude-code")}' in build
