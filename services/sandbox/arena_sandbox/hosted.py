"""A hosted OpenEnv environment (``task.environment``): its unmodified server runs in a
sandbox (``envhost.py`` relays a Unix socket in ``/sandbox/.arena`` to its port), each
episode is one WebSocket ``/ws`` to it with OpenEnv's frames relayed as they are, and the
started server waits in :class:`EnvServers` for the next episode of the same environment
(OpenEnv's server makes a fresh environment per connection). docs/openenv.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from arena_core.schemas import EnvError, EnvReply, OpenEnvServer
from arena_sandbox.episode import EnvironmentBroken
from arena_sandbox_providers import envhost, local
from arena_sandbox_providers.local import ProxyForward
from arena_sandbox_providers.provider import Sandbox

log = logging.getLogger("arena.sandbox.hosted")

ENVHOST = Path(envhost.__file__)
ENV_SOCKET = f"{local.ARENA_DIR}/env.sock"
#: The server's own lifetime limit (a pooled server lives across episodes; the pool retires it sooner).
SERVER_WALL_CLOCK_S = 86400.0


class _Tail:
    """The server's output, its last ``limit`` bytes kept; ``since(mark)`` is one episode's part."""

    def __init__(self, limit: int = 1 << 20):
        self.limit, self.buf, self.total = limit, bytearray(), 0

    def __call__(self, chunk: bytes) -> None:
        self.buf += chunk
        self.total += len(chunk)
        if len(self.buf) > self.limit:
            del self.buf[: len(self.buf) - self.limit]

    def since(self, mark: int) -> bytes:
        kept_from = self.total - len(self.buf)
        return bytes(self.buf[max(0, mark - kept_from):])


class HostedServer:
    """One started environment server in its sandbox; destroyed with :meth:`close`."""

    def __init__(self, sandbox: Sandbox, spec: OpenEnvServer, *, command: list[str], workdir: str,
                 env: dict[str, str], proxy: ProxyForward | None):
        self.sandbox, self.spec, self.command, self.workdir, self.env, self.proxy = \
            sandbox, spec, command, workdir, env, proxy
        self.output = _Tail()
        self.episodes = 0
        self.idle_since = time.monotonic()
        self._stop = asyncio.Event()
        self._exec: asyncio.Task | None = None
        self._http = None
        self._link_dir: str | None = None
        #: the server's action JSON Schema (its ``GET /schema``), read once it is healthy; ``None``
        #: when it serves none (a server not built on OpenEnv's ``create_app``)
        self.action_schema: dict[str, Any] | None = None

    def alive(self) -> bool:
        return self._exec is not None and not self._exec.done() and not self._stop.is_set()

    def tail(self) -> str:
        return self.output.since(0).decode("utf-8", errors="replace")[-2000:]

    def _socket(self) -> str:
        """The socket's host path, through a short link when it is longer than a socket
        address may be (108 bytes)."""
        host_path = getattr(self.sandbox, "host_path", None)
        if host_path is None:
            raise EnvironmentBroken(f"the {self.sandbox.provider} provider cannot host OpenEnv environments "
                                    "(its sandboxes have no host directory to reach the server through)")
        path = str(host_path(ENV_SOCKET))
        if len(path.encode()) < 100:
            return path
        self._link_dir = tempfile.mkdtemp(prefix="arena-env-")
        link = os.path.join(self._link_dir, "s")
        os.symlink(path, link)
        return link

    async def start(self) -> None:
        import aiohttp  # the server extra: only the sandbox service hosts environments

        sock = self._socket()
        await self.sandbox.put_files({f"{local.ARENA_DIR}/envhost.py": ENVHOST.read_bytes()})
        argv = ["python3", f"{local.ARENA_DIR}/envhost.py", ENV_SOCKET, str(self.spec.port), "--", *self.command]
        self._exec = asyncio.ensure_future(self.sandbox.exec(
            argv, env=self.env, workdir=self.workdir, timeout_s=SERVER_WALL_CLOCK_S, proxy=self.proxy,
            cancel=self._stop, on_output=self.output))
        self._http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock),
                                           timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        deadline = time.monotonic() + self.spec.ready_timeout_s
        problem = "not started"
        while time.monotonic() < deadline:
            if self._exec.done():
                raise EnvironmentBroken(f"its server exited ({self._exit()}); last output:\n{self.tail()}")
            if os.path.exists(sock):
                try:
                    async with self._http.get("http://env/health", timeout=aiohttp.ClientTimeout(total=5)) as got:
                        if got.status == 200:
                            await self._read_schema()
                            return
                        problem = f"GET /health answered {got.status}"
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    problem = f"GET /health: {type(exc).__name__}: {exc}"
            await asyncio.sleep(0.1)
        raise EnvironmentBroken(f"not healthy within {self.spec.ready_timeout_s:g}s ({problem}); last output:\n"
                                f"{self.tail()}")

    async def _read_schema(self) -> None:
        """The server's action schema (OpenEnv's ``GET /schema``: ``{"action": ..., ...}``), if it serves one."""
        import aiohttp

        try:
            async with self._http.get("http://env/schema", timeout=aiohttp.ClientTimeout(total=10)) as got:
                body = await got.json(content_type=None) if got.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            log.info("hosted environment: no schema from GET /schema (%s: %s)", type(exc).__name__, exc)
            return
        action = body.get("action") if isinstance(body, dict) else None
        self.action_schema = action if isinstance(action, dict) and action else None

    def _exit(self) -> str:
        try:
            ran = self._exec.result()
        except BaseException as exc:  # noqa: BLE001 - a SandboxError, or cancelled
            return f"{type(exc).__name__}: {exc}"
        return f"exit code {ran.exit_code}"

    async def connect(self):
        import aiohttp

        try:
            return await self._http.ws_connect("http://env/ws", max_msg_size=100 * 2**20, heartbeat=None)
        except (aiohttp.ClientError, OSError) as exc:
            raise EnvironmentBroken(f"cannot open its WebSocket /ws: {exc}") from exc

    async def close(self) -> None:
        """Stop the server and destroy its sandbox. Idempotent."""
        if self._http is not None:
            with contextlib.suppress(Exception):
                await self._http.close()
        self._stop.set()
        if self._exec is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._exec, 30)
        if self._link_dir is not None:
            shutil.rmtree(self._link_dir, ignore_errors=True)
        await asyncio.shield(self.sandbox.destroy())


class HostedSession:
    """One episode: a WebSocket to a started :class:`HostedServer`, strictly one frame and its
    answer at a time (OpenEnv's replies carry no ids)."""

    def __init__(self, server: HostedServer):
        self.server = server
        self.spec = server.spec
        self._ws = None
        self._mark = server.output.total
        self._lock = asyncio.Lock()
        self.broken = False

    def log(self) -> bytes:
        return self.server.output.since(self._mark)

    def interrupt(self) -> None:
        self.broken = True  # its connection is mid-frame: the server is never reused

    async def start(self) -> None:
        self._ws = await self.server.connect()

    async def _exchange(self, frame: dict[str, Any]) -> dict[str, Any]:
        import aiohttp

        async with self._lock:
            try:
                await self._ws.send_str(json.dumps(frame))
                msg = await asyncio.wait_for(self._ws.receive(), self.spec.step_timeout_s)
            except asyncio.TimeoutError:
                self.broken = True
                raise EnvironmentBroken(f"no answer within {self.spec.step_timeout_s:g}s") from None
            except (aiohttp.ClientError, ConnectionError) as exc:
                self.broken = True
                raise EnvironmentBroken(f"its WebSocket failed: {exc}") from exc
            if msg.type != aiohttp.WSMsgType.TEXT:
                self.broken = True
                raise EnvironmentBroken(f"its WebSocket closed ({msg.type.name}, {msg.data!r}); last output:\n"
                                        f"{self.server.tail()}")
            try:
                answer = json.loads(msg.data)
            except ValueError as exc:
                self.broken = True
                raise EnvironmentBroken(f"it sent a frame that is not JSON: {exc}") from exc
            if not isinstance(answer, dict) or not isinstance(answer.get("data", {}), dict):
                self.broken = True
                raise EnvironmentBroken(f"it sent a frame OpenEnv does not define: {str(answer)[:200]}")
            return answer

    @staticmethod
    def _reply(answer: dict[str, Any]) -> EnvReply:
        data = answer.get("data") or {}
        if answer.get("type") == "error":
            extra = {k: v for k, v in data.items() if k not in ("code", "message")}
            errors = extra.pop("errors", None)
            return EnvReply(seq=0, error=EnvError(code=str(data.get("code", "EXECUTION_ERROR")),
                                                  message=str(data.get("message", "")),
                                                  errors=errors if isinstance(errors, list) else None))
        if answer.get("type") != "observation":
            raise EnvironmentBroken(f"it answered {answer.get('type')!r} where an observation was due")
        reward = data.get("reward")
        return EnvReply(seq=0, observation=data.get("observation") or {},
                        reward=float(reward) if isinstance(reward, (int, float)) else None, done=bool(data.get("done")))

    async def reset(self, data: dict[str, Any]) -> EnvReply:
        reply = self._reply(await self._exchange({"type": "reset", "data": {**self.spec.reset, **data}}))
        if reply.error is None and self.server.action_schema is not None:
            reply = msgspec.structs.replace(reply, action_schema=self.server.action_schema)
        return reply

    async def step(self, data: dict[str, Any]) -> EnvReply:
        return self._reply(await self._exchange({"type": "step", "data": data}))

    async def state(self) -> dict[str, Any]:
        answer = await self._exchange({"type": "state"})
        if answer.get("type") != "state":
            raise EnvironmentBroken(f"it answered {answer.get('type')!r} to state")
        return answer.get("data") or {}

    async def close(self) -> None:
        """End the episode's connection (the server stays)."""
        if self._ws is not None and not self._ws.closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._ws.send_str(json.dumps({"type": "close"})), 2)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._ws.close(), 2)


