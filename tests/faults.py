"""A TCP relay between the services and nats-server that a test can break: stop forwarding (a
partition: sockets stay open, nothing passes), heal, or write bytes to every client as if the
server had sent them (a protocol error)."""

from __future__ import annotations

import asyncio
import contextlib


class TcpRelay:
    def __init__(self, target_port: int, *, host: str = "127.0.0.1"):
        self.target_port = target_port
        self.host = host
        self.port = 0
        self.partitioned = False
        self._server: asyncio.base_events.Server | None = None
        self._clients: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self.connections = 0

    async def start(self, port: int = 0) -> TcpRelay:
        self._server = await asyncio.start_server(self._accept, self.host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.close()
            return
        self._clients.add(writer)
        pumps = [asyncio.create_task(self._pump(reader, up_writer)), asyncio.create_task(self._pump(up_reader, writer))]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
            self._tasks.discard(task)
        self._clients.discard(writer)
        for w in (writer, up_writer):
            with contextlib.suppress(Exception):
                w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            while self.partitioned:  # a partition: hold everything, close nothing
                await asyncio.sleep(0.05)
            writer.write(data)
            await writer.drain()

    def partition(self) -> None:
        self.partitioned = True

    def heal(self) -> None:
        self.partitioned = False

    async def send_to_clients(self, data: bytes) -> int:
        """Write ``data`` to every connected client, as if from the server; how many got it."""
        sent = 0
        for writer in list(self._clients):
            with contextlib.suppress(Exception):
                writer.write(data)
                await writer.drain()
                sent += 1
        return sent

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for writer in list(self._clients):
            with contextlib.suppress(Exception):
                writer.close()
