"""Shared fixtures: a real nats-server with JetStream on a free port, per test."""

from __future__ import annotations

import pytest

from arena_stack.natsserver import NatsServer


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats", sync="1s").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def bus(nats_server):
    from arena_core.bus import Bus

    b = await Bus.connect(nats_server.url, "test")
    await b.ensure_topology()
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def small_bus(tmp_path):
    """A NATS server whose messages are at most 256 KiB (so tests can exceed it cheaply),
    with the topology declared, and a bus on it: ``(server, bus)``."""
    from arena_core.bus import Bus

    server = NatsServer(tmp_path / "small-nats", sync="1s", max_payload=256 * 1024).start()
    try:
        b = await Bus.connect(server.url, "test")
        await b.ensure_topology()
        try:
            yield server, b
        finally:
            await b.close()
    finally:
        server.stop()


# --------------------------------------------------------------------------- sandbox plane


@pytest.fixture(scope="session")
def docker_url(tmp_path_factory):
    """A Docker-API engine for the docker sandbox provider: ``ARENA_TEST_DOCKER_URL`` if
    set, else Podman's service started by ``deploy/docker-engine.sh`` (root only; it
    installs podman and builds the images) and stopped by PID at the end."""
    import os
    import subprocess
    from pathlib import Path

    if os.environ.get("ARENA_TEST_DOCKER_URL"):
        yield os.environ["ARENA_TEST_DOCKER_URL"]
        return
    if os.geteuid() != 0:
        pytest.skip("docker provider: no ARENA_TEST_DOCKER_URL and not root, so no engine can be set up here")
    script = Path(__file__).resolve().parents[1] / "deploy" / "docker-engine.sh"
    work = tmp_path_factory.mktemp("docker-engine")
    sock, pidfile = work / "podman.sock", work / "podman.pid"
    proc = subprocess.run([str(script), "start", str(sock), str(pidfile)], capture_output=True, text=True,
                          timeout=600, check=False)
    try:
        if proc.returncode != 0:
            pytest.skip(f"docker provider: engine unavailable: {proc.stderr.strip()[-500:]}")
        yield f"unix://{sock}"
    finally:
        if pidfile.exists():
            subprocess.run([str(script), "stop", str(pidfile)], check=False)


# --------------------------------------------------------------------------- scaffolds

_SCAFFOLD_BUILDS: list = []


def pytest_collection_finish(session):
    """mini-swe-agent's virtualenv (about 90 s on a fresh machine) builds in the background
    while the tests before its end-to-end tests run; those wait for it (``install.ensure``
    takes the same lock) and use it as built."""
    import subprocess
    import sys
    from pathlib import Path

    from arena_core.scaffolds import install

    if not any("test_agent_mini_swe_agent" in item.nodeid for item in session.items):
        return
    base = Path(__file__).resolve().parents[1] / ".arena" / "scaffolds"
    if install.installed("mini-swe-agent", base):
        return
    base.mkdir(parents=True, exist_ok=True)
    with open(base.parent / "scaffolds-build.log", "wb") as log:  # its own session: pip is stopped with it
        _SCAFFOLD_BUILDS.append(subprocess.Popen(
            [sys.executable, "-m", "arena_core.scaffolds.install", "mini-swe-agent", "--dir", str(base)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))


def pytest_sessionfinish(session, exitstatus):
    """A build still running when the session ends (its tests deselected or failed early) is
    stopped by its PID; the half-built virtualenv is rebuilt next time."""
    import os
    import signal
    import subprocess

    for proc in _SCAFFOLD_BUILDS:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the builder and its pip, by the group of its PID
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
