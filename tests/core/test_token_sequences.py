"""One token sequence with a loss mask from a multi-turn rollout's steps."""

from __future__ import annotations

import pytest

from arena_core.schemas import Step
from arena_stack.scripted_llm import BOS, Script, ScriptedLLM, ScriptedResponse, encode_text, render_chat
from arena_core.tokens import MissingTokenIds, sequences, single_sequence


def step_from(llm, messages, index: int) -> tuple[Step, str]:
    out = llm.complete({"messages": messages, "return_token_ids": True, "logprobs": True, "seed": index})
    choice = out["choices"][0]
    step = Step(rollout_id="r", step_index=index, model="m", backend="b", prompt_token_ids=out["prompt_token_ids"],
                completion_token_ids=choice["token_ids"],
                logprobs=[c["logprob"] for c in choice["logprobs"]["content"]])
    return step, choice["message"]["content"]


def test_multi_turn_steps_make_one_sequence_with_the_sampled_tokens_masked_in():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="ls")]))
    messages = [{"role": "user", "content": "list files"}]
    s0, a0 = step_from(llm, messages, 0)
    messages += [{"role": "assistant", "content": a0}, {"role": "tool", "content": "a.py b.py"}]
    s1, _ = step_from(llm, messages, 1)
    seq = single_sequence([s1, s0])  # order of arrival does not matter
    assert seq.ids == s1.prompt_token_ids + s1.completion_token_ids
    sampled = [t for t, m in zip(seq.ids, seq.loss_mask) if m]
    assert sampled == s0.completion_token_ids + s1.completion_token_ids
    assert [lp for lp, m in zip(seq.logprobs, seq.loss_mask) if m] == s0.logprobs + s1.logprobs
    assert seq.steps == [0, 1] and seq.ids[0] == BOS
    assert seq.ids[: len(s0.prompt_token_ids)] == [BOS, *encode_text(render_chat(messages[:1]))]


def test_a_rewritten_history_starts_a_new_sequence_and_missing_ids_fail_loudly():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="x")]))
    s0, _ = step_from(llm, [{"role": "user", "content": "one"}], 0)
    s1, _ = step_from(llm, [{"role": "user", "content": "two"}], 1)
    assert len(sequences([s0, s1])) == 2
    with pytest.raises(ValueError, match="2 token sequences"):
        single_sequence([s0, s1])
    blind = Step(rollout_id="r", step_index=2, model="m", backend="b", token_ids_source="unavailable")
    with pytest.raises(MissingTokenIds, match="nothing is re-tokenized"):
        sequences([s0, blind])
