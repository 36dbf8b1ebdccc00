"""The bubblewrap primitive: one ``bwrap`` sandbox per run.

:func:`run` runs one command in a fresh sandbox (host ``/usr`` read-only, ``/sandbox/*``, no network
but the relay to the LLM proxy, uid 1000, limits, a wall clock) and returns only once every process
of it is gone. What a sandbox sees and may do: docs/sandbox.md ("The sandbox").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from arena_core import sources
from arena_sandbox_providers import netns, overlay, priority, relay

log = logging.getLogger("arena.sandbox.local")

BWRAP = shutil.which("bwrap") or "/usr/bin/bwrap"
SHIM = Path(__file__).with_name("shim.py")

WORKSPACE = "/sandbox/workspace"
ARENA_DIR = "/sandbox/.arena"
AGENT_DIR = "/sandbox/agent"
RUN_DIR = "/run/arena"  # per-run host dir (shim, proxy socket), read-only inside
CTL_DIR = "/run/arena-ctl"  # a session sandbox's command server: its code and socket, read-only inside
PROXY_SOCKET = f"{RUN_DIR}/proxy.sock"
SANDBOX_UID = 1000
SANDBOX_GID = 1000

#: Files ignored when :func:`git_diff` collects the agent's changes: interpreter and
#: test-runner caches are never part of a solution.
DIFF_EXCLUDES = ("__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/")

#: Fixed identity and dates for the base commit: the same task gives the same sha.
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "arena",
    "GIT_AUTHOR_EMAIL": "arena@localhost",
    "GIT_COMMITTER_NAME": "arena",
    "GIT_COMMITTER_EMAIL": "arena@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}

_KILL_GRACE_S = 5.0


@functools.lru_cache(maxsize=1)
def run_tmp() -> str:
    """Where each run's host directory goes (relay socket, generated /etc files, a diff's output):
    ``/dev/shm`` where it is a tmpfs this process can write, else the temp directory. A file or
    directory made on a disk file system costs ~0.5 ms of the kernel's CPU each on some hosts
    (ext4 here), on tmpfs ~0.01 ms; a run makes 7 of them."""
    try:
        if ("/dev/shm", "tmpfs") in overlay.mounts() and os.access("/dev/shm", os.W_OK | os.X_OK):
            return "/dev/shm"
    except (OSError, ValueError, IndexError):
        pass
    return tempfile.gettempdir()


class ProxyForward(msgspec.Struct, frozen=True):
    """The LLM proxy on the host; reachable inside as ``127.0.0.1:<inside_port>``.

    ``inside_port`` is ``sandbox_port`` if given, else ``port`` itself, except that a
    privileged port (< 1024), which the unprivileged sandbox user cannot listen on,
    becomes ``10000 + port`` (80 -> 10080).
    """

    host: str
    port: int
    sandbox_port: int | None = None
    #: The rollout's proxy routes (``/proxy/{rollout_id}``): the relay parses HTTP/1.1 and forwards
    #: only the requests for them (:mod:`.relay`), answering anything else 404 itself. None: a plain
    #: TCP relay to host:port (no HTTP; for what is not a rollout's agent).
    routes: str | None = None

    @property
    def inside_port(self) -> int:
        if self.sandbox_port is not None:
            return self.sandbox_port
        return self.port if self.port >= 1024 else 10000 + self.port


class ResourceLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-process limits (``setrlimit``) and the size of the private ``/tmp``.

    There is no process-count limit: ``RLIMIT_NPROC`` counts per host uid and is not
    enforced for a sandbox started by root, so it would give a false sense of safety.
    """

    open_files: int = 4096
    address_space_bytes: int = 16 * 1024**3  # generous: JITs reserve a lot of virtual memory
    file_size_bytes: int = 2 * 1024**3  # largest file (and log) a sandbox can write
    tmp_size_bytes: int = 1024**3
    #: The sandbox's nice level (:mod:`.priority`); 0 = the service's own.
    nice: int = 0


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One sandboxed command."""

    command: list[str]
    workspace: Path  # host dir bound read-write at /sandbox/workspace
    arena_dir: Path | None = None  # host dir bound read-write at /sandbox/.arena
    agent_dir: Path | None = None  # host dir bound read-only at /sandbox/agent
    env: dict[str, str] = {}
    timeout_s: float = 600.0
    proxy: ProxyForward | None = None  # None: no network at all
    log_path: Path | None = None  # stdout+stderr (merged) go here; else discarded
    workdir: str = "."  # working directory, relative to /sandbox/workspace (or an absolute /sandbox/... path)
    limits: ResourceLimits = ResourceLimits()
    #: ``cgroup.procs`` files the sandbox joins before exec (pids/memory/CPU limits).
    cgroup_procs: tuple[str, ...] = ()
    #: Name prefix of the run's host directory in the temp dir (relay socket, shim,
    #: generated /etc files): a provider reaps its own after a crash by it.
    run_prefix: str = "arena-run-"
    #: Host directories bound read-only at their own path (installed agent scaffolds).
    ro_binds: tuple[str, ...] = ()
    #: Relay to ``proxy`` through the in-sandbox shim even where the service can make the
    #: sandbox's network namespace itself (:mod:`.netns`, no relay process inside).
    shim_relay: bool = False
    #: The workspace as an overlay (lower, upper, work) mounted at ``workspace`` in the
    #: sandbox's own mount namespace, never in the service's (:func:`overlay.in_namespace_argv`).
    overlay: tuple[Path, Path, Path] | None = None
    #: The command is the PID namespace's init (bwrap ``--as-pid-1``, no reaper of bwrap's own):
    #: the command server of a sandbox whose commands share one session (``local_provider``).
    as_pid_1: bool = False
    #: A host directory bound read-only at :data:`CTL_DIR` (the command server's socket and code).
    ctl_dir: Path | None = None
    #: ``/logs`` and ``/tests`` as links into ``/sandbox/.arena/harbor`` (``CreateSpec.harbor_layout``).
    harbor_links: bool = False


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """How a sandbox ended.

    ``exit_code`` is the command's exit code (``128 + N`` if it died of signal N), or
    ``None`` when Arena killed it. ``killed`` is true whenever Arena killed it:
    ``timed_out`` says it was the wall clock, otherwise it was a cancel.
    """

    exit_code: int | None
    timed_out: bool
    killed: bool
    duration_s: float
    #: Why an LLM call through the relay was cut on Arena's side (the proxy refused the connection
    #: or broke it before the answer ended), "" if none was.
    proxy_fault: str = ""


# --------------------------------------------------------------------------- availability


@functools.lru_cache(maxsize=1)
def available() -> str | None:
    """``None`` if bubblewrap sandboxes work on this machine, else the reason."""
    if not os.path.exists(BWRAP):
        return f"bubblewrap not found (looked for {BWRAP})"
    with tempfile.TemporaryDirectory(prefix="arena-probe-") as tmp:
        argv = _bwrap_argv(
            SandboxSpec(command=["true"], workspace=Path(tmp)), Path(tmp), shim=None
        )
        try:
            proc = subprocess.run(argv, capture_output=True, timeout=20, env={"PATH": "/usr/bin:/bin"}, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot run bubblewrap: {exc}"
    if proc.returncode != 0:
        return f"bubblewrap failed (exit {proc.returncode}): {proc.stderr.decode(errors='replace').strip()}"
    return None


# --------------------------------------------------------------------------- command line


@functools.lru_cache(maxsize=1)
def _python_roots() -> tuple[str, ...]:
    """Directories holding the Python this service runs on (venv and base install); resolved
    once (five ``realpath``s, ~50 us, for every command otherwise)."""
    candidates = {
        sys.prefix,
        sys.exec_prefix,
        sys.base_prefix,
        sys.base_exec_prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
    }
    roots: list[str] = []
    for path in sorted(os.path.realpath(c) for c in candidates):
        if path in ("/", "/usr") or path.startswith("/usr/"):
            continue  # already visible through /usr
        if any(path == r or path.startswith(r + "/") for r in roots):
            continue
        roots.append(path)
    return tuple(roots)


def _venv_bin() -> str:
    return os.path.join(sys.prefix, "bin")


def _base_env() -> dict[str, str]:
    return {
        "PATH": f"{_venv_bin()}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        # keep bytecode out of the workspace, while every program still reads the bytecode installed
        # beside its sources (a cache prefix would recompile every module each Python program imports)
        "PYTHONDONTWRITEBYTECODE": "1",
    }


@functools.lru_cache(maxsize=1)
def _root_entries() -> tuple[str, ...]:
    """The top-level links or dirs (/bin, /lib, /lib64, ...) that point into /usr (looked up
    once: the host's layout does not change under a running service)."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return tuple(args)


def _write_run_files(run_dir: Path) -> list[str]:
    """Generated /etc files, and the diff excludes at /run/arena/excludes."""
    (run_dir / "excludes").write_text("".join(f"{p}\n" for p in DIFF_EXCLUDES))
    etc = run_dir / "etc"
    etc.mkdir()
    (etc / "passwd").write_text(
        f"root:x:0:0:root:/tmp:/bin/sh\nsandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:/tmp:/bin/sh\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (etc / "group").write_text(f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n")
    (etc / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    (etc / "nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files\n")  # no DNS
    args: list[str] = []
    for name in ("passwd", "group", "hosts", "nsswitch.conf"):
        args += ["--ro-bind", str(etc / name), f"/etc/{name}"]
    for host_file in ("/etc/ld.so.cache", "/etc/alternatives"):
        if os.path.exists(host_file):
            args += ["--ro-bind", host_file, host_file]
    return args


def validate_env(env: dict[str, str]) -> None:
    """Raise ``ValueError`` for a variable name or value the sandbox cannot take."""
    for name, value in env.items():
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ValueError(f"invalid environment variable {name!r}")


@functools.lru_cache(maxsize=1)
def _userns_args() -> tuple[str, ...]:
    """``--disable-userns`` where bwrap has it (0.8 and later): nothing in the sandbox
    can create a user namespace, in which it would hold every capability again (the
    kernel's largest attack surface for an unprivileged process). Older bwrap: none."""
    try:
        out = subprocess.run([BWRAP, "--help"], capture_output=True, timeout=20, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return ("--unshare-user", "--disable-userns") if b"--disable-userns" in out else ()


def _bwrap_argv(spec: SandboxSpec, run_dir: Path, *, shim: tuple[int, str] | None, net: bool = False) -> list[str]:
    """The bwrap command line. The sandbox's environment is set with ``--setenv`` on
    top of ``--clearenv``, never in bwrap's own environment: bwrap runs on the host,
    where a variable such as ``LD_PRELOAD`` from a task must have no effect.

    ``net``: bwrap starts in a network namespace made for the sandbox (:mod:`.netns`) and
    keeps it, instead of making a new empty one of its own."""
    env = _base_env() | dict(spec.env)
    validate_env(env)
    # --unshare-all but the network when it starts in the sandbox's own
    unshare = ["--unshare-all"] if not net else [
        "--unshare-user-try", "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
    argv = [
        BWRAP,
        *unshare,
        *_userns_args(),
        "--die-with-parent",
        "--new-session",
        "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr",
        *_root_entries(),
        # the private /tmp comes before the Python binds: a venv that lives under the
        # host's /tmp (a CI checkout) must stay visible on top of it
        "--size", str(spec.limits.tmp_size_bytes), "--tmpfs", "/tmp",
    ]
    for root in _python_roots():
        argv += ["--ro-bind", root, root]
    for path in spec.ro_binds:
        argv += ["--ro-bind", path, path]
    argv += _write_run_files(run_dir)
    argv += [
        "--proc", "/proc",
        "--dev", "/dev",
        "--bind", str(spec.workspace), WORKSPACE,
    ]
    if spec.arena_dir is not None:
        argv += ["--bind", str(spec.arena_dir), ARENA_DIR]
        if spec.harbor_links:
            argv += ["--symlink", f"{ARENA_DIR}/harbor/logs", "/logs",
                     "--symlink", f"{ARENA_DIR}/harbor/tests", "/tests"]
    if spec.agent_dir is not None:
        argv += ["--ro-bind", str(spec.agent_dir), AGENT_DIR]
    argv += ["--ro-bind", str(run_dir), RUN_DIR]
    if spec.ctl_dir is not None:
        argv += ["--ro-bind", str(spec.ctl_dir), CTL_DIR]
    argv.append("--clearenv")
    for name, value in env.items():
        argv += ["--setenv", name, value]
    if spec.as_pid_1:
        argv.append("--as-pid-1")
    argv += [
        "--remount-ro", "/",
        "--chdir", os.path.normpath(os.path.join(WORKSPACE, spec.workdir)),
        "--uid", str(SANDBOX_UID),
        "--gid", str(SANDBOX_GID),
        "--",
    ]
    if shim is not None:
        port, socket_path = shim
        argv += [os.path.join(_venv_bin(), "python3"), "-I", "-S", f"{RUN_DIR}/shim.py",
                 str(port), socket_path, "--"]
    if spec.limits.nice > 0 and not spec.cgroup_procs:
        # No cgroup of its own: the scheduler weighs the sandbox's session (``--new-session``: an
        # autogroup of its own) against the service's as equals unless the session's nice is set too
        # (in a cgroup, autogroups do not apply: the cgroup's weight does). :mod:`.priority`
        argv += ["/bin/sh", "-c", _AUTOGROUP_NICE.format(nice=int(spec.limits.nice)), "sh"]
    return argv + list(spec.command)


#: The kernel takes one autogroup change per 100 ms from an unprivileged writer (EAGAIN otherwise):
#: a few tries, 0.3 s at most, then the sandbox runs with its nice level only.
_AUTOGROUP_NICE = ('for _ in 1 2 3 4; do {{ echo {nice} > /proc/self/autogroup; }} 2>/dev/null && break; '
                   'sleep 0.1; done; exec "$@"')


#: The sandbox's first process: waits on stdin until the service has put it in the sandbox's
#: cgroups and set its limits (both inherited from then on), then becomes bwrap. The service
#: forks no Python for it (``preexec_fn`` would: a fork of the whole service per command).
_GATE = 'read -r go && [ "$go" = go ] || exit 125; exec "$@" </dev/null'


def _gate_argv(argv: list[str], spec: SandboxSpec) -> list[str]:
    if spec.overlay is not None:
        argv = overlay.in_namespace_argv(spec.overlay, spec.workspace, argv)
    return ["/bin/sh", "-c", _GATE, "sh", *argv]


class _Gate:
    """The gate spawned by ``subprocess.Popen`` inside the sandbox's network namespace
    (:func:`netns.inside`: synchronous, which asyncio's spawn is not), awaited on this loop
    through a pidfd; the part of ``asyncio.subprocess.Process`` that :func:`_execute` and
    :func:`_kill_tree` use."""

    def __init__(self, popen: subprocess.Popen):
        self._popen = popen
        self.pid = popen.pid
        self.stdin = popen.stdin  # unbuffered (bufsize=0): a write goes out at once
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)  # a zombie still has one: only this object reaps it
        self._loop.add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        code = self._popen.wait()  # it has exited: the wait reaps it at once
        if self.stdin is not None and not self.stdin.closed:
            self.stdin.close()
        if not self._exited.done():
            self._exited.set_result(code)

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def kill(self) -> None:
        if not self._exited.done():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)  # not reaped before _on_exit: the pid is still its


#: The gate's and bwrap's own environment, on the host (the sandbox's is set by ``--setenv``).
_GATE_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}


def _popen_gate(argv: list[str], spec: SandboxSpec, stdout: int | None, stderr: int | None) -> subprocess.Popen:
    return subprocess.Popen(_gate_argv(argv, spec), stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, bufsize=0,
                            env=_GATE_ENV, start_new_session=True)


def _limit_process(pid: int, limits: ResourceLimits, cgroup_procs: tuple[str, ...] = ()) -> None:
    """Put process ``pid`` (the gate, not yet running bwrap) in ``cgroup_procs`` and set its
    rlimits, soft and hard (capped at this process's own hard limit)."""
    for procs in cgroup_procs:
        fd = os.open(procs, os.O_WRONLY)
        try:
            os.write(fd, str(pid).encode())
        finally:
            os.close(fd)
    priority.lower(pid, limits.nice)
    for which, value in (
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_AS, limits.address_space_bytes),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
    ):
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.prlimit(pid, which, (value, value))


