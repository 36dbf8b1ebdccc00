"""The embedded stack for the scaffolds' end-to-end tests in their images: the docker
provider on a Docker-API engine, the scripted backend playing a script, and no container
of the stack's left on the engine once it stopped."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import docker
import pytest

from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack


def require_image(docker_url: str, image: str) -> str:
    """``docker_url``, or a skip when ``image`` is not on that engine."""
    client = docker.DockerClient(base_url=docker_url)
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        pytest.skip(f"no {image} on the engine: build it with `make images`")
    finally:
        client.close()
    return docker_url


@contextmanager
def docker_stack(engine: str, data_dir: Path, script: Path, owner_prefix: str,
                 **overrides) -> Iterator[tuple[Stack, Settings]]:
    """A running stack whose sandboxes are containers labelled with an owner of their own
    (``overrides``: more settings); its settings carry the administrator's NATS credentials."""
    owner = f"{owner_prefix}-{uuid.uuid4().hex[:8]}"
    settings = Settings(
        allow_host_paths=True,  # the task's repository is a path on this machine
        nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data_dir),
        rollout_port=(rp := free_port()), trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
        sandbox_provider="docker", docker_url=engine, sandbox_owner=owner, sandbox_concurrency=2,
        verify_concurrency=2, **overrides,
    )
    stack = Stack(settings, llm_script=script, nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start(timeout=120))
    try:
        yield stack, stack.settings
    finally:
        stack.stop()
    client = docker.DockerClient(base_url=engine)
    try:
        assert not client.api.containers(all=True, filters={"label": f"arena.owner={owner}"})
    finally:
        client.close()
