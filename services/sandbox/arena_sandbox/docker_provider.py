"""The ``docker`` provider: one container per sandbox, through the docker SDK against
any Docker-API engine (Docker, or Podman's compatible service).

A container is started with a keep-alive init (``sleep infinity``) and hardened:
uid 1000, every capability dropped, ``no-new-privileges``, read-only root, a ``/tmp``
tmpfs, memory (= memory+swap), CPU, pids, ``nofile``/``nproc`` limits and
``network_mode=none``. Its ``/sandbox/{workspace,.arena,agent}`` and ``/run/arena``
are bind mounts of ``<data_dir>/docker/<owner>/<id>/`` (so the engine must run on the
worker's host); the LLM proxy is reached through the same Unix-socket relay as the
local provider (:mod:`arena_sandbox.shim`, run by the image's ``python3``). Commands
run with ``exec``; on timeout or cancel the container's init is SIGKILLed (the kernel
kills everything in it, even under a fork bomb) and, after a timeout, the container is
started again so the diff can be extracted.

Containers are labelled ``arena.sandbox=1`` and ``arena.owner=<owner>``; start-up
removes the owner's leftovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker
import docker.errors

from arena_sandbox import local
from arena_sandbox.hostdir import SANDBOX_UID, HostDirSandbox, make_layout
from arena_sandbox.local import GIT_IDENTITY, ProxyForward
from arena_sandbox.provider import LABEL, OWNER_LABEL, CreateSpec, ExecResult, OutputCallback, SandboxError

log = logging.getLogger("arena.sandbox.docker")

DEFAULT_IMAGE = "arena/agent-base:latest"
USER = f"{SANDBOX_UID}:{SANDBOX_UID}"
#: Below this host's hard limits: an engine refuses a container whose limits exceed them.
NPROC_LIMIT = 4096
_SIGKILL_EXIT = 137


class DockerSandbox(HostDirSandbox):
    provider = "docker"
    owner_uid = SANDBOX_UID

    def __init__(self, sandbox_id: str, root: Path, client: docker.DockerClient, container_id: str, memory_bytes: int):
        self.id = sandbox_id
        self.root = root
        self.client = client
        self.container_id = container_id
        self.memory_bytes = memory_bytes
        self.run_dir = run_dir_of(root)
        self._forwarder: local._Forwarder | None = None
        self._oom_file: Path | None = None
        self._destroyed = False

    # ---------------------------------------------------------------- exec

    def _exec_blocking(self, command: list[str], env: Mapping[str, str], workdir: str,
                       on_chunk: Any, demux: bool = False) -> int | None:
        api = self.client.api
        exec_id = api.exec_create(self.container_id, command, user=USER, environment=dict(env), workdir=workdir)["Id"]
        for chunk in api.exec_start(exec_id, stream=True, demux=demux):
            on_chunk(chunk)
        return api.exec_inspect(exec_id).get("ExitCode")

    def _kill_all_blocking(self, *, restart: bool) -> None:
        """SIGKILL the container's init, so the kernel kills every process in it (this
        works even when a fork bomb has used up the pids limit), then, if ``restart``,
        start it again (same bind mounts) so the diff can still run."""
        api = self.client.api
        with contextlib.suppress(docker.errors.APIError):
            api.kill(self.container_id, signal="SIGKILL")
        api.wait(self.container_id, timeout=30)
        if restart:
            api.start(self.container_id)

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
        if proxy is not None:
            self._forwarder = local._Forwarder(proxy, self.run_dir / "proxy.sock")
            await self._forwarder.start()
            argv = ["python3", "-I", "-S", f"{local.RUN_DIR}/shim.py", str(proxy.inside_port),
                    local.PROXY_SOCKET, "--", *argv]
        loop = asyncio.get_running_loop()
        sink = (lambda chunk: loop.call_soon_threadsafe(on_output, chunk)) if on_output else (lambda chunk: None)
        ooms = await asyncio.to_thread(self._oom_kills)
        started = time.monotonic()
        task = asyncio.ensure_future(asyncio.to_thread(self._exec_blocking, argv, env, workdir, sink))
        waiters: set[asyncio.Future] = {task}
        if cancel is not None:
            waiters.add(asyncio.ensure_future(cancel.wait()))
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            killed = not task.done()
            timed_out = killed and not (cancel is not None and cancel.is_set())
            try:
                if killed:
                    await asyncio.to_thread(self._kill_all_blocking, restart=timed_out)
                code = await asyncio.wait_for(asyncio.shield(task), 30)
            except (docker.errors.DockerException, OSError, asyncio.TimeoutError) as exc:
                raise SandboxError(f"docker exec failed: {type(exc).__name__}: {exc}") from exc
        finally:
            for waiter in waiters:
                if waiter is not task:
                    waiter.cancel()
            if not task.done():
                await self.destroy()  # the engine is stuck or we were cancelled: never leave it
            if self._forwarder is not None:
                await self._forwarder.close()
                self._forwarder = None
        duration = time.monotonic() - started
        if killed:
            return ExecResult(exit_code=None, timed_out=timed_out, killed=True, duration_s=duration)
        after = await asyncio.to_thread(self._oom_kills)
        if after is None or ooms is None:  # engine not on this host: SIGKILL nobody sent = the OOM killer
            oom = code == _SIGKILL_EXIT
        else:
            oom = after > ooms
        return ExecResult(exit_code=code, oom_killed=oom, duration_s=duration)

    def _oom_kills(self) -> int | None:
        """The container's OOM-kill counter, read from its memory cgroup on this host
        (``None`` when the engine runs elsewhere). The file is found once, then read."""
        if self._oom_file is None:
            self._oom_file = self._find_oom_file() or Path("/nonexistent")
        try:
            for entry in self._oom_file.read_text().splitlines():
                key, _, value = entry.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            return None
        return None

    def _find_oom_file(self) -> Path | None:
        try:
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

    async def diff(self, base: str, *, timeout_s: float = 120.0) -> str:
        out: list[bytes] = []
        err: list[bytes] = []

        def collect(chunk: tuple[bytes | None, bytes | None]) -> None:
            if chunk[0]:
                out.append(chunk[0])
            if chunk[1]:
                err.append(chunk[1])

        env = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": "/tmp", **GIT_IDENTITY}
        command = ["sh", "-c", local._DIFF_SCRIPT, "sh", base, *local._exclude_pathspecs()]
        try:
            code = await asyncio.wait_for(
                asyncio.to_thread(self._exec_blocking, command, env, local.WORKSPACE, collect, True), timeout_s
            )
        except asyncio.TimeoutError:
            raise local.GitError(f"git diff timed out after {timeout_s:.0f}s") from None
        except docker.errors.DockerException as exc:
            raise local.GitError(f"git diff could not run: {exc}") from exc
        if code != 0:
            detail = b"".join(err).decode(errors="replace").strip()[-2000:]
            raise local.GitError(f"git diff failed (exit {code}): {detail}")
        return b"".join(out).decode("utf-8", errors="replace")

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        await asyncio.to_thread(_remove, self.client, self.container_id, self.root)


def run_dir_of(root: Path) -> Path:
    """The relay directory (``/run/arena``): a short path, a Unix socket path has 108 bytes."""
    return Path(tempfile.gettempdir()) / f"arena-dk-{root.name}"


def _remove(client: docker.DockerClient, container_id: str, root: Path) -> None:
    with contextlib.suppress(docker.errors.NotFound):
        try:
            client.api.remove_container(container_id, force=True)
        except docker.errors.APIError as exc:
            if exc.status_code != 404:
                log.warning("could not remove container %s: %s", container_id[:12], exc)
    shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(run_dir_of(root), ignore_errors=True)


class DockerProvider:
    """Containers on the Docker-API engine at ``base_url`` ("" = the environment's)."""

    name = "docker"

    def __init__(self, *, data_dir: Path, owner: str, base_url: str = "", default_image: str = DEFAULT_IMAGE):
        self.base = Path(data_dir) / "docker" / owner
        self.owner = owner
        self.base_url = base_url
        self.default_image = default_image
        self._client: docker.DockerClient | None = None

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            self._client = (
                docker.DockerClient(base_url=self.base_url, timeout=120) if self.base_url else docker.from_env(timeout=120)
            )
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
                return f"image {self.default_image} is not built (deploy/images/build.sh)"
            except docker.errors.DockerException as exc:
                return f"engine error: {exc}"
            return None

        return await asyncio.to_thread(probe)

    async def create(self, spec: CreateSpec) -> DockerSandbox:
        sandbox_id = uuid.uuid4().hex[:12]
        root = self.base / sandbox_id
        image = spec.image or self.default_image
        lim = spec.limits

        def make() -> str:
            make_layout(root, owner_uid=SANDBOX_UID)
            run_dir = run_dir_of(root)
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.move(root / "run", run_dir)
            try:
                container = self.client.containers.run(
                    image,
                    ["sleep", "infinity"],
                    name=f"arena-{self.owner}-{sandbox_id}",
                    detach=True,
                    user=USER,
                    cap_drop=["ALL"],
                    security_opt=["no-new-privileges"],
                    read_only=True,
                    network_mode="none",
                    tmpfs={"/tmp": f"size={lim.tmp_bytes},mode=1777"},
                    mem_limit=lim.memory_bytes,
                    memswap_limit=lim.memory_bytes,
                    nano_cpus=int(lim.cpus * 1e9),
                    pids_limit=lim.pids,
                    ulimits=[
                        docker.types.Ulimit(name="nofile", soft=lim.open_files, hard=lim.open_files),
                        docker.types.Ulimit(name="nproc", soft=NPROC_LIMIT, hard=NPROC_LIMIT),
                        docker.types.Ulimit(name="fsize", soft=lim.file_size_bytes, hard=lim.file_size_bytes),
                        docker.types.Ulimit(name="core", soft=0, hard=0),
                    ],
                    labels={LABEL: "1", OWNER_LABEL: self.owner, "arena.sandbox_id": sandbox_id},
                    volumes={
                        str(root / "workspace"): {"bind": local.WORKSPACE, "mode": "rw"},
                        str(root / "arena"): {"bind": local.ARENA_DIR, "mode": "rw"},
                        str(root / "agent"): {"bind": local.AGENT_DIR, "mode": "ro"},
                        str(run_dir): {"bind": local.RUN_DIR, "mode": "ro"},
                    },
                    environment={"HOME": "/tmp"},
                    hostname="sandbox",
                )
            except docker.errors.DockerException as exc:
                shutil.rmtree(root, ignore_errors=True)
                shutil.rmtree(run_dir, ignore_errors=True)
                raise SandboxError(f"cannot start a {image} container: {exc}") from exc
            return container.id

        container_id = await asyncio.to_thread(make)
        return DockerSandbox(sandbox_id, root, self.client, container_id, lim.memory_bytes)

    async def reap_orphans(self) -> int:
        def reap() -> int:
            found = self.client.api.containers(all=True, filters={"label": [f"{LABEL}=1", f"{OWNER_LABEL}={self.owner}"]})
            for info in found:
                _remove(self.client, info["Id"], self.base / info.get("Labels", {}).get("arena.sandbox_id", "-"))
            if self.base.is_dir():
                for path in self.base.iterdir():
                    shutil.rmtree(path, ignore_errors=True)
                    shutil.rmtree(run_dir_of(path), ignore_errors=True)
            return len(found)

        n = await asyncio.to_thread(reap)
        if n:
            log.warning("reaped %d orphaned container(s) of owner %s", n, self.owner)
        return n

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
