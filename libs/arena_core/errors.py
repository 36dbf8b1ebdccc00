"""Arena's error hierarchy. Every error carries a stable ``code`` that survives the wire.

HTTP responses carry ``{"error": {"code", "message"}}``; the SDK maps them back to
these classes, so a caller can ``except NotFound`` instead of parsing strings.
"""

from __future__ import annotations


class ArenaError(Exception):
    """Base of every error Arena raises on purpose."""

    code = "arena_error"
    status = 500
    #: whether a client may send the same request again (``x-should-retry`` on the proxy)
    retryable = False

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(ArenaError):
    code = "invalid_request"
    status = 422


class NotFound(ArenaError):
    code = "not_found"
    status = 404


class Conflict(ArenaError):
    """A state transition lost a race or is not allowed from the current state."""

    code = "conflict"
    status = 409


class Unauthorized(ArenaError):
    code = "unauthorized"
    status = 401


class Forbidden(ArenaError):
    """A known API key without the scope the route needs, or changing what another key owns."""

    code = "forbidden"
    status = 403


class BudgetExhausted(ArenaError):
    """A rollout's turns or tokens are spent: the proxy refuses its calls for good. 403, a
    status no SDK or scaffold retries (a 429 would be retried until the rollout ended and
    the key turned into a confusing 401)."""

    code = "budget_exhausted"
    status = 403


class WallClockExceeded(ArenaError):
    """A rollout's wall-clock budget is spent: the proxy refuses its calls (403, as above)."""

    code = "wall_clock_exceeded"
    status = 403


class UpstreamRejected(ArenaError):
    """The LLM backend refused the request as invalid (its 4xx, with its message)."""

    code = "upstream_rejected"
    status = 400


class PayloadTooLarge(ArenaError):
    code = "payload_too_large"
    status = 413


class UpstreamError(ArenaError):
    """The LLM backend failed or answered something that is not a valid response."""

    code = "upstream_error"
    status = 502
    retryable = True


class Unavailable(ArenaError):
    code = "unavailable"
    status = 503
    retryable = True


class SandboxError(ArenaError):
    code = "sandbox_error"


class VerificationError(ArenaError):
    code = "verification_error"


class Retryable(Exception):
    """Raised by a message handler: nak the message and try again after ``delay`` s."""

    def __init__(self, message: str, delay: float = 1.0):
        super().__init__(message)
        self.delay = delay


class Permanent(Exception):
    """Raised by a message handler: the message can never succeed; dead-letter it."""


class Overloaded(ArenaError):
    """The queue cannot take more work now: try again after ``retry_after`` seconds (HTTP 429
    with ``Retry-After``). Nothing was created."""

    code = "overloaded"
    status = 429
    retryable = True

    def __init__(self, message: str, *, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class ProviderUnserved(InvalidRequest):
    """No sandbox worker serves the provider a submission names (``arena_core.workers``):
    refused at once rather than left to wait out its queue limit."""

    code = "provider_unserved"


BY_CODE: dict[str, type[ArenaError]] = {
    cls.code: cls
    for cls in (
        ArenaError,
        InvalidRequest,
        NotFound,
        Conflict,
        Unauthorized,
        Forbidden,
        BudgetExhausted,
        WallClockExceeded,
        UpstreamRejected,
        PayloadTooLarge,
        UpstreamError,
        Unavailable,
        SandboxError,
        VerificationError,
        Overloaded,
        ProviderUnserved,
    )
}

