"""Codex CLI (npm ``@openai/codex``, its native ``codex`` binary) under the sandbox contract: ``codex
exec`` non-interactive with JSON events, approvals and Codex's own sandbox off (Arena's sandbox is
the sandbox), its OpenAI Responses API calls to Arena's proxy through a custom provider, ``done``
written when its turn completes. See docs/agents.md ("Codex CLI").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch

if TYPE_CHECKING:
    from arena_core.schemas import ScaffoldSpec

NAME = "codex"
WRAPPER = f"{SCAFFOLD_DIR}/codex.py"
PROMPT = f"{SCAFFOLD_DIR}/codex-task.txt"
#: Codex's home (``CODEX_HOME``: config.toml, its sessions, state databases, shell snapshots),
#: writable by the sandbox user. Not under /tmp: there Codex refuses to create the helper aliases
#: (``apply_patch``) it puts on the ``PATH`` of the commands it runs.
CODEX_HOME = "/sandbox/.arena/codex"
#: Kept as artifacts: its JSON events (stdout), its session record (the rollout JSONL under
#: ``$CODEX_HOME/sessions``) and its last message.
EVENTS = "/sandbox/.arena/codex.events.jsonl"
SESSION = "/sandbox/.arena/codex.session.jsonl"
LAST_MESSAGE = "/sandbox/.arena/codex.last-message.txt"
#: The provider id Arena's proxy has in Codex's configuration.
PROVIDER = "arena"

ENV = {"CODEX_HOME": CODEX_HOME, "NO_COLOR": "1"}

#: ``config`` keys the preset understands (anything else is refused).
CONFIG_KEYS = ("context_tokens", "reasoning_effort", "config", "args")

#: Runs ``codex exec`` (the task on stdin), its JSON events to the log (stdout) and to EVENTS; after
#: it exits: exit code 0, a ``turn.completed`` and no ``turn.failed`` write ``done``. ``result.json``
#: carries the thread id, the turn's usage and the errors; the session record is copied out.
_WRAPPER = '''\
import json, pathlib, shutil, subprocess, sys
argv, prompt, events, home, config, session_out = json.loads(sys.argv[1])
arena = pathlib.Path("/sandbox/.arena")
pathlib.Path(home).mkdir(parents=True, exist_ok=True)
pathlib.Path(home, "config.toml").write_text(config)
thread, completed, failed, errors, usage, items = None, 0, 0, [], None, 0
with open(prompt, "rb") as stdin, open(events, "wb") as record:
    try:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE)
    except OSError as exc:
        print(f"arena: cannot start Codex: {exc}", file=sys.stderr)
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
        kind = event.get("type")
        if kind == "thread.started":
            thread = event.get("thread_id")
        elif kind == "turn.completed":
            completed += 1
            usage = event.get("usage")
        elif kind == "turn.failed":
            failed += 1
            errors.append((event.get("error") or {}).get("message"))
        elif kind == "error":
            errors.append(event.get("message"))
        elif kind == "item.completed":
            items += 1
    rc = proc.wait()
if thread:  # its own record: sessions/YYYY/MM/DD/rollout-<time>-<thread id>.jsonl
    found = sorted(pathlib.Path(home, "sessions").glob(f"*/*/*/rollout-*-{thread}.jsonl"))
    if found:
        shutil.copyfile(found[0], session_out)
result = {"scaffold": "codex", "exit_code": rc, "thread_id": thread, "turns_completed": completed,
          "turns_failed": failed, "items": items, "usage": usage, "errors": errors}
(arena / "result.json").write_text(json.dumps(result))
if rc == 0 and completed and not failed:
    (arena / "done").touch()
else:
    print(f"arena: Codex ended with exit {rc}, {completed} turn(s) completed, {failed} failed; not done",
          file=sys.stderr)
sys.exit(rc)
'''


def _toml(value: Any) -> str:
    """A TOML value (strings as JSON strings: a valid TOML basic string for these characters)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"codex: cannot write {value!r} as TOML")


