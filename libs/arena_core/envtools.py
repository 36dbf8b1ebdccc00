"""The actions an OpenEnv client sends to Arena's own tasks: OpenEnv's MCP-shaped
``list_tools`` / ``call_tool`` actions and the five tools (shell, read/write/edit a file,
submit). Shared by the environment endpoint (which checks them at the edge) and the
sandbox worker (which runs them). docs/openenv.md ("Arena's tasks as environments").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

#: Output kept per tool call; the rest is cut and ``truncated`` is set.
MAX_OUTPUT_BYTES = 64 * 1024
#: The largest file ``read_file`` returns and ``write_file`` takes.
MAX_FILE_BYTES = 1024 * 1024

Path = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]


class ListTools(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="list_tools",
                tag_field="type"):
    metadata: dict[str, Any] = {}


class CallTool(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="call_tool",
               tag_field="type"):
    tool_name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    arguments: dict[str, Any] = {}
    metadata: dict[str, Any] = {}


Action = ListTools | CallTool
_action = msgspec.json.Decoder(Action)


class Shell(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Run a shell command (``/bin/sh -c``) in the task's working directory; stdout and stderr together."""

    command: Annotated[str, msgspec.Meta(min_length=1, max_length=128 * 1024)]
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 120.0


class ReadFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Read a text file (a path relative to the working directory, or absolute under /sandbox/workspace);
    ``offset`` is the first line (1-based), ``limit`` the number of lines."""

    path: Path
    offset: Annotated[int, msgspec.Meta(ge=1)] = 1
    limit: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] | None = None


class WriteFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Create or overwrite a file with ``content`` (parent directories are made)."""

    path: Path
    content: Annotated[str, msgspec.Meta(max_length=MAX_FILE_BYTES)]


class EditFile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Replace ``old_str`` by ``new_str`` in a file: ``old_str`` must occur exactly once unless ``replace_all``."""

    path: Path
    old_str: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_FILE_BYTES)]
    new_str: Annotated[str, msgspec.Meta(max_length=MAX_FILE_BYTES)]
    replace_all: bool = False


class Submit(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """End the episode: the workspace as it is now is verified and the reward returned.
    ``answer`` is graded by answer verifiers (exact, rubric, judge)."""

    answer: Annotated[str, msgspec.Meta(max_length=MAX_FILE_BYTES)] | None = None


TOOLS: dict[str, type[msgspec.Struct]] = {
    "shell": Shell, "read_file": ReadFile, "write_file": WriteFile, "edit_file": EditFile, "submit": Submit,
}


class ActionError(ValueError):
    """An action Arena refuses: ``errors`` are pydantic-shaped (``type``, ``loc``, ``msg``)."""

    def __init__(self, message: str, errors: list[dict[str, Any]]):
        super().__init__(message)
        self.errors = errors


def _problem(exc: msgspec.ValidationError, root: tuple[str, ...]) -> list[dict[str, Any]]:
    text = str(exc)
    loc = list(root)
    if " - at `$." in text:  # msgspec: "Expected `str`, got `int` - at `$.command`"
        text, _, where = text.partition(" - at `$.")
        loc += [p for p in where.rstrip("`").replace("[", ".").replace("]", "").split(".") if p]
    return [{"type": "value_error", "loc": loc, "msg": text, "input": None}]


def parse_action(data: Any) -> Action:
    """The action an OpenEnv ``step`` carries, checked; :class:`ActionError` otherwise."""
    if not isinstance(data, dict):
        raise ActionError("Invalid message", [{"type": "model_type", "loc": ["message"],
                                               "msg": "an action is a JSON object", "input": None}])
    try:
        return msgspec.convert(data, Action)
    except msgspec.ValidationError as exc:
        raise ActionError("Invalid message", _problem(exc, ("message",))) from None


def parse_arguments(name: str, arguments: dict[str, Any]) -> msgspec.Struct:
    """A tool's arguments, checked; ``KeyError`` for an unknown tool, :class:`ActionError` for bad arguments."""
    spec = TOOLS[name]
    try:
        return msgspec.convert(arguments, spec)
    except msgspec.ValidationError as exc:
        raise ActionError(f"invalid arguments for {name}", _problem(exc, ("arguments",))) from None


def tool_list() -> list[dict[str, Any]]:
    """The tools as MCP lists them (``name``, ``description``, ``input_schema``)."""
    out = []
    for name, spec in TOOLS.items():
        schema = msgspec.json.schema(spec)
        body = schema["$defs"][spec.__name__] if "$defs" in schema else schema
        body = {k: v for k, v in body.items() if k not in ("title", "description")}
        out.append({"name": name, "description": (spec.__doc__ or "").strip().replace("\n    ", " "),
                    "input_schema": body})
    return out


def action_schema() -> dict[str, Any]:
    """JSON Schema of an action (``/schema``'s ``action``)."""
    schema = msgspec.json.schema(Action)
    return {"title": "ArenaToolAction", **schema}


def observation_schema() -> dict[str, Any]:
    return {
        "title": "ArenaToolObservation",
        "type": "object",
        "properties": {
            "tool_name": {"type": "string"},
            "result": {"description": "the tool's result (a JSON object)", "type": ["object", "null"]},
            "error": {"type": ["object", "null"], "properties": {
                "error_type": {"enum": ["execution_error", "invalid_args", "tool_not_found", "timeout"]},
                "message": {"type": "string"}}},
            "tools": {"type": "array", "items": {"type": "object"}},
            "done": {"type": "boolean"},
            "reward": {"type": ["number", "null"]},
        },
    }


def tool_error(error_type: Literal["execution_error", "invalid_args", "tool_not_found", "timeout"],
               message: str, tool_name: str = "") -> dict[str, Any]:
    """A tool call that did not work, as an observation (the episode goes on)."""
    return {"tool_name": tool_name, "result": None, "error": {"error_type": error_type, "message": message}}
