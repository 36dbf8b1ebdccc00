"""Anthropic Messages <-> OpenAI chat translation, whole and streamed."""

from __future__ import annotations

import json

import pytest

from arena_core.errors import InvalidRequest
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse, ScriptedToolCall
from arena_rollout.proxy import anthropic

TOOLS = [{"name": "read_file", "description": "read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def test_request_translation_keeps_system_tools_and_tool_results():
    body = {"model": "claude-x", "max_tokens": 64, "system": [{"type": "text", "text": "be brief"}],
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "read_file"},
            "messages": [
                {"role": "user", "content": "open a.py"},
                {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                                  {"type": "tool_use", "id": "t1", "name": "read_file",
                                                   "input": {"path": "a.py"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "print(1)"}]},
                                             {"type": "text", "text": "now fix it"}]}]}
    out = anthropic.to_openai(body)
    assert out["messages"][0] == {"role": "system", "content": "be brief"}
    assert out["messages"][2]["tool_calls"][0]["function"] == {"name": "read_file", "arguments": '{"path": "a.py"}'}
    assert out["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "print(1)"}
    assert out["messages"][4] == {"role": "user", "content": "now fix it"}
    assert out["stop"] == ["END"] and out["top_k"] == 5 and out["max_tokens"] == 64
    assert out["tools"][0]["function"]["parameters"] == TOOLS[0]["input_schema"]
    assert out["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}


def test_bad_messages_requests_are_refused_with_the_reason():
    with pytest.raises(InvalidRequest, match="max_tokens"):
        anthropic.to_openai({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(InvalidRequest, match="image"):
        anthropic.to_openai({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]})


def test_tool_use_answer_round_trips_whole_and_streamed():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="t", tool_calls=[
        ScriptedToolCall(name="read_file", arguments='{"path": "a.py"}')])]))
    body = anthropic.to_openai({"max_tokens": 200, "tools": TOOLS, "messages": [{"role": "user", "content": "go"}]})
    whole = anthropic.from_openai(llm.complete(body), model="claude-x")
    assert whole["stop_reason"] == "tool_use"
    assert whole["content"] == [{"type": "tool_use", "id": whole["content"][0]["id"], "name": "read_file",
                                 "input": {"path": "a.py"}}]
    tr = anthropic.StreamTranslator(model="claude-x")
    events = []
    for chunk in llm.chunks({**body, "stream": True, "stream_options": {"include_usage": True}}, chat=True):
        events += tr.feed(chunk)
    events += tr.end()
    names = [e.split(b"\n")[0].decode() for e in events]
    assert names[0] == "event: message_start" and names[-1] == "event: message_stop"
    deltas = [json.loads(e.split(b"data: ")[1]) for e in events if b"input_json_delta" in e]
    assert "".join(d["delta"]["partial_json"] for d in deltas) == '{"path": "a.py"}'
    final = json.loads(events[-2].split(b"data: ")[1])
    assert final["delta"]["stop_reason"] == "tool_use" and final["usage"]["output_tokens"] > 0


def test_stop_reasons_map():
    assert anthropic.stop_reason("length", None) == ("max_tokens", None)
    assert anthropic.stop_reason("stop", "END") == ("stop_sequence", "END")
    assert anthropic.stop_reason("stop", None) == ("end_turn", None)


def test_a_system_message_mid_conversation_stays_in_place_and_reasoning_blocks_are_dropped():
    """Claude Code sends a ``system`` message inside ``messages`` (the sub-agent list) and
    replays its thinking blocks: both translate, neither is refused."""
    sent = anthropic.to_openai({"model": "m", "max_tokens": 8, "system": "You code.", "messages": [
        {"role": "user", "content": "fix it"},
        {"role": "system", "content": [{"type": "text", "text": "Agents: "}, {"type": "text", "text": "explore"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Looking."}]},
        {"role": "user", "content": "go on"},
    ]})
    assert sent["messages"] == [{"role": "system", "content": "You code."}, {"role": "user", "content": "fix it"},
                                {"role": "system", "content": "Agents: explore"},
                                {"role": "assistant", "content": "Looking."}, {"role": "user", "content": "go on"}]
