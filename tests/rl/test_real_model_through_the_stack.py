"""SmolLM2-135M-Instruct served through the real stack (``make test-rl``: the model loads
in seconds from its cache, ~30 s the first time): nats and the four services as processes,
the policy server registered as a backend replica, the chat example's agent in a sandbox.

The token ids and logprobs captured from the server's answers (whole and streamed) are the
model's own: the trainer's recomputation (its chat template, one forward pass) matches them.
A LoRA update pushed to the running server is served under the new policy version, and the
steps after it carry that version and the updated model's logprobs."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from arena.sdk import ArenaClient  # noqa: E402
from arena_core.schemas import RolloutState  # noqa: E402
from arena_core.settings import Settings  # noqa: E402
from arena_rl.chat_tasks import chat_task  # noqa: E402
from arena_rl.lm import LanguageModel, LoRASpec, ModelUnavailable, gguf_path  # noqa: E402
from arena_rl.policy_server import VERSION_HEADER  # noqa: E402
from arena_stack.natsserver import free_port, wait_port  # noqa: E402
from arena_stack.stack import Stack  # noqa: E402

try:
    gguf_path()
except ModelUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

TOLERANCE = 2e-3  # float32 on CPU: batched, KV-cached sampling against one right-padded forward


def _check_steps(lm: LanguageModel, steps, version: str) -> float:
    """Every step's ids are the chat template's and its logprobs the model's; returns the
    largest difference to the reference (adapter off)."""
    drift = 0.0
    for step in steps:
        assert step.policy_version == version
        assert step.prompt_token_ids == lm.render_chat(step.request_messages)
        assert step.completion_token_ids and len(step.logprobs) == len(step.completion_token_ids)
        assert lm.text(step.completion_token_ids) == step.completion_text
        recomputed = lm.sequence_logprobs([step.prompt_token_ids], [step.completion_token_ids])[0].detach()
        assert torch.allclose(recomputed, torch.tensor(step.logprobs), atol=TOLERANCE), \
            float((recomputed - torch.tensor(step.logprobs)).abs().max())
        reference = lm.sequence_logprobs([step.prompt_token_ids], [step.completion_token_ids], reference=True)[0]
        drift = max(drift, float((reference - recomputed).abs().max()))
    return drift


async def test_the_real_model_serves_exact_tokens_and_takes_lora_updates(tmp_path, monkeypatch):
    policy_port = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{policy_port}/v1",
                        sandbox_concurrency=2, verify_concurrency=2)
    stack = Stack(settings, nats_sync="1s", log=lambda m: None)
    server = None
    await stack.start()
    settings = stack.settings  # its NATS URL carries the administrator's credentials
    monkeypatch.setenv("ARENA_API_KEY", stack.api_key)  # what the clients and trainers send by default
    try:
        log = open(tmp_path / "policy.log", "wb")
        server = subprocess.Popen([sys.executable, "-m", "arena_rl.policy_server", "--engine", "smollm2",
                                   "--port", str(policy_port), "--nats-url", settings.nats_url, "--threads", "2",
                                   "--lora-r", "8"], stdout=log, stderr=log)
        lm = await asyncio.to_thread(LanguageModel.load, lora=LoRASpec(r=8))
        await asyncio.to_thread(wait_port, "127.0.0.1", policy_port, 300, server)

        def run(index: int, seed: int):
            with ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=60) as client:
                rid = client.submit(chat_task(index, turns=2, max_tokens=20, stream="alternate")
                                    ).rollout_id
                view = client.wait(rid, timeout=600)
                return view, client.wait_trajectory(rid, timeout=120)

        view, trajectory = await asyncio.to_thread(run, 0, 1)
        assert view.state == RolloutState.COMPLETED, (view.state, (tmp_path / "policy.log").read_text()[-2000:])
        assert view.reward is not None and 0.0 <= view.reward <= 1.0
        steps = sorted(trajectory.steps, key=lambda s: s.step_index)
        assert [s.stream for s in steps] == [False, True]  # the second turn streamed
        assert len(steps[1].request_messages) == 4  # system, partner, the first reply, partner again
        assert _check_steps(lm, steps, "0") < 1e-4  # version 0: the adapter is all zeros, the base itself

        # a LoRA update: the trainer's adapter, pushed to the running server
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, param in lm.model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        async with httpx.AsyncClient(timeout=60) as http:
            pushed = await http.post(f"http://127.0.0.1:{policy_port}/v1/weights", content=lm.adapter_blob(),
                                     headers={VERSION_HEADER: "1"})
            assert pushed.status_code == 200, pushed.text
            stale = await http.post(f"http://127.0.0.1:{policy_port}/v1/weights", content=lm.adapter_blob(),
                                    headers={VERSION_HEADER: "1"})
            assert stale.status_code == 400 and "not newer" in stale.text
            assert (await http.get(f"http://127.0.0.1:{policy_port}/health")).json()["policy_version"] == "1"

        view, trajectory = await asyncio.to_thread(run, 1, 2)
        assert view.state == RolloutState.COMPLETED
        assert trajectory.policy_versions == ["1"]
        drift = _check_steps(lm, sorted(trajectory.steps, key=lambda s: s.step_index), "1")
        assert drift > 10 * TOLERANCE  # the update changed the served model
    finally:
        if server is not None:
            server.terminate()
            server.wait(20)
        stack.stop()
