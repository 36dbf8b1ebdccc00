"""An agent in a real sandbox (local provider, bubblewrap) reaches only its own rollout's proxy
routes, with API keys on and off: the rollout API (list, cancel another rollout), another
rollout's proxy routes and every path trick are answered 404 in the API's error shape by the
sandbox's relay, without reaching the API; its own LLM calls work, kept alive, streamed and
pipelined. The whole stack runs as processes (docs/sandbox.md, "The LLM relay")."""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from arena.sdk import ArenaClient
from arena.tasks import load_task
from arena_core.schemas import Budget, RolloutState
from arena_core.settings import Settings
from arena_sandbox_providers import local
from arena_stack.natsserver import free_port
from arena_stack.stack import Stack

QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart"

pytestmark = [
    pytest.mark.skipif(local.available() is not None, reason=f"no bubblewrap: {local.available()}"),
    pytest.mark.timeout(600),
]

#: The agent: raw HTTP/1.1 over sockets to its OPENAI_BASE_URL's host and port (what any
#: program in the sandbox can send), each answer recorded in result.json.
ATTACK = textwrap.dedent(r'''
    import http.client, json, os, socket, urllib.parse

    base = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
    host, port = base.hostname, base.port
    rid, victim, key = os.environ["ARENA_ROLLOUT_ID"], os.environ["VICTIM"], os.environ["OPENAI_API_KEY"]
    own = f"/proxy/{rid}/v1/chat/completions"
    chat = json.dumps({"model": "default", "seed": 1,
                       "messages": [{"role": "user", "content": "fix the bug"}]}).encode()

    def request(method, target, body=b"", extra=""):
        head = (f"{method} {target} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n")
        return head.encode() + body

    class Kept:  # the connection's reader, not closed by HTTPResponse after an answer
        def __init__(self, fp):
            self.fp = fp
        def __getattr__(self, name):
            return getattr(self.fp, name)
        def close(self):
            pass

    def responses(sock, n):
        fp = Kept(sock.makefile("rb"))
        out = []
        for _ in range(n):
            class One:
                def makefile(self, *a, **k):
                    return fp
            r = http.client.HTTPResponse(One(), method="POST")
            r.begin()
            out.append({"status": r.status, "relay": r.getheader("x-arena-relay"), "body": r.read().decode()})
        return out

    def raw(data, n=1):
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(data)
            return responses(sock, n)

    results = {}
    tries = {
        "list rollouts": request("GET", "/v1/rollouts"),
        "list rollouts, no version": request("GET", "/rollouts"),
        "cancel another rollout": request("POST", f"/v1/rollouts/{victim}/cancel"),
        "cancel another rollout, no version": request("POST", f"/rollouts/{victim}/cancel"),
        "another rollout's proxy": request("POST", f"/proxy/{victim}/v1/chat/completions", chat),
        "another rollout's models": request("GET", f"/proxy/{victim}/v1/models"),
        "dot-dot out of its prefix": request("GET", f"/proxy/{rid}/../../v1/rollouts"),
        "dot-dot into another rollout": request("POST", f"/proxy/{rid}/../{victim}/v1/chat/completions", chat),
        "percent-encoded dot-dot": request("GET", f"/proxy/{rid}/%2e%2e/%2e%2e/v1/rollouts"),
        "percent-encoded slash": request("POST", f"/proxy/{rid}/v1/chat%2Fcompletions", chat),
        "double slash": request("POST", f"//proxy/{rid}/v1/chat/completions", chat),
        "absolute-form to the API": request("GET", f"http://{host}:{port}/v1/rollouts"),
        "absolute-form to its own route": request("POST", f"http://{host}:{port}{own}", chat),
        "lower-case method": request("post", own, chat),
        "another method on its route": request("DELETE", own),
        "health of the service": request("GET", "/healthz"),
        "the judge route": request("POST", f"/judge/{rid}/v1/chat/completions", chat),
    }
    for name, data in tries.items():
        results[name] = raw(data)[0]
    # a second request pipelined behind its own call on one connection
    results["pipelined"] = raw(request("POST", own, chat) + request("GET", "/v1/rollouts"), 2)
    # its own calls, three on one kept-alive connection, then one streamed
    conn = http.client.HTTPConnection(host, port, timeout=60)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    socks = []
    own_calls = []
    for _ in range(3):
        conn.request("POST", own, body=chat, headers=headers)
        r = conn.getresponse()
        own_calls.append({"status": r.status, "body": r.read().decode()})
        socks.append(id(conn.sock))
    results["own calls"] = own_calls
    results["kept alive"] = len(set(socks)) == 1 and conn.sock is not None
    stream = json.dumps({"model": "default", "seed": 1, "stream": True,
                         "messages": [{"role": "user", "content": "fix the bug"}]}).encode()
    conn.request("POST", own, body=stream, headers=headers)
    r = conn.getresponse()
    results["streamed"] = {"status": r.status, "type": r.getheader("content-type"), "body": r.read().decode()}
    results["kept alive after the stream"] = id(conn.sock) == socks[0]
    conn.close()
    with open("/sandbox/.arena/result.json", "w") as fh:
        json.dump(results, fh)
    open("/sandbox/.arena/done", "w").close()
''')


