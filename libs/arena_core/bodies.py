"""Request bodies: JSON decoded into a Struct the way its JSON Schema reads (``1.0`` is an
integer), every problem an ``InvalidRequest`` that names it. See docs/schemas.md.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from arena_core.errors import InvalidRequest

T = TypeVar("T")

_INTEGRAL = 2**53  # beyond it a float no longer holds every integer exactly


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) <= _INTEGRAL else value
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    return value


def decode_body(data: bytes, type_: type[T], *, what: str = "request") -> T:
    """``data`` as ``type_``; a JSON number with no fraction is accepted where an integer is due."""
    if not data.strip():
        raise InvalidRequest(f"{what} body is empty; send a JSON object")
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        if "got `float`" not in str(exc):
            raise InvalidRequest(f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{what} body is not valid JSON: {exc}") from None
    try:
        return msgspec.convert(_integral_floats_as_ints(msgspec.json.decode(data)), type_)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid {what}: {exc}") from None
