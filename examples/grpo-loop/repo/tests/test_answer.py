"""The checker: the agent's ``answer.txt`` must hash to ``ARENA_EXPECTED_SHA256``.

Runs in the verification plane's fresh sandbox, on the pristine task with the agent's
diff applied; the expected hash comes from the task's verifier command, so the answer
never appears in plain text in the task.
"""

import hashlib
import os
from pathlib import Path


def test_answer():
    path = Path(__file__).resolve().parents[1] / "answer.txt"
    assert path.exists(), "the agent wrote no answer.txt"
    answer = path.read_text(encoding="utf-8").strip()
    assert hashlib.sha256(answer.encode()).hexdigest() == os.environ["ARENA_EXPECTED_SHA256"], f"wrong: {answer!r}"
