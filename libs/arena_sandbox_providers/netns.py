"""The local sandbox's network namespace made by the service, with the proxy relay's listeners in it.

The sandbox's first process is spawned inside it (``inside``: the spawning thread enters it for
the spawn and comes back), so bwrap starts in it and keeps it instead of making its own (no
``nsenter`` between: its exec was ~0.9 ms of CPU per command): the agent finds the proxy on its
loopback with no relay process inside the sandbox (the shim's Python start is most of a short
command's cost). Needs CAP_SYS_ADMIN (a service run as root) and pidfds (Linux 5.3) to await
that process; elsewhere the shim relays. See docs/sandbox.md ("The sandbox").
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import functools
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sh22x"  # struct ifreq: the name, then ifr_flags (the union is 24 bytes)


class SandboxNet:
    """A network namespace with only loopback (up), held open by ``fd``, and the listening
    sockets bound in it (``127.0.0.1:port``, and ``[::1]:port`` when it has IPv6)."""

    def __init__(self, fd: int, listeners: list[socket.socket]):
        self.fd = fd
        self.listeners = listeners

    def close(self) -> None:
        """Close the listeners and the namespace (the kernel frees it with its last user)."""
        for listener in self.listeners:
            listener.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _make(port: int) -> SandboxNet:
    """In a thread of its own, which ends in the new namespace: no other thread ever leaves its own."""
    if _libc().unshare(_CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    listeners: list[socket.socket] = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as ctl:
            flags = struct.unpack(_IFREQ, fcntl.ioctl(ctl, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
            fcntl.ioctl(ctl, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
        for family, address in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((address, port))
            except OSError:
                listener.close()
                if family == socket.AF_INET:
                    raise
                continue  # no IPv6 here: 127.0.0.1 is enough
            listener.listen(128)
            listener.setblocking(False)
            listeners.append(listener)
    except BaseException:
        SandboxNet(fd, listeners).close()
        raise
    return SandboxNet(fd, listeners)


async def create(port: int) -> SandboxNet:
    """A new namespace with the relay's listeners on ``port``; raises ``OSError`` if it cannot."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[SandboxNet] = loop.create_future()

    def work() -> None:
        try:
            net = _make(port)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(_settle, done, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, done, net, None)

    threading.Thread(target=work, name="arena-netns", daemon=True).start()
    return await done


def _settle(future: asyncio.Future, net: SandboxNet | None, exc: BaseException | None) -> None:
    if future.cancelled():  # the caller went away: nobody else will close it
        if net is not None:
            net.close()
    elif exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(net)


def inside(net: SandboxNet, fn: Callable[[], T]) -> T:
    """``fn()`` called with this thread in ``net``'s namespace: a process it spawns (a fork
    copies the calling thread) is born there. Keep ``fn`` synchronous: nothing else may run on
    this thread meanwhile (a socket it opened would be the sandbox's). The thread is back in its
    own namespace when this returns or raises; if the kernel refused that, the process exits
    rather than go on serving from the sandbox's namespace."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc().setns(net.fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the sandbox's network namespace: {os.strerror(err)}")
        try:
            return fn()
        finally:
            if _libc().setns(home, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                sys.stderr.write(f"arena: cannot leave a sandbox's network namespace ({os.strerror(err)}): exiting\n")
                os._exit(70)
    finally:
        os.close(home)


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` if this process can make a sandbox's network namespace and await a process
    spawned in it through a pidfd, else the reason (the shim relays then)."""
    if not hasattr(os, "pidfd_open"):
        return "no os.pidfd_open (Python on Linux 5.3 or later)"
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError as exc:
        return f"no pidfds: {exc}"
    result: list[BaseException | SandboxNet] = []
    thread = threading.Thread(target=lambda: result.append(_try(_make, 0)), daemon=True)
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        return f"cannot make a network namespace: {result[0]}"
    net = result[0]
    try:
        inside(net, lambda: None)
    except OSError as exc:
        return f"cannot enter a network namespace: {exc}"
    finally:
        net.close()
    return None


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return exc

