"""Gemini CLI (npm ``@google/gemini-cli``, its ``gemini`` command) under the sandbox contract:
headless (the task on stdin, ``--output-format stream-json``), every tool approved (``--yolo``), its
Gemini API calls (``models/{model}:streamGenerateContent``) to Arena's proxy through
``GOOGLE_GEMINI_BASE_URL``, ``done`` written when it ends with a successful result. See
docs/agents.md ("Gemini CLI").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch

if TYPE_CHECKING:
    from arena_core.schemas import ScaffoldSpec

NAME = "gemini-cli"
WRAPPER = f"{SCAFFOLD_DIR}/gemini-cli.py"
PROMPT = f"{SCAFFOLD_DIR}/gemini-cli-task.txt"
#: Gemini CLI's home (``GEMINI_CLI_HOME``: ``.gemini/settings.json``, its sessions under
#: ``.gemini/tmp/<project>/chats``): somewhere the sandbox user may write; the session copied out.
GEMINI_HOME = "/tmp/gemini-cli"
#: Kept as artifacts: its stream-json events (stdout) and its session record (JSONL).
EVENTS = "/sandbox/.arena/gemini-cli.events.jsonl"
SESSION = "/sandbox/.arena/gemini-cli.session.jsonl"

#: Unattended and offline: no telemetry, the workspace trusted (else yolo is turned back to
#: "default", which asks), no relaunch of itself in a child node.
ENV = {
    "GEMINI_CLI_HOME": GEMINI_HOME,
    "GEMINI_TELEMETRY_ENABLED": "false",
    "GEMINI_CLI_TRUST_WORKSPACE": "true",
    "GEMINI_CLI_NO_RELAUNCH": "true",
    "NO_COLOR": "1",
}

#: Gemini CLI's settings.json (merged key by key with ``config.settings``): the Gemini API with a
#: key (the proxy's, from ``GEMINI_API_KEY``), no update check, no usage statistics, no telemetry.
#: (With only ``GOOGLE_GEMINI_BASE_URL`` set it would pick its "gateway" auth type, which its
#: headless mode refuses: "Invalid auth method selected".)
SETTINGS: dict[str, Any] = {
    "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
    "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}

#: ``config`` keys the preset understands (anything else is refused).
CONFIG_KEYS = ("settings", "args")

#: Runs gemini with the task on stdin, its stream-json to the log (stdout) and to EVENTS; after it
#: exits, the last ``result`` event decides: status ``success`` and exit code 0 write ``done``.
#: ``result.json`` carries the result either way; the session file is copied out. The key reaches
#: Gemini CLI as ``GEMINI_API_KEY``, copied from the contract's ``OPENAI_API_KEY`` here (never in a
#: file).
_WRAPPER = '''\
import json, os, pathlib, shutil, subprocess, sys
argv, prompt, events, home, settings, session_out = json.loads(sys.argv[1])
arena = pathlib.Path("/sandbox/.arena")
pathlib.Path(home, ".gemini").mkdir(parents=True, exist_ok=True)
pathlib.Path(home, ".gemini", "settings.json").write_text(settings)
env = {**os.environ, "GEMINI_API_KEY": os.environ.get("GEMINI_API_KEY") or os.environ.get("OPENAI_API_KEY", "")}
last, session = None, None
with open(prompt, "rb") as stdin, open(events, "wb") as record:
    try:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE, env=env)
    except OSError as exc:
        print(f"arena: cannot start Gemini CLI: {exc}", file=sys.stderr)
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
        session = event.get("session_id") or session
        if event.get("type") == "result":
            last = event
    rc = proc.wait()
if session:  # its own record: .gemini/tmp/<project>/chats/session-<time>-<id's first 8>.jsonl
    found = sorted(pathlib.Path(home, ".gemini", "tmp").glob(f"*/chats/session-*-{session[:8]}.jsonl"))
    if found:
        shutil.copyfile(found[-1], session_out)
result = {"scaffold": "gemini-cli", "exit_code": rc, "session_id": session,
          **{k: last[k] for k in ("status", "error", "stats") if last and k in last}}
(arena / "result.json").write_text(json.dumps(result))
if rc == 0 and last is not None and last.get("status") == "success":
    (arena / "done").touch()
else:
    print(f"arena: Gemini CLI ended without a successful result (exit {rc}, "
          f"{(last or {}).get('status', 'no result event')}); not done", file=sys.stderr)
sys.exit(rc)
'''


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, dictionaries merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _options(config: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"gemini-cli: unknown config keys {unknown} (known: {', '.join(CONFIG_KEYS)})")
    settings = config.get("settings", {})
    if not isinstance(settings, dict):
        raise ValueError("gemini-cli: config.settings must be an object (merged into settings.json)")
    args = config.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("gemini-cli: config.args must be a list of strings (extra gemini arguments)")
    return {"settings": settings, "args": args}


def settings(scaffold: ScaffoldSpec) -> dict[str, Any]:
    return merge(SETTINGS, _options(scaffold.config)["settings"])


def command(scaffold: ScaffoldSpec, context: Context) -> list[str]:
    """The ``gemini`` command line (the prompt comes on stdin: headless without a terminal)."""
    gemini = f"{context.home.rstrip('/')}/bin/gemini" if context.home else "gemini"
    return [gemini, "--yolo", "--output-format", "stream-json", "--model", scaffold.model,
            *_options(scaffold.config)["args"]]


def env(context: Context) -> dict[str, str]:
    """The preset's environment: the proxy's root for the rollout as the Gemini API's base URL (the
    SDK appends ``/v1beta/models/{model}:streamGenerateContent``)."""
    return {**ENV, "GOOGLE_GEMINI_BASE_URL": context.anthropic_base_url}


def launch(scaffold: ScaffoldSpec, context: Context) -> Launch:
    spec = [command(scaffold, context), PROMPT, EVENTS, GEMINI_HOME, json.dumps(settings(scaffold), indent=1), SESSION]
    return Launch(
        command=["python3", WRAPPER, json.dumps(spec)],
        env=env(context),
        files={PROMPT: context.instructions.encode(), WRAPPER: _WRAPPER.encode()},
        artifacts={"gemini-cli.events.jsonl": EVENTS, "gemini-cli.session.jsonl": SESSION},
    )