def to_toml(config: dict[str, Any]) -> str:
    """``config`` as a TOML document: plain keys first, then one table per nested dictionary."""
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []

    def walk(prefix: str, table: dict[str, Any]) -> None:
        plain = {k: v for k, v in table.items() if not isinstance(v, dict)}
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        if prefix:
            tables.append((prefix, plain))
        else:
            lines.extend(f"{json.dumps(k)} = {_toml(v)}" for k, v in plain.items())
        for key, value in nested.items():
            walk(f"{prefix}.{json.dumps(key)}" if prefix else json.dumps(key), value)

    walk("", config)
    for name, plain in tables:
        if plain:
            lines += ["", f"[{name}]", *(f"{json.dumps(k)} = {_toml(v)}" for k, v in plain.items())]
    return "\n".join(lines) + "\n"


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, dictionaries merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _positive(config: dict[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"codex: config.{key} must be a positive integer")
    return value


def config(scaffold: ScaffoldSpec, context: Context) -> dict[str, Any]:
    """Codex's ``config.toml`` (as a dictionary): the proxy as its only model provider, speaking the
    Responses API; no approvals, no sandbox of its own, no update check, analytics or feedback."""
    options = scaffold.config
    unknown = sorted(set(options) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"codex: unknown config keys {unknown} (known: {', '.join(CONFIG_KEYS)})")
    own = options.get("config", {})
    if not isinstance(own, dict):
        raise ValueError("codex: config.config must be an object (merged into config.toml)")
    effort = options.get("reasoning_effort")
    if effort is not None and effort not in ("minimal", "low", "medium", "high", "xhigh", "none"):
        raise ValueError("codex: config.reasoning_effort must be one of minimal, low, medium, high, xhigh, none")
    preset: dict[str, Any] = {
        "model": scaffold.model,
        "model_provider": PROVIDER,
        # the model is not one Codex knows: its context window given (when to compact)
        "model_context_window": _positive(options, "context_tokens", 131072),
        "approval_policy": "never",
        "sandbox_mode": "danger-full-access",
        "check_for_update_on_startup": False,
        # only function tools: Codex's hosted web search has no network in a sandbox, and its
        # sub-agents (a `namespace` tool) would be conversations of their own; Arena's proxy
        # translates function tools only and refuses a request with either
        "web_search": "disabled",
        "features": {"multi_agent": False},
        "model_providers": {PROVIDER: {
            "name": "Arena",
            "base_url": context.openai_base_url,
            # the key stays in OPENAI_API_KEY: never in a file the agent or a trajectory keeps
            "env_key": "OPENAI_API_KEY",
            "wire_api": "responses",
        }},
        "analytics": {"enabled": False},
        "feedback": {"enabled": False},
    }
    if effort is not None:
        preset["model_reasoning_effort"] = effort
    return merge(preset, own)


def command(scaffold: ScaffoldSpec, context: Context) -> list[str]:
    """The ``codex exec`` command line (the prompt comes on stdin: ``-``)."""
    args = scaffold.config.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("codex: config.args must be a list of strings (extra `codex exec` arguments)")
    codex = f"{context.home.rstrip('/')}/bin/codex" if context.home else "codex"
    return [codex, "exec", "--json", "--dangerously-bypass-approvals-and-sandbox", "--skip-git-repo-check",
            "--color", "never", "--cd", context.workdir, "--output-last-message", LAST_MESSAGE, *args, "-"]


def launch(scaffold: ScaffoldSpec, context: Context) -> Launch:
    spec = [command(scaffold, context), PROMPT, EVENTS, CODEX_HOME, to_toml(config(scaffold, context)), SESSION]
    return Launch(
        command=["python3", WRAPPER, json.dumps(spec)],
        env=dict(ENV),
        files={PROMPT: context.instructions.encode(), WRAPPER: _WRAPPER.encode()},
        artifacts={"codex.events.jsonl": EVENTS, "codex.session.jsonl": SESSION,
                   "codex.last-message.txt": LAST_MESSAGE},
    )
