"""Request bodies: JSON decoded into a Struct the way its JSON Schema reads (``1.0`` is an
integer), every problem an ``InvalidRequest`` that names it. See docs/schemas.md.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

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


_ENUM_PROBLEM = re.compile(r"^Invalid enum value (?P<value>.*) - at `(?P<path>\$[^`]*)`$")
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _choices_at(info: mi.Type, parts: list[tuple[str, str]]) -> list[str]:
    """The valid values of the enum (or literal) at ``parts`` of the type ``info`` (empty: none found)."""
    if isinstance(info, mi.UnionType):
        return list(dict.fromkeys(c for t in info.types for c in _choices_at(t, parts)))
    if not parts:
        if isinstance(info, mi.EnumType):
            return [str(m.value) for m in info.cls]
        if isinstance(info, mi.LiteralType):
            return [str(v) for v in info.values]
        return []
    (name, index), rest = parts[0], parts[1:]
    if isinstance(info, mi.StructType) and name:
        field = next((f for f in info.fields if f.encode_name == name), None)
        return _choices_at(field.type, rest) if field is not None else []
    if isinstance(info, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)) and index:
        return _choices_at(info.item_type, rest)
    if isinstance(info, mi.DictType) and name:
        return _choices_at(info.value_type, rest)
    return []


def _problem(exc: msgspec.ValidationError, type_: type) -> str:
    """The decode error, with the valid names when it is a bad enum value."""
    text = str(exc)
    match = _ENUM_PROBLEM.match(text)
    if match is None:
        return text
    try:
        parts = [(m.group(1) or "", m.group(2) or "") for m in _PATH_PART.finditer(match["path"][1:])]
        choices = _choices_at(mi.type_info(type_), parts)
    except Exception:  # noqa: BLE001 - the names are a help: the error stands without them
        choices = []
    return f"{text} (valid: {', '.join(choices)})" if choices else text


def decode_body(data: bytes, type_: type[T], *, what: str = "request") -> T:
    """``data`` as ``type_``; a JSON number with no fraction is accepted where an integer is due."""
    if not data.strip():
        raise InvalidRequest(f"{what} body is empty; send a JSON object")
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as exc:
        if "got `float`" not in str(exc):
            raise InvalidRequest(f"invalid {what}: {_problem(exc, type_)}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{what} body is not valid JSON: {exc}") from None
    try:
        return msgspec.convert(_integral_floats_as_ints(msgspec.json.decode(data)), type_)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid {what}: {_problem(exc, type_)}") from None
