"""Partial rollouts on the real 135M model (``make test-rl``): a LoRA update pushed while a
long generation runs is taken between two of its tokens; the generation goes on under the
new policy, and the answer names both versions and the token the new one took over at. Each
token's logprob is the one of the policy that sampled it."""

from __future__ import annotations

import asyncio

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from arena_rl.lm import LanguageModel, LoRASpec, ModelUnavailable, gguf_path  # noqa: E402
from arena_rl.openai_api import Policy  # noqa: E402
from arena_rl.policy_server import VERSION_HEADER, PolicyServer, create_app  # noqa: E402

try:
    gguf_path()
except ModelUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

TOLERANCE = 2e-3


async def test_a_weight_update_mid_generation_continues_under_the_new_policy():
    lm = await asyncio.to_thread(LanguageModel.load, lora=LoRASpec(r=4, alpha=8))
    server = PolicyServer(Policy(lm, 0), model_name="smollm2", partial_rollouts=True, batch_wait_ms=1)
    await server.start()
    # the trainer's new adapter: the same LoRA, its B matrices moved (made before anything runs)
    from peft import get_peft_model_state_dict
    from safetensors.torch import save

    gen = torch.Generator().manual_seed(3)
    state = {k: (torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v.detach().clone())
             for k, v in get_peft_model_state_dict(lm.model).items()}
    blob = save(state)
    try:
        transport = httpx.ASGITransport(app=create_app(server))
        async with httpx.AsyncClient(transport=transport, base_url="http://policy", timeout=120) as http:
            body = {"model": "smollm2", "max_tokens": 64, "temperature": 0, "logprobs": True,
                    "return_token_ids": True,
                    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]}
            call = asyncio.create_task(http.post("/v1/chat/completions", json=body))
            while server.batches == 0:  # the generation has started
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            pushed = await http.post("/v1/weights", content=blob, headers={VERSION_HEADER: "1"})
            assert pushed.status_code == 200 and pushed.json()["policy_version"] == "1", pushed.text
            answer = await call
        assert answer.status_code == 200
        assert answer.headers[VERSION_HEADER] == "1"
        data = answer.json()
        ids = data["choices"][0]["token_ids"]
        logprobs = [t["logprob"] for t in data["choices"][0]["logprobs"]["content"]]
        spans = data["policy_versions"]
        assert data["policy_version"] == "1" and [s["version"] for s in spans] == ["0", "1"]
        took_over = spans[1]["from_token"]
        assert spans[0]["from_token"] == 0 and 0 < took_over < len(ids), (took_over, len(ids))
        prompt = data["prompt_token_ids"]
        before = lm.sequence_logprobs([prompt], [ids], reference=True)[0]  # version 0: the base
        after = lm.sequence_logprobs([prompt], [ids])[0].detach()  # version 1: the update, now served
        sampled = torch.tensor(logprobs)
        assert torch.allclose(sampled[:took_over], before[:took_over], atol=TOLERANCE)
        assert torch.allclose(sampled[took_over:], after[took_over:], atol=TOLERANCE)
        assert not torch.allclose(before[took_over:], after[took_over:], atol=10 * TOLERANCE)
    finally:
        await server.stop()
