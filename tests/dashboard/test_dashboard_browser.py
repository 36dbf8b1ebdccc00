"""The dashboard in a real browser (Playwright driving Chromium headless) against a real stack
(nats-server, the scripted LLM, the four services and the dashboard as processes): live updates
without a reload, a rollout's LLM calls and token overlay, a tamper flag on Verify, a real GRPO
run (the CPU trainer of arena_rl and its policy server) on Training and as the trainer-vs-inference
overlay of a rollout it trained on, duels between three policies served by three backends on the
leaderboard, an evaluation job's report on Evaluations and its self-contained HTML report opened from disk.
Each test saves its page to docs/img/dashboard-<page>.png (1280x800).

Not in ``make test``: ``make test-dashboard``. ``ARENA_CHROMIUM`` names the browser binary
(default /usr/bin/chromium)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.schemas import SamplingParams
from arena_core.settings import Settings
from arena_stack.natsserver import free_port, wait_port
from arena_stack.stack import Stack
from tests.duel_backends import register, replica, script, start_scripted_llm, stop, unregister

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart"
IMG = ROOT / "docs" / "img"
CHROMIUM = os.environ.get("ARENA_CHROMIUM", "/usr/bin/chromium")

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (ARENA_CHROMIUM)"),
]
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

#: An agent that weakens the tests instead of fixing the bug (no LLM call): flagged tests_tampered.
TAMPERING_AGENT = """\
import os, pathlib
root = pathlib.Path(os.environ.get("ARENA_SANDBOX_ROOT", "/sandbox"))
tests = root / "workspace" / "tests" / "test_textstats.py"
tests.write_text(tests.read_text().replace("assert ", "assert True or "))
(root / ".arena" / "done").write_text("{}")
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("arena-dashboard")
    settings = Settings(
        nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(data_dir),
        rollout_port=(rp := free_port()), trajectory_port=free_port(), dashboard_port=free_port(),
        public_url=f"http://127.0.0.1:{rp}", backend_url=f"http://127.0.0.1:{free_port()}/v1",
        backend_policy_version="0", sandbox_concurrency=4, verify_concurrency=2,
        # the pages are under test, not the sign-in (tests/dashboard/test_dashboard_app.py): no API keys
        auth="off")
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    asyncio.run(stack.start())
    try:
        assert stack.dashboard_started
        yield stack, ArenaClient(settings.rollout_url, settings.trajectory_url)
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser, stack):
    context = browser.new_context(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda exc: errors.append(str(exc)))
    p.base = stack[0].dashboard_url  # type: ignore[attr-defined]
    try:
        yield p
    finally:
        context.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def shot(page, name: str, *, keep_tip: bool = False, full_page: bool = False) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    if not keep_tip:  # a rollout's pictures keep their token tooltip
        page.mouse.move(0, 0)
    page.screenshot(path=str(IMG / f"dashboard-{name}.png"), full_page=full_page)


