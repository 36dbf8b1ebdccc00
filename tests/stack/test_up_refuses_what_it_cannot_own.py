"""``arena up`` refuses what it cannot own: a second one on a running stack's ports, or on its
data directory, exits non-zero at once with one line naming the holder, touching none of the
first stack's files; a child (nats-server included) that keeps dying stops the supervisor with
its last log lines; and ``ARENA_PUBLIC_URL`` follows ``ARENA_ROLLOUT_PORT`` unless set."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from arena_core.settings import Settings
from arena_core.schemas import LlmJudgeVerifier
from arena_stack import natsauth
from arena_stack.natsserver import free_port
from arena_stack.stack import LOCK_FILE, Child, Stack, StackError
from arena_verification.judge import endpoint_of

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def settings_for(tmp_path: Path) -> Settings:
    return Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                    rollout_port=free_port(), trajectory_port=free_port(), dashboard_port=free_port(),
                    backend_url=f"http://127.0.0.1:{free_port()}/v1", sandbox_concurrency=1, verify_concurrency=1)


def snapshot(paths: list[Path]) -> dict[Path, tuple[bytes, int]]:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in paths}


def arena_up(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ARENA_")} | env
    return subprocess.run([sys.executable, "-m", "arena.cli", "up"], env=full, cwd=cwd, capture_output=True,
                          text=True, timeout=90)


def test_public_url_follows_the_rollout_port_unless_given():
    assert Settings(rollout_port=9190).public_url == "http://127.0.0.1:9190"
    assert Settings(host="0.0.0.0", rollout_port=9190).public_url == "http://127.0.0.1:9190"
    assert Settings.from_env({"ARENA_ROLLOUT_PORT": "9290"}).public_url == "http://127.0.0.1:9290"
    assert Settings.from_env({"ARENA_ROLLOUT_PORT": "9290", "ARENA_PUBLIC_URL": "http://arena:9090"}).public_url \
        == "http://arena:9090"
    assert Settings().public_url == "http://127.0.0.1:9090"
    # and the verification service's judge calls follow it too
    judge = LlmJudgeVerifier(rubric="Grade it.")
    assert endpoint_of(judge, "r1", {"ARENA_JUDGE_KEY": "k", "ARENA_ROLLOUT_PORT": "9390"}) \
        == ("http://127.0.0.1:9390/judge/r1/v1", "k")


@needs_bwrap
async def test_a_second_arena_up_on_busy_ports_or_a_held_data_dir_exits_naming_the_holder(tmp_path):
    first = Stack(settings_for(tmp_path), nats_sync="1s", log=lambda m: None)
    await first.start()
    try:
        s = first.settings
        owned = [first.data_dir / "api-key", first.data_dir / natsauth.CREDENTIALS_FILE]
        before = snapshot(owned)
        assert (first.data_dir / LOCK_FILE).read_text().strip() == str(os.getpid())

        same_ports = {"ARENA_NATS_URL": first.services_nats_url, "ARENA_ROLLOUT_PORT": str(s.rollout_port),
                      "ARENA_TRAJECTORY_PORT": str(s.trajectory_port), "ARENA_DASHBOARD_PORT": str(s.dashboard_port),
                      "ARENA_SANDBOX_HEALTH_PORT": str(s.sandbox_health_port),
                      "ARENA_VERIFICATION_HEALTH_PORT": str(s.verification_health_port),
                      "ARENA_DATA_DIR": str(tmp_path / "second")}
        began = time.monotonic()
        ports = await asyncio.to_thread(arena_up, same_ports, tmp_path)
        assert ports.returncode == 1, ports.stderr
        assert time.monotonic() - began < 60
        lines = ports.stderr.strip().splitlines()
        assert len(lines) == 1, ports.stderr
        assert f"port {first.nats.port} (ARENA_NATS_URL) is in use by pid {first.nats.proc.pid}" in lines[0]
        rollout_pid = next(c.pid for c in first.children if c.name == "rollout")
        assert f"port {s.rollout_port} (ARENA_ROLLOUT_PORT) is in use by pid {rollout_pid}" in lines[0]
        assert "Arena is up" not in ports.stdout
        assert not (tmp_path / "second" / "api-key").exists()

        same_dir = {"ARENA_NATS_URL": f"nats://127.0.0.1:{free_port()}", "ARENA_ROLLOUT_PORT": str(free_port()),
                    "ARENA_TRAJECTORY_PORT": str(free_port()), "ARENA_DASHBOARD_PORT": str(free_port()),
                    "ARENA_DATA_DIR": str(first.data_dir)}
        held = await asyncio.to_thread(arena_up, same_dir, tmp_path)
        assert held.returncode == 1, held.stderr
        lines = held.stderr.strip().splitlines()
        assert len(lines) == 1, held.stderr
        assert f"{first.data_dir} is in use by another stack (pid {os.getpid()}" in lines[0]

        assert snapshot(owned) == before
        async with httpx.AsyncClient(timeout=5.0) as http:
            for name, url in first.health_urls().items():
                assert (await http.get(url)).status_code == 200, name
        assert first.nats.running and all(c.alive() for c in first.children)
    finally:
        first.stop()
    # stopped, the directory is free again: a stack may hold it
    again = Stack(settings_for(tmp_path), log=lambda m: None)
    again.stop()


def test_a_stack_on_a_held_data_dir_refuses_before_writing_anything(tmp_path):
    first = Stack(settings_for(tmp_path), log=lambda m: None)
    try:
        with pytest.raises(StackError, match=f"pid {os.getpid()}"):
            Stack(settings_for(tmp_path), log=lambda m: None)
    finally:
        first.stop()


async def test_a_child_that_keeps_dying_stops_the_supervisor_with_its_log_lines(tmp_path):
    stack = Stack(settings_for(tmp_path), nats_sync="1s", log=lambda m: None)
    try:
        stack.nats.start()
        child = Child("doomed", [sys.executable, "-c", "import sys; print('doomed: cannot open its store', "
                                 "flush=True); sys.exit(3)"], stack.env(), stack.data_dir / "logs" / "doomed.log")
        child.start()
        stack.children.append(child)
        with pytest.raises(StackError) as raised:
            await asyncio.wait_for(stack.supervise(asyncio.Event(), interval=0.05, max_backoff=0.1,
                                                   max_restarts=3, restart_window=60), 60)
        message = str(raised.value)
        assert message.startswith("doomed exited with code 3 after 3 restarts within 60 s; stopping the stack")
        assert "doomed: cannot open its store" in message
    finally:
        stack.stop()


async def test_a_nats_server_that_cannot_listen_again_stops_the_supervisor_with_its_log_lines(tmp_path):
    stack = Stack(settings_for(tmp_path), nats_sync="1s", log=lambda m: None)
    squatter = socket.socket()
    try:
        stack.nats.log_file = stack.data_dir / "nats-server.log"
        stack.nats.start()
        stack.nats.kill()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", stack.nats.port))
        squatter.listen()
        with pytest.raises(StackError) as raised:
            await asyncio.wait_for(stack.supervise(asyncio.Event(), interval=0.05, max_restarts=2,
                                                   restart_window=120), 90)
        message = str(raised.value)
        assert message.startswith("nats-server exited with code 1 after 2 restarts within 120 s")
        assert "address already in use" in message
    finally:
        squatter.close()
        stack.stop()


def test_a_port_answering_from_another_process_than_the_child_is_not_the_child(tmp_path):
    stack = Stack(settings_for(tmp_path), log=lambda m: None)
    other = socket.socket()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(StackError, match=f"port {port} answers for rollout from pid {os.getpid()} .*"
                                             f"not from the rollout this stack started \\(pid {child.pid}\\)"):
            stack._check_owner("rollout", port, child.pid)
        stack._check_owner("rollout", port, os.getpid())  # its own: fine
    finally:
        child.kill()
        child.wait()
        other.close()
        stack.stop()
