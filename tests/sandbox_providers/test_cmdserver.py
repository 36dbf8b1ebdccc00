"""The docker provider's in-sandbox command server and its host channel, for real but
without an engine: the server runs as PID 1 of a fresh PID namespace (bubblewrap
``--as-pid-1``), as it does as a container's init."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arena_sandbox_providers import local
from arena_sandbox_providers.channel import Channel, ChannelClosed, listen

CMDSERVER = Path(local.__file__).with_name("cmdserver.py")

#: the interpreter's real path: a venv in a clone under /tmp is hidden by the sandbox's tmpfs
PYTHON = os.path.realpath(sys.executable)

pytestmark = pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}")


class Output:
    def __init__(self):
        self.out = bytearray()
        self.err = bytearray()

    async def run(self, channel: Channel, argv: list[str], env: dict | None = None, cwd: str = "/") -> int:
        return await channel.run(argv, env or {}, cwd, self.out.extend, self.err.extend)


@pytest.fixture
async def server(tmp_path):
    sock = tmp_path / "ctl.sock"
    listener = listen(sock, uid=os.getuid())
    proc = await asyncio.create_subprocess_exec(
        local.BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
        "--bind", str(tmp_path), str(tmp_path),
        "--ro-bind", str(CMDSERVER), str(CMDSERVER), "--unshare-user", "--unshare-pid", "--as-pid-1",
        # the server and the interpreter's real path: a clone under /tmp is hidden by the tmpfs
        "--die-with-parent", "--", PYTHON, "-I", "-S", str(CMDSERVER), str(sock),
    )

    async def alive():
        return None if proc.returncode is None else f"exit {proc.returncode}"

    channel = await Channel.accept(listener, sock, uid=os.getuid(), timeout_s=30, alive=alive)
    assert not sock.exists()  # nobody else can connect any more
    try:
        yield channel, proc
    finally:
        channel.close()
        await asyncio.wait_for(proc.wait(), 10)  # end of input: the server exits


async def test_runs_commands_with_output_code_env_and_cwd(server, tmp_path):
    channel, _ = server
    o = Output()
    code = await o.run(channel, ["sh", "-c", 'echo "out $GREETING"; pwd; echo err >&2; exit 3'],
                       env={"GREETING": "hi"}, cwd=str(tmp_path))
    assert code == 3
    assert o.out.decode() == f"out hi\n{tmp_path}\n" and o.err == b"err\n"
    o = Output()
    assert await o.run(channel, ["sh", "-c", "kill -TERM $$"]) == 128 + 15
    o = Output()
    assert await o.run(channel, ["/no/such/command"]) == 127
    assert b"cannot run" in o.err


async def test_a_command_ends_with_everything_it_started(server):
    channel, _ = server
    o = Output()
    # the background sleep keeps stdout open: the command ends only because it is killed
    assert await asyncio.wait_for(o.run(channel, ["sh", "-c", "setsid sleep 100 & echo $!"]), 10) == 0
    pid = o.out.decode().strip()
    o2 = Output()
    await o2.run(channel, ["sh", "-c", f"kill -0 {pid} 2>/dev/null; echo $?"])
    assert o2.out == b"1\n"


async def test_kill_stops_a_running_command_and_its_detached_children(server):
    channel, _ = server
    o = Output()
    run = asyncio.ensure_future(o.run(channel, ["sh", "-c", "setsid sleep 100 & sleep 100"]))
    await asyncio.sleep(0.3)
    assert not run.done()
    channel.kill()
    assert await asyncio.wait_for(run, 10) == 128 + 9
    assert await Output().run(channel, ["true"]) == 0  # the server itself survives


async def test_signals_from_inside_do_not_end_the_server(server):
    # As an init, the server only gets the signals it handles: none (Python's SIGINT
    # handler would make `kill -INT 1` a KeyboardInterrupt). Commands get the defaults.
    channel, _ = server
    o = Output()
    assert await o.run(channel, [PYTHON, "-I", "-S", "-c",
                                 "import os, signal\n"
                                 "for sig in range(1, signal.NSIG):\n"
                                 "    os.kill(1, sig)\n"
                                 "os.kill(os.getpid(), signal.SIGINT)\n"]) == 128 + 2, o.err
    assert await Output().run(channel, ["true"]) == 0


async def test_commands_cannot_create_a_user_namespace(server):
    # In one they would hold every capability again: the server's seccomp filter refuses
    # (EPERM; clone3 ENOSYS, so libc falls back to clone). The sandbox around this test
    # server allows it, so the refusal is the server's. Threads and processes still work.
    channel, _ = server
    o = Output()
    code = await o.run(channel, [PYTHON, "-I", "-S", "-c",
                                 "import ctypes, os, subprocess, threading\n"
                                 "libc = ctypes.CDLL(None, use_errno=True)\n"
                                 "print(libc.unshare(0x10000000), ctypes.get_errno())\n"  # CLONE_NEWUSER
                                 "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
                                 "print(subprocess.run(['true']).returncode)\n"
                                 "print(open('/proc/self/status').read().count('Seccomp:\\t2'))\n"])
    assert code == 0, o.err
    assert o.out.decode().split("\n") == ["-1 1", "thread", "0", "1", ""]


async def test_quit_ends_the_server(server):
    channel, proc = server
    assert await channel.quit(timeout_s=10)
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    with pytest.raises(ChannelClosed):
        await Output().run(channel, ["true"])


def test_refuses_to_run_outside_its_own_pid_namespace(tmp_path):
    # kill(-1) as a plain process would reach every process of its user: never started
    proc = subprocess.run([sys.executable, "-I", "-S", str(CMDSERVER), str(tmp_path / "none.sock")],
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2 and "PID 1" in proc.stderr
