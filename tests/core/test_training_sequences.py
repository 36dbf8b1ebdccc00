"""arena_core.sequences.assemble: a rollout's steps as training sequences, with their breaks."""

from __future__ import annotations

import msgspec

from arena_core.schemas import RolloutState, SequenceBreak, Step, TrainingSequence, Trajectory
from arena_core.sequences import assemble, sequences_of, with_sequences
from arena_stack.scripted_llm import Script, ScriptedLLM, ScriptedResponse


def step(i: int, prompt: list[int] | None, completion: list[int] | None, logprobs: list[float] | None = None,
         **kw) -> Step:
    if logprobs is None and completion is not None:
        logprobs = [-0.1 * (k + 1) for k in range(len(completion))]
    return Step(rollout_id="r", step_index=i, model="m", backend="b", prompt_token_ids=prompt,
                completion_token_ids=completion, logprobs=logprobs, **kw)


def three_turns() -> list[Step]:
    """System+user [1..4]; the agent calls a tool [10, 11]; tool output [20, 21, 22] comes
    back with template tokens [5]; the agent calls again [12]; more output [23]; it answers [13, 14, 2]."""
    return [
        step(0, [1, 2, 3, 4], [10, 11], [-0.5, -0.25], policy_version="7"),
        step(1, [1, 2, 3, 4, 10, 11, 20, 21, 22, 5], [12], [-1.0], policy_version="7"),
        step(2, [1, 2, 3, 4, 10, 11, 20, 21, 22, 5, 12, 23, 5], [13, 14, 2], [-0.125, -0.0625, -0.5],
             policy_version="8"),
    ]


def test_sequences_copy_the_steps_ids_and_take_tuples_alike():
    steps = three_turns()
    [seq], _ = assemble(steps)
    seq.token_ids.append(99)
    seq.logprobs.append(0.0)
    assert steps[0].prompt_token_ids == [1, 2, 3, 4] and steps[0].logprobs == [-0.5, -0.25]  # untouched
    as_tuples = [msgspec.structs.replace(s, prompt_token_ids=tuple(s.prompt_token_ids),
                                         completion_token_ids=tuple(s.completion_token_ids), logprobs=tuple(s.logprobs))
                 for s in three_turns()]
    assert assemble(as_tuples) == assemble(three_turns())


def test_three_turns_with_tool_output_between_merge_into_one_masked_sequence():
    steps = three_turns()
    [seq], breaks = assemble(reversed(steps))  # walked by step_index, whatever the arrival order
    assert breaks == []
    assert seq.token_ids == [1, 2, 3, 4, 10, 11, 20, 21, 22, 5, 12, 23, 5, 13, 14, 2]
    assert seq.loss_mask == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1]
    assert seq.logprobs == [0.0, 0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0,
                            -0.125, -0.0625, -0.5]
    assert sum(seq.loss_mask) == 6 == sum(len(s.completion_token_ids) for s in steps)
    assert len(seq.loss_mask) - sum(seq.loss_mask) == 10  # 4 prompt + 3 tool + 1 template + 1 tool + 1 template
    assert seq.step_indexes == [0, 1, 2] and seq.policy_versions == ["7", "7", "8"]
    # every sampled token is exactly one step's completion, in order
    assert [t for t, m in zip(seq.token_ids, seq.loss_mask) if m] == [10, 11, 12, 13, 14, 2]


def test_a_rewritten_history_starts_a_new_sequence_and_says_at_which_token():
    steps = three_turns()
    # the scaffold summarised turn 0 away: call 2's prompt diverges at position 4
    steps[2] = step(2, [1, 2, 3, 4, 99, 5], [13], [-0.3])
    seqs, breaks = assemble(steps)
    assert [s.step_indexes for s in seqs] == [[0, 1], [2]]
    assert seqs[1].token_ids == [1, 2, 3, 4, 99, 5, 13] and seqs[1].loss_mask == [0, 0, 0, 0, 0, 0, 1]
    assert sum(seqs[0].loss_mask) == 3 and sum(seqs[1].loss_mask) == 1
    assert breaks == [SequenceBreak(step_index=2, kind="prefix_mismatch", position=4,
                                    reason="prefix mismatch at token 4")]
    # a prompt that is only a shorter prefix of the sequence (history truncated) breaks too
    seqs, breaks = assemble([step(0, [1, 2, 3], [4, 5]), step(1, [1, 2, 3, 4], [6])])
    assert [s.step_indexes for s in seqs] == [[0], [1]]
    assert breaks == [SequenceBreak(step_index=1, kind="prefix_mismatch", position=4,
                                    reason="the prompt (4 tokens) is shorter than the sequence (5)")]


def test_the_break_position_is_the_first_differing_token_of_a_long_history():
    history = list(range(3000))
    rewritten = history[:2500] + [-1] + history[2501:]
    for prompt, at in [(rewritten, 2500), (history[:2048], 2048), (history[:2000], 2000), (history[:1] + [7], 1),
                       ([7], 0), (history[:1500] + [-1], 1500)]:
        _, [b] = assemble([step(0, history[:-10], history[-10:]), step(1, prompt, [1])])
        assert (b.kind, b.position) == ("prefix_mismatch", at)


