"""In-sandbox command server: the ``docker`` provider's container init (PID 1). Stdlib only.

Run as ``python3 -I -S cmdserver.py SOCKET`` by the sandbox user, it connects to SOCKET and runs
the commands the provider sends, one at a time, streaming their output back. The frame table
and what it guarantees: docs/sandbox.md ("The command server").
"""

# CPython's C modules behind ``signal`` and ``socket``: they import enum, selectors and more,
# ~6 ms of the server's start, which every cold sandbox waits for (docs/sandbox.md, Performance)
import _signal as signal
import _socket as socket
import os
import select
import struct
import sys

HEADER = struct.Struct(">cI")
_CHUNK = 65536
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2

# A seccomp filter (classic BPF over struct seccomp_data: nr at 0, arch at 4, the low
# word of args[0] at 16) that refuses to create a user namespace: in one, a process
# holds every capability again (scoped to it), the usual first step of a kernel
# exploit; engines' default profiles differ (Podman's allows it). unshare(2) and
# clone(2) with CLONE_NEWUSER fail with EPERM; clone3(2), whose flags a filter cannot
# read, fails with ENOSYS, so libc falls back to clone(2); x32 system calls fail.
# Other architectures than x86_64 and aarch64 are let through unfiltered.
_CLONE_NEWUSER = 0x10000000
_ALLOW, _EPERM, _ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
_FILTER = (
    ("ld", 4, None, None),
    ("jeq", 0xC000003E, "x86_64", None),  # AUDIT_ARCH_X86_64
    ("jeq", 0xC00000B7, "aarch64", "allow"),  # AUDIT_ARCH_AARCH64
    "x86_64",
    ("ld", 0, None, None),
    ("jge", 0x40000000, "eperm", None),  # x32
    ("jeq", 272, "flags", None),  # unshare
    ("jeq", 56, "flags", None),  # clone
    ("jeq", 435, "enosys", "allow"),  # clone3
    "aarch64",
    ("ld", 0, None, None),
    ("jeq", 97, "flags", None),  # unshare
    ("jeq", 220, "flags", None),  # clone
    ("jeq", 435, "enosys", "allow"),  # clone3
    "flags",
    ("ld", 16, None, None),
    ("jset", _CLONE_NEWUSER, "eperm", "allow"),
    "allow", ("ret", _ALLOW, None, None),
    "eperm", ("ret", _EPERM, None, None),
    "enosys", ("ret", _ENOSYS, None, None),
)
_OPCODES = {"ld": 0x20, "jeq": 0x15, "jge": 0x35, "jset": 0x45, "ret": 0x06}  # BPF_LD|W|ABS, BPF_JMP|..|K, BPF_RET|K


def _assemble(program: tuple) -> bytes:
    """``struct sock_filter[]`` of ``program``: jump targets are labels (None: the next)."""
    labels, index = {}, 0
    for item in program:
        if isinstance(item, str):
            labels[item] = index
        else:
            index += 1
    code, index = b"", 0
    for item in program:
        if isinstance(item, str):
            continue
        op, k, true, false = item
        jt = labels[true] - index - 1 if true else 0
        jf = labels[false] - index - 1 if false else 0
        code += struct.pack("=HBBI", _OPCODES[op], jt, jf, k)
        index += 1
    return code


def _deny_user_namespaces(ctypes, libc) -> "str | None":
    """Install :data:`_FILTER` on the server; every command it starts inherits it."""

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    code = ctypes.create_string_buffer(_assemble(_FILTER))
    prog = SockFprog(len(code.raw) // 8, ctypes.addressof(code))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return f"prctl(PR_SET_NO_NEW_PRIVS) failed: errno {ctypes.get_errno()}"
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.c_void_p(ctypes.addressof(prog)), 0, 0) != 0:
        return f"seccomp filter refused: errno {ctypes.get_errno()}"
    return None


def _prepare() -> "str | None":
    """Make the server non-dumpable, so that processes of the same uid (the agent's)
    can neither ptrace it nor read its memory (``exec`` resets this for the commands
    it starts), forbid user namespaces to it and its commands, and check that process
    fds work here; the reason if not."""
    try:
        os.close(os.pidfd_open(os.getpid()))
        import ctypes  # only here: the rest of the server needs no ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            return f"prctl(PR_SET_DUMPABLE, 0) failed: errno {ctypes.get_errno()}"
        return _deny_user_namespaces(ctypes, libc)
    except (AttributeError, ImportError, OSError) as exc:  # Python < 3.9, Linux < 5.3, no ctypes
        return f"{type(exc).__name__}: {exc} (needs Python >= 3.9 with ctypes, Linux >= 5.3)"


