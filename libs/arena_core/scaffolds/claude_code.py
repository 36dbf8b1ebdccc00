"""Claude Code (npm ``@anthropic-ai/claude-code``, its ``claude`` command) under the sandbox contract:
headless (``--print``, stream-json), every permission granted, its Anthropic API calls to Arena's
proxy, ``done`` written when it ends with a successful result. See docs/agents.md ("Claude Code").
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch

if TYPE_CHECKING:
    from arena_core.schemas import ScaffoldSpec

NAME = "claude-code"
WRAPPER = f"{SCAFFOLD_DIR}/claude-code.py"
PROMPT = f"{SCAFFOLD_DIR}/claude-code-task.txt"
#: Claude Code's own state (settings, the session's JSONL under ``projects/``): somewhere the
#: sandbox user may write (Arena's scaffold directory is not), the session copied out at the end.
CONFIG_DIR = "/tmp/claude-code"
#: Kept as artifacts: its stream-json events (stdout) and its session file.
EVENTS = "/sandbox/.arena/claude-code.events.jsonl"
SESSION = "/sandbox/.arena/claude-code.session.jsonl"

#: The tools offered by default (``config.tools`` changes them). Claude Code's own full set
#: (``config.tools: "default"``, 24 tools) adds the Agent tool (sub-agents: their calls are steps of
#: other conversations, and its list of sub-agents comes as a ``system`` message in mid-conversation),
#: cron, task, worktree, notebook, skill and web tools that have no use in a sandbox without network,
#: and ~64 KB to every request.
TOOLS = ("Bash", "Edit", "Read", "Write")
#: ``config.tools`` naming Claude Code's full built-in set (its own ``--tools default``).
ALL_TOOLS = "default"

#: Unattended and offline: no telemetry, error reports, update checks or other non-essential
#: traffic, no beta features beyond the Messages API's core, root-less "sandbox" mode.
ENV = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_BUG_COMMAND": "1",
    "IS_SANDBOX": "1",
    "CLAUDE_CONFIG_DIR": CONFIG_DIR,
}

#: ``config`` keys the preset understands (anything else is refused).
CONFIG_KEYS = ("tools", "allowed_tools", "disallowed_tools", "max_turns", "max_output_tokens",
               "append_system_prompt", "args")

#: Runs claude with the task on stdin, its stream-json to the log (stdout) and to EVENTS; after it
#: exits, the last ``result`` event decides: subtype ``success``, not an error, exit code 0 writes
#: ``done``. ``result.json`` carries the result either way; the session file is copied out.
#: Python, not a shell pipeline: images need only ``python3`` (no ``tee``, no ``pipefail``).
_WRAPPER = '''\
import json, pathlib, shutil, subprocess, sys
argv, prompt, events, config_dir, session_out = json.loads(sys.argv[1])
arena = pathlib.Path("/sandbox/.arena")
pathlib.Path(config_dir).mkdir(parents=True, exist_ok=True)
last = None
with open(prompt, "rb") as stdin, open(events, "wb") as record:
    try:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE)
    except OSError as exc:
        print(f"arena: cannot start Claude Code: {exc}", file=sys.stderr)
        sys.exit(127)
    for line in proc.stdout:
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        record.write(line)
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("type") == "result":
            last = event
    rc = proc.wait()
if last is not None:  # the session's own record: projects/<cwd>/<session id>.jsonl
    found = sorted(pathlib.Path(config_dir, "projects").glob(f"*/{last.get('session_id')}.jsonl"))
    if found:
        shutil.copyfile(found[0], session_out)
keys = ("subtype", "is_error", "num_turns", "stop_reason", "terminal_reason", "session_id", "result",
        "api_error_status")
result = {"scaffold": "claude-code", "exit_code": rc, **{k: last[k] for k in keys if last and k in last}}
(arena / "result.json").write_text(json.dumps(result))
if rc == 0 and last is not None and last.get("subtype") == "success" and not last.get("is_error"):
    (arena / "done").touch()
else:
    print(f"arena: Claude Code ended without a successful result (exit {rc}, "
          f"{(last or {}).get('subtype', 'no result event')}); not done", file=sys.stderr)
sys.exit(rc)
'''


def _options(config: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"claude-code: unknown config keys {unknown} (known: {', '.join(CONFIG_KEYS)})")
    tools = config.get("tools", list(TOOLS))
    if tools != ALL_TOOLS and (not isinstance(tools, list) or not all(_tool_name(t) for t in tools)):
        raise ValueError(f"claude-code: config.tools must be a list of Claude Code tool names (e.g. "
                         f"{list(TOOLS)}) or {ALL_TOOLS!r} (its full built-in set)")
    rules = {}
    for key in ("allowed_tools", "disallowed_tools"):
        value = config.get(key, [])
        if not isinstance(value, list) or not all(isinstance(r, str) and r.strip() and r == r.strip() for r in value):
            raise ValueError(f"claude-code: config.{key} must be a list of Claude Code permission rules "
                             '(tool names or e.g. "Bash(git *)")')
        rules[key] = value
    for key in ("max_turns", "max_output_tokens"):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"claude-code: config.{key} must be a positive integer")
    prompt = config.get("append_system_prompt", "")
    if not isinstance(prompt, str):
        raise ValueError("claude-code: config.append_system_prompt must be a string")
    args = config.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("claude-code: config.args must be a list of strings (extra claude arguments)")
    return {"tools": tools, **rules, "max_turns": config.get("max_turns"),
            "max_output_tokens": config.get("max_output_tokens"), "append_system_prompt": prompt, "args": args}


def _tool_name(name: object) -> bool:
    """A built-in tool's name: one word (``--tools`` takes a comma-separated list)."""
    return isinstance(name, str) and bool(name) and name.replace("_", "").isalnum()


def command(scaffold: ScaffoldSpec, context: Context) -> list[str]:
    """The ``claude`` command line (the prompt comes on stdin)."""
    options = _options(scaffold.config)
    claude = f"{context.home.rstrip('/')}/bin/claude" if context.home else "claude"
    argv = [claude, "--print", "--output-format=stream-json", "--verbose", "--permission-mode=bypassPermissions",
            f"--model={scaffold.model}",
            f"--tools={options['tools'] if options['tools'] == ALL_TOOLS else ','.join(options['tools'])}"]
    # permission rules, one argument each (a rule may hold spaces: "Bash(git *)")
    argv += [f"--allowedTools={rule}" for rule in options["allowed_tools"]]
    argv += [f"--disallowedTools={rule}" for rule in options["disallowed_tools"]]
    if options["max_turns"] is not None:
        argv.append(f"--max-turns={options['max_turns']}")
    if options["append_system_prompt"]:
        argv += ["--append-system-prompt", options["append_system_prompt"]]
    return [*argv, *options["args"]]


def env(scaffold: ScaffoldSpec) -> dict[str, str]:
    """The preset's environment: offline, and every model alias mapped to the rollout's model."""
    out = dict(ENV)
    for var in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        out[var] = scaffold.model
    max_output = _options(scaffold.config)["max_output_tokens"]
    if max_output is not None:
        out["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output)
    return out


def launch(scaffold: ScaffoldSpec, context: Context) -> Launch:
    spec = [command(scaffold, context), PROMPT, EVENTS, CONFIG_DIR, SESSION]
    return Launch(
        command=["python3", WRAPPER, json.dumps(spec)],
        env=env(scaffold),
        files={PROMPT: context.instructions.encode(), WRAPPER: _WRAPPER.encode()},
        artifacts={"claude-code.events.jsonl": EVENTS, "claude-code.session.jsonl": SESSION},
    )
