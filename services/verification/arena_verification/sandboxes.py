"""Verification's sandboxes, from the sandbox plane's provider interface.

A task with an image is verified in that image (the docker provider); a task without one
in a local bubblewrap sandbox. Network is off in both (no proxy is given to ``exec``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import msgspec

from arena_core.errors import VerificationError
from arena_core.settings import Settings
from arena_sandbox_providers.factory import build_provider, owner_of
from arena_sandbox_providers.provider import CreateSpec, Sandbox, SandboxError, SandboxLimits, SandboxProvider
from arena_verification.tests_verifier import Sandboxes

log = logging.getLogger("arena.verification")

__all__ = ["LocalSandboxes", "ProviderSandboxes", "Sandboxes"]


class ProviderSandboxes:
    """``local`` for tasks without an image, ``docker`` for tasks with one (``None``: this
    worker has no container engine, and such tasks cannot be verified here)."""

    def __init__(self, *, local: SandboxProvider | None, docker: SandboxProvider | None,
                 limits: SandboxLimits = SandboxLimits()):
        self.local = local
        self.docker = docker
        self.limits = limits

    @classmethod
    def from_settings(cls, settings: Settings) -> ProviderSandboxes:
        """The providers of the sandbox plane, under this worker's own owner name (so reaping
        its leftovers never touches the sandbox service's sandboxes on the same host)."""
        own = msgspec.structs.replace(settings, sandbox_owner=owner_of(settings) + "-verify")
        names = {n.strip() for n in settings.sandbox_provider.split(",")}
        docker = build_provider("docker", own) if (settings.docker_url or "docker" in names) else None
        return cls(local=build_provider("local", own), docker=docker)

    async def sandbox_for(self, image: str, workspace_mount: str = "", services: tuple = (), *,
                          harbor_layout: bool = False) -> Sandbox:
        """A fresh sandbox of ``image`` (docker), with the task's sidecar ``services`` beside it;
        without an image a local one, with ``harbor_layout`` its ``/logs`` and ``/tests`` links."""
        provider = self.docker if image else self.local
        if provider is None:
            raise VerificationError(f"the task runs in image {image!r}, and this verification worker has no "
                                    "container engine (set ARENA_DOCKER_URL)")
        problem = await provider.health()
        if problem is not None:
            raise VerificationError(f"the {provider.name} sandbox provider is unavailable: {problem}")
        try:
            return await provider.create(CreateSpec(image=image, limits=self.limits, services=tuple(services),
                                                    workspace_mount=workspace_mount if image else "",
                                                    harbor_layout=harbor_layout and not image))
        except SandboxError as exc:
            raise VerificationError(f"cannot create a verification sandbox: {exc}") from exc

    async def reap(self) -> int:
        """Remove the sandboxes an earlier process of this worker left (``kill -9``)."""
        count = 0
        for provider in (self.local, self.docker):
            if provider is None:
                continue
            try:
                count += await provider.reap_orphans()
            except Exception as exc:  # noqa: BLE001 - an engine that is down: reaped next start
                log.warning("cannot reap %s verification sandboxes now: %s", provider.name, exc)
        return count

    async def close(self) -> None:
        for provider in (self.local, self.docker):
            if provider is not None:
                await provider.close()


class LocalSandboxes(ProviderSandboxes):
    """Local bubblewrap sandboxes under ``directory`` (tests and one-off verifications)."""

    def __init__(self, directory: Path):
        settings = Settings(data_dir=str(directory), sandbox_owner=f"verify-{os.getpid()}")
        super().__init__(local=build_provider("local", settings), docker=None)
