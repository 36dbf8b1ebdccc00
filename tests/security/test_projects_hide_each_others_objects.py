"""Projects through the real stack (nats-server, the four services as processes, the scripted
LLM, ``ARENA_AUTH=keys``): two projects' keys, ``alpha`` (two keys: ``a1`` makes everything,
``a2`` is its colleague) and ``beta`` (``b``), and an ``admin`` key.

Every operation of both OpenAPI documents (rollout and trajectory services) is called with
``b`` on ``alpha``'s objects and answers 404 ``not_found`` (the object does not exist for it),
while ``a1`` reaches them; lists, statistics and exports leave the other project out; names
(environments, evaluation jobs) are per project; within a project the owner rule stays (403
for ``a2``); the trainer stream hands each project its own groups; an evaluation report is
never overwritten by another key. A new route fails ``test_every_route`` until it is given a
case here (``CASES``): nobody adds a route without deciding what another project sees."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.stream import TrajectoryStream
from arena.tasks import load_task
from arena_core import apikeys, sources
from arena_core.bus import Bus
from arena_core.schemas import AgentSpec, BundleSource
from arena_stack.stack import Stack, free_port_settings
from tests.duel_backends import register, replica

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

pytestmark = [pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
              pytest.mark.timeout(900)]


@dataclass
class World:
    stack: Stack
    keys: dict[str, str]  # who -> the key
    alpha: dict[str, str] = field(default_factory=dict)  # what -> alpha's object id
    beta: dict[str, str] = field(default_factory=dict)
    alpha_rollouts: list[str] = field(default_factory=list)
    beta_rollouts: list[str] = field(default_factory=list)
    alpha_groups: list[str] = field(default_factory=list)
    beta_groups: list[str] = field(default_factory=list)
    alpha_task: dict = field(default_factory=dict)  # a prepared task of alpha (its bundles uploaded by a1)

    @property
    def rollout_url(self) -> str:
        return self.stack.settings.rollout_url

    @property
    def trajectory_url(self) -> str:
        return self.stack.settings.trajectory_url

    def h(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[who]}"}

    def alpha_markers(self) -> list[str]:
        return [*self.alpha_rollouts, *self.alpha_groups, *self.alpha.values(), "alpha-task"]

    def beta_markers(self) -> list[str]:
        return [*self.beta_rollouts, *self.beta_groups, *self.beta.values(), "beta-task"]


async def issue(stack: Stack) -> dict[str, str]:
    bus = await Bus.connect(stack.direct_nats_url(), "test-projects")
    try:
        made = {"a1": await apikeys.issue(bus, "a1", ["submit", "read"], "alpha"),
                "a2": await apikeys.issue(bus, "a2", ["submit", "read"], "alpha"),
                "b": await apikeys.issue(bus, "b", ["submit", "read"], "beta"),
                "admin": await apikeys.issue(bus, "admin", ["admin"], "alpha")}
    finally:
        await bus.close()
    return {who: key for who, (key, _) in made.items()}


def until_known(world: World) -> None:
    """Until both APIs know every key (each follows the keys' bucket): neither 401 nor 503."""
    with httpx.Client(timeout=10) as http:
        for who in world.keys:
            for base in (world.rollout_url, world.trajectory_url):
                for _ in range(600):
                    if http.get(f"{base}/v1/evals", headers=world.h(who)).status_code not in (401, 503):
                        break
                    time.sleep(0.05)


def finished(client: ArenaClient, rollout_ids: list[str]) -> None:
    """Until each rollout's trajectory is stored (whatever its end: what it is does not matter here)."""
    for rid in rollout_ids:
        view = client.wait(rid, timeout=300)
        assert view.state.is_final, (view.state, view.reason)
        client.wait_trajectory(rid, timeout=120)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    data_dir = tmp_path_factory.mktemp("arena-projects")
    settings = free_port_settings(data_dir, sandbox_concurrency=2, verify_concurrency=1, allow_host_paths=True,
                                  auth="keys")
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        world = World(stack=stack, keys=asyncio.run(issue(stack)))
        until_known(world)
        # a duel needs its two policies on two models: "policy-one" is named by a replica of its
        # own (the same scripted LLM), "policy-two" goes to the stack's default replica
        asyncio.run(register(stack.direct_nats_url(), replica("one", settings.backend_url, "policy-one")))
        task = load_task(QUICKSTART)
        # a loaded 2-core host can take more than the quickstart's 60 s to run its agent
        task = msgspec.structs.replace(task, budget=msgspec.structs.replace(task.budget, wall_clock_s=300))
        alpha = ArenaClient(world.rollout_url, world.trajectory_url, api_key=world.keys["a1"])
        beta = ArenaClient(world.rollout_url, world.trajectory_url, api_key=world.keys["b"])
        # the same repository's bundle is uploaded by both projects (each sees it as its own)
        group = alpha.submit_group(msgspec.structs.replace(task, id="alpha-task"), n=2, seed=0)
        world.alpha_rollouts += group.rollout_ids
        world.alpha_groups.append(group.group_id)
        group = beta.submit_group(msgspec.structs.replace(task, id="beta-task"), n=2, seed=0)
        world.beta_rollouts += group.rollout_ids
        world.beta_groups.append(group.group_id)
        prepared = alpha.prepare(msgspec.structs.replace(task, id="alpha-task"))
        world.alpha_task = msgspec.to_builtins(prepared)
        with httpx.Client(timeout=60) as http:
            for _ in range(200):  # until the rollout service follows the "one" replica
                duel = http.post(f"{world.rollout_url}/v1/duels", headers=world.h("a1"), json={
                    "task": world.alpha_task, "policies": ["policy-one", "policy-two"], "n": 1})
                if duel.status_code != 422:
                    break
                time.sleep(0.1)
            assert duel.status_code == 201, duel.text
            world.alpha["duel"] = duel.json()["duel_id"]
            world.alpha_groups += duel.json()["groups"]
            world.alpha_rollouts += [r for side in duel.json()["rollout_ids"] for r in side]
            # a bundle only alpha uploaded
            secret = data_dir / "alpha-secret"
            secret.mkdir()
            (secret / "SECRET.txt").write_text("alpha's hidden tests\n")
            pushed = http.post(f"{world.rollout_url}/v1/bundles", headers=world.h("a1"),
                               content=sources.pack_dir(secret))
            assert pushed.status_code == 201, pushed.text
            world.alpha["bundle"] = pushed.json()["digest"]
            external = {**world.alpha_task, "agent": msgspec.to_builtins(AgentSpec(external=True))}
            env = http.put(f"{world.rollout_url}/v1/environments/alpha-env", headers=world.h("a1"),
                           json={"task": external})
            assert env.status_code == 200 and env.json()["project"] == "alpha", env.text
            world.alpha["env"] = "alpha-env"
            report = http.post(f"{world.trajectory_url}/v1/evals", headers=world.h("a1"),
                               content=eval_report("alpha-job", agent="alpha's agent"))
            assert report.status_code == 201, report.text
            world.alpha["job"] = "alpha-job"
            metrics = http.post(f"{world.trajectory_url}/v1/trainer-metrics", headers=world.h("a1"),
                                json={"run": "alpha-run", "step": 1, "at": time.time(), "metrics": {"loss": 1.0}})
            assert metrics.status_code == 201, metrics.text
            world.alpha["run"] = "alpha-run"
        finished(alpha, world.alpha_rollouts)
        finished(beta, world.beta_rollouts)
        with httpx.Client(timeout=60) as http:
            rid = world.alpha_rollouts[0]
            trajectory = http.get(f"{world.trajectory_url}/v1/trajectories/{rid}", headers=world.h("a1")).json()
            assert trajectory.get("sequences"), trajectory.get("reason")  # its agent made an LLM call
            tokens = len(trajectory["sequences"][0]["token_ids"])
            logprobs = http.post(f"{world.trajectory_url}/v1/trainer-logprobs", headers=world.h("a1"), json={
                "run": "alpha-run", "rollout_id": rid, "sequence_index": 0, "logprobs": [-0.5] * tokens})
            assert logprobs.status_code == 201, logprobs.text
        alpha.close()
        beta.close()
        yield world
    finally:
        stack.stop()


def eval_report(job_id: str, *, agent: str, version: int = 1) -> bytes:
    return json.dumps({"spec": {"job_id": job_id, "created_at": time.time(), "dataset": "d", "agent": agent,
                                "models": ["m"], "k": 1, "tasks": [{"task_id": "t"}]},
                       "models": [{"model": "m"}], "grading": {"version": version}}).encode()


# ----------------------------------------------------------------------------- the cases

#: How a route is called on ``alpha``'s objects, and what each key must get:
#: ``object``: the path names one of alpha's objects: ``b`` gets 404 ``not_found`` naming none of
#: alpha's objects, and alpha's key reaches it (not 401/403/404; ``a2`` instead of ``a1`` where
#: ``a1`` would change it: the owner rule answers 403 there). ``listing``: ``b``'s answer names
#: none of alpha's objects, ``a1``'s none of beta's. ``create``: ``b`` makes its own (the status
#: given), never touching alpha's: a task naming alpha's bundle is refused (422), a name alpha
#: uses is beta's own (the tests below check alpha's is untouched).
OBJECT, LISTING, CREATE = "object", "listing", "create"


@dataclass(frozen=True)
class Case:
    kind: str
    kwargs: object = lambda w, who: {}  # noqa: E731 - (world, who) -> httpx request keywords
    own: str = "a1"  # who of alpha calls it
    created: int = 0  # create: b's status
    cleanup: str = ""  # create: a path b deletes after (its own object)


def fill(world: World, path: str) -> str:
    ids = {"rollout_id": world.alpha_rollouts[0], "group_id": world.alpha_groups[0], "duel_id": world.alpha["duel"],
           "digest": world.alpha["bundle"], "name": world.alpha["env"], "job_id": world.alpha["job"],
           "project": "alpha"}
    return re.sub(r"\{([^}]+)\}", lambda m: ids[m.group(1)], path)


def task_naming_alpha_bundle(world: World) -> dict:
    """Alpha's task with its source the bundle only alpha uploaded."""
    return {**world.alpha_task, "source": msgspec.to_builtins(BundleSource(digest=world.alpha["bundle"])),
            "repo": ""}


def external_task(world: World) -> dict:
    return {**world.alpha_task, "agent": msgspec.to_builtins(AgentSpec(external=True))}


CASES: dict[tuple[str, str], Case] = {
    ("GET", "/v1/rollouts"): Case(LISTING),
    ("GET", "/v1/rollouts/{rollout_id}"): Case(OBJECT),
    ("GET", "/v1/rollouts/{rollout_id}/wait"): Case(OBJECT, lambda w, who: {"params": {"timeout": "0.1"}}),
    ("POST", "/v1/rollouts/{rollout_id}/cancel"): Case(OBJECT, own="a2"),
    ("GET", "/v1/rollouts/{rollout_id}/events"): Case(OBJECT, lambda w, who: {"stream": True}),
    ("POST", "/v1/rollouts"): Case(CREATE, lambda w, who: {"json": {"task": task_naming_alpha_bundle(w)}},
                                   created=422),
    ("POST", "/v1/rollout-groups"): Case(CREATE, lambda w, who: {"json": {"task": task_naming_alpha_bundle(w),
                                                                           "n": 1}}, created=422),
    ("POST", "/v1/duels"): Case(CREATE, lambda w, who: {"json": {"task": task_naming_alpha_bundle(w), "n": 1,
                                                                 "policies": ["policy-one", "policy-two"]}},
                                created=422),
    ("POST", "/v1/bundles"): Case(CREATE, lambda w, who: {"content": sources.pack_dir(QUICKSTART / "agent")},
                                  created=201),
    ("GET", "/v1/bundles/{digest}"): Case(OBJECT),
    ("GET", "/v1/bundles/{digest}/archive"): Case(OBJECT),
    ("GET", "/v1/environments"): Case(LISTING),
    # projects' quotas: a project's key lists its own project's; setting them needs an admin key
    ("GET", "/v1/projects"): Case(LISTING),
    ("PUT", "/v1/projects/{project}"): Case(CREATE, lambda w, who: {"json": {"weight": 2}}, created=403),
    ("GET", "/v1/environments/{name}"): Case(OBJECT),
    ("PUT", "/v1/environments/{name}"): Case(CREATE, lambda w, who: {"json": {"task": external_task(w)}},
                                             created=200, cleanup="/v1/environments/{name}"),
    ("DELETE", "/v1/environments/{name}"): Case(OBJECT, own="a2"),
    ("GET", "/openenv/{name}/health"): Case(OBJECT),
    ("GET", "/openenv/{name}/metadata"): Case(OBJECT),
    ("GET", "/openenv/{name}/schema"): Case(OBJECT),
    ("GET", "/openenv/{name}/openapi.json"): Case(OBJECT),
    ("GET", "/openenv/{name}/state"): Case(OBJECT),
    ("POST", "/openenv/{name}/mcp"): Case(OBJECT, lambda w, who: {"json": {"jsonrpc": "2.0", "id": 1,
                                                                           "method": "tools/list"}}),
    ("POST", "/openenv/{name}/reset"): Case(OBJECT, lambda w, who: {"json": {}}),
    ("POST", "/openenv/{name}/step"): Case(OBJECT, lambda w, who: {"json": {}}),  # a1: 422, no action
    # the trajectory service
    ("GET", "/v1/trajectories"): Case(LISTING),
    ("GET", "/v1/trajectories/{rollout_id}"): Case(OBJECT),
    ("GET", "/v1/trajectories/{rollout_id}/trainer-logprobs"): Case(OBJECT),
    ("GET", "/v1/groups/{group_id}"): Case(OBJECT),
    ("GET", "/v1/export/trajectories"): Case(LISTING),
    ("GET", "/v1/stats/rewards"): Case(LISTING),
    ("GET", "/v1/stats/pass-rates"): Case(LISTING),
    ("GET", "/v1/stats/tokens"): Case(LISTING),
    ("GET", "/v1/stats/latency"): Case(LISTING),
    ("GET", "/v1/stats/overview"): Case(LISTING),
    ("GET", "/v1/stats/live"): Case(LISTING),
    ("GET", "/v1/stats/verification"): Case(LISTING),
    ("GET", "/v1/stats/tasks"): Case(LISTING, lambda w, who: {"params": {"min_attempts": "1"}}),
    ("GET", "/v1/stats/token-usage"): Case(LISTING),
    ("GET", "/v1/stats/training"): Case(LISTING),
    ("GET", "/v1/counts"): Case(LISTING),
    ("GET", "/v1/trainer-metrics"): Case(LISTING, lambda w, who: {"params": {"run": "alpha-run"}}),
    ("POST", "/v1/trainer-metrics"): Case(CREATE, lambda w, who: {"json": {"run": f"{who}-run", "step": 1,
                                                                           "at": time.time()}}, created=201),
    ("POST", "/v1/trainer-logprobs"): Case(OBJECT, lambda w, who: {"json": {  # a1: 409, one logprob is too few
        "run": "alpha-run", "rollout_id": w.alpha_rollouts[0], "sequence_index": 0, "logprobs": [-0.5]}}),
    ("GET", "/v1/duels"): Case(LISTING),
    ("GET", "/v1/duels/{duel_id}"): Case(OBJECT),
    ("GET", "/v1/leaderboard"): Case(LISTING),
    ("GET", "/v1/evals"): Case(LISTING),
    ("GET", "/v1/evals/{job_id}"): Case(OBJECT),
    ("POST", "/v1/evals"): Case(CREATE, lambda w, who: {"content": eval_report(f"{who}-job", agent=who)},
                                created=201),
}


def operations(openapi: dict) -> list[tuple[str, str]]:
    return [(method.upper(), path) for path, ops in openapi["paths"].items()
            for method in ops if method in ("get", "post", "put", "delete")]


def call(http: httpx.Client, world: World, base: str, method: str, path: str, who: str) -> httpx.Response:
    kwargs = dict(CASES[(method, path)].kwargs(world, who))
    url = base + fill(world, path)
    if kwargs.pop("stream", False):  # a stream: its status, then the connection is closed
        with http.stream(method, url, headers=world.h(who)) as resp:
            if resp.status_code != 200:
                resp.read()
            return resp
    return http.request(method, url, headers=world.h(who), **kwargs)


def hidden(world: World, resp: httpx.Response, markers: list[str], where: str) -> None:
    """None of ``markers`` (another project's ids) in the answer, but those the request itself named."""
    request = resp.request
    asked = str(request.url) + (request.content.decode(errors="replace") if not request.stream or
                                hasattr(request, "_content") else "")
    for marker in markers:
        if marker not in asked:
            assert marker not in resp.text, (where, marker, resp.text[:300])


def test_every_route(world):
    """Every operation of both documents: another project's object is not found, your own is there."""
    checked = set()
    with httpx.Client(timeout=60) as http:
        for base in (world.rollout_url, world.trajectory_url):
            spec = http.get(f"{base}/openapi.json").json()
            for method, path in operations(spec):
                if path in apikeys.PUBLIC_PATHS or path.startswith(apikeys.OWN_KEYS):
                    continue  # health and the API's description; the proxy and the judge take their own keys
                where = f"{method} {path}"
                assert (method, path) in CASES, f"{where}: a route without a case here (what does another " \
                                                "project see of it?)"
                case = CASES[(method, path)]
                theirs = call(http, world, base, method, path, "b")
                hidden(world, theirs, world.alpha_markers(), where)
                if case.kind == OBJECT:
                    assert theirs.status_code == 404, (where, theirs.status_code, theirs.text[:300])
                    assert theirs.json()["error"]["code"] == "not_found", (where, theirs.text[:300])
                    mine = call(http, world, base, method, path, case.own)
                    assert mine.status_code not in (401, 404), (where, mine.status_code, mine.text[:300])
                    assert mine.status_code != 403 or case.own == "a2", (where, mine.text[:300])
                elif case.kind == LISTING:
                    assert theirs.status_code == 200, (where, theirs.status_code, theirs.text[:300])
                    mine = call(http, world, base, method, path, "a1")
                    assert mine.status_code == 200, (where, mine.status_code, mine.text[:300])
                    hidden(world, mine, world.beta_markers(), where)
                else:
                    assert theirs.status_code == case.created, (where, theirs.status_code, theirs.text[:300])
                    if case.created == 422:
                        assert "is not in Arena's object store" in theirs.json()["error"]["message"], where
                    if case.cleanup:
                        gone = http.delete(base + fill(world, case.cleanup), headers=world.h("b"))
                        assert gone.status_code == 204, (where, gone.text)
                checked.add((method, path))
    assert checked == set(CASES), set(CASES) ^ checked  # every case is a route of the documents
    # alpha's objects are as they were
    with httpx.Client(timeout=60) as http:
        env = http.get(f"{world.rollout_url}/v1/environments/alpha-env", headers=world.h("a1"))
        assert env.status_code == 200 and env.json()["project"] == "alpha"


def test_listings_show_each_project_its_own(world):
    with httpx.Client(timeout=60) as http:
        def get(base: str, path: str, who: str, **params) -> dict:
            resp = http.get(f"{base}{path}", headers=world.h(who), params=params)
            assert resp.status_code == 200, resp.text
            return resp.json()

        listed = {r["rollout_id"] for r in get(world.rollout_url, "/v1/rollouts", "a1")["rollouts"]}
        assert set(world.alpha_rollouts) <= listed and not listed & set(world.beta_rollouts)
        assert {r["project"] for r in get(world.rollout_url, "/v1/rollouts", "b")["rollouts"]} == {"beta"}
        everything = {r["rollout_id"] for r in get(world.rollout_url, "/v1/rollouts", "admin")["rollouts"]}
        assert set(world.alpha_rollouts) | set(world.beta_rollouts) <= everything  # an admin key sees all

        for who, own, other in (("a1", world.alpha_rollouts, world.beta_rollouts),
                                ("b", world.beta_rollouts, world.alpha_rollouts)):
            listed = {t["rollout_id"] for t in get(world.trajectory_url, "/v1/trajectories", who)["trajectories"]}
            assert set(own) <= listed and not listed & set(other), who
            exported = {t["rollout_id"] for t in
                        get(world.trajectory_url, "/v1/export/trajectories", who)["trajectories"]}
            assert set(own) <= exported and not exported & set(other), who
            assert {t["project"] for t in get(world.trajectory_url, "/v1/export/trajectories", who)["trajectories"]} \
                == {"alpha" if who == "a1" else "beta"}
        counts = get(world.trajectory_url, "/v1/counts", "b", table="trajectories")
        overview = get(world.trajectory_url, "/v1/stats/overview", "b")
        assert counts["trajectories"] == overview["rollouts"] == sum(
            1 for t in get(world.trajectory_url, "/v1/trajectories", "b")["trajectories"])
        tasks = {row["task_id"] for row in get(world.trajectory_url, "/v1/stats/tasks", "b", min_attempts=1)["rows"]}
        assert "beta-task" in tasks and "alpha-task" not in tasks, tasks
        assert [d["duel_id"] for d in get(world.trajectory_url, "/v1/duels", "a1")["duels"]] == [world.alpha["duel"]]
        assert get(world.trajectory_url, "/v1/duels", "b")["duels"] == []
        assert get(world.trajectory_url, "/v1/leaderboard", "b")["games"] == 0
        assert get(world.trajectory_url, "/v1/leaderboard", "a1")["games"] >= 0
        assert [e["name"] for e in get(world.rollout_url, "/v1/environments", "b")["environments"]] == []
        assert [e["name"] for e in get(world.rollout_url, "/v1/environments", "a1")["environments"]] == ["alpha-env"]


def test_a_task_cannot_name_another_projects_bundle(world):
    with httpx.Client(timeout=60) as http:
        refused = http.post(f"{world.rollout_url}/v1/rollouts", headers=world.h("b"),
                            json={"task": task_naming_alpha_bundle(world)})
        assert refused.status_code == 422, refused.text
        assert "is not in Arena's object store" in refused.json()["error"]["message"]
        made = http.post(f"{world.rollout_url}/v1/rollouts", headers=world.h("a1"),
                         json={"task": task_naming_alpha_bundle(world)})
        assert made.status_code == 201 and made.json()["project"] == "alpha", made.text
        rid = made.json()["rollout_id"]
        assert http.post(f"{world.rollout_url}/v1/rollouts/{rid}/cancel", headers=world.h("b")).status_code == 404
        refused = http.post(f"{world.rollout_url}/v1/rollouts/{rid}/cancel", headers=world.h("a2"))
        assert refused.status_code == 403, refused.text  # its project, another key: the owner rule
        cancelled = http.post(f"{world.rollout_url}/v1/rollouts/{rid}/cancel", headers=world.h("a1"))
        assert cancelled.status_code in (200, 409), cancelled.text  # 409: it ended first
        # the same bytes uploaded by beta make the bundle beta's too (beta had them)
        archive = http.get(f"{world.rollout_url}/v1/bundles/{world.alpha['bundle']}/archive", headers=world.h("a1"))
        assert archive.status_code == 200
        assert http.post(f"{world.rollout_url}/v1/bundles", headers=world.h("b"),
                         content=archive.content).json()["digest"] == world.alpha["bundle"]
        assert http.get(f"{world.rollout_url}/v1/bundles/{world.alpha['bundle']}", headers=world.h("b")).status_code == 200


def test_names_are_per_project(world):
    """Beta's environment of alpha's name is beta's own; alpha's is untouched, and only its key or
    an admin key may replace it."""
    with httpx.Client(timeout=60) as http:
        body = {"task": {**world.alpha_task, "agent": msgspec.to_builtins(AgentSpec(external=True)),
                         "instructions": "beta's instructions"}}
        put = http.put(f"{world.rollout_url}/v1/environments/alpha-env", headers=world.h("b"), json=body)
        assert put.status_code == 200 and put.json()["project"] == "beta", put.text
        seen = http.get(f"{world.rollout_url}/v1/environments/alpha-env", headers=world.h("a1")).json()
        assert seen["project"] == "alpha" and seen["owner"] != put.json()["owner"]
        reset = http.post(f"{world.rollout_url}/openenv/alpha-env/reset", headers=world.h("a1"), json={})
        assert "beta's instructions" not in reset.text and reset.json()["observation"]["prompt"]
        assert http.post(f"{world.rollout_url}/openenv/alpha-env/reset", headers=world.h("b"),
                         json={}).json()["observation"]["prompt"] == "beta's instructions"
        refused = http.put(f"{world.rollout_url}/v1/environments/alpha-env", headers=world.h("a2"), json=body)
        assert refused.status_code == 403, refused.text
        # an admin key names another project's with ?project=; a project's key cannot
        env = f"{world.rollout_url}/v1/environments/alpha-env"
        assert http.get(env, headers=world.h("admin"), params={"project": "beta"}).json()["project"] == "beta"
        assert http.get(env, headers=world.h("a1"), params={"project": "alpha"}).json()["project"] == "alpha"
        hidden_env = http.get(env, headers=world.h("b"), params={"project": "alpha"})
        assert hidden_env.status_code == 404 and hidden_env.json()["error"]["code"] == "not_found"
        assert http.delete(env, headers=world.h("b"), params={"project": "alpha"}).status_code == 404
        assert http.delete(f"{world.rollout_url}/v1/environments/alpha-env", headers=world.h("b")).status_code == 204
        assert http.get(f"{world.rollout_url}/v1/environments/alpha-env", headers=world.h("a1")).status_code == 200


def test_an_eval_report_is_never_overwritten_by_another_key(world):
    with httpx.Client(timeout=60) as http:
        def report(who: str) -> dict:
            got = http.get(f"{world.trajectory_url}/v1/evals/alpha-job", headers=world.h(who))
            assert got.status_code == 200, got.text
            return got.json()

        # another project's post of the same job id is its own job
        theirs = http.post(f"{world.trajectory_url}/v1/evals", headers=world.h("b"),
                           content=eval_report("alpha-job", agent="beta's agent"))
        assert theirs.status_code == 201, theirs.text
        assert report("a1")["report"]["spec"]["agent"] == "alpha's agent"
        assert report("b")["report"]["spec"]["agent"] == "beta's agent"
        # another key of the project may not replace it, nor add a version
        for version in (1, 2):
            refused = http.post(f"{world.trajectory_url}/v1/evals", headers=world.h("a2"),
                                content=eval_report("alpha-job", agent="a2's agent", version=version))
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden", refused.text
        assert report("a1")["report"]["spec"]["agent"] == "alpha's agent" and report("a1")["versions"] == [1]
        # its owner may, and an admin key of the project may
        for who, version in (("a1", 2), ("admin", 3)):
            again = http.post(f"{world.trajectory_url}/v1/evals", headers=world.h(who),
                              content=eval_report("alpha-job", agent=f"{who}'s agent", version=version))
            assert again.status_code == 201, again.text
        assert report("a1")["versions"] == [1, 2, 3]
        job = f"{world.trajectory_url}/v1/evals/alpha-job"
        by_admin = http.get(job, headers=world.h("admin"), params={"project": "beta"})
        assert by_admin.json()["report"]["spec"]["agent"] == "beta's agent"  # an admin key names the project
        assert http.get(job, headers=world.h("b"), params={"project": "alpha"}).status_code == 404
        listed = {j["job_id"]: j["project"] for j in
                  http.get(f"{world.trajectory_url}/v1/evals", headers=world.h("b")).json()["jobs"]}
        assert listed["alpha-job"] == "beta" and set(listed.values()) == {"beta"}


def test_trainer_metrics_of_a_run_name_are_per_project(world):
    with httpx.Client(timeout=60) as http:
        posted = http.post(f"{world.trajectory_url}/v1/trainer-metrics", headers=world.h("b"),
                           json={"run": "alpha-run", "step": 99, "at": time.time()})
        assert posted.status_code == 201
        steps = lambda who: [s["step"] for s in http.get(  # noqa: E731
            f"{world.trajectory_url}/v1/trainer-metrics", headers=world.h(who), params={"run": "alpha-run"}).json()["steps"]]
        assert steps("a1") == [1] and steps("b") == [99]


def test_the_trainer_stream_hands_each_project_its_own_groups(world):
    url = world.stack.nats_url_for("trainer")

    async def read(project: str, want: set[str]) -> tuple[set[str], set[str], int]:
        seen, projects = set(), set()
        async with TrajectoryStream(url, name=f"trainer-{project}", project=project, partial_groups="yield") as stream:
            async def until_seen() -> None:
                async for batch in stream.groups(batch_size=1, max_wait=1.0):
                    for group in batch:
                        seen.add(group.group_id)
                        projects.update(t.project for t in group.trajectories)
                        projects.add(group.project)
                    await batch.commit()
                    if want <= seen:
                        return

            await asyncio.wait_for(until_seen(), 120)  # a bound for a hung stream, not a measurement
            return seen, projects, stream.stats.other_project

    seen, projects, skipped = asyncio.run(read("alpha", set(world.alpha_groups)))
    assert projects == {"alpha"} and not seen & set(world.beta_groups)
    seen, projects, skipped = asyncio.run(read("beta", set(world.beta_groups)))
    assert projects == {"beta"} and not seen & set(world.alpha_groups)
    assert skipped >= 1  # alpha's groups went by, unseen


def test_a_websocket_episode_of_another_projects_environment_is_not_found(world):
    import websockets.sync.client as ws

    base = world.rollout_url.replace("http://", "ws://")
    with pytest.raises(Exception) as refused:  # noqa: B017 - websockets' InvalidStatus, by version
        with ws.connect(f"{base}/openenv/k/{world.keys['b']}/alpha-env/ws"):
            pass
    assert "404" in str(refused.value)
    with ws.connect(f"{base}/openenv/k/{world.keys['a1']}/alpha-env/ws") as mine:
        mine.send(json.dumps({"type": "state", "data": {}}))
        assert json.loads(mine.recv(timeout=30))["type"] in ("observation", "state", "error")


def test_an_openenv_group_id_stays_its_projects_after_its_members_ended(world):
    """OpenEnv clients choose group ids: another project naming alpha's is told there is no such
    group, while alpha's member runs and after it ended."""
    import websockets.sync.client as ws

    base = world.rollout_url.replace("http://", "ws://")

    def reset(conn, **data) -> dict:
        conn.send(json.dumps({"type": "reset", "data": data}))
        return json.loads(conn.recv(timeout=60))

    with httpx.Client(timeout=60) as http:
        put = http.put(f"{world.rollout_url}/v1/environments/beta-env", headers=world.h("b"),
                       json={"task": external_task(world)})
        assert put.status_code == 200 and put.json()["project"] == "beta", put.text
        with ws.connect(f"{base}/openenv/k/{world.keys['a1']}/alpha-env/ws") as mine:
            assert reset(mine, group_id="grp-shared", group_size=2, group_index=0)["type"] != "error"
            [member] = http.get(f"{world.rollout_url}/v1/rollouts", headers=world.h("a1"),
                                params={"group_id": "grp-shared"}).json()["rollouts"]
            with ws.connect(f"{base}/openenv/k/{world.keys['b']}/beta-env/ws") as theirs:
                refused = reset(theirs, group_id="grp-shared", group_size=2, group_index=1)
                assert refused["type"] == "error" and "no group 'grp-shared'" in refused["data"]["message"], refused
        # alpha's client left: its episode's rollout is cancelled; the group is still alpha's
        ended = http.get(f"{world.rollout_url}/v1/rollouts/{member['rollout_id']}/wait", headers=world.h("a1"),
                         params={"timeout": "60"}).json()
        assert ended["state"] in ("cancelled", "completed", "failed", "timed_out"), ended
        with ws.connect(f"{base}/openenv/k/{world.keys['b']}/beta-env/ws") as theirs:
            refused = reset(theirs, group_id="grp-shared", group_size=2, group_index=1)
            assert refused["type"] == "error" and "no group 'grp-shared'" in refused["data"]["message"], refused
        assert [r["rollout_id"] for r in http.get(f"{world.rollout_url}/v1/rollouts", headers=world.h("admin"),
                                                 params={"group_id": "grp-shared"}).json()["rollouts"]] \
            == [member["rollout_id"]]
        assert http.delete(f"{world.rollout_url}/v1/environments/beta-env", headers=world.h("b")).status_code == 204
