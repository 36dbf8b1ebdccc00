"""The OpenHands preset: its command, environment, files and artifacts, and its wrapper's completion
rule, run in a bubblewrap sandbox against a stand-in ``openhands`` that prints what the real one
prints (JSON events among console lines) and persists a conversation the way it does."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from arena_core import scaffolds
from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch, install, openhands, preset
from arena_core.schemas import AgentSpec, ScaffoldSpec
from arena_sandbox_providers import local

KEY = "ak-rollout-secret"
CONTEXT = Context(instructions="Fix `median` in textstats/core.py.\n\"Quotes\" and $HOME stay as they are.",
                  openai_base_url="http://127.0.0.1:9090/proxy/r1/v1", anthropic_base_url="http://127.0.0.1:9090/proxy/r1",
                  api_key=KEY, workdir="/sandbox/workspace/pkg", home="/opt/scaffolds/openhands")


def launch(context: Context = CONTEXT, **config) -> Launch:
    return preset(AgentSpec(scaffold=ScaffoldSpec(name="openhands", model="qwen-7b", config=config)), context)


def spec_of(launch_: Launch) -> list:
    """The wrapper's argument: [argv, task file, events, conversation out, conversations dir, max arg]."""
    assert launch_.command[:2] == ["python3", openhands.WRAPPER] and openhands.WRAPPER in launch_.files
    return json.loads(launch_.command[2])


def with_home(home: str) -> Context:
    return Context(**{**{f: getattr(CONTEXT, f) for f in CONTEXT.__struct_fields__}, "home": home})


def test_it_is_registered_and_installs_from_pypi_on_python_3_12():
    assert scaffolds.unavailable("openhands") is None
    assert install.requirements("openhands") == ("openhands==1.16.0",)
    assert install.python_version("openhands") == "3.12"
    assert install.python_version("mini-swe-agent") == "%d.%d" % sys.version_info[:2]


def test_openhands_runs_headless_with_its_llm_settings_from_the_environment():
    out = launch()
    argv = spec_of(out)[0]
    # its own interpreter, isolated (-I): the task's environment does not change how OpenHands imports
    assert argv == ["/opt/scaffolds/openhands/bin/python", "-I", "/opt/scaffolds/openhands/bin/openhands",
                    "--headless", "--json", "--override-with-envs"]
    assert out.env["LLM_MODEL"] == "openai/qwen-7b" and out.env["LLM_BASE_URL"] == CONTEXT.openai_base_url
    assert out.env["OPENHANDS_WORK_DIR"] == "/sandbox/workspace/pkg"
    assert out.env["OPENHANDS_PERSISTENCE_DIR"] == "/tmp/openhands"  # writable by the sandbox user
    assert out.env["OPENHANDS_SUPPRESS_BANNER"] == "1" and out.env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    assert "LLM_API_KEY" not in out.env  # the wrapper takes it from OPENAI_API_KEY at run time
    assert out.artifacts == {"openhands.events.jsonl": "/sandbox/.arena/openhands.events.jsonl",
                             "openhands.conversation.json": "/sandbox/.arena/openhands.conversation.json"}
    assert all(path.startswith(f"{SCAFFOLD_DIR}/") for path in out.files)
    assert out.files[openhands.PROMPT] == CONTEXT.instructions.encode()  # the task, as a file
    assert KEY not in json.dumps([out.command, out.env]) + b"".join(out.files.values()).decode()


def test_in_its_image_openhands_runs_from_opt_and_config_args_are_appended():
    # the docker provider names no installation (home ""): arena/openhands holds it in /opt/openhands
    argv = spec_of(launch(with_home(""), args=["--exit-without-confirmation"]))[0]
    assert argv == ["/opt/openhands/bin/python", "-I", "/opt/openhands/bin/openhands", "--headless", "--json",
                    "--override-with-envs", "--exit-without-confirmation"]
    for bad in ({"args": "-x"}, {"args": [1]}, {"max_turns": 3}):
        with pytest.raises(ValueError, match="openhands"):
            launch(**bad)


