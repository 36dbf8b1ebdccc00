"""The proxy answers as the real APIs do, to the real ``openai`` and ``anthropic`` SDKs:
errors in each API's own shape on every path, ``x-request-id`` everywhere, final refusals
no SDK retries, no fields the agent did not ask for, the side routes scaffolds call
(``/v1/models``, ``count_tokens``, ``/tokenize``), and answers the agent never received."""

from __future__ import annotations

import anthropic
import httpx
import msgspec
import openai

from arena_core.schemas import RolloutState
from arena_stack.scripted_llm import Faults

from tests.rollout.test_proxy_with_sdks import stack  # noqa: F401 - the fixture

MSGS = [{"role": "user", "content": "fix the median"}]


def chat(**extra) -> dict:
    return {"model": "default", "messages": MSGS, **extra}


async def test_errors_have_each_apis_own_shape_on_every_proxy_path(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    good = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=f"{s.url}/proxy/{rid}", timeout=10) as http:
        wrong_key = await http.post("/v1/chat/completions", json=chat(), headers={"authorization": "Bearer nope"})
        assert wrong_key.status_code == 401 and wrong_key.headers["x-should-retry"] == "false"
        assert wrong_key.json() == {"error": {"message": "invalid API key for this rollout",
                                              "type": "authentication_error", "param": None, "code": "unauthorized"}}
        messages = await http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": MSGS},
                                   headers={"x-api-key": "nope"})
        assert messages.status_code == 401
        assert messages.json() == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": "invalid API key for this rollout"}}
        not_json = await http.post("/v1/chat/completions", content=b"{", headers=good)
        assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"
        no_max = await http.post("/v1/messages", json={"model": "m", "messages": MSGS}, headers=good)
        assert no_max.status_code == 400 and no_max.json()["error"]["type"] == "invalid_request_error"
        assert "max_tokens" in no_max.json()["error"]["message"]
        unrouted = await http.post("/v1/embeddings", json={"input": "x"}, headers=good)
        assert unrouted.status_code == 404 and unrouted.json()["error"]["type"] == "not_found_error"
        assert unrouted.json()["error"]["message"] == f"no route for POST /proxy/{rid}/v1/embeddings"
        wrong_method = await http.get("/v1/chat/completions", headers=good)
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
        anthropic_method = await http.get("/v1/messages", headers=good)
        assert anthropic_method.status_code == 405
        assert anthropic_method.json()["type"] == "error" and anthropic_method.json()["error"]["type"] == \
            "invalid_request_error"
        answers = [wrong_key, messages, not_json, no_max, unrouted, wrong_method, anthropic_method]
        assert all(a.headers["x-request-id"].startswith("req_") for a in answers)
    # the SDKs read them as their own errors
    with_sdk = s.openai(rid, "nope")
    try:
        await with_sdk.chat.completions.create(**chat())
    except openai.AuthenticationError as exc:
        assert exc.code == "unauthorized" and exc.request_id.startswith("req_")
    else:
        raise AssertionError("a wrong key must be refused")


