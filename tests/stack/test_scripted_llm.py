"""The scripted backend: seeded choice, byte tokenizer, vLLM-shaped responses."""

from __future__ import annotations

from arena_stack.scripted_llm import BOS, Script, ScriptedLLM, ScriptedResponse, decode_ids, encode_text, render_chat

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


def test_tokenize_counts_exactly_the_prompt_ids_the_same_request_gets():
    llm = ScriptedLLM(SCRIPT, max_model_len=4096)
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    chats = [
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "ü ✓"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}], "tools": tools},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "pre"}],
         "add_generation_prompt": False},
    ]
    for body in chats:
        out = llm.complete({**body, "seed": 3, "return_token_ids": True})
        counted = llm.tokenize({"model": "scripted", **body})
        assert counted["tokens"] == out["prompt_token_ids"] and counted["count"] == out["usage"]["prompt_tokens"]
        assert counted["max_model_len"] == 4096
    assert decode_ids(llm.tokenize(chats[2])["tokens"]).endswith("<|assistant|>\npre\n")  # no generation prompt
    assert decode_ids(llm.tokenize(chats[0])["tokens"]).endswith("<|assistant|>\n")
    for body in ({"prompt": "def f():"}, {"prompt": "naïve", "add_special_tokens": False}):
        out = llm.text_complete({**body, "return_token_ids": True, "max_tokens": 2})
        counted = llm.tokenize(body)
        assert counted["tokens"] == out["choices"][0]["prompt_token_ids"] and counted["count"] == len(counted["tokens"])
    assert llm.tokenize({"prompt": "naïve", "add_special_tokens": False})["count"] == len("naïve".encode())
    assert llm.tokenize({"prompt": "x"})["tokens"][0] == BOS


async def test_tokenize_is_served_at_the_root_like_vllm_and_can_be_missing_like_ollama():
    import httpx

    from arena_stack.scripted_llm import Faults, create_app

    body = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}]}
    transport = httpx.ASGITransport(app=create_app(ScriptedLLM(SCRIPT)))
    async with httpx.AsyncClient(transport=transport, base_url="http://llm") as http:
        answer = (await http.post("/tokenize", json=body)).json()
        assert answer["count"] == len(answer["tokens"]) == 1 + len(render_chat(body["messages"]).encode())
        assert (await http.post("/tokenize", json={"model": "scripted"})).status_code == 400
    transport = httpx.ASGITransport(app=create_app(ScriptedLLM(SCRIPT, faults=Faults(no_tokenize=True))))
    async with httpx.AsyncClient(transport=transport, base_url="http://llm") as http:
        assert (await http.post("/tokenize", json=body)).status_code == 404
