"""The scripted backend: seeded choice, byte tokenizer, vLLM-shaped responses."""

from __future__ import annotations

from arena.scripted_llm import BOS, Script, ScriptedLLM, ScriptedResponse, decode_ids, encode_text, render_chat

SCRIPT = Script(responses=[ScriptedResponse(label="right", content="fix", weight=0.5),
                           ScriptedResponse(label="wrong", content="nope", weight=0.5)])


def test_same_seed_same_answer_and_seeds_give_a_mix():
    llm = ScriptedLLM(SCRIPT)
    msgs = [{"role": "user", "content": "q"}]
    answers = [llm.complete({"messages": msgs, "seed": s})["choices"][0]["message"]["content"] for s in range(4)]
    again = [llm.complete({"messages": msgs, "seed": s})["choices"][0]["message"]["content"] for s in range(4)]
    assert answers == again
    assert set(answers) == {"fix", "nope"}


def test_token_ids_match_the_text_and_the_template():
    llm = ScriptedLLM(SCRIPT)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "ü"}]
    out = llm.complete({"messages": msgs, "seed": 1, "return_token_ids": True, "logprobs": True})
    assert out["prompt_token_ids"] == [BOS, *encode_text(render_chat(msgs))]
    choice = out["choices"][0]
    assert decode_ids(choice["token_ids"]) == choice["message"]["content"]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert out["usage"]["completion_tokens"] == len(choice["token_ids"])


def test_max_tokens_truncates_with_finish_length():
    out = ScriptedLLM(SCRIPT).complete({"messages": [{"role": "user", "content": "q"}], "seed": 0, "max_tokens": 2,
                                        "return_token_ids": True})
    assert len(out["choices"][0]["token_ids"]) == 2
    assert out["choices"][0]["finish_reason"] == "length"


def test_without_return_token_ids_no_ids_are_sent():
    out = ScriptedLLM(SCRIPT).complete({"messages": [{"role": "user", "content": "q"}]})
    assert out["prompt_token_ids"] is None and out["choices"][0]["token_ids"] is None
