"""Helpers for tests and benchmarks: a provider of each kind, ready to use."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

from arena_sandbox_providers.provider import SandboxProvider


def make_provider(name: str, data_dir: Path, *, docker_url: str = "", owner: str = "") -> SandboxProvider:
    """``owner`` "" = a fresh unique one (engines and cgroups are shared by concurrent test runs)."""
    owner = owner or f"test-{uuid.uuid4().hex[:8]}"
    if name == "local":
        from arena_sandbox_providers.local_provider import LocalProvider

        return LocalProvider(data_dir=data_dir, owner=owner)
    if name == "docker":
        from arena_sandbox_providers.docker_provider import DockerProvider

        return DockerProvider(data_dir=data_dir, owner=owner, base_url=docker_url)
    from arena_sandbox_providers.mock_provider import MockProvider

    return MockProvider()


@contextlib.contextmanager
def built_image(docker_url: str, context: bytes, name: str) -> Iterator[str]:
    """An image built on the engine from ``context`` (a tar holding a ``Containerfile``),
    tagged ``localhost/<name>:<random>``; it and its containers are removed on exit.
    Raises ``docker.errors.DockerException`` when the engine cannot build it."""
    import io

    import docker

    client = docker.DockerClient(base_url=docker_url)
    tag = f"localhost/{name}:{uuid.uuid4().hex[:10]}"
    try:
        client.images.build(fileobj=io.BytesIO(context), custom_context=True, tag=tag, dockerfile="Containerfile",
                            rm=True, forcerm=True)
        try:
            yield tag
        finally:
            for container in client.containers.list(all=True, filters={"ancestor": tag}):
                container.remove(force=True)
            client.images.remove(tag, force=True)
    finally:
        client.close()
