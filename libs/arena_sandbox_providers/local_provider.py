"""The ``local`` provider: bubblewrap sandboxes (see :mod:`arena_sandbox_providers.local`).

A sandbox is a directory ``<data_dir>/sandboxes/<owner>/<id>/`` plus, where cgroups are writable,
a cgroup; each ``exec`` is a fresh ``bwrap`` over that directory. See docs/sandbox.md (Providers).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path

from arena_sandbox_providers import cgroups, local, overlay
from arena_sandbox_providers.hostdir import HostDirSandbox, make_layout, tail_file
from arena_sandbox_providers.local import ProxyForward, ResourceLimits, SandboxSpec
from arena_sandbox_providers.provider import CreateSpec, ExecResult, OutputCallback, SandboxError, SandboxLimits

log = logging.getLogger("arena.sandbox.local")

_DEFAULT = object()  # "not given" (None means no scaffolds)


class LocalSandbox(HostDirSandbox):
    provider = "local"

    def __init__(self, sandbox_id: str, root: Path, limits: SandboxLimits, cgroup: cgroups.SandboxCgroup | None,
                 run_prefix: str = "arena-run-", ro_binds: tuple[str, ...] = (), overlays: _Overlays | None = None,
                 *, nice: int = 0):
        self.id = sandbox_id
        self.nice = nice
        self.root = root
        self.limits = limits
        self.cgroup = cgroup
        self.run_prefix = run_prefix
        self.ro_binds = ro_binds
        self._overlays = overlays
        #: the workspace is an overlay of these layers (lower, upper, work), mounted in each of the
        #: sandbox's own mount namespaces only (:func:`overlay.in_namespace_argv`)
        self._layers: tuple[Path, Path, Path] | None = None
        self._merged: overlay.Merged | None = None  # the service's view of it
        self._upper_mtime = 0
        self._destroyed = False

    async def put_dir(self, src: Path, dest: str, *, src_stable: bool = False) -> None:
        """A stable ``src`` put as the whole workspace becomes the lower layer of an overlay
        (:mod:`.overlay`) instead of being copied, where this service may mount one; a copy
        otherwise. The overlay is mounted in each of the sandbox's own mount namespaces, never in
        the service's: a service holding a mount per live sandbox would make every new sandbox
        copy them all (docs/performance.md)."""
        workspace = self.root / "workspace"
        target = Path(super()._host(dest))
        if self._merged is not None and target.is_relative_to(workspace):
            rel = str(target.relative_to(workspace))
            await asyncio.to_thread(self._copy_into_upper, Path(src), rel)
            return
        if (src_stable and self._overlays is not None and self._layers is None and target == workspace
                and await asyncio.to_thread(self._overlays.check, self.root.parent)):
            if await asyncio.to_thread(self._overlay_workspace, Path(src).resolve()):
                return
        await super().put_dir(src, dest)

    def _overlay_workspace(self, lower: Path) -> bool:
        workspace = self.root / "workspace"
        if any(workspace.iterdir()):
            return False
        upper, work = self.root / "upper", self.root / "overlay-work"
        try:
            overlay.options(lower, upper, work)
        except OSError as exc:
            self._overlays.refused(exc)
            return False
        upper.mkdir()
        work.mkdir()
        self._layers = (lower, upper, work)
        self._merged = overlay.Merged(lower, upper)
        self._workspace_mark = None
        self._upper_mtime = upper.stat().st_mtime_ns
        return True

    def _copy_into_upper(self, src: Path, rel: str) -> None:
        assert self._merged is not None
        shutil.copytree(src, self._merged.writable(rel + "/x").parent, symlinks=True, dirs_exist_ok=True)

    def _host(self, path: str) -> str:
        """A workspace path as the sandbox sees it while the workspace is an overlay: its host path
        in the upper or lower layer, or one under ``<root>/absent`` (nothing) where it has none."""
        host = super()._host(path)
        if self._merged is None:
            return host
        workspace = os.path.join(os.fspath(self.root), "workspace")
        if host != workspace and not host.startswith(workspace + "/"):
            return host
        rel = host[len(workspace) + 1:]
        return self._merged.lookup(rel) or os.path.join(os.fspath(self.root), "absent", rel)

    async def put_files(self, files: Mapping[str, bytes]) -> None:
        if self._merged is None:
            return await super().put_files(files)
        workspace = os.path.join(os.fspath(self.root), "workspace")
        plain = {}
        for path, data in files.items():
            host = super()._host(path)
            if host.startswith(workspace + "/"):
                target = await asyncio.to_thread(self._merged.writable, host[len(workspace) + 1:])
                target.write_bytes(data)
            else:
                plain[path] = data
        if plain:
            await super().put_files(plain)

    def workspace_unchanged(self) -> bool:
        if self._layers is not None:  # every write, creation, deletion, rename or chmod lands in the upper layer,
            # and one made and removed again moved its directory's mtime (not its ctime: each
            # overlay's first mount stores its uuid as an extended attribute of the upper directory)
            upper = self.root / "upper"
            return upper.stat().st_mtime_ns == self._upper_mtime and not any(upper.iterdir())
        return super().workspace_unchanged()

    def _workdir(self, workdir: str, has_agent: bool) -> str:
        """``workdir`` as :class:`SandboxSpec` takes it (relative to the workspace, else absolute);
        a directory this sandbox does not have is refused (:class:`SandboxError`), never replaced
        by another: a command run elsewhere than asked finds the wrong files, or none."""
        norm = posixpath.normpath(workdir)
        host = self._host(norm)  # refuses one outside /sandbox/{workspace,.arena,agent}
        if (norm == local.AGENT_DIR or norm.startswith(local.AGENT_DIR + "/")) and not has_agent:
            raise SandboxError(f"working directory {workdir!r}: this sandbox has nothing at {local.AGENT_DIR}")
        if not os.path.isdir(host):
            raise SandboxError(f"working directory {workdir!r} is not a directory in the sandbox")
        if norm == local.WORKSPACE or norm.startswith(local.WORKSPACE + "/"):
            return posixpath.relpath(norm, local.WORKSPACE)
        return norm

    def _spec(self, command, *, env, workdir, timeout_s, proxy, log_path) -> SandboxSpec:
        has_agent = any((self.root / "agent").iterdir())
        rel = self._workdir(workdir, has_agent)
        return SandboxSpec(
            command=list(command),
            workspace=self.root / "workspace",
            arena_dir=self.root / "arena",
            agent_dir=self.root / "agent" if has_agent else None,
            env=dict(env),
            timeout_s=timeout_s,
            proxy=proxy,
            log_path=log_path,
            workdir=str(rel),
            overlay=self._layers,
            limits=ResourceLimits(
                open_files=self.limits.open_files,
                file_size_bytes=self.limits.file_size_bytes,
                tmp_size_bytes=self.limits.tmp_bytes,
                nice=self.nice,
            ),
            cgroup_procs=self.cgroup.procs_files if self.cgroup else (),
            run_prefix=self.run_prefix,
            ro_binds=self.ro_binds,
        )

    async def exec(
        self,
        command: list[str],
        *,
        env: Mapping[str, str],
        workdir: str = local.WORKSPACE,
        timeout_s: float = 600.0,
        proxy: ProxyForward | None = None,
        cancel: asyncio.Event | None = None,
        on_output: OutputCallback | None = None,
    ) -> ExecResult:
        log_path = self.root / "run" / f"exec-{uuid.uuid4().hex[:8]}.log"
        spec = self._spec(command, env=env, workdir=workdir, timeout_s=timeout_s, proxy=proxy, log_path=log_path)
        ooms = self.cgroup.oom_kills() if self.cgroup else 0
        finished = asyncio.Event()
        tail = asyncio.create_task(tail_file(log_path, on_output, finished)) if on_output else None
        try:
            run = await local.run(spec, cancel=cancel)
        finally:
            finished.set()
            if tail is not None:
                await tail
            log_path.unlink(missing_ok=True)
        oom = self.cgroup is not None and self.cgroup.oom_kills() > ooms
        return ExecResult(exit_code=run.exit_code, timed_out=run.timed_out, killed=run.killed,
                          oom_killed=oom, duration_s=run.duration_s, proxy_fault=run.proxy_fault)

    async def diff(self, base: str, *, timeout_s: float = 120.0, put_at_base: bool = False,
                   max_bytes: int | None = None) -> str:
        if put_at_base and await asyncio.to_thread(self.workspace_unchanged):
            return ""  # nothing in it changed since it was a clean checkout of base
        return await local.git_diff(self.root / "workspace", base, timeout_s=timeout_s, run_prefix=self.run_prefix,
                                    max_bytes=max_bytes, layers=self._layers)

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        await asyncio.to_thread(_remove, self.root, self.cgroup)


def _remove(root: Path, cgroup: cgroups.SandboxCgroup | None) -> None:
    if cgroup is not None:
        cgroup.destroy()
    # the workspace's overlay went with the last process of the sandbox's own mount namespace
    shutil.rmtree(root, ignore_errors=True)


class _Overlays:
    """Whether this provider's workspaces are overlays: until the kernel refuses one mount (no
    CAP_SYS_ADMIN, no overlayfs, an upper file system it cannot use), then copies for good."""

    def __init__(self) -> None:
        self.usable = os.geteuid() == 0
        self._probed = False

    def check(self, scratch_parent: Path) -> bool:
        """Whether overlays are usable, probed once (a mount in a namespace of its own)."""
        if self.usable and not self._probed:
            self._probed = True
            why = overlay.probe(scratch_parent / f".overlay-probe-{uuid.uuid4().hex[:8]}")
            if why is not None:
                self.refused(OSError(why))
        return self.usable

    def refused(self, exc: OSError) -> None:
        if self.usable:
            self.usable = False
            log.warning("workspace overlays off, workspaces are copies from now on: %s", exc)


class LocalProvider:
    """Bubblewrap sandboxes under ``<data_dir>/sandboxes/<owner>/``."""

    name = "local"
    uses_host_memory = True

    def __init__(self, *, data_dir: Path, owner: str, use_cgroups: bool = True, scaffolds_dir=_DEFAULT,
                 nice: int = 0):
        """``scaffolds_dir``: installed agent scaffolds (``<dir>/<scaffold name>/bin/...``), bound
        read-only into every sandbox at their host path; default ``ARENA_SCAFFOLDS_DIR``, else
        ``<data_dir>/scaffolds``; ``None`` or a missing directory: none (docs/agents.md). ``nice``:
        the sandboxes' CPU priority below the service's (:mod:`.priority`, ``ARENA_SANDBOX_NICE``)."""
        self.nice = nice
        if scaffolds_dir is _DEFAULT:
            scaffolds_dir = os.environ.get("ARENA_SCAFFOLDS_DIR") or Path(data_dir) / "scaffolds"
        self._scaffolds = Path(scaffolds_dir).resolve() if scaffolds_dir is not None else None
        self.base = Path(data_dir) / "sandboxes" / owner
        self.owner = owner
        # cgroups are host-wide: keyed by owner and data directory, so two services
        # sharing an owner name never reap each other's sandboxes
        digest = hashlib.sha1(str(self.base.resolve()).encode()).hexdigest()[:8]
        self.cgroup_owner = f"{owner}-{digest}"
        # each run's relay directory in the temp dir (a Unix socket path must be short)
        # is named after this installation too, so a crash's are reaped at start-up
        self.run_prefix = f"arena-run-{hashlib.sha1(self.cgroup_owner.encode()).hexdigest()[:10]}-"
        self.use_cgroups = use_cgroups and cgroups.available() is None
        self.overlays = _Overlays()

    @property
    def scaffolds_dir(self) -> Path | None:
        """Installed scaffolds as sandboxes see them (the host path), or ``None``: none here."""
        return self._scaffolds if self._scaffolds is not None and self._scaffolds.is_dir() else None

    async def health(self) -> str | None:
        return await asyncio.to_thread(local.available)

    @property
    def limits_note(self) -> str:
        if self.use_cgroups:
            return f"cgroups {cgroups.mode()}: pids, memory, cpu per sandbox"
        return "no cgroups: pids and memory are NOT limited per sandbox (rlimits only)"

    def pool_key(self, spec: CreateSpec) -> CreateSpec:
        return CreateSpec(limits=spec.limits)  # no images here: the host's /usr for every task

    async def create(self, spec: CreateSpec) -> LocalSandbox:
        sandbox_id = uuid.uuid4().hex[:12]
        root = self.base / sandbox_id
        cgroup = cgroups.SandboxCgroup(self.cgroup_owner, sandbox_id) if self.use_cgroups else None

        def make() -> None:
            make_layout(root, owner_uid=None, relay_files=False)  # a run's own directory has them
            if cgroup is not None:
                cgroup.create(pids=spec.limits.pids, memory_bytes=spec.limits.memory_bytes, cpus=spec.limits.cpus,
                              nice=self.nice)

        await asyncio.to_thread(make)
        scaffolds = self.scaffolds_dir
        binds = (str(scaffolds),) if scaffolds is not None else ()
        return LocalSandbox(sandbox_id, root, spec.limits, cgroup, self.run_prefix, binds, self.overlays,
                            nice=self.nice)

    async def reap_orphans(self) -> int:
        def reap() -> int:
            count = 0
            if self.base.is_dir():
                for mounted in overlay.mounts_under(self.base):  # a workspace overlay left mounted
                    overlay.unmount(mounted)
                for path in self.base.iterdir():
                    shutil.rmtree(path, ignore_errors=True)
                    count += 1
            if self.use_cgroups:
                count = max(count, cgroups.reap(self.cgroup_owner))
            for tmp in dict.fromkeys((local.run_tmp(), tempfile.gettempdir())):
                for run_dir in Path(tmp).glob(f"{self.run_prefix}*"):
                    shutil.rmtree(run_dir, ignore_errors=True)
            return count

        n = await asyncio.to_thread(reap)
        if n:
            log.warning("reaped %d orphaned local sandbox(es) of owner %s", n, self.owner)
        return n

    async def close(self) -> None:
        return None  # nothing held between sandboxes
