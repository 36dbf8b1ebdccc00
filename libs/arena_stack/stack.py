"""The embedded stack behind ``arena up``: nats-server (or a cluster of them, ``--cluster``),
the four services and the dashboard, optionally the scripted LLM, each a child process,
started in order, health-checked, stopped by PID. The bus has a user per service
(``natsauth``, passwords kept in ``<data_dir>/nats-users.json``), the APIs ask for keys
unless ``ARENA_AUTH=off``, and everything under the data directory is this user's only.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import fcntl
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import msgspec

from arena_core import apikeys, subjects
from arena_core.settings import Settings
from arena_stack import natsauth, ports, topology
from arena_stack.natsserver import DEFAULT_SYNC, NatsCluster, NatsServer, free_port, private_dir, wait_port

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Child pre-exec: receive SIGTERM if the supervisor dies, so nothing is orphaned."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


SERVICES = (
    ("trajectory", "arena_trajectory"),
    ("verification", "arena_verification"),
    ("sandbox", "arena_sandbox"),
    ("rollout", "arena_rollout"),
    ("dashboard", "arena_dashboard"),  # reads the trajectory API and NATS events; nothing waits for it
)


def free_port_settings(data_dir: Path | str, **overrides) -> Settings:
    """Settings of a stack on free ports of this machine (NATS, the rollout API and proxy, the
    trajectory API, a scripted backend's address), its data under ``data_dir``: what tests and
    benchmarks start beside others. ``overrides``: any other settings."""
    rollout_port = overrides.pop("rollout_port", None) or free_port()
    base = dict(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data_dir), rollout_port=rollout_port,
                trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rollout_port}",
                backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0")
    return Settings(**{**base, **overrides})


#: A child (nats-server included) that fails again after ``MAX_RESTARTS`` restarts within
#: ``RESTART_WINDOW_S`` seconds stops the stack (``Stack.supervise`` raises ``StackError`` with
#: its last log lines; ``arena up`` exits non-zero) instead of restarting forever.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0

#: Under the data directory: held (``fcntl.flock``) by the stack using it for its lifetime, the
#: holder's PID written in it; a second stack on the same directory refuses to start.
LOCK_FILE = "stack.lock"


class StackError(RuntimeError):
    """A component did not start, or this stack cannot own what it needs (a port, the data
    directory); the message names it and its holder, or points at its log."""


def hold_data_dir(data_dir: Path) -> int:
    """The descriptor of ``<data_dir>/stack.lock``, locked (exclusive, for as long as it stays
    open) with this process's PID written in it; ``StackError`` naming the holder's PID if
    another stack holds it. Nothing else under ``data_dir`` is touched."""
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        cmd = ports.command(int(pid)) if pid.isdigit() else ""
        raise StackError(f"the data directory {data_dir} is in use by another stack (pid {pid or 'unknown'}"
                         f"{f', {cmd}' if cmd else ''}; {data_dir / LOCK_FILE}): stop it, or choose another "
                         "ARENA_DATA_DIR") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of the log at ``path`` ("" if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path):
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        #: ``/healthz`` of the child, if it has one; the supervisor restarts it on a lasting 503
        self.health_url: str | None = None
        self.restarts = 0

    def start(self) -> None:
        """Start it, its log this user's only. Its umask stays: a sandbox provider shares files
        with containers running as other users; the data directory (0700) keeps others out."""
        private_dir(self.log_path.parent)
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 15) -> str:
        return _tail(self.log_path, lines)

    def stop(self, timeout: float = 15.0) -> int | None:
        self.terminate()
        return self.wait(timeout)

    def terminate(self) -> None:
        """SIGTERM, if it runs (``wait`` then reaps it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 15.0) -> int | None:
        """Its exit code, SIGKILLing it if it has not exited ``timeout`` s after ``terminate``."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode


class Stack:
    """Start with ``await stack.start()``, stop with ``stack.stop()`` (or ``async with``)."""

    def __init__(self, settings: Settings, *, llm_script: str | Path | None = None,
                 nats_sync: str = DEFAULT_SYNC, log=print, separate_data_dirs: bool = False,
                 nats_port: int | None = None, nats_cluster: int = 0):
        """``nats_port``: where nats-server listens when the services reach it elsewhere
        (``settings.nats_url`` through a proxy or relay); default the port of that URL.

        ``nats_cluster``: start that many nats-servers as one JetStream cluster instead of one
        server (under ``<data_dir>/nats-cluster``): node 0 on ``nats_port`` or the port of
        ``settings.nats_url`` (or, when that URL lists ``nats_cluster`` servers, each on its
        own), the others on free ports; the services get every node's URL
        (``ARENA_NATS_URL=nats://a,nats://b,...``) and ``ARENA_NATS_REPLICAS`` = the node
        count (at most 5, JetStream's limit) unless ``settings.nats_replicas`` asks for another.

        The bus always has one user per service, each allowed only its own subjects
        (``arena_stack.natsauth``; every node of a cluster the same users, its routes their own
        password), with passwords kept in ``<data_dir>/nats-users.json`` (0600) and reused on
        restart: every service gets its own credentials in ``ARENA_NATS_URL``, and
        ``settings.nats_url`` carries the administrator's (for the CLI and tests).

        Unless ``settings.auth`` is ``off``, ``start`` issues an API key for this machine's CLI
        (``api_key``, also in ``<data_dir>/api-key``)."""
        if not settings.judge_key:  # one judge key per run, shared by rollout and verification
            settings = msgspec.structs.replace(settings, judge_key=secrets.token_urlsafe(24))
        if not settings.sandbox_health_port or not settings.verification_health_port:
            settings = msgspec.structs.replace(
                settings, sandbox_health_port=settings.sandbox_health_port or free_port(),
                verification_health_port=settings.verification_health_port or free_port())
        self.data_dir = Path(settings.data_dir).resolve()
        private_dir(self.data_dir)
        #: ``<data_dir>/stack.lock``, held from here until ``stop`` (before any file is written)
        self._lock_fd: int | None = hold_data_dir(self.data_dir)
        try:
            self._init(settings, llm_script, nats_sync, log, separate_data_dirs, nats_port, nats_cluster)
        except BaseException:
            self._release()
            raise

    def _init(self, settings: Settings, llm_script: str | Path | None, nats_sync: str, log,
              separate_data_dirs: bool, nats_port: int | None, nats_cluster: int) -> None:
        #: a password per NATS user (``natsauth.PERMISSIONS``, and the cluster's routes)
        self.nats_passwords: dict[str, str] = natsauth.load_or_create(self.data_dir / natsauth.CREDENTIALS_FILE)
        admin = ("admin", self.nats_passwords["admin"])
        #: the key ``start`` issued for this machine's CLI (None when ``settings.auth`` is ``off``)
        self.api_key: str | None = None
        self.llm_script = Path(llm_script).resolve() if llm_script else None
        #: the cluster when ``nats_cluster``, else None; ``nats`` is then its node 0
        self.nats_cluster: NatsCluster | None = None
        if nats_cluster:
            listed = [u for u in settings.nats_url.split(",") if u.strip()]
            ports = ([urlparse(u.strip()).port or 4222 for u in listed] if len(listed) == nats_cluster else
                     [nats_port or urlparse(listed[0].strip()).port or 4222] + [free_port() for _ in
                                                                                range(nats_cluster - 1)])
            self.nats_cluster = NatsCluster(nats_cluster, self.data_dir / "nats-cluster", ports=ports,
                                            sync=nats_sync, log_dir=self.data_dir / "logs",
                                            authorization=natsauth.authorization_block(self.nats_passwords),
                                            credentials=admin,
                                            route_password=self.nats_passwords[natsauth.ROUTE_USER])
            replicas = settings.nats_replicas if settings.nats_replicas != 1 else min(nats_cluster, 5)
            settings = msgspec.structs.replace(settings, nats_url=self.nats_cluster.url, nats_replicas=replicas)
            self.nats = self.nats_cluster.nodes[0]
        else:
            self.nats = NatsServer(self.data_dir / "nats", nats_port or urlparse(settings.nats_url).port or 4222,
                                   sync=nats_sync, extra_config=natsauth.authorization_block(self.nats_passwords))
        #: NATS as the services reach it (``settings.nats_url``: a relay's, say), without credentials
        self.services_nats_url = settings.nats_url
        settings = msgspec.structs.replace(settings, nats_url=self.nats_url_for("admin"))
        self.settings = settings
        self.children: list[Child] = []
        self.log = log
        #: each service its own data directory (``<data_dir>/services/<name>``), as on
        #: separate machines: nothing passes between them but NATS and HTTP
        self.separate_data_dirs = separate_data_dirs

    async def issue_local_key(self, path: Path | None = None) -> str:
        """An API key (submit, read) for this machine's CLI, written to ``path`` (default
        ``<data_dir>/api-key``, mode 0600); the key."""
        from arena_core.bus import Bus

        bus = await Bus.connect(self.direct_nats_url(), "stack")
        try:
            key, _ = await apikeys.issue(bus, "local-cli", ["submit", "read"])
        finally:
            await bus.close()
        natsauth.write_private(path or self.data_dir / "api-key", key + "\n")
        return key

    async def _wait_key_accepted(self, key: str, timeout: float) -> None:
        """Until the APIs know ``key`` (each follows the keys' bucket): a guarded route answers
        neither 401 (unknown key) nor 503 (keys not loaded yet)."""
        deadline = time.monotonic() + timeout
        headers = apikeys.auth_headers(key)
        async with httpx.AsyncClient(timeout=1.0) as http:
            for base in (self.settings.rollout_url, self.settings.trajectory_url):
                while True:
                    try:
                        status = (await http.get(f"{base}/v1/arena-stack-key-check", headers=headers)).status_code
                    except httpx.HTTPError:
                        status = 503
                    if status not in (401, 503):
                        break
                    if time.monotonic() > deadline:
                        raise StackError(f"{base} does not accept the key issued for the CLI after {timeout}s "
                                         f"(answers {status})")
                    await asyncio.sleep(0.05)

    @property
    def dashboard_url(self) -> str:
        """The web dashboard (``arena_dashboard``) as this host reaches it."""
        return f"http://{self.settings.host}:{self.settings.dashboard_port}"

    def _no_dashboard(self) -> str | None:
        """Why the dashboard cannot start here, if it cannot: it is the one optional child (the
        stack works without it), so a busy port (another stack on this host) is reported, not fatal."""
        port = self.settings.dashboard_port
        if why := ports.busy(self.settings.host, port):
            return f"port {port} is in use by {ports.describe(port)} ({why}; ARENA_DASHBOARD_PORT)"
        return None

    def ports_needed(self) -> list[tuple[str, int, str]]:
        """(host, port, what sets it) of every port this stack's children will listen on but
        the dashboard's (optional: ``_no_dashboard``) and those picked free for the cluster."""
        host = self.settings.host
        needed = [(node.host, node.port, "ARENA_NATS_URL") for node in self.nats_nodes]
        needed += [(host, self.settings.rollout_port, "ARENA_ROLLOUT_PORT"),
                   (host, self.settings.trajectory_port, "ARENA_TRAJECTORY_PORT"),
                   (host, self.settings.sandbox_health_port, "ARENA_SANDBOX_HEALTH_PORT"),
                   (host, self.settings.verification_health_port, "ARENA_VERIFICATION_HEALTH_PORT")]
        if self.settings.proxy_port:  # the rollout service's proxy-only listener (sandboxes elsewhere)
            needed.append((host, self.settings.proxy_port, "ARENA_PROXY_PORT"))
        if self.llm_script is not None:
            backend = urlparse(self.settings.backend_url)
            needed.append((backend.hostname or "127.0.0.1", backend.port or 80, "ARENA_BACKEND_URL, the scripted LLM"))
        return needed

    def refuse_busy_ports(self) -> None:
        """``StackError`` (one line) naming every needed port that is in use and its holder."""
        busy = [f"port {port} ({what}) is in use by {ports.describe(port)}"
                for host, port, what in self.ports_needed() if ports.busy(host, port)]
        if busy:
            raise StackError("; ".join(busy) + ": stop it, or choose other ports")

    def _check_owner(self, name: str, port: int, pid: int | None) -> None:
        """``StackError`` if the process listening on ``port`` is visible and is not ``pid``
        (the child started for ``name``) or one of its descendants: another stack answered."""
        held_by = ports.holder(port)
        if held_by is not None and pid is not None and not ports.descends_from(held_by, pid):
            raise StackError(f"port {port} answers for {name} from {ports.describe(port)}, not from the "
                             f"{name} this stack started (pid {pid})")

    @property
    def dashboard_started(self) -> bool:
        return any(c.name == "dashboard" for c in self.children)

    def direct_nats_url(self) -> str:
        """This stack's NATS (the cluster's nodes) as it reaches them itself, as the administrator."""
        url = self.nats_cluster.url if self.nats_cluster is not None else self.nats.url
        return natsauth.with_user(url, "admin", self.nats_passwords["admin"])

    def nats_url_for(self, user: str) -> str:
        """This stack's NATS as the services reach it (every node of a cluster) with ``user``'s
        credentials (a service, ``trainer`` or ``admin``; ``natsauth.PERMISSIONS``)."""
        return natsauth.with_user(self.services_nats_url, user, self.nats_passwords[user])

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.settings.to_env())
        # no credentials but a service's own (``start`` gives each its user)
        env["ARENA_NATS_URL"] = self.services_nats_url
        env["ARENA_DATA_DIR"] = str(self.data_dir)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    async def start(self, timeout: float = 60.0) -> Stack:
        """Start everything, once every port it needs is free (else ``StackError``, nothing started)."""
        if self._lock_fd is None:  # started again after ``stop``
            self._lock_fd = hold_data_dir(self.data_dir)
        private_dir(self.data_dir)
        try:
            self.refuse_busy_ports()
        except StackError:
            self._release()
            raise
        logs = private_dir(self.data_dir / "logs")
        if self.settings.auth == "off":
            self.log(f"WARNING: ARENA_AUTH=off: the APIs on {self.settings.host} ask for no key; anyone who "
                     "reaches them may use them")
        try:
            if self.nats_cluster is not None:
                await asyncio.to_thread(self.nats_cluster.start, timeout)
                for node in self.nats_cluster.nodes:
                    self.log(f"nats-server     {node.url} ({node.server_name}, pid {node.proc.pid}, "
                             f"JetStream in {node.store_dir})")
                self.log(f"nats cluster    {self.nats_cluster.name}: {len(self.nats_cluster.nodes)} nodes, meta leader "
                         f"{self.nats_cluster.meta_leader()}, replicas {self.settings.nats_replicas}")
            else:
                self.nats.log_file = logs / "nats-server.log"
                self.nats.start()
                self._check_owner("nats-server", self.nats.port, self.nats.proc.pid)
                self.log(f"nats-server     {self.nats.url} (pid {self.nats.proc.pid}, JetStream in {self.nats.store_dir})")
            # the topology step, as the administrator: the services' users only bind to it
            await topology.create(self.direct_nats_url(), self.settings.nats_replicas)
            if self.llm_script is not None:
                backend = urlparse(self.settings.backend_url)
                child = Child("scripted-llm", [sys.executable, "-m", "arena_stack.scripted_llm", "--script",
                                               str(self.llm_script), "--host", backend.hostname or "127.0.0.1",
                                               "--port", str(backend.port or 80)],
                              self.env(), logs / "scripted-llm.log")
                child.start()
                self.children.append(child)
                await asyncio.to_thread(self._wait_port, child, backend.hostname or "127.0.0.1", backend.port or 80,
                                        timeout)
                self._check_owner(child.name, backend.port or 80, child.pid)
                self.log(f"scripted LLM    {self.settings.backend_url} (pid {child.pid})")
            for name, module in SERVICES:
                env = self.env()
                if name == "dashboard" and (why := self._no_dashboard()):
                    self.log(f"{name:<15} not started: {why}")
                    continue
                env["ARENA_NATS_URL"] = self.nats_url_for(name)
                if self.separate_data_dirs:
                    env["ARENA_DATA_DIR"] = str(private_dir(self.data_dir / "services" / name))
                child = Child(name, [sys.executable, "-m", module], env, logs / f"{name}.log")
                child.health_url = self.health_urls().get(name) or (
                    f"{self.dashboard_url}/healthz" if name == "dashboard" else None)
                child.start()
                self.children.append(child)
            await self._wait_healthy(timeout)
            if apikeys.enforced(self.settings.auth, self.settings.host):
                self.api_key = await self.issue_local_key()
                await self._wait_key_accepted(self.api_key, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def health_urls(self) -> dict[str, str]:
        host = f"http://{self.settings.host}"
        return {"rollout": f"{self.settings.rollout_url}/healthz",
                "trajectory": f"{self.settings.trajectory_url}/healthz",
                "sandbox": f"{host}:{self.settings.sandbox_health_port}/healthz",
                "verification": f"{host}:{self.settings.verification_health_port}/healthz"}

    async def supervise(self, stop: asyncio.Event, *, interval: float = 1.0, unhealthy_after: float = 10.0,
                        max_backoff: float = 30.0, max_restarts: int = MAX_RESTARTS,
                        restart_window: float = RESTART_WINDOW_S) -> None:
        """Until ``stop``: restart nats-server (on the same store) or a child that exits, and a
        child whose ``/healthz`` answers 503 for ``unhealthy_after`` seconds; each restart of
        the same child waits twice as long as the one before (up to ``max_backoff``), and a
        child that stayed up for a minute starts again from one second. One that fails again after
        ``max_restarts`` restarts within ``restart_window`` seconds raises ``StackError`` with
        its last log lines (the caller stops the stack)."""
        unhealthy_since: dict[str, float] = {}
        next_try: dict[str, float] = {}
        started: dict[str, float] = {c.name: time.monotonic() for c in self.children}
        restarted: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)

        def count_restart(name: str, why: str, log_path: Path, tail: str) -> None:
            times = restarted[name]
            while times and time.monotonic() - times[0] > restart_window:
                times.popleft()
            if len(times) >= max_restarts:
                raise StackError(f"{name} {why} after {len(times)} restarts within {restart_window:.0f} s; "
                                 f"stopping the stack. Last lines of {log_path}:\n{tail}")
            times.append(time.monotonic())
        async with httpx.AsyncClient(timeout=2.0) as http:
            while not stop.is_set():
                now = time.monotonic()
                for i, node in enumerate(self.nats_nodes):
                    key = f"nats-{i}"
                    if node.proc is None or node.proc.poll() is None or now < next_try.get(key, 0):
                        continue
                    name = f"nats-server {node.server_name}".rstrip()
                    count_restart(name, f"exited with code {node.proc.returncode}", node.log_file,
                                  _tail(node.log_file))
                    self.log(f"{name} exited with code {node.proc.returncode}; restarting on {node.store_dir}")
                    try:
                        if self.nats_cluster is not None:
                            await asyncio.to_thread(self.nats_cluster.start_node, i)
                        else:
                            await asyncio.to_thread(node.start)
                    except Exception as exc:  # noqa: BLE001 - try again later
                        self.log(f"{name} did not start again: {exc}")
                        next_try[key] = now + 5.0
                for child in list(self.children):
                    reason = None
                    if not child.alive():
                        reason = f"exited with code {child.proc.returncode if child.proc else None}"
                    elif child.health_url is not None:
                        try:
                            bad = (await http.get(child.health_url)).status_code == 503
                        except httpx.HTTPError:
                            bad = False  # not answering at all: busy or starting; exits are caught above
                        if bad:
                            since = unhealthy_since.setdefault(child.name, now)
                            if now - since >= unhealthy_after:
                                reason = f"answered 503 on /healthz for {now - since:.0f} s"
                        else:
                            unhealthy_since.pop(child.name, None)
                    if reason is None or now < next_try.get(child.name, 0):
                        continue
                    if now - started.get(child.name, now) > 60:
                        child.restarts = 0
                    count_restart(child.name, reason, child.log_path, child.tail())
                    delay = min(2.0 ** child.restarts, max_backoff)
                    child.restarts += 1
                    self.log(f"{child.name} {reason}; restarting (restart {child.restarts}; next no sooner "
                             f"than {delay:.0f} s). Last log lines:\n{child.tail(5)}")
                    await asyncio.to_thread(child.stop, 10.0)
                    child.start()
                    started[child.name] = time.monotonic()
                    unhealthy_since.pop(child.name, None)
                    next_try[child.name] = time.monotonic() + delay
                try:
                    await asyncio.wait_for(stop.wait(), interval)
                except asyncio.TimeoutError:
                    pass

    @property
    def nats_nodes(self) -> list[NatsServer]:
        """The nats-servers this stack runs: one, or the cluster's nodes."""
        return list(self.nats_cluster.nodes) if self.nats_cluster is not None else [self.nats]

    def _wait_port(self, child: Child, host: str, port: int, timeout: float) -> None:
        try:
            wait_port(host, port, timeout, child.proc)
        except (TimeoutError, RuntimeError) as exc:
            raise StackError(f"{child.name} did not start: {exc}\n--- {child.log_path} ---\n{child.tail()}") from None

    async def _wait_healthy(self, timeout: float) -> None:
        from arena_core.bus import Bus

        deadline = time.monotonic() + timeout
        urls = {"rollout": f"{self.settings.rollout_url}/healthz",
                "trajectory": f"{self.settings.trajectory_url}/healthz",
                "dashboard": f"{self.dashboard_url}/healthz"}
        first_provider = self.settings.sandbox_provider.split(",")[0].strip()  # "local,docker": one consumer each
        durables = {"sandbox": ("ARENA_SANDBOX_JOBS", subjects.CONSUMER_SANDBOX.format(provider=first_provider)),
                    "verification": ("ARENA_VERIFY_JOBS", subjects.CONSUMER_VERIFIER)}
        pending = {c.name for c in self.children if c.name in urls or c.name in durables}
        bus = await Bus.connect(self.direct_nats_url(), "stack")
        try:
            async with httpx.AsyncClient(timeout=1.0) as http:
                while pending:
                    for child in list(self.children):
                        if not child.alive() and child.name == "dashboard":  # optional: lost its port, say
                            self._drop_dashboard(child, f"exited with code {child.proc.returncode} (log: "
                                                        f"{child.log_path})")
                            pending.discard(child.name)
                        elif not child.alive():
                            raise StackError(f"{child.name} exited with code {child.proc.returncode}\n"
                                             f"--- {child.log_path} ---\n{child.tail()}")
                    for name in list(pending):
                        try:
                            if name in urls:
                                ok = (await http.get(urls[name])).status_code == 200
                            else:
                                await bus.js.consumer_info(*durables[name])
                                ok = True
                        except Exception:  # noqa: BLE001 - not up yet
                            ok = False
                        if ok:
                            pending.discard(name)
                            child = next(c for c in self.children if c.name == name)
                            try:
                                if name in urls:
                                    self._check_owner(name, urlparse(urls[name]).port or 80, child.pid)
                            except StackError as exc:
                                if name != "dashboard":
                                    raise
                                self._drop_dashboard(child, str(exc))
                                continue
                            where = urls.get(name, f"consumer {durables.get(name, ('', ''))[1]}").replace("/healthz", "")
                            self.log(f"{name:<15} {where} (pid {child.pid})")
                    if time.monotonic() > deadline:
                        raise StackError(f"not healthy after {timeout}s: {', '.join(sorted(pending))}")
                    if pending:
                        await asyncio.sleep(0.1)
        finally:
            await bus.close()

    def _drop_dashboard(self, child: Child, why: str) -> None:
        """The dashboard (optional) did not come up as this stack's own: stopped, reported, left out."""
        child.stop(5.0)
        self.children.remove(child)
        self.log(f"{child.name:<15} not started: {why}")

    def stop(self) -> None:
        """Every child but the trajectory service at once (each drains in parallel), then the
        trajectory service, which stores what they published last, then nats-server."""
        last = [c for c in self.children if c.name == "trajectory"]
        for phase in ([c for c in self.children if c not in last], last):
            for child in phase:
                child.terminate()
            for child in phase:
                code = child.wait()
                if code not in (None, 0, -signal.SIGTERM):
                    self.log(f"{child.name} exited with code {code} (log: {child.log_path})")
        self.children.clear()
        if self.nats_cluster is not None:
            self.nats_cluster.stop()
        else:
            self.nats.stop()
        self._release()

    def _release(self) -> None:
        """Let go of the data directory (``LOCK_FILE``): another stack may use it now."""
        if getattr(self, "_lock_fd", None) is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self) -> None:
        self._release()  # a stack dropped without ``stop``: its directory is free again

    async def __aenter__(self) -> Stack:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        self.stop()
