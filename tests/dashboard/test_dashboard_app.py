"""The dashboard without a browser: its parameter checks, the live fan-out and debounce (pure),
sign-in with a key, and every ``/api`` route against a real trajectory app (chDB, in-process)."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from arena_core import apikeys
from arena_core.errors import InvalidRequest
from arena_core.schemas import RolloutState, RolloutStateChanged, Step, TrainerMetrics, VerificationResult
from arena_dashboard import auth, params
from arena_dashboard.app import create_app, create_app_without_bus
from arena_dashboard.fanout import DROPPED, Debouncer, Hub, LiveFeed, SseEvent, compact_state
from arena_dashboard.upstream import TrajectoryApi

# ------------------------------------------------------------------ parameters


def test_only_known_parameters_pass_each_validated_and_normalised():
    route = params.ROUTES["stats/tasks"]
    assert params.clean(route, [("task_id", "calc.add"), ("order", "success_rate"), ("since", "1700000000.0"),
                                ("min_reward", "0.5"), ("state", "timed_out"), ("group_id", "")]) == {
        "task_id": "calc.add", "order": "success_rate", "since": "1700000000", "min_reward": "0.5",
        "state": "timed_out"}
    bad = [("evil", "1"), ("task_id", "../etc"), ("task_id", "a b"), ("state", "running; drop"), ("order", "rowid"),
           ("limit", "100000"), ("since", "nan"), ("min_reward", "1e99"), ("policy_version", "x" * 300)]
    for name, value in bad:
        with pytest.raises(InvalidRequest, match=name):
            params.clean(route, [(name, value)])
    with pytest.raises(InvalidRequest, match="twice"):
        params.clean(route, [("limit", "1"), ("limit", "2")])
    with pytest.raises(InvalidRequest, match="identifier"):
        params.item_path(params.ITEM_ROUTES["trajectories"], "../../v1/counts")
    assert params.item_path(params.ITEM_ROUTES["duels"], "d-1") == "/v1/duels/d-1"


def test_parameters_are_refused_where_the_trajectory_api_would_refuse_or_ignore_them():
    with pytest.raises(InvalidRequest, match="min_attempts"):  # the trajectory API takes 1 and up
        params.clean(params.ROUTES["stats/tasks"], {"min_attempts": "0"})
    assert params.clean(params.ROUTES["stats/tasks"], {"min_attempts": "1"}) == {"min_attempts": "1"}
    with pytest.raises(InvalidRequest, match="task_id"):  # live counts take no filters
        params.clean(params.ROUTES["stats/live"], {"task_id": "calc.add"})


# ------------------------------------------------------------------ fan-out and debounce


async def test_a_slow_stream_is_dropped_and_the_others_keep_every_event():
    hub = Hub(queue_size=4)
    fast, slow = hub.subscribe(), hub.subscribe()
    got = []
    for i in range(10):
        hub.publish(SseEvent("states", str(i).encode()))
        got.append((await fast.queue.get()).data)  # the fast tab reads as events come
    assert got == [str(i).encode() for i in range(10)]
    assert slow.closed and slow not in hub.subscribers and hub.dropped == 1
    frames = [f async for f in slow.frames()]  # what it had, then the last word, then the end
    assert frames[-1] == DROPPED.frame() and len(frames) <= 5
    hub.close()
    assert [f async for f in fast.frames()][-1].startswith(b"event: closing")


def test_refresh_notices_are_debounced_per_page_kind():
    d = Debouncer(interval=2.0, settle=1.0, again=5.0)
    for t in range(0, 20):  # a burst: a mark every 50 ms for 1 s
        d.mark(["overview", "tasks"], t * 0.05)
    assert d.due(0.5) == []  # not settled yet
    assert d.due(1.0) == ["overview", "tasks"]
    d.mark(["overview"], 1.1)
    assert d.due(2.5) == []  # settled, but one was sent 1.5 s ago
    assert d.due(3.0) == ["overview"]
    assert d.due(5.9) == []
    assert d.due(6.0) == ["tasks"]  # once more, 5 s after the last ask: late writes are seen
    assert d.due(6.1) == ["overview"]
    assert d.due(60.0) == []  # nothing asked since


def state_change(rid: str, to: RolloutState, frm: RolloutState | None = None, **kw) -> RolloutStateChanged:
    return RolloutStateChanged(rollout_id=rid, task_id="calc.add", from_state=frm, to_state=to, at=100.0, **kw)


def test_state_changes_go_out_in_bounded_batches_and_finals_ask_for_one_refresh():
    hub = Hub(queue_size=100)
    sub = hub.subscribe()
    now = [0.0]
    feed = LiveFeed(hub, max_batch=3, debouncer=Debouncer(interval=2.0, settle=0.0, again=0), clock=lambda: now[0])
    for i in range(5):
        feed.on_state(compact_state(state_change(f"r{i}", RolloutState.COMPLETED, RolloutState.VERIFYING, reward=1.0)))
    feed.tick()
    states = sub.queue.get_nowait()
    body = msgspec.json.decode(states.data)
    assert states.event == "states" and len(body["changes"]) == 3 and body["overflow"] == 2
    assert body["changes"][0] == {**body["changes"][0], "rollout_id": "r0", "from": "verifying", "to": "completed",
                                  "final": True, "reward": 1.0}
    refresh = sub.queue.get_nowait()
    assert refresh.event == "refresh" and "overview" in msgspec.json.decode(refresh.data)["kinds"]
    feed.on_state(compact_state(state_change("r9", RolloutState.COMPLETED)))
    now[0] = 1.0
    feed.tick()  # a batch, but no second refresh within 2 s
    assert [sub.queue.get_nowait().event for _ in range(sub.queue.qsize())] == ["states"]
    feed.on_trainer({"run": "r", "step": 1, "metrics": {"loss": 0.5}})
    feed.on_duel({"duel_id": "d1", "winner": "a"})
    now[0] = 3.5
    feed.tick()
    events = [sub.queue.get_nowait() for _ in range(sub.queue.qsize())]
    assert [e.event for e in events] == ["trainer", "duel", "refresh"]
    assert set(msgspec.json.decode(events[-1].data)["kinds"]) >= {"overview", "training", "leaderboard"}
    feed.on_reconnect()  # NATS came back: pages re-seed their counters (and re-fetch, debounced)
    assert sub.queue.get_nowait().event == "reseed"


def test_a_session_of_one_project_hears_only_its_projects_live_events():
    """docs/projects.md: each project's state changes, trainer metrics and duel notices go to its
    own sessions (and to sessions of every project: keys off, an admin key); refresh notices,
    which carry no data, to all."""
    hub = Hub(queue_size=100)
    alpha, beta, everyone = hub.subscribe("alpha"), hub.subscribe("beta"), hub.subscribe()
    feed = LiveFeed(hub, max_batch=100, debouncer=Debouncer(interval=0.0, settle=0.0, again=0), clock=lambda: 0.0)
    feed.on_state(compact_state(state_change("r-alpha", RolloutState.COMPLETED, project="alpha")))
    feed.on_state(compact_state(state_change("r-beta", RolloutState.RUNNING, project="beta")))
    feed.on_trainer({"run": "alpha-run", "step": 1}, "alpha")
    feed.on_duel({"duel_id": "d-beta"}, "beta")
    feed.tick()

    def heard(sub) -> str:
        return " ".join(f"{e.event}:{e.data.decode()}" for e in (sub.queue.get_nowait() for _ in range(sub.queue.qsize())))

    mine, theirs, all_ = heard(alpha), heard(beta), heard(everyone)
    assert "r-alpha" in mine and "alpha-run" in mine and "r-beta" not in mine and "d-beta" not in mine
    assert "r-beta" in theirs and "d-beta" in theirs and "r-alpha" not in theirs and "alpha-run" not in theirs
    assert all(x in all_ for x in ("r-alpha", "r-beta", "alpha-run", "d-beta"))
    assert "refresh:" in mine and "refresh:" in theirs


# ------------------------------------------------------------------ against a real trajectory app


def trajectory(rid: str, *, group=None, index=0, size=1, reward=1.0, state=RolloutState.COMPLETED, at=100.0):
    from arena_trajectory import assembler

    event = RolloutStateChanged(rollout_id=rid, task_id="calc.add", from_state=RolloutState.VERIFYING, to_state=state,
                                at=at, steps=1, group_id=group, group_index=index, group_size=size)
    steps = [Step(rollout_id=rid, step_index=0, model="m", backend="b", policy_version="2", completion_text="ok",
                  completion_token_ids=[300, 301], logprobs=[-0.1, -2.0])]
    verification = VerificationResult(rollout_id=rid, verifier="tests", reward=reward, passed=reward == 1.0,
                                      started_at=at - 2, finished_at=at - 1, flags=["tests_tampered"] if reward else [])
    return assembler.assemble(event, steps, None, verification)


@pytest.fixture(scope="module")
def trajectory_app(tmp_path_factory):
    from arena_trajectory.app import create_app as trajectory_app
    from arena_trajectory.clickhouse import ChdbBackend
    from arena_trajectory.store import TrajectoryStore

    async def setup():
        store = TrajectoryStore(ChdbBackend(tmp_path_factory.mktemp("dash") / "clickhouse"))
        await store.init()
        for t in (trajectory("a", group="g", index=0, size=2, reward=1.0, at=1_700_000_101.0),
                  trajectory("b", group="g", index=1, size=2, reward=0.0, at=1_700_000_102.0),
                  trajectory("solo", state=RolloutState.TIMED_OUT, at=1_700_000_103.0)):
            await store.insert_trajectory(t)
            if t.verification is not None:
                await store.insert_verification(t.verification)
        await store.insert_trainer_metrics(TrainerMetrics(run="run1", step=1, at=1_700_000_104.0, policy_version="2",
                                                          metrics={"loss": 0.5, "kl": 0.01}))
        return store

    loop = asyncio.new_event_loop()
    store = loop.run_until_complete(setup())
    yield trajectory_app(store)
    loop.run_until_complete(store.close())
    loop.close()


def dashboard_client(app, *, gate=None, transport=None) -> httpx.AsyncClient:
    dashboard = create_app_without_bus("http://trajectory", gate=gate,
                                       transport=transport or httpx.ASGITransport(app=app))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=dashboard), base_url="http://dash")


API_ROUTES = ["stats/overview?since=0", "stats/live", "stats/verification?task_id=calc.add",
              "stats/tasks?order=success_rate&limit=10", "stats/token-usage", "stats/training?run=run1",
              "trajectories?limit=2", "trainer-metrics?run=run1", "duels?limit=5", "leaderboard", "trajectories/a",
              "groups/g", "rollout/a"]


async def test_the_page_and_every_api_route_answer_from_the_trajectory_api(trajectory_app):
    async with dashboard_client(trajectory_app) as c:
        page = await c.get("/")
        assert page.status_code == 200 and 'src="/static/js/main.js"' in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        for path in ("/static/js/main.js", "/static/app.css", "/static/vendor/chart.umd.min.js",
                     "/static/vendor/chart.js.LICENSE.md"):
            assert (await c.get(path)).status_code == 200, path
        for route in API_ROUTES:
            r = await c.get(f"/api/{route}")
            assert r.status_code == 200, (route, r.text)
            assert r.headers["content-type"] == "application/json"
        newest = (await c.get("/api/trajectories?limit=2")).json()["trajectories"]
        assert [t["rollout_id"] for t in newest] == ["solo", "b"]
        older = await c.get("/api/trajectories", params={"limit": 2, "before_completed_at": newest[-1]["completed_at"],
                                                          "before_rollout": newest[-1]["rollout_id"]})
        assert [t["rollout_id"] for t in older.json()["trajectories"]] == ["a"]  # keyset: the page after "b"
        rollout = (await c.get("/api/rollout/a")).json()
        assert rollout["trajectory"]["rollout_id"] == "a"
        assert [round(a, 3) for a in rollout["group"]["advantages"]] == [1.0, -1.0]
        assert "trajectories" not in rollout["group"]  # never the whole group
        assert (await c.get("/api/stats/training?run=run1")).json()["trainer"][0]["metrics"]["loss"] == 0.5
        flags = (await c.get("/api/stats/verification")).json()["flags"]
        assert flags[0]["flag"] == "tests_tampered" and sorted(flags[0]["rollout_ids"]) == ["a", "solo"]


async def test_bad_input_and_upstream_failures_are_clear_json_errors(trajectory_app):
    async with dashboard_client(trajectory_app) as c:
        for path, status, code in (("/api/stats/overview?bogus=1", 422, "invalid_request"),
                                   ("/api/trajectories?task_id=../x", 422, "invalid_request"),
                                   ("/api/rollout/nope", 404, "not_found"),
                                   ("/api/nothing", 404, "not_found"),
                                   ("/api/stats/secrets", 404, "not_found"),
                                   ("/nowhere", 404, "not_found")):
            r = await c.get(path)
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, r.text)

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    async with dashboard_client(None, transport=httpx.MockTransport(refuse)) as c:
        r = await c.get("/api/stats/overview")
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        assert "Traceback" not in r.text
        assert (await c.get("/readyz")).status_code == 503


def ring_with(*keys: tuple[str, list[str]]) -> tuple[apikeys.KeyRing, list[str]]:
    ring = apikeys.KeyRing()
    out = []
    for name, scopes in keys:
        key, record = apikeys.new_key(name, scopes)
        ring.keys[record.key_id] = record
        out.append(key)
    ring.ready.set()
    return ring, out


FORM = {"content-type": "application/x-www-form-urlencoded", "origin": "http://dash"}


async def test_with_keys_enforced_a_read_key_signs_in_once_into_a_strict_http_only_cookie(trajectory_app):
    ring, (reader, submitter) = ring_with(("me", ["read"]), ("bot", ["submit"]))
    async with dashboard_client(trajectory_app, gate=auth.Gate(ring)) as c:
        page = await c.get("/")
        assert page.status_code == 401 and 'name="key"' in page.text  # the sign-in form
        assert (await c.get("/api/stats/live")).json()["error"]["code"] == "unauthorized"
        assert (await c.get("/events")).status_code == 401
        assert (await c.get("/static/js/main.js")).status_code == 401
        assert (await c.get("/static/app.css")).status_code == 200  # the sign-in page's style
        for key in (submitter, reader):  # a key in an address is never taken (docs/dashboard.md)
            r = await c.get(f"/?key={key}")
            assert r.status_code == 400 and "set-cookie" not in r.headers
        r = await c.post("/login", content=f"key={reader}", headers=FORM)
        assert r.status_code == 303 and r.headers["location"] == "/"
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"{auth.COOKIE}={reader};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        c.cookies.set(auth.COOKIE, reader)
        assert (await c.get("/")).status_code == 200
        assert (await c.get("/api/stats/live")).status_code == 200
        reader_id = apikeys.key_id_of(reader)
        ring.keys[reader_id] = msgspec.structs.replace(ring.keys[reader_id], revoked=True)
        assert (await c.get("/api/stats/live")).status_code == 401  # revoked: out at once
        c.cookies.clear()
        r = await c.post("/login", content=f"key={submitter}", headers=FORM)
        assert r.status_code == 401
        assert (await c.get("/healthz")).status_code == 200


async def test_events_stream_over_a_real_server():
    from arena_core import runtime
    from arena_stack.natsserver import free_port

    hub = Hub()
    app = create_app(TrajectoryApi("http://127.0.0.1:9"), hub)
    port = free_port()
    stop = asyncio.Event()
    server = asyncio.create_task(runtime.serve(stop, app=app, port=port))
    try:
        async with httpx.AsyncClient(timeout=5) as c:
            for _ in range(100):
                try:
                    await c.get(f"http://127.0.0.1:{port}/healthz")
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.02)
            async with c.stream("GET", f"http://127.0.0.1:{port}/events") as resp:
                assert resp.headers["content-type"].startswith("text/event-stream")
                lines = resp.aiter_lines()
                assert [await anext(lines) for _ in range(4)] == ["retry: 3000", "", "event: hello", "data: {}"]
                while not hub.subscribers:
                    await asyncio.sleep(0.01)
                hub.publish(SseEvent("refresh", b'{"kinds":["overview"]}'))
                got = []
                while len(got) < 2:
                    line = await anext(lines)
                    if line:
                        got.append(line)
                assert got == ["event: refresh", 'data: {"kinds":["overview"]}']
                hub.close()  # what the service does at SIGTERM: every stream ends, the server drains
    finally:
        stop.set()
        assert await asyncio.wait_for(server, 10) == 0


async def test_a_live_stream_ends_once_its_key_is_revoked():
    """A revoked key stops working at once (docs/dashboard.md): an open ``/events`` stream too,
    not only the next request; it gets no event published after the revocation."""
    ring, (reader,) = ring_with(("me", ["read"]))
    hub = Hub()
    app = create_app(TrajectoryApi("http://127.0.0.1:9"), hub, gate=auth.Gate(ring))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash") as c:
        c.cookies.set(auth.COOKIE, reader)
        stream = asyncio.create_task(c.get("/events"))
        for _ in range(200):
            if hub.subscribers:
                break
            await asyncio.sleep(0.01)
        hub.publish(SseEvent("before", b"{}"))
        await asyncio.sleep(0.05)
        reader_id = apikeys.key_id_of(reader)
        ring.keys[reader_id] = msgspec.structs.replace(ring.keys[reader_id], revoked=True)
        await asyncio.sleep(0.05)
        hub.publish(SseEvent("after", b'{"secret":1}'))
        try:
            r = await asyncio.wait_for(stream, 5)
        finally:
            stream.cancel()
        assert "event: before" in r.text and "event: after" not in r.text
        assert not hub.subscribers
