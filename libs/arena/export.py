"""Training views of stored trajectories: pure functions from groups of ``Trajectory`` to rows.

Views ``grpo``, ``dpo``, ``sft`` and ``tokens``; no I/O and no pyarrow here (``arena.export_io``).
What a view skips is counted in ``ExportStats``. See docs/trajectory.md ("Exports: training data").
"""

from __future__ import annotations

import datetime as dt
import difflib
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from arena_core.grpo import group_advantages
from arena_core.schemas import Step, Trajectory
from arena_core.sequences import sequences_of

View = Literal["grpo", "dpo", "sft", "tokens"]
VIEWS: tuple[str, ...] = ("grpo", "dpo", "sft", "tokens")


@dataclass
class ExportOptions:
    include_incomplete: bool = False  # keep trajectories the plane assembled with parts missing
    include_partial_groups: bool = False  # grpo/dpo/tokens: use groups missing members
    normalize_std: bool = True  # grpo/tokens: divide by the group's std (False: Dr. GRPO)
    sft_threshold: float = 1.0  # sft: minimum reward of the best member
    dpo_margin: float = 0.0  # dpo: chosen.reward - rejected.reward must exceed this
    dpo_pairs: Literal["best-worst", "all"] = "best-worst"


@dataclass
class ExportStats:
    trajectories: int = 0
    groups: int = 0
    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n


# --------------------------------------------------------------------------- grouping


def group_trajectories(trajectories: Iterable[Trajectory]) -> Iterator[list[Trajectory]]:
    """Consecutive trajectories sharing a ``group_id`` (the export order keeps members
    together); a trajectory without a group is a group of one."""
    for _, members in itertools.groupby(trajectories, key=lambda t: t.group_id or f"\0{t.rollout_id}"):
        yield sorted(members, key=lambda t: t.group_index)


def date_of(t: Trajectory) -> str:
    return dt.datetime.fromtimestamp(t.completed_at, dt.timezone.utc).strftime("%Y-%m-%d")


def _usable(group: list[Trajectory], options: ExportOptions, stats: ExportStats, *, needs_group: bool
            ) -> list[Trajectory]:
    stats.groups += 1
    stats.trajectories += len(group)
    members = [t for t in group if t.reward is not None]
    if len(members) < len(group):  # Arena could not run or verify them: no reward to learn from
        stats.skip("no reward (an infrastructure outcome, or ended unverified)", len(group) - len(members))
    if not options.include_incomplete:
        complete = [t for t in members if not (t.incomplete or "incomplete" in t.metadata)]
        if len(complete) < len(members):
            stats.skip("incomplete trajectory", len(members) - len(complete))
        members = complete
    if needs_group:
        if group[0].group_id is None:
            stats.skip("not in a group", len(members))
            return []
        # partial: members not stored (or left out as incomplete). Members stored without a
        # reward are left out above and the rest keep their group, as GroupCompleted.advantages
        # does (docs/trajectory.md, One meaning of reward)
        unscored = len(group) - sum(t.reward is not None for t in group)
        if len(members) + unscored < group[0].group_size and not options.include_partial_groups:
            stats.skip("partial group", len(members))
            return []
        if len(members) < 2:
            stats.skip("group of one", len(members))
            return []
    return members


# --------------------------------------------------------------------------- text helpers


