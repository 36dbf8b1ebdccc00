"""The dashboard in a real browser (Playwright driving Chromium headless) against a real stack
(nats-server, the scripted LLM, the four services and the dashboard as processes): live updates
without a reload, a rollout's LLM calls and token overlay, a tamper flag on Verify, a duel on
the leaderboard. Each test saves its page to docs/img/dashboard-<page>.png (1280x800).

Not in ``make test``: ``make test-dashboard``. ``ARENA_CHROMIUM`` names the browser binary
(default /usr/bin/chromium)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.schemas import SamplingParams
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

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
        backend_policy_version="0", sandbox_concurrency=4, verify_concurrency=2)
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


def shot(page, name: str) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    if name != "rollout":  # the rollout's picture keeps its token tooltip
        page.mouse.move(0, 0)
    page.screenshot(path=str(IMG / f"dashboard-{name}.png"), full_page=False)


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
    shot(page, "rollout")


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


def test_a_duel_updates_the_leaderboard(stack, page):
    _, client = stack
    page.goto(f"{page.base}/#/leaderboard")
    loaded(page, "leaderboard")
    page.evaluate("window.__sameDocument = true")
    duel = client.submit_duel(load_task(QUICKSTART), policies=["policy-a", "policy-b"], n=2)  # POST /v1/duels
    for side in duel.rollout_ids:
        for rid in side:
            client.wait(rid, timeout=120)
    page.wait_for_selector(f'#duels tr[data-duel="{duel.duel_id}"]', timeout=60_000)
    page.wait_for_selector('#ratings tr[data-policy="policy-a"]', timeout=60_000)
    assert page.evaluate("window.__sameDocument") is True
    page.goto(f"{page.base}/#/leaderboard?duel={duel.duel_id}")
    loaded(page, "leaderboard")
    page.wait_for_selector("table.rounds tbody tr")
    assert page.locator("table.rounds a").count() == 4  # both rollouts of both rounds
    shot(page, "leaderboard")


def test_the_other_pages_render_their_aggregates(stack, page):
    st, _ = stack
    for step in range(1, 13):  # a trainer's metrics, as arena_rl posts them
        httpx.post(f"{st.settings.trajectory_url}/v1/trainer-metrics", timeout=10, json={
            "run": "demo", "step": step, "at": time.time(), "policy_version": str(step // 4),
            "metrics": {"loss": 1.0 / step, "kl": 0.002 * step, "entropy": 1.5 - 0.05 * step,
                        "grad_norm": 0.8 + 0.1 * (step % 3), "lr": 1e-5, "staleness_mean": 0.5}}).raise_for_status()
    page.goto(f"{page.base}/#/training?run=demo")
    loaded(page, "training")
    page.wait_for_selector("#trainer-charts canvas")
    httpx.post(f"{st.settings.trajectory_url}/v1/trainer-metrics", timeout=10, json={
        "run": "demo", "step": 13, "at": time.time(), "policy_version": "3",
        "metrics": {"loss": 0.07}}).raise_for_status()
    page.wait_for_function("() => document.querySelector('h2')?.textContent.includes('13 steps') || "
                           "[...document.querySelectorAll('h2')].some(h => h.textContent.includes('13 steps'))",
                           timeout=20_000)  # live, from arena.trainer.metrics
    shot(page, "training")
    for name, url in (("tokens", "#/tokens?window=all"), ("tasks", "#/tasks?order=attempts")):
        page.goto(f"{page.base}/{url}")
        loaded(page, name)
        page.wait_for_timeout(300)
        shot(page, name)
    assert page.locator('#tasks tr[data-task="quickstart-textstats"]').count() == 1
