"""The quickstart agent: one LLM call, one unified diff, ``git apply``.

Standard library only, so it runs with any Python 3 inside any sandbox. It follows
Arena's sandbox contract:

- reads its task from ``$ARENA_SANDBOX_ROOT/.arena/task.json``
  (``{"rollout_id": ..., "task": {...}}``);
- calls the OpenAI-compatible API at ``$OPENAI_BASE_URL`` with ``$OPENAI_API_KEY``;
- edits the working copy ``$ARENA_SANDBOX_ROOT/workspace``;
- writes ``.arena/result.json`` and then ``.arena/done``.

``ARENA_SANDBOX_ROOT`` defaults to ``/sandbox``; set it to run the agent outside a
sandbox. If the LLM call fails the agent exits 1 without writing ``done``, so Arena
records the rollout as failed rather than as a finished attempt.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

SYSTEM_PROMPT = (
    "You are a careful software engineer. You are given a task and the Python files of a "
    "repository. Fix the problem with the smallest correct change. Answer with a short "
    "explanation followed by exactly one unified diff (as produced by `git diff`, paths "
    "prefixed a/ and b/, relative to the repository root) in a ```diff fenced block."
)

MAX_FILE_CHARS = 20_000  # per file, so a large repository cannot blow the context
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", ".pytest_cache"}
DIFF_BLOCK = re.compile(r"```diff[^\n]*\n(.*?)```", re.DOTALL)


def sandbox_paths() -> tuple[Path, Path]:
    root = Path(os.environ.get("ARENA_SANDBOX_ROOT", "/sandbox"))
    return root / ".arena", root / "workspace"


def repo_files(workspace: Path) -> list[tuple[str, str]]:
    """``(relative path, text)`` of every ``.py`` file in the working copy, sorted."""
    files = []
    for path in sorted(workspace.rglob("*.py")):
        rel = path.relative_to(workspace)
        if any(part in SKIP_DIRS for part in rel.parts):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > MAX_FILE_CHARS:
            text = text[:MAX_FILE_CHARS] + "\n# ... (truncated)\n"
        files.append((rel.as_posix(), text))
    return files


def build_messages(task: dict, workspace: Path) -> list[dict]:
    parts = [task["instructions"].strip(), "", "Repository files:"]
    for rel, text in repo_files(workspace):
        parts += ["", f"--- {rel} ---", text.rstrip("\n")]
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "\n".join(parts) + "\n"},
    ]


def chat(messages: list[dict]) -> str:
    """POST one chat completion and return the assistant's text. Raises on any failure."""
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    body = {
        "model": os.environ.get("ARENA_MODEL", "default"),
        "messages": messages,
        "max_tokens": 1024,
    }
    request = urllib.request.Request(
        base + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", ""),
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        payload = json.loads(response.read())
    return payload["choices"][0]["message"]["content"] or ""


def extract_diff(text: str) -> str | None:
    match = DIFF_BLOCK.search(text)
    if match is None:
        return None
    diff = match.group(1)
    return diff if diff.endswith("\n") else diff + "\n"


def apply_diff(diff: str, workspace: Path) -> tuple[bool, str | None]:
    env = dict(os.environ, HOME=os.environ.get("HOME", "/tmp"))
    proc = subprocess.run(
        ["git", "apply", "--whitespace=nowarn", "-"],
        input=diff,
        cwd=workspace,
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        return False, (proc.stderr or proc.stdout).strip() or f"git apply exited {proc.returncode}"
    return True, None


def main() -> int:
    arena, workspace = sandbox_paths()
    envelope = json.loads((arena / "task.json").read_text(encoding="utf-8"))
    task = envelope["task"]
    rollout_id = envelope.get("rollout_id", "")
    try:
        content = chat(build_messages(task, workspace))
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as exc:
        detail = ""
        if isinstance(exc, urllib.error.HTTPError):
            detail = exc.read().decode("utf-8", "replace")[:2000]
        print(f"agent[{rollout_id}]: LLM call failed: {exc!r} {detail}", file=sys.stderr)
        return 1

    diff = extract_diff(content)
    if diff is None:
        applied, error = False, "the model's answer holds no ```diff block"
    else:
        applied, error = apply_diff(diff, workspace)
    print(f"agent[{rollout_id}]: applied={applied} error={error}", file=sys.stderr)
    (arena / "result.json").write_text(json.dumps({"applied": applied, "error": error}), encoding="utf-8")
    (arena / "done").write_text("", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
