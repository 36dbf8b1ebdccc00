"""A scripted, seeded LLM behind an OpenAI-compatible HTTP API, shaped like vLLM's.

For demos and tests: no weights, no GPU. It answers ``/v1/chat/completions`` with a
response drawn from a script file, chosen by the request's ``seed`` so a group of
rollouts with seeds ``s, s+1, ...`` gets a reproducible mix of answers. Like vLLM
with ``return_token_ids``, it returns ``prompt_token_ids`` and ``choices[0].token_ids``,
and per-token ``logprobs`` (with ``top_logprobs`` alternatives when asked).

Tokenizer: bytes. A chat is rendered as ``<|role|>\\ncontent\\n`` per message plus
``<|assistant|>\\n``; token id = byte value + 3 (0 pad, 1 bos, 2 eos). Real enough
that ids, counts, truncation by ``max_tokens`` and decoding are all exact.

Script file: ``{"responses": [{"label": str, "weight": float, "content": str}, ...]}``.

Run: ``python -m arena.scripted_llm --script FILE --port 9093``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import math
import random
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

BOS, EOS, OFFSET = 1, 2, 3


class ScriptedResponse(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    content: str
    weight: float = 1.0


class Script(msgspec.Struct, frozen=True, kw_only=True):
    responses: list[ScriptedResponse]


def load_script(path: str | Path) -> Script:
    script = msgspec.json.decode(Path(path).read_bytes(), type=Script)
    if not script.responses or any(r.weight < 0 for r in script.responses):
        raise ValueError(f"{path}: need at least one response, with non-negative weights")
    return script


def encode_text(text: str) -> list[int]:
    return [b + OFFSET for b in text.encode("utf-8")]


def decode_ids(ids: list[int]) -> str:
    return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8", errors="replace")


def token_str(token_id: int) -> str:
    if token_id < OFFSET:
        return ["<pad>", "<s>", "</s>"][token_id]
    b = token_id - OFFSET
    return chr(b) if 32 <= b < 127 or b in (9, 10) else f"bytes:\\x{b:02x}"


def render_chat(messages: list[dict[str, Any]]) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content or ''}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


class ScriptedLLM:
    """The pure model: messages + sampling in, a vLLM-shaped response out."""

    def __init__(self, script: Script, *, model: str = "scripted", seed: int = 0, policy_version: str = "0"):
        self.script = script
        self.model = model
        self.policy_version = policy_version
        self._unseeded = itertools.count(seed * 1_000_003)

    def choose(self, seed: int | None) -> ScriptedResponse:
        rng = random.Random(seed if seed is not None else next(self._unseeded))
        total = sum(r.weight for r in self.script.responses)
        x = rng.random() * total
        for response in self.script.responses:
            x -= response.weight
            if x < 0:
                return response
        return self.script.responses[-1]

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        seed = body.get("seed")
        chosen = self.choose(seed)
        prompt_ids = [BOS, *encode_text(render_chat(messages))]
        completion_ids = encode_text(chosen.content)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        finish = "stop"
        if max_tokens is not None and len(completion_ids) > int(max_tokens):
            completion_ids = completion_ids[: int(max_tokens)]
            finish = "length"
        text = decode_ids(completion_ids)
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        rng = random.Random(f"{seed}:{chosen.label}:{digest}")
        k = int(body.get("top_logprobs") or 0)
        content = []
        for tid in completion_ids:
            lp = -rng.expovariate(20.0)
            item: dict[str, Any] = {"token": token_str(tid), "logprob": lp, "bytes": [tid - OFFSET] if tid >= OFFSET else []}
            alts = [{"token": token_str(tid), "logprob": lp, "bytes": item["bytes"]}]
            rest = 1.0 - math.exp(lp)
            for j in range(1, k):
                alt = OFFSET + (tid - OFFSET + 7 * j) % 256
                alts.append({"token": token_str(alt), "logprob": math.log(max(rest / (2 ** j), 1e-12)),
                             "bytes": [alt - OFFSET]})
            item["top_logprobs"] = alts[:k] if k else []
            content.append(item)
        now = int(time.time())
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex[:24],
            "object": "chat.completion",
            "created": now,
            "model": body.get("model") or self.model,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": {"content": content} if body.get("logprobs") else None,
                "finish_reason": finish,
                "token_ids": completion_ids if body.get("return_token_ids") else None,
            }],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion_ids),
                      "total_tokens": len(prompt_ids) + len(completion_ids)},
            "prompt_token_ids": prompt_ids if body.get("return_token_ids") else None,
            "system_fingerprint": f"arena-scripted-v{self.policy_version}",
        }


def create_app(llm: ScriptedLLM) -> FastAPI:
    app = FastAPI(title="Arena scripted LLM")

    def error(status: int, message: str) -> Response:
        body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
        return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "policy_version": llm.policy_version}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": llm.model, "object": "model", "owned_by": "arena",
                                            "created": 0}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            return error(400, f"invalid JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "body must be a JSON object")
        if body.get("stream"):
            return error(400, "the scripted backend does not stream")
        try:
            answer = llm.complete(body)
        except (ValueError, TypeError) as exc:
            return error(400, str(exc))
        return Response(msgspec.json.encode(answer), media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m arena.scripted_llm", description=__doc__.splitlines()[0])
    parser.add_argument("--script", required=True, help="script JSON file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9093)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--policy-version", default="0")
    args = parser.parse_args(argv)
    try:
        script = load_script(args.script)
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        raise SystemExit(f"scripted_llm: cannot load script {args.script}: {exc}") from None
    import uvicorn

    app = create_app(ScriptedLLM(script, model=args.model, policy_version=args.policy_version))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