def test_an_abandoned_call_is_left_out_without_breaking_the_chain():
    steps = three_turns()
    # call 1 was answered after the agent gave up on it; the agent retried it as call 2
    retry = step(2, [1, 2, 3, 4, 10, 11, 20, 21, 22, 5], [12, 2], [-0.75, -0.5])
    abandoned = msgspec.structs.replace(steps[1], abandoned=True, completion_token_ids=[77, 78],
                                        logprobs=[-2.0, -3.0])
    [seq], breaks = assemble([steps[0], abandoned, retry])
    assert seq.step_indexes == [0, 2]
    assert seq.token_ids == [1, 2, 3, 4, 10, 11, 20, 21, 22, 5, 12, 2]
    assert seq.loss_mask == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1] and 77 not in seq.token_ids
    assert breaks == [SequenceBreak(step_index=1, kind="abandoned", reason="the agent never received the answer")]


def test_an_incomplete_call_is_left_out_and_a_retry_extends_the_sequence():
    cut = step(1, [1, 2, 3, 4, 10, 11, 20], [30], [-0.4], incomplete=True, error="replica died")
    [seq], breaks = assemble([step(0, [1, 2, 3, 4], [10, 11]), cut, step(2, [1, 2, 3, 4, 10, 11, 20], [31])])
    assert seq.step_indexes == [0, 2] and seq.token_ids == [1, 2, 3, 4, 10, 11, 20, 31]
    assert sum(seq.loss_mask) == 3
    assert breaks == [SequenceBreak(step_index=1, kind="incomplete", reason="the call was cut short: replica died")]


def test_a_call_without_token_ids_is_left_out_and_ends_the_sequence():
    steps = three_turns()
    blind = step(1, None, None, token_ids_source="unavailable", completion_text="ls")
    seqs, breaks = assemble([steps[0], blind, steps[2]])
    # call 2's prompt still extends call 0's tokens, but call 1's sampled answer is inside it,
    # unknown as tokens: it is not spliced in as context
    assert [s.step_indexes for s in seqs] == [[0], [2]]
    assert seqs[0].token_ids == [1, 2, 3, 4, 10, 11] and seqs[1].token_ids[:13] == steps[2].prompt_token_ids
    assert seqs[1].loss_mask == [0] * 13 + [1, 1, 1]
    assert breaks == [SequenceBreak(step_index=1, kind="no_token_ids", reason="no token ids (the backend gave none)")]
    # no ids at all: no sequence, one break per step
    seqs, breaks = assemble([step(0, None, None, token_ids_source="unavailable"),
                             step(1, [1], [2], logprobs=[])])
    assert seqs == [] and [(b.step_index, b.kind) for b in breaks] == [(0, "no_token_ids"), (1, "no_logprobs")]
    assert breaks[1].reason == "0 logprobs for 1 completion tokens"


def test_a_trajectory_carries_its_sequences_through_json():
    t = Trajectory(rollout_id="r", task_id="t", final_state=RolloutState.COMPLETED, steps=three_turns())
    assert sequences_of(t) == assemble(t.steps)  # a trajectory from before the fields: assembled
    filled = with_sequences(t)
    back = msgspec.json.decode(msgspec.json.encode(filled), type=Trajectory)
    assert back.sequences == filled.sequences and back.sequences[0].step_indexes == [0, 1, 2]
    assert isinstance(back.sequences[0], TrainingSequence) and sequences_of(back) == (back.sequences, [])
    assert b'"sequence_breaks"' not in msgspec.json.encode(filled)  # empty: omitted on the wire


def test_a_scripted_chat_with_a_tool_turn_is_one_sequence_of_the_backend_ids():
    llm = ScriptedLLM(Script(responses=[ScriptedResponse(label="a", content="ls")]))
    messages: list[dict] = [{"role": "user", "content": "list files"}]
    steps = []
    for i in range(3):
        out = llm.complete({"messages": messages, "return_token_ids": True, "logprobs": True, "seed": i})
        choice = out["choices"][0]
        steps.append(Step(rollout_id="r", step_index=i, model="m", backend="b", prompt_token_ids=out["prompt_token_ids"],
                          completion_token_ids=choice["token_ids"],
                          logprobs=[c["logprob"] for c in choice["logprobs"]["content"]]))
        messages += [{"role": "assistant", "content": choice["message"]["content"]},
                     {"role": "tool", "content": f"a.py b.py {i}"}]
    [seq], breaks = assemble(steps)
    assert breaks == [] and seq.token_ids == steps[2].prompt_token_ids + steps[2].completion_token_ids
    assert [t for t, m in zip(seq.token_ids, seq.loss_mask) if m] == [
        t for s in steps for t in s.completion_token_ids]
    assert [lp for lp, m in zip(seq.logprobs, seq.loss_mask) if m] == [lp for s in steps for lp in s.logprobs]
