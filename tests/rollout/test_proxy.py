"""The proxy's pure logic: sampling injection, budgets, token-level capture."""

from __future__ import annotations

import msgspec
import pytest

from arena_core.errors import BudgetExhausted, InvalidRequest, UpstreamError, WallClockExceeded
from arena_core.schemas import (AgentSpec, Budget, PromptCount, RolloutRecord, RolloutState, SamplingParams, Task,
                           TestsVerifier, Timings)
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse, decode_ids
from arena_rollout import proxy
from arena_rollout.proxy.upstream import sse_events


def record(budget: Budget, steps: int = 0, tokens: int = 0) -> RolloutRecord:
    task = Task(id="t", repo="/r", instructions="i", agent=AgentSpec(command=["a"]),
                verifier=TestsVerifier(fail_to_pass=["x"]), budget=budget)
    return RolloutRecord(rollout_id="r1", task=task, sampling=SamplingParams(), model="m", provider="local",
                         api_key="k", state=RolloutState.RUNNING, created_at=0.0, updated_at=0.0,
                         steps=steps, total_tokens=tokens)


def test_rollout_sampling_overrides_the_agent_and_capture_is_forced():
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.0, "top_p": 0.5, "stream": False}
    sent, applied = proxy.apply_sampling(body, SamplingParams(temperature=1.0, seed=7, top_k=20))
    assert sent["temperature"] == 1.0 and sent["seed"] == 7 and sent["top_k"] == 20
    assert sent["top_p"] == 0.5  # not set by the rollout: the agent's value stays
    assert sent["logprobs"] is True and sent["return_token_ids"] is True
    assert applied == SamplingParams(temperature=1.0, top_p=0.5, top_k=20, seed=7)
    assert body["temperature"] == 0.0  # the caller's dict is not mutated


def test_turn_budget_refuses_before_sending():
    with pytest.raises(BudgetExhausted, match="turn budget exhausted: 2 of 2"):
        proxy.check_budget(record(Budget(max_turns=2), steps=2), {"messages": []}, now=1.0)


def test_token_budget_caps_max_tokens_then_refuses():
    ids = {"prompt": [7, 8, 9, 10, 11]}  # a prompt of token ids: counted exactly, no round trip
    capped = proxy.check_budget(record(Budget(max_total_tokens=100), tokens=70), {**ids, "max_tokens": 500}, now=1.0,
                                api="openai.completions")
    assert capped.verdict == "send" and capped.body["max_tokens"] == 25  # 30 left, 5 of them the prompt
    assert capped.prompt == PromptCount(tokens=5, source="ids", remaining=30) and capped.reserve == 30
    untouched = proxy.check_budget(record(Budget(max_total_tokens=100), tokens=70), {**ids, "max_tokens": 10},
                                   now=1.0, api="openai.completions")
    assert untouched.body["max_tokens"] == 10 and untouched.reserve == 15
    with pytest.raises(BudgetExhausted, match="token budget exhausted: 100 of 100 tokens used"):
        proxy.check_budget(record(Budget(max_total_tokens=100), tokens=100), {}, now=1.0)


def test_wall_clock_budget_refuses_after_it_has_passed():
    assert proxy.check_budget(record(Budget(wall_clock_s=10)), {}, now=9.9).body == {}
    with pytest.raises(WallClockExceeded, match="wall-clock budget exhausted: 10.5 s of 10 s"):
        proxy.check_budget(record(Budget(wall_clock_s=10)), {}, now=10.5)


def test_the_time_calls_waited_for_a_backend_slot_is_left_out_of_the_wall_clock():
    assert proxy.check_budget(record(Budget(wall_clock_s=10)), {}, now=15.0, off_clock_s=6.0).body == {}
    with pytest.raises(WallClockExceeded, match="wall-clock budget exhausted: 11.0 s of 10 s"):
        proxy.check_budget(record(Budget(wall_clock_s=10)), {}, now=15.0, off_clock_s=4.0)


def test_policy_default_fills_only_what_the_agent_left_unset():
    body = {"messages": [], "temperature": 0.2, "max_completion_tokens": 50}
    sent, applied = proxy.apply_sampling(body, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10,
                                                              policy="default"))
    assert sent["temperature"] == 0.2 and sent["top_p"] == 0.9 and sent["max_tokens"] == 50
    assert "max_completion_tokens" not in sent
    assert applied.policy == "default" and applied.max_tokens == 50


def test_policy_clamp_caps_numeric_fields_and_overrides_the_rest():
    body = {"messages": [], "temperature": 1.5, "top_p": 0.3, "max_tokens": 4000, "seed": 1, "stop": ["x"]}
    sent, _ = proxy.apply_sampling(body, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=512, seed=9,
                                                        stop=["END"], policy="clamp"))
    assert sent["temperature"] == 1.0 and sent["top_p"] == 0.3 and sent["max_tokens"] == 512
    assert sent["seed"] == 9 and sent["stop"] == ["END"]


