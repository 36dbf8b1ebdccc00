"""Encode ``Trajectory`` and ``GroupCompleted`` with their steps as the JSON they arrived as.

Same message, same values, without re-encoding every step's token ids and logprobs, and
without the training sequences: they are derived from the steps (as many token ids again),
so readers assemble them (``arena.stream`` does; ``arena_core.sequences.ensure_sequences``).
A group refers to its members' trajectory messages instead of copying them.
See docs/trajectory.md (Assembly, step 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from arena_core import subjects
from arena_core.schemas import GroupCompleted, MemberRef, Step, Trajectory

#: A step as it goes on the wire: its JSON if we have it, else the ``Step``.
WireStep = msgspec.Raw | Step


def _mirror(cls: type[msgspec.Struct], name: str) -> type[msgspec.Struct]:
    fields = []
    for f in msgspec.structs.fields(cls):
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.encode_name, Any, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.encode_name, Any, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.encode_name, Any))
    config = cls.__struct_config__
    return msgspec.defstruct(name, fields, kw_only=True, omit_defaults=config.omit_defaults,
                             tag=config.tag, tag_field=config.tag_field)


_TrajectoryWire = _mirror(Trajectory, "_TrajectoryWire")
_encoder = msgspec.json.Encoder()


def wire_trajectory(t: Trajectory, raw_steps: Mapping[int, msgspec.Raw | bytes] | None = None) -> msgspec.Struct:
    """``t`` with each step replaced by its JSON from ``raw_steps`` (by step index) if there,
    and without its training sequences."""
    values = {f: getattr(t, f) for f in t.__struct_fields__}
    values["sequences"], values["sequence_breaks"] = [], []
    if raw_steps:
        values["steps"] = [_raw(raw_steps.get(s.step_index), s) for s in t.steps]
    return _TrajectoryWire(**values)


def encode_trajectory(t: Trajectory, raw_steps: Mapping[int, msgspec.Raw | bytes] | None = None) -> bytes:
    return _encoder.encode(wire_trajectory(t, raw_steps))


def encode_group(group: GroupCompleted) -> bytes:
    """``group`` referring to its members (``members``: each one's subject on the stream)
    instead of copying them: each trajectory's bytes are stored once. Its members must be
    on the stream before it (``TrajectoryWorker`` publishes them first)."""
    members = [MemberRef(rollout_id=t.rollout_id, group_index=t.group_index,
                         subject=subjects.trajectory(t.task_id, t.rollout_id)) for t in group.trajectories]
    return _encoder.encode(msgspec.structs.replace(group, trajectories=[], members=members))


def _raw(raw: msgspec.Raw | bytes | None, step: Step) -> WireStep:
    if raw is None:
        return step
    return raw if isinstance(raw, msgspec.Raw) else msgspec.Raw(raw)
