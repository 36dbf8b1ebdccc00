"""Duels end to end: the real stack, two scripted LLMs registered in ``arena_backends`` under two
model names (one answers the quickstart task right, one wrong), ``arena duel`` (the CLI as a
subprocess) for three seeds, then the duel's rounds, the leaderboard and the live notices."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import msgspec
import nats
import pytest

from arena.tasks import load_task
from arena_core import apikeys, subjects
from arena_core.schemas import DuelRoundDone
from arena_core.settings import Settings
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack
from tests.duel_backends import QUICKSTART, register, replica, script, start_scripted_llm, stop

GOOD, BAD = "policy-good", "policy-bad"

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


async def test_a_duel_through_the_cli_rates_the_right_policy_higher(tmp_path):
    good_url = f"http://127.0.0.1:{free_port()}/v1"
    bad_port = free_port()
    settings = Settings(nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
                        rollout_port=(rp := free_port()), trajectory_port=free_port(),
                        public_url=f"http://127.0.0.1:{rp}", backend_url=good_url, backend_policy_version="0",
                        sandbox_concurrency=6, verify_concurrency=3)
    stack = Stack(settings, llm_script=script(tmp_path, "correct"), nats_sync="1s", log=lambda m: None)
    bad = None
    await stack.start()
    settings = stack.settings  # its NATS URL carries the administrator's credentials
    key = apikeys.auth_headers(stack.api_key)
    try:
        bad = await asyncio.to_thread(start_scripted_llm, script(tmp_path, "wrong"), bad_port, tmp_path / "bad-llm.log")
        # "default" (the stack's scripted LLM) now serves only GOOD; BAD has its own replica
        await register(settings.nats_url, replica("bad", f"http://127.0.0.1:{bad_port}/v1", BAD),
                       replica("default", good_url, GOOD))

        # a task without its verifier: every request below is refused, never run
        task = msgspec.to_builtins(msgspec.structs.replace(load_task(QUICKSTART), verifier=None))
        async with httpx.AsyncClient(base_url=settings.rollout_url, timeout=30, headers=key) as http:
            async def refused(**changes) -> str:
                body = {"task": task, "policies": [GOOD, BAD], "n": 3, **changes}
                resp = await http.post("/v1/duels", content=json.dumps(body))
                assert resp.status_code == 422, resp.text
                assert resp.json()["error"]["code"] == "invalid_request"
                return resp.json()["error"]["message"]

            # the rollout service follows arena_backends: a model nobody serves is refused once it
            # has seen "default" narrowed (and "bad", registered before it)
            for _ in range(100):
                message = await refused(policies=[GOOD, "policy-nobody"])
                if "no backend replica serves model 'policy-nobody'" in message:
                    break
                await asyncio.sleep(0.1)
            assert "no backend replica serves model 'policy-nobody'" in message, message
            assert "task.verifier is required" in await refused()
            assert "two distinct model names" in await refused(policies=[GOOD, GOOD])
            assert "'default' leaves the choice" in await refused(policies=["default", BAD])
            assert "reserved for duels" in await refused(metadata={"arena.duel.side": "a"})
            assert "$.n" in await refused(n=65)
            assert "$.policies" in await refused(policies=[GOOD])

        notices: list[DuelRoundDone] = []

        async def keep(msg) -> None:
            notices.append(msgspec.json.decode(msg.data, type=DuelRoundDone))

        nc = await nats.connect(settings.nats_url)
        await nc.subscribe(subjects.duel_done("*"), cb=keep)
        try:
            env = {**os.environ, "ARENA_DATA_DIR": str(tmp_path / "cli"), "ARENA_API_KEY": stack.api_key}
            done = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "arena.cli", "--url", settings.rollout_url,
                                 "--trajectory-url", settings.trajectory_url, "duel", "--task", str(QUICKSTART),
                                 "--policy", GOOD, "--policy", BAD, "--seeds", "3", "--wait", "--timeout", "120"],
                capture_output=True, text=True, env=env, timeout=180)
            assert done.returncode == 0, done.stdout + done.stderr
            out = done.stdout
            duel_id = re.search(r"^duel (d-[0-9a-f]+)  task quickstart-textstats", out, re.M)[1]
            assert len(re.findall(rf"^  {duel_id} seed \d+\s+rewards 1  0\s+-> {GOOD}$", out, re.M)) == 3, out
            assert f"duel {duel_id}: {GOOD} 3 - 0 {BAD}, 0 draw(s), 0 void; winner: {GOOD}" in out, out
            board_lines = out.split("leaderboard (bradley-terry, 3 games")[1].splitlines()
            assert GOOD in board_lines[2] and BAD in board_lines[3], out

            async with httpx.AsyncClient(base_url=settings.trajectory_url, timeout=30, headers=key) as http:
                duel = (await http.get(f"/v1/duels/{duel_id}")).json()
                listed = (await http.get("/v1/duels", params={"limit": 5})).json()["duels"]
                board = (await http.get("/v1/leaderboard")).json()
                assert (await http.get("/v1/duels/d-nothing")).status_code == 404
            assert duel["policies"] == [GOOD, BAD] and duel["task_id"] == "quickstart-textstats"
            assert (duel["seeds"], duel["wins"], duel["draws"], duel["void"]) == (3, [3, 0], 0, 0)
            assert duel["complete"] is True and duel["winner"] == GOOD
            assert duel["started_at"] <= duel["completed_at"]
            assert [r["seed"] for r in duel["rounds"]] == [0, 1, 2]
            for r in duel["rounds"]:
                assert r["winner"] == "a" and r["rewards"] == [1.0, 0.0]
                assert all(rid.startswith("r-") for rid in r["rollout_ids"])
            assert [d["duel_id"] for d in listed] == [duel_id]
            assert listed[0] == {k: v for k, v in duel.items() if k != "rounds"}

            assert board["method"] == "bradley-terry" and board["games"] == 3
            assert [r["policy"] for r in board["ratings"]] == [GOOD, BAD]
            good, worse = board["ratings"]
            assert good["rating"] > 1500 > worse["rating"]
            assert (good["wins"], good["losses"], worse["wins"], worse["losses"]) == (3, 0, 0, 3)
            assert good["ci_low"] <= good["rating"] <= good["ci_high"]

            # a notice for each round, sent when its second side was stored
            for _ in range(100):
                if {n.seed for n in notices if n.duel_id == duel_id} == {0, 1, 2}:
                    break
                await asyncio.sleep(0.1)
            mine = [n for n in notices if n.duel_id == duel_id]
            assert sorted(n.seed for n in mine) == [0, 1, 2], notices
            assert all(n.winner == "a" for n in mine) and any(n.complete for n in mine)
        finally:
            await nc.close()
    finally:
        stop(bad)
        stack.stop()
