"""Providers by name, from the settings (an unknown name fails loudly)."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

from arena_core.settings import Settings, SettingsError
from arena_sandbox_providers.provider import SandboxProvider

PROVIDERS = ("local", "docker", "kubernetes", "mock")


def owner_of(settings: Settings) -> str:
    """``ARENA_SANDBOX_OWNER``, else ``<host name>-<hash of the data directory>``: one
    identity per worker installation, so a restart reaps its own sandboxes only."""
    digest = hashlib.sha1(str(Path(settings.data_dir).resolve()).encode()).hexdigest()[:8]
    owner = settings.sandbox_owner or f"{socket.gethostname()}-{digest}"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in owner)


def build_provider(name: str, settings: Settings) -> SandboxProvider:
    data_dir, owner = Path(settings.data_dir), owner_of(settings)
    if name == "local":
        from arena_sandbox_providers.local_provider import LocalProvider

        return LocalProvider(data_dir=data_dir, owner=owner, nice=settings.sandbox_nice)
    if name == "docker":
        from arena_sandbox_providers.docker_provider import DockerProvider

        return DockerProvider(data_dir=data_dir, owner=owner, base_url=settings.docker_url,
                              default_image=settings.sandbox_image, nice=settings.sandbox_nice)
    if name == "kubernetes":
        from arena_sandbox_providers.kubernetes_provider import KubernetesConfig, KubernetesProvider

        # the pods reach the proxy where agents are sent: the proxy-only port when there is one
        config = KubernetesConfig.from_env(os.environ, public_url=settings.agent_url)
        return KubernetesProvider(owner=owner, config=config, default_image=settings.sandbox_image,
                                  max_wall_clock_s=settings.max_wall_clock_s, nice=settings.sandbox_nice)
    if name == "mock":
        from arena_sandbox_providers.mock_provider import MockProvider

        return MockProvider()
    raise SettingsError(f"ARENA_SANDBOX_PROVIDER: unknown provider {name!r} (known: {', '.join(PROVIDERS)})")


def build_providers(settings: Settings) -> list[SandboxProvider]:
    names = [n.strip() for n in settings.sandbox_provider.split(",") if n.strip()]
    if not names:
        raise SettingsError("ARENA_SANDBOX_PROVIDER is empty")
    return [build_provider(n, settings) for n in dict.fromkeys(names)]
