"""The sandbox provider interface, shared by ``local`` (bubblewrap), ``docker`` and ``mock``.

A provider creates sandboxes (:class:`Sandbox`: put files, exec, read, diff, destroy) under
:class:`SandboxLimits`, each reaching only the LLM proxy, and reaps its owner's leftovers at
start-up. See docs/sandbox.md (Providers).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import msgspec

from arena_core.errors import ArenaError
from arena_core.schemas import SidecarService
from arena_sandbox_providers.local import ProxyForward

#: Label (docker) / marker file (local) naming Arena's sandboxes and their owner.
LABEL = "arena.sandbox"
OWNER_LABEL = "arena.owner"

OutputCallback = Callable[[bytes], None]


class SandboxError(ArenaError):
    """The provider could not create, use or destroy a sandbox (not the agent's fault)."""

    code = "sandbox_error"


class SandboxLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-sandbox limits; each provider documents how it enforces each one."""

    memory_bytes: int = 2 * 1024**3
    cpus: float = 1.0
    pids: int = 512
    open_files: int = 4096
    tmp_bytes: int = 512 * 1024**2
    file_size_bytes: int = 2 * 1024**3


class CreateSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a sandbox is created with (before any job is known: warm pools use it)."""

    image: str = ""  # docker: the image; local/mock: ignored ("" = provider default)
    limits: SandboxLimits = SandboxLimits()
    #: docker: the workspace is also mounted here (an image source's path, e.g. ``/testbed``),
    #: so what the image installed from that path (an editable install) is the workspace.
    workspace_mount: str = ""
    #: Sidecar services on the sandbox's own internal network (docker only; other providers refuse).
    services: tuple[SidecarService, ...] = ()
    #: Commands run one after another in one long-lived sandbox (a command server as its init), sharing
    #: its /tmp and processes' namespaces, as a container's do: no new namespaces per command. The
    #: ``docker`` provider's sandboxes always work so; ``local`` ones when this is set (an OpenEnv
    #: episode's many short commands). Commands with an LLM relay still get a sandbox of their own.
    session: bool = False
    #: ``/logs`` and ``/tests`` as links into ``/sandbox/.arena/harbor``, as the layer ``arena images
    #: build`` adds to a Harbor task's image (``local`` only: an image has its own): a ``reward_file``
    #: task without an image is verified in such a sandbox (docs/verification.md).
    harbor_layout: bool = False


class ExecResult(msgspec.Struct, frozen=True, kw_only=True):
    """How one command ended.

    ``exit_code`` is the command's code (``128 + N`` for signal N) or ``None`` when
    Arena killed it (``timed_out`` for the wall clock, else a cancel).
    ``oom_killed``: the kernel's OOM killer fired in this sandbox during the command.
    """

    exit_code: int | None
    timed_out: bool = False
    killed: bool = False
    oom_killed: bool = False
    duration_s: float = 0.0
    #: Why an LLM call through the relay was cut on Arena's side ("" if none was): the proxy
    #: refused the connection or broke it before the answer ended (docs/sandbox.md, "The LLM relay").
    proxy_fault: str = ""


@runtime_checkable
class Sandbox(Protocol):
    id: str
    provider: str

    async def put_dir(self, src: Path, dest: str, *, src_stable: bool = False) -> None:
        """Copy the host directory ``src`` to ``dest`` (under ``/sandbox``), owned by the sandbox user.

        ``src_stable``: ``src`` is neither modified nor removed while the sandbox lives, so a
        provider may use it in place of a copy (``local``: the lower layer of an overlay); what
        the sandbox sees and changes is the same either way, and ``src`` is never modified."""

    async def put_files(self, files: Mapping[str, bytes]) -> None:
        """Write files (absolute paths under ``/sandbox``)."""

    async def exec(
        self,
        command: list[str],
        *,
        env: Mapping[str, str],
        workdir: str = "/sandbox/workspace",
        timeout_s: float = 600.0,
        proxy: ProxyForward | None = None,
        cancel: asyncio.Event | None = None,
        on_output: OutputCallback | None = None,
    ) -> ExecResult:
        """Run ``command`` as the sandbox user, stdout+stderr streamed to ``on_output``.

        Returns when the command and every process it started are gone (or killed)."""

    async def read_file(self, path: str, *, max_bytes: int) -> bytes | None:
        """A regular file's first ``max_bytes + 1`` bytes; ``None`` if missing or not a
        regular file (links are never followed)."""

    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists (of any kind, a dangling link included)."""

    async def diff(self, base: str, *, timeout_s: float = 120.0, put_at_base: bool = False,
                   max_bytes: int | None = None) -> str:
        """The workspace's changes against commit ``base``; runs git inside the sandbox
        boundary, never on the host. Raises :class:`~arena_sandbox_providers.local.GitError`,
        and :class:`~arena_core.sources.DiffTooLarge` (its size, its first ``max_bytes``) for a
        diff over ``max_bytes``: the diff is streamed, never held whole past ``max_bytes``.

        ``put_at_base``: the workspace, as ``put_dir`` filled it, was a clean checkout of ``base``;
        a sandbox that can see that nothing in it changed since answers ``""`` without git."""

    async def destroy(self) -> None:
        """Kill everything in the sandbox and delete it. Idempotent; never raises."""


@runtime_checkable
class SandboxProvider(Protocol):
    name: str
    #: Whether its sandboxes take this host's memory (local, docker): the worker then starts one
    #: only while the host keeps its reserve free (:mod:`arena_core.capacity`). Kubernetes pods run
    #: on the cluster's nodes; mock sandboxes run nothing.
    uses_host_memory: bool

    async def health(self) -> str | None:
        """``None`` when sandboxes can be created here, else the reason."""

    async def create(self, spec: CreateSpec) -> Sandbox: ...

    def pool_key(self, spec: CreateSpec) -> CreateSpec:
        """The spec that sandboxes created for ``spec`` are interchangeable under (warm
        pools are keyed by it): ``local``/``mock`` ignore the image, ``docker`` resolves
        ``""`` to its default image."""

    async def reap_orphans(self) -> int:
        """Destroy every sandbox of this owner left by an earlier process; how many."""

    async def close(self) -> None: ...
