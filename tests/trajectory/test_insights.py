"""Dashboard aggregates of the trajectory API (insights.py) over one shared chDB store:
overview, live counts, verification, tasks, token usage, training curves, trainer logprobs
and keyset paging of the rollout list, with exact figures."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from arena_core.schemas import (
    RolloutState,
    RolloutStateChanged,
    SandboxDone,
    SandboxOutcome,
    StateTransition,
    Step,
    TestCounts,
    Timings,
    ToolCall,
    TrainerMetrics,
    Usage,
    VerificationResult,
)
from arena_trajectory import assembler, insights
from arena_trajectory.app import create_app
from arena_trajectory.clickhouse import ChdbBackend
from arena_trajectory.listing import TrajectoryFilter
from arena_trajectory.store import TrajectoryStore

T0 = 1_700_000_000.0
approx = pytest.approx


def step(rid: str, i: int, version: str, *, finish: str = "stop", tools: int = 0) -> Step:
    prompt, completion = (10, 4) if i == 0 else (20, 2)
    return Step(rollout_id=rid, step_index=i, model="m", backend=f"b{version}", policy_version=version,
                prompt_token_ids=list(range(prompt)), completion_token_ids=list(range(completion)),
                logprobs=[-0.5] * completion, finish_reason=finish,
                tool_calls=[ToolCall(id=f"c{k}", name="f") for k in range(tools)],
                usage=Usage(prompt_tokens=prompt, completion_tokens=completion),
                timings=Timings(total_ms=100.0 * (i + 1)), started_at=T0 + i)


def rollout(rid, task, at, *, reward=None, version="1", group=None, index=0, size=1, state=RolloutState.COMPLETED,
            flags=(), task_set="", steps=2, truncated=False, tools=0, sandbox=True, infrastructure=False,
            p2p_failed=0):
    """A stored rollout: its trajectory (steps, sandbox, verification, history), ending at ``at``;
    queued 2 s, sandbox 30 s, verification 5 s, 60 s in all."""
    base = at - 60
    all_steps = [step(rid, i, version, finish="length" if truncated and i == 1 else "stop",
                      tools=tools if i == 0 else 0) for i in range(steps)]
    box = SandboxDone(rollout_id=rid, sandbox_id="s", provider="local", outcome=SandboxOutcome.COMPLETED,
                      reason="", started_at=base + 2, finished_at=base + 32) if sandbox else None
    verification = None
    if reward is not None or infrastructure:
        verification = VerificationResult(
            rollout_id=rid, verifier="tests", reward=None if infrastructure else reward, passed=reward == 1.0,
            started_at=base + 40, finished_at=base + 45, flags=list(flags), parser="" if infrastructure else "pytest",
            counts=TestCounts() if infrastructure else TestCounts(
                f2p_passed=int(reward == 1.0), f2p_failed=int(reward != 1.0), p2p_passed=2, p2p_failed=p2p_failed))
    history = [StateTransition(from_state=None, to_state=RolloutState.PENDING, at=base),
               StateTransition(from_state=RolloutState.PENDING, to_state=RolloutState.PROVISIONING, at=base + 1),
               StateTransition(from_state=RolloutState.PROVISIONING, to_state=RolloutState.RUNNING, at=base + 2)]
    event = RolloutStateChanged(rollout_id=rid, task_id=task, from_state=RolloutState.RUNNING, to_state=state, at=at,
                                steps=steps, group_id=group, group_index=index, group_size=size,
                                metadata={"task_set": task_set} if task_set else {}, infrastructure=infrastructure)
    history.append(StateTransition(from_state=RolloutState.RUNNING, to_state=state, at=at))
    return assembler.assemble(event, all_steps, box, verification, history=history), all_steps, box, verification


ROLLOUTS = [
    # v1, "easy": a group with signal, and a group whose rewards are all equal
    rollout("a0", "add", T0 + 100, reward=1.0, group="ga", size=2, task_set="easy", truncated=True, tools=2),
    rollout("a1", "add", T0 + 110, reward=0.0, group="ga", index=1, size=2, task_set="easy", flags=["parse_failed"]),
    rollout("b0", "sub", T0 + 120, reward=0.0, group="gb", size=2, task_set="easy", flags=["tests_tampered"], tools=1),
    rollout("b1", "sub", T0 + 120, reward=0.0, group="gb", index=1, size=2, task_set="easy",
            flags=["tests_tampered", "parse_failed"], p2p_failed=1),
    # v2, "hard": a group of three, one an infrastructure outcome (no reward), the others equal
    rollout("c0", "pow", T0 + 900, reward=1.0, version="2", group="gc", size=3, task_set="hard"),
    rollout("c1", "pow", T0 + 910, reward=1.0, version="2", group="gc", index=1, size=3, task_set="hard"),
    rollout("c2", "pow", T0 + 920, version="2", group="gc", index=2, size=3, task_set="hard",
            state=RolloutState.FAILED, infrastructure=True, flags=["infrastructure_error"]),
    # v2, no task set: an incomplete group's member that timed out, a solo that failed early
    rollout("m0", "mul", T0 + 950, version="2", group="gm", size=2, state=RolloutState.TIMED_OUT),
    rollout("m1", "mul", T0 + 1000, version="2", state=RolloutState.FAILED, steps=1, sandbox=False),
]


async def fill(store: TrajectoryStore) -> None:
    await store.init()
    for t, steps, box, verification in ROLLOUTS:
        await store.insert_trajectory(t)  # its steps too
        if box is not None:
            await store.insert_sandbox_result(box)
        if verification is not None:
            await store.insert_verification(verification)
        await store.insert_states([RolloutStateChanged(rollout_id=t.rollout_id, task_id=t.task_id,
                                                       from_state=h.from_state, to_state=h.to_state, at=h.at)
                                   for h in t.history])
    await store.insert_trajectory(ROLLOUTS[0][0])  # a redelivery: never counted twice
    live = [("p0", RolloutState.PENDING, T0 + 990), ("r0", RolloutState.PENDING, T0 + 980),
            ("r0", RolloutState.RUNNING, T0 + 985), ("v0", RolloutState.RUNNING, T0 + 970),
            ("v0", RolloutState.VERIFYING, T0 + 995), ("old", RolloutState.RUNNING, T0 - 90_000)]
    await store.insert_states([RolloutStateChanged(rollout_id=rid, task_id="t", from_state=None, to_state=s, at=at)
                               for rid, s, at in live])
    for run, at in (("r1", T0 + 1), ("r2", T0 + 2)):
        for n in (1, 2):
            await store.insert_trainer_metrics(TrainerMetrics(run=run, step=n, at=at + n, policy_version=str(n),
                                                              metrics={"loss": n / 10}))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    store = TrajectoryStore(ChdbBackend(tmp_path_factory.mktemp("insights") / "clickhouse"))
    asyncio.run(fill(store))
    yield store
    asyncio.run(store.close())


@pytest.fixture
async def client(store):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(store)), base_url="http://t") as c:
        yield c


async def test_overview(client):
    o = (await client.get("/v1/stats/overview")).json()
    assert o["since"] is None and o["until"] is None and o["rollouts"] == 9
    assert o["rollouts_per_s"] == approx(9 / 900)  # first..last completed_at
    assert o["by_state"] == {"completed": 6, "failed": 2, "timed_out": 1, "cancelled": 0, "budget_exhausted": 0}
    assert (o["success_rate"], o["error_rate"], o["timeout_rate"], o["budget_exhausted_rate"],
            o["infrastructure_error_rate"]) == approx((3 / 9, 1 / 9, 1 / 9, 0, 1 / 9))  # c2: infrastructure
    # 3 of the 6 rewarded (verified) rollouts passed: the failed and the timed-out one were never
    # verified, so they have no reward; the first tenth (100..190 s) holds a*, b*: 1 of 4
    assert (o["mean_reward"], o["mean_reward_first"], o["reward_change"]) == approx((3 / 6, 1 / 4, 1 / 4))
    lat = o["latency_ms"]
    assert lat["rollout"] == {"p50": 60_000.0, "p95": 60_000.0, "count": 9}
    assert lat["queue"] == {"p50": 2000.0, "p95": 2000.0, "count": 9}
    assert lat["sandbox"] == {"p50": 30_000.0, "p95": 30_000.0, "count": 8}
    assert lat["verification"] == {"p50": 5000.0, "p95": 5000.0, "count": 7}
    assert lat["llm"] == {"p50": 100.0, "p95": 200.0, "count": 17}

    windowed = (await client.get("/v1/stats/overview", params={"since": T0 + 800, "until": T0 + 1800})).json()
    assert windowed["since"] == T0 + 800 and windowed["rollouts"] == 5 and windowed["rollouts_per_s"] == approx(0.005)
    # c0, c1 (m0, m1 never verified; c2 an infrastructure outcome): no reward in 800..900
    assert windowed["mean_reward"] == approx(1.0) and windowed["mean_reward_first"] is None
    empty = (await client.get("/v1/stats/overview", params={"task_id": "nope"})).json()
    assert empty["rollouts"] == 0 and empty["mean_reward"] is None and empty["latency_ms"]["llm"]["count"] == 0


async def test_infrastructure_outcomes_are_no_policy_errors_in_the_overview(client):
    """c2 ended ``failed`` because Arena could not verify it: counted once, as an
    infrastructure error, never also as the policy's error (docs/trajectory.md, Overview)."""
    o = (await client.get("/v1/stats/overview", params={"task_id": "pow"})).json()
    assert o["by_state"]["failed"] == 1 and o["infrastructure_error_rate"] == approx(1 / 3)
    assert o["error_rate"] == 0.0


