"""Host side of the in-sandbox command server (:mod:`arena_sandbox_providers.cmdserver`).

The provider listens on a Unix socket in the sandbox's relay directory before the
container starts; the container's init (the command server) connects to it. The first
connection from the sandbox user is accepted and the socket is closed and unlinked at
once, so nothing started later in the sandbox can connect or impersonate the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

HEADER = struct.Struct(">cI")
MAX_FRAME = 2**20  # the server sends output in chunks of at most 64 KiB
OutputSink = Callable[[bytes], None]


class ChannelClosed(ConnectionError):
    """The command server is gone (its process, hence the container, ended)."""


def listen(path: Path, *, uid: int) -> socket.socket:
    """A non-blocking listener at ``path`` that only root and ``uid`` may connect to."""
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chown(path, uid, uid)
        os.chmod(path, 0o600)
        listener.listen(1)
        listener.setblocking(False)
    except OSError:
        listener.close()
        raise
    return listener


def run_payload(argv: list[str], env: Mapping[str, str], cwd: str) -> bytes:
    fields = [cwd, str(len(argv)), *argv, *(f"{k}={v}" for k, v in env.items())]
    for field in fields:
        if "\0" in field:
            raise ValueError(f"NUL byte in a command, environment or directory: {field!r}")
    return b"\0".join(os.fsencode(f) for f in fields)


class Channel:
    """One connection to a command server: run commands one at a time, kill, quit."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer_pid: int):
        self._reader = reader
        self._writer = writer
        self.peer_pid = peer_pid  # the server's pid on this host (0: not visible here)
        self.closed = False
        self._reading = asyncio.Lock()  # one reader of the input at a time (a run, or quit)

    @classmethod
    async def accept(cls, listener: socket.socket, path: Path, *, uid: int, timeout_s: float,
                     alive: Callable[[], Awaitable[str | None]],
                     peer_ok: Callable[[int], bool] | None = None) -> Channel:
        """Wait for the server's connection (``alive()`` returns why the container is
        gone, checked every second), then stop listening. A connection is the server's
        if its peer runs as ``uid`` and ``peer_ok(its pid)`` holds (a host process of
        the same uid can reach the socket too); any other is closed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while True:
                try:
                    conn, _ = await asyncio.wait_for(loop.sock_accept(listener), 1.0)
                except asyncio.TimeoutError:
                    if (reason := await alive()) is not None:
                        raise ChannelClosed(f"the sandbox stopped before its command server connected: {reason}")
                    if loop.time() > deadline:
                        raise ChannelClosed(f"the command server did not connect within {timeout_s:.0f}s") from None
                    continue
                pid, peer_uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                if peer_uid == uid and (peer_ok is None or peer_ok(pid)):
                    break
                conn.close()  # not the sandbox's server: never ours
        finally:
            listener.close()
            path.unlink(missing_ok=True)
        reader, writer = await asyncio.open_unix_connection(sock=conn, limit=2**20)
        return cls(reader, writer, pid)

    async def alive(self) -> bool:
        """False once the server is known to be gone (after one pass of the event loop,
        so that an end of input already received is seen)."""
        await asyncio.sleep(0)
        if not self.closed and (self._reader.at_eof() or self._writer.is_closing()):
            self.close()
        return not self.closed

    def _send(self, kind: bytes, payload: bytes = b"") -> None:
        if self.closed:
            raise ChannelClosed("the command server is gone")
        self._writer.write(HEADER.pack(kind, len(payload)) + payload)

    async def run(self, argv: list[str], env: Mapping[str, str], cwd: str,
                  on_stdout: OutputSink, on_stderr: OutputSink) -> int:
        """Run one command; its exit code (``128 + N`` for signal N). Raises
        :class:`ChannelClosed` if the server goes away first."""
        self._send(b"X", run_payload(argv, env, cwd))
        async with self._reading:
            return await self._read_run(on_stdout, on_stderr)

    async def _read_run(self, on_stdout: OutputSink, on_stderr: OutputSink) -> int:
        try:
            await self._writer.drain()
            while True:
                kind, size = HEADER.unpack(await self._reader.readexactly(HEADER.size))
                if size > MAX_FRAME:
                    raise ChannelClosed(f"oversized frame ({size} bytes) from the command server")
                data = await self._reader.readexactly(size)
                if kind == b"O":
                    on_stdout(data)
                elif kind == b"E":
                    on_stderr(data)
                elif kind == b"R":
                    return int(data)
                else:
                    raise ChannelClosed(f"unexpected frame {kind!r} from the command server")
        except ChannelClosed:
            self.close()
            raise
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:  # ValueError: a bad exit code
            self.close()
            raise ChannelClosed(f"the command server is gone: {exc}") from exc

    def kill(self) -> None:
        """SIGKILL every process in the sandbox but the server (the running command's
        ``run`` then returns 137)."""
        with contextlib.suppress(ChannelClosed, ConnectionError):
            self._send(b"K")

    async def quit(self, timeout_s: float) -> bool:
        """Kill everything in the sandbox and let the server exit (so the container
        stops); True once it has closed its end, i.e. nothing runs in the sandbox. A
        command running meanwhile ends: its ``run`` raises :class:`ChannelClosed`."""

        async def until_end() -> None:
            async with self._reading:  # after a running command's run, which reads until then
                await self._reader.read()

        try:
            self._send(b"Q")
            await asyncio.wait_for(until_end(), timeout_s)
            return True
        except (ChannelClosed, ConnectionError, asyncio.TimeoutError):
            return False
        finally:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._writer.close()
