"""The client's tests against a real embedded stack: one per test module (``stack``), keys on,
the quickstart's scripted LLM, two sandbox slots."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-client")
    rp = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data_dir), rollout_port=rp,
                        trajectory_port=free_port(), dashboard_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
                        sandbox_concurrency=2, verify_concurrency=1)
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        assert stack.api_key and (stack.data_dir / "api-key").is_file()  # what the CLI and the SDK find
        yield stack
    finally:
        stack.stop()
