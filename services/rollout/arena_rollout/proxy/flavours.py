"""The client APIs the proxy translates to the backend's OpenAI chat completions, one module
each (``anthropic``, ``responses``, ``gemini``), and what the handler asks of them. Capture,
budgets, sampling injection and training sequences stay the handler's, the same for all.
"""

from __future__ import annotations

from typing import Any, Protocol

from arena_core.llm_errors import Flavor

from arena_rollout.proxy import anthropic, gemini, responses


class Translator(Protocol):
    """A chat-completions stream in, the client API's stream bytes out."""

    content_type: bytes

    def feed(self, chunk: dict[str, Any]) -> list[bytes]: ...

    def end(self) -> list[bytes]: ...

    def error(self, message: str) -> bytes:
        """The stream's last piece when the backend broke mid-answer."""


class Translation(Protocol):
    """One call of a translated API: ``body`` goes to the backend, its answer comes back here."""

    body: dict[str, Any]

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]: ...

    def stream(self) -> Translator: ...


class Flavour(Protocol):
    #: the error shape of the API (arena_core.llm_errors)
    errors: Flavor

    def memory(self) -> Any:
        """What the API keeps per rollout between calls (None: nothing)."""

    def translate(self, payload: Any, memory: Any) -> Translation: ...

    def count_body(self, payload: Any) -> dict[str, Any]:
        """The chat body whose prompt a token-count request of the API asks about."""


#: the translated APIs, by the ``api`` name a step records
FLAVOURS: dict[str, Flavour] = {
    "anthropic.messages": anthropic.FLAVOUR,
    "openai.responses": responses.FLAVOUR,
    "gemini.generate_content": gemini.FLAVOUR,
}


def error_flavor(api: str) -> Flavor:
    """The error shape of ``api``'s answers (OpenAI's for the chat and completions routes)."""
    flavour = FLAVOURS.get(api)
    return "openai" if flavour is None else flavour.errors
