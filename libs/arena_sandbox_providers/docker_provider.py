"""The ``docker`` provider: one hardened container per sandbox, through the docker SDK against
any Docker-API engine (Docker, or Podman's compatible service).

Commands run through the in-sandbox command server (:mod:`arena_sandbox_providers.cmdserver`),
not an engine ``exec``. Hardening, mounts, kill and clean-up: docs/sandbox.md (Providers).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import os
import resource
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import requests
from docker.utils import version_lt

from arena_core import sources
from arena_sandbox_providers import local, priority
from arena_sandbox_providers.channel import Channel, ChannelClosed, listen
from arena_sandbox_providers.hostdir import SANDBOX_UID, HostDirSandbox, make_layout
from arena_sandbox_providers.local import GIT_IDENTITY, ProxyForward
from arena_sandbox_providers.provider import LABEL, OWNER_LABEL, CreateSpec, ExecResult, OutputCallback, SandboxError

log = logging.getLogger("arena.sandbox.docker")
_T = TypeVar("_T")

DEFAULT_IMAGE = "arena/agent-base:latest"
USER = f"{SANDBOX_UID}:{SANDBOX_UID}"
CMDSERVER = Path(__file__).with_name("cmdserver.py")
CONTROL_SOCKET = f"{local.RUN_DIR}/ctl.sock"
INIT = ["python3", "-I", "-S", f"{local.RUN_DIR}/cmdserver.py", CONTROL_SOCKET]
#: The least ``nproc`` ulimit a container gets (:func:`nproc_limit`; the fixed value before).
NPROC_FLOOR = 4096
_SIGKILL_EXIT = 137
_CONNECT_TIMEOUT_S = 60.0  # generous: start-up on 2 busy cores
_KILL_GRACE_S = 10.0  # for the server to kill a command before the engine kills the container
_REMOVE_ATTEMPTS = 4
#: Engine calls a provider makes at once, on threads of its own (:meth:`DockerProvider.call`): each
#: holds its thread as long as the engine takes (seconds when it is busy). In the loop's default
#: executor (min(32, cores + 4) threads, 6 on 2 cores, shared with the service's file work) 256
#: sandboxes' creates and starts queued every sandbox's workspace copy behind them: at 256 at once
#: no agent started before the last container had (docs/performance.md). At most the docker SDK's
#: connection pool (10), so no connection is opened and discarded per call.
ENGINE_THREADS = 8
#: Names a sidecar service's container (its value: the service's name).
SIDECAR_LABEL = "arena.sidecar"
#: What a sidecar (a database, a web server: started as root, dropping to its own user) does not need.
SIDECAR_CAP_DROP = ["NET_RAW", "NET_ADMIN", "SYS_ADMIN", "SYS_PTRACE", "SYS_MODULE", "MKNOD", "AUDIT_WRITE"]


class DockerSandbox(HostDirSandbox):
    provider = "docker"
    owner_uid = SANDBOX_UID

    def __init__(self, sandbox_id: str, root: Path, provider: DockerProvider, container_id: str, channel: Channel):
        self.id = sandbox_id
        self.root = root
        self.client = provider.client
        self._provider = provider
        self.container_id = container_id
        self.run_dir = run_dir_of(root)
        self._channel: Channel | None = channel
        self._lock = asyncio.Lock()
        self._oom_file: Path | None = None
        self._destroyed = False
        self.has_sidecars = False

    # ---------------------------------------------------------------- exec

    async def _live_channel(self) -> Channel:
        """The server's channel; if the server died (the container stopped), the
        container is started again (same mounts) with a fresh server."""
        if self._destroyed:
            raise SandboxError("the sandbox was destroyed")
        if self._channel is None or not await self._channel.alive():
            log.warning("sandbox %s: command server gone, restarting the container", self.id)
            self._channel = None
            self._oom_file = None
            await self._provider.call(self._kill_container)
            self._channel = await self._provider._start(self.container_id, self.run_dir)
        return self._channel

    def _kill_container(self) -> None:
        """SIGKILL the container's init through the engine (the kernel kills everything
        in it, even under a fork bomb) and wait until the engine sees it stopped."""
        with contextlib.suppress(docker.errors.APIError):
            self.client.api.kill(self.container_id, signal="SIGKILL")
        self.client.api.wait(self.container_id, timeout=30)

    async def _run(self, argv: list[str], env: Mapping[str, str], workdir: str, timeout_s: float,
                   cancel: asyncio.Event | None, on_stdout, on_stderr) -> tuple[int | None, bool]:
        """Run one command; (exit code, whether Arena killed it). A command that
        outlives ``timeout_s`` or ``cancel`` is killed with everything it started."""
        channel = await self._live_channel()
        task = asyncio.ensure_future(channel.run(argv, env, workdir, on_stdout, on_stderr))
        waiters: set[asyncio.Future] = {task}
        if cancel is not None:
            waiters.add(asyncio.ensure_future(cancel.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            killed = not task.done()
            if killed:
                channel.kill()
                try:
                    await asyncio.wait_for(asyncio.shield(task), _KILL_GRACE_S)
                except asyncio.TimeoutError:
                    log.warning("sandbox %s: the command server did not kill in time; killing the container", self.id)
                    channel.close()
                    await self._provider.call(self._kill_container)
            try:
                return await task, killed
            except ChannelClosed:
                if killed:
                    return None, True
                raise
        finally:
            for waiter in waiters:
                if waiter is not task:
                    waiter.cancel()
            if not task.done():  # we were cancelled: never leave the command running
                task.cancel()
                channel.close()
                await asyncio.shield(self.destroy())

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
        local.validate_env(dict(env))
        if cancel is not None and cancel.is_set():
            return ExecResult(exit_code=None, killed=True)
        argv = list(command)
        sink = on_output or (lambda chunk: None)
        async with self._lock:
            forwarder = None
            if proxy is not None:
                forwarder = local._Forwarder(proxy, self.run_dir / "proxy.sock")
                await forwarder.start()
                argv = ["python3", "-I", "-S", f"{local.RUN_DIR}/shim.py", str(proxy.inside_port),
                        local.PROXY_SOCKET, "--", *argv]
            started = time.monotonic()
            try:
                ooms = await self._oom_kills()
                try:
                    code, killed = await self._run(argv, env, workdir, timeout_s, cancel, sink, sink)
                except ChannelClosed as exc:
                    if self._destroyed:
                        raise SandboxError(f"docker sandbox {self.id} was destroyed while the command ran") from exc
                    # The server (the container's init) died under the command: only the
                    # OOM killer does that; anything else is Arena's failure, not the agent's.
                    after = await self._oom_kills()
                    if after is not None and ooms is not None and after > ooms:
                        return ExecResult(exit_code=_SIGKILL_EXIT, oom_killed=True, duration_s=time.monotonic() - started)
                    raise SandboxError(f"docker sandbox {self.id}: {exc}") from exc
            finally:
                if forwarder is not None:
                    await forwarder.close()
            duration = time.monotonic() - started
            fault = forwarder.fault if forwarder is not None else ""
            if killed:
                timed_out = not (cancel is not None and cancel.is_set())
                return ExecResult(exit_code=None, timed_out=timed_out, killed=True, duration_s=duration,
                                  proxy_fault=fault)
            after = await self._oom_kills()
            if after is None or ooms is None:  # engine not on this host: SIGKILL nobody sent = the OOM killer
                oom = code == _SIGKILL_EXIT
            else:
                oom = after > ooms
            return ExecResult(exit_code=code, oom_killed=oom, duration_s=duration, proxy_fault=fault)

    async def _oom_kills(self) -> int | None:
        """The container's OOM-kill counter, read from its memory cgroup on this host
        (``None`` when the engine runs elsewhere). The file is found once, then read."""
        if self._oom_file is None:
            pid = self._channel.peer_pid if self._channel is not None else 0
            # the server's pid known: a read of /proc, not behind the engine's queue (there, at 256
            # sandboxes starting, the agents waited for the last container's start); else the
            # engine is asked for it, on its threads
            found = await (asyncio.to_thread(self._find_oom_file, pid) if pid
                           else self._provider.call(self._find_oom_file, 0))
            self._oom_file = found or Path("/nonexistent")
        try:
            for entry in self._oom_file.read_text().splitlines():
                key, _, value = entry.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            return None
        return None

    def _find_oom_file(self, pid: int) -> Path | None:
        try:
            if not pid:  # the server's pid is not visible here: ask the engine
                pid = self.client.api.inspect_container(self.container_id)["State"]["Pid"]
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except (docker.errors.DockerException, OSError, KeyError):
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers == "memory":
                return Path("/sys/fs/cgroup/memory" + path) / "memory.oom_control"
            if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
                return Path("/sys/fs/cgroup" + path) / "memory.events"
        return None

    async def diff(self, base: str, *, timeout_s: float = 120.0, put_at_base: bool = False,
                   max_bytes: int | None = None) -> str:
        if put_at_base and await asyncio.to_thread(self.workspace_unchanged):
            return ""  # nothing in it changed since it was a clean checkout of base
        out = sources.BoundedBytes(max_bytes)  # streamed: at most max_bytes held
        err = sources.BoundedBytes(64 * 1024)
        env = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/tmp",
               "GIT_NO_REPLACE_OBJECTS": "1", **GIT_IDENTITY}
        command = ["sh", "-c", local._DIFF_SCRIPT, "sh", base, *local._exclude_pathspecs()]
        async with self._lock:
            try:
                code, killed = await self._run(command, env, local.WORKSPACE, timeout_s, None, out, err)
            except (ChannelClosed, SandboxError, docker.errors.DockerException) as exc:
                raise local.GitError(f"git diff could not run: {exc}") from exc
        if killed:
            raise local.GitError(f"git diff timed out after {timeout_s:.0f}s")
        if code != 0:
            detail = err.data().decode(errors="replace").strip()[-2000:]
            raise local.GitError(f"git diff failed (exit {code}): {detail}")
        return out.diff()

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        channel, self._channel = self._channel, None
        try:
            if channel is not None and not channel.closed and await channel.quit(timeout_s=5.0):
                # Everything else in the sandbox is dead; once the server's process is reaped
                # too, the engine finds the container stopped and removes it without a kill.
                await asyncio.to_thread(_wait_gone, channel.peer_pid, 1.0)  # /proc, not the engine
        finally:
            await asyncio.shield(self._provider.call(_remove, self.client, self.container_id, self.root))
            if self.has_sidecars:
                await asyncio.shield(self._provider.call(_remove_sidecars, self.client, self._provider.owner, self.id))


def run_dir_of(root: Path) -> Path:
    """The relay directory (``/run/arena``): a short path, a Unix socket path has 108 bytes; on
    tmpfs where there is one (:func:`local.run_tmp`)."""
    return Path(local.run_tmp()) / f"arena-dk-{root.name}"


def _remove(client: docker.DockerClient, container_id: str, root: Path) -> None:
    """Remove the container (killing it if it runs) and its host directories. A
    container that is stopping as this runs makes Podman fail with "could not be
    stopped ... state improper": tried again, as any other engine error, a few times."""
    for attempt in range(1, _REMOVE_ATTEMPTS + 1):
        try:
            client.api.remove_container(container_id, force=True)
            break
        except docker.errors.NotFound:
            break
        except docker.errors.APIError as exc:
            if exc.status_code == 404:
                break
            if attempt == _REMOVE_ATTEMPTS:
                log.warning("could not remove container %s: %s", container_id[:12], exc)
            else:
                time.sleep(0.05 * attempt)
    _remove_dirs(root)


