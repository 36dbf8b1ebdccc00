"""compose.yaml for real: `podman-compose up` brings up NATS, the four services and the
scripted LLM from the images `make images` builds here (arena/server, arena/nats:
compose.local.yaml, no registry), a group of the quickstart task is submitted from the
host with `arena submit` (the CLI of this environment, against the ports compose publishes
on 127.0.0.1), its rewards and trajectories are read back, and the stack is torn down with
its volumes (`podman-compose down -v`) whatever happens.

Runs only with ``ARENA_COMPOSE=1`` (`make test-compose`); skipped, with the reason, where
podman-compose or the images are missing. As root the images are in the store of
deploy/docker-engine.sh's engine, and podman-compose runs podman on it through
deploy/images/engine-podman. Prints its timings.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from arena_stack import natsauth
from arena_stack.natsserver import js_api_info

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
ENGINE_PODMAN = ROOT / "deploy" / "images" / "engine-podman"
IMAGES = ("arena/server:latest", "arena/nats:latest")
GROUP = 4
#: containers that must answer their health check; the scripted LLM's name as compose makes it
SERVICES = ("nats", "scripted-llm", "rollout", "trajectory", "sandbox", "verification", "dashboard")

pytestmark = [
    pytest.mark.skipif(os.environ.get("ARENA_COMPOSE") != "1",
                       reason="compose runs for real only with ARENA_COMPOSE=1 (make test-compose)"),
    pytest.mark.timeout(900),
]


def _podman_compose() -> str | None:
    beside = Path(sys.executable).parent / "podman-compose"
    return str(beside) if beside.exists() else shutil.which("podman-compose")


def _podman() -> str | None:
    if not shutil.which("podman"):
        return None
    return str(ENGINE_PODMAN)  # root: the engine's store; else the user's podman


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _arena() -> str:
    beside = Path(sys.executable).parent / "arena"
    return str(beside) if beside.exists() else "arena"


class Stack:
    def __init__(self, compose: str, podman: str, tmp: Path):
        self.project = f"arenatest{uuid.uuid4().hex[:8]}"
        self.compose = compose
        self.podman = podman
        self.ports = {"rollout": _free_port(), "trajectory": _free_port(), "nats": _free_port(),
                      "dashboard": _free_port()}
        self.env = dict(os.environ)
        for name in list(self.env):  # nothing of the caller's own stack leaks into compose's interpolation
            if name.startswith("ARENA_") and name != "ARENA_ENGINE_DIR":  # (the engine's store stays)
                del self.env[name]
        self.env.update({"ARENA_PUBLISH_ROLLOUT": str(self.ports["rollout"]),
                         "ARENA_PUBLISH_TRAJECTORY": str(self.ports["trajectory"]),
                         "ARENA_PUBLISH_NATS": str(self.ports["nats"]),
                         "ARENA_PUBLISH_DASHBOARD": str(self.ports["dashboard"]),
                         "ARENA_DATA_DIR": str(tmp)})  # the CLI finds no local key file of `arena up`
        # the NATS users' passwords compose requires, as `python -m arena_stack.natsauth env` makes them
        self.nats_passwords = {u: pw for u, pw in natsauth.passwords().items() if u in natsauth.PERMISSIONS}
        self.env.update({natsauth.env_name(u): pw for u, pw in self.nats_passwords.items()})
        self.rollout_url = f"http://127.0.0.1:{self.ports['rollout']}"
        self.trajectory_url = f"http://127.0.0.1:{self.ports['trajectory']}"
        self.nats_url = natsauth.with_user(f"nats://127.0.0.1:{self.ports['nats']}", "admin",
                                           self.nats_passwords["admin"])
        self.dashboard_url = f"http://127.0.0.1:{self.ports['dashboard']}"

    def compose_cmd(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        argv = [self.compose, "--podman-path", self.podman, "-p", self.project,
                "-f", str(ROOT / "compose.yaml"), "-f", str(ROOT / "compose.local.yaml"), *args]
        return subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)

    def containers(self) -> dict[str, str]:
        """service -> container name, for this project's containers."""
        out = subprocess.run([self.podman, "ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}",
                              "--format", "{{.Names}}\t{{index .Labels \"com.docker.compose.service\"}}"],
                             capture_output=True, text=True, env=self.env, timeout=60).stdout
        return {svc: name for name, _, svc in (line.partition("\t") for line in out.splitlines()) if svc}

    def healthy(self, container: str) -> bool:
        # Podman runs health checks from systemd timers; where there is no systemd (here) it
        # schedules none, so each check is run on demand: the same command, the same verdict.
        return subprocess.run([self.podman, "healthcheck", "run", container], capture_output=True,
                              env=self.env, timeout=60).returncode == 0

    def logs(self, tail: int = 30) -> str:
        parts = []
        for svc, name in sorted(self.containers().items()):
            out = subprocess.run([self.podman, "logs", "--tail", str(tail), name], capture_output=True, text=True,
                                 env=self.env, timeout=60)
            parts.append(f"--- {svc} ({name})\n{out.stdout}{out.stderr}")
        return "\n".join(parts)


