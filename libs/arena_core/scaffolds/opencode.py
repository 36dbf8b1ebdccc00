"""OpenCode (npm ``opencode-ai``, its ``opencode`` command) under the sandbox contract: ``opencode
run`` headless with JSON events, every permission granted, its calls to Arena's proxy through an
OpenAI-compatible provider, ``done`` written when it ends without an error. See docs/agents.md
("OpenCode").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch

if TYPE_CHECKING:
    from arena_core.schemas import ScaffoldSpec

NAME = "opencode"
WRAPPER = f"{SCAFFOLD_DIR}/opencode.py"
CONFIG = f"{SCAFFOLD_DIR}/opencode.json"
PROMPT = f"{SCAFFOLD_DIR}/opencode-task.txt"
#: Kept as artifacts: its JSON events (stdout) and the session as ``opencode export`` gives it.
EVENTS = "/sandbox/.arena/opencode.events.jsonl"
SESSION = "/sandbox/.arena/opencode.session.json"
#: The provider id Arena's proxy has in OpenCode's configuration (models are ``arena/<model>``).
PROVIDER = "arena"

#: Unattended and offline: no update check, no models.dev catalogue, no LSP downloads, no
#: sharing, no Claude Code compatibility files; its own files under the sandbox's /tmp (HOME).
ENV = {
    "OPENCODE_CONFIG": CONFIG,
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_CLAUDE_CODE": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
}

#: Every tool allowed without asking (a headless run has nobody to ask), the web excepted.
PERMISSION = {"edit": "allow", "bash": "allow", "webfetch": "deny", "external_directory": "allow",
              "doom_loop": "allow"}

#: ``config`` keys the preset understands (anything else is refused).
CONFIG_KEYS = ("context_tokens", "max_output_tokens", "agent", "args", "opencode")

#: Runs ``opencode run`` (the task as its message), its JSON events to the log (stdout) and to
#: EVENTS; after it exits: exit code 0 with no ``error`` event writes ``done``. ``result.json``
#: carries the session id, steps and the last step's finish reason; the session is exported.
#: Python, not a shell pipeline: images need only ``python3``.
_WRAPPER = '''\
import json, pathlib, subprocess, sys
argv, prompt, events, session_out, opencode = json.loads(sys.argv[1])
arena = pathlib.Path("/sandbox/.arena")
argv = [*argv, pathlib.Path(prompt).read_text()]
session, steps, reason, errors = None, 0, None, []
with open(events, "wb") as record:
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    except OSError as exc:
        print(f"arena: cannot start OpenCode: {exc}", file=sys.stderr)
        sys.exit(127)
    for line in proc.stdout:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        record.write(line)
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        session = event.get("sessionID") or session
        if event.get("type") == "step_finish":
            steps += 1
            reason = (event.get("part") or {}).get("reason")
        elif event.get("type") == "error":
            errors.append(event.get("error"))
    rc = proc.wait()
if session:
    with open(session_out, "wb") as out:
        subprocess.run([opencode, "export", session], stdin=subprocess.DEVNULL, stdout=out,
                       stderr=subprocess.DEVNULL, timeout=60, check=False)
result = {"scaffold": "opencode", "exit_code": rc, "session_id": session, "steps": steps,
          "finish_reason": reason, "errors": errors}
(arena / "result.json").write_text(json.dumps(result))
if rc == 0 and not errors and steps:
    (arena / "done").touch()
else:
    print(f"arena: OpenCode ended with exit {rc}, {len(errors)} error(s), {steps} step(s); not done",
          file=sys.stderr)
sys.exit(rc)
'''


def _positive(config: dict[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"opencode: config.{key} must be a positive integer")
    return value


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, dictionaries merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config(scaffold: ScaffoldSpec, context: Context) -> dict[str, Any]:
    """OpenCode's configuration (``opencode.json``): the proxy as its only provider."""
    options = scaffold.config
    unknown = sorted(set(options) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"opencode: unknown config keys {unknown} (known: {', '.join(CONFIG_KEYS)})")
    own = options.get("opencode", {})
    if not isinstance(own, dict):
        raise ValueError("opencode: config.opencode must be an object (merged into opencode.json)")
    model = f"{PROVIDER}/{scaffold.model}"
    preset = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "model": model,
        "small_model": model,
        "provider": {PROVIDER: {
            "npm": "@ai-sdk/openai-compatible",
            "name": "Arena",
            # the key stays in OPENAI_API_KEY: never in a file the agent or a trajectory keeps
            "options": {"baseURL": context.openai_base_url, "apiKey": "{env:OPENAI_API_KEY}"},
            "models": {scaffold.model: {
                "name": scaffold.model, "tool_call": True,
                "limit": {"context": _positive(options, "context_tokens", 131072),
                          "output": _positive(options, "max_output_tokens", 8192)},
            }},
        }},
        "permission": dict(PERMISSION),
    }
    return merge(preset, own)


def command(scaffold: ScaffoldSpec, context: Context) -> list[str]:
    """The ``opencode run`` command line, without its message (the wrapper appends the task)."""
    options = scaffold.config
    agent = options.get("agent", "build")
    args = options.get("args", [])
    if not isinstance(agent, str) or not agent:
        raise ValueError("opencode: config.agent must be an agent name (build, plan, ...)")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("opencode: config.args must be a list of strings (extra `opencode run` arguments)")
    opencode = f"{context.home.rstrip('/')}/bin/opencode" if context.home else "opencode"
    # --title: a session title given is one LLM call (the title's) fewer, outside the agent's turns
    return [opencode, "run", "--format=json", "--pure", "--title=arena", f"--model={PROVIDER}/{scaffold.model}",
            f"--agent={agent}", *args, "--"]


def launch(scaffold: ScaffoldSpec, context: Context) -> Launch:
    argv = command(scaffold, context)
    spec = [argv, PROMPT, EVENTS, SESSION, argv[0]]
    return Launch(
        command=["python3", WRAPPER, json.dumps(spec)],
        env=dict(ENV),
        files={
            CONFIG: json.dumps(config(scaffold, context), indent=1).encode(),
            PROMPT: context.instructions.encode(),
            WRAPPER: _WRAPPER.encode(),
        },
        artifacts={"opencode.events.jsonl": EVENTS, "opencode.session.json": SESSION},
    )
