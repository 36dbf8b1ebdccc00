"""The attack: an id with a trailing newline. msgspec searches its patterns with Python's
``re``, where ``$`` also matches before a final newline, so ``"t1\\n"`` once passed as a task
id (and a git commit, a bundle digest). Every id is now matched whole: a 4xx in the API's
error shape, over HTTP, in the body, the path and the query."""

from __future__ import annotations

import msgspec
import pytest

from arena_core.schemas import GitSource, SubmitRolloutRequest, valid_id


def task(**changes) -> dict:
    body = {"id": "t1", "instructions": "fix it", "agent": {"command": ["true"]},
            "source": {"type": "bundle", "digest": "sha256:" + "0" * 64},
            "verifier": {"type": "exact", "answers": ["42"]}}
    return {**body, **changes}


@pytest.mark.parametrize("changes, field", [
    ({"id": "t1\n"}, "$.task.id"),
    ({"source": {"type": "bundle", "digest": "sha256:" + "0" * 64 + "\n"}}, "digest"),
    ({"source": {"type": "git", "url": "https://example.com/r.git", "commit": "abcdef1\n"}}, "commit"),
])
async def test_a_trailing_newline_in_a_submitted_id_is_a_422(api, changes, field):
    r = await api.post("/v1/rollouts", json={"task": task(**changes)})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_request" and field in error["message"]


async def test_a_group_of_a_task_id_with_a_trailing_newline_is_a_422(api):
    r = await api.post("/v1/rollout-groups", json={"task": task(id="t1\n"), "n": 2})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "invalid_request" and "$.task.id" in r.json()["error"]["message"]


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/rollouts/r1%0A"),
    ("GET", "/v1/rollouts/r1%0A/wait?timeout=0.1"),
    ("POST", "/v1/rollouts/r1%0A/cancel"),
    ("GET", "/v1/rollouts?group_id=g1%0A"),
    ("GET", f"/v1/bundles/sha256:{'0' * 64}%0A"),
    ("POST", "/proxy/r1%0A/v1/chat/completions"),
    ("POST", "/proxy/r1/v1/chat/completions%0A"),
])
async def test_a_trailing_newline_in_a_path_or_query_id_is_a_4xx(api, method, path):
    r = await api.request(method, path, json={"messages": []})
    assert 400 <= r.status_code < 500, (path, r.status_code, r.text[:200])
    assert "error" in r.json()


def test_the_grammar_refuses_a_trailing_newline_wherever_it_is_decoded():
    body = msgspec.json.encode({"task": task(id="t1\n")})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(body, type=SubmitRolloutRequest)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"url": "https://example.com/r.git", "commit": "abcdef1\n"}, GitSource)
    assert not valid_id("t1\n") and valid_id("t1")
    assert msgspec.json.decode(msgspec.json.encode({"task": task()}), type=SubmitRolloutRequest).task.id == "t1"
