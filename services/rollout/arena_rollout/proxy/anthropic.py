"""The Anthropic Messages API over an OpenAI-compatible backend. Pure translation.

``to_openai`` turns a ``/v1/messages`` body into a chat-completions body (system
prompt, text, ``tool_use`` and ``tool_result`` blocks, tools, tool choice, stop
sequences); ``from_openai`` turns the chat answer back into an Anthropic message;
``StreamTranslator`` does the same chunk by chunk, emitting Anthropic's SSE events
(``message_start``, ``content_block_*``, ``message_delta``, ``message_stop``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from arena_core.errors import InvalidRequest

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}
_SAMPLING = ("temperature", "top_p", "top_k")


def _text(block: dict[str, Any]) -> str:
    return str(block.get("text") or "")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or "type" not in block:
            raise InvalidRequest(f"{where}.content[{i}] must be an object with a 'type'")
    return content


def _tool_result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, list):
        return "".join(_text(b) for b in content if isinstance(b, dict) and b.get("type") == "text")
    return str(content or "")


def to_openai(body: Any) -> dict[str, Any]:
    """An Anthropic ``/v1/messages`` request as an OpenAI chat-completions body."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list")
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        raise InvalidRequest("'max_tokens' is required by the Messages API and must be a positive integer")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        text = system if isinstance(system, str) else "".join(_text(b) for b in _blocks(system, "system"))
        out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise InvalidRequest(f"{where}.role must be 'user', 'assistant' or 'system'")
        if m["role"] == "system":  # a system message mid-conversation (Claude Code sends them): kept in place
            content = m.get("content")
            text = content if isinstance(content, str) else "".join(
                _text(b) for b in _blocks(content, where) if b["type"] == "text")
            out.append({"role": "system", "content": text})
            continue
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in _blocks(m.get("content"), where):
            kind = block["type"]
            if kind == "text":
                texts.append(_text(block))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                continue  # earlier reasoning: not replayed to an OpenAI-compatible backend
            elif kind == "tool_result" and m["role"] == "user":
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _tool_result_text(block)})
            else:
                raise InvalidRequest(f"{where}: content block type {kind!r} is not supported by this proxy")
        if m["role"] == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    sent: dict[str, Any] = {"model": body.get("model") or "default", "messages": out,
                            "max_tokens": body["max_tokens"], "stream": bool(body.get("stream"))}
    for name in _SAMPLING:
        if body.get(name) is not None:
            sent[name] = body[name]
    if body.get("stop_sequences"):
        sent["stop"] = list(body["stop_sequences"])
    tools = body.get("tools")
    if tools:
        sent["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema") or {}}}
                         for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        sent["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or (
            {"type": "function", "function": {"name": choice.get("name")}} if kind == "tool" else "auto")
    return sent


def stop_reason(finish: str | None, stop: Any) -> tuple[str | None, str | None]:
    """(Anthropic ``stop_reason``, ``stop_sequence``) from an OpenAI finish reason."""
    if finish == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return _STOP.get(finish or "", "end_turn" if finish else None), None


def _tool_input(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"_raw": arguments}  # the model produced invalid JSON; keep it visible, not lost


def from_openai(answer: dict[str, Any], *, model: str) -> dict[str, Any]:
    """An OpenAI chat completion as an Anthropic ``message``."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                        "input": _tool_input(fn.get("arguments", ""))})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"))
    usage = answer.get("usage") or {}
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                            _cached(usage))}


def _cached(usage: dict[str, Any]) -> int:
    """The backend's prefix-cache hits (OpenAI's ``prompt_tokens_details.cached_tokens``)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _usage(prompt: int, completion: int, cached: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the cache
    (the prompt is ``input_tokens + cache_read_input_tokens + cache_creation_input_tokens``)."""
    cached = min(cached, prompt)
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": completion}


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def error_event(message: str) -> bytes:
    return _event("error", {"type": "error", "error": {"type": "api_error", "message": message}})


class StreamTranslator:
    """OpenAI chat chunks in, Anthropic SSE event bytes out."""

    content_type = b"text/event-stream; charset=utf-8"

    def __init__(self, *, model: str):
        self.model = model
        self.started = False
        self.block: str | None = None  # "text" or "tool_use:<openai index>"
        self.index = -1
        self.finish: str | None = None
        self.stop: Any = None
        self.input_tokens = 0
        self.output_tokens = 0
        self.cached_tokens = 0

    @staticmethod
    def error(message: str) -> bytes:
        return error_event(message)

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.started = True
        self.input_tokens = len(chunk.get("prompt_token_ids") or [])
        return [_event("message_start", {"type": "message_start", "message": {
            "id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})]

    def _open(self, key: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.block, self.index = key, self.index + 1
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                  "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self.block is None:
            return []
        self.block = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out = [] if self.started else self._start(chunk)
        if chunk.get("usage"):
            self.input_tokens = int(chunk["usage"].get("prompt_tokens") or self.input_tokens)
            self.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
            self.cached_tokens = _cached(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.block != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                          "delta": {"type": "text_delta", "text": delta["content"]}}))
            for call in delta.get("tool_calls") or []:
                key = f"tool_use:{call.get('index', 0)}"
                fn = call.get("function") or {}
                if self.block != key:
                    out += self._open(key, {"type": "tool_use", "id": call.get("id"), "name": fn.get("name"),
                                            "input": {}})
                if fn.get("arguments"):
                    out.append(_event("content_block_delta", {
                        "type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}}))
            if choice.get("finish_reason") is not None:
                self.finish, self.stop = choice["finish_reason"], choice.get("stop_reason")
        return out

    def end(self) -> list[bytes]:
        out = [] if self.started else self._start({})
        out += self._close()
        reason, sequence = stop_reason(self.finish, self.stop)
        out.append(_event("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                            "usage": _usage(self.input_tokens, self.output_tokens,
                                                            self.cached_tokens)}))
        out.append(_event("message_stop", {"type": "message_stop"}))
        return out


class _Call:
    """One Messages call (``flavours.Translation``)."""

    def __init__(self, payload: Any):
        self.body = to_openai(payload)
        self.model = str(payload.get("model") or "")

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        return from_openai(chat, model=self.model or str(chat.get("model") or ""))

    def stream(self) -> StreamTranslator:
        return StreamTranslator(model=self.model)


class _Messages:
    """The Messages API as ``flavours.Flavour``."""

    errors = "anthropic"

    @staticmethod
    def memory() -> None:
        return None

    @staticmethod
    def translate(payload: Any, memory: Any) -> _Call:
        return _Call(payload)

    @staticmethod
    def count_body(payload: Any) -> dict[str, Any]:
        if isinstance(payload, dict) and "max_tokens" not in payload:
            payload = {**payload, "max_tokens": 1}  # count_tokens takes no max_tokens
        return to_openai(payload)


FLAVOUR = _Messages()
