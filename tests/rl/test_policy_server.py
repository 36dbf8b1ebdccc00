"""The policy server as a real process over HTTP: ids and logprobs agree with a direct
forward pass of the same weights; weights swap atomically under concurrent requests;
it registers itself (and its new version after a swap) in ``arena_backends``."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import msgspec
import pytest

torch = pytest.importorskip("torch")

from arena_core import subjects  # noqa: E402
from arena_core.bus import Bus  # noqa: E402
from arena_stack import topology  # noqa: E402
from arena_stack.natsserver import free_port, wait_port  # noqa: E402
from arena_rl.model import completion_logprobs, new_policy, save_checkpoint, to_blob  # noqa: E402
from arena_rl.tokenizer import CharTokenizer  # noqa: E402
from arena_core.schemas import BackendReplica  # noqa: E402

TOK = CharTokenizer(alphabet="0123456789")


@pytest.fixture
def policy_server(tmp_path, nats_server):
    asyncio.run(topology.create(nats_server.url))  # the backends' bucket: what `arena up` makes first
    model = new_policy(TOK, seed=1, d_model=32, n_layers=1, max_len=32).eval()
    ckpt = save_checkpoint(tmp_path / "p.pt", model, TOK, 0)
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "arena_rl.policy_server", "--checkpoint", str(ckpt), "--port",
                             str(port), "--nats-url", nats_server.url, "--replica-id", "policy-test",
                             "--batch-wait-ms", "20"], stdout=log, stderr=log)
    try:
        wait_port("127.0.0.1", port, 60, proc)
        yield f"http://127.0.0.1:{port}/v1", model
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


async def test_ids_and_logprobs_agree_with_a_direct_forward_pass(policy_server):
    url, model = policy_server
    async with httpx.AsyncClient(timeout=30) as http:
        chat = (await http.post(f"{url}/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "4242"}], "max_tokens": 6, "seed": 5,
            "logprobs": True, "top_logprobs": 3, "return_token_ids": True})).json()
        prompt = [1, 5, *TOK.encode("4242"), 6]
        assert chat["prompt_token_ids"] == prompt
        choice = chat["choices"][0]
        ids = choice["token_ids"]
        lps = [c["logprob"] for c in choice["logprobs"]["content"]]
        assert len(ids) == len(lps) == chat["usage"]["completion_tokens"] >= 1
        direct = completion_logprobs(model, [prompt], [ids])[0]
        assert torch.allclose(direct, torch.tensor(lps), atol=1e-4)
        # top_logprobs are the model's top-3 at each position, the sampled token's logprob among real values
        assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 3
        assert chat["policy_version"] == "0" and chat["system_fingerprint"] == "arena-policy-v0"

        comp = await http.post(f"{url}/completions", json={"prompt": prompt, "max_tokens": 4, "seed": 9,
                                                           "logprobs": 1, "return_token_ids": True})
        assert comp.headers["X-Arena-Policy-Version"] == "0"
        c = comp.json()["choices"][0]
        direct = completion_logprobs(model, [prompt], [c["token_ids"]])[0]
        assert torch.allclose(direct, torch.tensor(c["logprobs"]["token_logprobs"]), atol=1e-4)
        assert c["prompt_token_ids"] == prompt

        bad = await http.post(f"{url}/chat/completions", json={"messages": [], "max_tokens": 2})
        assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
        junk = await http.post(f"{url}/weights", content=b"not a blob")
        assert junk.status_code == 400 and junk.json()["error"]["code"] == "invalid_weights"


async def test_weight_swap_under_concurrent_requests_is_atomic_and_registered(policy_server, nats_server):
    url, model = policy_server
    new = new_policy(TOK, seed=2, d_model=32, n_layers=1, max_len=32).eval()
    versions = {0: model, 1: new}
    prompt = [1, 5, *TOK.encode("123"), 6]
    seen = []

    async def one(http, i):
        r = await http.post(f"{url}/completions", json={"prompt": prompt, "max_tokens": 5, "seed": i,
                                                        "logprobs": 0, "return_token_ids": True})
        body = r.json()
        version = int(body["policy_version"])
        assert r.headers["X-Arena-Policy-Version"] == body["policy_version"]
        c = body["choices"][0]
        seen.append((version, c["token_ids"], c["logprobs"]["token_logprobs"]))

    async with httpx.AsyncClient(timeout=60) as http:
        first = [asyncio.create_task(one(http, i)) for i in range(24)]
        await asyncio.sleep(0.05)
        pushed = await http.post(f"{url}/weights", content=to_blob(new, TOK, 1))
        assert pushed.json() == {"policy_version": "1"}
        second = [asyncio.create_task(one(http, 100 + i)) for i in range(24)]
        await asyncio.gather(*first, *second)
        health = (await http.get(url.removesuffix("/v1") + "/health")).json()
    assert health["largest_batch"] > 1 and health["policy_version"] == "1"  # concurrent requests were batched
    assert {v for v, _, _ in seen[-24:]} <= {0, 1} and any(v == 1 for v, _, _ in seen)
    # every response is exactly what its announced version computes: never a mix of weights
    for version, ids, lps in seen:
        direct = completion_logprobs(versions[version], [prompt], [ids])[0]
        assert torch.allclose(direct, torch.tensor(lps), atol=1e-4), version

    bus = await Bus.connect(nats_server.url, "test")
    try:
        kv = await bus.kv(subjects.KV_BACKENDS)
        for _ in range(50):
            replica = msgspec.json.decode((await kv.get("policy-test")).value, type=BackendReplica)
            if replica.policy_version == "1":
                break
            await asyncio.sleep(0.1)
        assert replica.policy_version == "1" and replica.url == url
    finally:
        await bus.close()
