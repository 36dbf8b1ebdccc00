"""The chat-rubric agent: a multi-turn chat with a partner, every reply from the policy.

Standard library only. Reads ``$ARENA_SANDBOX_ROOT/.arena/task.json``; ``metadata.partner``
is a JSON list of the partner's messages. Each one is sent with the conversation so far to
``$OPENAI_BASE_URL`` (the Arena proxy); replies are streamed when ``metadata.stream`` is
"1" (or "alternate": every other turn). The replies, joined, are the answer the rubric
grades (``result.json``), then ``.arena/done``. A failed call exits 1 without ``done``.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path


def call(messages: list[dict], *, model: str, max_tokens: int, stream: bool, seed: int | None) -> str:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    if seed is not None:
        body["seed"] = seed
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + os.environ.get("OPENAI_API_KEY", "")},
        method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        if not stream:
            return json.loads(response.read())["choices"][0]["message"]["content"] or ""
        parts = []
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or []:
                parts.append((choice.get("delta") or {}).get("content") or "")
        return "".join(parts)


def main() -> int:
    root = Path(os.environ.get("ARENA_SANDBOX_ROOT", "/sandbox"))
    task = json.loads((root / ".arena" / "task.json").read_text(encoding="utf-8"))["task"]
    meta = task.get("metadata") or {}
    partner = json.loads(meta.get("partner") or json.dumps([task["instructions"]]))
    messages = [{"role": "system", "content": meta["system"]}] if meta.get("system") else []
    streaming = meta.get("stream", "0")
    seed = int(meta["seed"]) if meta.get("seed") else None
    replies = []
    try:
        for turn, said in enumerate(partner):
            messages.append({"role": "user", "content": said})
            stream = streaming == "1" or (streaming == "alternate" and turn % 2 == 1)
            reply = call(messages, model=os.environ.get("ARENA_MODEL", "default"),
                         max_tokens=int(meta.get("max_tokens", "48")), stream=stream,
                         seed=None if seed is None else seed + turn)
            messages.append({"role": "assistant", "content": reply})
            replies.append(reply)
    except Exception as exc:  # noqa: BLE001 - any failure: no done, the rollout fails
        print(f"agent: LLM call failed: {exc!r}", file=sys.stderr)
        return 1
    (root / ".arena" / "result.json").write_text(json.dumps({"answer": "\n".join(replies)}), encoding="utf-8")
    (root / ".arena" / "done").write_text("", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
