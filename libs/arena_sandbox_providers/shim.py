"""In-sandbox entry point that makes the LLM proxy reachable on the sandbox's loopback.

``python3 -I -S shim.py PORT SOCKET -- COMMAND [ARG...]`` (stdlib only) relays ``127.0.0.1:PORT``
to the Unix socket SOCKET, runs COMMAND and exits with its code. See docs/sandbox.md ("The sandbox").
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

_CHUNK = 65536


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(_CHUNK)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        # Half-close so the other direction can still finish its response.
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _serve_connection(client: socket.socket, socket_path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(socket_path)
    except OSError as exc:
        sys.stderr.write(f"arena shim: cannot reach the proxy socket: {exc}\n")
        client.close()
        upstream.close()
        return
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _accept_loop(listener: socket.socket, socket_path: str) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_serve_connection, args=(client, socket_path), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: shim.py PORT SOCKET -- COMMAND [ARG...]\n")
        return 2
    port, socket_path, command = int(argv[0]), argv[1], argv[3:]
    for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError:
            if family == socket.AF_INET:
                raise
            listener.close()  # no IPv6 loopback in this sandbox: 127.0.0.1 is enough
            continue
        listener.listen(128)
        threading.Thread(target=_accept_loop, args=(listener, socket_path), daemon=True).start()
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        sys.stderr.write(f"arena shim: cannot run {command[0]!r}: {exc}\n")
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))  # daemon relay threads must not delay the exit
