"""Actions and observations of the majority environment."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class MajorityAction(Action):
    """The answer: the bit that occurs most often in the prompt."""

    message: str = Field(..., max_length=64, description="the answer, '0' or '1'")


class MajorityObservation(Observation):
    """The bit string to answer about; after the answer, whether it was right."""

    prompt: str = Field(default="", description="an odd-length string of 0s and 1s")
    correct: bool | None = Field(default=None, description="None until answered")
