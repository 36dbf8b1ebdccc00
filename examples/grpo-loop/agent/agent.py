"""The grpo-loop agent: one LLM call, the answer written to ``answer.txt``.

Standard library only. Sandbox contract: reads ``$ARENA_SANDBOX_ROOT/.arena/task.json``,
sends the task's ``metadata.prompt`` as the user message to ``$OPENAI_BASE_URL`` (the
Arena proxy, which forwards to the policy server), writes the completion text to
``workspace/answer.txt`` and then ``.arena/done``. If the LLM call fails it exits 1
without ``done``.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path


def main() -> int:
    root = Path(os.environ.get("ARENA_SANDBOX_ROOT", "/sandbox"))
    task = json.loads((root / ".arena" / "task.json").read_text(encoding="utf-8"))["task"]
    meta = task.get("metadata") or {}
    body = {"model": os.environ.get("ARENA_MODEL", "default"),
            "messages": [{"role": "user", "content": meta.get("prompt", task["instructions"])}],
            "max_tokens": int(meta.get("max_tokens", "1"))}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "")},
        method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())["choices"][0]["message"]["content"] or ""
    except Exception as exc:  # noqa: BLE001 - any failure: no done, the rollout fails
        print(f"agent: LLM call failed: {exc!r}", file=sys.stderr)
        return 1
    (root / "workspace" / "answer.txt").write_text(answer.strip() + "\n", encoding="utf-8")
    (root / ".arena" / "done").write_text("", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