async def test_every_answer_carries_a_request_id_and_fields_the_agent_did_not_ask_for_stay_out(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path)
    async with httpx.AsyncClient(base_url=f"{s.url}/proxy/{rid}/v1", timeout=10,
                                 headers={"authorization": f"Bearer {key}"}) as http:
        plain = await http.post("/chat/completions", json=chat())
        asked = await http.post("/chat/completions", json=chat(logprobs=True, return_token_ids=True))
        async with http.stream("POST", "/chat/completions", json=chat(stream=True)) as streamed:
            chunks = [msgspec.json.decode(line[5:]) async for line in streamed.aiter_lines()
                      if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        models = await http.get("/models")
    for answer in (plain, asked, streamed, models):
        assert answer.status_code == 200 and answer.headers["x-request-id"].startswith("req_")
    body = plain.json()
    assert "prompt_token_ids" not in body and body["choices"][0]["logprobs"] is None
    assert "token_ids" not in body["choices"][0]
    assert asked.json()["choices"][0]["logprobs"]["content"] and asked.json()["choices"][0]["token_ids"]
    assert chunks and all("prompt_token_ids" not in c for c in chunks)
    assert all(ch.get("logprobs") is None and "token_ids" not in ch for c in chunks for ch in c["choices"])
    # what the agent was not sent is still captured, token-exact
    steps = await s.steps(rid, 3)
    for step in steps:
        assert step.prompt_token_ids and step.completion_token_ids
        assert len(step.logprobs) == len(step.completion_token_ids)
    assert steps[1].completion_token_ids == asked.json()["choices"][0]["token_ids"]


async def test_an_exhausted_budget_is_a_final_403_that_no_sdk_retries(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path, max_turns=1)
    client = openai.AsyncOpenAI(base_url=f"{s.url}/proxy/{rid}/v1", api_key=key, max_retries=3)
    await client.chat.completions.create(**chat())
    try:
        await client.chat.completions.create(**chat())
    except openai.PermissionDeniedError as exc:
        assert exc.code == "budget_exhausted" and exc.response.headers["x-should-retry"] == "false"
        assert exc.message.endswith("turn budget exhausted: 1 of 1 LLM calls used")
    else:
        raise AssertionError("the second call must be refused")
    assert len(s.backends["default"].requests) == 1
    record, _ = await s.service.store.get(rid)
    assert record.state is RolloutState.BUDGET_EXHAUSTED

    rid, key = await s.rollout(tmp_path, max_turns=1)
    claude = anthropic.AsyncAnthropic(base_url=f"{s.url}/proxy/{rid}", api_key=key, max_retries=3)
    await claude.messages.create(model="m", max_tokens=20, messages=MSGS)
    try:
        await claude.messages.create(model="m", max_tokens=20, messages=MSGS)
    except anthropic.PermissionDeniedError as exc:
        assert exc.body["error"]["type"] == "permission_error"
    else:
        raise AssertionError("the second call must be refused")
    assert len(s.backends["default"].requests) == 2


async def test_models_count_tokens_and_tokenize_answer_what_scaffolds_ask(stack, tmp_path):
    s = await stack()
    rid, key = await s.rollout(tmp_path, model="default")
    counted = await s.anthropic(rid, key).messages.count_tokens(model="claude-x", messages=MSGS,
                                                                system="You fix bugs.")
    tokenized = msgspec.json.decode(s.backends["default"].tokenized[-1])
    assert tokenized["messages"][0] == {"role": "system", "content": "You fix bugs."}
    async with httpx.AsyncClient(base_url=f"{s.url}/proxy/{rid}", timeout=10,
                                 headers={"authorization": f"Bearer {key}"}) as http:
        models = (await http.get("/v1/models")).json()
        root = await http.post("/tokenize", json={"prompt": "abc"})
        v1 = await http.post("/v1/tokenize", json={"prompt": "abc"})
    async with httpx.AsyncClient(timeout=10) as direct:  # the backend's own count of what the proxy sent it
        own = (await direct.post(s.service.router.replicas["default"].replica.url[:-3] + "/tokenize",
                                 json=tokenized)).json()["count"]
    assert counted.input_tokens == own > len(b"You fix bugs.fix the median")
    assert [m["id"] for m in models["data"]] == ["default"]
    assert root.status_code == v1.status_code == 200 and root.json() == v1.json()
    assert root.json()["count"] == 4  # BOS and three bytes
    record, _ = await s.service.store.get(rid)
    assert record.steps == 0 and len(s.backends["default"].requests) == 0  # none of these is a step

    rid, key = await s.rollout(tmp_path, model="mine")
    async with httpx.AsyncClient(base_url=f"{s.url}/proxy/{rid}", timeout=10,
                                 headers={"authorization": f"Bearer {key}"}) as http:
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["mine"]

    bare = await stack(default=Faults(no_tokenize=True))  # a backend without /tokenize (Ollama, say)
    rid, key = await bare.rollout(tmp_path)
    async with httpx.AsyncClient(base_url=f"{bare.url}/proxy/{rid}", timeout=10,
                                 headers={"authorization": f"Bearer {key}"}) as http:
        missing = await http.post("/tokenize", json={"prompt": "abc"})
        bound = await http.post("/v1/messages/count_tokens", json={"model": "m", "messages": MSGS},
                                headers={"anthropic-version": "2023-06-01"})
    assert missing.status_code == 404 and "has no /tokenize" in missing.json()["error"]["message"]
    assert missing.json()["error"]["type"] == "not_found_error"
    assert bound.status_code == 200 and bound.json()["input_tokens"] >= len(b"fix the median")


async def test_a_client_that_timed_out_and_retried_gets_one_answer_and_one_step(stack, tmp_path):
    s = await stack(default=Faults(latency_s=1.0))
    rid, key = await s.rollout(tmp_path)
    client = openai.AsyncOpenAI(base_url=f"{s.url}/proxy/{rid}/v1", api_key=key, max_retries=3, timeout=0.7)
    answer = await client.chat.completions.create(**chat())  # times out once, its retry takes the answer
    assert answer.choices[0].message.content
    assert len(s.backends["default"].requests) == 1  # one call to the backend
    steps = await s.steps(rid, 1)
    assert len(steps) == 1 and not steps[0].abandoned
    record, _ = await s.service.store.get(rid)
    assert record.steps == 1 and record.abandoned_steps == 0


async def test_an_answer_no_client_took_is_abandoned_counts_its_tokens_but_no_turn(stack, tmp_path):
    s = await stack(default=Faults(latency_s=0.6))
    s.service.proxy.orphans.window_s = 0.5
    rid, key = await s.rollout(tmp_path, max_turns=1)
    client = openai.AsyncOpenAI(base_url=f"{s.url}/proxy/{rid}/v1", api_key=key, max_retries=0, timeout=0.3)
    try:
        await client.chat.completions.create(**chat())
    except openai.APITimeoutError:
        pass
    else:
        raise AssertionError("the call must time out")
    steps = await s.steps(rid, 1)
    assert len(steps) == 1 and steps[0].abandoned and steps[0].completion_token_ids
    record, _ = await s.service.store.get(rid)
    assert record.abandoned_steps == 1 and record.total_tokens == steps[0].usage.total_tokens > 0
    # the one turn the budget allows is still there: the agent never saw the first answer
    patient = openai.AsyncOpenAI(base_url=f"{s.url}/proxy/{rid}/v1", api_key=key, max_retries=0, timeout=10)
    assert (await patient.chat.completions.create(**chat(max_tokens=40))).choices[0].message.content
    steps = await s.steps(rid, 2)
    assert [st.abandoned for st in steps] == [True, False]


def test_trimming_an_answer_leaves_the_captured_document_whole():
    from arena_rollout.proxy.answers import stripped, without

    doc = {"id": "c", "prompt_token_ids": [1, 2], "choices": [
        {"index": 0, "message": {"content": "x"}, "logprobs": {"content": [{"logprob": -0.5}]}, "token_ids": [7]}]}
    trimmed = without(doc, True, True)
    assert trimmed == {"id": "c", "choices": [{"index": 0, "message": {"content": "x"}, "logprobs": None}]}
    assert doc["prompt_token_ids"] == [1, 2] and doc["choices"][0]["token_ids"] == [7]  # capture still sees them
    assert without(doc, False, True)["choices"][0]["logprobs"] == {"content": [{"logprob": -0.5}]}
    assert without({"choices": [{"index": 0, "logprobs": None}]}, True, True) is None  # nothing to remove
    raw = b'{"id": "c", "choices": [{"index": 0, "delta": {}, "logprobs": null}]}'
    assert stripped(raw, True, True) is raw  # relayed byte for byte


async def test_tool_call_arguments_sent_back_reserialized_reach_the_backend_as_sampled(stack, tmp_path):
    """A scaffold that re-serializes the arguments of the tool calls it replays (OpenCode:
    compact JSON; Claude Code: ``input`` objects) would break the conversation's token chain
    at every tool call: the proxy restores the sampled text when both mean the same JSON."""
    from tests.rollout.test_proxy_with_sdks import OPENAI_TOOLS

    s = await stack()
    rid, key = await s.rollout(tmp_path)
    client = s.openai(rid, key)
    first = await client.chat.completions.create(model="default", messages=MSGS, tools=OPENAI_TOOLS, seed=1)
    call = first.choices[0].message.tool_calls[0]
    assert call.function.arguments == '{"path": "a.py"}'  # as sampled
    replayed = {"id": call.id, "type": "function", "function": {"name": "read_file", "arguments": '{"path":"a.py"}'}}
    other = {"id": "call_other", "type": "function", "function": {"name": "read_file", "arguments": '{"path":"b.py"}'}}
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [replayed]},
                      {"role": "tool", "tool_call_id": call.id, "content": "def median(): ..."},
                      {"role": "assistant", "content": None, "tool_calls": [other]},
                      {"role": "tool", "tool_call_id": "call_other", "content": "..."}]
    await client.chat.completions.create(model="default", messages=history, tools=OPENAI_TOOLS, seed=1)
    sent = msgspec.json.decode(s.backends["default"].requests[1])
    assert sent["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"path": "a.py"}'  # restored
    assert sent["messages"][3]["tool_calls"][0]["function"]["arguments"] == '{"path":"b.py"}'  # not sampled here
    steps = await s.steps(rid, 2)
    chained = steps[0].prompt_token_ids + steps[0].completion_token_ids
    assert steps[1].prompt_token_ids[:len(chained)] == chained  # the second call extends the first
