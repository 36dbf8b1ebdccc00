"""The OpenAI Responses API on the proxy, with the real ``openai`` SDK's ``responses`` client
against the real rollout app in front of the scripted vLLM-shaped backend: whole and streamed
answers, a function call round trip, ``previous_response_id`` kept per rollout, errors in the
API's own shape, a client that gives up mid-stream, and every call captured token-exact and
merged into one training sequence."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from arena_core.schemas import RolloutState, SamplingParams
from arena_core.sequences import assemble
from arena_stack.scripted_llm import Faults, ScriptedLLM

from tests.rollout.test_proxy_with_sdks import SCRIPT, assert_exact, stack  # noqa: F401 - the fixture

TOOLS = [{"type": "function", "name": "read_file", "description": "read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def client(s, rid: str, key: str) -> openai.AsyncOpenAI:
    return s.openai(rid, key)


async def test_whole_answers_and_a_function_call_round_trip_are_captured_token_exact_in_one_sequence(stack,
                                                                                                     tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    api = client(s, rid, key)
    first = await api.responses.create(model="codex-arena", instructions="You fix bugs.", input="fix the median",
                                       tools=TOOLS, max_output_tokens=300, temperature=0.5)
    assert first.status == "completed" and first.id.startswith("resp_") and first.model == "codex-arena"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "read_file" and call.arguments == '{"path": "a.py"}'
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0
    history = [{"role": "user", "content": "fix the median"}, call.model_dump(),
               {"type": "function_call_output", "call_id": call.call_id, "output": "def median(): ..."}]
    second = await api.responses.create(model="codex-arena", instructions="You fix bugs.", input=history,
                                        tools=TOOLS)
    assert second.output_text == SCRIPT.responses[0].content
    assert second.output[0].type == "message" and second.output[0].content[0].type == "output_text"
    # the next turn refers to the stored response instead of sending the history again
    third = await api.responses.create(model="codex-arena", previous_response_id=second.id,
                                       instructions="You fix bugs.", input=[{"role": "user", "content": [{"type": "input_text", "text": "thanks"}]}])
    assert third.previous_response_id == second.id and third.output_text == SCRIPT.responses[0].content

    steps = await s.steps(rid, 3)
    assert [st.api for st in steps] == ["openai.responses"] * 3 and not any(st.stream for st in steps)
    for st, raw in zip(steps, s.backends["default"].bodies):
        assert_exact(st, raw)
    assert steps[0].request_messages[0] == {"role": "system", "content": "You fix bugs."}
    assert steps[0].tools[0]["function"]["name"] == "read_file" and steps[0].sampling.temperature == 0.5
    assert steps[0].tool_calls[0].arguments == '{"path": "a.py"}'
    assert steps[1].request_messages[-1] == {"role": "tool", "tool_call_id": call.call_id,
                                             "content": "def median(): ..."}
    # the call's instructions (never carried over), the previous response's conversation, the new input
    assert [m["role"] for m in steps[2].request_messages] == ["system", "user", "assistant", "tool", "assistant",
                                                              "user"]
    sequences, breaks = assemble(steps)
    assert len(sequences) == 1 and breaks == []
    assert sequences[0].step_indexes == [0, 1, 2]

    # a call that leaves the instructions out rewrites the history: a new sequence, and where
    await api.responses.create(model="codex-arena", previous_response_id=third.id, input="and now?")
    steps = await s.steps(rid, 4)
    sequences, breaks = assemble(steps)
    assert [sq.step_indexes for sq in sequences] == [[0, 1, 2], [3]]
    assert [(b.step_index, b.kind, b.position) for b in breaks] == [(3, "prefix_mismatch", 3)]


async def test_a_streamed_answer_is_the_apis_typed_events_and_the_sdk_reads_them(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    api = client(s, rid, key)
    stream = await api.responses.create(model="codex-arena", input="fix the median", stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert text == SCRIPT.responses[0].content == done.output_text and done.usage.output_tokens > 0

    tooled = await api.responses.create(model="codex-arena", input="again", tools=TOOLS, stream=True)
    events = [e async for e in tooled]
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "read_file"
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == '{"path": "a.py"}' == events[-1].response.output[0].arguments
    assert any(e.type == "response.function_call_arguments.done" for e in events)

    # the SDK's stream helper assembles the same final response
    async with api.responses.stream(model="codex-arena", input="fix the median") as helper:
        async for _ in helper:
            pass
        final = await helper.get_final_response()
    assert final.output_text == SCRIPT.responses[0].content

    steps = await s.steps(rid, 3)
    assert [st.stream for st in steps] == [True, True, True]
    for st, raw in zip(steps, s.backends["default"].bodies):
        assert_exact(st, raw)
    assert steps[1].tool_calls[0].name == "read_file"


async def test_a_stored_response_is_only_this_rollouts_and_store_false_keeps_none(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    other, other_key = await s.rollout(tmp_path)
    mine = await client(s, rid, key).responses.create(model="m", input="fix the median")
    kept_out = await client(s, rid, key).responses.create(model="m", input="fix the median", store=False)
    assert kept_out.store is False and kept_out.output_text == SCRIPT.responses[0].content
    with pytest.raises(openai.NotFoundError) as foreign:
        await client(s, other, other_key).responses.create(model="m", previous_response_id=mine.id, input="go on")
    assert "not found in this rollout" in foreign.value.body["message"]
    assert foreign.value.body["type"] == "not_found_error"
    for missing in (kept_out.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            await client(s, rid, key).responses.create(model="m", previous_response_id=missing, input="go on")
    steps = await s.steps(rid, 2)
    assert len(steps) == 2  # the refused calls never reached the backend
    assert len(s.backends["default"].bodies) == 2


async def test_errors_come_in_the_responses_apis_shape(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    with pytest.raises(openai.AuthenticationError) as wrong_key:
        await client(s, rid, "nope").responses.create(model="m", input="x")
    assert wrong_key.value.body == {"message": "invalid API key for this rollout", "type": "authentication_error",
                                    "param": None, "code": "unauthorized"}
    with pytest.raises(openai.BadRequestError) as bad_limit:
        await client(s, rid, key).responses.create(model="m", input="x", max_output_tokens=0)
    assert "max_output_tokens" in bad_limit.value.body["message"]
    with pytest.raises(openai.BadRequestError) as web:
        await client(s, rid, key).responses.create(model="m", input="x", tools=[{"type": "web_search"}])
    assert "tool type 'web_search' is not supported" in web.value.body["message"]
    with pytest.raises(openai.BadRequestError) as image:
        await client(s, rid, key).responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://x/y.png"}]}])
    assert "input_image" in image.value.body["message"]
    async with httpx.AsyncClient(base_url=f"{s.url}/proxy/{rid}/v1", timeout=10) as http:
        not_json = await http.post("/responses", content=b"{", headers={"authorization": f"Bearer {key}"})
    assert not_json.status_code == 400 and set(not_json.json()["error"]) == {"message", "type", "param", "code"}
    assert len(s.backends["default"].bodies) == 0


async def test_a_replica_dying_mid_stream_ends_it_with_response_failed(stack, tmp_path):
    s = await stack(default=Faults(die_after_chunks=4))
    rid, key = await s.rollout(tmp_path)
    stream = await client(s, rid, key).responses.create(model="m", input="fix the median", stream=True)
    events = [e async for e in stream]
    assert events[-1].type == "response.failed" and "died mid-stream" in events[-1].response.error.message
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == SCRIPT.responses[0].content[:3]
    (step,) = await s.steps(rid, 1)
    assert step.incomplete and "died mid-stream" in step.error and step.api == "openai.responses"


async def test_a_client_giving_up_mid_stream_leaves_an_incomplete_step_and_the_rollout_running(stack, tmp_path):
    s = await stack(default=Faults(chunk_delay_s=0.02))
    rid, key = await s.rollout(tmp_path)
    stream = await client(s, rid, key).responses.create(model="m", input="fix the median", stream=True)
    seen = 0
    async for event in stream:
        seen += event.type == "response.output_text.delta"
        if seen == 4:
            break
    await stream.close()
    (step,) = await s.steps(rid, 1)
    assert step.incomplete and step.error == "client disconnected mid-stream" and step.stream
    assert 3 <= len(step.completion_token_ids) < len(SCRIPT.responses[0].content.encode())
    again = await client(s, rid, key).responses.create(model="m", input="fix the median")
    assert again.output_text == SCRIPT.responses[0].content
    steps = await s.steps(rid, 2)
    sequences, breaks = assemble(steps)
    assert len(sequences) == 1 and [b.kind for b in breaks] == ["incomplete"]


async def test_budgets_and_sampling_injection_apply_as_on_the_chat_route(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path, sampling=SamplingParams(temperature=0.1), max_total_tokens=150)
    api = client(s, rid, key)
    first = await api.responses.create(model="m", input="q", temperature=0.9)
    assert first.status == "completed"
    capped = await api.responses.create(model="m", input="q", max_output_tokens=1000)
    # capped to what the budget leaves after its prompt: the Responses API's own "incomplete"
    assert capped.status == "incomplete" and capped.incomplete_details.reason == "max_output_tokens"
    assert first.usage.total_tokens + capped.usage.total_tokens == 150
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await api.responses.create(model="m", input="q")
    assert refused.value.body["code"] == "budget_exhausted" and refused.value.body["type"] == "permission_error"
    sent = [json.loads(r) for r in s.backends["default"].requests]
    assert [b["temperature"] for b in sent] == [0.1, 0.1] and sent[1]["max_tokens"] < 1000
    assert all(b["logprobs"] is True and b["return_token_ids"] is True for b in sent)
    steps = await s.steps(rid, 2)
    assert [st.sampling.temperature for st in steps] == [0.1, 0.1]
    assert (await s.service.store.get(rid))[0].state == RolloutState.BUDGET_EXHAUSTED


def backend_reasons(monkeypatch, thought: str = "Check the median's middle pair first.") -> None:
    """The scripted backend answers with ``reasoning_content`` too, whole and streamed, as
    vLLM does with a reasoning parser (its token ids stay the content's)."""
    complete, chunks = ScriptedLLM.complete, ScriptedLLM.chunks

    def reasoned(self, body):
        answer = complete(self, body)
        answer["choices"][0]["message"]["reasoning_content"] = thought
        return answer

    def reasoned_chunks(self, body, *, chat):
        out = chunks(self, body, chat=chat)
        if chat:
            out.insert(1, {**out[0], "choices": [{"index": 0, "delta": {"reasoning_content": thought},
                                                  "logprobs": None, "finish_reason": None}]})
        return out

    monkeypatch.setattr(ScriptedLLM, "complete", reasoned)
    monkeypatch.setattr(ScriptedLLM, "chunks", reasoned_chunks)


async def test_reasoning_comes_back_as_a_reasoning_item_and_goes_back_to_the_backend(stack, tmp_path, monkeypatch):
    backend_reasons(monkeypatch, "think")
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    api = client(s, rid, key)
    first = await api.responses.create(model="m", input="fix the median", tools=TOOLS)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "think"
    call = first.output[1]
    history = [{"role": "user", "content": "fix the median"}, *(i.model_dump(exclude_none=True) for i in first.output),
               {"type": "function_call_output", "call_id": call.call_id, "output": "def median(): ..."}]
    stream = await api.responses.create(model="m", input=history, tools=TOOLS, stream=True)
    events = [e async for e in stream]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "think"
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    sent = json.loads(s.backends["default"].requests[1])["messages"]
    assert sent[1] == {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]}
    steps = await s.steps(rid, 2)
    sequences, breaks = assemble(steps)
    assert len(sequences) == 1 and breaks == []
