"""The closed loop through the real stack, bounded: nats + the four services as processes,
the policy server registered in ``arena_backends``, two synchronous GRPO steps. The policy
version advances on the server, and the steps each update trained on were tagged (by the
proxy, from the server's answers) with the version that served them."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import httpx
import pytest

torch = pytest.importorskip("torch")

from arena_stack.natsserver import free_port, wait_port  # noqa: E402
from arena_rl.loop import LoopConfig, run_loop  # noqa: E402
from arena_rl.model import load_checkpoint, new_policy, save_checkpoint  # noqa: E402
from arena_rl.tasks import majority_family  # noqa: E402
from arena_rl.tokenizer import CharTokenizer  # noqa: E402
from arena_rl.trainer import GRPOTrainer, TrainerConfig  # noqa: E402
from arena.sdk import ArenaClient  # noqa: E402
from arena_core import apikeys  # noqa: E402
from arena_core.settings import Settings  # noqa: E402
from arena_stack.stack import Stack  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


async def test_two_sync_grpo_steps_advance_the_policy_and_tag_the_steps(tmp_path, monkeypatch):
    policy_port = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{policy_port}/v1",
                        sandbox_concurrency=4, verify_concurrency=2)
    tok = CharTokenizer(alphabet="01")
    model = new_policy(tok, seed=0, d_model=32, n_layers=1, max_len=16)
    ckpt = save_checkpoint(tmp_path / "v0.pt", model, tok, 0)
    stack = Stack(settings, nats_sync="1s", log=lambda m: None)
    server = None
    await stack.start()
    settings = stack.settings  # its NATS URL carries the administrator's credentials
    monkeypatch.setenv("ARENA_API_KEY", stack.api_key)  # the client and the trainer's metrics post send it
    try:
        log = open(tmp_path / "policy.log", "wb")
        server = subprocess.Popen([sys.executable, "-m", "arena_rl.policy_server", "--checkpoint", str(ckpt),
                                   "--port", str(policy_port), "--nats-url", settings.nats_url],
                                  stdout=log, stderr=log)
        await asyncio.to_thread(wait_port, "127.0.0.1", policy_port, 60, server)
        # a group with uniform rewards trains nothing, but the version still counts the step
        trainer = GRPOTrainer(model, tok, TrainerConfig(batch_groups=1, epochs=1, mode="sync"),
                              push_urls=[settings.backend_url])
        seen: list[tuple[int, list[str]]] = []
        train, _ = majority_family()

        def accept(group) -> bool:
            seen.append((trainer.version, sorted({v for t in group.trajectories for v in t.policy_versions})))
            return True

        original_run = trainer.run

        async def run_with_probe(stream, **kw):
            kw["accept"] = accept
            return await original_run(stream, **kw)

        trainer.run = run_with_probe
        with ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=60) as client:
            history = await asyncio.wait_for(
                run_loop(client=client, trainer=trainer, nats_url=settings.nats_url, train_items=train,
                         config=LoopConfig(steps=2, group_size=4), metrics_path=str(tmp_path / "m.jsonl"),
                         metrics_url=settings.trajectory_url),
                timeout=240)
        assert [m.policy_version for m in history] == [1, 2]
        # one batch per step and no more: nothing was submitted for a version never trained on
        with httpx.Client(headers=apikeys.auth_headers(stack.api_key)) as http:
            submitted = http.get(f"{settings.rollout_url}/v1/rollouts").json()["rollouts"]
        assert len(submitted) == 2 * 4, [r["rollout_id"] for r in submitted]
        assert all(m.groups == 1 and m.trajectories == 4 for m in history)
        # sync mode: step 1 trained on rollouts served by version 0, step 2 on version 1
        assert [versions for _, versions in seen] == [["0"], ["1"]], seen
        assert [m.staleness_max for m in history] == [0, 0]
        async with httpx.AsyncClient() as http:
            health = (await http.get(f"http://127.0.0.1:{policy_port}/health")).json()
        assert health["policy_version"] == "2"
        assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2
        # the same metrics reached the trajectory service for the dashboard
        with httpx.Client(headers=apikeys.auth_headers(stack.api_key)) as http:
            posted = http.get(f"{settings.trajectory_url}/v1/trainer-metrics", params={"run": "grpo-loop"}).json()
        assert [s["step"] for s in posted["steps"]] == [m.step for m in history]
        assert [s["policy_version"] for s in posted["steps"]] == ["1", "2"]
        assert posted["steps"][0]["metrics"]["mean_reward"] == history[0].mean_reward
        for step, m in zip(posted["steps"], history):  # what the Training page charts
            if m.samples:
                assert {"loss", "kl", "entropy", "grad_norm", "lr"} <= set(step["metrics"]), step
            else:  # trained on nothing: no optimiser figures rather than zeros
                assert "loss" not in step["metrics"] and "lr" in step["metrics"], step
        _, _, version = load_checkpoint(trainer.checkpoint(tmp_path / "v2.pt"))
        assert version == 2
    finally:
        if server is not None:
            server.terminate()
            server.wait(15)
        stack.stop()
