"""An interactive command in a ``docker`` sandbox (``arena tasks shell`` of a task in an image): the
container the provider makes for an agent, the command an engine ``exec`` on this terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import struct
import tempfile
import termios
import threading
import time
import tty
import uuid
from pathlib import Path

import docker
import docker.errors
import msgspec
from docker.utils.socket import STDERR, frames_iter

from arena_sandbox_providers import local
from arena_sandbox_providers.docker_provider import DEFAULT_IMAGE, USER, DockerProvider, connect
from arena_sandbox_providers.provider import CreateSpec, SandboxError, SandboxLimits


class EngineUnreachable(SandboxError):
    """No Docker-API engine answers at the URL."""

    code = "no_engine"


class ImageMissing(SandboxError):
    """The engine has no such image (nothing is pulled: images are built locally)."""

    code = "image_not_found"

    def __init__(self, image: str, engine: str):
        super().__init__(f"image {image} is not on the engine at {engine}")
        self.image = image


class ShellSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the shell's sandbox holds, as ``arena_sandbox.runner`` puts it for an agent."""

    command: list[str]
    #: the container's image ("" = the provider's default)
    image: str = ""
    #: the task's source as a git repository at its base commit: copied to /sandbox/workspace
    workspace: Path
    #: /sandbox/.arena/task.json (the task's public part)
    task_json: bytes
    #: /sandbox/agent (read-only), if the agent has files
    agent_dir: Path | None = None
    #: added to the image's environment
    env: dict[str, str] = {}
    #: the command's working directory (absolute, in the sandbox)
    workdir: str = local.WORKSPACE
    #: the workspace is mounted here too (an image source's path)
    workspace_mount: str = ""
    limits: SandboxLimits = SandboxLimits()
    #: a terminal (stdin is one), else stdin as a pipe
    tty: bool = False


def engine_name(base_url: str) -> str:
    """The engine a client of ``base_url`` reaches, for messages."""
    return base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def check_image(base_url: str, image: str) -> None:
    """Raise :class:`EngineUnreachable` or :class:`ImageMissing` unless the engine at ``base_url``
    answers (as the provider connects: :func:`.docker_provider.connect`) and holds ``image``."""
    try:
        client = connect(base_url, timeout=30)
    except docker.errors.DockerException as exc:
        raise EngineUnreachable(f"no Docker-API engine answers at {engine_name(base_url)} ({_reason(exc)})") from None
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        raise ImageMissing(image, engine_name(base_url)) from None
    except docker.errors.DockerException as exc:
        raise SandboxError(f"engine at {engine_name(base_url)}: {_one_line(exc)}") from None
    finally:
        client.close()


def interactive(spec: ShellSpec, *, base_url: str = "", default_image: str = DEFAULT_IMAGE, nice: int = 0,
                stdin: int = 0, stdout: int = 1, stderr: int = 2) -> int:
    """Run ``spec.command`` in a fresh docker sandbox with these file descriptors until it exits; its
    exit code. The sandbox (container, directories) is removed on every path, Ctrl-C too.

    The container is the provider's own (``DockerProvider.create``: mounts, user, limits, labels,
    network off, the command server as its init), so the command cannot be its main process: it is
    an engine ``exec``, made and attached through the docker SDK on the provider's connection rather
    than by running ``docker exec -it`` / ``podman exec -it``. A CLI would have to be installed,
    pointed at the same engine (``-H`` / ``--url``) and speak an API version that engine takes; the
    SDK is already Arena's, and what a CLI adds is small: the terminal in raw mode and restored,
    the window size at start and on ``SIGWINCH``, stdin half-closed at its end so the command reads
    EOF, the exit code from the exec. The command runs as ``cmdserver.py --exec CMD``: under the
    command server's seccomp filter, as an agent's commands do."""
    local.validate_env(spec.env)
    with tempfile.TemporaryDirectory(prefix="arena-shell-") as tmp:
        provider = DockerProvider(data_dir=Path(tmp), owner=f"shell-{uuid.uuid4().hex[:12]}", base_url=base_url,
                                  default_image=default_image, nice=nice)
        return asyncio.run(_run(provider, spec, (stdin, stdout, stderr)))


