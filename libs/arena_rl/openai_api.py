"""OpenAI / vLLM request parsing and response shapes for the policy server (pure).

Chat: top-level ``prompt_token_ids``, ``choices[0].token_ids``, ``choices[0].logprobs.content``;
completions: ``choices[0].prompt_token_ids``, ``choices[0].token_ids``,
``choices[0].logprobs.{tokens, token_logprobs, top_logprobs, text_offset}``. Every answer
carries ``policy_version`` and ``system_fingerprint`` ``arena-policy-v{N}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from arena_rl.generate import GenRequest, GenResult
from arena_rl.model import PolicyModel
from arena_rl.tokenizer import EOS, CharTokenizer


class BadRequest(ValueError):
    """The request is invalid; answered with a 400 and this message."""


@dataclass(frozen=True)
class Policy:
    """One immutable (model, tokenizer, version): swapped as a whole."""

    model: PolicyModel
    tokenizer: CharTokenizer
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
    if body.get("stream"):
        raise BadRequest("streaming is not supported by the Arena policy server; send stream=false")
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


def chat_prompt(tokenizer: CharTokenizer, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    try:
        return tokenizer.render_chat(messages)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def completion_prompt(tokenizer: CharTokenizer, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.render_prompt(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if any(not 0 <= i < tokenizer.vocab_size for i in prompt):
            raise BadRequest(f"prompt token ids must be in [0, {tokenizer.vocab_size})")
        return list(prompt)
    raise BadRequest("'prompt' must be a string or a non-empty list of token ids (batches are not supported)")


def _text(tokenizer: CharTokenizer, result: GenResult) -> str:
    return tokenizer.decode([t for t in result.token_ids if t != EOS])


def chat_response(body: dict, prompt_ids: list[int], result: GenResult, policy: Policy, model: str) -> dict:
    tok = policy.tokenizer
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": _text(tok, result)},
                              "finish_reason": result.finish_reason, "logprobs": None}
    if body.get("logprobs"):
        content = []
        for i, (tid, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
            s = tok.token_str(tid)
            top = [{"token": tok.token_str(t), "logprob": v, "bytes": list(tok.token_str(t).encode())}
                   for t, v in (result.top_logprobs[i] if result.top_logprobs else [])]
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": top})
        choice["logprobs"] = {"content": content}
    if body.get("return_token_ids"):
        choice["token_ids"] = list(result.token_ids)
    out = _envelope("chat.completion", policy, model, prompt_ids, result)
    out["choices"] = [choice]
    if body.get("return_token_ids"):
        out["prompt_token_ids"] = list(prompt_ids)
    return out


def completion_response(body: dict, prompt_ids: list[int], result: GenResult, policy: Policy, model: str) -> dict:
    tok = policy.tokenizer
    choice: dict[str, Any] = {"index": 0, "text": _text(tok, result), "finish_reason": result.finish_reason,
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


def _envelope(kind: str, policy: Policy, model: str, prompt_ids: list[int], result: GenResult) -> dict:
    return {
        "id": ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex[:24],
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"arena-policy-v{policy.version}",
        "policy_version": str(policy.version),
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(result.token_ids),
                  "total_tokens": len(prompt_ids) + len(result.token_ids)},
    }
