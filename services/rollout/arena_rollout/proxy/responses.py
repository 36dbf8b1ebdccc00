"""The OpenAI Responses API over an OpenAI-compatible backend. Pure translation, and the
responses a rollout's agent may refer to again (``previous_response_id``).

``to_openai`` turns a ``/v1/responses`` body (``instructions``, ``input`` as text or items:
``message``, ``function_call``, ``function_call_output``, ``reasoning``; function tools) into a
chat-completions body; ``from_openai`` turns the chat answer into a ``response`` (output items
``reasoning``, ``message``, ``function_call``); ``StreamTranslator`` does it chunk by chunk as
the API's typed events. docs/rollout.md ("The Responses API").
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any

import msgspec

from arena_core.errors import InvalidRequest, NotFound

#: responses a rollout may refer to with ``previous_response_id`` (the oldest are forgotten)
STORED_PER_ROLLOUT = 64
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_SSE = b"text/event-stream; charset=utf-8"


def _id(prefix: str) -> str:
    return prefix + "_" + os.urandom(12).hex()


# ------------------------------------------------------------------ requests


class Stored:
    """A rollout's served responses: id -> the conversation as items (its input, then its output)."""

    def __init__(self, limit: int = STORED_PER_ROLLOUT):
        self.limit = limit
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        items = self._items.get(response_id)
        if items is None:
            raise NotFound(f"previous response with id {response_id!r} not found in this rollout "
                           f"(the proxy keeps the last {self.limit} responses of a rollout, never another's)")
        return items

    def put(self, response_id: str, items: list[dict[str, Any]]) -> None:
        self._items[response_id] = items
        while len(self._items) > self.limit:
            self._items.popitem(last=False)


