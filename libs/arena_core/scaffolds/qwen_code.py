"""Qwen Code (npm ``@qwen-code/qwen-code``, its ``qwen`` command) under the sandbox contract:
headless (the task on stdin, ``--output-format stream-json``), every tool approved (yolo), its
OpenAI chat calls to Arena's proxy, ``done`` written when it ends with a successful result. See
docs/agents.md ("Qwen Code").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch

if TYPE_CHECKING:
    from arena_core.schemas import ScaffoldSpec

NAME = "qwen-code"
WRAPPER = f"{SCAFFOLD_DIR}/qwen-code.py"
PROMPT = f"{SCAFFOLD_DIR}/qwen-code-task.txt"
#: Qwen Code's home (``QWEN_HOME``: settings.json, its sessions under ``projects/<cwd>/chats``):
#: somewhere the sandbox user may write; the session copied out at the end.
QWEN_HOME = "/tmp/qwen-code"
#: Kept as artifacts: its stream-json events (stdout) and its session file (JSONL).
EVENTS = "/sandbox/.arena/qwen-code.events.jsonl"
SESSION = "/sandbox/.arena/qwen-code.session.jsonl"

#: Unattended and offline: no telemetry, no usage statistics, no update check, no yolo notice.
ENV = {
    "QWEN_HOME": QWEN_HOME,
    "QWEN_TELEMETRY_ENABLED": "false",
    "QWEN_USAGE_STATISTICS_ENABLED": "false",
    "QWEN_CODE_SKIP_UPDATE_CHECK_ONCE": "true",
    "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    "QWEN_DISABLE_AUTO_TITLE": "1",
    "NO_COLOR": "1",
}

#: Qwen Code's settings.json (merged key by key with ``config.settings``): the proxy as its
#: OpenAI provider (the key stays in ``OPENAI_API_KEY``), no update check, no telemetry.
SETTINGS: dict[str, Any] = {
    "general": {"enableAutoUpdate": False, "disableUpdateNag": True},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "security": {"auth": {"selectedType": "openai"}},
    "ui": {"hideTips": True},
}

#: ``config`` keys the preset understands (anything else is refused).
CONFIG_KEYS = ("max_session_turns", "max_output_tokens", "exclude_tools", "core_tools", "append_system_prompt",
               "settings", "args")

#: Runs qwen with the task on stdin (a positional prompt would be read as options when it starts with
#: ``-``, and qwen ignores one after ``--``), its stream-json to the log (stdout) and to
#: EVENTS; after it exits, the last ``result`` event decides: subtype ``success``, not an error,
#: exit code 0 writes ``done``. ``result.json`` carries the result either way; the session file
#: (``$QWEN_HOME/projects/<cwd>/chats/<session id>.jsonl``) is copied out.
_WRAPPER = '''\
import json, pathlib, shutil, subprocess, sys
argv, prompt, events, home, settings, session_out = json.loads(sys.argv[1])
arena = pathlib.Path("/sandbox/.arena")
pathlib.Path(home).mkdir(parents=True, exist_ok=True)
pathlib.Path(home, "settings.json").write_text(settings)
last, session = None, None
with open(prompt, "rb") as stdin, open(events, "wb") as record:
    try:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE)
    except OSError as exc:
        print(f"arena: cannot start Qwen Code: {exc}", file=sys.stderr)
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
if session:  # the session's own record: projects/<cwd>/chats/<session id>.jsonl
    found = sorted(pathlib.Path(home, "projects").glob(f"*/chats/{session}.jsonl"))
    if found:
        shutil.copyfile(found[0], session_out)
keys = ("subtype", "is_error", "num_turns", "result", "duration_ms", "usage", "error")
result = {"scaffold": "qwen-code", "exit_code": rc, "session_id": session,
          **{k: last[k] for k in keys if last and k in last}}
(arena / "result.json").write_text(json.dumps(result))
if rc == 0 and last is not None and last.get("subtype") == "success" and not last.get("is_error"):
    (arena / "done").touch()
else:
    print(f"arena: Qwen Code ended without a successful result (exit {rc}, "
          f"{(last or {}).get('subtype', 'no result event')}); not done", file=sys.stderr)
sys.exit(rc)
'''


def _strings(config: dict[str, Any], key: str) -> list[str]:
    value = config.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"qwen-code: config.{key} must be a list of strings")
    return value


def _options(config: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"qwen-code: unknown config keys {unknown} (known: {', '.join(CONFIG_KEYS)})")
    for key in ("max_session_turns", "max_output_tokens"):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"qwen-code: config.{key} must be a positive integer")
    prompt = config.get("append_system_prompt", "")
    if not isinstance(prompt, str):
        raise ValueError("qwen-code: config.append_system_prompt must be a string")
    settings = config.get("settings", {})
    if not isinstance(settings, dict):
        raise ValueError("qwen-code: config.settings must be an object (merged into settings.json)")
    return {"max_session_turns": config.get("max_session_turns"), "max_output_tokens": config.get("max_output_tokens"),
            "exclude_tools": _strings(config, "exclude_tools"), "core_tools": _strings(config, "core_tools"),
            "append_system_prompt": prompt, "settings": settings, "args": _strings(config, "args")}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, dictionaries merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def settings(scaffold: ScaffoldSpec, context: Context) -> dict[str, Any]:
    """Qwen Code's ``settings.json``: the proxy as its OpenAI endpoint, nothing else reached."""
    return merge(SETTINGS, _options(scaffold.config)["settings"])


def command(scaffold: ScaffoldSpec, context: Context) -> list[str]:
    """The ``qwen`` command line (the prompt comes on stdin)."""
    options = _options(scaffold.config)
    qwen = f"{context.home.rstrip('/')}/bin/qwen" if context.home else "qwen"
    argv = [qwen, "--yolo", "--output-format", "stream-json", "--auth-type", "openai",
            "--openai-base-url", context.openai_base_url, "--model", scaffold.model, "--chat-recording"]
    if options["max_session_turns"] is not None:
        argv += ["--max-session-turns", str(options["max_session_turns"])]
    for tool in options["core_tools"]:
        argv += ["--core-tools", tool]
    for tool in options["exclude_tools"]:
        argv += ["--exclude-tools", tool]
    if options["append_system_prompt"]:
        argv += ["--append-system-prompt", options["append_system_prompt"]]
    return [*argv, *options["args"]]


def env(scaffold: ScaffoldSpec) -> dict[str, str]:
    out = dict(ENV)
    out["OPENAI_MODEL"] = scaffold.model
    max_output = _options(scaffold.config)["max_output_tokens"]
    if max_output is not None:
        out["QWEN_CODE_MAX_OUTPUT_TOKENS"] = str(max_output)
    return out


def launch(scaffold: ScaffoldSpec, context: Context) -> Launch:
    spec = [command(scaffold, context), PROMPT, EVENTS, QWEN_HOME,
            json.dumps(settings(scaffold, context), indent=1), SESSION]
    return Launch(
        command=["python3", WRAPPER, json.dumps(spec)],
        env=env(scaffold),
        files={PROMPT: context.instructions.encode(), WRAPPER: _WRAPPER.encode()},
        artifacts={"qwen-code.events.jsonl": EVENTS, "qwen-code.session.jsonl": SESSION},
    )