async def test_live_counts_latest_non_final_states_of_the_last_day(store, client):
    got = await insights.live(store, now=T0 + 1000)
    assert (got.pending, got.provisioning, got.running, got.verifying) == (1, 0, 1, 1)
    shape = (await client.get("/v1/stats/live")).json()  # now: these are years old
    assert set(shape) == {"at", "pending", "provisioning", "running", "verifying"} and shape["running"] == 0


async def test_verification(client):
    v = (await client.get("/v1/stats/verification")).json()
    assert v["verdicts"] == {"passed": 3, "failed": 3, "infrastructure": 1, "unverified": 2}
    assert v["tests"] == {"f2p_passed": 3, "f2p_failed": 3, "p2p_passed": 12, "p2p_failed": 1}
    assert v["flags"] == [{"flag": "parse_failed", "count": 2, "rollout_ids": ["b1", "a1"]},
                          {"flag": "tests_tampered", "count": 2, "rollout_ids": ["b1", "b0"]},
                          {"flag": "infrastructure_error", "count": 1, "rollout_ids": ["c2"]}]
    assert v["parser_failures"] == 2 and v["parsers"] == [{"parser": "pytest", "count": 6}]
    assert v["latency_ms"] == [{"verifier": "tests", "count": 7, "p50": 5000.0, "p95": 5000.0}]
    only = (await client.get("/v1/stats/verification", params={"task_id": "add"})).json()
    assert only["verdicts"] == {"passed": 1, "failed": 1, "infrastructure": 0, "unverified": 0}
    assert [f["flag"] for f in only["flags"]] == ["parse_failed"] and only["parser_failures"] == 1


