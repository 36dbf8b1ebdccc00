"""OpenAI Responses API <-> OpenAI chat translation, whole and streamed: input items, one
assistant turn per answer, reasoning, tools, stored responses."""

from __future__ import annotations

import json

import pytest

from arena_core.errors import InvalidRequest, NotFound
from arena_rollout.proxy import responses

TOOLS = [{"type": "function", "name": "shell", "description": "run a command", "strict": False,
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def test_items_become_chat_messages_one_assistant_turn_per_answer():
    body = {"model": "codex", "instructions": "You code.", "max_output_tokens": 64, "temperature": 0.2, "top_p": 0.9,
            "tools": TOOLS, "tool_choice": {"type": "function", "name": "shell"}, "parallel_tool_calls": False,
            "reasoning": {"effort": "high"},
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
                {"role": "user", "content": "list files"},
                {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "use ls"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running."}]},
                {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd":"ls"}'},
                {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": '{"cmd":"pwd"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
                {"type": "function_call_output", "call_id": "c2",
                 "output": [{"type": "input_text", "text": "/w"}]},
                {"type": "function_call", "call_id": "c3", "name": "shell", "arguments": "{}"},
            ]}
    sent, items = responses.to_openai(body)
    assert items == body["input"]
    assert sent["messages"] == [
        {"role": "system", "content": "You code."},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Running.", "reasoning_content": "use ls", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}},
            {"id": "c2", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"pwd"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
        {"role": "tool", "tool_call_id": "c2", "content": "/w"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
    ]
    assert sent["max_tokens"] == 64 and sent["temperature"] == 0.2 and sent["top_p"] == 0.9
    assert sent["tools"] == [{"type": "function", "function": {"name": "shell", "description": "run a command",
                                                               "parameters": TOOLS[0]["parameters"], "strict": False}}]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "shell"}}
    assert sent["parallel_tool_calls"] is False and sent["reasoning_effort"] == "high"


def test_reasoning_with_only_encrypted_content_adds_no_empty_message():
    sent, _ = responses.to_openai({"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
        {"role": "user", "content": "again"}]})
    assert sent["messages"] == [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]


def test_a_structured_output_format_becomes_the_chat_response_format():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    sent, _ = responses.to_openai({"input": "x", "text": {"format": {"type": "json_schema", "name": "v",
                                                                     "schema": schema, "strict": True}}})
    assert sent["response_format"] == {"type": "json_schema", "json_schema": {"name": "v", "schema": schema,
                                                                              "strict": True}}


@pytest.mark.parametrize(("body", "says"), [
    ({"input": []}, "'input' must not be empty"),
    ({"input": 3}, "'input' must be a string or a list"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input item type 'item_reference'"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role must be"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tool type 'file_search'"),
    ({"input": "x", "tool_choice": 3}, "tool_choice"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id"),
])
def test_bad_requests_are_refused_with_the_reason(body, says):
    with pytest.raises(InvalidRequest, match=says):
        responses.to_openai(body)


def test_a_previous_response_is_prepended_and_unknown_ones_are_not_found():
    stored = responses.Stored(limit=2)
    stored.put("resp_a", [{"role": "user", "content": "hi"}, responses._message_item("hello", "completed")])
    sent, items = responses.to_openai({"previous_response_id": "resp_a", "input": "again"}, stored)
    assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
    assert sent["messages"][1]["content"] == "hello" and len(items) == 3
    stored.put("resp_b", [])
    stored.put("resp_c", [])  # the oldest is forgotten
    with pytest.raises(NotFound, match="resp_a"):
        responses.to_openai({"previous_response_id": "resp_a", "input": "again"}, stored)
    with pytest.raises(NotFound):
        responses.to_openai({"previous_response_id": "resp_b", "input": "again"})


def chat_answer(message: dict, finish: str = "stop") -> dict:
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5}}


def test_a_chat_answer_becomes_output_items_and_usage():
    answer = chat_answer({"role": "assistant", "content": "Looking.", "reasoning_content": "think",
                          "tool_calls": [{"id": "call_1", "type": "function",
                                          "function": {"name": "shell", "arguments": '{"cmd":"ls"}'}}]}, "tool_calls")
    out = responses.from_openai(answer, {"input": "x", "tools": TOOLS}, response_id="resp_1", created_at=5,
                                model="codex")
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert out["output"][1]["content"][0]["text"] == "Looking."
    assert out["output"][2]["call_id"] == "call_1" and out["output"][2]["arguments"] == '{"cmd":"ls"}'
    assert out["status"] == "completed" and out["tools"] == TOOLS and out["id"] == "resp_1"
    assert out["usage"]["input_tokens"] == 10 and out["usage"]["output_tokens"] == 5 and out["usage"][
        "total_tokens"] == 15
    # the items replay as the same assistant message
    assert responses.messages_of(out["output"]) == [{
        "role": "assistant", "content": "Looking.", "reasoning_content": "think",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "shell",
                                                                         "arguments": '{"cmd":"ls"}'}}]}]
    cut = responses.from_openai(chat_answer({"content": "Loo"}, "length"), {"input": "x"}, response_id="r",
                                created_at=0, model="m")
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def events(pieces: list[bytes]) -> list[dict]:
    return [json.loads(p.split(b"data: ", 1)[1]) for p in pieces]


def test_the_stream_is_typed_events_with_reasoning_text_and_calls_in_order():
    kept = []
    tr = responses.StreamTranslator({"input": "x"}, response_id="resp_s", model="codex", done=kept.append)
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
              {"choices": [{"index": 0, "delta": {"content": "Do"}}]},
              {"choices": [{"index": 0, "delta": {"content": "ne"}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                                                  "function": {"name": "shell", "arguments": "{}"}}]}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}]
    out = []
    for chunk in chunks:
        out += tr.feed(chunk)
    out += tr.end()
    docs = events(out)
    assert [d["sequence_number"] for d in docs] == list(range(len(docs)))
    assert [d["type"] for d in docs] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = docs[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Done" and final["output"][2]["call_id"] == "call_9"
    assert final["usage"]["output_tokens"] == 4 and kept == [final]
    assert out[0].startswith(b"event: response.created\ndata: ")


def test_a_stream_broken_by_the_backend_ends_with_response_failed():
    tr = responses.StreamTranslator({"input": "x"}, response_id="resp_f", model="m")
    tr.feed({"choices": [{"index": 0, "delta": {"content": "par"}}]})
    (failed,) = events([tr.error("backend replica r died mid-stream")])
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == "backend replica r died mid-stream"


def test_the_answer_and_every_event_validate_as_the_openai_sdks_own_types():
    """The SDK builds its objects without validating them; validated here, every field the
    SDK's types require is there, with its type."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    answer = chat_answer({"role": "assistant", "content": "Looking.", "reasoning_content": "think", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]}, "tool_calls")
    body = {"input": "x", "tools": TOOLS, "instructions": "You code.", "max_output_tokens": 9}
    Response.model_validate(responses.from_openai(answer, body, response_id="resp_1", created_at=1, model="m"))
    tr = responses.StreamTranslator(body, response_id="resp_1", model="m")
    pieces = []
    for chunk in ({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "Do"}}]},
                  {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "function": {
                      "name": "shell", "arguments": "{}"}}]}, "finish_reason": "tool_calls"}]}):
        pieces += tr.feed(chunk)
    pieces += [*tr.end(), tr.error("cut")]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events(pieces):
        adapter.validate_python(event)
