"""A partial rollout's answer names the policies that sampled it (``policy_versions``): the
captured step keeps them as ``policy_spans``, whole or streamed, and its ``policy_version`` is
the last one; an answer of one version has no spans, and malformed spans are ignored."""

from __future__ import annotations

from arena_core.schemas import PolicySpan, SamplingParams, Timings
from arena_rollout.proxy.capture import Capture

SPANS = [{"version": "3", "from_token": 0}, {"version": "4", "from_token": 2}]


def step_of(cap: Capture):
    return cap.to_step(rollout_id="r", step_index=0, api="openai.chat", request={"messages": []},
                       applied=SamplingParams(), backend="b", replica="p", policy_version="registry-version",
                       timings=Timings(), started_at=0.0, stream=False)


def whole(**extra) -> dict:
    return {"model": "m", "prompt_token_ids": [1, 2], "usage": {"prompt_tokens": 2, "completion_tokens": 3},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc"}, "token_ids": [5, 6, 7],
                         "logprobs": {"content": [{"token": t, "logprob": -0.5} for t in "abc"]},
                         "finish_reason": "stop"}], **extra}


def test_a_whole_answer_of_two_policies_is_recorded_with_both():
    cap = Capture()
    cap.add_chat(whole(policy_version="4", policy_versions=SPANS))
    step = step_of(cap)
    assert step.policy_version == "4"
    assert step.policy_spans == [PolicySpan(version="3", start=0), PolicySpan(version="4", start=2)]


def test_a_stream_takes_the_versions_of_its_last_chunk_that_names_them():
    cap = Capture()
    cap.add_chat_chunk({"model": "m", "policy_version": "3", "prompt_token_ids": [1, 2],
                        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    for i, t in enumerate("abc"):
        cap.add_chat_chunk({"policy_version": "3", "choices": [{"index": 0, "delta": {"content": t},
                                                               "token_ids": [5 + i]}]})
    cap.add_chat_chunk({"policy_version": "4", "policy_versions": SPANS,
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    step = step_of(cap)
    assert step.policy_version == "4" and [s.start for s in step.policy_spans] == [0, 2]
    assert step.completion_token_ids == [5, 6, 7]


def test_one_version_or_malformed_spans_leave_none():
    for extra in ({"policy_version": "3"}, {"policy_versions": [{"version": "3", "from_token": 0}]},
                  {"policy_versions": [{"version": "3", "from_token": "0"}, {"version": "4", "from_token": 2}]},
                  {"policy_versions": "3,4"}):
        cap = Capture()
        cap.add_chat(whole(**extra))
        assert step_of(cap).policy_spans == []
    cap = Capture()
    cap.add_chat(whole())
    assert step_of(cap).policy_version == "registry-version"  # no version in the answer: the registry's
