"""The real 135M model's completions API, whole and streamed, and a streamed chat (``make
test-rl``): the prompt's ids are the tokenizer's, the streamed chunks add up to the whole
answer of the same seed, and every token's logprob is the model's own."""

from __future__ import annotations

import json

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from arena_rl.lm import LanguageModel, LoRASpec, ModelUnavailable, gguf_path  # noqa: E402
from arena_rl.openai_api import Policy  # noqa: E402
from arena_rl.policy_server import PolicyServer, create_app  # noqa: E402

try:
    gguf_path()
except ModelUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)


def events(body: bytes) -> list[dict]:
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    assert body.decode().rstrip().endswith("data: [DONE]")
    return out


async def test_completions_and_streams_carry_the_models_own_tokens():
    lm = LanguageModel.load(lora=LoRASpec(r=4, alpha=8))
    server = PolicyServer(Policy(lm, 0), model_name="smollm2", batch_wait_ms=1)
    await server.start()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(server)),
                                     base_url="http://policy", timeout=120) as http:
            ask = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "seed": 5,
                   "logprobs": 1, "return_token_ids": True}
            whole = (await http.post("/v1/completions", json=ask)).json()
            choice = whole["choices"][0]
            assert choice["prompt_token_ids"] == lm.render_prompt("The capital of France is")
            ids, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            recomputed = lm.sequence_logprobs([choice["prompt_token_ids"]], [ids])[0].detach()
            assert torch.allclose(recomputed, torch.tensor(lps), atol=2e-3)
            assert choice["text"] == lm.text(ids) and whole["usage"]["completion_tokens"] == len(ids)

            streamed = await http.post("/v1/completions", json={**ask, "stream": True,
                                                                 "stream_options": {"include_usage": True}})
            assert streamed.headers["content-type"].startswith("text/event-stream")
            chunks = events(streamed.content)
            assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == ids
            assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == choice["text"]
            assert chunks[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
            assert chunks[-1]["usage"]["completion_tokens"] == len(ids) and chunks[-1]["choices"] == []

            chat = {"model": "smollm2", "max_tokens": 8, "seed": 5, "logprobs": True, "return_token_ids": True,
                    "messages": [{"role": "user", "content": "Say hello."}]}
            whole_chat = (await http.post("/v1/chat/completions", json=chat)).json()
            chunks = events((await http.post("/v1/chat/completions", json={**chat, "stream": True})).content)
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[0]["prompt_token_ids"] == whole_chat["prompt_token_ids"]
            assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == \
                whole_chat["choices"][0]["message"]["content"]
            streamed_lps = [t["logprob"] for c in chunks for ch in c["choices"]
                            for t in ((ch.get("logprobs") or {}).get("content") or [])]
            assert streamed_lps == [t["logprob"] for t in whole_chat["choices"][0]["logprobs"]["content"]]
            assert chunks[-1]["choices"][0]["finish_reason"] == whole_chat["choices"][0]["finish_reason"]
            bad = await http.post("/v1/chat/completions", json={"model": "smollm2", "messages": "hi"})
            assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    finally:
        await server.stop()
