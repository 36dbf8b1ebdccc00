"""The Gemini API (``models/{model}:generateContent`` and ``:streamGenerateContent``) over an
OpenAI-compatible backend. Pure translation.

``to_openai`` turns a ``GenerateContentRequest`` (``contents`` of ``user`` / ``model`` turns
with ``text``, ``functionCall`` and ``functionResponse`` parts, ``systemInstruction``,
``tools[].functionDeclarations``, ``toolConfig``, ``generationConfig``) into a
chat-completions body; ``from_openai`` turns the chat answer into a ``GenerateContentResponse``;
``StreamTranslator`` does it chunk by chunk, as server-sent events (``?alt=sse``) or as one JSON
array. docs/rollout.md ("The Gemini API").
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

from arena_core.errors import InvalidRequest

_FINISH = {"stop": "STOP", "tool_calls": "STOP", "function_call": "STOP", "length": "MAX_TOKENS",
           "content_filter": "SAFETY"}
_MODES = {"AUTO": "auto", "ANY": "required", "NONE": "none", "VALIDATED": "auto"}
#: generationConfig -> the chat body's field
_CONFIG = {"temperature": "temperature", "topP": "top_p", "topK": "top_k", "maxOutputTokens": "max_tokens",
           "seed": "seed", "presencePenalty": "presence_penalty", "frequencyPenalty": "frequency_penalty"}


def route_payload(body: Any, *, model: str, stream: bool, sse: bool) -> Any:
    """The request of a Gemini route with what its path and query say (the model, whether it
    streams and how) under the keys ``model``, ``stream`` and ``alt``, which the API's own
    bodies never use."""
    if not isinstance(body, dict):
        return body
    return {**body, "model": model, "stream": stream, "alt": "sse" if sse else "json"}


def _schema(schema: Any) -> Any:
    """A Gemini ``Schema`` (OpenAPI's subset, types in capitals) as JSON Schema."""
    if isinstance(schema, list):
        return [_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "type" and isinstance(value, str):
            out[key] = value.lower()
        elif key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: _schema(v) for k, v in value.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "not", "additionalProperties"):
            out[key] = _schema(value)
        else:
            out[key] = value
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise InvalidRequest(f"tools[{i}] must be an object")
        other = sorted(k for k in tool if k not in ("functionDeclarations", "function_declarations"))
        if other:
            raise InvalidRequest(f"tools[{i}]: {', '.join(other)} is not supported by this proxy "
                                 "(functionDeclarations are)")
        for fn in tool.get("functionDeclarations") or tool.get("function_declarations") or []:
            if "parametersJsonSchema" in fn:
                params = fn["parametersJsonSchema"]
            elif fn.get("parameters") is not None:
                params = _schema(fn["parameters"])
            else:
                params = {"type": "object", "properties": {}}
            out.append({"type": "function", "function": {"name": fn.get("name"), "description":
                                                         fn.get("description") or "", "parameters": params}})
    return out


def _tool_choice(config: Any) -> Any:
    calling = (config or {}).get("functionCallingConfig") if isinstance(config, dict) else None
    if not isinstance(calling, dict) or not calling.get("mode"):
        return None
    mode = _MODES.get(str(calling["mode"]).upper())
    if mode is None:
        raise InvalidRequest("toolConfig.functionCallingConfig.mode must be AUTO, ANY, NONE or VALIDATED")
    allowed = calling.get("allowedFunctionNames") or []
    if mode == "required" and len(allowed) == 1:
        return {"type": "function", "function": {"name": allowed[0]}}
    return mode


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, dict) or not isinstance(content.get("parts"), list):
        raise InvalidRequest(f"{where} must be a string or a Content with 'parts'")
    return "".join(str(p.get("text") or "") for p in content["parts"] if isinstance(p, dict))