class Server:
    def __init__(self, sock: "socket.socket"):
        self.sock = sock
        self.inbuf = b""
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)
        self.child = 0  # pid of the running command's first process
        self.pidfd = -1
        self.status: "int | None" = None  # its wait status once reaped
        self.failed: "int | None" = None  # 126/127 when it could not be started
        self.exited = False
        self.outputs: "dict[int, bytes]" = {}  # pipe fd -> frame kind

    # ------------------------------------------------------------ processes

    def reap(self, block: bool) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.child:
                self.status = status

    def kill_all(self) -> None:
        """SIGKILL every other process in the sandbox and reap them, until none is left."""
        while True:
            try:
                os.kill(-1, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                break  # nothing left that we may signal
            self.reap(block=True)
        self.reap(block=False)

    def spawn(self, payload: bytes) -> None:
        fields = [os.fsdecode(f) for f in payload.split(b"\0")]
        cwd, argc = fields[0], int(fields[1])
        argv, entries = fields[2 : 2 + argc], fields[2 + argc :]
        env = dict(os.environ)
        for entry in entries:
            name, _, value = entry.partition("=")
            env[name] = value
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        check_r, check_w = os.pipe()  # close-on-exec: EOF means the exec succeeded
        pid = os.fork()
        if pid == 0:  # the child: never returns
            try:
                os.setsid()
                for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):  # the server ignores these; commands must not
                    signal.signal(sig, signal.SIG_DFL)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                null = os.open("/dev/null", os.O_RDONLY)
                os.dup2(null, 0)
                os.chdir(cwd)
                os.execvpe(argv[0], argv, env)
            except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
                code = b"126" if isinstance(exc, PermissionError) else b"127"
                os.write(check_w, code + f" arena: cannot run {argv[:1]!r} in {cwd}: {exc}\n".encode())
            finally:
                os._exit(127)
        for fd in (out_w, err_w, check_w):
            os.close(fd)
        failure = b""
        while chunk := os.read(check_r, _CHUNK):
            failure += chunk
        os.close(check_r)
        self.child, self.status, self.failed, self.exited = pid, None, None, False
        self.pidfd = os.pidfd_open(pid)
        self.poller.register(self.pidfd, select.POLLIN)
        self.outputs = {out_r: b"O", err_r: b"E"}
        for fd in self.outputs:
            self.poller.register(fd, select.POLLIN)
        if failure:
            code, _, message = failure.partition(b" ")
            self.send(b"E", message)
            self.failed = int(code)

    # ------------------------------------------------------------ protocol

    def send(self, kind: bytes, payload: bytes) -> None:
        self.sock.sendall(HEADER.pack(kind, len(payload)) + payload)

    def on_control(self) -> bool:
        """Read and act on host frames; False when the server must exit."""
        data = self.sock.recv(_CHUNK)
        if not data:
            return False
        self.inbuf += data
        while len(self.inbuf) >= HEADER.size:
            kind, size = HEADER.unpack_from(self.inbuf)
            if len(self.inbuf) < HEADER.size + size:
                break
            payload = self.inbuf[HEADER.size : HEADER.size + size]
            self.inbuf = self.inbuf[HEADER.size + size :]
            if kind == b"X" and not self.child:
                self.spawn(payload)
            elif kind == b"K":
                self.kill_all()
            elif kind == b"Q":
                return False
            else:
                sys.stderr.write(f"arena cmdserver: unexpected frame {kind!r}\n")
                return False
        return True

    def on_exit(self) -> None:
        """The command's first process exited: kill what it left, keep draining."""
        self.poller.unregister(self.pidfd)
        os.close(self.pidfd)
        self.pidfd = -1
        if self.status is None:
            try:
                _, self.status = os.waitpid(self.child, 0)
            except ChildProcessError:
                pass  # reaped by kill_all, which recorded the status
        self.kill_all()
        self.exited = True

    def finish(self) -> None:
        if self.failed is not None:
            code = self.failed
        else:
            code = os.waitstatus_to_exitcode(self.status if self.status is not None else signal.SIGKILL)
        self.send(b"R", str(128 - code if code < 0 else code).encode())
        self.child, self.status, self.failed, self.exited = 0, None, None, False

    def serve(self) -> None:
        sock_fd = self.sock.fileno()
        while True:
            events = self.poller.poll(1000)
            self.reap(block=False)  # orphans re-parented to PID 1 (and maybe the command)
            for fd, _ in events:
                if fd == sock_fd:
                    if not self.on_control():
                        return
                elif fd == self.pidfd:
                    self.on_exit()
                elif fd in self.outputs:
                    data = os.read(fd, _CHUNK)
                    if data:
                        self.send(self.outputs[fd], data)
                    else:
                        self.poller.unregister(fd)
                        os.close(fd)
                        del self.outputs[fd]
            if self.child and self.exited and not self.outputs:
                self.finish()


def exec_command(argv: "list[str]") -> int:
    """``cmdserver.py --exec CMD...``: become CMD as the server starts its commands (user namespaces
    denied, the default dispositions of the signals Python ignores), without a server: the
    process of an engine ``exec`` (``arena tasks shell`` in a docker sandbox). Returns only on failure."""
    import ctypes

    problem = _deny_user_namespaces(ctypes, ctypes.CDLL(None, use_errno=True))
    if problem is not None:
        sys.stderr.write(f"arena cmdserver: cannot run here: {problem}\n")
        return 2
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"arena: cannot run {argv[:1]!r}: {exc}\n")
        return 126 if isinstance(exc, PermissionError) else 127


def main(argv: "list[str]") -> int:
    if argv[:1] == ["--exec"] and len(argv) > 1:
        return exec_command(argv[1:])
    if len(argv) != 1:
        sys.stderr.write("usage: cmdserver.py SOCKET | cmdserver.py --exec CMD...\n")
        return 2
    if os.getpid() != 1:  # kill(-1) anywhere else would reach every process of this user
        sys.stderr.write("arena cmdserver: must run as PID 1 of its own PID namespace (a container's init)\n")
        return 2
    # An init only gets the signals it handles from inside its namespace; Python handles
    # SIGINT (KeyboardInterrupt), so `kill -INT 1` by the agent would end the server.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    problem = _prepare()
    if problem is not None:
        sys.stderr.write(f"arena cmdserver: cannot run here: {problem}\n")
        return 2
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(argv[0])
    server = Server(sock)
    try:
        server.serve()
    finally:
        server.kill_all()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