def run_async(coro):
    """Run a coroutine to its end on a thread of its own: Playwright's sync API keeps an event loop
    running on this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def loaded(page, name: str, timeout: float = 20_000) -> None:
    page.wait_for_selector(f'.page[data-page="{name}"][data-loaded]', timeout=timeout)


def run_group(client: ArenaClient, n: int = 4, seed: int = 0, sampling: SamplingParams | None = None) -> list[str]:
    group = client.submit_group(load_task(QUICKSTART), n=n, seed=seed, sampling=sampling)
    return group.rollout_ids


def test_the_overview_follows_a_running_group_without_a_reload(stack, page):
    _, client = stack
    page.goto(f"{page.base}/#/overview?window=all")
    loaded(page, "overview")
    page.evaluate("window.__sameDocument = true")
    first = page.locator(".tile", has_text="Rollouts / s").locator(".sub").inner_text()
    ids = run_group(client, n=4, seed=0)
    # the live counters move while the group runs (SSE), then the aggregates refresh when it ends
    page.wait_for_function("() => Number(document.getElementById('ov-running')?.textContent) > 0 || "
                           "Number(document.getElementById('ov-verifying')?.textContent) > 0", timeout=60_000)
    views = [client.wait(rid, timeout=120) for rid in ids]
    assert [v.state.value for v in views] == ["completed"] * 4
    page.wait_for_function("(first) => { const n = [...document.querySelectorAll('.tile')].find(t => "
                           "t.textContent.includes('Rollouts / s')); return n && !n.textContent.includes(first); }",
                           arg=first, timeout=30_000)
    page.wait_for_function("() => document.getElementById('ov-running').textContent === '0' && "
                           "document.getElementById('ov-verifying').textContent === '0'", timeout=30_000)
    page.wait_for_function("() => [...document.querySelectorAll('.tile')].some(t => "
                           "t.textContent.includes('4 rollouts ended'))", timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True  # no reload happened
    shot(page, "overview")


def test_the_rollouts_list_gets_new_rows_live_and_a_rollout_shows_its_calls_and_tokens(stack, page):
    _, client = stack
    page.goto(f"{page.base}/#/rollouts")
    loaded(page, "rollouts")
    page.evaluate("window.__sameDocument = true")
    ids = run_group(client, n=2, seed=1, sampling=SamplingParams(temperature=1.0, top_logprobs=3))
    for rid in ids:
        page.wait_for_selector(f'#rollout-rows tr[data-rollout="{rid}"]', timeout=60_000)
    for rid in ids:
        client.wait(rid, timeout=120)
        client.wait_trajectory(rid, timeout=30)
    page.wait_for_function("(ids) => ids.every(id => document.querySelector(`#rollout-rows tr[data-rollout=\"${id}\"]`)"
                           "?.textContent.includes('completed'))", arg=ids, timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True
    shot(page, "rollouts")

    page.goto(f"{page.base}/#/rollout/{ids[0]}")
    loaded(page, "rollout")
    assert page.locator(".step h2", has_text="LLM call 0").count() == 1
    assert "policy version" in page.locator(".step").first.inner_text()
    tokens = page.locator('[data-step="0"] .tok')
    assert tokens.count() > 20
    tokens.nth(5).hover()
    tip = page.locator("#tip")
    tip.wait_for(state="visible")
    assert "token id" in tip.inner_text() and "logprob" in tip.inner_text()
    assert page.locator(".timeline .st").count() == 5  # pending .. completed
    assert page.locator("pre .add").count() >= 1  # the final diff
    assert page.locator("[data-sequence] .tok").count() > 0  # the training sequence with its loss mask
    assert "top logprobs" in tip.inner_text()
    page.locator("input[value=advantage]").check()  # the group's advantage over the trained tokens
    page.wait_for_url("**colour=advantage**")
    loaded(page, "rollout")
    page.locator("input[value=logprob]").check()
    page.wait_for_url("**colour=logprob**")
    loaded(page, "rollout")
    page.locator('[data-step="0"] .tok').nth(9).hover()
    tip.wait_for(state="visible")
    shot(page, "rollout", keep_tip=True)


def test_a_tampering_rollout_shows_up_as_a_flag_on_verify(stack, page, tmp_path):
    _, client = stack
    page.goto(f"{page.base}/#/verify?window=all")
    loaded(page, "verify")
    agent_dir = tmp_path / "tamperer"
    agent_dir.mkdir()
    (agent_dir / "agent.py").write_text(TAMPERING_AGENT)
    task = load_task(QUICKSTART)
    agent = msgspec.structs.replace(task.agent, path=str(agent_dir))
    task = msgspec.structs.replace(task, id="quickstart-tamper", agent=agent)
    rid = client.submit(task).rollout_id
    view = client.wait(rid, timeout=120)
    assert view.state.value == "completed"
    client.wait_trajectory(rid, timeout=30)
    row = page.locator('tr[data-flag="tests_tampered"]')
    row.wait_for(timeout=30_000)  # the page re-fetched on the live refresh notice
    assert row.locator(f'a[href="#/rollout/{rid}"]').count() == 1
    shot(page, "verify")
    row.locator(f'a[href="#/rollout/{rid}"]').click()
    loaded(page, "rollout")
    assert page.locator('[data-flag="tests_tampered"]').count() >= 1


#: The GRPO run: real steps of arena_rl's CPU trainer, each on ``batch_groups`` groups of ``group_size``.
RL_STEPS, RL_BATCH_GROUPS, RL_GROUP_SIZE = 4, 2, 4
RL_TASK_SET = "majority-bits"


class TaskSetClient(ArenaClient):
    """The loop's groups labelled with a task set of their own (``metadata.task_set``): their own
    line on the reward curve, apart from the quickstart's rollouts."""

    def submit_group(self, task, **kw):
        return super().submit_group(task, **{**kw, "metadata": {"task_set": RL_TASK_SET, **(kw.get("metadata") or {})}})