def messages_of(contents: Any, system: Any = None) -> list[dict[str, Any]]:
    """``contents`` (and ``systemInstruction``) as chat messages: a ``model`` turn is one
    assistant message (its thought parts as ``reasoning_content``); a ``user`` turn's
    ``functionResponse`` parts are tool messages, its text one user message after them."""
    if not isinstance(contents, list) or not contents:
        raise InvalidRequest("'contents' must be a non-empty list")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "systemInstruction")})
    pending: dict[str, list[str]] = {}  # function name -> ids of its calls not answered yet
    for i, content in enumerate(contents):
        where = f"contents[{i}]"
        if not isinstance(content, dict) or not isinstance(content.get("parts"), list):
            raise InvalidRequest(f"{where} must be an object with 'parts'")
        role = content.get("role") or "user"
        if role not in ("user", "model", "function"):
            raise InvalidRequest(f"{where}.role must be 'user' or 'model'")
        texts, thoughts, calls = [], [], []
        for j, part in enumerate(content["parts"]):
            if not isinstance(part, dict):
                raise InvalidRequest(f"{where}.parts[{j}] must be an object")
            if "text" in part:
                (thoughts if part.get("thought") and role == "model" else texts).append(str(part["text"] or ""))
            elif "functionCall" in part and role == "model":
                fc = part["functionCall"] or {}
                call_id = fc.get("id") or f"call_{i}_{j}"
                pending.setdefault(fc.get("name") or "", []).append(call_id)
                calls.append({"id": call_id, "type": "function", "function": {
                    "name": fc.get("name"), "arguments": json.dumps(fc.get("args") or {}, ensure_ascii=False)}})
            elif "functionResponse" in part and role != "model":
                fr = part["functionResponse"] or {}
                waiting = pending.get(fr.get("name") or "") or []
                call_id = fr.get("id") or (waiting[0] if waiting else f"call_{i}_{j}")
                if call_id in waiting:
                    waiting.remove(call_id)
                response = fr.get("response")
                out.append({"role": "tool", "tool_call_id": call_id,
                            "content": json.dumps(response if response is not None else {}, ensure_ascii=False)})
            else:
                kind = next((k for k in part if k not in ("thought", "thoughtSignature", "thought_signature")),
                            None)
                raise InvalidRequest(f"{where}.parts[{j}]: part {kind!r} is not supported by this proxy in a "
                                     f"{role} turn (text, functionCall and functionResponse are)")
        if role == "model":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if thoughts:
                message["reasoning_content"] = "".join(thoughts)
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def to_openai(body: Any) -> dict[str, Any]:
    """A Gemini ``GenerateContentRequest`` (as ``route_payload`` made it) as a chat-completions body."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    sent: dict[str, Any] = {"model": body.get("model") or "default",
                            "messages": messages_of(body.get("contents"), body.get("systemInstruction")),
                            "stream": bool(body.get("stream"))}
    config = body.get("generationConfig") or {}
    if not isinstance(config, dict):
        raise InvalidRequest("'generationConfig' must be an object")
    if config.get("candidateCount") not in (None, 1):
        raise InvalidRequest("only candidateCount=1 is supported: submit a rollout group for several samples")
    for name, chat in _CONFIG.items():
        if config.get(name) is not None:
            sent[chat] = config[name]
    if config.get("stopSequences"):
        sent["stop"] = list(config["stopSequences"])
    schema = config.get("responseJsonSchema") or (
        _schema(config["responseSchema"]) if config.get("responseSchema") else None)
    if schema:
        sent["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    elif config.get("responseMimeType") == "application/json":
        sent["response_format"] = {"type": "json_object"}
    if body.get("tools"):
        sent["tools"] = _tools(body["tools"])
        choice = _tool_choice(body.get("toolConfig"))
        if choice is not None:
            sent["tool_choice"] = choice
    return sent


# ------------------------------------------------------------------ answers


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"_raw": arguments}  # the model produced invalid JSON; keep it visible, not lost


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    out = {"promptTokenCount": prompt, "candidatesTokenCount": completion, "totalTokenCount": prompt + completion}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if cached:  # of promptTokenCount, those read from the backend's prefix cache
        out["cachedContentTokenCount"] = min(cached, prompt)
    return out


def _candidate(parts: list[dict[str, Any]], finish: str | None) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish is not None:
        candidate["finishReason"] = _FINISH.get(finish, "OTHER")
    return candidate


def _reasoning_of(message: dict[str, Any]) -> str:
    return str(message.get("reasoning_content") or message.get("reasoning") or "")


def from_openai(answer: dict[str, Any], *, model: str, response_id: str) -> dict[str, Any]:
    """An OpenAI chat completion as a ``GenerateContentResponse``."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    parts: list[dict[str, Any]] = []
    if _reasoning_of(message):
        parts.append({"text": _reasoning_of(message), "thought": True})
    if message.get("content"):
        parts.append({"text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        parts.append({"functionCall": {"id": call.get("id"), "name": fn.get("name"),
                                       "args": _args(fn.get("arguments") or "")}})
    return {"candidates": [_candidate(parts, choice.get("finish_reason") or "stop")],
            "usageMetadata": _usage(answer.get("usage")), "modelVersion": model, "responseId": response_id}