def test_compose_stack_runs_a_quickstart_group(tmp_path):
    compose = _podman_compose()
    if compose is None:
        pytest.skip("podman-compose is not installed (pip install podman-compose)")
    podman = _podman()
    if podman is None:
        pytest.skip("podman is not installed")
    missing = [i for i in IMAGES if subprocess.run([podman, "image", "exists", i], capture_output=True,
                                                   timeout=60).returncode != 0]
    if missing:
        pytest.skip(f"images missing: {', '.join(missing)} (make images, or ARENA_IMAGES='server nats' make images)")

    stack = Stack(compose, podman, tmp_path)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    ok = False
    try:
        up = stack.compose_cmd("up", "-d")
        timings["up -d"] = time.monotonic() - t0
        assert up.returncode == 0, f"podman-compose up failed:\n{up.stdout}\n{up.stderr}"
        containers = stack.containers()
        assert set(SERVICES) <= set(containers), f"containers: {containers}"

        # health: every container's own check, and the published APIs from the host
        t = time.monotonic()
        deadline = t + 180
        pending = set(SERVICES)
        while pending and time.monotonic() < deadline:
            pending = {svc for svc in pending if not stack.healthy(containers[svc])}
            if pending:
                time.sleep(1)
        assert not pending, f"not healthy after 180 s: {sorted(pending)}\n{stack.logs()}"
        with httpx.Client(timeout=5) as http:
            for url in (stack.rollout_url, stack.trajectory_url):
                assert http.get(f"{url}/readyz").status_code == 200
        timings["healthy"] = time.monotonic() - t

        # NATS's published port lets no one in without a password
        assert js_api_info(stack.ports["nats"]) is None
        # an API key, made through NATS's published port as its administrator (keys are on by default)
        env = dict(stack.env)
        has_keys = subprocess.run([_arena(), "keys", "--help"], capture_output=True, env=env,
                                  timeout=60).returncode == 0
        if has_keys:
            made = subprocess.run([_arena(), "keys", "create", "--nats-url", stack.nats_url, "--name", "test-compose",
                                   "--scope", "submit", "--scope", "read"], capture_output=True, text=True, env=env,
                                  timeout=60)
            assert made.returncode == 0, made.stderr
            env["ARENA_API_KEY"] = made.stdout.strip().splitlines()[-1]

        # a group of the quickstart task from the host: its directories travel as bundles
        t = time.monotonic()
        submitted = subprocess.run([_arena(), "--url", stack.rollout_url, "--trajectory-url", stack.trajectory_url,
                                    "submit", str(QUICKSTART), "--n", str(GROUP), "--seed", "0", "--wait",
                                    "--timeout", "300"], capture_output=True, text=True, env=env, timeout=400)
        timings["submit --wait"] = time.monotonic() - t
        print(submitted.stdout)
        lines = submitted.stdout.splitlines()
        assert lines and lines[0].startswith("group "), f"{submitted.stdout}\n{submitted.stderr}\n{stack.logs()}"
        group_id = lines[0].split()[1]
        rollout_ids = lines[1:1 + GROUP]
        assert submitted.returncode == 0, f"not every rollout completed:\n{submitted.stdout}\n{submitted.stderr}\n" \
                                          f"{stack.logs()}"
        rewards = {}
        for line in lines[1 + GROUP:]:
            rid, state, _, reward = line.split()[:4]
            assert state == "completed", line
            rewards[rid] = float(reward)
        assert set(rewards) == set(rollout_ids)
        # the scripted LLM's answers for seeds 0..3: two fix the bug, two do not
        assert sorted(rewards.values()) == [0.0, 0.0, 1.0, 1.0], rewards

        # trajectories and the group through the trajectory API
        t = time.monotonic()
        headers = {"Authorization": f"Bearer {env['ARENA_API_KEY']}"} if "ARENA_API_KEY" in env else {}
        with httpx.Client(base_url=stack.trajectory_url, headers=headers, timeout=10) as http:
            for rid in rollout_ids:
                deadline = time.monotonic() + 60
                while (resp := http.get(f"/v1/trajectories/{rid}")).status_code == 404 and time.monotonic() < deadline:
                    time.sleep(0.5)
                assert resp.status_code == 200, resp.text
                traj = resp.json()
                assert traj["final_state"] == "completed" and traj["reward"] == rewards[rid], traj
                assert traj["steps"], f"{rid}: no steps"
                for step in traj["steps"]:
                    assert step["prompt_token_ids"] and step["completion_token_ids"], step
                assert traj["verification"] is not None
            deadline = time.monotonic() + 60
            while (resp := http.get(f"/v1/groups/{group_id}")).status_code == 404 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert resp.status_code == 200, resp.text
            summary = resp.json()
            assert sorted(summary["rewards"]) == [0.0, 0.0, 1.0, 1.0], summary
        timings["trajectories"] = time.monotonic() - t
        # the dashboard's figures: the group's four rollouts, two passed (its own key check: bearer)
        with httpx.Client(base_url=stack.dashboard_url, headers=headers, timeout=10) as http:
            overview = http.get("/api/stats/overview").json()
            assert overview["rollouts"] == GROUP and overview["success_rate"] == 0.5, overview
            assert "Arena" in http.get("/").text
        print(f"group {group_id}: rewards {json.dumps(summary['rewards'])}, "
              f"advantages {[round(a, 3) for a in summary['advantages']]}")
        ok = True
    finally:
        if not ok:
            print(stack.logs(60))
        t = time.monotonic()
        down = stack.compose_cmd("down", "-v")
        timings["down -v"] = time.monotonic() - t
        timings["total"] = time.monotonic() - t0
        print("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
        leftover = stack.containers()
        assert down.returncode == 0 and not leftover, f"down -v: {down.stderr}\nleft: {leftover}"
