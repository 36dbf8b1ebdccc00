"""What would fail at run time is refused at submission, naming what exists: a bad enum value in
a request lists the valid names (arena_core.bodies), ..."""

from __future__ import annotations

import json

import pytest

from arena_core.bodies import decode_body
from arena_core.errors import InvalidRequest
from arena_core.schemas import SubmitGroupRequest, SubmitRolloutRequest


def body(**task_changes) -> dict:
    task = {"id": "t", "instructions": "x", "agent": {"command": ["true"]}, **task_changes}
    return {"task": task}


@pytest.mark.parametrize(("changes", "where", "valid"), [
    ({"provider": "dockr"}, "$.provider", "docker, local, mock"),
    ({"task": body(agent={"scaffold": {"name": "mini-swe"}})["task"]}, "$.task.agent.scaffold.name",
     "claude-code, mini-swe-agent, opencode, openhands, terminus-2"),
    ({"task": body(verifier={"type": "tests", "command": "pytest", "parser": "pytset"})["task"]},
     "$.task.verifier.parser", "pytest"),
])
def test_a_bad_enum_value_is_refused_with_the_valid_names(changes, where, valid):
    for type_ in (SubmitRolloutRequest, SubmitGroupRequest):
        data = {**body(), "n": 2, **changes} if type_ is SubmitGroupRequest else {**body(), **changes}
        with pytest.raises(InvalidRequest) as err:
            decode_body(json.dumps(data).encode(), type_)
        message = str(err.value)
        assert f"at `{where}` (valid: " in message and valid in message, message


def test_other_problems_keep_their_message():
    with pytest.raises(InvalidRequest) as err:
        decode_body(json.dumps({**body(), "provider": 3}).encode(), SubmitRolloutRequest)
    assert "valid:" not in str(err.value) and "$.provider" in str(err.value)
