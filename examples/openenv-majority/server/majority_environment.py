"""The majority environment: one question per episode, the majority bit of a bit string.

``reset(bits=...)`` asks about ``bits`` (or a string drawn from ``seed``); ``step`` takes
the answer and ends the episode with reward 1.0 when it is the majority bit, else 0.0.
"""

import random
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import MajorityAction, MajorityObservation
except ImportError:
    from models import MajorityAction, MajorityObservation


def majority(bits: str) -> str:
    return "1" if bits.count("1") > bits.count("0") else "0"


class MajorityEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._bits = ""

    def reset(self, seed=None, episode_id=None, bits=None) -> MajorityObservation:
        if bits is None or not bits or len(bits) % 2 == 0 or set(bits) - {"0", "1"}:
            rng = random.Random(seed)
            bits = "".join(rng.choice("01") for _ in range(rng.choice((1, 3, 5, 7))))
        self._bits = bits
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return MajorityObservation(prompt=bits, done=False, reward=None)

    def step(self, action: MajorityAction) -> MajorityObservation:  # type: ignore[override]
        self._state.step_count += 1
        correct = action.message.strip() == majority(self._bits)
        return MajorityObservation(prompt=self._bits, correct=correct, done=True, reward=1.0 if correct else 0.0)

    @property
    def state(self) -> State:
        return self._state
