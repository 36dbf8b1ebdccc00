"""The demo task family: the majority bit of an odd-length bit string.

170 strings of length 1, 3, 5 and 7, 30 of them held out; each is a real Arena task
(``examples/grpo-loop``) graded by a ``tests`` verifier. See docs/rl.md ("The demo").
"""

from __future__ import annotations

import hashlib
import itertools
import random
from pathlib import Path

from arena_core.schemas import AgentSpec, Budget, Task, TestsVerifier

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "grpo-loop"
HELDOUT_PREFIX = "heldout-"
ALPHABET = "01"


def majority(bits: str) -> str:
    if not bits or len(bits) % 2 == 0 or set(bits) - set(ALPHABET):
        raise ValueError(f"{bits!r} is not an odd-length bit string")
    return "1" if bits.count("1") > bits.count("0") else "0"


def majority_task(bits: str, *, example_dir: Path = EXAMPLE_DIR, split: str = "train") -> Task:
    sha = hashlib.sha256(majority(bits).encode()).hexdigest()
    prefix = HELDOUT_PREFIX if split == "heldout" else "train-"
    return Task(
        id=f"{prefix}majority-{bits}",
        repo=str(example_dir / "repo"),
        instructions=f"Answer with the bit that occurs most often in {bits}.",
        agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(example_dir / "agent")),
        verifier=TestsVerifier(command=f"ARENA_EXPECTED_SHA256={sha} python -m pytest -rA -p no:cacheprovider tests",
                               fail_to_pass=["tests/test_answer.py::test_answer"],
                               test_files=["tests/test_answer.py"], timeout_s=60),
        budget=Budget(max_turns=1, max_total_tokens=256, wall_clock_s=600),
        metadata={"prompt": bits, "max_tokens": "1", "split": split},
    )


def majority_family(seed: int = 0, heldout: int = 30) -> tuple[list[str], list[str]]:
    """(train, held-out) bit strings, split by ``seed``."""
    items = ["".join(b) for n in (1, 3, 5, 7) for b in itertools.product(ALPHABET, repeat=n)]
    random.Random(seed).shuffle(items)
    return items[heldout:], items[:heldout]


def is_heldout(task_id: str) -> bool:
    return task_id.startswith(HELDOUT_PREFIX)
