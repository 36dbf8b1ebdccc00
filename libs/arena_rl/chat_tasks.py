"""The chat example's tasks: reply to a partner's troubles with empathy, graded by a rubric.

Each task is a multi-turn chat (``examples/chat-rubric-rl``'s agent) whose replies Arena's
``rubric`` verifier grades: phrases an empathetic reply uses, phrases it avoids. docs/rl.md
("The chat example").
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from arena_core.schemas import (
    AgentSpec,
    Budget,
    CompositeVerifier,
    LlmJudgeVerifier,
    RubricItem,
    RubricVerifier,
    Task,
    WeightedVerifier,
)

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "chat-rubric-rl"
HELDOUT_PREFIX = "heldout-"

SYSTEM = "You are a kind friend. Reply in one or two short sentences."

#: What the partner says first, then a follow-up; one task per pair.
TROUBLES = [
    "My dog died yesterday.", "I failed my driving test again.", "I lost my job this morning.",
    "My best friend moved away.", "I didn't get into the university I wanted.", "My grandmother is in hospital.",
    "I broke up with my partner.", "I have been feeling lonely lately.", "My exam went really badly.",
    "Our house flooded last week.", "I missed my sister's wedding.", "My bike was stolen today.",
    "I can't sleep because of stress.", "My project was cancelled after months of work.",
    "I argued with my dad.", "My cat is very sick.", "I got rejected from another job.",
    "I feel like nobody listens to me.", "My phone with all my photos got lost.", "I had a panic attack at work.",
    "My team lost the final.", "I have to move out of my flat.", "My friend forgot my birthday.",
    "I am worried about my health.",
]
FOLLOW_UPS = ["I don't know what to do.", "It has been really hard.", "Thanks for listening."]

#: An empathetic reply acknowledges the feeling and offers support; it does not dismiss.
RUBRIC = [
    RubricItem(name="sorry", pattern=r"\bsorry\b", regex=True, weight=1.0),
    RubricItem(name="acknowledges", pattern=r"\b(that sounds|must be|understand|hard|difficult|tough)\b",
               regex=True, weight=1.0),
    RubricItem(name="support", pattern=r"\b(here for you|i'm here|support|help|with you)\b", regex=True, weight=1.0),
    RubricItem(name="no dismissal", pattern=r"\b(calm down|get over it|whatever|not a big deal|your fault)\b",
               regex=True, forbidden=True, weight=1.0),
]


JUDGE_RUBRIC = ("Score how empathetic these replies to a friend in trouble are: 1 when they acknowledge "
                "the feeling and offer support warmly, 0 when they dismiss it or ignore it.")


def chat_task(index: int, *, split: str = "train", turns: int = 2, max_tokens: int = 40,
              stream: str = "alternate", judge: LlmJudgeVerifier | None = None, judge_weight: float = 1.0) -> Task:
    """The ``index``-th trouble as a task; with ``judge``, graded by the rubric and that LLM
    judge together (a composite: ``rubric`` and ``judge`` components)."""
    trouble = TROUBLES[index % len(TROUBLES)]
    partner = [trouble, *FOLLOW_UPS[: max(turns - 1, 0)]]
    prefix = HELDOUT_PREFIX if split == "heldout" else "train-"
    return Task(
        id=f"{prefix}empathy-{index}",
        repo=str(EXAMPLE_DIR / "repo"),
        instructions=trouble,
        agent=AgentSpec(command=["python3", "/sandbox/agent/agent.py"], path=str(EXAMPLE_DIR / "agent")),
        verifier=RubricVerifier(items=list(RUBRIC)) if judge is None else CompositeVerifier(verifiers=[
            WeightedVerifier(name="rubric", verifier=RubricVerifier(items=list(RUBRIC))),
            WeightedVerifier(name="judge", verifier=judge, weight=judge_weight)]),
        budget=Budget(max_turns=len(partner), max_total_tokens=len(partner) * (max_tokens + 400), wall_clock_s=900),
        metadata={"partner": json.dumps(partner), "system": SYSTEM, "max_tokens": str(max_tokens),
                  "stream": stream, "split": split},
    )


def chat_family(seed: int = 0, heldout: int = 6) -> tuple[list[int], list[int]]:
    """(train, held-out) task indices, split by ``seed``."""
    items = list(range(len(TROUBLES)))
    random.Random(seed).shuffle(items)
    return items[heldout:], items[:heldout]
