"""Every rollout, group, environment and episode records the API key that made it, and only
that key or an admin key may cancel, replace, delete or take it over: another key gets 403
``forbidden`` and the object is left as it was. Reads stay open to any ``read`` key. The real
rollout app behind the real key guard, on a real nats-server, keys issued into its bucket; no
sandbox worker runs, so rollouts wait in the queue (where cancelling them matters most)."""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest
import websockets

from arena_core import apikeys, subjects
from arena_core.runtime import serve
from arena_core.schemas import AgentSpec, Budget, ExactVerifier, RolloutView, Task
from arena_core.settings import Settings
from arena_rollout.app import create_app
from arena_rollout.service import RolloutService
from arena_rollout.store import RolloutStore
from arena_stack.natsserver import free_port

from tests.rollout.test_service import task_json

pytestmark = pytest.mark.timeout(120)


class Keyed:
    """The API on a port, and four keys: ``a`` and ``b`` (submit + read), ``admin``, ``reader``."""

    def __init__(self, url: str, service: RolloutService, keys: dict[str, tuple[str, apikeys.ApiKey]]):
        self.url, self.service, self.keys = url, service, keys

    def headers(self, who: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.keys[who][0]}"}

    def key_id(self, who: str) -> str:
        return self.keys[who][1].key_id


@pytest.fixture
async def keyed(bus, tmp_path):
    kv = await bus.kv(subjects.KV_ROLLOUTS)
    store = RolloutStore(kv)
    stop = asyncio.Event()
    port = free_port()
    settings = Settings(auth="keys", allow_host_paths=True, nats_url="nats://127.0.0.1:1",
                        public_url=f"http://127.0.0.1:{port}", openenv_start_timeout_s=1)
    http = httpx.AsyncClient()
    service = RolloutService(bus=bus, store=store, settings=settings, http=http)
    ring = apikeys.KeyRing(bus)
    keys = {"a": await apikeys.issue(bus, "a", ["submit", "read"]),
            "b": await apikeys.issue(bus, "b", ["submit", "read"]),
            "admin": await apikeys.issue(bus, "admin", ["admin"]),
            "reader": await apikeys.issue(bus, "reader", ["read"])}
    watch = asyncio.create_task(store.cache.watch(kv, stop))
    server = asyncio.create_task(serve(stop, consumers=[ring], app=apikeys.KeyGuard(create_app(service), ring),
                                       port=port))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as probe:
        for _ in range(300):
            try:
                if (await probe.get("/healthz")).status_code == 200 and store.cache.watching and ring.ready.is_set() \
                        and all(record.key_id in ring.keys for _, record in keys.values()):
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.02)
    try:
        yield Keyed(f"http://127.0.0.1:{port}", service, keys)
    finally:
        stop.set()
        await asyncio.gather(watch, server)
        await service.upstream.aclose()
        await http.aclose()


async def state_of(http: httpx.AsyncClient, api: Keyed, rid: str) -> dict:
    got = await http.get(f"{api.url}/v1/rollouts/{rid}", headers=api.headers("reader"))
    assert got.status_code == 200, got.text
    return got.json()


async def test_only_its_owner_or_an_admin_may_cancel_a_rollout(keyed, tmp_path):
    api = keyed
    async with httpx.AsyncClient(timeout=30) as http:
        made = await http.post(f"{api.url}/v1/rollouts", json={"task": task_json(tmp_path)}, headers=api.headers("a"))
        assert made.status_code == 201, made.text
        rid = made.json()["rollout_id"]
        assert made.json()["owner"] == api.key_id("a")  # the key's id, never the secret
        assert api.keys["a"][0] not in made.text

        refused = await http.post(f"{api.url}/v1/rollouts/{rid}/cancel", headers=api.headers("b"))
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "forbidden"
        assert "another API key" in refused.json()["error"]["message"]
        assert (await state_of(http, api, rid))["state"] == "provisioning"  # untouched

        read = await http.get(f"{api.url}/v1/rollouts/{rid}", headers=api.headers("b"))
        assert read.status_code == 200 and read.json()["owner"] == api.key_id("a")  # reads stay open

        mine = await http.post(f"{api.url}/v1/rollouts/{rid}/cancel", headers=api.headers("a"))
        assert mine.status_code == 200 and mine.json()["state"] == "cancelled"

        other = (await http.post(f"{api.url}/v1/rollouts", json={"task": task_json(tmp_path)},
                                 headers=api.headers("a"))).json()["rollout_id"]
        by_admin = await http.post(f"{api.url}/v1/rollouts/{other}/cancel", headers=api.headers("admin"))
        assert by_admin.status_code == 200 and by_admin.json()["state"] == "cancelled"


