"""Who holds a TCP port on this host: ``arena up`` refuses a busy port, naming its holder, and
checks that what answers on a port is the child it started (docs/deploy.md, "Embedded").

The holder is found through ``/proc/net/tcp{,6}`` (the listening socket's inode) and
``/proc/<pid>/fd`` (the process with that socket open), or through psutil when there is no
``/proc``; a process of another user stays unnamed (its ``fd`` directory is not readable).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def busy(host: str, port: int) -> str | None:
    """Why ``port`` cannot be bound on ``host`` (as uvicorn and nats-server bind it, with
    ``SO_REUSEADDR``), or None when it is free."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == _LISTEN and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def holder(port: int) -> int | None:
    """The PID of the process listening on ``port``, when this user may see it."""
    inodes = _listening_inodes(port)
    if inodes:
        links = {f"socket:[{inode}]" for inode in inodes}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                for fd in os.scandir(proc / "fd"):
                    if os.readlink(fd.path) in links:
                        return int(proc.name)
            except OSError:  # another user's process, or gone
                continue
        return None
    if Path("/proc/net/tcp").exists():
        return None
    try:
        import psutil
    except ImportError:
        return None
    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except (psutil.Error, OSError):
        pass
    return None


def command(pid: int, width: int = 100) -> str:
    """``pid``'s command line (shortened to ``width``), or "" when it cannot be read."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return ""
    line = " ".join(" ".join(a.decode(errors="replace").split()) for a in argv if a)  # one line
    return line if len(line) <= width else line[: width - 3] + "..."


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (by ``/proc/<pid>/stat``)."""
    seen = 0
    while pid > 1 and seen < 64:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError):
            return False
        seen += 1
    return pid == ancestor


def describe(port: int) -> str:
    """``pid 123 (nats-server -c ...)``, or a note that the holder is not visible."""
    pid = holder(port)
    if pid is None:
        return "a process this user cannot see"
    cmd = command(pid)
    return f"pid {pid}" + (f" ({cmd})" if cmd else "")