def _text(content: Any, where: str) -> str:
    """The text of a message's content: a string or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of content parts")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            out.append(str(part.get("text") or ""))
        elif kind == "refusal":
            out.append(str(part.get("refusal") or ""))
        else:
            raise InvalidRequest(f"{where}.content[{i}]: content part type {kind!r} is not supported by this proxy "
                                 "(text parts only)")
    return "".join(out)


def _items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message)."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if given is None:
        return []
    if not isinstance(given, list):
        raise InvalidRequest("'input' must be a string or a list of input items")
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise InvalidRequest(f"input[{i}] must be an object")
    return given


def messages_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input (and earlier output) items as chat messages. One assistant turn's items (its
    ``reasoning``, ``message`` and ``function_call`` items, in that order) become one assistant
    message, as the backend answered them."""
    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None

    def close() -> None:
        nonlocal turn
        if turn is not None and (turn["content"] is not None or turn.get("tool_calls")
                                 or turn.get("reasoning_content")):
            out.append(turn)  # (a turn of nothing but encrypted reasoning is no message)
        turn = None

    def open_turn(fresh: bool) -> dict[str, Any]:
        nonlocal turn
        if turn is not None and fresh and (turn["content"] is not None or turn.get("tool_calls")):
            close()
        if turn is None:
            turn = {"role": "assistant", "content": None}
        return turn

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise InvalidRequest(f"{where}.role must be 'user', 'assistant', 'system' or 'developer'")
            text = _text(item.get("content"), where)
            if role == "assistant":
                current = open_turn(True)
                current["content"] = (current["content"] or "") + text
            else:
                close()
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            current = open_turn(False)
            current.setdefault("tool_calls", []).append({
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""}})
        elif kind == "function_call_output":
            close()
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            text = _text(item.get("content"), where) or _text(item.get("summary"), where)
            current = open_turn(True)
            if text:
                current["reasoning_content"] = current.get("reasoning_content", "") + text
        else:
            raise InvalidRequest(f"{where}: input item type {kind!r} is not supported by this proxy (message, "
                                 "function_call, function_call_output and reasoning are)")
    close()
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(f"tools[{i}]: tool type {kind!r} is not supported by this proxy (function tools are)")
        fn = {"name": tool.get("name"), "description": tool.get("description") or "",
              "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("strict") is not None:
            fn["strict"] = tool["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        return choice.get("mode") or "auto"
    raise InvalidRequest("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}")


def to_openai(body: Any, stored: Stored | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A ``/v1/responses`` request as an OpenAI chat-completions body, and the conversation
    as items (the previous response's, then this input) for storing with the answer."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    items = _items(body)
    previous = body.get("previous_response_id")
    if previous is not None:
        if not isinstance(previous, str) or not previous:
            raise InvalidRequest("'previous_response_id' must be a response id")
        items = [*(stored or Stored()).get(previous), *items]
    if not items:
        raise InvalidRequest("'input' must not be empty")
    messages = messages_of(items)
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            instructions = _text(instructions, "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    sent: dict[str, Any] = {"model": body.get("model") or "default", "messages": messages,
                            "stream": bool(body.get("stream"))}
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise InvalidRequest("'max_output_tokens' must be a positive integer")
        sent["max_tokens"] = limit
    for name in ("temperature", "top_p", "top_logprobs", "parallel_tool_calls", "seed"):
        if body.get(name) is not None:
            sent[name] = body[name]
    if body.get("tools"):
        sent["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        sent["tool_choice"] = _tool_choice(body["tool_choice"])
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort:
        sent["reasoning_effort"] = effort
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        sent["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        sent["response_format"] = {"type": "json_object"}
    return sent, items


# ------------------------------------------------------------------ answers


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    reasoning = int(((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def _reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _reasoning_of(message: dict[str, Any]) -> str:
    return str(message.get("reasoning_content") or message.get("reasoning") or "")


def response(body: dict[str, Any], *, response_id: str, created_at: float, model: str, output: list[dict[str, Any]],
             status: str, usage: dict[str, Any] | None, error: dict[str, Any] | None = None,
             finish: str | None = None) -> dict[str, Any]:
    """A ``response`` object: the request's parameters echoed, as the API does."""
    return {
        "id": response_id, "object": "response", "created_at": int(created_at), "status": status,
        "error": error, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": model, "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
        "store": body.get("store", True), "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [], "top_p": body.get("top_p"), "truncation": body.get("truncation", "disabled"),
        "usage": usage, "user": body.get("user"), "metadata": body.get("metadata") or {},
    }


def _status(finish: str | None) -> str:
    return "incomplete" if finish == "length" else "completed"


def from_openai(answer: dict[str, Any], body: dict[str, Any], *, response_id: str, created_at: float,
                model: str) -> dict[str, Any]:
    """An OpenAI chat completion as a ``response``."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    status = _status(finish)
    output: list[dict[str, Any]] = []
    if _reasoning_of(message):
        output.append(_reasoning_item(_reasoning_of(message)))
    if message.get("content"):
        output.append(_message_item(message["content"], status))
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        output.append(_call_item(call.get("id") or _id("call"), fn.get("name") or "", fn.get("arguments") or "",
                                 status))
    return response(body, response_id=response_id, created_at=created_at, model=model, output=output, status=status,
                    usage=_usage(answer.get("usage")), finish=finish)


class StreamTranslator:
    """OpenAI chat chunks in, the Responses API's typed SSE events out (each with its
    ``sequence_number``); ``done`` is called with the final response."""

    content_type = _SSE

    def __init__(self, body: dict[str, Any], *, response_id: str, model: str, done=lambda response: None):
        self.body, self.id, self.model, self.done = body, response_id, model, done
        self.created_at = time.time()
        self.seq = 0
        self.started = False
        self.output: list[dict[str, Any]] = []
        self.open: str | None = None  # "reasoning", "message" or "call:<chat index>"
        self.text = ""
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        doc = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(doc) + b"\n\n"

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        return response(self.body, response_id=self.id, created_at=self.created_at, model=self.model,
                        output=list(self.output), status=status, usage=extra.pop("usage", None), **extra)

    def _start(self) -> list[bytes]:
        self.started = True
        return [self._event("response.created", {"response": self._response("in_progress")}),
                self._event("response.in_progress", {"response": self._response("in_progress")})]

    def _item(self) -> dict[str, Any]:
        return self.output[-1]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._item()["id"], "output_index": len(self.output) - 1}

    def _open(self, key: str, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.open, self.text = key, ""
        self.output.append(item)
        out.append(self._event("response.output_item.added", {"output_index": len(self.output) - 1, "item": item}))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", {
                **self._where(), "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        return out

    def _close(self, status: str = "completed") -> list[bytes]:
        if self.open is None:
            return []
        item, where, out = self._item(), self._where(), []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": self.text}]
            out.append(self._event("response.reasoning_text.done", {**where, "content_index": 0, "text": self.text}))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item["content"], item["status"] = [part], status
            out.append(self._event("response.output_text.done", {**where, "content_index": 0, "text": self.text,
                                                                 "logprobs": []}))
            out.append(self._event("response.content_part.done", {**where, "content_index": 0, "part": part}))
        else:
            item["arguments"], item["status"] = self.text, status
            out.append(self._event("response.function_call_arguments.done", {
                **where, "name": item["name"], "arguments": self.text}))
        out.append(self._event("response.output_item.done", {"output_index": where["output_index"], "item": item}))
        self.open = None
        return out

    def feed(self, chunk: dict[str, Any]) -> list[bytes]:
        out = [] if self.started else self._start()
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = _reasoning_of(delta)
            if reasoning:
                if self.open != "reasoning":
                    out += self._open("reasoning", {"type": "reasoning", "id": _id("rs"), "summary": [],
                                                    "content": []})
                self.text += reasoning
                out.append(self._event("response.reasoning_text.delta", {**self._where(), "content_index": 0,
                                                                         "delta": reasoning}))
            if delta.get("content"):
                if self.open != "message":
                    out += self._open("message", {"type": "message", "id": _id("msg"), "status": "in_progress",
                                                  "role": "assistant", "content": []})
                self.text += delta["content"]
                out.append(self._event("response.output_text.delta", {**self._where(), "content_index": 0,
                                                                      "delta": delta["content"], "logprobs": []}))
            for call in delta.get("tool_calls") or []:
                key = f"call:{call.get('index', 0)}"
                fn = call.get("function") or {}
                if self.open != key:
                    out += self._open(key, {"type": "function_call", "id": _id("fc"),
                                            "call_id": call.get("id") or _id("call"), "name": fn.get("name") or "",
                                            "arguments": "", "status": "in_progress"})
                if fn.get("arguments"):
                    self.text += fn["arguments"]
                    out.append(self._event("response.function_call_arguments.delta", {**self._where(),
                                                                                      "delta": fn["arguments"]}))
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> list[bytes]:
        out = [] if self.started else self._start()
        status = _status(self.finish)
        out += self._close(status)
        final = self._response(status, usage=_usage(self.usage), finish=self.finish)
        self.done(final)
        out.append(self._event("response.incomplete" if status == "incomplete" else "response.completed",
                               {"response": final}))
        return out

    def error(self, message: str) -> bytes:
        """``response.failed``: the backend broke mid-answer (what came before was relayed)."""
        head = b"".join(self._start()) if not self.started else b""
        failed = self._response("failed", usage=_usage(self.usage),
                                error={"code": "server_error", "message": message})
        return head + self._event("response.failed", {"response": failed})


# ------------------------------------------------------------------ the flavour


class _Call:
    """One Responses call (``flavours.Translation``): the answer stored for a later
    ``previous_response_id`` unless the request said ``store: false``."""

    def __init__(self, payload: Any, stored: Stored):
        self.body, self.items = to_openai(payload, stored)
        self.payload, self.stored = payload, stored
        self.id = _id("resp")
        self.model = str(payload.get("model") or "")

    def _keep(self, done: dict[str, Any]) -> None:
        if self.payload.get("store", True) is not False and done["status"] in ("completed", "incomplete"):
            self.stored.put(self.id, [*self.items, *done["output"]])

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        done = from_openai(chat, self.payload, response_id=self.id, created_at=time.time(),
                           model=self.model or str(chat.get("model") or ""))
        self._keep(done)
        return done

    def stream(self) -> StreamTranslator:
        return StreamTranslator(self.payload, response_id=self.id, model=self.model, done=self._keep)


class _Responses:
    """The Responses API as ``flavours.Flavour``."""

    errors = "openai"

    @staticmethod
    def memory() -> Stored:
        return Stored()

    @staticmethod
    def translate(payload: Any, memory: Stored) -> _Call:
        return _Call(payload, memory)

    @staticmethod
    def count_body(payload: Any) -> dict[str, Any]:
        return to_openai(payload)[0]


FLAVOUR = _Responses()