def hosted_command(spec: OpenEnvServer, provider: str, image_command: list[str] | None) -> list[str]:
    """What serves the environment on ``127.0.0.1:{port}`` in the sandbox."""
    if spec.command:
        return list(spec.command)
    if provider == "docker":
        if not image_command:
            raise ValueError(f"image {spec.image} has no command (CMD/ENTRYPOINT): give environment.command")
        return image_command
    return ["python", "-m", "uvicorn", spec.app, "--host", "127.0.0.1", "--port", str(spec.port)]


def server_workdir(spec: OpenEnvServer, has_dir: bool, image_workdir: str) -> str:
    """Where the server's command runs, so a relative one (``./serve.sh``, ``python
    app/server.py``) finds its files: the environment's directory (``bundle``/``path``, at
    ``/sandbox/agent``) for a ``command`` of the task's; the image's ``WORKDIR`` for the image's
    own command, or for a command in an image without a directory of the task's; else the
    workspace. A provider that cannot run there refuses (it never runs it elsewhere)."""
    if has_dir and (spec.command or not image_workdir):
        return local.AGENT_DIR
    return image_workdir or local.WORKSPACE


def server_key(spec: OpenEnvServer, image: str, provider: str) -> str:
    """Servers are interchangeable for episodes of the same environment on the same provider."""
    return f"{provider}|{image}|{msgspec.json.encode(spec).decode()}"