def test_top_logprobs_and_stream_usage_are_requested():
    sent, applied = proxy.apply_sampling({"messages": [], "stream": True}, SamplingParams(top_logprobs=5))
    assert sent["logprobs"] is True and sent["top_logprobs"] == 5 and applied.top_logprobs == 5
    assert sent["stream_options"] == {"include_usage": True}
    sent, applied = proxy.apply_sampling({"prompt": "x", "logprobs": 2}, SamplingParams(),
                                         api="openai.completions")
    assert sent["logprobs"] == 2 and applied.top_logprobs == 2 and sent["return_token_ids"] is True


def test_bad_bodies_are_refused_with_a_reason():
    with pytest.raises(InvalidRequest, match="messages"):
        proxy.validate_chat_body({"messages": []})
    with pytest.raises(InvalidRequest, match="n=1"):
        proxy.validate_chat_body({"messages": [{"role": "user", "content": "x"}], "n": 3})
    with pytest.raises(InvalidRequest, match="prompt"):
        proxy.validate_completions_body({"prompt": ["a", "b"]})
    with pytest.raises(InvalidRequest, match="JSON object"):
        proxy.validate_chat_body([1, 2])


def test_capture_keeps_the_backend_tokens_exactly():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="héllo ```diff\n```")]))
    body, applied = proxy.apply_sampling({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
                                         SamplingParams(seed=3))
    answer = llm.complete(body)
    step = proxy.capture(rollout_id="r1", step_index=4, request=body, response=answer, applied=applied,
                         backend="http://b/v1", policy_version="7", timings=Timings(total_ms=1.0), started_at=5.0)
    assert step.prompt_token_ids == answer["prompt_token_ids"]
    assert step.completion_token_ids == answer["choices"][0]["token_ids"]
    assert step.logprobs == [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
    assert all(len(alts) == 3 for alts in step.top_logprobs)
    assert decode_ids(step.completion_token_ids) == step.completion_text == "héllo ```diff\n```"
    assert step.token_ids_source == "backend" and step.step_index == 4 and step.policy_version == "7"
    assert step.usage.total_tokens == len(step.prompt_token_ids) + len(step.completion_token_ids)
    # round-trips on the wire unchanged
    assert msgspec.json.decode(msgspec.json.encode(step), type=type(step)) == step


def test_capture_without_token_ids_says_so_instead_of_guessing():
    answer = {"model": "m", "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    step = proxy.capture(rollout_id="r", step_index=0, request={"messages": []}, response=answer,
                         applied=SamplingParams(), backend="b", policy_version=None, timings=Timings(), started_at=0)
    assert step.token_ids_source == "unavailable"
    assert step.prompt_token_ids is None and step.completion_token_ids is None and step.logprobs is None
    assert step.usage.total_tokens == 4


def test_capture_rejects_a_response_without_choices():
    with pytest.raises(UpstreamError, match="no choices"):
        proxy.capture(rollout_id="r", step_index=0, request={}, response={"oops": 1}, applied=SamplingParams(),
                      backend="b", policy_version=None, timings=Timings(), started_at=0)


def test_streamed_chunks_capture_the_same_tokens_as_the_whole_answer():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="naïve ✓ answer")]))
    body, applied = proxy.apply_sampling({"messages": [{"role": "user", "content": "x"}], "stream": True,
                                          "top_logprobs": 2, "logprobs": True}, SamplingParams(seed=4))
    whole = llm.complete({**body, "stream": False})
    cap = proxy.Capture()
    for chunk in llm.chunks(body, chat=True):
        cap.add_chat_chunk(chunk)
    step = cap.to_step(rollout_id="r", step_index=0, api="openai.chat", request=body, applied=applied,
                       backend="b", replica="default", policy_version=None, timings=Timings(), started_at=0,
                       stream=True)
    assert step.completion_token_ids == whole["choices"][0]["token_ids"]
    assert step.prompt_token_ids == whole["prompt_token_ids"]
    assert step.logprobs == [c["logprob"] for c in whole["choices"][0]["logprobs"]["content"]]
    assert step.completion_text == "naïve ✓ answer" and step.usage.total_tokens == whole["usage"]["total_tokens"]
    assert step.stream and step.token_ids_source == "backend" and step.finish_reason == "stop"


def test_a_stream_without_token_ids_says_unavailable():
    from arena_stack.scripted_llm import Faults

    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="hi")]), faults=Faults(no_token_ids=True))
    cap = proxy.Capture()
    for chunk in llm.chunks({"messages": [{"role": "user", "content": "x"}], "return_token_ids": True,
                             "logprobs": True}, chat=True):
        cap.add_chat_chunk(chunk)
    step = cap.to_step(rollout_id="r", step_index=0, api="openai.chat", request={}, applied=SamplingParams(),
                       backend="b", replica=None, policy_version=None, timings=Timings(), started_at=0, stream=True)
    assert step.token_ids_source == "unavailable" and step.completion_token_ids is None
    assert step.completion_text == "hi" and len(step.logprobs) == 2