async def test_tasks_ordered_paged_and_flagged(client):
    page = (await client.get("/v1/stats/tasks", params={"min_attempts": 2, "order": "task_id"})).json()
    assert page["total"] == 4
    add, mul, pow_, sub = page["rows"]
    assert add == {"task_id": "add", "attempts": 2, "passed": 1, "success_rate": 0.5, "mean_reward": 0.5,
                   "reward_variance": 0.25, "saturated": False, "never_solved": False, "last_seen": T0 + 110}
    assert (pow_["attempts"], pow_["saturated"], pow_["reward_variance"]) == (2, True, 0.0)  # c2 is no attempt
    assert mul["never_solved"] and sub["never_solved"] and mul["last_seen"] == T0 + 1000

    async def order(by, **extra):
        got = (await client.get("/v1/stats/tasks", params={"order": by, **extra})).json()
        return got["total"], [r["task_id"] for r in got["rows"]]

    assert await order("success_rate") == (4, ["mul", "sub", "add", "pow"])
    assert await order("last_seen") == (4, ["mul", "pow", "sub", "add"])
    assert await order("reward_variance") == (4, ["add", "mul", "pow", "sub"])
    assert await order("task_id", limit=2, offset=2) == (4, ["pow", "sub"])
    assert await order("task_id", offset=10) == (4, [])
    strict = (await client.get("/v1/stats/tasks")).json()["rows"]  # min_attempts 5: no verdicts
    assert not any(r["saturated"] or r["never_solved"] for r in strict)
    assert (await client.get("/v1/stats/tasks", params={"order": "nope"})).status_code == 422