async def test_another_key_cannot_cancel_the_members_of_a_group(keyed, tmp_path):
    api = keyed
    async with httpx.AsyncClient(timeout=30) as http:
        group = await http.post(f"{api.url}/v1/rollout-groups", json={"task": task_json(tmp_path), "n": 3},
                                headers=api.headers("a"))
        assert group.status_code == 201, group.text
        members = group.json()["rollout_ids"]
        for rid in members:
            refused = await http.post(f"{api.url}/v1/rollouts/{rid}/cancel", headers=api.headers("b"))
            assert refused.status_code == 403, refused.text
        listed = await http.get(f"{api.url}/v1/rollouts", params={"group_id": group.json()["group_id"]},
                                headers=api.headers("b"))
        assert [(r["state"], r["owner"]) for r in listed.json()["rollouts"]] == [
            ("provisioning", api.key_id("a"))] * 3
        assert (await http.post(f"{api.url}/v1/rollouts/{members[0]}/cancel",
                                headers=api.headers("a"))).status_code == 200
        assert (await http.post(f"{api.url}/v1/rollouts/{members[1]}/cancel",
                                headers=api.headers("admin"))).status_code == 200


def environment(instructions: str, tmp_path) -> dict:
    repo = tmp_path / "repo"
    repo.mkdir(exist_ok=True)
    task = Task(id="env-task", repo=str(repo), instructions=instructions, agent=AgentSpec(external=True),
                verifier=ExactVerifier(answers=["42"]), budget=Budget(wall_clock_s=60))
    return {"task": msgspec.to_builtins(task)}


async def test_another_key_cannot_replace_or_delete_an_environment(keyed, tmp_path):
    api = keyed
    async with httpx.AsyncClient(timeout=30) as http:
        put = await http.put(f"{api.url}/v1/environments/shared", json=environment("A's instructions", tmp_path),
                             headers=api.headers("a"))
        assert put.status_code == 200, put.text
        assert put.json()["owner"] == api.key_id("a")

        replaced = await http.put(f"{api.url}/v1/environments/shared",
                                  json=environment("B's instructions", tmp_path), headers=api.headers("b"))
        assert replaced.status_code == 403, replaced.text
        assert replaced.json()["error"]["code"] == "forbidden"
        deleted = await http.delete(f"{api.url}/v1/environments/shared", headers=api.headers("b"))
        assert deleted.status_code == 403, deleted.text

        # A's next reset still serves A's instructions, from any replica's fresh read
        reset = await http.post(f"{api.url}/openenv/shared/reset", json={}, headers=api.headers("a"))
        assert reset.status_code == 200, reset.text
        assert reset.json()["observation"]["prompt"] == "A's instructions"
        seen = await http.get(f"{api.url}/v1/environments/shared", headers=api.headers("b"))
        assert seen.status_code == 200 and seen.json()["owner"] == api.key_id("a")

        again = await http.put(f"{api.url}/v1/environments/shared", json=environment("A's second", tmp_path),
                               headers=api.headers("a"))
        assert again.status_code == 200, again.text  # its owner may replace it
        reset = await http.post(f"{api.url}/openenv/shared/reset", json={}, headers=api.headers("a"))
        assert reset.json()["observation"]["prompt"] == "A's second"
        gone = await http.delete(f"{api.url}/v1/environments/shared", headers=api.headers("admin"))
        assert gone.status_code == 204, gone.text  # and an admin key may delete it
        assert (await http.get(f"{api.url}/v1/environments/shared", headers=api.headers("a"))).status_code == 404

        # a name deleted is free again: whoever registers it owns it
        taken = await http.put(f"{api.url}/v1/environments/shared", json=environment("B's instructions", tmp_path),
                               headers=api.headers("b"))
        assert taken.status_code == 200 and taken.json()["owner"] == api.key_id("b")
        assert (await http.delete(f"{api.url}/v1/environments/shared", headers=api.headers("b"))).status_code == 204


