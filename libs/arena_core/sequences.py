"""A rollout's steps merged into training sequences, token-in-token-out. Pure.

``assemble`` chains each call onto the sequence so far while its prompt ids extend it, and
says where and why they did not (``SequenceBreak``). See docs/trajectory.md ("Training sequences").
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from arena_core.schemas import SequenceBreak, Step, TrainingSequence, Trajectory


class _Open:
    """The sequence being built (``TrainingSequence`` is frozen)."""

    __slots__ = ("token_ids", "loss_mask", "logprobs", "step_indexes", "policy_versions")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.step_indexes: list[int] = []
        self.policy_versions: list[str] = []

    def add(self, step: Step, prompt: list[int], completion: list[int], logprobs: list[float]) -> None:
        """Append the prompt's tokens past the sequence so far, then the completion's (each
        list extended in place: a trainer assembles every step it reads, thousands of ids each)."""
        start = len(self.token_ids)
        context = len(prompt) - start
        self.token_ids.extend(prompt[start:] if start else prompt)
        self.token_ids.extend(completion)
        self.loss_mask.extend([0] * context)
        self.loss_mask.extend([1] * len(completion))
        self.logprobs.extend([0.0] * context)
        self.logprobs.extend(logprobs)
        self.step_indexes.append(step.step_index)
        self.policy_versions.append(step.policy_version or "")

    def close(self) -> TrainingSequence:
        return TrainingSequence(token_ids=self.token_ids, loss_mask=self.loss_mask, logprobs=self.logprobs,
                                step_indexes=self.step_indexes, policy_versions=self.policy_versions)


def _as_list(values: list | tuple | None) -> list:
    """``values`` as a list, not copied when it is one (only read: the sequences copy what they take)."""
    if values is None:
        return []
    return values if type(values) is list else list(values)


def first_difference(sequence: list[int], prompt: list[int]) -> int | None:
    """The first position where ``prompt`` does not extend ``sequence``; ``None`` if it does."""
    n = len(sequence)
    if len(prompt) >= n and prompt[:n] == sequence:
        return None
    common = min(n, len(prompt))
    start = 0
    while start < common:  # whole chunks (of the part both have) compared at C speed,
        end = min(start + 1024, common)
        if sequence[start:end] != prompt[start:end]:
            break
        start = end
    for i in range(start, min(start + 1024, common)):  # then token by token in the one that differs
        if sequence[i] != prompt[i]:
            return i
    return common  # a prefix of the sequence, but shorter


def _left_out(step: Step) -> SequenceBreak | None:
    """Why ``step`` is in no sequence, or ``None`` if it can be."""
    i = step.step_index
    if step.abandoned:
        return SequenceBreak(step_index=i, kind="abandoned", reason="the agent never received the answer")
    if step.incomplete:
        why = f": {step.error}" if step.error else ""
        return SequenceBreak(step_index=i, kind="incomplete", reason=f"the call was cut short{why}")
    if step.token_ids_source != "backend" or step.prompt_token_ids is None or step.completion_token_ids is None:
        return SequenceBreak(step_index=i, kind="no_token_ids", reason="no token ids (the backend gave none)")
    if len(step.logprobs or ()) != len(step.completion_token_ids):
        return SequenceBreak(step_index=i, kind="no_logprobs",
                             reason=f"{len(step.logprobs or ())} logprobs for {len(step.completion_token_ids)} "
                                    "completion tokens")
    return None


#: Kinds of left-out steps after which the next call cannot chain on: the agent saw that
#: answer, so it is in the next prompt, but which of those tokens the policy sampled is unknown.
ENDS_SEQUENCE = frozenset({"no_token_ids", "no_logprobs"})


def assemble(steps: Iterable[Step]) -> tuple[list[TrainingSequence], list[SequenceBreak]]:
    """The steps (walked by ``step_index``, the first of a repeated index kept) as training
    sequences, and the breaks between them.

    A call whose prompt ids start with the sequence so far (previous prompt + completion)
    joins it: the new prompt tokens are context (mask 0, logprob 0.0), its completion is
    sampled (mask 1, its logprobs). Otherwise a new sequence starts and a ``prefix_mismatch``
    break says at which token. Abandoned and incomplete calls are left out without ending
    the sequence (the agent never received, or got only part of, that answer: a retry or a
    continuation extends the sequence so far, a partial answer it did see comes in as
    context); a call without token ids or with logprobs not aligned to its completion is
    left out and ends it.
    """
    sequences: list[TrainingSequence] = []
    breaks: list[SequenceBreak] = []
    current: _Open | None = None
    seen: set[int] = set()
    for step in sorted(steps, key=lambda s: s.step_index):
        if step.step_index in seen:
            continue
        seen.add(step.step_index)
        skipped = _left_out(step)
        if skipped is not None:
            breaks.append(skipped)
            if skipped.kind in ENDS_SEQUENCE and current is not None:
                sequences.append(current.close())
                current = None
            continue
        prompt, completion = _as_list(step.prompt_token_ids), _as_list(step.completion_token_ids)
        if current is not None:
            at = first_difference(current.token_ids, prompt)
            if at is not None:
                what = (f"prefix mismatch at token {at}" if at < len(prompt) else
                        f"the prompt ({len(prompt)} tokens) is shorter than the sequence ({len(current.token_ids)})")
                breaks.append(SequenceBreak(step_index=step.step_index, kind="prefix_mismatch", position=at,
                                            reason=what))
                sequences.append(current.close())
                current = None
        if current is None:
            current = _Open()
        current.add(step, prompt, completion, _as_list(step.logprobs))
    if current is not None:
        sequences.append(current.close())
    return sequences, breaks


def with_sequences(t: Trajectory) -> Trajectory:
    """``t`` with its sequences and breaks assembled from its steps (replacing any it had)."""
    sequences, breaks = assemble(t.steps)
    return msgspec.structs.replace(t, sequences=sequences, sequence_breaks=breaks)


def lacks_sequences(t: Trajectory) -> bool:
    """Steps, but neither sequences nor breaks (any step makes one or the other): left out
    of a message on the trajectory stream, or from before they existed."""
    return bool(t.steps) and not t.sequences and not t.sequence_breaks


def ensure_sequences(t: Trajectory) -> Trajectory:
    """``t`` as it is if it carries its sequences, else with them assembled from its steps."""
    return with_sequences(t) if lacks_sequences(t) else t


def sequences_of(t: Trajectory) -> tuple[list[TrainingSequence], list[SequenceBreak]]:
    """The sequences and breaks ``t`` carries; for one that lacks them (``lacks_sequences``),
    those ``assemble`` makes from its steps: the same values."""
    if lacks_sequences(t):
        return assemble(t.steps)
    return list(t.sequences), list(t.sequence_breaks)