async def test_token_usage(client):
    u = (await client.get("/v1/stats/token-usage")).json()
    assert u["steps"] == 17 and u["truncation_rate"] == approx(1 / 17)
    p = u["prompt_tokens"]  # nine first calls of 10 tokens, eight second calls of 20
    assert (p["mean"], p["p50"], p["p95"], p["max"]) == approx((250 / 17, 10, 20, 20))
    assert p["buckets"] == [{"le": 16.0, "count": 9}, {"le": 32.0, "count": 8}]
    assert u["completion_tokens"]["buckets"] == [{"le": 2.0, "count": 8}, {"le": 4.0, "count": 9}]
    assert u["turns"] == approx({"mean": 17 / 9, "p50": 2, "p95": 2, "max": 2})
    assert (u["tool_calls"]["mean"], u["tool_calls"]["p50"], u["tool_calls"]["max"]) == approx((3 / 9, 0, 2))
    # v1: 4 rollouts x (4 + 2) tokens in 4 x 300 ms; v2: 4 x 6 + 4 in 4 x 300 + 100 ms
    assert u["by_backend"] == [{"backend": "b1", "steps": 8, "completion_tokens": 24, "tokens_per_s": 20.0},
                               {"backend": "b2", "steps": 9, "completion_tokens": 28, "tokens_per_s": approx(28 / 1.3)}]
    assert [(r["policy_version"], r["steps"]) for r in u["by_policy_version"]] == [("1", 8), ("2", 9)]
    v1 = (await client.get("/v1/stats/token-usage", params={"policy_version": "1"})).json()
    assert v1["steps"] == 8 and v1["tool_calls"]["max"] == 2 and [r["backend"] for r in v1["by_backend"]] == ["b1"]
    none = (await client.get("/v1/stats/token-usage", params={"task_id": "nope"})).json()
    assert none["steps"] == 0 and none["prompt_tokens"]["p95"] == 0 and none["by_backend"] == []


async def test_training(client):
    t = (await client.get("/v1/stats/training")).json()
    assert t["reward_curve"] == [
        {"policy_version": "1", "task_set": "easy", "rollouts": 4, "mean_reward": 0.25, "pass_rate": 0.25,
         "first_completed_at": T0 + 100},
        {"policy_version": "2", "task_set": "hard", "rollouts": 2, "mean_reward": 1.0, "pass_rate": 1.0,
         "first_completed_at": T0 + 900},
        {"policy_version": "2", "task_set": "", "rollouts": 2, "mean_reward": 0.0, "pass_rate": 0.0,
         "first_completed_at": T0 + 950}]
    # complete groups only (gm is not); gc's infrastructure member is left out of the comparison
    assert t["zero_variance"] == [{"policy_version": "1", "groups": 2, "zero_variance_groups": 1, "rate": 0.5},
                                  {"policy_version": "2", "groups": 1, "zero_variance_groups": 1, "rate": 1.0}]
    assert t["run"] == "r2" and t["trainer"] == [
        {"step": 1, "at": T0 + 3, "policy_version": "1", "metrics": {"loss": 0.1}},
        {"step": 2, "at": T0 + 4, "policy_version": "2", "metrics": {"loss": 0.2}}]
    r1 = (await client.get("/v1/stats/training", params={"run": "r1"})).json()
    assert r1["run"] == "r1" and [p["at"] for p in r1["trainer"]] == [T0 + 2, T0 + 3]


async def test_trainer_logprobs_round_trip_and_refusals(client):
    def post(**body):
        return client.post("/v1/trainer-logprobs", json={"run": "r1", "policy_version": "3", "rollout_id": "a0",
                                                         "sequence_index": 0, **body})

    # a0's steps do not extend each other's prompt: two sequences, of 10 + 4 and 20 + 2 tokens
    assert (await post(logprobs=[-1.0] * 14)).status_code == 201
    assert (await post(logprobs=[-0.5] * 14)).status_code == 201  # replaces
    assert (await post(sequence_index=1, logprobs=[-0.25] * 22, run="r0")).status_code == 201
    got = (await client.get("/v1/trajectories/a0/trainer-logprobs")).json()
    assert got == {"rollout_id": "a0", "sequences": [
        {"sequence_index": 0, "run": "r1", "policy_version": "3", "logprobs": [-0.5] * 14},
        {"sequence_index": 1, "run": "r0", "policy_version": "3", "logprobs": [-0.25] * 22}]}
    assert (await client.get("/v1/trajectories/b0/trainer-logprobs")).json() == {"rollout_id": "b0", "sequences": []}

    for bad, status in ((post(logprobs=[-1.0] * 13), 409), (post(sequence_index=2, logprobs=[]), 409),
                        (post(rollout_id="nope", logprobs=[-1.0]), 404), (post(logprobs="x"), 422),
                        (post(logprobs=[-1.0] * 14, extra=1), 422), (post(run="", logprobs=[-1.0] * 14), 422),
                        (post(logprobs=[-1.0] * 13 + [1e300]), 422),
                        (client.post("/v1/trainer-logprobs", content=b"{"), 422),
                        (client.post("/v1/trainer-logprobs", content=b""), 422)):
        answer = await bad
        assert answer.status_code == status and set(answer.json()["error"]) == {"code", "message"}