@pytest.mark.parametrize("auth", ["keys", "off"])
async def test_an_agent_reaches_only_its_own_rollouts_proxy_routes(tmp_path, auth):
    rp = free_port()
    settings = Settings(
        allow_host_paths=True, auth=auth,
        nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
        rollout_port=rp, trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
        sandbox_provider="local", sandbox_concurrency=2, verify_concurrency=1,
    )
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "attack.py").write_text(ATTACK)
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    await stack.start(timeout=120)
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key, timeout=60)
    try:
        quickstart = load_task(QUICKSTART / "task.json")
        budget = Budget(max_turns=50, max_total_tokens=200_000, wall_clock_s=120)
        victim_task = msgspec.structs.replace(
            quickstart, budget=budget, agent=msgspec.structs.replace(quickstart.agent, command=["sleep", "100"]))
        victim = await asyncio.to_thread(client.submit, victim_task)
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(client.get, victim.rollout_id)).state is not RolloutState.RUNNING:
            assert time.monotonic() < deadline, "the victim's sandbox never started"
            await asyncio.sleep(0.2)
        attacker_task = msgspec.structs.replace(quickstart, budget=budget, agent=msgspec.structs.replace(
            quickstart.agent, command=["python3", "/sandbox/agent/attack.py"], path=str(agent),
            env={"VICTIM": victim.rollout_id}))
        attacker = await asyncio.to_thread(client.submit, attacker_task)
        view = await asyncio.to_thread(client.wait, attacker.rollout_id, timeout=180)
        assert view.state is RolloutState.COMPLETED, view.reason
        trajectory = await asyncio.to_thread(client.wait_trajectory, attacker.rollout_id, timeout=60)
        results = trajectory.sandbox.result
        assert results is not None, trajectory.sandbox.reason

        # every try: 404 in the API's shape, answered by the relay (the API never saw it)
        tries = {name: r for name, r in results.items() if isinstance(r, dict) and name != "streamed"}
        assert len(tries) == 17, sorted(results)
        for name, answer in tries.items():
            assert answer["status"] == 404, (name, answer)
            assert answer["relay"] == "refused", (name, answer)
            error = json.loads(answer["body"])["error"]
            assert "no route for" in error["message"], (name, error)
        assert json.loads(tries["list rollouts"]["body"])["error"]["code"] == "not_found"  # Arena's shape
        assert json.loads(tries["another rollout's proxy"]["body"])["error"]["type"] == "not_found_error"  # OpenAI's

        # the victim was never touched: still running, never cancelled by the agent
        assert (await asyncio.to_thread(client.get, victim.rollout_id)).state is RolloutState.RUNNING

        # its own calls went through: the pipelined one, three kept alive, one streamed
        first, second = results["pipelined"]
        assert first["status"] == 200 and json.loads(first["body"])["choices"], first
        assert second["status"] == 404 and second["relay"] == "refused", second
        assert [c["status"] for c in results["own calls"]] == [200, 200, 200], results["own calls"]
        assert results["kept alive"] and results["kept alive after the stream"]
        streamed = results["streamed"]
        assert streamed["status"] == 200 and streamed["type"].startswith("text/event-stream"), streamed
        assert streamed["body"].rstrip().endswith("data: [DONE]"), streamed["body"][-200:]
        assert view.steps == 5  # 1 pipelined + 3 kept alive + 1 streamed: only its own calls are steps
        await asyncio.to_thread(client.cancel, victim.rollout_id)
    finally:
        client.close()
        stack.stop()