def _remove_sidecars(client: docker.DockerClient, owner: str, sandbox_id: str) -> None:
    """A sandbox's sidecar containers, then its network."""
    with contextlib.suppress(docker.errors.DockerException):
        for info in client.api.containers(all=True, filters={"label": [
                f"{OWNER_LABEL}={owner}", f"arena.sandbox_id={sandbox_id}", SIDECAR_LABEL]}):
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(info["Id"], force=True)
    for attempt in range(1, _REMOVE_ATTEMPTS + 1):
        try:
            client.api.remove_network(f"arena-{owner}-{sandbox_id}")
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if exc.status_code == 404:
                return
            if attempt == _REMOVE_ATTEMPTS:
                log.warning("could not remove network arena-%s-%s: %s", owner, sandbox_id, exc)
            else:
                time.sleep(0.2 * attempt)


def _retrieved(future: asyncio.Future) -> None:
    """A background engine call's outcome, taken (a failure no one reads is not logged as lost)."""
    if not future.cancelled():
        future.exception()


def nproc_limit() -> int:
    """The containers' ``nproc`` ulimit: the kernel's ``pid_max`` (no host holds more tasks than
    that, threads included), or this host's hard ``RLIMIT_NPROC`` where lower, at least
    :data:`NPROC_FLOOR`. An engine cannot give a container more than its own hard limit (Podman
    sets its own to ``pid_max`` at start; without ``CAP_SYS_RESOURCE`` nothing raises it), and the
    engine runs on the worker's host.

    ``RLIMIT_NPROC`` counts every thread of the sandbox's uid on the whole host: the containers
    share the host's user namespace, so all sandboxes (and any process of that uid) count together,
    and the runtime's exec of a container's init as that uid fails (EAGAIN) once the count is over.
    A fixed per-container 4096 was therefore a ceiling on the worker's sandboxes together: no
    container could start once they held 4,096 threads (~650 trivial Python agents at ~6 threads
    each with the command server and the relay's shim; near 250 for agents of ten threads of their
    own; docs/performance.md). What bounds one sandbox is ``pids_limit`` (its pids cgroup,
    ``SandboxLimits.pids``)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = NPROC_FLOOR
    return max(NPROC_FLOOR, pid_max if hard == resource.RLIM_INFINITY else min(hard, pid_max))


def _in_container(pid: int, container_id: str) -> bool:
    """Whether process ``pid`` of this host runs in the container: its cgroup path
    names the container (any engine). A host process of the sandbox's uid could
    connect to the control socket first; it is not in that cgroup, nor can it get in.
    Pid 0 (the engine's processes are not visible from here, e.g. the worker runs in
    another PID namespace) cannot be checked: the uid alone decides then."""
    if pid == 0:
        return True
    try:
        return container_id in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Wait until process ``pid`` of this host has been reaped (no-op for 0)."""
    deadline = time.monotonic() + timeout_s
    while pid and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.001)