async def reset(ws, **data) -> dict:
    await ws.send(json.dumps({"type": "reset", "data": data}))
    return json.loads(await asyncio.wait_for(ws.recv(), 30))


async def test_another_key_cannot_end_or_join_an_episode(keyed, tmp_path):
    api = keyed
    async with httpx.AsyncClient(timeout=30) as http:
        put = await http.put(f"{api.url}/v1/environments/game", json=environment("play", tmp_path),
                             headers=api.headers("a"))
        assert put.status_code == 200, put.text
    ws_url = api.url.replace("http://", "ws://") + "/openenv/k/{key}/game/ws"
    async with websockets.connect(ws_url.format(key=api.keys["a"][0])) as mine:
        # no sandbox worker here: the episode's rollout waits in the queue, and the reset says so
        first = await reset(mine, group_id="grp-a", group_size=2, group_index=0)
        assert "still starting" in first["data"]["message"], first
        async with httpx.AsyncClient(timeout=30) as http:
            listed = (await http.get(f"{api.url}/v1/rollouts", params={"group_id": "grp-a"},
                                     headers=api.headers("reader"))).json()["rollouts"]
            [episode] = listed
            assert episode["owner"] == api.key_id("a") and episode["state"] == "provisioning"
            rid = episode["rollout_id"]

            refused = await http.post(f"{api.url}/v1/rollouts/{rid}/cancel", headers=api.headers("b"))
            assert refused.status_code == 403, refused.text

            # B plays A's environment (that is what serving one is for), but cannot join A's group
            async with websockets.connect(ws_url.format(key=api.keys["b"][0])) as theirs:
                joined = await reset(theirs, group_id="grp-a", group_size=2, group_index=1)
                assert joined["type"] == "error" and "another API key" in joined["data"]["message"], joined
            members = (await http.get(f"{api.url}/v1/rollouts", params={"group_id": "grp-a"},
                                      headers=api.headers("reader"))).json()["rollouts"]
            assert [(m["rollout_id"], m["state"]) for m in members] == [(rid, "provisioning")]

            # an admin key may join it
            async with websockets.connect(ws_url.format(key=api.keys["admin"][0])) as admin:
                joined = await reset(admin, group_id="grp-a", group_size=2, group_index=1)
                assert "still starting" in joined["data"]["message"], joined
                members = (await http.get(f"{api.url}/v1/rollouts", params={"group_id": "grp-a"},
                                          headers=api.headers("reader"))).json()["rollouts"]
                assert sorted(m["owner"] for m in members) == sorted([api.key_id("a"), api.key_id("admin")])
            assert (await state_of(http, api, rid))["state"] == "provisioning"  # A's episode is still A's
            by_admin = await http.post(f"{api.url}/v1/rollouts/{rid}/cancel", headers=api.headers("admin"))
            assert by_admin.status_code == 200 and by_admin.json()["state"] == "cancelled"
        # its owner may end its own episode's rollout
        ended = await reset(mine)  # the reset that was still starting learns its episode ended
        assert "ended: cancelled" in ended["data"]["message"], ended
        second = await reset(mine)  # and the next starts another
        assert "still starting" in second["data"]["message"], second
        own = second["data"]["message"].split()[1]
        async with httpx.AsyncClient(timeout=30) as http:
            mine_cancelled = await http.post(f"{api.url}/v1/rollouts/{own}/cancel", headers=api.headers("a"))
            assert mine_cancelled.status_code == 200 and mine_cancelled.json()["owner"] == api.key_id("a")


@pytest.fixture
def api_settings() -> Settings:
    return Settings(auth="off", allow_host_paths=True, nats_url="nats://127.0.0.1:1",
                    public_url="http://arena:9090")


async def test_with_keys_off_everything_is_owned_by_anonymous_and_anyone_may_cancel(api, tmp_path):
    """And everything is of the ``default`` project (docs/projects.md)."""
    made = await api.post("/v1/rollouts", json={"task": task_json(tmp_path)})
    assert made.status_code == 201, made.text
    assert made.json()["owner"] == "anonymous"
    # keys off: one project, nothing checked (a default value is left off the wire: the schema's)
    assert msgspec.convert(made.json(), RolloutView).project == "default"
    cancelled = await api.post(f"/v1/rollouts/{made.json()['rollout_id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
