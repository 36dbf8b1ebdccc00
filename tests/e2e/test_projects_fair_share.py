"""Per-project quotas, priorities and weighted fair sharing of the sandbox slots, through the
real stack (nats-server, the services as processes, bubblewrap sandboxes, the waiting agents of
``arena_stack.waiting_agents`` against a stand-in backend of fixed latency, ``ARENA_AUTH=keys``).

Three projects share ``SLOTS`` sandbox slots: ``heavy`` (weight 1, at most 2 sandboxes) and
``medium`` (weight 3) each submit a backlog; ``light`` (priority ``high``) submits a few while
both wait. Everything asserted comes from the rollouts' own histories (when each took its slot,
``provisioning``, and gave it back, leaving ``running``), never from durations: the slots and
``heavy``'s limit are never exceeded, no lower-class rollout starts while a ``light`` one waits,
and while both backlogs wait ``medium`` gets the larger share. A fourth project, ``capped`` (1
sandbox, 2 queued), shows a project at its limit waiting (its rollouts stay ``pending``) and a
submission beyond its queue refused with 429 naming its limit. The settings go through the admin
API and ``arena projects``."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from arena.sdk import ArenaClient
from arena_core import apikeys
from arena_core.bus import Bus
from arena_core.errors import Overloaded
from arena_core.schemas import RolloutState
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack
from arena_stack.waiting_agents import StandInBackend, waiting_task, write_agent

S = RolloutState
SLOTS, TURNS, LATENCY_S = 3, 1, 0.3
HEAVY_N, MEDIUM_N, LIGHT_N = 12, 12, 3

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.timeout(600)]


def slot_of(view) -> tuple[float, float]:
    """(took its slot, gave it back) from the rollout's own history."""
    took = next(t.at for t in view.history if t.to_state == S.PROVISIONING)
    back = next(t.at for t in view.history if t.from_state in (S.PROVISIONING, S.RUNNING)
                and t.to_state not in (S.PROVISIONING, S.RUNNING))
    return took, back


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    return max(sum(1 for a, b in intervals if a <= t < b) for t, _ in intervals)


def arena(settings: Settings, key: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ARENA_URL": settings.rollout_url, "ARENA_TRAJECTORY_URL": settings.trajectory_url,
           "ARENA_API_KEY": key}
    return subprocess.run([sys.executable, "-m", "arena.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


async def make_keys(stack: Stack) -> dict[str, str]:
    bus = await Bus.connect(stack.direct_nats_url(), "test-fair-share")
    try:
        made = {"admin": await apikeys.issue(bus, "admin", ["admin"])}
        for project in ("heavy", "medium", "light", "capped"):
            made[project] = await apikeys.issue(bus, project, ["submit", "read"], project)
    finally:
        await bus.close()
    keys = {who: key for who, (key, _) in made.items()}
    with httpx.Client(timeout=10) as http:  # until the rollout service's key watch knows them all
        for key in keys.values():
            for _ in range(600):
                if http.get(f"{stack.settings.rollout_url}/v1/projects",
                            headers={"authorization": f"Bearer {key}"}).status_code == 200:
                    break
                time.sleep(0.05)
    return keys


async def test_quotas_priorities_and_weighted_fair_share(tmp_path):
    agent_dir = write_agent(tmp_path / "agent")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "README.md").write_text("a task whose agent mostly waits\n")
    with StandInBackend(free_port(), median_s=LATENCY_S, sigma=0.0, limit=0, log=tmp_path / "backend.log") as backend:
        rp = free_port()
        settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                            rollout_port=rp, trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
                            backend_url=backend.url, backend_policy_version="0", allow_host_paths=True,
                            sandbox_concurrency=SLOTS, verify_concurrency=2, auth="keys")
        stack = Stack(settings, log=lambda m: None)
        await stack.start()
        try:
            keys = await make_keys(stack)
            await asyncio.to_thread(run, settings, keys, repo, agent_dir)
        finally:
            stack.stop()


def run(settings: Settings, keys: dict[str, str], repo, agent_dir) -> None:
    clients = {who: ArenaClient(settings.rollout_url, settings.trajectory_url, timeout=120, api_key=key,
                           overload_wait=0)
               for who, key in keys.items()}
    try:
        settings_api_and_cli(settings, keys, clients)
        task = waiting_task(repo, agent_dir, index=0, turns=TURNS, wall_clock_s=60)  # admission: 24 fit
        capped_waits_and_refuses(clients["capped"], task)
        shares(clients, task)
    finally:
        for client in clients.values():
            client.close()


