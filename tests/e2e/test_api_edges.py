"""Bad input at the rollout API's edge: every id follows one grammar and every number is
bounded before any bus or store call; nothing answers 5xx, and the service keeps working."""

from __future__ import annotations

import pytest

from tests.rollout.test_service import rollout, task_json  # noqa: F401 - the fixture and its task

BAD_IDS = ["x" * 5000, "%00", "a%22b", "a%20b", "%C3%A9t%C3%A9", "%FF%FE", "a*b", "a%3Eb", ".hidden", "-x"]


@pytest.mark.parametrize("bad", BAD_IDS)
async def test_a_bad_rollout_id_is_a_4xx_everywhere_and_the_service_lives_on(rollout, tmp_path, bad):
    api, service = rollout
    for method, path in (("GET", f"/v1/rollouts/{bad}"), ("GET", f"/v1/rollouts/{bad}/wait?timeout=0.1"),
                         ("GET", f"/v1/rollouts/{bad}/events"), ("POST", f"/v1/rollouts/{bad}/cancel"),
                         ("POST", f"/proxy/{bad}/v1/chat/completions")):
        r = await api.request(method, path, headers={"authorization": "Bearer k"}, json={"messages": []})
        assert 400 <= r.status_code < 500, (method, path[:60], r.status_code, r.text[:200])
        if r.status_code != 404:
            assert r.json()["error"]["code"] == "invalid_request"
    # the bus connection is whole: health holds and a good rollout goes through
    assert (await api.get("/healthz")).status_code == 200
    assert (await api.get("/readyz")).status_code == 200
    created = await api.post("/v1/rollouts", json={"task": task_json(tmp_path)})
    assert created.status_code == 201, created.text
    assert (await api.get(f"/v1/rollouts/{created.json()['rollout_id']}")).status_code == 200


@pytest.mark.parametrize("change, field", [
    ({"budget": {"wall_clock_s": 1e308}}, "wall_clock_s"),
    ({"budget": {"wall_clock_s": 100_000.0}}, "ARENA_MAX_WALL_CLOCK_S"),
    ({"budget": {"max_turns": 0}}, "max_turns"),
    ({"budget": {"max_total_tokens": 10**12}}, "max_total_tokens"),
    ({"id": "has space"}, "$.task.id"),
    ({"id": "t" * 129}, "$.task.id"),
])
async def test_numbers_and_ids_in_a_submission_are_bounded(rollout, tmp_path, change, field):
    api, _ = rollout
    task = {**task_json(tmp_path), **change}
    r = await api.post("/v1/rollouts", json={"task": task})
    assert r.status_code == 422, r.text
    assert field in r.json()["error"]["message"]


async def test_a_group_size_and_labels_are_bounded(rollout, tmp_path):
    api, _ = rollout
    for body in ({"task": task_json(tmp_path), "n": 5000}, {"task": task_json(tmp_path), "n": 2,
                                                           "metadata": {f"k{i}": "v" for i in range(100)}}):
        r = await api.post("/v1/rollout-groups", json=body)
        assert r.status_code == 422, r.text
    r = await api.get("/v1/rollouts", params={"group_id": "bad id"})
    assert r.status_code == 422