async def _run(provider: DockerProvider, spec: ShellSpec, fds: tuple[int, int, int]) -> int:
    try:
        try:
            sandbox = await provider.create(CreateSpec(image=spec.image, limits=spec.limits,
                                                       workspace_mount=spec.workspace_mount))
        except PermissionError as exc:  # make_layout chowns the sandbox's directories to its uid
            raise SandboxError(f"cannot make the sandbox's directories ({exc}): the docker provider needs root "
                               "here") from None
        try:
            await sandbox.put_dir(spec.workspace, local.WORKSPACE)
            if spec.agent_dir is not None:
                await sandbox.put_dir(spec.agent_dir, local.AGENT_DIR)
            await sandbox.put_files({f"{local.ARENA_DIR}/task.json": spec.task_json})
            api = provider.client.api
            argv = ["python3", "-I", "-S", f"{local.RUN_DIR}/cmdserver.py", "--exec", *spec.command]
            try:
                made = await asyncio.to_thread(api.exec_create, sandbox.container_id, argv, stdin=True,
                                               tty=spec.tty, user=USER, environment=spec.env, workdir=spec.workdir)
            except docker.errors.DockerException as exc:
                raise SandboxError(f"cannot start {spec.command[:1]} in the sandbox: {_one_line(exc)}") from None
            code = await _attach(api, made["Id"], spec.tty, fds)
        finally:
            await sandbox.destroy()
    finally:
        await provider.close()
    if code is None:
        raise SandboxError("the sandbox ended before the command did (no exit code)")
    return code


async def _attach(api: docker.APIClient, exec_id: str, with_tty: bool, fds: tuple[int, int, int]) -> int | None:
    """Start the exec and relay: ``stdin`` to it (half-closed at its end), its output to ``stdout``
    and ``stderr`` (one stream with a terminal); the exec's exit code once its output ends."""
    stdin, stdout, stderr = fds
    loop = asyncio.get_running_loop()
    conn = await asyncio.to_thread(api.exec_start, exec_id, socket=True, tty=with_tty)
    raw = getattr(conn, "_sock", conn)  # the hijacked connection under the SDK's SocketIO
    terminal = with_tty and os.isatty(stdin)
    with _raw_mode(stdin) if terminal else contextlib.nullcontext():
        if terminal:
            def resize() -> None:
                rows, cols = _window_size(stdout if os.isatty(stdout) else stdin)
                with contextlib.suppress(docker.errors.DockerException):
                    api.exec_resize(exec_id, height=rows, width=cols)

            resize()
            loop.add_signal_handler(signal.SIGWINCH, resize)
        threading.Thread(target=_pump, args=(stdin, raw), daemon=True).start()
        try:
            await asyncio.to_thread(_copy_out, conn, with_tty, stdout, stderr)
        finally:
            if terminal:
                loop.remove_signal_handler(signal.SIGWINCH)
            with contextlib.suppress(OSError):  # wakes the output thread if we were interrupted
                raw.shutdown(socket.SHUT_RDWR)
            raw.close()
    return await asyncio.to_thread(_exit_code, api, exec_id)


def _exit_code(api: docker.APIClient, exec_id: str, timeout_s: float = 10.0) -> int | None:
    """The exec's exit code, once the engine has it (its output may end a moment before)."""
    deadline = time.monotonic() + timeout_s
    while (state := api.exec_inspect(exec_id)).get("Running") and time.monotonic() < deadline:
        time.sleep(0.05)
    return state.get("ExitCode")


def _pump(fd: int, sock: socket.socket) -> None:
    """``fd`` into the exec until its end, then half-close: the command reads EOF."""
    try:
        while data := os.read(fd, 65536):
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # the exec ended first
        pass


def _copy_out(conn, with_tty: bool, stdout: int, stderr: int) -> None:
    for stream, data in frames_iter(conn, with_tty):
        fd = stderr if stream == STDERR else stdout
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]


@contextlib.contextmanager
def _raw_mode(fd: int):
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _window_size(fd: int) -> tuple[int, int]:
    try:
        rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8))
    except OSError:
        return 24, 80
    return rows or 24, cols or 80


def _reason(exc: BaseException) -> str:
    """The operating system's word for why a connection failed ("Connection refused"), found in the
    chain the SDK and requests wrap it in; else the whole message on one line."""
    seen, pending = set(), [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            return current.strerror
        pending += [e for e in (current.__cause__, current.__context__, getattr(current, "reason", None),
                                *current.args) if isinstance(e, BaseException)]
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300]