def settings_api_and_cli(settings: Settings, keys: dict[str, str], clients: dict[str, ArenaClient]) -> None:
    # the CLI with the admin key
    done = arena(settings, keys["admin"], "projects", "set", "heavy", "--max-sandboxes", "2", "--weight", "1")
    assert done.returncode == 0, done.stderr
    assert "project heavy: max sandboxes 2, max queued unlimited, priority normal, weight 1" in done.stdout
    done = arena(settings, keys["admin"], "projects", "set", "medium", "--weight", "3")
    assert done.returncode == 0, done.stderr
    # the API with the admin key
    admin = clients["admin"]
    assert admin.set_project("light", priority="high")["priority"] == "high"
    got = admin.set_project("capped", max_sandboxes=1, max_queued=2)
    assert (got["max_sandboxes"], got["max_queued"], got["priority"], got["weight"]) == (1, 2, "normal", 1.0)
    # a field left out keeps its stored value
    assert admin.set_project("heavy", max_queued=100)["max_sandboxes"] == 2
    listed = {q["project"]: q for q in admin.projects()["projects"]}
    assert {"heavy", "medium", "light", "capped"} <= set(listed)
    assert (listed["medium"]["weight"], listed["light"]["priority"], listed["heavy"]["max_queued"]) == (3, "high", 100)
    done = arena(settings, keys["admin"], "projects", "list")
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:]}
    assert rows["medium"][1:3] == ["normal", "3"] and rows["light"][1] == "high", done.stdout
    # a project's key sees its own project's settings, and may not set any
    own = clients["heavy"].projects()["projects"]
    assert [q["project"] for q in own] == ["heavy"] and own[0]["max_sandboxes"] == 2
    refused = httpx.put(f"{settings.rollout_url}/v1/projects/heavy", json={"max_sandboxes": 100},
                        headers={"authorization": f"Bearer {keys['heavy']}"})
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "forbidden"
    done = arena(settings, keys["heavy"], "projects", "set", "heavy", "--max-sandboxes", "100")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    # invalid settings: a clear 422
    for body in ({"priority": "urgent"}, {"weight": 0}, {"max_sandboxes": -1}, {"slots": 3}):
        bad = httpx.put(f"{settings.rollout_url}/v1/projects/heavy", json=body,
                        headers={"authorization": f"Bearer {keys['admin']}"})
        assert bad.status_code == 422, (body, bad.text)
    assert clients["admin"].projects()["defaults"] == {"project": "any", "max_sandboxes": 0, "max_queued": 0,
                                                       "priority": "normal", "weight": 1.0, "updated_at": 0.0}


def capped_waits_and_refuses(client: ArenaClient, task) -> None:
    """At its one sandbox, ``capped``'s next rollouts wait ``pending``; a third waiting one is 429."""
    sleeper = msgspec.structs.replace(task, agent=msgspec.structs.replace(
        task.agent, command=["python3", "-c", "import time; time.sleep(600)"]))
    first = client.submit(sleeper)
    for _ in range(600):
        if client.get(first.rollout_id).state in (S.PROVISIONING, S.RUNNING):
            break
        time.sleep(0.1)
    waiting = client.submit_group(sleeper, n=2)
    with pytest.raises(Overloaded) as refused:
        client.submit(sleeper)
    assert "project 'capped'" in str(refused.value) and "at most 2" in str(refused.value), str(refused.value)
    assert refused.value.retry_after >= 1
    # its two wait: pending, not failed, while its one sandbox is held
    assert [client.get(rid).state for rid in waiting.rollout_ids] == [S.PENDING, S.PENDING]
    mine = client.projects()["projects"][0]
    assert (mine["project"], mine["sandboxes"], mine["waiting"]) == ("capped", 1, 2)
    for rid in [*waiting.rollout_ids, first.rollout_id]:  # the waiting ones first: the slot stays held meanwhile
        client.cancel(rid)
    for rid in [first.rollout_id, *waiting.rollout_ids]:
        assert client.wait(rid, timeout=120).state == S.CANCELLED
    # a cancelled pending rollout never took a slot
    assert all(t.to_state != S.PROVISIONING for rid in waiting.rollout_ids for t in client.get(rid).history)


def shares(clients: dict[str, ArenaClient], task) -> None:
    heavy = clients["heavy"].submit_group(task, n=HEAVY_N).rollout_ids
    medium_submitted = time.time()
    medium = clients["medium"].submit_group(task, n=MEDIUM_N).rollout_ids
    # light comes once medium holds a slot: every slot busy, both backlogs waiting
    for _ in range(1200):
        if any(clients["medium"].get(rid).state != S.PENDING for rid in medium):
            break
        time.sleep(0.05)
    light = clients["light"].submit_group(task, n=LIGHT_N).rollout_ids
    light_submitted = time.time()  # every light rollout is in the rollout service's queue by now
    views = {}
    for who, rids in (("heavy", heavy), ("medium", medium), ("light", light)):
        for rid in rids:
            view = clients[who].wait(rid, timeout=300)
            assert (view.state, view.reward) == (S.COMPLETED, 1.0), (who, view.state, view.reason)
            views[rid] = (who, view)
    slots = {rid: slot_of(v) for rid, (_, v) in views.items()}
    by = {who: [slots[rid] for rid, (w, _) in views.items() if w == who] for who in ("heavy", "medium", "light")}
    # the host's slots and heavy's limit held at every instant
    assert most_at_once(list(slots.values())) <= SLOTS, sorted(slots.values())
    assert most_at_once(by["heavy"]) <= 2, sorted(by["heavy"])
    # priority: no lower-class rollout took a slot while a light one waited
    last_light = max(took for took, _ in by["light"])
    jumped = [took for who in ("heavy", "medium") for took, _ in by[who] if light_submitted < took < last_light]
    assert not jumped, (jumped, last_light, light_submitted)
    later = [took for who in ("heavy", "medium") for took, _ in by[who] if took > last_light]
    assert later, "the light rollouts came after both backlogs were served: nothing was waiting"
    # weighted fair share: while both backlogs waited, medium (weight 3) took more slots than heavy (weight 1)
    until = min(max(took for took, _ in by["heavy"]), max(took for took, _ in by["medium"]))
    heavy_n = sum(1 for took, _ in by["heavy"] if medium_submitted <= took <= until)
    medium_n = sum(1 for took, _ in by["medium"] if medium_submitted <= took <= until)
    assert medium_n >= 2 * heavy_n and medium_n >= 4, (medium_n, heavy_n)
