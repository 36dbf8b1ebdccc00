"""A rollout's steps as token sequences with a loss mask, for trainers. Pure.

``sequences`` extends one sequence while each prompt extends the previous one (prompt tokens mask 0,
sampled tokens mask 1 with their logprobs), else starts a new one: nothing is re-tokenized.
See docs/schemas.md (the trajectory schema: the loss mask).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from arena_core.schemas import Step


class TokenSequence(msgspec.Struct, kw_only=True):
    """``ids``, ``loss_mask`` (1 = sampled by the policy, 0 = prompt/tool/user tokens) and
    ``logprobs`` (the sampling logprob for mask-1 tokens, 0.0 elsewhere), all the same
    length; ``steps`` are the step indexes it covers."""

    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    steps: list[int]


class MissingTokenIds(ValueError):
    """A step has no backend token ids (``token_ids_source == "unavailable"``)."""


def sequences(steps: Iterable[Step], *, skip_incomplete: bool = True) -> list[TokenSequence]:
    """The steps (sorted by ``step_index``) as the fewest prefix-consistent token sequences.

    Raises ``MissingTokenIds`` for a step without token ids; incomplete steps (client
    gone, replica died) are skipped unless ``skip_incomplete`` is false.
    """
    out: list[TokenSequence] = []
    current: TokenSequence | None = None
    for step in sorted(steps, key=lambda s: s.step_index):
        if step.incomplete and skip_incomplete:
            continue
        if step.prompt_token_ids is None or step.completion_token_ids is None:
            raise MissingTokenIds(f"step {step.step_index} of rollout {step.rollout_id} has no token ids "
                                  f"(token_ids_source={step.token_ids_source!r}); nothing is re-tokenized")
        prompt, completion = step.prompt_token_ids, step.completion_token_ids
        lps = list(step.logprobs or [])
        if len(lps) != len(completion):
            lps = (lps + [0.0] * len(completion))[: len(completion)]
        n = len(current.ids) if current is not None else 0
        if current is None or len(prompt) < n or prompt[:n] != current.ids:
            current = TokenSequence(ids=[], loss_mask=[], logprobs=[], steps=[])
            out.append(current)
            n = 0
        new_prompt = prompt[n:]
        current.ids += new_prompt + completion
        current.loss_mask += [0] * len(new_prompt) + [1] * len(completion)
        current.logprobs += [0.0] * len(new_prompt) + lps
        current.steps.append(step.step_index)
    return out


def single_sequence(steps: Iterable[Step]) -> TokenSequence:
    """The steps as exactly one sequence; ``ValueError`` if the history was not prefix-consistent."""
    seqs = sequences(steps)
    if len(seqs) != 1:
        raise ValueError(f"the steps form {len(seqs)} token sequences, not one: a prompt did not extend "
                         "the previous turn's tokens")
    return seqs[0]