class StreamTranslator:
    """OpenAI chat chunks in, ``GenerateContentResponse`` chunks out: server-sent events
    (``sse``) or the pieces of one JSON array. Text and thoughts go as they come, one piece
    behind: the last piece goes with the function calls (Gemini sends a call whole), the
    finish reason and the usage, as Google's last chunk does (Gemini CLI takes a chunk whose
    only part is empty text for an invalid one)."""

    def __init__(self, *, model: str, response_id: str, sse: bool):
        self.model, self.id, self.sse = model, response_id, sse
        self.content_type = b"text/event-stream; charset=utf-8" if sse else b"application/json; charset=utf-8"
        self.opened = False  # the JSON array's "[" went out
        self.calls: dict[int, dict[str, Any]] = {}
        self.held: list[dict[str, Any]] = []  # the last text or thought parts, not sent yet
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def _piece(self, doc: dict[str, Any]) -> bytes:
        data = msgspec.json.encode(doc)
        if self.sse:
            return b"data: " + data + b"\r\n\r\n"
        head = b"\n,\r\n" if self.opened else b"["
        self.opened = True
        return head + data

    def _chunk(self, parts: list[dict[str, Any]], finish: str | None = None,
               usage: dict[str, Any] | None = None) -> bytes:
        doc: dict[str, Any] = {"candidates": [_candidate(parts, finish)]}
        if usage is not None:
            doc["usageMetadata"] = _usage(usage)
        doc["modelVersion"], doc["responseId"] = self.model, self.id
        return self._piece(doc)

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            parts = []
            if _reasoning_of(delta):
                parts.append({"text": _reasoning_of(delta), "thought": True})
            if delta.get("content"):
                parts.append({"text": delta["content"]})
            if parts:
                if self.held:
                    out.append(self._chunk(self.held))
                self.held = parts
            for call in delta.get("tool_calls") or []:
                held = self.calls.setdefault(int(call.get("index") or 0), {"id": None, "name": "", "arguments": ""})
                fn = call.get("function") or {}
                held["id"] = held["id"] or call.get("id")
                held["name"] = held["name"] or fn.get("name") or ""
                held["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> list[bytes]:
        parts = [*self.held, *({"functionCall": {"id": c["id"], "name": c["name"], "args": _args(c["arguments"])}}
                               for _, c in sorted(self.calls.items()))] or [{"text": ""}]
        out = [self._chunk(parts, self.finish or "stop", self.usage or {})]
        if not self.sse:
            out.append(b"\n]")
        return out

    def error(self, message: str) -> bytes:
        """The last pieces when the backend broke mid-answer: the text held back, then the error."""
        held = self._chunk(self.held) if self.held else b""
        piece = held + self._piece({"error": {"code": 502, "message": message, "status": "UNAVAILABLE"}})
        return piece if self.sse else piece + b"\n]"


# ------------------------------------------------------------------ the flavour


class _Call:
    """One generateContent call (``flavours.Translation``)."""

    def __init__(self, payload: Any):
        self.body = to_openai(payload)
        self.model = str(payload.get("model") or "")
        self.sse = payload.get("alt") == "sse"
        self.id = os.urandom(12).hex()

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        return from_openai(chat, model=self.model, response_id=self.id)

    def stream(self) -> StreamTranslator:
        return StreamTranslator(model=self.model, response_id=self.id, sse=self.sse)


class _Gemini:
    """The Gemini API as ``flavours.Flavour``."""

    errors = "gemini"

    @staticmethod
    def memory() -> None:
        return None

    @staticmethod
    def translate(payload: Any, memory: Any) -> _Call:
        return _Call(payload)

    @staticmethod
    def count_body(payload: Any) -> dict[str, Any]:
        """``countTokens``: ``contents`` alone, or a whole ``generateContentRequest``."""
        if isinstance(payload, dict) and isinstance(payload.get("generateContentRequest"), dict):
            payload = {**payload["generateContentRequest"], "model": payload.get("model")}
        return to_openai(payload)


FLAVOUR = _Gemini()