# --------------------------------------------------------------------------- proxy forwarder


class _Forwarder:
    """Host side of the proxy relay: a Unix socket (``path``, the shim's end), or listening
    sockets in the sandbox's network namespace (``listeners``), whose connections go to host:port:
    through :class:`relay.Relay` (only the rollout's proxy routes) when ``proxy.routes`` is set."""

    def __init__(self, proxy: ProxyForward, path: Path | None = None, *, listeners=()):
        self.proxy = proxy
        self.path = path
        self.listeners = list(listeners)
        self.relay = relay.Relay(proxy.host, proxy.port, proxy.routes) if proxy.routes is not None else None
        self._servers: list[asyncio.AbstractServer] = []
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def fault(self) -> str:
        """Why a call was cut on Arena's side ("" if none was): :attr:`RunResult.proxy_fault`."""
        return (self.relay.fault or "") if self.relay is not None else ""

    async def start(self) -> None:
        handle = self.relay.serve if self.relay is not None else self._handle
        if self.path is not None:
            self._servers.append(await asyncio.start_unix_server(handle, path=str(self.path)))
            os.chmod(self.path, 0o666)
        for listener in self.listeners:
            self._servers.append(await asyncio.start_server(handle, sock=listener))

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        if self.relay is not None:
            self.relay.close()
        for writer in list(self._writers):
            writer.close()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(self.proxy.host, self.proxy.port)
            except OSError as exc:
                log.warning("proxy %s:%d unreachable: %s", self.proxy.host, self.proxy.port, exc)
                return
            self._writers.add(up_writer)
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
                self._writers.discard(up_writer)
        finally:
            writer.close()
            self._writers.discard(writer)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        pass