def connect(base_url: str, *, timeout: int = 120) -> docker.DockerClient:
    """A client at the engine's API version, read from ``/_ping`` (a plain
    ``DockerClient`` asks ``/version``, which Podman answers slowly: it queries the
    package manager, ~0.3 s), capped at what the SDK knows."""

    def make(version: str) -> docker.DockerClient:
        if base_url:
            return docker.DockerClient(base_url=base_url, version=version, timeout=timeout)
        return docker.from_env(version=version, timeout=timeout)

    probe = make(docker.constants.MINIMUM_DOCKER_API_VERSION)
    try:
        response = probe.api.get(probe.api._url("/_ping", versioned_api=False), timeout=timeout)
        response.raise_for_status()
        version = response.headers.get("Api-Version") or docker.constants.DEFAULT_DOCKER_API_VERSION
    except requests.RequestException as exc:
        raise docker.errors.DockerException(f"cannot reach the engine at {base_url or 'DOCKER_HOST'}: {exc}") from exc
    finally:
        probe.close()
    if not version_lt(version, docker.constants.DEFAULT_DOCKER_API_VERSION):
        version = docker.constants.DEFAULT_DOCKER_API_VERSION
    return make(version)


class DockerProvider:
    """Containers on the Docker-API engine at ``base_url`` ("" = the environment's)."""

    name = "docker"
    uses_host_memory = True

    def __init__(self, *, data_dir: Path, owner: str, base_url: str = "", default_image: str = DEFAULT_IMAGE,
                 nice: int = 0):
        self.base = Path(data_dir) / "docker" / owner
        #: the containers' CPU weight below the service's (:mod:`.priority`, ``ARENA_SANDBOX_NICE``)
        self.nice = nice
        self.owner = owner
        self.base_url = base_url
        self.default_image = default_image
        #: every container's ``nproc`` ulimit (:func:`nproc_limit`: not a cap on the sandboxes together)
        self.nproc = nproc_limit()
        self._client: docker.DockerClient | None = None
        self._engine_threads = ThreadPoolExecutor(max_workers=ENGINE_THREADS, thread_name_prefix="arena-docker-engine")

    async def call(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
        """``fn(*args, **kwargs)`` (a blocking engine call, or work between engine calls) on the
        provider's own threads (:data:`ENGINE_THREADS`), in the caller's context like
        ``asyncio.to_thread``; the loop's default executor stays free for the service's file work."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._engine_threads, functools.partial(context.run, fn, *args, **kwargs))

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            self._client = connect(self.base_url)
        return self._client

    async def health(self) -> str | None:
        def probe() -> str | None:
            try:
                self.client.ping()
            except Exception as exc:  # noqa: BLE001 - any failure is the reason
                return f"no Docker-API engine at {self.base_url or 'DOCKER_HOST'}: {exc}"
            try:
                self.client.images.get(self.default_image)
            except docker.errors.ImageNotFound:
                return f"image {self.default_image} is not built (deploy/docker-engine.sh images)"
            except docker.errors.DockerException as exc:
                return f"engine error: {exc}"
            return None

        return await self.call(probe)

    def _host_config(self, spec: CreateSpec, root: Path, run_dir: Path, network: str = "",
                     hosts: dict[str, str] | None = None) -> dict[str, Any]:
        lim = spec.limits
        return self.client.api.create_host_config(
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            read_only=True,
            network_mode=network or "none",
            extra_hosts=hosts or None,
            tmpfs={"/tmp": f"size={lim.tmp_bytes},mode=1777"},
            mem_limit=lim.memory_bytes,
            memswap_limit=lim.memory_bytes,
            nano_cpus=int(lim.cpus * 1e9),
            cpu_shares=priority.cpu_shares(self.nice) if self.nice > 0 else None,
            pids_limit=lim.pids,
            ulimits=[
                docker.types.Ulimit(name="nofile", soft=lim.open_files, hard=lim.open_files),
                docker.types.Ulimit(name="nproc", soft=self.nproc, hard=self.nproc),
                docker.types.Ulimit(name="fsize", soft=lim.file_size_bytes, hard=lim.file_size_bytes),
                docker.types.Ulimit(name="core", soft=0, hard=0),
            ],
            binds=[
                f"{root / 'workspace'}:{local.WORKSPACE}:rw",
                f"{root / 'arena'}:{local.ARENA_DIR}:rw",
                f"{root / 'agent'}:{local.AGENT_DIR}:ro",
                f"{run_dir}:{local.RUN_DIR}:ro",
                *([f"{root / 'workspace'}:{spec.workspace_mount}:rw"] if spec.workspace_mount else []),
            ],
        )

    async def _start(self, container_id: str, run_dir: Path) -> Channel:
        """Start the (created or stopped) container and accept its server's connection."""
        path = run_dir / "ctl.sock"
        listener = listen(path, uid=SANDBOX_UID)  # before the start: the server connects at once
        try:
            await self.call(self.client.api.start, container_id)
        except BaseException as exc:  # cancelled too: the listener is not left open
            listener.close()
            path.unlink(missing_ok=True)
            if isinstance(exc, docker.errors.DockerException):
                raise SandboxError(f"cannot start container {container_id[:12]}: {exc}") from exc
            raise

        asked: list[asyncio.Future] = []  # the engine's answer on the container's state, while it comes

        async def alive() -> str | None:
            """Why the container is gone, or None. The accept loop asks every second while the server
            has not connected; it never waits on the engine for it (a busy engine's queue took
            seconds, and the connection waited with it): the engine is asked in the background and
            its answer read at the next look."""
            if not asked:
                asked.append(asyncio.ensure_future(self.call(self.client.api.inspect_container, container_id)))
                asked[0].add_done_callback(_retrieved)
                return None
            if not asked[0].done():
                return None
            state = asked.pop().result()["State"]
            if state.get("Running"):
                return None
            logs = await self.call(self.client.api.logs, container_id, tail=20)
            return f"exit code {state.get('ExitCode')}: {logs.decode(errors='replace').strip()[-1000:]}"

        try:
            return await Channel.accept(listener, path, uid=SANDBOX_UID, timeout_s=_CONNECT_TIMEOUT_S, alive=alive,
                                        peer_ok=lambda pid: _in_container(pid, container_id))
        except (ChannelClosed, docker.errors.DockerException) as exc:
            raise SandboxError(f"container {container_id[:12]}: {exc}") from exc

    async def image_command(self, image: str) -> tuple[list[str], str]:
        """The command ``image`` runs by itself (its entrypoint then its command) and its working
        directory: how an unmodified OpenEnv environment image serves (docs/openenv.md)."""
        image = image or self.default_image

        def inspect() -> tuple[list[str], str]:
            config = self.client.api.inspect_image(image).get("Config") or {}
            return [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])], config.get("WorkingDir") or ""

        try:
            return await self.call(inspect)
        except docker.errors.DockerException as exc:
            raise SandboxError(f"cannot inspect image {image}: {exc}") from exc

    def pool_key(self, spec: CreateSpec) -> CreateSpec:
        return CreateSpec(image=spec.image or self.default_image, limits=spec.limits,
                          workspace_mount=spec.workspace_mount)

    async def create(self, spec: CreateSpec) -> DockerSandbox:
        sandbox_id = uuid.uuid4().hex[:12]
        root = self.base / sandbox_id
        run_dir = run_dir_of(root)
        image = spec.image or self.default_image
        check_workspace_mount(spec.workspace_mount)

        def make() -> str:
            shutil.rmtree(run_dir, ignore_errors=True)
            make_layout(root, owner_uid=SANDBOX_UID, run_dir=run_dir)
            shutil.copyfile(CMDSERVER, run_dir / "cmdserver.py")
            network, hosts = self._start_sidecars(spec, sandbox_id) if spec.services else ("", {})
            return self.client.api.create_container(
                image,
                entrypoint=INIT,  # replaces the image's entrypoint and command
                name=f"arena-{self.owner}-{sandbox_id}",
                user=USER,
                labels={LABEL: "1", OWNER_LABEL: self.owner, "arena.sandbox_id": sandbox_id},
                environment={"HOME": "/tmp"},
                hostname="sandbox",
                host_config=self._host_config(spec, root, run_dir, network, hosts),
            )["Id"]

        made = asyncio.ensure_future(self.call(make))
        try:
            container_id = await asyncio.shield(made)
            channel = await self._start(container_id, run_dir)
        except BaseException as exc:
            await asyncio.shield(self._undo_create(made, root))
            if spec.services:
                await asyncio.shield(self.call(_remove_sidecars, self.client, self.owner, sandbox_id))
            if isinstance(exc, docker.errors.DockerException):
                raise SandboxError(f"cannot start a {image} container: {exc}") from exc
            raise
        sandbox = DockerSandbox(sandbox_id, root, self, container_id, channel)
        sandbox.has_sidecars = bool(spec.services)
        return sandbox

    def _start_sidecars(self, spec: CreateSpec, sandbox_id: str) -> tuple[str, dict[str, str]]:
        """The sandbox's internal network (no route out) and its sidecar services on it, started;
        the network's name and each service's name -> address (the agent's ``/etc/hosts``: an
        engine's DNS on internal networks is not everywhere)."""
        lim = spec.limits
        labels = {LABEL: "1", OWNER_LABEL: self.owner, "arena.sandbox_id": sandbox_id}
        network = f"arena-{self.owner}-{sandbox_id}"
        self.client.api.create_network(network, internal=True, labels=labels)
        hosts: dict[str, str] = {}
        for service in spec.services:
            try:
                made = self.client.api.create_container(
                    service.image, command=list(service.command) or None, environment=dict(service.env),
                    name=f"{network}-{service.name}", hostname=service.name,
                    labels={**labels, SIDECAR_LABEL: service.name},
                    host_config=self.client.api.create_host_config(
                        network_mode=network, security_opt=["no-new-privileges"], cap_drop=SIDECAR_CAP_DROP,
                        mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes, pids_limit=lim.pids,
                        nano_cpus=int(lim.cpus * 1e9), tmpfs={"/tmp": f"size={lim.tmp_bytes},mode=1777"},
                        ulimits=[docker.types.Ulimit(name="nofile", soft=lim.open_files, hard=lim.open_files),
                                 docker.types.Ulimit(name="nproc", soft=self.nproc, hard=self.nproc)]),
                    networking_config=self.client.api.create_networking_config(
                        {network: self.client.api.create_endpoint_config(aliases=[service.name])}),
                )
                self.client.api.start(made["Id"])
                info = self.client.api.inspect_container(made["Id"])
            except docker.errors.DockerException as exc:
                raise SandboxError(f"sidecar service {service.name} ({service.image}) did not start: {exc}") from exc
            address = ((info.get("NetworkSettings") or {}).get("Networks") or {}).get(network, {}).get("IPAddress")
            if not address:
                raise SandboxError(f"sidecar service {service.name} ({service.image}) has no address on {network}")
            hosts[service.name] = address
        return network, hosts

    async def _undo_create(self, made: asyncio.Future[str], root: Path) -> None:
        """Remove what a failed or cancelled ``create`` made. Its thread cannot be
        stopped: the container it may be creating is known once the thread returns."""
        container_id = ""
        with contextlib.suppress(Exception):
            container_id = await made
        if container_id:
            await self.call(_remove, self.client, container_id, root)
        else:
            await self.call(_remove_dirs, root)

    async def reap_orphans(self) -> int:
        def reap() -> int:
            found = self.client.api.containers(all=True, filters={"label": [f"{LABEL}=1", f"{OWNER_LABEL}={self.owner}"]})
            for info in found:
                _remove(self.client, info["Id"], self.base / info.get("Labels", {}).get("arena.sandbox_id", "-"))
            for net in self.client.api.networks(filters={"label": [f"{LABEL}=1", f"{OWNER_LABEL}={self.owner}"]}):
                with contextlib.suppress(docker.errors.APIError):
                    self.client.api.remove_network(net["Id"])
            if self.base.is_dir():
                for path in self.base.iterdir():
                    _remove_dirs(path)
            return len(found)

        n = await self.call(reap)
        if n:
            log.warning("reaped %d orphaned container(s) of owner %s", n, self.owner)
        return n

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()


#: Where a workspace may not be mounted: Arena's own paths and the system's.
_RESERVED = ("/sandbox", "/run/arena", "/proc", "/sys", "/dev", "/tmp", "/etc", "/usr", "/bin", "/lib", "/sbin")


def check_workspace_mount(path: str) -> None:
    if not path:
        return
    norm = os.path.normpath(path)
    if not norm.startswith("/") or norm == "/" or any(norm == r or norm.startswith(r + "/") for r in _RESERVED) \
            or ":" in norm or "," in norm:
        raise SandboxError(f"cannot mount the workspace at {path!r}: an absolute path outside Arena's and the "
                           "system's directories is needed (e.g. /testbed)")


def _remove_dirs(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(run_dir_of(root), ignore_errors=True)
