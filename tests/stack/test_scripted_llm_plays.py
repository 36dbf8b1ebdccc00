"""The scripted backend's plays: multi-turn scripts whose turn comes from the request alone."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest

from arena_stack.scripted_llm import (Script, ScriptedLLM, ScriptedPlay, ScriptedToolCall, ScriptedTurn, create_app,
                                      decode_ids, load_script)

BASH = ScriptedToolCall(name="bash", arguments=json.dumps({"command": "ls"}))
SCRIPT = Script(plays=[
    ScriptedPlay(label="tools", match="tool task", turns=[
        ScriptedTurn(content="Let me look.", tool_calls=[BASH]),
        ScriptedTurn(tool_calls=[BASH, ScriptedToolCall(name="bash", arguments='{"command": "echo done"}')]),
        ScriptedTurn(content="All done."),
    ]),
    ScriptedPlay(label="text-a", match="text task", weight=0.5, turns=[
        ScriptedTurn(content="THOUGHT: a\n\n```bash\necho a\n```"), ScriptedTurn(content="a2")]),
    ScriptedPlay(label="text-b", match="text task", weight=0.5, turns=[
        ScriptedTurn(content="THOUGHT: b\n\n```bash\necho b\n```"), ScriptedTurn(content="b2")]),
])


def conversation(task: str, turns: int) -> list[dict]:
    """A chat with ``turns`` assistant messages already in it (what the agent sends next)."""
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": task}]
    for i in range(turns):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"output {i}"}]
    return messages


def test_the_turn_is_the_number_of_assistant_messages_in_the_request():
    llm = ScriptedLLM(SCRIPT)
    body = {"messages": conversation("a tool task", 0), "return_token_ids": True, "logprobs": True}
    first = llm.complete(body)["choices"][0]
    assert first["message"]["content"] == "Let me look."
    assert [c["function"]["name"] for c in first["message"]["tool_calls"]] == ["bash"]
    assert first["finish_reason"] == "tool_calls"
    # token ids hold the text and then the tool call, as the model "sampled" them
    assert decode_ids(first["token_ids"]).startswith("Let me look.<tool_call>")
    assert len(first["logprobs"]["content"]) == len(first["token_ids"])
    second = llm.complete({**body, "messages": conversation("a tool task", 1)})["choices"][0]
    assert second["message"]["content"] is None and len(second["message"]["tool_calls"]) == 2
    assert len({c["id"] for c in second["message"]["tool_calls"]}) == 2
    third = llm.complete({**body, "messages": conversation("a tool task", 2)})["choices"][0]
    assert third["message"]["content"] == "All done." and "tool_calls" not in third["message"]
    assert third["finish_reason"] == "stop"
    # past the last turn the last is played again; the same request always gets the same turn
    again = llm.complete({**body, "messages": conversation("a tool task", 7)})["choices"][0]
    assert again["message"]["content"] == "All done."
    assert llm.complete(body)["choices"][0]["token_ids"] == first["token_ids"]


def test_the_play_is_drawn_by_seed_among_those_that_match_the_first_user_message():
    llm = ScriptedLLM(SCRIPT)
    picks = {s: llm.complete({"messages": conversation("a text task", 0), "seed": s})["choices"][0]["message"]
             ["content"][:10] for s in range(8)}
    assert set(picks.values()) == {"THOUGHT: a", "THOUGHT: b"}
    for seed, start in picks.items():  # the same seed keeps its play on every turn
        later = llm.complete({"messages": conversation("a text task", 1), "seed": seed})["choices"][0]
        assert later["message"]["content"] == ("a2" if start.endswith("a") else "b2")
    with pytest.raises(ValueError, match="no play"):
        llm.complete({"messages": conversation("something else", 0)})


def test_a_play_may_match_any_user_message_not_only_the_first():
    """Codex's first user message is its ``<environment_context>``, the task comes after it."""
    script = Script(plays=[
        ScriptedPlay(label="first-only", match="the task", turns=[ScriptedTurn(content="first")]),
        ScriptedPlay(label="any", match="the task", match_any_user=True, turns=[ScriptedTurn(content="any")]),
    ])
    llm = ScriptedLLM(script)
    context_first = [{"role": "user", "content": "<environment_context>cwd</environment_context>"},
                     {"role": "user", "content": [{"type": "text", "text": "do the task"}]}]
    assert {llm.complete({"messages": context_first, "seed": s})["choices"][0]["message"]["content"]
            for s in range(8)} == {"any"}
    task_first = [{"role": "user", "content": "do the task"}]
    assert {llm.complete({"messages": task_first, "seed": s})["choices"][0]["message"]["content"]
            for s in range(8)} == {"first", "any"}


def test_a_streamed_turn_carries_its_text_then_one_chunk_per_tool_call():
    llm = ScriptedLLM(SCRIPT)
    body = {"messages": conversation("a tool task", 1), "stream": True, "return_token_ids": True, "logprobs": True,
            "stream_options": {"include_usage": True}}
    whole = llm.complete({**body, "stream": False})["choices"][0]
    chunks = llm.chunks(body, chat=True)
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[1:] if c["choices"]
             and "tool_calls" in c["choices"][0].get("delta", {})]
    assert [c["index"] for c in calls] == [0, 1]
    assert [c["function"] for c in calls] == [c["function"] for c in whole["message"]["tool_calls"]]
    ids = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert ids == whole["token_ids"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
    # text and a tool call in one turn: the text streams first
    first = llm.chunks({**body, "messages": conversation("a tool task", 0)}, chat=True)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in first[1:] if c["choices"])
    assert text == "Let me look."
    assert "tool_calls" in first[-2]["choices"][0]["delta"]


def test_max_tokens_cuts_a_turn_and_drops_its_tool_calls():
    out = ScriptedLLM(SCRIPT).complete({"messages": conversation("a tool task", 0), "max_tokens": 5})["choices"][0]
    assert out["finish_reason"] == "length" and out["message"]["content"] == "Let m"
    assert "tool_calls" not in out["message"]


def test_a_script_file_with_plays_loads_and_is_checked(tmp_path):
    path = tmp_path / "script.json"
    path.write_bytes(msgspec.json.encode(SCRIPT))
    assert load_script(path) == SCRIPT
    path.write_text(json.dumps({"plays": [{"label": "x", "turns": []}]}))
    with pytest.raises(ValueError, match="at least one turn"):
        load_script(path)
    path.write_text(json.dumps({}))
    with pytest.raises(ValueError, match="response or play"):
        load_script(path)


async def test_over_http_a_request_no_play_matches_is_a_400():
    transport = httpx.ASGITransport(app=create_app(ScriptedLLM(SCRIPT)))
    async with httpx.AsyncClient(transport=transport, base_url="http://llm") as http:
        ok = await http.post("/v1/chat/completions", json={"messages": conversation("a tool task", 2)})
        assert ok.json()["choices"][0]["message"]["content"] == "All done."
        bad = await http.post("/v1/chat/completions", json={"messages": conversation("nothing", 0)})
        assert bad.status_code == 400 and "no play" in bad.json()["error"]["message"]