async def test_rollout_list_pages_by_keyset(client):
    everything = (await client.get("/v1/trajectories", params={"limit": 100})).json()["trajectories"]
    ids = [t["rollout_id"] for t in everything]
    assert ids == ["m1", "m0", "c2", "c1", "c0", "b0", "b1", "a1", "a0"]  # b0, b1 end at the same time
    pages, params = [], {"limit": 3}
    while True:
        page = (await client.get("/v1/trajectories", params=params)).json()["trajectories"]
        if not page:
            break
        pages.append([t["rollout_id"] for t in page])
        last = page[-1]
        params = {"limit": 3, "before_completed_at": last["completed_at"], "before_rollout": last["rollout_id"]}
    assert pages == [ids[0:3], ids[3:6], ids[6:9]]  # the middle page ends between b0 and b1
    older = (await client.get("/v1/trajectories", params={"before_completed_at": T0 + 120})).json()["trajectories"]
    assert [t["rollout_id"] for t in older] == ["a1", "a0"]
    offset = (await client.get("/v1/trajectories", params={"limit": 2, "offset": 7})).json()["trajectories"]
    assert [t["rollout_id"] for t in offset] == ["a1", "a0"]
    alone = await client.get("/v1/trajectories", params={"before_rollout": "a0", "limit": 100})
    assert [t["rollout_id"] for t in alone.json()["trajectories"]] == ids  # a tie-breaker without a time


async def test_a_keyset_rollout_id_that_is_no_identifier_is_refused(client):
    """Every id entering over HTTP follows the id grammar (ARCHITECTURE.md, Edges): 422, not a query."""
    for bad in ("é", "a b", "../x", "a" * 129):
        r = await client.get("/v1/trajectories", params={"before_completed_at": T0 + 120, "before_rollout": bad})
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", (bad, r.text)


async def test_filters_reach_every_aggregate(store):
    f = TrajectoryFilter(task_id="pow")
    assert (await insights.overview(store, f)).rollouts == 3
    assert (await insights.token_usage(store, f)).steps == 6
    assert [r.task_id for r in (await insights.tasks(store, f)).rows] == ["pow"]
    assert [(p.policy_version, p.task_set) for p in (await insights.training(store, f)).reward_curve] == [("2", "hard")]


async def test_the_cpu_trainer_posts_its_logprobs_of_the_sequences_it_trained_on(store, client):
    pytest.importorskip("torch")
    from arena_core.schemas import GroupCompleted
    from arena_rl.model import new_policy
    from arena_rl.tokenizer import CharTokenizer
    from arena_rl.trainer import post_logprobs, trained_members, trainer_logprobs

    ga = GroupCompleted(group_id="ga", task_id="add", size=2, trajectories=[await store.trajectory("a0"),
                        await store.trajectory("a1")], rewards=[1.0, 0.0], advantages=[1.0, -1.0], completed_at=T0)
    gb = GroupCompleted(group_id="gb", task_id="sub", size=2, trajectories=[await store.trajectory("b0"),
                        await store.trajectory("b1")], rewards=[0.0, 0.0], advantages=[0.0, 0.0], completed_at=T0)
    members = trained_members([ga, gb])  # gb's equal rewards teach nothing
    assert [t.rollout_id for t in members] == ["a0", "a1"]
    rows = trainer_logprobs(new_policy(CharTokenizer(), seed=0), members)
    assert [(rid, index, len(lp)) for rid, index, lp in rows] == [("a0", 0, 14), ("a0", 1, 22), ("a1", 0, 14),
                                                                  ("a1", 1, 22)]
    mine = [r for r in rows if r[0] == "a1"]  # a0's belong to the round-trip test
    await post_logprobs(client, "http://t", "cpu", "0", mine + [("a1", 7, [0.0])])  # the bad one is logged only
    got = (await client.get("/v1/trajectories/a1/trainer-logprobs")).json()["sequences"]
    assert [(s["sequence_index"], s["run"], s["policy_version"]) for s in got] == [(0, "cpu", "0"), (1, "cpu", "0")]
    assert got[1]["logprobs"] == approx(rows[3][2], rel=1e-6)
