"""OpenHands (PyPI ``openhands``, the V1 CLI) under the sandbox contract: ``openhands --headless
--json`` (every action approved), its LLM calls to Arena's proxy (LiteLLM, ``openai/<model>``), its
tools run in the sandbox (local workspace, tmux terminal), ``done`` written when its conversation
finished without an error. See docs/agents.md ("OpenHands").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch

if TYPE_CHECKING:
    from arena_core.schemas import ScaffoldSpec

NAME = "openhands"
#: What ``python -m arena_core.scaffolds.install openhands`` puts in its virtualenv.
REQUIREMENTS = ("openhands==1.16.0",)
#: The CLI requires Python 3.12 (``Requires-Python: ==3.12.*``).
PYTHON = "3.12"
#: Where its image (``arena/openhands``, deploy/images) holds that directory: used when the provider
#: names no installation (``Context.home`` empty: the docker provider).
IMAGE_HOME = "/opt/openhands"
WRAPPER = f"{SCAFFOLD_DIR}/openhands.py"
PROMPT = f"{SCAFFOLD_DIR}/openhands-task.txt"
#: OpenHands' own state (conversations, caches): somewhere the sandbox user may write.
PERSISTENCE_DIR = "/tmp/openhands"
#: Kept as artifacts: its JSON events (stdout) and its persisted conversation (state and events).
EVENTS = "/sandbox/.arena/openhands.events.jsonl"
CONVERSATION = "/sandbox/.arena/openhands.conversation.json"
#: Above this many bytes the task goes by ``-f`` (OpenHands then wraps it in a "file context"
#: message) instead of ``-t`` (one argument is at most 128 KiB on Linux).
MAX_TASK_ARG = 100_000

#: Unattended and offline: LLM settings from the environment (never ~/.openhands), no banner,
#: no download of LiteLLM's price list, its state in the sandbox's /tmp.
ENV = {
    "OPENHANDS_PERSISTENCE_DIR": PERSISTENCE_DIR,
    "OPENHANDS_SUPPRESS_BANNER": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "HF_HUB_OFFLINE": "1",
    "GIT_TERMINAL_PROMPT": "0",
    "PYTHONUNBUFFERED": "1",
}

#: ``config`` keys the preset understands (anything else is refused).
CONFIG_KEYS = ("args",)

#: Runs OpenHands with the task, its JSON events to the log (stdout) and to EVENTS; after it
#: exits: exit code 0, no ``ConversationErrorEvent`` and the conversation's persisted
#: ``execution_status`` ``finished`` (a ``finish`` tool call, or a final message without tool
#: calls) write ``done``. ``result.json`` says how it ended; the conversation is copied out.
#: The key reaches OpenHands as ``LLM_API_KEY`` from the contract's ``OPENAI_API_KEY`` here, so
#: it is in no file and in no preset environment. Python, not a shell pipeline: images need
#: only ``python3``.
_WRAPPER = '''\
import json, os, pathlib, subprocess, sys
argv, prompt, events, conversation_out, conversations, max_arg = json.loads(sys.argv[1])
arena = pathlib.Path("/sandbox/.arena")
task = pathlib.Path(prompt).read_text()
argv = [*argv, *(["-t", task] if len(task.encode()) <= max_arg else ["-f", prompt])]
env = dict(os.environ, LLM_API_KEY=os.environ.get("OPENAI_API_KEY", ""))
actions, errors, finish = 0, [], None
with open(events, "wb") as record:
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
    except OSError as exc:
        print(f"arena: cannot start OpenHands: {exc}", file=sys.stderr)
        sys.exit(127)
    for line in proc.stdout:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        if not line.startswith(b"{"):
            continue  # its console lines ("Agent is working", the summary) go to the log only
        record.write(line)
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        action = event.get("action")
        if isinstance(action, dict):
            actions += 1
            if action.get("kind") == "FinishAction":
                finish = action.get("message")
        elif "code" in event and "detail" in event:  # ConversationErrorEvent
            errors.append({"code": event.get("code"), "detail": str(event.get("detail"))[:2000]})
    rc = proc.wait()
state, kept = None, None
found = sorted(pathlib.Path(conversations).glob("*/base_state.json"), key=lambda p: p.stat().st_mtime)
if found:
    folder = found[-1].parent
    base = json.loads(found[-1].read_text())
    state = base.get("execution_status")
    kept = [json.loads(p.read_text()) for p in sorted(folder.glob("events/event-*.json"))]
    errors = [{"code": e.get("code"), "detail": str(e.get("detail"))[:2000]} for e in kept
              if e.get("kind") == "ConversationErrorEvent"] or errors  # the record has them all
    with open(conversation_out, "w") as out:
        json.dump({"id": folder.name, "base_state": base, "events": kept}, out)
result = {"scaffold": "openhands", "exit_code": rc, "execution_status": state, "actions": actions,
          "finish_message": finish, "errors": errors}
(arena / "result.json").write_text(json.dumps(result))
if rc == 0 and not errors and state == "finished":
    (arena / "done").touch()
else:
    print(f"arena: OpenHands ended with exit {rc}, status {state!r}, {len(errors)} error(s); not done",
          file=sys.stderr)
sys.exit(rc)
'''


def _args(config: dict[str, Any]) -> list[str]:
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"openhands: unknown config keys {unknown} (known: {', '.join(CONFIG_KEYS)})")
    args = config.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("openhands: config.args must be a list of strings (extra `openhands` arguments)")
    return args


def command(scaffold: ScaffoldSpec, context: Context) -> list[str]:
    """The ``openhands`` command line, without the task (the wrapper adds ``-t``/``-f``)."""
    args = _args(scaffold.config)
    # Its own interpreter, isolated (-I): nothing in the task's environment changes how OpenHands
    # itself imports (it reads the bytecode installed beside its sources).
    home = (context.home or IMAGE_HOME).rstrip("/")
    return [f"{home}/bin/python", "-I", f"{home}/bin/openhands", "--headless", "--json", "--override-with-envs", *args]


def env(scaffold: ScaffoldSpec, context: Context) -> dict[str, str]:
    """LiteLLM's OpenAI client for the scaffold's model, at the proxy (the key: see the wrapper)."""
    return {**ENV, "LLM_MODEL": f"openai/{scaffold.model}", "LLM_BASE_URL": context.openai_base_url,
            "OPENHANDS_WORK_DIR": context.workdir}


def launch(scaffold: ScaffoldSpec, context: Context) -> Launch:
    spec = [command(scaffold, context), PROMPT, EVENTS, CONVERSATION, f"{PERSISTENCE_DIR}/conversations",
            MAX_TASK_ARG]
    return Launch(
        command=["python3", WRAPPER, json.dumps(spec)],
        env=env(scaffold, context),
        files={PROMPT: context.instructions.encode(), WRAPPER: _WRAPPER.encode()},
        artifacts={"openhands.events.jsonl": EVENTS, "openhands.conversation.json": CONVERSATION},
    )
