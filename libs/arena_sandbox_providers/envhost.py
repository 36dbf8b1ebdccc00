"""Runs an OpenEnv environment server inside a sandbox and makes it reachable from the host.

Shipped into the sandbox and run with the sandbox's own ``python3`` (standard library only):
``python3 envhost.py SOCKET PORT -- COMMAND...`` starts COMMAND (the server, listening on
``127.0.0.1:PORT`` in the sandbox's network namespace) and relays every connection made to
the Unix socket SOCKET (under ``/sandbox/.arena``, a host directory) to that port, byte for
byte. It exits with the server's exit code; SIGTERM stops the server first.
"""

import asyncio
import os
import signal
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


async def _main(sock: str, port: int, command: list[str]) -> int:
    server_proc = await asyncio.create_subprocess_exec(*command)

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    if os.path.lexists(sock):
        os.unlink(sock)
    listener = await asyncio.start_unix_server(relay, path=sock)
    os.chmod(sock, 0o600)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server_proc.terminate)
    code = await server_proc.wait()
    listener.close()
    return code


def main() -> int:
    args = sys.argv[1:]
    if len(args) < 4 or args[2] != "--":
        print("usage: envhost.py SOCKET PORT -- COMMAND...", file=sys.stderr)
        return 2
    return asyncio.run(_main(args[0], int(args[1]), args[3:]))


if __name__ == "__main__":
    sys.exit(main())
