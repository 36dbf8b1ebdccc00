"""OpenAI / vLLM request parsing and response shapes for the policy server (pure).

Chat: top-level ``prompt_token_ids``, ``choices[0].token_ids``, ``choices[0].logprobs.content``;
completions: ``choices[0].prompt_token_ids``, ``choices[0].token_ids``,
``choices[0].logprobs.{tokens, token_logprobs, top_logprobs, text_offset}``. Every answer
carries ``policy_version`` and ``system_fingerprint`` ``arena-policy-v{N}``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from arena_rl.generate import GenRequest, GenResult, generate
from arena_rl.model import PolicyModel
from arena_rl.tokenizer import EOS, CharTokenizer


class BadRequest(ValueError):
    """The request is invalid; answered with a 400 and this message."""


class Engine(Protocol):
    """What the policy server samples from: a model with its tokenizer and chat template."""

    vocab_size: int
    max_len: int

    def generate(self, requests: list[GenRequest],
                 on_token: Callable[[int, int, float, list], None] | None = None,
                 interrupt: Callable[[], int | None] | None = None) -> list[GenResult]: ...
    def render_chat(self, messages: list[dict[str, Any]], tools: list | None = None) -> list[int]: ...
    def render_prompt(self, prompt: str) -> list[int]: ...
    def text(self, ids: list[int]) -> str: ...
    def token_str(self, token_id: int) -> str: ...


class CharEngine:
    """The demo's character-level policy as an :class:`Engine`."""

    def __init__(self, model: PolicyModel, tokenizer: CharTokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.vocab_size, self.max_len = tokenizer.vocab_size, model.cfg.max_len

    def generate(self, requests, on_token=None, interrupt=None):
        results = generate(self.model, requests)  # short: weight updates wait for the batch
        if on_token is not None:  # sampled as a whole: handed over token by token after
            for i, result in enumerate(results):
                for j, (tok, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
                    on_token(i, tok, lp, result.top_logprobs[j] if result.top_logprobs else [])
        return results

    def render_chat(self, messages, tools=None):
        return self.tokenizer.render_chat(messages)

    def render_prompt(self, prompt):
        return self.tokenizer.render_prompt(prompt)

    def text(self, ids):
        return self.tokenizer.decode([t for t in ids if t != EOS])

    def token_str(self, token_id):
        return self.tokenizer.token_str(token_id)


@dataclass(frozen=True)
class Policy:
    """One (engine, version): swapped as a whole."""

    engine: Engine
    version: int


# ----------------------------------------------------------------------------- requests


def _num(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}")
    return kind(value)


def gen_request(body: dict, prompt_ids: list[int]) -> GenRequest:
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported")
    if body.get("stop"):
        raise BadRequest("stop strings are not supported by the Arena policy server; it stops at </s>")
    max_tokens = _num(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = _num(body, "max_completion_tokens", int, 16)
    top_k = _num(body, "top_k", int, 0)
    top_logprobs = _num(body, "top_logprobs", int, 0)
    if not isinstance(body.get("logprobs", False), bool) and isinstance(body.get("logprobs"), int):
        top_logprobs = max(top_logprobs, int(body["logprobs"]))  # completions API: logprobs=k
    return GenRequest(prompt_ids=prompt_ids, max_tokens=max_tokens,
                      temperature=_num(body, "temperature", float, 1.0), top_p=_num(body, "top_p", float, 1.0),
                      top_k=max(top_k, 0), seed=_num(body, "seed", int, None), top_logprobs=max(top_logprobs, 0))


def chat_prompt(engine: Engine, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of objects")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    try:
        return engine.render_chat(messages, tools)
    except Exception as exc:  # noqa: BLE001 - a chat template raises template errors of its own kinds
        raise BadRequest(f"the chat template cannot render these messages: {exc}") from None


def completion_prompt(engine: Engine, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return engine.render_prompt(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if any(not 0 <= i < engine.vocab_size for i in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {engine.vocab_size})")
        return list(prompt)
    raise BadRequest("'prompt' must be a string or a non-empty list of token ids (batches are not supported)")


def chat_response(body: dict, prompt_ids: list[int], result: GenResult, policy: Policy, model: str) -> dict:
    eng = policy.engine
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": eng.text(result.token_ids)},
                              "finish_reason": result.finish_reason, "logprobs": None}
    if body.get("logprobs"):
        choice["logprobs"] = {"content": chat_logprobs(eng, result.token_ids, result.logprobs, result.top_logprobs)}
    if body.get("return_token_ids"):
        choice["token_ids"] = list(result.token_ids)
    out = _envelope("chat.completion", policy, model, prompt_ids, result)
    out["choices"] = [choice]
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = list(prompt_ids)
    return out


def completion_response(body: dict, prompt_ids: list[int], result: GenResult, policy: Policy, model: str) -> dict:
    tok = policy.engine
    choice: dict[str, Any] = {"index": 0, "text": tok.text(result.token_ids), "finish_reason": result.finish_reason,
                              "logprobs": None}
    if body.get("logprobs") is not None and body.get("logprobs") is not False:
        tokens = [tok.token_str(t) for t in result.token_ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t) if not t.startswith("<") else 0
        choice["logprobs"] = {
            "tokens": tokens, "token_logprobs": list(result.logprobs), "text_offset": offsets,
            "top_logprobs": [{tok.token_str(t): v for t, v in row} for row in result.top_logprobs] or None,
        }
    if body.get("return_token_ids"):
        choice["token_ids"] = list(result.token_ids)
        choice["prompt_token_ids"] = list(prompt_ids)
    out = _envelope("text_completion", policy, model, prompt_ids, result)
    out["choices"] = [choice]
    return out


def chat_logprobs(engine: Engine, ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]]) -> list[dict[str, Any]]:
    """OpenAI's ``choices[].logprobs.content`` entries for ``ids``."""
    content = []
    for i, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
        s = engine.token_str(tid)
        alts = [{"token": engine.token_str(t), "logprob": v, "bytes": list(engine.token_str(t).encode())}
                for t, v in (top[i] if i < len(top) else [])]
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
    return content


def versions(policy: Policy, result: GenResult) -> dict[str, Any]:
    """``policy_version`` (the version that sampled the last token) and, for a partial rollout,
    ``policy_versions``: ``[{"version", "from_token"}, ...]``."""
    if not result.switches:
        return {"system_fingerprint": f"arena-policy-v{policy.version}", "policy_version": str(policy.version)}
    last = result.switches[-1][1]
    spans = [{"version": str(policy.version), "from_token": 0}]
    spans += [{"version": str(v), "from_token": at} for at, v in result.switches]
    return {"system_fingerprint": f"arena-policy-v{last}", "policy_version": str(last), "policy_versions": spans}


def _envelope(kind: str, policy: Policy, model: str, prompt_ids: list[int], result: GenResult) -> dict:
    return {
        "id": ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24],
        "object": kind,
        "created": int(time.time()),
        "model": model,
        **versions(policy, result),
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(result.token_ids),
                  "total_tokens": len(prompt_ids) + len(result.token_ids)},
    }


# ----------------------------------------------------------------------------- streams


class StreamShaper:
    """Server-sent events of one streamed answer, vLLM-shaped: a first chunk (the role, and
    ``prompt_token_ids`` when asked), one chunk per token (its text delta, ``token_ids`` and
    logprobs when asked), the finish chunk, a usage chunk when ``stream_options.include_usage``,
    then ``[DONE]``."""

    def __init__(self, kind: str, body: dict, policy: Policy, model: str, prompt_ids: list[int]):
        self.chat = kind == "chat"
        self.body, self.policy, self.model, self.prompt_ids = body, policy, model, prompt_ids
        self.ids: list[int] = []
        self.sent = ""  # the text already sent
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.want_ids = bool(body.get("return_token_ids"))
        logprobs = body.get("logprobs")
        self.want_logprobs = bool(logprobs) if self.chat else logprobs is not None and logprobs is not False

    def _event(self, choices: list[dict], result: GenResult | None = None, **extra: Any) -> bytes:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model,
                 **versions(self.policy, result or GenResult()), "choices": choices, **extra}
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    def first(self) -> bytes | None:
        if self.chat:
            extra = {"prompt_token_ids": self.prompt_ids} if self.want_ids else {}
            return self._event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **extra)
        return None  # completions: the prompt's ids go with the first token's chunk

    def token(self, tok: int, lp: float, top: list) -> bytes:
        self.ids.append(tok)
        text = self.policy.engine.text(self.ids)
        delta = ""
        if not text.endswith("\ufffd") and text.startswith(self.sent):  # hold back a partial character
            delta, self.sent = text[len(self.sent):], text
        engine = self.policy.engine
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": delta}, "finish_reason": None,
                                      "logprobs": {"content": chat_logprobs(engine, [tok], [lp], [top])}
                                      if self.want_logprobs else None}
        else:
            choice = {"index": 0, "text": delta, "finish_reason": None, "logprobs": {
                "tokens": [engine.token_str(tok)], "token_logprobs": [lp], "text_offset": [len(self.sent) - len(delta)],
                "top_logprobs": [{engine.token_str(t): v for t, v in top}] if top else None,
            } if self.want_logprobs else None}
            if self.want_ids and len(self.ids) == 1:
                choice["prompt_token_ids"] = self.prompt_ids
        if self.want_ids:
            choice["token_ids"] = [tok]
        return self._event([choice])

    def end(self, result: GenResult) -> list[bytes]:
        text = self.policy.engine.text(result.token_ids)
        rest = text[len(self.sent):] if text.startswith(self.sent) else ""
        if self.chat:
            final = {"index": 0, "delta": {"content": rest} if rest else {}, "logprobs": None,
                     "finish_reason": result.finish_reason}
        else:
            final = {"index": 0, "text": rest, "logprobs": None, "finish_reason": result.finish_reason}
        events = [self._event([final], result)]  # the versions that sampled it, all known now
        if (self.body.get("stream_options") or {}).get("include_usage"):
            n = len(result.token_ids)
            events.append(self._event([], usage={"prompt_tokens": len(self.prompt_ids), "completion_tokens": n,
                                                 "total_tokens": len(self.prompt_ids) + n}))
        events.append(b"data: [DONE]\n\n")
        return events
