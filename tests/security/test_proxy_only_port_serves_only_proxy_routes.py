"""The rollout service's proxy-only port (``ARENA_PROXY_PORT``, what Kubernetes sandbox pods reach)
serves only the agents' proxy routes, with API keys on and off: the rollout API (list, get,
submit, cancel another rollout, its events), health, metrics, the judge route, OpenAPI and every
``..`` or percent-encoded trick get a 404 in the API's error shape there, sent by the filter in
front of the API (even with the project's admin key or the judge key), and the target rollout is
untouched; the proxy routes reach the proxy, which still checks the rollout's key; an agent
whose base URL is that port (the stack gives it that port) makes its calls, whole and streamed.
The main port still serves the API and the judge route. The whole stack runs as processes
(docs/kubernetes.md, docs/sandbox.md "The LLM relay")."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit

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

CHAT = json.dumps({"model": "default", "seed": 1, "messages": [{"role": "user", "content": "fix the bug"}]}).encode()

#: The agent: its own calls to its OPENAI_BASE_URL (a whole answer, then a streamed one), and the
#: base URL it was given, in result.json.
AGENT = textwrap.dedent(r'''
    import http.client, json, os, urllib.parse

    base = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
    headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
    own = base.path.rstrip("/") + "/chat/completions"
    conn = http.client.HTTPConnection(base.hostname, base.port, timeout=60)
    results = {"base_url": os.environ["OPENAI_BASE_URL"]}
    for name, stream in (("whole", False), ("streamed", True)):
        body = {"model": "default", "seed": 1, "messages": [{"role": "user", "content": "fix the bug"}]}
        if stream:
            body["stream"] = True
        conn.request("POST", own, body=json.dumps(body), headers=headers)
        r = conn.getresponse()
        results[name] = {"status": r.status, "type": r.getheader("content-type"), "body": r.read().decode()}
    conn.close()
    with open("/sandbox/.arena/result.json", "w") as fh:
        json.dump(results, fh)
    open("/sandbox/.arena/done", "w").close()
''')


def raw(port: int, method: str, target: str, *, key: str | None = None, body: bytes = b"") -> dict:
    """One request sent as written (no client normalises its target): status, headers, body."""
    head = f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n" \
           f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n" + body)

        class One:
            def makefile(self, *args, **kwargs):
                return sock.makefile("rb")

        response = http.client.HTTPResponse(One(), method=method)  # type: ignore[arg-type]
        response.begin()
        return {"status": response.status, "request_id": response.getheader("x-request-id"),
                "body": response.read().decode()}


@pytest.mark.parametrize("auth", ["keys", "off"])
async def test_the_proxy_only_port_serves_only_the_proxy_routes(tmp_path, auth):
    rp, pp = free_port(), free_port()
    settings = Settings(
        allow_host_paths=True, auth=auth,
        nats_url=f"nats://127.0.0.1:{free_port()}", data_dir=str(tmp_path / "arena"),
        rollout_port=rp, proxy_port=pp, trajectory_port=free_port(), public_url=f"http://127.0.0.1:{rp}",
        backend_url=f"http://127.0.0.1:{free_port()}/v1", backend_policy_version="0",
        sandbox_provider="local", sandbox_concurrency=2, verify_concurrency=1,
    )
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "agent.py").write_text(AGENT)
    stack = Stack(settings, llm_script=QUICKSTART / "llm_script.json", nats_sync="1s", log=lambda m: None)
    await stack.start(timeout=120)
    client = ArenaClient(settings.rollout_url, settings.trajectory_url, api_key=stack.api_key, timeout=60)
    admin, judge_key = stack.api_key, stack.settings.judge_key
    try:
        quickstart = load_task(QUICKSTART / "task.json")
        budget = Budget(max_turns=50, max_total_tokens=200_000, wall_clock_s=120)
        victim_task = msgspec.structs.replace(
            quickstart, budget=budget, agent=msgspec.structs.replace(quickstart.agent, command=["sleep", "100"]))
        victim = (await asyncio.to_thread(client.submit, victim_task)).rollout_id
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(client.get, victim)).state is not RolloutState.RUNNING:
            assert time.monotonic() < deadline, "the victim's sandbox never started"
            await asyncio.sleep(0.2)

        submit = msgspec.json.encode({"task": msgspec.to_builtins(victim_task)})
        tries = {
            "list rollouts": ("GET", "/v1/rollouts", admin, b""),
            "list rollouts, no version": ("GET", "/rollouts", admin, b""),
            "get another rollout": ("GET", f"/v1/rollouts/{victim}", admin, b""),
            "its events": ("GET", f"/v1/rollouts/{victim}/events", admin, b""),
            "submit a rollout": ("POST", "/v1/rollouts", admin, submit),
            "cancel another rollout": ("POST", f"/v1/rollouts/{victim}/cancel", admin, b""),
            "cancel another rollout, no version": ("POST", f"/rollouts/{victim}/cancel", admin, b""),
            "health": ("GET", "/healthz", None, b""),
            "readiness": ("GET", "/readyz", None, b""),
            "metrics": ("GET", "/metrics", None, b""),
            "openapi": ("GET", "/openapi.json", None, b""),
            "the judge route": ("POST", f"/judge/{victim}/v1/chat/completions", judge_key, CHAT),
            "dot-dot out of the prefix": ("GET", f"/proxy/{victim}/../../v1/rollouts", admin, b""),
            "dot-dot to cancel": ("POST", f"/proxy/{victim}/../../v1/rollouts/{victim}/cancel", admin, b""),
            "percent-encoded dot-dot": ("GET", f"/proxy/{victim}/%2e%2e/%2e%2e/v1/rollouts", admin, b""),
            "percent-encoded slash": ("POST", f"/proxy/{victim}/v1/chat%2Fcompletions", "k", CHAT),
            "percent-encoded letter": ("POST", f"/proxy/{victim}/v1/chat/c%6fmpletions", "k", CHAT),
            "double slash": ("POST", f"//proxy/{victim}/v1/chat/completions", "k", CHAT),
            "trailing slash": ("POST", f"/proxy/{victim}/v1/chat/completions/", "k", CHAT),
            "another method on a proxy route": ("DELETE", f"/proxy/{victim}/v1/chat/completions", "k", b""),
            "not a proxy route": ("GET", f"/proxy/{victim}/v1/rollouts", admin, b""),
            "a bad rollout id": ("POST", "/proxy/a..b/v1/chat/completions", "k", CHAT),
            "absolute-form to the API": ("GET", f"http://127.0.0.1:{pp}/v1/rollouts", admin, b""),
        }
        answers = {name: await asyncio.to_thread(raw, pp, method, target, key=key, body=body)
                   for name, (method, target, key, body) in tries.items()}
        for name, answer in answers.items():
            assert answer["status"] == 404, (name, answer)
            assert answer["request_id"], (name, answer)
            error = json.loads(answer["body"])["error"]
            assert error["message"].startswith("no route for "), (name, error)  # the filter's, not the API's
            assert error["code"] == "not_found", (name, error)
        # the API's error shape: Arena's off the proxy's paths, OpenAI's on them
        assert set(json.loads(answers["list rollouts"]["body"])["error"]) == {"code", "message"}
        assert json.loads(answers["percent-encoded slash"]["body"])["error"]["type"] == "not_found_error"

        # the victim was never touched; the same requests on the API's port do work
        assert (await asyncio.to_thread(client.get, victim)).state is RolloutState.RUNNING
        listed = await asyncio.to_thread(raw, rp, "GET", "/v1/rollouts", key=admin)
        assert listed["status"] == 200 and victim in listed["body"], listed
        judged = await asyncio.to_thread(raw, rp, "POST", f"/judge/{victim}/v1/chat/completions", key=judge_key,
                                         body=CHAT)
        assert judged["status"] == 200 and json.loads(judged["body"])["choices"], judged
        assert (await asyncio.to_thread(raw, rp, "GET", "/healthz"))["status"] == 200

        # the proxy routes reach the proxy, which checks the rollout's key (the project's is not it)
        for key in ("not-the-key", admin or "not-the-key"):
            for method, route, body in (("POST", "/v1/chat/completions", CHAT), ("GET", "/v1/models", b"")):
                answer = await asyncio.to_thread(raw, pp, method, f"/proxy/{victim}{route}", key=key, body=body)
                assert answer["status"] == 401, (route, answer)
                assert json.loads(answer["body"])["error"]["type"] == "authentication_error", answer
            for route, body in (("/v1/responses", b'{"input": "x"}'),
                                ("/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse", b'{"contents": []}')):
                answer = await asyncio.to_thread(raw, pp, "POST", f"/proxy/{victim}{route}", key=key, body=body)
                assert answer["status"] == 401, (route, answer)
                error = json.loads(answer["body"])["error"]
                assert error.get("type") == "authentication_error" or error.get("status") == "UNAUTHENTICATED", error

        # an agent sent to the proxy-only port makes its calls there, with its rollout's key
        caller_task = msgspec.structs.replace(quickstart, budget=budget, agent=msgspec.structs.replace(
            quickstart.agent, command=["python3", "/sandbox/agent/agent.py"], path=str(agent)))
        caller = (await asyncio.to_thread(client.submit, caller_task)).rollout_id
        view = await asyncio.to_thread(client.wait, caller, timeout=180)
        assert view.state is RolloutState.COMPLETED, view.reason
        trajectory = await asyncio.to_thread(client.wait_trajectory, caller, timeout=60)
        results = trajectory.sandbox.result
        assert results is not None, trajectory.sandbox.reason
        assert urlsplit(results["base_url"]).port == pp  # inside: the relay's port, the proxy-only one's number
        assert results["whole"]["status"] == 200 and json.loads(results["whole"]["body"])["choices"], results
        streamed = results["streamed"]
        assert streamed["status"] == 200 and streamed["type"].startswith("text/event-stream"), streamed
        assert streamed["body"].rstrip().endswith("data: [DONE]"), streamed["body"][-200:]
        assert view.steps == 2

        await asyncio.to_thread(client.cancel, victim)
    finally:
        client.close()
        stack.stop()