FAKE_OPENHANDS = r'''
import json, os, pathlib, sys
mode = os.environ["FAKE_MODE"]
assert os.environ["LLM_API_KEY"] == os.environ["OPENAI_API_KEY"], "the key comes from the contract"
task = sys.argv[sys.argv.index("-t") + 1] if "-t" in sys.argv else "file:" + sys.argv[sys.argv.index("-f") + 1]
folder = pathlib.Path(os.environ["OPENHANDS_PERSISTENCE_DIR"], "conversations", "c0ffee")
(folder / "events").mkdir(parents=True)
n = 0
def event(kind, echo=True, **fields):
    global n
    data = {"id": str(n), "source": "agent", **fields}
    (folder / "events" / f"event-{n:05d}-{n}.json").write_text(json.dumps({**data, "kind": kind}))
    n += 1
    if echo:
        print(json.dumps(data), flush=True)  # --json prints model_dump(): no top-level kind
print("Initializing agent...")
event("SystemPromptEvent", echo=False, system_prompt={"text": "You are OpenHands."})
event("MessageEvent", source="user", llm_message={"role": "user", "content": [{"type": "text", "text": task}]})
if mode == "crash":
    sys.exit(1)
event("ActionEvent", action={"kind": "TerminalAction", "command": "ls"}, tool_name="terminal")
event("ObservationEvent", observation={"kind": "TerminalObservation", "content": []}, tool_name="terminal")
status = "finished"
if mode == "ok":
    event("ActionEvent", action={"kind": "FinishAction", "message": "Fixed."}, tool_name="finish")
elif mode == "llm-error":
    event("ConversationErrorEvent", source="environment", code="BadRequestError", detail="403 budget exhausted")
    status = "error"
print("Agent finished")
(folder / "base_state.json").write_text(json.dumps({"id": "c0ffee", "execution_status": status,
                                                    "agent": {"llm": {"api_key": "**********"}}}))
print("Goodbye!")
'''


def run_wrapper(tmp_path: Path, mode: str, max_arg: int = openhands.MAX_TASK_ARG) -> tuple[int, Path, str]:
    """The preset's launch in a bubblewrap sandbox, OpenHands replaced by a stand-in."""
    if local.available() is not None:
        pytest.skip(f"no bubblewrap: {local.available()}")
    out = launch(with_home("/sandbox/agent"))
    spec = spec_of(out)
    command = [*out.command[:2], json.dumps([*spec[:-1], max_arg])]
    workspace, arena, agent = tmp_path / "workspace", tmp_path / "arena", tmp_path / "agent"
    (workspace / "pkg").mkdir(parents=True)
    for path, data in out.files.items():
        host = arena / os.path.relpath(path, "/sandbox/.arena")
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)
    (agent / "bin").mkdir(parents=True)
    (agent / "bin" / "python").symlink_to(os.path.realpath(sys.executable))  # the sandbox sees this Python
    (agent / "bin" / "openhands").write_text(FAKE_OPENHANDS)
    log = tmp_path / "log"
    result = asyncio.run(local.run(local.SandboxSpec(
        command=command, workspace=workspace, arena_dir=arena, agent_dir=agent, log_path=log, timeout_s=60,
        env={**local._base_env(), **out.env, "OPENAI_API_KEY": KEY, "FAKE_MODE": mode})))
    return result.exit_code, arena, log.read_text()


def test_the_wrapper_writes_done_when_openhands_finished(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "ok")
    assert code == 0 and (arena / "done").exists(), log
    result = json.loads((arena / "result.json").read_text())
    assert result == {"scaffold": "openhands", "exit_code": 0, "execution_status": "finished", "actions": 2,
                      "finish_message": "Fixed.", "errors": []}
    events = [json.loads(e) for e in (arena / "openhands.events.jsonl").read_text().splitlines()]
    assert len(events) == 4 and events[0]["llm_message"]["content"][0]["text"] == CONTEXT.instructions  # -t, verbatim
    assert "Initializing agent" in log and "Goodbye!" in log  # its console lines: in the log, not the events
    conversation = json.loads((arena / "openhands.conversation.json").read_text())
    assert conversation["id"] == "c0ffee" and conversation["base_state"]["execution_status"] == "finished"
    assert [e["kind"] for e in conversation["events"]][:2] == ["SystemPromptEvent", "MessageEvent"]
    assert KEY not in (arena / "openhands.conversation.json").read_text()


@pytest.mark.parametrize("mode", ["llm-error", "crash"])
def test_the_wrapper_is_not_done_after_an_error(tmp_path, mode):
    code, arena, log = run_wrapper(tmp_path, mode)
    assert not (arena / "done").exists() and "not done" in log
    result = json.loads((arena / "result.json").read_text())
    assert result["exit_code"] == code == (1 if mode == "crash" else 0)  # OpenHands exits 0 after an LLM error
    if mode == "llm-error":
        assert result["execution_status"] == "error"
        assert result["errors"] == [{"code": "BadRequestError", "detail": "403 budget exhausted"}]
    else:
        assert result["execution_status"] is None  # no conversation state was written


def test_a_long_task_goes_by_file(tmp_path):
    code, arena, log = run_wrapper(tmp_path, "ok", max_arg=10)
    assert code == 0 and (arena / "done").exists(), log
    events = [json.loads(e) for e in (arena / "openhands.events.jsonl").read_text().splitlines()]
    assert events[0]["llm_message"]["content"][0]["text"] == f"file:{openhands.PROMPT}"
