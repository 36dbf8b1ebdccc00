"""Helpers for tests and benchmarks: a provider of each kind, ready to use."""

from __future__ import annotations

import uuid
from pathlib import Path

from arena_sandbox.provider import SandboxProvider


def make_provider(name: str, data_dir: Path, *, docker_url: str = "", owner: str = "") -> SandboxProvider:
    """``owner`` "" = a fresh unique one (engines and cgroups are shared by concurrent test runs)."""
    owner = owner or f"test-{uuid.uuid4().hex[:8]}"
    if name == "local":
        from arena_sandbox.local_provider import LocalProvider

        return LocalProvider(data_dir=data_dir, owner=owner)
    if name == "docker":
        from arena_sandbox.docker_provider import DockerProvider

        return DockerProvider(data_dir=data_dir, owner=owner, base_url=docker_url)
    from arena_sandbox.mock_provider import MockProvider

    return MockProvider()
