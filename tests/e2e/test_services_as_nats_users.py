"""The four services each as their own NATS user, allowed only their own subjects
(``arena_stack.natsauth``): a quickstart group runs end to end, a trainer user reads the
group from the trajectory stream, and nats-server logged no permissions violation (every
subject a service uses is in its list, and nothing else is)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from arena.sdk import ArenaClient
from arena.stream import TrajectoryStream
from arena.tasks import load_task
from arena_core.schemas import RolloutState
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


async def test_services_run_a_group_as_users_with_their_own_permissions(tmp_path):
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{free_port()}/v1")
    stack = Stack(settings, log=lambda m: None,
                  llm_script=ROOT / "examples" / "quickstart" / "llm_script.json")
    await stack.start()
    try:
        trainer_url = stack.nats_url_for("trainer")
        async with TrajectoryStream(trainer_url, name="as-a-trainer") as stream:
            def run():
                with ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=60,
                                 api_key=stack.api_key) as client:
                    group = client.submit_group(client.prepare(load_task(ROOT / "examples/quickstart/task.json")),
                                                n=2, seed=3)
                    return group, [client.wait(rid, timeout=300) for rid in group.rollout_ids]

            group, views = await asyncio.wait_for(asyncio.to_thread(run), 360)
            assert [v.state for v in views] == [RolloutState.COMPLETED] * 2, [(v.state, v.reason) for v in views]
            async for batch in stream.groups(batch_size=1, max_wait=30):
                assert batch.groups[0].group_id == group.group_id
                await batch.commit()
                break
        log = (Path(settings.data_dir) / "logs" / "nats-server.log").read_text()
        # nats-server logs a refused publish or subscription as "Publish Violation" / "Subscription Violation"
        assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line][:5]
    finally:
        stack.stop()
