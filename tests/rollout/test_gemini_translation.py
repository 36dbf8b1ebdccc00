"""Gemini API <-> OpenAI chat translation, whole and streamed: contents and parts, function
calls with and without ids, schemas, generation config, thoughts."""

from __future__ import annotations

import json

import pytest

from arena_core.errors import InvalidRequest
from arena_core.llm_errors import body as error_body
from arena_core.llm_errors import flavor_of
from arena_rollout.proxy import gemini


def request(**extra) -> dict:
    return gemini.route_payload({"contents": [{"role": "user", "parts": [{"text": "hi"}]}], **extra},
                                model="gemini-x", stream=False, sse=False)


def test_contents_parts_tools_and_config_become_a_chat_body():
    body = gemini.route_payload({
        "systemInstruction": {"parts": [{"text": "You "}, {"text": "code."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "list "}, {"text": "files"}]},
            {"role": "model", "parts": [{"text": "plan", "thought": True, "thoughtSignature": "sig"},
                                        {"text": "Running."},
                                        {"functionCall": {"name": "shell", "args": {"cmd": "ls"}}},
                                        {"functionCall": {"id": "given", "name": "shell", "args": {}}}]},
            {"role": "user", "parts": [{"functionResponse": {"name": "shell", "response": {"output": "a.py"}}},
                                       {"functionResponse": {"id": "given", "name": "shell",
                                                             "response": {"output": "/w"}}},
                                       {"text": "go on"}]},
        ],
        "tools": [{"functionDeclarations": [
            {"name": "shell", "description": "run", "parameters": {
                "type": "OBJECT", "properties": {"cmd": {"type": "STRING"}, "args": {
                    "type": "ARRAY", "items": {"type": "STRING"}}}, "required": ["cmd"]}},
            {"name": "read", "parametersJsonSchema": {"type": "object", "properties": {}}}]}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["shell"]}},
        "generationConfig": {"temperature": 0.3, "topP": 0.8, "topK": 20, "maxOutputTokens": 99,
                             "stopSequences": ["END"], "candidateCount": 1, "seed": 7},
    }, model="gemini-x", stream=True, sse=True)
    sent = gemini.to_openai(body)
    assert sent["model"] == "gemini-x" and sent["stream"] is True
    assert sent["messages"] == [
        {"role": "system", "content": "You code."},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Running.", "reasoning_content": "plan", "tool_calls": [
            {"id": "call_1_2", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}},
            {"id": "given", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1_2", "content": '{"output": "a.py"}'},
        {"role": "tool", "tool_call_id": "given", "content": '{"output": "/w"}'},
        {"role": "user", "content": "go on"},
    ]
    assert sent["tools"][0]["function"]["parameters"] == {
        "type": "object", "properties": {"cmd": {"type": "string"}, "args": {"type": "array",
                                                                           "items": {"type": "string"}}},
        "required": ["cmd"]}
    assert sent["tools"][1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "shell"}}
    assert (sent["temperature"], sent["top_p"], sent["top_k"], sent["max_tokens"], sent["stop"], sent["seed"]) == \
        (0.3, 0.8, 20, 99, ["END"], 7)