# --------------------------------------------------------------------------- process tree


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(entry))
    return out


async def _kill_tree(proc: asyncio.subprocess.Process) -> None:
    """Kill the sandbox and wait until every process in it is gone.

    The outer ``bwrap`` (our child) waits on the sandbox's PID-namespace init; killing
    that init makes the kernel kill and reap every process in the namespace before the
    init itself is reaped, so once the outer ``bwrap`` exits nothing is left.
    """
    deadline = time.monotonic() + _KILL_GRACE_S
    while proc.returncode is None and time.monotonic() < deadline:
        # Re-scanned each round: a bwrap that just started may not have forked yet.
        for pid in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), 0.05)
    # Anything left in bwrap's own process group (bwrap itself if it did not exit).
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    await proc.wait()


# --------------------------------------------------------------------------- run


async def _execute(
    spec: SandboxSpec,
    *,
    cancel: asyncio.Event | None,
    stdout: int | None,
    stderr: int | None,
) -> RunResult:
    if cancel is not None and cancel.is_set():
        return RunResult(exit_code=None, timed_out=False, killed=True, duration_s=0.0)
    run_dir = Path(tempfile.mkdtemp(prefix=spec.run_prefix, dir=run_tmp()))
    forwarder: _Forwarder | None = None
    net: netns.SandboxNet | None = None
    proc: asyncio.subprocess.Process | _Gate | None = None
    released = False  # the gate was told to become bwrap
    started = time.monotonic()
    try:
        if spec.proxy is not None and not spec.shim_relay and netns.available() is None:
            # the gate is born in the sandbox's network namespace (spawned from this thread, the
            # loop's, which lives as long as the service: bwrap's --die-with-parent is its death)
            net = await netns.create(spec.proxy.inside_port)
            argv = _bwrap_argv(spec, run_dir, shim=None, net=True)
            popen = netns.inside(net, lambda: _popen_gate(argv, spec, stdout, stderr))
            try:
                proc = _Gate(popen)
            except BaseException:
                popen.kill()
                popen.wait()
                raise
            forwarder = _Forwarder(spec.proxy, listeners=net.listeners)
            await forwarder.start()
        else:
            shim: tuple[int, str] | None = None
            if spec.proxy is not None:
                shutil.copyfile(SHIM, run_dir / "shim.py")
                forwarder = _Forwarder(spec.proxy, run_dir / "proxy.sock")
                await forwarder.start()
                shim = (spec.proxy.inside_port, PROXY_SOCKET)
            argv = _bwrap_argv(spec, run_dir, shim=shim)
            proc = await asyncio.create_subprocess_exec(
                *_gate_argv(argv, spec),
                stdin=subprocess.PIPE,
                stdout=stdout,
                stderr=stderr,
                env=_GATE_ENV,
                start_new_session=True,
            )
        # off the loop: a move into a v1 cgroup can wait for an RCU grace period (6-25 ms under load)
        await asyncio.to_thread(_limit_process, proc.pid, spec.limits, spec.cgroup_procs)  # raises: the gate is killed
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        released = True
        waiters = {asyncio.ensure_future(proc.wait())}
        cancel_wait = asyncio.ensure_future(cancel.wait()) if cancel is not None else None
        if cancel_wait is not None:
            waiters.add(cancel_wait)
        try:
            await asyncio.wait(waiters, timeout=spec.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if cancel_wait is not None:
                cancel_wait.cancel()
        if proc.returncode is not None:
            code = proc.returncode
            return RunResult(
                exit_code=128 - code if code < 0 else code,
                timed_out=False,
                killed=False,
                duration_s=time.monotonic() - started,
                proxy_fault=forwarder.fault if forwarder is not None else "",
            )
        timed_out = not (cancel is not None and cancel.is_set())
        await _kill_tree(proc)
        return RunResult(exit_code=None, timed_out=timed_out, killed=True, duration_s=time.monotonic() - started,
                         proxy_fault=forwarder.fault if forwarder is not None else "")
    finally:
        if proc is not None and proc.returncode is None:
            # Cancelled or failed mid-run: never leave the sandbox behind.
            if not released:  # still the gate, which has started nothing: it goes at once
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await asyncio.shield(_kill_tree(proc))
        if forwarder is not None:
            await forwarder.close()
        if net is not None:
            net.close()
        shutil.rmtree(run_dir, ignore_errors=True)


async def run(spec: SandboxSpec, *, cancel: asyncio.Event | None = None) -> RunResult:
    """Run ``spec.command`` in a fresh sandbox until it exits, times out or is cancelled.

    Setting ``cancel`` kills the sandbox (``killed=True, timed_out=False``). If the
    calling task itself is cancelled, the sandbox is killed before the cancellation
    propagates.
    """
    if spec.log_path is None:
        return await _execute(spec, cancel=cancel, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(spec.log_path, "wb") as log_file:
        return await _execute(spec, cancel=cancel, stdout=log_file.fileno(), stderr=subprocess.STDOUT)


def interactive(spec: SandboxSpec) -> int:
    """Run ``spec.command`` in a sandbox built as :func:`run` builds it (the same bwrap command line
    and rlimits, no network: ``spec.proxy`` must be None) with this process's stdin, stdout and
    stderr, until it exits (``arena tasks shell``); its exit code. No cgroup, no wall clock."""
    if spec.proxy is not None:
        raise ValueError("an interactive sandbox has no LLM proxy")
    run_dir = Path(tempfile.mkdtemp(prefix=spec.run_prefix, dir=run_tmp()))
    try:
        argv = _bwrap_argv(spec, run_dir, shim=None)
        if spec.overlay is not None:
            argv = overlay.in_namespace_argv(spec.overlay, spec.workspace, argv)
        proc = subprocess.Popen(argv, env=_GATE_ENV, preexec_fn=functools.partial(_limit_process, 0, spec.limits))
        try:
            code = proc.wait()
        except BaseException:  # Ctrl-C: the sandbox goes with it (--die-with-parent as well)
            proc.kill()
            proc.wait()
            raise
        return 128 - code if code < 0 else code
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# --------------------------------------------------------------------------- git


# The base commit and its git steps are the core's (arena_core.sources): the verification plane
# commits the same trees the same way.
GitError = sources.GitError
prepare_workspace = sources.prepare_workspace


_DIFF_SCRIPT = (
    'git -c core.fsmonitor=false -c core.excludesFile=/run/arena/excludes add -A >&2 || exit 1; '
    'base="$1"; shift; '
    'exec git -c core.fsmonitor=false diff --cached --binary --no-ext-diff --no-textconv --no-color '
    '"$base" -- . "$@"'
)


def _exclude_pathspecs() -> list[str]:
    """Pathspecs that drop :data:`DIFF_EXCLUDES` from the diff even if committed."""
    out = []
    for pattern in DIFF_EXCLUDES:
        glob = f"**/{pattern}**" if pattern.endswith("/") else f"**/{pattern}"
        out.append(f":(exclude,glob){glob}")
    return out


async def git_diff(workspace: Path, base: str = "HEAD", *, timeout_s: float = 120.0,
                   run_prefix: str = "arena-run-", max_bytes: int | None = None,
                   layers: tuple[Path, Path, Path] | None = None) -> str:
    """The workspace's changes against ``base`` (new files included), as a binary diff.

    Git runs inside a fresh sandbox over the workspace, never on the host: an agent
    can leave hooks or config in ``.git`` that would execute. Caches listed in
    :data:`DIFF_EXCLUDES` are left out. Raises :class:`GitError` if git fails, and
    :class:`~arena_core.sources.DiffTooLarge` if the diff is over ``max_bytes``: git writes
    into a pipe drained as it goes, only the first ``max_bytes`` kept (nothing on the disk,
    memory bounded whatever the agent wrote). ``layers``: the workspace is that overlay (lower,
    upper, work), mounted in the diff's own sandbox as in the agent's.
    """
    out = sources.BoundedBytes(max_bytes)
    with tempfile.TemporaryDirectory(prefix="arena-diff-", dir=run_tmp()) as tmp:
        err_path = Path(tmp) / "err"
        spec = SandboxSpec(
            command=["sh", "-c", _DIFF_SCRIPT, "sh", base, *_exclude_pathspecs()],
            workspace=Path(workspace),
            env={"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_NO_REPLACE_OBJECTS": "1",
                 **GIT_IDENTITY},
            timeout_s=timeout_s,
            run_prefix=run_prefix,
            overlay=layers,
        )
        read_end, write_end = os.pipe()
        drained = asyncio.ensure_future(asyncio.to_thread(_drain, read_end, out))
        try:
            with open(err_path, "wb") as err:
                result = await _execute(spec, cancel=None, stdout=write_end, stderr=err.fileno())
        finally:
            os.close(write_end)  # every process of the run is gone: the reader sees the end
            await asyncio.shield(drained)
        if result.timed_out:
            raise GitError(f"git diff timed out after {timeout_s:.0f}s")
        if result.exit_code != 0:
            detail = err_path.read_text(errors="replace").strip()[-2000:]
            raise GitError(f"git diff failed (exit {result.exit_code}): {detail}")
        return out.diff()


def _drain(fd: int, sink: sources.BoundedBytes) -> None:
    """Read ``fd`` to its end into ``sink``, then close it."""
    try:
        while chunk := os.read(fd, 1024 * 1024):
            sink(chunk)
    finally:
        os.close(fd)
