"""In-sandbox entry point that makes the LLM proxy reachable on the sandbox's loopback.

``python3 -I -S shim.py PORT SOCKET -- COMMAND [ARG...]`` relays ``127.0.0.1:PORT`` to the Unix
socket SOCKET, runs COMMAND and exits with its code. See docs/sandbox.md ("The sandbox").
It starts once per command, so it imports only C modules (``_socket``, ``_thread``, ``_signal``):
``socket``/``subprocess``/``threading`` cost more than the rest of its start-up.
"""

from __future__ import annotations

import _signal
import _socket
import _thread
import os
import sys

_CHUNK = 65536


def _pump(src, dst) -> None:
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
            dst.shutdown(_socket.SHUT_WR)
        except OSError:
            pass


def _serve_connection(client, socket_path: str) -> None:
    upstream = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        upstream.connect(socket_path)
    except OSError as exc:
        sys.stderr.write(f"arena shim: cannot reach the proxy socket: {exc}\n")
        client.close()
        upstream.close()
        return
    back_done = _thread.allocate_lock()
    back_done.acquire()

    def back() -> None:
        try:
            _pump(upstream, client)
        finally:
            back_done.release()

    _thread.start_new_thread(back, ())
    _pump(client, upstream)
    back_done.acquire()
    client.close()
    upstream.close()


def _accept_loop(listener, socket_path: str) -> None:
    while True:
        try:
            fd, _ = listener._accept()
        except OSError:
            return
        client = _socket.socket(fileno=fd)
        _thread.start_new_thread(_serve_connection, (client, socket_path))


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        sys.stderr.write("usage: shim.py PORT SOCKET -- COMMAND [ARG...]\n")
        return 2
    port, socket_path, command = int(argv[0]), argv[1], argv[3:]
    # The signals to forward, and SIGCHLD, are blocked in every thread (the relay threads inherit
    # it) and taken with sigwaitinfo: none is lost between the command's start and the wait.
    waited = {_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP, _signal.SIGCHLD}
    _signal.pthread_sigmask(_signal.SIG_BLOCK, waited)
    for family, address in ((_socket.AF_INET, "127.0.0.1"), (_socket.AF_INET6, "::1")):
        listener = _socket.socket(family, _socket.SOCK_STREAM)
        listener.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError:
            if family == _socket.AF_INET:
                raise
            listener.close()  # no IPv6 loopback in this sandbox: 127.0.0.1 is enough
            continue
        listener.listen(128)
        _thread.start_new_thread(_accept_loop, (listener, socket_path))
    try:  # the listeners are close-on-exec: the command inherits only stdin/stdout/stderr
        pid = _spawn(command)  # with no signal blocked
    except OSError as exc:
        sys.stderr.write(f"arena shim: cannot run {command[0]!r}: {exc}\n")
        return 127
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        signum = _signal.sigwaitinfo(waited).si_signo
        if signum != _signal.SIGCHLD:
            try:
                os.kill(pid, signum)
            except OSError:
                pass


def _spawn(command: list[str]) -> int:
    """The command's pid (``posix_spawnp``; fork and exec on a Python older than 3.8,
    which an image may ship)."""
    if hasattr(os, "posix_spawnp"):
        return os.posix_spawnp(command[0], command, os.environ, setsigmask=())
    pid = os.fork()
    if pid == 0:
        try:
            _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
            os.execvp(command[0], command)
        except OSError as exc:
            sys.stderr.write(f"arena shim: cannot run {command[0]!r}: {exc}\n")
        os._exit(127)
    return pid


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))  # the relay threads must not delay the exit
