"""The Gemini API on the proxy, with Google's ``google-genai`` SDK against the real rollout app
in front of the scripted vLLM-shaped backend: ``generate_content`` whole and streamed, a
function call round trip, ``countTokens``, the API's own error shape and key forms, a backend
dying and a client giving up mid-stream, and every call captured token-exact and merged into
one training sequence."""

from __future__ import annotations

import json

import httpx
import pytest
from google import genai
from google.genai import errors as genai_errors
from google.genai import types

from arena_core.schemas import RolloutState, SamplingParams
from arena_core.sequences import assemble
from arena_stack.scripted_llm import Faults

from tests.rollout.test_proxy_responses_api import backend_reasons
from tests.rollout.test_proxy_with_sdks import SCRIPT, assert_exact, stack  # noqa: F401 - the fixture

MODEL = "gemini-2.5-pro"
READ_FILE = types.FunctionDeclaration(name="read_file", description="read a file", parameters=types.Schema(
    type=types.Type.OBJECT, properties={"path": types.Schema(type=types.Type.STRING)}, required=["path"]))


def client(s, rid: str, key: str) -> genai.Client:
    return genai.Client(api_key=key, http_options=types.HttpOptions(
        base_url=f"{s.url}/proxy/{rid}", retry_options=types.HttpRetryOptions(attempts=1)))


def config(**extra) -> types.GenerateContentConfig:
    return types.GenerateContentConfig(system_instruction="You fix bugs.", **extra)