@pytest.mark.parametrize(("extra", "says"), [
    ({"contents": []}, "'contents' must be a non-empty list"),
    ({"contents": [{"role": "tool", "parts": []}]}, "role must be"),
    ({"contents": [{"parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}]}, "part 'inlineData'"),
    ({"tools": [{"googleSearch": {}}]}, "googleSearch is not supported"),
    ({"generationConfig": {"candidateCount": 2}}, "candidateCount=1"),
    ({"tools": [{"functionDeclarations": []}], "toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}},
     "mode must be"),
])
def test_bad_requests_are_refused_with_the_reason(extra, says):
    with pytest.raises(InvalidRequest, match=says):
        gemini.to_openai(request(**extra))


def test_a_chat_answer_becomes_a_candidate_with_parts_and_usage():
    answer = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Looking.", "reasoning_content": "think", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}]}}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5}}
    out = gemini.from_openai(answer, model="gemini-x", response_id="r1")
    (candidate,) = out["candidates"]
    assert candidate["content"] == {"role": "model", "parts": [
        {"text": "think", "thought": True}, {"text": "Looking."},
        {"functionCall": {"id": "call_1", "name": "shell", "args": {"cmd": "ls"}}}]}
    assert candidate["finishReason"] == "STOP"
    assert out["usageMetadata"] == {"promptTokenCount": 10, "candidatesTokenCount": 5, "totalTokenCount": 15}
    # the model turn replays as the same assistant message
    assert gemini.messages_of([candidate["content"]]) == [
        {"role": "assistant", "content": "Looking.", "reasoning_content": "think",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "shell",
                                                                          "arguments": '{"cmd": "ls"}'}}]}]
    cut = gemini.from_openai({"choices": [{"message": {"content": "Lo"}, "finish_reason": "length"}]}, model="m",
                             response_id="r")
    assert cut["candidates"][0]["finishReason"] == "MAX_TOKENS"


CHUNKS = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
          {"choices": [{"index": 0, "delta": {"content": "Do"}}]},
          {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_7", "function": {
              "name": "shell", "arguments": '{"cmd": '}}]}}]},
          {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}}]}}]},
          {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
          {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}]


def run(tr: gemini.StreamTranslator) -> bytes:
    out = []
    for chunk in CHUNKS:
        out += tr.feed(chunk)
    return b"".join(out + tr.end())


def test_the_stream_as_server_sent_events_and_as_a_json_array_says_the_same():
    sse = run(gemini.StreamTranslator(model="g", response_id="r", sse=True))
    docs = [json.loads(e[len(b"data: "):]) for e in sse.split(b"\r\n\r\n") if e]
    array = json.loads(run(gemini.StreamTranslator(model="g", response_id="r", sse=False)))
    assert docs == array
    assert [p for d in docs for p in d["candidates"][0]["content"]["parts"]] == [
        {"text": "Do"}, {"functionCall": {"id": "call_7", "name": "shell", "args": {"cmd": "ls"}}}]
    assert docs[-1]["candidates"][0]["finishReason"] == "STOP" and docs[-1]["usageMetadata"]["totalTokenCount"] == 7
    # the last text piece goes with the last chunk: no chunk is a lone empty text part
    assert docs[-1]["candidates"][0]["content"]["parts"][0] == {"text": "Do"}
    assert all(p != {"text": ""} for d in docs for p in d["candidates"][0]["content"]["parts"])


def test_errors_are_googles_shape_on_gemini_paths():
    assert flavor_of("/proxy/r/v1beta/models/gemini-x:generateContent") == "gemini"
    assert flavor_of("/proxy/r/v1/models") == "openai"
    assert json.loads(error_body("gemini", 429, "overloaded", "slow down")) == {
        "error": {"code": 429, "message": "slow down", "status": "RESOURCE_EXHAUSTED"}}
    tr = gemini.StreamTranslator(model="g", response_id="r", sse=False)
    broken = b"".join(tr.feed(CHUNKS[1])) + tr.error("backend replica died mid-stream")
    assert json.loads(broken)[-1] == {"error": {"code": 502, "message": "backend replica died mid-stream",
                                                "status": "UNAVAILABLE"}}


def test_the_answer_and_every_chunk_validate_as_the_google_genai_sdks_own_types():
    from google.genai import types

    answer = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "content": "Looking.", "reasoning_content": "think", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
    types.GenerateContentResponse.model_validate(gemini.from_openai(answer, model="g", response_id="r"))
    for doc in json.loads(run(gemini.StreamTranslator(model="g", response_id="r", sse=False))):
        types.GenerateContentResponse.model_validate(doc)
