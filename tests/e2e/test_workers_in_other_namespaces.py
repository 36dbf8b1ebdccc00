"""Workers on other machines, here network namespaces (``ip netns``, root): the sandbox and
the verification worker each run in their own namespace behind a veth pair, with their own
data directory, reaching only NATS (and, for the sandbox, the proxy URL it is given). A
quickstart group submitted on the host with an API key completes with rewards and stored
trajectories: the task's files, the diff and the logs travelled through NATS, never a disk
the workers share with the host's services."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core import apikeys
from arena_core.bus import Bus
from arena_core.schemas import RolloutState
from arena_stack import topology
from arena_stack.natsserver import NatsServer, free_port, wait_port
from arena_stack.stack import Child

ROOT = Path(__file__).resolve().parents[2]


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None or shutil.which("bwrap") is None:
        return "needs iproute2 and bubblewrap"
    name = f"arena-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.decode()[:200]}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


pytestmark = pytest.mark.skipif(bool(_can_make_namespaces()), reason=str(_can_make_namespaces()))


class Namespace:
    """A network namespace joined to the host by a veth pair: host ``10.231.N.1``, inside ``.2``."""

    def __init__(self, index: int):
        tag = uuid.uuid4().hex[:5]
        self.name, self.host_if, self.ns_if = f"arena-w{index}-{tag}", f"aw{index}h{tag}", f"aw{index}n{tag}"
        self.host_ip, self.ns_ip = f"10.231.{index}.1", f"10.231.{index}.2"

    def __enter__(self) -> Namespace:
        for cmd in (["ip", "netns", "add", self.name],
                    ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
                    ["ip", "link", "set", self.ns_if, "netns", self.name],
                    ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
                    ["ip", "link", "set", self.host_if, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", self.ns_if, "up"],
                    ["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"]):
            subprocess.run(cmd, check=True, capture_output=True)
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "link", "delete", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)

    def reaches(self, host: str, port: int) -> bool:
        probe = (f"import socket; s = socket.socket(); s.settimeout(1); "
                 f"print(s.connect_ex(({host!r}, {port})))")
        out = subprocess.run(["ip", "netns", "exec", self.name, sys.executable, "-c", probe],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() == "0"


async def test_workers_in_their_own_namespaces_run_a_group_through_nats_alone(tmp_path):
    nats = NatsServer(tmp_path / "nats", sync="1s", host="0.0.0.0").start()
    children: list[Child] = []
    try:
        await topology.create(nats.url)  # the topology step, as `arena up` runs it before its services
        with Namespace(1) as sandbox_ns, Namespace(2) as verify_ns:
            rollout_port, trajectory_port = free_port(), free_port()
            host_env = {**os.environ, "ARENA_NATS_URL": nats.url, "ARENA_AUTH": "keys", "PYTHONUNBUFFERED": "1",
                        "ARENA_ROLLOUT_PORT": str(rollout_port), "ARENA_TRAJECTORY_PORT": str(trajectory_port),
                        "ARENA_BACKEND_URL": f"http://127.0.0.1:{free_port()}/v1"}
            llm_port = int(host_env["ARENA_BACKEND_URL"].rsplit(":", 1)[1].split("/")[0])
            logs = tmp_path / "logs"
            logs.mkdir()

            def start(name: str, argv: list[str], env: dict) -> Child:
                child = Child(name, argv, env, logs / f"{name}.log")
                child.start()
                children.append(child)
                return child

            start("scripted-llm", [sys.executable, "-m", "arena_stack.scripted_llm", "--script",
                                   str(ROOT / "examples" / "quickstart" / "llm_script.json"), "--port", str(llm_port)],
                  host_env)
            # the API and proxy on the host: the proxy reachable from the sandbox's namespace
            rollout = start("rollout", [sys.executable, "-m", "arena_rollout"],
                            {**host_env, "ARENA_HOST": "0.0.0.0", "ARENA_DATA_DIR": str(tmp_path / "rollout"),
                             "ARENA_PUBLIC_URL": f"http://{sandbox_ns.host_ip}:{rollout_port}"})
            trajectory = start("trajectory", [sys.executable, "-m", "arena_trajectory"],
                               {**host_env, "ARENA_DATA_DIR": str(tmp_path / "trajectory")})
            # the workers: their own namespace and data directory, NATS by its veth address only
            for ns, name, module in ((sandbox_ns, "sandbox", "arena_sandbox"),
                                     (verify_ns, "verification", "arena_verification")):
                env = {**os.environ, "PYTHONUNBUFFERED": "1", "ARENA_DATA_DIR": str(tmp_path / f"{name}-host"),
                       "ARENA_NATS_URL": f"nats://{ns.host_ip}:{nats.port}",
                       "ARENA_PUBLIC_URL": f"http://{ns.host_ip}:{rollout_port}"}
                start(name, ["ip", "netns", "exec", ns.name, sys.executable, "-m", module], env)
            for child, port in ((rollout, rollout_port), (trajectory, trajectory_port)):
                await asyncio.to_thread(wait_port, "127.0.0.1", port, 60, child.proc)
            # the workers see NATS and the proxy on their veth address, nothing on the host's loopback
            assert sandbox_ns.reaches(sandbox_ns.host_ip, nats.port)
            assert sandbox_ns.reaches(sandbox_ns.host_ip, rollout_port)
            assert not sandbox_ns.reaches("127.0.0.1", nats.port)
            assert not verify_ns.reaches("127.0.0.1", trajectory_port)

            bus = await Bus.connect(nats.url, "test-admin")
            try:
                key, _ = await apikeys.issue(bus, "test", ["submit", "read"])
            finally:
                await bus.close()
            task = load_task(ROOT / "examples" / "quickstart" / "task.json")

            def run_group():
                with ArenaClient(f"http://127.0.0.1:{rollout_port}", f"http://127.0.0.1:{trajectory_port}",
                                 api_key=key, timeout=60) as client:
                    group = client.submit_group(client.prepare(task), n=2, seed=1)
                    views = [client.wait(rid, timeout=300) for rid in group.rollout_ids]
                    return views, [client.wait_trajectory(v.rollout_id, timeout=60) for v in views]

            views, trajectories = await asyncio.wait_for(asyncio.to_thread(run_group), 420)
            assert [v.state for v in views] == [RolloutState.COMPLETED] * 2, [(v.state, v.reason) for v in views]
            assert all(v.reward is not None for v in views)
            for t in trajectories:
                assert t.steps and t.sandbox is not None and t.sandbox.diff  # the diff came over NATS
            # each worker wrote only under its own data directory
            assert (tmp_path / "sandbox-host").exists() and (tmp_path / "verification-host").exists()
    finally:
        for child in reversed(children):
            child.stop()
        nats.stop()