def test_a_grpo_run_fills_training_and_its_rollouts_show_the_trainer_vs_inference_gap(stack, page, tmp_path):
    """examples/grpo-loop through this stack: the policy server (char engine) replaces the scripted
    LLM as replica ``default`` in arena_backends while it runs, the trainer posts its metrics and its
    own logprobs of what it trained on to the trajectory API, the Training page follows it live."""
    torch = pytest.importorskip("torch")
    from arena_rl.loop import LoopConfig, run_loop
    from arena_rl.model import new_policy, save_checkpoint
    from arena_rl.tasks import ALPHABET, majority_family
    from arena_rl.tokenizer import CharTokenizer
    from arena_rl.trainer import GRPOTrainer, TrainerConfig, trained_members

    st, client = stack
    settings = st.settings
    torch.set_num_threads(1)
    tok = CharTokenizer(alphabet=ALPHABET)
    model = new_policy(tok, seed=0, d_model=32, n_layers=1, n_heads=4, max_len=16)
    ckpt = save_checkpoint(tmp_path / "policy-v0.pt", model, tok, 0)
    port = free_port()
    policy_url = f"http://127.0.0.1:{port}/v1"
    page.goto(f"{page.base}/#/training?run=grpo-loop")
    loaded(page, "training")
    page.evaluate("window.__sameDocument = true")
    with open(tmp_path / "policy-server.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "arena_rl.policy_server", "--engine", "char",
                                   "--checkpoint", str(ckpt), "--port", str(port), "--nats-url", settings.nats_url,
                                   "--replica-id", "default"], stdout=log, stderr=log)
    groups = []
    try:
        wait_port("127.0.0.1", port, 60, server)
        trainer = GRPOTrainer(model, tok, TrainerConfig(lr=2e-3, epochs=2, kl_coef=0.02, batch_groups=RL_BATCH_GROUPS,
                                                          mode="sync"),
                              push_urls=[policy_url])
        original_run = trainer.run

        async def run_keeping_groups(stream, **kw):
            accept = kw["accept"]
            # the stream also holds the earlier tests' quickstart groups: committed, not trained on
            kw["accept"] = lambda g: (accept(g) and g.task_id.startswith("train-majority-")
                                      and (groups.append(g) or True))
            return await original_run(stream, **kw)

        trainer.run = run_keeping_groups
        train, _ = majority_family()
        with TaskSetClient(settings.rollout_url, settings.trajectory_url, timeout=60) as rl_client:
            history = run_async(asyncio.wait_for(
                run_loop(client=rl_client, trainer=trainer, nats_url=settings.nats_url, train_items=train,
                         config=LoopConfig(steps=RL_STEPS, group_size=RL_GROUP_SIZE),
                         metrics_url=settings.trajectory_url), timeout=200))
            # a group the driver submitted as the last step ended still runs: served before the server stops
            deadline = time.monotonic() + 60
            while not all(v.state.is_final for v in rl_client.list()) and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        stop(server)
        run_async(unregister(settings.nats_url, "default"))  # the scripted LLM is "default" again
    assert [m.policy_version for m in history] == list(range(1, RL_STEPS + 1))
    assert all(m.trajectories == RL_BATCH_GROUPS * RL_GROUP_SIZE for m in history)

    # the steps arrived while the page was open (arena.trainer.metrics), without a reload
    page.wait_for_function("(n) => [...document.querySelectorAll('h2')]"
                           ".some(h => h.textContent.includes(`(${n} steps)`))",
                           arg=RL_STEPS, timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True
    training = httpx.get(f"{settings.trajectory_url}/v1/stats/training", params={"run": "grpo-loop"}, timeout=10).json()
    curve = sorted(p["policy_version"] for p in training["reward_curve"] if p["task_set"] == RL_TASK_SET)
    assert set(curve) >= {str(v) for v in range(RL_STEPS)}, training["reward_curve"]  # v3 sampled step 4's
    assert {z["policy_version"] for z in training["zero_variance"]} >= {str(v) for v in range(RL_STEPS)}
    page.reload()  # the aggregates (reward curve, zero-variance rate) of every version, stored by now
    loaded(page, "training")
    page.wait_for_selector("#trainer-charts canvas")
    for name in ("loss", "kl", "clip_fraction", "mean_reward"):
        assert page.locator("#trainer-charts .card", has_text=name).count() >= 1, name
    assert page.locator(".card", has_text="Reward per policy version").locator("canvas").count() == 1
    assert page.locator(".card", has_text="Zero-variance groups").locator("canvas").count() == 1
    shot(page, "training", full_page=True)  # every trainer metric the run posted

    # a rollout the trainer trained on: its sequence carries the trainer's logprobs
    trained = sorted(trained_members(groups), key=lambda t: -t.reward)  # a rewarded one first
    assert trained, "every group had uniform rewards: nothing was trained on"
    rid = trained[0].rollout_id
    posted = httpx.get(f"{settings.trajectory_url}/v1/trajectories/{rid}/trainer-logprobs", timeout=10).json()
    assert posted["sequences"], posted
    page.goto(f"{page.base}/#/rollout/{rid}")
    loaded(page, "rollout")
    option = page.locator("input[value=mismatch]")
    assert option.is_enabled()
    option.check()
    page.wait_for_url("**colour=mismatch**")
    loaded(page, "rollout")
    assert page.locator("input[value=mismatch]").is_checked()
    page.locator(".legend", has_text="trainer and inference disagree").wait_for()
    trained_token = page.locator("[data-sequence] .tok:not(.masked)").first
    # the colour toggles at the top of the picture, the trained sequence and its tooltip below them
    page.evaluate("() => window.scrollTo(0, document.querySelector('.toggles').getBoundingClientRect().top "
                  "+ window.scrollY - 110)")
    trained_token.hover()
    tip = page.locator("#tip")
    tip.wait_for(state="visible")
    assert "trainer logprob" in tip.inner_text() and "Δ" in tip.inner_text()
    shot(page, "rollout-mismatch", keep_tip=True)


GOOD, MIXED, BAD = "policy-good", "policy-mixed", "policy-bad"


async def routed(settings: Settings, task) -> None:
    """Until the rollout service follows the narrowed replicas: a model nobody serves is refused."""
    body = {"task": msgspec.to_builtins(msgspec.structs.replace(task, verifier=None)),
            "policies": [GOOD, "policy-nobody"], "n": 1}
    async with httpx.AsyncClient(base_url=settings.rollout_url, timeout=30) as http:
        for _ in range(200):
            resp = await http.post("/v1/duels", json=body)  # never run: a duel without a verifier is refused
            if "no backend replica serves model 'policy-nobody'" in resp.text:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the rollout service did not follow arena_backends: {resp.text}")


def test_duels_between_three_backends_order_the_leaderboard(stack, page, tmp_path):
    """Three policies, three backends (tests/duel_backends.py): GOOD always answers the quickstart task
    right, BAD always wrong, MIXED is the stack's scripted LLM (right or wrong by seed)."""
    st, client = stack
    settings = st.settings
    task = load_task(QUICKSTART)
    page.goto(f"{page.base}/#/leaderboard")
    loaded(page, "leaderboard")
    page.evaluate("window.__sameDocument = true")
    good_port, bad_port = free_port(), free_port()
    procs = []
    try:
        procs.append(start_scripted_llm(script(tmp_path, "correct"), good_port, tmp_path / "good-llm.log"))
        procs.append(start_scripted_llm(script(tmp_path, "wrong"), bad_port, tmp_path / "bad-llm.log"))
        run_async(register(settings.nats_url, replica("good", f"http://127.0.0.1:{good_port}/v1", GOOD),
                             replica("bad", f"http://127.0.0.1:{bad_port}/v1", BAD),
                             replica("default", settings.backend_url, MIXED)))
        run_async(routed(settings, task))
        duels = [client.submit_duel(task, policies=pair, n=3)  # POST /v1/duels, seeds 0..2
                 for pair in ([GOOD, BAD], [GOOD, MIXED], [MIXED, BAD])]
        for duel in duels:
            for side in duel.rollout_ids:
                for rid in side:
                    client.wait(rid, timeout=180)
    finally:
        run_async(unregister(settings.nats_url, "good", "bad", "default"))
        for proc in procs:
            stop(proc)
    for duel in duels:
        page.wait_for_selector(f'#duels tr[data-duel="{duel.duel_id}"]', timeout=60_000)
    board = httpx.get(f"{settings.trajectory_url}/v1/leaderboard", timeout=10).json()
    for _ in range(100):  # every round decided and stored
        if board["games"] == 9:
            break
        page.wait_for_timeout(200)
        board = httpx.get(f"{settings.trajectory_url}/v1/leaderboard", timeout=10).json()
    assert board["games"] == 9, board
    ratings = {r["policy"]: r for r in board["ratings"]}
    assert ratings[GOOD]["losses"] == 0 and ratings[BAD]["wins"] == 0, board
    assert ratings[GOOD]["rating"] > ratings[BAD]["rating"]
    # the browser orders them too, live (arena.duel.done), without a reload
    page.wait_for_function("(want) => { const rows = [...document.querySelectorAll('#ratings tbody tr')]"
                           ".map(r => r.dataset.policy); return rows.length === 3 && rows[0] === want[0] && "
                           "rows[2] === want[1]; }", arg=[GOOD, BAD], timeout=30_000)
    assert page.evaluate("window.__sameDocument") is True
    assert page.locator("svg.forest circle").count() == 3
    for row in page.locator("#ratings tbody tr").all():  # each interval is an interval
        low, high = (int(x.replace(",", "")) for x in row.locator("td").nth(2).inner_text().split(" – "))
        assert low < high
    first = duels[0]
    page.goto(f"{page.base}/#/leaderboard?duel={first.duel_id}")
    loaded(page, "leaderboard")
    page.wait_for_selector("table.rounds tbody tr")
    assert page.locator("table.rounds tbody tr").count() == 3
    assert page.locator("table.rounds a").count() == 6  # both rollouts of every round
    row = page.locator(f'#duels tr[data-duel="{first.duel_id}"]')
    assert "3 – 0" in row.inner_text() and GOOD in row.locator(".badge").inner_text()
    shot(page, "leaderboard")


def test_the_other_pages_render_their_aggregates(stack, page):
    for name, url in (("tokens", "#/tokens?window=all"), ("tasks", "#/tasks?order=attempts")):
        page.goto(f"{page.base}/{url}")
        loaded(page, name)
        page.wait_for_timeout(300)
        shot(page, name)
    assert page.locator('#tasks tr[data-task="quickstart-textstats"]').count() == 1


def test_an_openenv_episode_shows_its_exchanges_on_the_rollout_page(stack, page):
    """An episode played with OpenEnv's client (docs/openenv.md): its resets and steps as a table."""
    from openenv.core import GenericEnvClient

    _, client = stack
    env = client.put_environment("dashboard-quickstart", load_task(QUICKSTART), max_concurrent=4)
    with GenericEnvClient(base_url=env.url).sync() as episode:
        first = episode.reset()
        episode.step({"type": "call_tool", "tool_name": "shell", "arguments": {"command": "ls textstats"}})
        episode.step({"type": "call_tool", "tool_name": "submit", "arguments": {}})
        rid = first.observation["rollout_id"]
    client.wait(rid, timeout=120)
    client.wait_trajectory(rid, timeout=30)
    page.goto(f"{page.base}/#/rollout/{rid}")
    loaded(page, "rollout")
    card = page.locator(".card", has_text="Environment episode (3 exchanges)")
    assert card.count() == 1
    text = card.inner_text()
    assert "reset" in text and "shell" in text and "core.py" in text and "submit" in text


def test_evaluations_list_a_stored_job_show_its_report_and_the_html_report_renders_offline(stack, page, tmp_path):
    """An ``arena eval`` report stored on the trajectory service (as the CLI does) is listed on
    Evaluations and opens as tables, the pass@k curve and the models × tasks heat map; the job's
    self-contained report.html opened from disk draws its curve and heat map and fetches nothing."""
    import io

    from arena.evaluation import report, runner
    from arena_core.schemas import RolloutState
    from tests.client.test_evaluation_job import FakeClient, dataset

    solved = {"ckpt-800": {"t0", "t1", "t2"}, "ckpt-700": {"t0"}}
    attempt_of = {runner.seed_of(0, f"t{t}", i): i for t in range(4) for i in range(3)}

    def decide(task, model, seed, try_):  # ckpt-800 solves three tasks, ckpt-700 one, each on attempts 0 and 2
        hit = task in solved[model] and attempt_of[seed] != 1
        return RolloutState.COMPLETED, 1.0 if hit else 0.0, False

    job = runner.create_job(dataset(tmp_path, 4), agent="task", models=["ckpt-800", "ckpt-700"], k=3, concurrency=4,
                            root=tmp_path / "evals")
    runner.run_job(FakeClient(decide), job, stream=io.StringIO(), tty=False)
    built = report.build(job)
    report.write_files(built, job)
    client = stack[1]
    assert client.store_eval_report(msgspec.json.encode(built))["version"] == 1
    job_id = built.spec.job_id

    page.goto(f"{page.base}/#/evals")
    loaded(page, "evals")
    row = page.locator(f'#evals tr[data-job="{job_id}"]')
    assert "ckpt-800" in row.inner_text() and "v1" in row.inner_text()
    row.locator("a.mono").click()
    page.wait_for_selector("#eval-models")
    loaded(page, "evals")
    models = page.locator("#eval-models tbody tr")
    assert models.count() == 2
    assert models.nth(0).locator("td").nth(5).inner_text().startswith("0.500 [")  # ckpt-800's pass@1: 3 of 4 × 2/3
    assert page.locator("svg.passk polyline").count() == 2  # a curve per model
    heat = page.locator("#eval-heat tbody tr")
    assert heat.count() == 4
    assert page.locator('#eval-heat tr[data-task="t1"] td[data-model="ckpt-800"]').inner_text() == "2/3"
    assert page.locator('#eval-heat tr[data-task="t1"] td[data-model="ckpt-800"]').get_attribute("style")
    assert page.locator("#eval-comparisons tbody tr").count() == 3 and page.locator("#eval-ratings tbody tr").count() == 2
    shot(page, "evals", full_page=True)

    fetched: list[str] = []
    page.on("request", lambda request: fetched.append(request.url))
    page.goto((job / "report.html").as_uri())
    page.wait_for_load_state("load")
    assert fetched == [(job / "report.html").as_uri()]  # the page itself, and nothing else
    svgs = page.locator("svg")
    assert svgs.count() >= 2 and all(svgs.nth(i).bounding_box()["width"] > 100 for i in range(svgs.count()))
    assert "ckpt-800" in page.locator("body").inner_text() and page.locator("table").count() >= 3