async def test_generate_content_whole_with_a_function_call_round_trip_is_token_exact_in_one_sequence(stack,
                                                                                                    tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    api = client(s, rid, key).aio
    tools = [types.Tool(function_declarations=[READ_FILE])]
    first = await api.models.generate_content(model=MODEL, contents="fix the median",
                                              config=config(tools=tools, temperature=0.5, max_output_tokens=300))
    (call,) = first.function_calls
    assert call.name == "read_file" and call.args == {"path": "a.py"} and call.id
    assert first.candidates[0].finish_reason == types.FinishReason.STOP
    assert first.usage_metadata.prompt_token_count > 0 and first.usage_metadata.candidates_token_count > 0
    history = [types.Content(role="user", parts=[types.Part(text="fix the median")]), first.candidates[0].content,
               types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                   id=call.id, name="read_file", response={"output": "def median(): ..."}))])]
    second = await api.models.generate_content(model=MODEL, contents=history, config=config(tools=tools))
    assert second.text == SCRIPT.responses[0].content and second.model_version == MODEL

    steps = await s.steps(rid, 2)
    assert [st.api for st in steps] == ["gemini.generate_content"] * 2
    for st, raw in zip(steps, s.backends["default"].bodies):
        assert_exact(st, raw)
    assert steps[0].request_messages[0] == {"role": "system", "content": "You fix bugs."}
    assert steps[0].tools[0]["function"]["parameters"] == {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    assert steps[0].sampling.temperature == 0.5 and steps[0].sampling.max_tokens == 300
    assert steps[1].request_messages[-1] == {"role": "tool", "tool_call_id": call.id,
                                             "content": json.dumps({"output": "def median(): ..."})}
    sequences, breaks = assemble(steps)
    assert len(sequences) == 1 and breaks == [] and sequences[0].step_indexes == [0, 1]


async def test_generate_content_stream_as_sse_and_as_a_json_array(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    api = client(s, rid, key).aio
    chunks = [c async for c in await api.models.generate_content_stream(model=MODEL, contents="fix the median",
                                                                        config=config())]
    assert "".join(c.text or "" for c in chunks) == SCRIPT.responses[0].content
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert chunks[-1].usage_metadata.candidates_token_count == len(SCRIPT.responses[0].content.encode())

    tools = [types.Tool(function_declarations=[READ_FILE])]
    called = [c async for c in await api.models.generate_content_stream(model=MODEL, contents="again",
                                                                        config=config(tools=tools))]
    calls = [fc for c in called for fc in (c.function_calls or [])]
    assert [(fc.name, fc.args) for fc in calls] == [("read_file", {"path": "a.py"})]

    # without ?alt=sse: one JSON array, as Google's REST API streams it; the key as ?key=
    async with httpx.AsyncClient(timeout=10) as http:
        answer = await http.post(f"{s.url}/proxy/{rid}/v1beta/models/{MODEL}:streamGenerateContent",
                                 params={"key": key}, json={"contents": [{"role": "user", "parts": [{"text": "x"}]}]})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/json")
    pieces = answer.json()
    assert "".join(p["text"] for c in pieces for p in c["candidates"][0]["content"]["parts"]) == \
        SCRIPT.responses[0].content
    assert pieces[-1]["candidates"][0]["finishReason"] == "STOP" and pieces[-1]["usageMetadata"]["totalTokenCount"]

    steps = await s.steps(rid, 3)
    assert [st.stream for st in steps] == [True, True, True]
    for st, raw in zip(steps, s.backends["default"].bodies):
        assert_exact(st, raw)


async def test_count_tokens_and_the_v1_prefix(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    api = client(s, rid, key).aio
    counted = await api.models.count_tokens(model=MODEL, contents="fix the median")
    async with httpx.AsyncClient(base_url=f"{s.url}/proxy/{rid}/v1", timeout=10,
                                 headers={"x-goog-api-key": key}) as http:
        v1 = await http.post(f"/models/{MODEL}:generateContent",
                             json={"contents": [{"parts": [{"text": "fix the median"}]}]})
        v1_count = await http.post(f"/models/{MODEL}:countTokens", json={"generateContentRequest": {
            "contents": [{"parts": [{"text": "fix the median"}]}]}})
    assert v1.status_code == 200
    assert counted.total_tokens == v1.json()["usageMetadata"]["promptTokenCount"] == v1_count.json()["totalTokens"]
    (step,) = await s.steps(rid, 1)  # the count is no step
    assert step.usage.prompt_tokens == counted.total_tokens


async def test_errors_come_in_googles_shape(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    with pytest.raises(genai_errors.ClientError) as wrong_key:
        await client(s, rid, "nope").aio.models.generate_content(model=MODEL, contents="x")
    assert wrong_key.value.code == 401 and wrong_key.value.status == "UNAUTHENTICATED"
    assert wrong_key.value.message == "invalid API key for this rollout"
    with pytest.raises(genai_errors.ClientError) as two:
        await client(s, rid, key).aio.models.generate_content(
            model=MODEL, contents="x", config=types.GenerateContentConfig(candidate_count=2))
    assert two.value.code == 400 and two.value.status == "INVALID_ARGUMENT" and "candidateCount" in two.value.message
    with pytest.raises(genai_errors.ClientError) as image:
        await client(s, rid, key).aio.models.generate_content(model=MODEL, contents=[types.Content(
            role="user", parts=[types.Part.from_bytes(data=b"\x89PNG", mime_type="image/png")])])
    assert image.value.code == 400 and "inlineData" in image.value.message
    async with httpx.AsyncClient(timeout=10) as http:
        no_key = await http.post(f"{s.url}/proxy/{rid}/v1beta/models/{MODEL}:generateContent", json={"contents": []})
        unrouted = await http.post(f"{s.url}/proxy/{rid}/v1beta/models/{MODEL}:embedContent", params={"key": key},
                                   json={})
    assert no_key.status_code == 401 and no_key.json()["error"]["status"] == "UNAUTHENTICATED"
    assert set(no_key.json()["error"]) == {"code", "message", "status"}
    assert unrouted.status_code == 404 and unrouted.json()["error"]["status"] == "NOT_FOUND"
    assert len(s.backends["default"].bodies) == 0


async def test_a_replica_dying_mid_stream_raises_in_the_sdk_and_records_an_incomplete_step(stack, tmp_path):
    s = await stack(default=Faults(die_after_chunks=4))
    rid, key = await s.rollout(tmp_path)
    got = []
    with pytest.raises(genai_errors.ServerError, match="died mid-stream"):
        async for chunk in await client(s, rid, key).aio.models.generate_content_stream(model=MODEL, contents="x"):
            got.append(chunk.text or "")
    assert "".join(got) == SCRIPT.responses[0].content[:3]
    (step,) = await s.steps(rid, 1)
    assert step.incomplete and "died mid-stream" in step.error and step.api == "gemini.generate_content"


async def test_a_client_giving_up_mid_stream_leaves_an_incomplete_step_and_the_rollout_running(stack, tmp_path):
    s = await stack(default=Faults(chunk_delay_s=0.02))
    rid, key = await s.rollout(tmp_path)
    stream = await client(s, rid, key).aio.models.generate_content_stream(model=MODEL, contents="fix the median")
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == 4:
            break
    await stream.aclose()
    (step,) = await s.steps(rid, 1)
    assert step.incomplete and step.error == "client disconnected mid-stream" and step.stream
    again = await client(s, rid, key).aio.models.generate_content(model=MODEL, contents="fix the median")
    assert again.text == SCRIPT.responses[0].content
    steps = await s.steps(rid, 2)
    sequences, breaks = assemble(steps)
    assert len(sequences) == 1 and [b.kind for b in breaks] == ["incomplete"]


async def test_budgets_and_sampling_injection_apply_as_on_the_chat_route(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path, sampling=SamplingParams(temperature=0.1, top_p=0.5), max_turns=1)
    api = client(s, rid, key).aio
    await api.models.generate_content(model=MODEL, contents="q", config=types.GenerateContentConfig(
        temperature=0.9, top_p=0.95, stop_sequences=["END"]))
    with pytest.raises(genai_errors.ClientError) as refused:
        await api.models.generate_content(model=MODEL, contents="q")
    assert refused.value.code == 403 and refused.value.status == "PERMISSION_DENIED"
    assert "turn budget" in refused.value.message
    (sent,) = [json.loads(r) for r in s.backends["default"].requests]
    assert (sent["temperature"], sent["top_p"], sent["stop"]) == (0.1, 0.5, ["END"])
    assert sent["logprobs"] is True and sent["return_token_ids"] is True
    (step,) = await s.steps(rid, 1)
    assert step.sampling.temperature == 0.1 and step.sampling.top_p == 0.5
    assert (await s.service.store.get(rid))[0].state == RolloutState.BUDGET_EXHAUSTED


async def test_reasoning_comes_back_as_thought_parts_and_goes_back_to_the_backend(stack, tmp_path, monkeypatch):
    backend_reasons(monkeypatch, "think")
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    api = client(s, rid, key).aio
    tools = [types.Tool(function_declarations=[READ_FILE])]
    first = await api.models.generate_content(model=MODEL, contents="fix the median", config=config(tools=tools))
    parts = first.candidates[0].content.parts
    assert (parts[0].thought, parts[0].text) == (True, "think") and parts[1].function_call.name == "read_file"
    (call,) = first.function_calls
    history = [types.Content(role="user", parts=[types.Part(text="fix the median")]), first.candidates[0].content,
               types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                   id=call.id, name="read_file", response={"output": "def median(): ..."}))])]
    chunks = [c async for c in await api.models.generate_content_stream(model=MODEL, contents=history,
                                                                        config=config(tools=tools))]
    thoughts = [p.text for c in chunks for p in c.candidates[0].content.parts if p.thought]
    assert thoughts == ["think"] and "".join(c.text or "" for c in chunks) == SCRIPT.responses[0].content
    sent = json.loads(s.backends["default"].requests[1])["messages"]
    assert sent[2]["reasoning_content"] == "think" and sent[2]["tool_calls"][0]["id"] == call.id
    steps = await s.steps(rid, 2)
    sequences, breaks = assemble(steps)
    assert len(sequences) == 1 and breaks == []