def _text(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def prompt_messages(t: Trajectory) -> str:
    """The first step's request messages as JSON text ('' without steps)."""
    return json.dumps(t.steps[0].request_messages, ensure_ascii=False) if t.steps else ""


def completions(t: Trajectory) -> list[str]:
    return [s.completion_text for s in t.steps]


def chat_messages(t: Trajectory) -> list[dict[str, str]]:
    """The whole conversation: the last step's request messages plus its completion,
    contents as text (non-text contents as JSON)."""
    if not t.steps:
        return []
    last = t.steps[-1]
    messages = [{"role": str(m.get("role", "")), "content": _text(m.get("content", ""))}
                for m in last.request_messages]
    return [*messages, {"role": "assistant", "content": last.completion_text}]


# --------------------------------------------------------------------------- views


def grpo_rows(group: list[Trajectory], options: ExportOptions, stats: ExportStats) -> list[dict]:
    members = _usable(group, options, stats, needs_group=True)
    if not members:
        return []
    advantages = group_advantages([t.reward for t in members], normalize_std=options.normalize_std)
    return [{
        "date": date_of(t), "task_id": t.task_id, "group_id": t.group_id or "", "group_size": t.group_size,
        "group_index": t.group_index, "rollout_id": t.rollout_id, "reward": float(t.reward), "advantage": a,
        "final_state": t.final_state.value, "policy_versions": list(t.policy_versions), "num_steps": len(t.steps),
        "prompt_messages": prompt_messages(t), "completions": completions(t),
    } for t, a in zip(members, advantages)]


def dpo_rows(group: list[Trajectory], options: ExportOptions, stats: ExportStats) -> list[dict]:
    members = _usable(group, options, stats, needs_group=True)
    if not members:
        return []
    ranked = sorted(members, key=lambda t: (-t.reward, t.group_index))
    if options.dpo_pairs == "best-worst":
        candidates = [(ranked[0], ranked[-1])]
    else:
        candidates = [(a, b) for a, b in itertools.combinations(ranked, 2)]
    rows = []
    for chosen, rejected in candidates:
        if chosen.reward - rejected.reward <= options.dpo_margin:
            continue
        rows.append({
            "date": date_of(chosen), "task_id": chosen.task_id, "group_id": chosen.group_id or "",
            "prompt_messages": prompt_messages(chosen),
            "chosen": completions(chosen), "rejected": completions(rejected),
            "chosen_messages": chat_messages(chosen), "rejected_messages": chat_messages(rejected),
            "chosen_reward": float(chosen.reward), "rejected_reward": float(rejected.reward),
            "chosen_rollout_id": chosen.rollout_id, "rejected_rollout_id": rejected.rollout_id,
        })
    if not rows:
        stats.skip("no pair above the margin")
    return rows


def sft_rows(group: list[Trajectory], options: ExportOptions, stats: ExportStats) -> list[dict]:
    members = _usable(group, options, stats, needs_group=False)
    if not members:
        return []
    best = max(members, key=lambda t: (t.reward, -t.group_index))
    if best.reward < options.sft_threshold:
        stats.skip("best below the threshold")
        return []
    return [{
        "date": date_of(best), "task_id": best.task_id, "group_id": best.group_id or "", "rollout_id": best.rollout_id,
        "reward": float(best.reward), "messages": chat_messages(best),
    }]


def step_tokens(step: Step) -> tuple[list[int], list[int], list[float]] | None:
    """``(input_ids, loss_mask, logprobs)`` of one step alone, prompt then completion: mask 1
    on the completion tokens the policy sampled, 0 on the prompt; ``logprobs`` are the
    sampling policy's, 0.0 on the prompt. ``None`` when the backend did not return token
    ids or the logprobs do not line up with them."""
    if step.prompt_token_ids is None or step.completion_token_ids is None:
        return None
    prompt, completion = list(step.prompt_token_ids), list(step.completion_token_ids)
    logprobs = list(step.logprobs or [])
    if len(logprobs) != len(completion):
        return None
    return (prompt + completion, [0] * len(prompt) + [1] * len(completion), [0.0] * len(prompt) + logprobs)


#: What ``ExportStats`` calls a step a member's sequences leave out, by ``SequenceBreak.kind``.
LEFT_OUT = {
    "abandoned": "step the agent never received (abandoned)",
    "incomplete": "step cut short (incomplete)",
    "no_token_ids": "step without token ids",
    "no_logprobs": "step with logprobs not aligned to its completion",
}


def token_rows(group: list[Trajectory], options: ExportOptions, stats: ExportStats) -> list[dict]:
    """One row per training sequence of each member (``Trajectory.sequences``, made by
    ``arena_core.sequences.assemble``): a multi-turn rollout whose prompts extend each other
    is one sequence, its tool/user/template tokens masked 0 and every sampled completion
    masked 1; a rewritten history gives several (``sequence_index`` of ``num_sequences``).
    Steps no sequence holds (abandoned, cut short, without token ids or aligned logprobs) are
    counted in ``stats``; nothing is re-tokenized or padded."""
    members = _usable(group, options, stats, needs_group=True)
    if not members:
        return []
    advantages = group_advantages([t.reward for t in members], normalize_std=options.normalize_std)
    rows = []
    for t, a in zip(members, advantages):
        seqs, breaks = sequences_of(t)
        for b in breaks:
            if b.kind in LEFT_OUT:
                stats.skip(LEFT_OUT[b.kind])
        for n, seq in enumerate(seqs):
            rows.append({
                "date": date_of(t), "task_id": t.task_id, "group_id": t.group_id or "", "rollout_id": t.rollout_id,
                "sequence_index": n, "num_sequences": len(seqs),
                "steps": list(seq.step_indexes), "policy_versions": sorted(set(seq.policy_versions)),
                "input_ids": list(seq.token_ids), "loss_mask": list(seq.loss_mask), "logprobs": list(seq.logprobs),
                "num_loss_tokens": sum(seq.loss_mask), "advantage": a, "reward": float(t.reward),
            })
    return rows


VIEW_FUNCTIONS = {"grpo": grpo_rows, "dpo": dpo_rows, "sft": sft_rows, "tokens": token_rows}


def export_rows(trajectories: Iterable[Trajectory], view: View, options: ExportOptions | None = None,
                stats: ExportStats | None = None) -> Iterator[dict]:
    """Rows of ``view`` for trajectories ordered so that each group's members are adjacent."""
    if view not in VIEW_FUNCTIONS:
        raise ValueError(f"unknown view {view!r}: one of {', '.join(VIEWS)}")
    options = options or ExportOptions()
    stats = stats if stats is not None else ExportStats()
    fn = VIEW_FUNCTIONS[view]
    for group in group_trajectories(trajectories):
        rows = fn(group, options, stats)
        stats.rows += len(rows)
        yield from rows


def near_matches(wanted: str, known: Iterable[str], *, limit: int = 5) -> list[str]:
    """Values of ``known`` a user may have meant by ``wanted`` (a filter that matched nothing):
    those that start with it, then those that contain it (case-insensitively), then the closest by
    ``difflib``; at most ``limit``."""
    known = sorted(set(known))
    low = wanted.lower()
    starts = [k for k in known if k.lower().startswith(low)]
    contains = [k for k in known if low in k.lower() and k not in starts]
    close = [k for k in difflib.get_close_matches(wanted, known, n=limit, cutoff=0.6) if k not in starts + contains]
    return (starts + contains + close)[:limit]