def test_completions_capture_prompt_ids_from_the_choice():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="abc")]))
    body, applied = proxy.apply_sampling({"prompt": [1, 70, 71], "logprobs": 2}, SamplingParams(),
                                         api="openai.completions")
    answer = llm.text_complete(body)
    step = proxy.capture(rollout_id="r", step_index=0, request=body, response=answer, applied=applied,
                         backend="b", policy_version=None, timings=Timings(), started_at=0, api="openai.completions")
    assert step.prompt_token_ids == [1, 70, 71] and step.request_prompt == [1, 70, 71]
    assert step.completion_token_ids == answer["choices"][0]["token_ids"]
    assert step.logprobs == answer["choices"][0]["logprobs"]["token_logprobs"]
    assert [len(a) for a in step.top_logprobs] == [2, 2, 2]


async def test_a_relay_closed_before_it_started_still_reports_it():
    from arena_rollout.proxy.handler import Relay

    async def gen():
        yield b"a"

    calls = []
    relay = Relay(gen(), lambda: calls.append("unstarted"))
    await relay.aclose()
    assert calls == ["unstarted"]
    started = Relay(gen(), lambda: calls.append("again"))
    assert [c async for c in started] == [b"a"]
    await started.aclose()
    assert calls == ["unstarted"]


def test_the_token_cap_holds_under_every_sampling_policy():
    """Sampling is injected first and the budget capped last: a rollout ``max_tokens``
    under ``override`` must not lift the cap again, and the step records what was sent."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}
    for policy in ("override", "default", "clamp"):
        rec = msgspec.structs.replace(record(Budget(max_total_tokens=100), tokens=70),
                                      sampling=SamplingParams(max_tokens=512, temperature=0.7, policy=policy))
        assert proxy.admit(rec, body, api="openai.chat", now=1.0).verdict == "count"  # tight: count the prompt
        counted = PromptCount(tokens=12, source="tokenize", replica="default")
        a = proxy.admit(rec, body, api="openai.chat", now=1.0, prompt=counted)
        assert a.verdict == "send" and a.body["max_tokens"] == 18 and a.applied.max_tokens == 18, policy
        assert a.applied.temperature == 0.7 and a.body["logprobs"] is True
    roomy = msgspec.structs.replace(record(Budget(max_total_tokens=10_000)), sampling=SamplingParams(max_tokens=512))
    a = proxy.admit(roomy, body, api="openai.chat", now=1.0)
    assert a.body["max_tokens"] == 512 == a.applied.max_tokens  # under the budget: the policy decides
    assert a.prompt.source == "bound" and a.verdict == "send"  # and no count was needed


def test_completions_keep_their_default_length_and_count_a_token_id_prompt():
    rec = record(Budget(max_total_tokens=100), tokens=50)
    a = proxy.admit(rec, {"prompt": "def f():"}, api="openai.completions", now=1.0)
    assert a.verdict == "send"  # 8 bytes + allowance + the API's own 16 fit the 50 left: no count
    assert "max_tokens" not in a.body and a.applied.max_tokens is None  # and not stretched to 50
    a = proxy.admit(rec, {"prompt": [1, 2, 3, 4, 5], "max_tokens": 100}, api="openai.completions", now=1.0)
    assert a.body["max_tokens"] == 45 == a.applied.max_tokens  # 50 left, 5 of them the known prompt
    with pytest.raises(BudgetExhausted, match="a prompt of 50 tokens does not fit in the 50 of 100"):
        proxy.admit(rec, {"prompt": list(range(3, 53))}, api="openai.completions", now=1.0)
    with pytest.raises(InvalidRequest, match="'max_tokens' must be an integer"):
        proxy.admit(rec, {"messages": [{"role": "user", "content": "x"}], "max_tokens": "lots"},
                    api="openai.chat", now=1.0)


def test_sse_events_are_read_whole_however_the_reads_cut_them():
    stream = (b'data: {"a":1}\n\n: keep-alive comment\n\ndata: {"b":2}\n\n'
              b'event: ping\ndata: {"c":\ndata: 3}\n\ndata:{"d":4}\n\ndata: [DONE]\n\n')
    expected = [b'{"a":1}', b'{"b":2}', b'{"c":\n3}', b'{"d":4}', b"[DONE]"]
    for stream_ in (stream, stream.replace(b"\n", b"\r\n")):
        for size in (1, 2, 3, 7, 16, len(stream_)):  # every way reads can cut events, lines and CRLFs
            buffer, got = bytearray(), []
            for i in range(0, len(stream_), size):
                got += sse_events(buffer, stream_[i:i + size])
            assert got == expected, (size, got)
            assert not buffer
    buffer = bytearray()
    assert sse_events(buffer, b'data: {"partial"') == []
    assert sse_events(buffer, b': 1}\n\n') == [b'{"partial": 1}']