class EnvServers:
    """Started servers kept between episodes, per environment: at most ``max_idle`` waiting
    for each and ``max_total`` in all (the longest idle is retired first), each retired after
    ``idle_s`` without an episode. ``reuse: false`` on the environment gives every episode a
    server of its own."""

    def __init__(self, *, max_idle: int = 4, idle_s: float = 300.0, max_total: int | None = None):
        self.max_idle, self.idle_s = max_idle, idle_s
        self.max_total = max_total if max_total is not None else max_idle
        self.idle: dict[str, list[HostedServer]] = {}
        self.closed = False
        self._sweeper: asyncio.Task | None = None

    def take(self, key: str) -> HostedServer | None:
        waiting = self.idle.get(key, [])
        while waiting:
            server = waiting.pop()
            if server.alive():
                return server
            asyncio.ensure_future(server.close())
        return None

    async def give(self, key: str, server: HostedServer) -> None:
        """Keep ``server`` for the next episode, or close it (the pool is full or closed, it died)."""
        waiting = self.idle.setdefault(key, [])
        if self.closed or not server.alive() or len(waiting) >= self.max_idle:
            await server.close()
            return
        server.idle_since = time.monotonic()
        waiting.append(server)
        while sum(len(w) for w in self.idle.values()) > self.max_total:  # the longest idle goes
            oldest = min((s for w in self.idle.values() for s in w), key=lambda s: s.idle_since)
            next(w for w in self.idle.values() if oldest in w).remove(oldest)
            await oldest.close()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        while any(self.idle.values()) and not self.closed:
            await asyncio.sleep(min(self.idle_s, 5.0))
            now = time.monotonic()
            for waiting in self.idle.values():
                for server in [s for s in waiting if now - s.idle_since > self.idle_s or not s.alive()]:
                    waiting.remove(server)
                    await server.close()

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        servers = [s for waiting in self.idle.values() for s in waiting]
        self.idle.clear()
        await asyncio.gather(*(s.close() for s in servers), return_exceptions=True)
