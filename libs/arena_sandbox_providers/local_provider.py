"""The ``local`` provider: bubblewrap sandboxes (see :mod:`arena_sandbox_providers.local`).

A sandbox is a directory ``<data_dir>/sandboxes/<owner>/<id>/`` plus, where cgroups are writable,
a cgroup; each ``exec`` is a fresh ``bwrap`` over that directory, or, in a sandbox created with
``CreateSpec.session``, a command sent to the command server (:mod:`.cmdserver`) that one long-lived
``bwrap`` runs as its init. See docs/sandbox.md (Providers).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import posixpath
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import msgspec

from arena_sandbox_providers import cgroups, channel, cmdserver, local, overlay
from arena_sandbox_providers.hostdir import HostDirSandbox, make_layout, tail_file
from arena_sandbox_providers.local import ProxyForward, ResourceLimits, SandboxSpec
from arena_sandbox_providers.provider import CreateSpec, ExecResult, OutputCallback, SandboxError, SandboxLimits

log = logging.getLogger("arena.sandbox.local")

_DEFAULT = object()  # "not given" (None means no scaffolds)


class LocalSandbox(HostDirSandbox):
    provider = "local"

    def __init__(self, sandbox_id: str, root: Path, limits: SandboxLimits, cgroup: cgroups.SandboxCgroup | None,
                 run_prefix: str = "arena-run-", ro_binds: tuple[str, ...] = (), overlays: _Overlays | None = None,
                 *, nice: int = 0, session: bool = False, harbor_layout: bool = False):
        self.id = sandbox_id
        self.harbor_layout = harbor_layout
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
        #: commands go to a command server in one long-lived bwrap (``CreateSpec.session``)
        self.session = session
        self._server: _Server | None = None
        self._server_lock = asyncio.Lock()

    async def put_dir(self, src: Path, dest: str, *, src_stable: bool = False) -> None:
        """A stable ``src`` put as the whole workspace becomes the lower layer of an overlay
        (:mod:`.overlay`) instead of being copied, where this service may mount one; a copy
        otherwise. The overlay is mounted in each of the sandbox's own mount namespaces, never in
        the service's: a service holding a mount per live sandbox would make every new sandbox
        copy them all (docs/performance.md)."""
        workspace = self.root / "workspace"
        target = Path(super()._host(dest))
        if target.is_relative_to(workspace):
            await self._stop_server()  # the layers of a mounted overlay are never written under it
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
        workspace = os.path.join(os.fspath(self.root), "workspace")
        if self._server is not None and any(
                (h := super(LocalSandbox, self)._host(p)) == workspace or h.startswith(workspace + "/") for p in files):
            await self._stop_server()  # the layers of a mounted overlay are never written under it
        if self._merged is None:
            return await super().put_files(files)
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
            harbor_links=self.harbor_layout,
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
        if self.session and proxy is None and not self._destroyed and not self._server_lock.locked():
            async with self._server_lock:
                return await self._exec_in_session(command, env=env, workdir=workdir, timeout_s=timeout_s,
                                                   cancel=cancel, on_output=on_output)
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

    async def _exec_in_session(self, command: list[str], *, env: Mapping[str, str], workdir: str, timeout_s: float,
                               cancel: asyncio.Event | None, on_output: OutputCallback | None) -> ExecResult:
        """``command`` through the sandbox's command server (started by the first one): a fork and
        exec in the namespaces, rlimits, cgroup and nice level it was started with, no new bwrap.
        Each command gets the environment and directory it asks for, its wall clock and cancel as a
        kill of everything the command started (the server's ``K``)."""
        full_env = dict(env)
        local.validate_env(full_env)
        has_agent = any((self.root / "agent").iterdir())
        cwd = posixpath.normpath(posixpath.join(local.WORKSPACE, self._workdir(workdir, has_agent)))
        server = self._server
        if server is not None and (server.has_agent != has_agent or not await server.channel.alive()):
            await self._stop_server()
            server = None
        if server is None:
            server = self._server = await self._start_server(has_agent)
        ooms = self.cgroup.oom_kills() if self.cgroup else 0
        sink = on_output if on_output is not None else (lambda chunk: None)
        started = time.monotonic()
        run = asyncio.ensure_future(server.channel.run(list(command), full_env, cwd, sink, sink))
        stop = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
        try:
            await asyncio.wait({run, *([stop] if stop else [])}, timeout=timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stop is not None:
                stop.cancel()
        timed_out = not run.done() and not (cancel is not None and cancel.is_set())
        killed = not run.done()
        if killed:
            server.channel.kill()  # the command and all it started; its R follows
            done, _ = await asyncio.wait({run}, timeout=10.0)
            if not done:
                run.cancel()
                await self._stop_server()
        code: int | None = None
        try:
            code = run.result() if run.done() and not run.cancelled() else None
        except channel.ChannelClosed as exc:  # the server (so the sandbox) ended under the command
            await self._stop_server()
            if not killed:
                raise SandboxError(f"the sandbox ended while running the command: {exc}") from exc
        oom = self.cgroup is not None and self.cgroup.oom_kills() > ooms
        return ExecResult(exit_code=None if killed else code, timed_out=timed_out, killed=killed, oom_killed=oom,
                          duration_s=time.monotonic() - started)

    async def _start_server(self, has_agent: bool) -> _Server:
        """The command server, as the init of a bwrap made as each ``exec`` makes its own (no LLM relay),
        connected over a socket in a directory of its own that only this sandbox sees (read-only)."""
        # a short host path (a socket's is at most 107 bytes), mode 0700, reaped with the runs' after a crash;
        # read-only at local.CTL_DIR inside
        ctl = Path(tempfile.mkdtemp(prefix=self.run_prefix + "ctl-", dir=local.run_tmp()))
        try:
            shutil.copyfile(cmdserver.__file__, ctl / "cmdserver.py")
            listener = channel.listen(ctl / "ctl.sock", uid=os.getuid())
        except OSError as exc:
            shutil.rmtree(ctl, ignore_errors=True)
            raise SandboxError(f"cannot start the sandbox's command server: {exc}") from exc
        python = os.path.join(local._venv_bin(), "python3")
        spec = msgspec.structs.replace(
            self._spec([python, "-I", "-S", f"{local.CTL_DIR}/cmdserver.py", f"{local.CTL_DIR}/ctl.sock"], env={},
                       workdir=local.WORKSPACE, timeout_s=float(365 * 86400), proxy=None,
                       log_path=self.root / "run" / "cmdserver.log"),
            as_pid_1=True, ctl_dir=ctl)
        end = asyncio.Event()
        task = asyncio.ensure_future(local.run(spec, cancel=end))

        async def gone() -> str | None:
            if not task.done():
                return None
            log_tail = (self.root / "run" / "cmdserver.log").read_bytes()[-500:].decode(errors="replace")
            return f"its bwrap ended ({task.result() if not task.exception() else task.exception()}): {log_tail}"

        try:
            conn = await channel.Channel.accept(listener, ctl / "ctl.sock", uid=os.getuid(), timeout_s=60.0,
                                                alive=gone)
        except channel.ChannelClosed as exc:
            end.set()
            await asyncio.wait({task}, timeout=10.0)
            shutil.rmtree(ctl, ignore_errors=True)
            raise SandboxError(f"the sandbox's command server did not start: {exc}") from exc
        return _Server(channel=conn, task=task, end=end, ctl=ctl, has_agent=has_agent)

    async def _stop_server(self) -> None:
        """Stop the command server (the sandbox's processes with it): before the service writes into
        the workspace's layers, before a diff, at destroy. The next command starts another."""
        server, self._server = self._server, None
        if server is None:
            return
        if not await server.channel.quit(5.0):
            server.end.set()  # bwrap killed
        await asyncio.wait({server.task}, timeout=15.0)
        if not server.task.done():
            server.end.set()
            await asyncio.wait({server.task}, timeout=15.0)
        if server.task.done() and not server.task.cancelled():
            server.task.exception()  # retrieved: a failed run is in the log, not an unobserved error
        await asyncio.to_thread(shutil.rmtree, server.ctl, True)

    async def diff(self, base: str, *, timeout_s: float = 120.0, put_at_base: bool = False,
                   max_bytes: int | None = None) -> str:
        await self._stop_server()  # the diff's own sandbox mounts the layers again, the session's unmounted
        if put_at_base and await asyncio.to_thread(self.workspace_unchanged):
            return ""  # nothing in it changed since it was a clean checkout of base
        return await local.git_diff(self.root / "workspace", base, timeout_s=timeout_s, run_prefix=self.run_prefix,
                                    max_bytes=max_bytes, layers=self._layers)

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        await self._stop_server()
        await asyncio.to_thread(_remove, self.root, self.cgroup)


class _Server(msgspec.Struct, kw_only=True):
    """A session sandbox's command server: its connection, the bwrap run it is the init of, what
    ends that run, its socket's directory, whether /sandbox/agent was there when it started."""

    channel: channel.Channel
    task: asyncio.Future
    end: asyncio.Event
    ctl: Path
    has_agent: bool


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
        # no images here: the host's /usr for every task
        return CreateSpec(limits=spec.limits, session=spec.session, harbor_layout=spec.harbor_layout)

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
                            nice=self.nice, session=spec.session, harbor_layout=spec.harbor_layout)

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
