"""A scripted, seeded LLM behind an OpenAI-compatible HTTP API, shaped like vLLM's.

For demos, tests and benchmarks: no weights, no GPU. Answers come from a script file, chosen by
the request's seed: one answer per request (``responses``), or multi-turn ``plays`` whose turn is
the number of assistant messages already in the request; token ids are bytes; ``Faults`` are
knobs for tests. Run
``python -m arena_stack.scripted_llm --script FILE --port 9093``. See docs/deploy.md ("The scripted LLM").
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import hashlib
import itertools
import json
import math
import random
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

BOS, EOS, OFFSET = 1, 2, 3


class ScriptedToolCall(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    arguments: str = "{}"


class ScriptedResponse(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    content: str = ""
    weight: float = 1.0
    tool_calls: list[ScriptedToolCall] = []


class ScriptedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """One assistant message of a play: text, tool calls, or both (text first)."""

    content: str = ""
    tool_calls: list[ScriptedToolCall] = []


class ScriptedPlay(msgspec.Struct, frozen=True, kw_only=True):
    """A multi-turn answer: turn ``i`` answers a request holding ``i`` assistant messages
    (past the last turn, the last is played again)."""

    label: str
    turns: list[ScriptedTurn]
    weight: float = 1.0
    #: Played only for requests whose first user message contains this text ("" = any request).
    match: str = ""
    #: Look for ``match`` in every user message, not only the first (for scaffolds whose first
    #: user message is their own context, e.g. Codex's ``<environment_context>``, the task after it).
    match_any_user: bool = False


class Script(msgspec.Struct, frozen=True, kw_only=True):
    responses: list[ScriptedResponse] = []
    #: When given, every request is answered by a play (``responses`` are then unused).
    plays: list[ScriptedPlay] = []


class Faults(msgspec.Struct, frozen=True, kw_only=True):
    """Misbehaviour on demand. Defaults: a healthy, instant backend."""

    latency_s: float = 0.0  # before the response (or the first chunk)
    chunk_delay_s: float = 0.0  # between streamed chunks
    chunk_tokens: int = 1  # tokens per streamed chunk
    die_after_chunks: int | None = None  # drop the connection after this many chunks
    malformed_json: bool = False  # answer 200 with a body that is not JSON
    no_token_ids: bool = False  # ignore return_token_ids, like Ollama
    no_tokenize: bool = False  # answer /tokenize with 404, like Ollama
    error_status: int | None = None  # answer every completion with this status


def load_script(path: str | Path, only: str | None = None) -> Script:
    """The script at ``path``; with ``only``, just its responses and plays labelled ``only``
    (e.g. the quickstart's ``correct`` or ``wrong``: a backend that always answers one way)."""
    script = msgspec.json.decode(Path(path).read_bytes(), type=Script)
    if only is not None:
        script = Script(responses=[r for r in script.responses if r.label == only],
                        plays=[p for p in script.plays if p.label == only])
        if not (script.responses or script.plays):
            raise ValueError(f"{path}: no response or play is labelled {only!r}")
    if not (script.responses or script.plays) or any(r.weight < 0 for r in [*script.responses, *script.plays]):
        raise ValueError(f"{path}: need at least one response or play, with non-negative weights")
    if any(not p.turns for p in script.plays):
        raise ValueError(f"{path}: every play needs at least one turn")
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


def _text_of(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def render_chat(messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
    parts = []
    for m in messages:
        text = _text_of(m.get("content"))
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            text += tool_call_text(fn.get("name", ""), fn.get("arguments", ""))
        parts.append(f"<|{m.get('role', 'user')}|>\n{text}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def tool_call_text(name: str, arguments: str) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class Sample(msgspec.Struct, kw_only=True):
    """One sampled answer: what every response shape is built from."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str | None
    tool_calls: list[dict[str, Any]]
    finish: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]]  # (token id, logprob, top-k alternatives)
    cached: int | None = None  # prompt tokens read from the prefix cache; None: the cache is off


class ScriptedLLM:
    """The pure model: a request in, a vLLM-shaped response (or chunks) out."""

    def __init__(self, script: Script, *, model: str = "scripted", seed: int = 0, policy_version: str = "0",
                 faults: Faults = Faults(), max_model_len: int = 32768, prefix_cache_block: int = 0):
        self.script = script
        # vLLM's automatic prefix caching: prompts are cached in whole blocks of this many
        # tokens, a prompt's leading blocks seen before are hits, reported as
        # ``usage.prompt_tokens_details.cached_tokens``; 0: no cache, no such field
        self.prefix_cache_block = prefix_cache_block
        self._blocks: set[int] = set()
        self.model = model
        self.policy_version = policy_version
        self.faults = faults
        self.max_model_len = max_model_len  # reported by /tokenize; nothing is truncated to it
        self._unseeded = itertools.count(seed * 1_000_003)

    def choose(self, seed: int | None, *, wants_tool: bool = False) -> ScriptedResponse:
        with_tools = [r for r in self.script.responses if r.tool_calls]
        plain = [r for r in self.script.responses if not r.tool_calls]
        candidates = (with_tools if wants_tool and with_tools else plain) or self.script.responses
        return self._draw(candidates, seed)

    def _draw(self, candidates: list, seed: int | None):
        rng = random.Random(seed if seed is not None else next(self._unseeded))
        total = sum(r.weight for r in candidates)
        x = rng.random() * total
        for candidate in candidates:
            x -= candidate.weight
            if x < 0:
                return candidate
        return candidates[-1]

    def play(self, body: dict[str, Any], *, chat: bool) -> tuple[str, ScriptedTurn]:
        """The play and turn answering ``body`` (stateless: the same request, the same turn):
        the play is drawn by seed among those whose ``match`` is in the first user message, the
        turn is the number of assistant messages in the request (0 for a text prompt)."""
        messages = body.get("messages") if chat else None
        if chat:
            users = [_text_of(m.get("content")) for m in messages if m.get("role") == "user"]
            first_user, any_user = (users[0] if users else ""), "\n".join(users)
            turn = sum(1 for m in messages if m.get("role") == "assistant")
        else:
            first_user = any_user = str(body.get("prompt") or "")
            turn = 0
        candidates = [p for p in self.script.plays if p.match in (any_user if p.match_any_user else first_user)]
        if not candidates:
            raise ValueError("no play of the script matches this request (its 'match' texts are not in the "
                             "first user message)")
        chosen = self._draw(candidates, body.get("seed"))
        index = min(turn, len(chosen.turns) - 1)
        return f"{chosen.label}#{index}", chosen.turns[index]

    @staticmethod
    def prompt_ids(body: dict[str, Any], *, chat: bool) -> list[int]:
        """The prompt's token ids: what ``prompt_token_ids`` and ``/tokenize`` both say."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise ValueError("'messages' must be a non-empty list of objects")
            text = render_chat(messages, add_generation_prompt=body.get("add_generation_prompt", True) is not False)
            return [BOS, *encode_text(text)]
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, str) and prompt:
            special = [BOS] if body.get("add_special_tokens", True) is not False else []
            return [*special, *encode_text(prompt)]
        raise ValueError("'prompt' must be a non-empty string or list of token ids")

    def _prefix_hits(self, prompt_ids: list[int]) -> int | None:
        """The prompt's leading tokens already in the cache (whole blocks), then its blocks cached."""
        size = self.prefix_cache_block
        if size <= 0:
            return None
        hits, missed = 0, False
        for end in range(size, len(prompt_ids) + 1, size):
            key = hash(tuple(prompt_ids[:end]))
            if key in self._blocks and not missed:
                hits = end
            else:
                missed = True
                self._blocks.add(key)
        return hits

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``messages`` (chat) or ``prompt`` (a string) in; ``count``,
        ``tokens`` and ``max_model_len`` out."""
        if "messages" in body:
            tokens = self.prompt_ids(body, chat=True)
        elif isinstance(body.get("prompt"), str):
            tokens = self.prompt_ids(body, chat=False)
        else:
            raise ValueError("/tokenize takes 'messages' (a chat) or 'prompt' (a string)")
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    def sample(self, body: dict[str, Any], *, chat: bool) -> Sample:
        seed = body.get("seed")
        prompt_ids = self.prompt_ids(body, chat=chat)
        messages = body.get("messages") if chat else None
        if self.script.plays:
            label, turn = self.play(body, chat=chat)
            content, tool_calls = turn.content, (turn.tool_calls if chat else [])
        else:
            wants_tool = bool(chat and body.get("tools")) and messages[-1].get("role") != "tool"
            chosen = self.choose(seed, wants_tool=wants_tool)
            label, content, tool_calls = chosen.label, chosen.content, (chosen.tool_calls if wants_tool else [])
            if tool_calls:
                content = ""  # a response with tool calls answers with them alone
        calls = [{"id": f"call_{i}_{hashlib.sha256(f'{label}:{c.name}'.encode()).hexdigest()[:8]}",
                  "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for i, c in enumerate(tool_calls)]
        full = content + "".join(tool_call_text(c.name, c.arguments) for c in tool_calls)
        completion_ids = encode_text(full)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if not chat and max_tokens is None:
            max_tokens = 16  # the OpenAI completions default
        finish = "tool_calls" if calls else "stop"
        if max_tokens is not None and len(completion_ids) > int(max_tokens):
            completion_ids = completion_ids[: int(max_tokens)]
            finish, calls = "length", []
        text = decode_ids(completion_ids) if not calls else content
        digest = hashlib.sha256(decode_ids(completion_ids).encode()).hexdigest()[:8]
        rng = random.Random(f"{seed}:{label}:{digest}")
        k = int(body.get("top_logprobs") or 0) if chat else int(body.get("logprobs") or 0)
        lps = []
        for tid in completion_ids:
            lp = -rng.expovariate(20.0)
            alts = [(tid, lp)]
            rest = 1.0 - math.exp(lp)
            for j in range(1, k):
                alts.append((OFFSET + (tid - OFFSET + 7 * j) % 256, math.log(max(rest / (2 ** j), 1e-12))))
            lps.append((tid, lp, alts[:k]))
        return Sample(prompt_ids=prompt_ids, completion_ids=completion_ids, text=text or (None if calls else ""),
                      tool_calls=calls, finish=finish, logprobs=lps, cached=self._prefix_hits(prompt_ids))

    def _ids(self, body: dict[str, Any]) -> bool:
        return bool(body.get("return_token_ids")) and not self.faults.no_token_ids

    @staticmethod
    def _chat_logprobs(items) -> list[dict[str, Any]]:
        def entry(tid: int, lp: float) -> dict[str, Any]:
            return {"token": token_str(tid), "logprob": lp, "bytes": [tid - OFFSET] if tid >= OFFSET else []}

        return [{**entry(tid, lp), "top_logprobs": [entry(a, alp) for a, alp in alts]} for tid, lp, alts in items]

    @staticmethod
    def _completion_logprobs(items, offset: int) -> dict[str, Any]:
        tokens = [token_str(tid) for tid, _, _ in items]
        offsets = []
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in items],
                "top_logprobs": [{token_str(a): alp for a, alp in alts} for _, _, alts in items] if items and
                items[0][2] else None, "text_offset": offsets}

    @staticmethod
    def _usage(s: Sample) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.completion_ids),
                                 "total_tokens": len(s.prompt_ids) + len(s.completion_ids)}
        if s.cached is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": s.cached}
        return usage

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming ``chat.completion``."""
        s = self.sample(body, chat=True)
        ids = self._ids(body)
        message: dict[str, Any] = {"role": "assistant", "content": s.text}
        if s.tool_calls:
            message["tool_calls"] = s.tool_calls
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex[:24],
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": {"content": self._chat_logprobs(s.logprobs)} if body.get("logprobs") else None,
                "finish_reason": s.finish,
                "token_ids": s.completion_ids if ids else None,
            }],
            "usage": self._usage(s),
            "prompt_token_ids": s.prompt_ids if ids else None,
            "system_fingerprint": f"arena-scripted-v{self.policy_version}",
        }

    def text_complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming ``text_completion`` (``/v1/completions``)."""
        s = self.sample(body, chat=False)
        ids = self._ids(body)
        return {
            "id": "cmpl-" + uuid.uuid4().hex[:24],
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or self.model,
            "choices": [{
                "index": 0,
                "text": s.text or "",
                "logprobs": self._completion_logprobs(s.logprobs, 0) if body.get("logprobs") is not None else None,
                "finish_reason": s.finish,
                "token_ids": s.completion_ids if ids else None,
                "prompt_token_ids": s.prompt_ids if ids else None,
            }],
            "usage": self._usage(s),
        }

    def chunks(self, body: dict[str, Any], *, chat: bool) -> list[dict[str, Any]]:
        """The stream of a completion as vLLM sends it: one chunk per ``chunk_tokens`` tokens."""
        s = self.sample(body, chat=chat)
        ids, n = self._ids(body), max(1, self.faults.chunk_tokens)
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": cid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": body.get("model") or self.model}
        out: list[dict[str, Any]] = []
        if chat:
            first: dict[str, Any] = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]}
            if ids:
                first["prompt_token_ids"] = s.prompt_ids
            out.append(first)
        want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        offset = 0
        call_lengths = [len(encode_text(tool_call_text(c["function"]["name"], c["function"]["arguments"])))
                        for c in s.tool_calls]
        n_text = len(s.completion_ids) - sum(call_lengths)  # text first, then the tool calls
        groups = [list(range(i, min(i + n, n_text))) for i in range(0, n_text, n)]
        text_groups, start = len(groups), n_text
        for length in call_lengths:  # one chunk per tool call, carrying its tokens
            groups.append(list(range(start, start + length)))
            start += length
        for gi, group in enumerate(groups):
            gids = [s.completion_ids[i] for i in group]
            items = [s.logprobs[i] for i in group]
            last = gi == len(groups) - 1
            choice: dict[str, Any] = {"index": 0, "finish_reason": s.finish if last else None}
            if chat:
                if gi >= text_groups:
                    call = s.tool_calls[gi - text_groups]
                    choice["delta"] = {"tool_calls": [{"index": gi - text_groups, **call}]}
                else:
                    final = last or gi == text_groups - 1
                    choice["delta"] = {"content": decoder.decode(bytes(t - OFFSET for t in gids), final=final)}
                choice["logprobs"] = {"content": self._chat_logprobs(items)} if want_lp else None
            else:
                piece = decoder.decode(bytes(t - OFFSET for t in gids), final=last)
                choice["text"] = piece
                choice["logprobs"] = self._completion_logprobs(items, offset) if want_lp else None
                offset += len(piece)
                if gi == 0 and ids:
                    choice["prompt_token_ids"] = s.prompt_ids
            if ids:
                choice["token_ids"] = gids
            out.append({**head, "choices": [choice]})
        if not groups:  # nothing sampled (max_tokens 0): still say why it stopped
            choice = {"index": 0, "finish_reason": s.finish, **({"delta": {}} if chat else {"text": ""})}
            out.append({**head, "choices": [choice]})
        if (body.get("stream_options") or {}).get("include_usage"):
            out.append({**head, "choices": [], "usage": self._usage(s)})
        return out


def create_app(llm: ScriptedLLM) -> FastAPI:
    app = FastAPI(title="Arena scripted LLM")
    faults = llm.faults

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

    async def stream(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
        for i, chunk in enumerate(chunks):
            if faults.die_after_chunks is not None and i >= faults.die_after_chunks:
                raise ConnectionAbortedError("scripted backend dies mid-stream (die_after_chunks)")
            if i and faults.chunk_delay_s:
                await asyncio.sleep(faults.chunk_delay_s)
            yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def json_object(request: Request) -> dict | Response:
        """The request's JSON object, or the 400 that says why it is not one."""
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            return error(400, f"invalid JSON: {exc}")
        return body if isinstance(body, dict) else error(400, "body must be a JSON object")

    async def handle(request: Request, *, chat: bool) -> Response:
        body = await json_object(request)
        if isinstance(body, Response):
            return body
        if faults.latency_s:
            await asyncio.sleep(faults.latency_s)
        if faults.error_status is not None:
            return error(faults.error_status, "scripted backend failure (error_status)")
        if faults.malformed_json:
            return Response(b'{"id": "chatcmpl-broken", "choices": [', media_type="application/json")
        try:
            if body.get("stream"):
                return StreamingResponse(stream(llm.chunks(body, chat=chat)), media_type="text/event-stream")
            answer = llm.complete(body) if chat else llm.text_complete(body)
        except (ValueError, TypeError) as exc:
            return error(400, str(exc))
        return Response(msgspec.json.encode(answer), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        if faults.no_tokenize:
            return Response(b'{"detail":"Not Found"}', status_code=404, media_type="application/json")
        body = await json_object(request)
        if isinstance(body, Response):
            return body
        try:
            answer = llm.tokenize(body)
        except (ValueError, TypeError) as exc:
            return error(400, str(exc))
        return Response(msgspec.json.encode(answer), media_type="application/json")

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m arena_stack.scripted_llm", description=__doc__.splitlines()[0])
    parser.add_argument("--script", required=True, help="script JSON file")
    parser.add_argument("--only", metavar="LABEL", help="answer only with the script's responses (or plays) "
                        "labelled LABEL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9093)
    parser.add_argument("--model", default="scripted")
    parser.add_argument("--policy-version", default="0")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="fixed delay before each answer")
    parser.add_argument("--chunk-delay-ms", type=float, default=0.0, help="delay between streamed chunks")
    parser.add_argument("--chunk-tokens", type=int, default=1, help="tokens per streamed chunk")
    parser.add_argument("--prefix-cache-block", type=int, default=0,
                        help="report prefix-cache hits in blocks of this many tokens, as vLLM (0: none)")
    parser.add_argument("--no-token-ids", action="store_true", help="never return token ids (like Ollama)")
    parser.add_argument("--no-tokenize", action="store_true", help="answer /tokenize with 404 (like Ollama)")
    args = parser.parse_args(argv)
    try:
        script = load_script(args.script, args.only)
    except (OSError, ValueError, msgspec.DecodeError) as exc:
        raise SystemExit(f"scripted_llm: cannot load script {args.script}: {exc}") from None
    import uvicorn

    faults = Faults(latency_s=args.latency_ms / 1000, chunk_delay_s=args.chunk_delay_ms / 1000,
                    chunk_tokens=args.chunk_tokens, no_token_ids=args.no_token_ids, no_tokenize=args.no_tokenize)
    app = create_app(ScriptedLLM(script, model=args.model, policy_version=args.policy_version, faults=faults,
                                  prefix_cache_block=args.prefix_cache_block))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
