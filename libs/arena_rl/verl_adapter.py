"""veRL adapter: Arena trajectories as veRL's ``DataProto`` training batch, and ``ArenaAgentLoop``,
a veRL agent loop that runs each sample as an Arena rollout. Built against verl==0.9.1 (CPU-importable
parts only). See docs/rl.md ("veRL").
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy as np
import torch

from arena.sdk import ArenaClient
from arena_core.schemas import GroupCompleted, SamplingParams, Task, TrainingSequence, Trajectory
from arena_core.sequences import sequences_of

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput
    from verl.protocol import DataProto
    from verl.utils.model import compute_position_id_with_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "arena_rl.verl_adapter needs veRL's data classes (no GPU needed to import them): pip install --no-deps "
        "verl==0.9.1 tensordict==0.10.0 ray==2.60.0 'pyvers<0.2' cloudpickle msgpack protobuf jsonschema "
        "jsonschema-specifications referencing rpds-py 'omegaconf<2.4' hydra-core 'antlr4-python3-runtime==4.9.*' "
        "pillow codetiming orjson cachetools "
        f"(docs/rl.md, 'veRL'); import failed: {exc}") from exc

#: Makes the Arena task for one veRL sample from the sample's dataset fields (``run``'s kwargs).
TaskFactory = Callable[[dict[str, Any]], Task]


class ArenaRolloutError(RuntimeError):
    """The rollout gave nothing veRL can train on (infrastructure outcome, no reward, no tokens)."""


class VerlRow(msgspec.Struct, frozen=True, kw_only=True):
    """One training sequence of one trajectory, split the way veRL splits a sample."""

    uid: str  # GRPO group: the Arena group id (the rollout id for a lone rollout)
    rollout_id: str
    sequence_index: int
    prompt_ids: list[int]  # the context before the first sampled token
    response_ids: list[int]  # from the first sampled token to the end: policy and tool/env tokens
    response_mask: list[int]  # 1: sampled by the policy; 0: tool/env/template tokens between turns
    response_logprobs: list[float]  # the rollout policy's logprob where the mask is 1, 0.0 elsewhere
    reward: float
    num_turns: int  # veRL's count: the user turn, then each assistant turn and the context after it
    policy_version: str  # the version of the sequence's last call ("" unknown)


class Skipped(msgspec.Struct, frozen=True, kw_only=True):
    rollout_id: str
    reason: str


def split_sequence(seq: TrainingSequence) -> tuple[list[int], list[int], list[int], list[float]]:
    """``(prompt_ids, response_ids, response_mask, response_logprobs)``: the prompt is every token
    before the first one the policy sampled; the response is the rest."""
    try:
        start = seq.loss_mask.index(1)
    except ValueError:
        raise ValueError("a training sequence without a sampled token") from None
    return (list(seq.token_ids[:start]), list(seq.token_ids[start:]), list(seq.loss_mask[start:]),
            list(seq.logprobs[start:]))


def _unusable(t: Trajectory) -> str | None:
    if t.infrastructure or t.reward is None:
        return f"no reward (infrastructure outcome: {t.reason or t.final_state.value})"
    if t.incomplete:
        return "incomplete: " + ", ".join(t.incomplete)
    return None


def _rows_of_trajectory(t: Trajectory, *, only_first: bool = False) -> list[VerlRow]:
    rows = []
    for i, seq in enumerate(sequences_of(t)[0]):
        if 1 not in seq.loss_mask:
            continue
        prompt, response, mask, logprobs = split_sequence(seq)
        rows.append(VerlRow(uid=t.group_id or t.rollout_id, rollout_id=t.rollout_id, sequence_index=i,
                            prompt_ids=prompt, response_ids=response, response_mask=mask,
                            response_logprobs=logprobs, reward=float(t.reward or 0.0),
                            num_turns=2 * len(seq.step_indexes),
                            policy_version=seq.policy_versions[-1] if seq.policy_versions else ""))
        if only_first:
            break
    return rows


def verl_rows(items: Iterable[GroupCompleted | Trajectory]) -> tuple[list[VerlRow], list[Skipped]]:
    """Every training sequence of every usable trajectory as a row (a trajectory whose steps did
    not chain gives one row per sequence, each with the rollout's reward), and the trajectories
    left out: infrastructure outcomes, incomplete trajectories, those without token ids."""
    rows: list[VerlRow] = []
    skipped: list[Skipped] = []
    for item in items:
        for t in item.trajectories if isinstance(item, GroupCompleted) else [item]:
            why = _unusable(t)
            got = [] if why else _rows_of_trajectory(t)
            if not why and not got:
                why = "no training sequence (no token ids or logprobs captured)"
            if why:
                skipped.append(Skipped(rollout_id=t.rollout_id, reason=why))
            rows.extend(got)
    return rows, skipped


def _padded(rows: list[list[int]] | list[list[float]], width: int, value: float, *, left: bool,
            dtype: torch.dtype) -> torch.Tensor:
    """``rows`` as a ``(len(rows), width)`` tensor, padded with ``value`` on the left or the right."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            at = slice(width - len(r), width) if left else slice(0, len(r))
            out[i, at] = torch.tensor(r, dtype=dtype)
    return out


def to_data_proto(items: Iterable[GroupCompleted | Trajectory], *, pad_token_id: int, max_prompt_len: int,
                  max_response_len: int, meta_info: dict[str, Any] | None = None) -> DataProto:
    """A veRL batch from Arena groups (or trajectories), shaped as veRL's agent loop output.

    ``prompts`` left-padded to ``max_prompt_len``, ``responses`` right-padded to ``max_response_len``
    (longer responses are cut there, as veRL's tool agent loop does; a longer prompt is an error),
    ``input_ids``/``attention_mask``/``position_ids`` over both, ``response_mask`` (the loss mask),
    ``rollout_log_probs`` (Arena's captured logprobs), ``rm_scores`` = ``token_level_scores`` (the
    reward on the last response token); non-tensor ``uid`` (group id: GRPO's grouping),
    ``arena_rollout_id``, ``arena_sequence_index``, ``arena_policy_version``, ``__num_turns__``.
    """
    rows, _ = verl_rows(items)
    if not rows:
        raise ValueError("no trainable trajectory: every one was an infrastructure outcome, incomplete or "
                         "without token ids (verl_rows says why)")
    for r in rows:
        if len(r.prompt_ids) > max_prompt_len:
            raise ValueError(f"rollout {r.rollout_id}: prompt of {len(r.prompt_ids)} tokens is longer than "
                             f"max_prompt_len={max_prompt_len}")
    responses = [r.response_ids[:max_response_len] for r in rows]
    prompts = _padded([r.prompt_ids for r in rows], max_prompt_len, pad_token_id, left=True, dtype=torch.int64)
    resp = _padded(responses, max_response_len, pad_token_id, left=False, dtype=torch.int64)
    prompt_attn = _padded([[1] * len(r.prompt_ids) for r in rows], max_prompt_len, 0, left=True, dtype=torch.int64)
    resp_attn = _padded([[1] * len(x) for x in responses], max_response_len, 0, left=False, dtype=torch.int64)
    mask = _padded([r.response_mask[:max_response_len] for r in rows], max_response_len, 0, left=False,
                   dtype=torch.int64)
    logprobs = _padded([r.response_logprobs[:max_response_len] for r in rows], max_response_len, 0.0, left=False,
                       dtype=torch.float32)
    scores = torch.zeros(len(rows), max_response_len, dtype=torch.float32)
    scores[torch.arange(len(rows)), torch.tensor([len(x) - 1 for x in responses])] = torch.tensor(
        [r.reward for r in rows], dtype=torch.float32)
    attention_mask = torch.cat([prompt_attn, resp_attn], dim=1)
    tensors = {
        "prompts": prompts, "responses": resp, "input_ids": torch.cat([prompts, resp], dim=1),
        "attention_mask": attention_mask, "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": mask * resp_attn, "rollout_log_probs": logprobs,
        "rm_scores": scores, "token_level_scores": scores.clone(),
    }
    non_tensors = {
        "uid": np.array([r.uid for r in rows], dtype=object),
        "arena_rollout_id": np.array([r.rollout_id for r in rows], dtype=object),
        "arena_sequence_index": np.array([r.sequence_index for r in rows], dtype=np.int32),
        "arena_policy_version": np.array([r.policy_version for r in rows], dtype=object),
        "__num_turns__": np.array([r.num_turns for r in rows], dtype=np.int32),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(meta_info or {}))


# ---------------------------------------------------------------------------------------- agent loop


def task_from_sample(sample: dict[str, Any]) -> Task:
    """The default task factory: the Arena task (JSON text or a dict) in the dataset row's
    ``extra_info["arena_task"]``, else in an ``arena_task`` column."""
    extra = sample.get("extra_info") or {}
    raw = extra.get("arena_task") if isinstance(extra, dict) else None
    raw = raw if raw is not None else sample.get("arena_task")
    if raw is None:
        raise ValueError("the sample has no extra_info['arena_task'] (nor arena_task): give ArenaAgentLoop a "
                         "task_factory")
    if isinstance(raw, str | bytes):
        return msgspec.json.decode(raw, type=Task)
    return msgspec.convert(raw, Task)


def resolve_task_factory(factory: TaskFactory | str) -> TaskFactory:
    """A callable, or ``"package.module:function"`` (what a veRL agent-loop YAML can hold)."""
    if callable(factory):
        return factory
    module, sep, name = factory.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"task_factory {factory!r}: expected 'package.module:function'")
    found = getattr(importlib.import_module(module), name)
    if not callable(found):
        raise ValueError(f"task_factory {factory!r} is not callable")
    return found


def sampling_from_verl(params: dict[str, Any]) -> SamplingParams:
    """veRL's per-sample ``sampling_params`` (temperature, top_p, top_k; -1/0 = off) as Arena's."""
    top_k = params.get("top_k")
    return SamplingParams(temperature=params.get("temperature"), top_p=params.get("top_p"),
                          top_k=int(top_k) if top_k is not None and int(top_k) > 0 else None)


def output_from_trajectory(t: Trajectory, *, max_response_len: int | None = None,
                           wait_s: float = 0.0) -> AgentLoopOutput:
    """veRL's ``AgentLoopOutput`` from the trajectory's first training sequence, the reward as
    ``reward_score`` (so veRL computes none), the response cut at ``max_response_len``."""
    why = _unusable(t)
    rows = [] if why else _rows_of_trajectory(t, only_first=True)
    if why or not rows:
        raise ArenaRolloutError(f"rollout {t.rollout_id}: {why or 'no training sequence (no token ids captured)'}")
    row = rows[0]
    cut = slice(None, max_response_len)
    return AgentLoopOutput(prompt_ids=row.prompt_ids, response_ids=row.response_ids[cut],
                           response_mask=row.response_mask[cut], response_logprobs=row.response_logprobs[cut],
                           reward_score=row.reward, num_turns=row.num_turns,
                           metrics=AgentLoopMetrics(generate_sequences=wait_s),
                           extra_fields={"arena_rollout_id": t.rollout_id,
                                         "arena_policy_version": row.policy_version})


class ArenaAgentLoop(AgentLoopBase):
    """A veRL agent loop whose sample runs as an Arena rollout: the task from ``task_factory``
    (sample kwargs -> ``Task``), submitted with veRL's sampling parameters, waited for, and its
    trajectory's first training sequence returned with the verifier's reward.

    veRL builds it per sample with its usual arguments; the Arena ones come from the agent-loop
    YAML entry (``_target_: arena_rl.verl_adapter.ArenaAgentLoop``, ``arena_url``, ...). The agent
    in the sandbox calls the policy through Arena's proxy, which must route to veRL's servers.
    """

    def __init__(self, trainer_config: Any, server_manager: Any, tokenizer: Any, processor: Any,
                 dataset_cls: Any, data_config: Any, *, arena_url: str = "http://127.0.0.1:9090",
                 trajectory_url: str = "http://127.0.0.1:9092",
                 task_factory: TaskFactory | str = "arena_rl.verl_adapter:task_from_sample",
                 provider: str = "local", model: str = "default", timeout_s: float = 600.0, **kwargs: Any):
        super().__init__(trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config, **kwargs)
        self.arena_url, self.trajectory_url = arena_url, trajectory_url
        self.task_factory = resolve_task_factory(task_factory)
        self.provider, self.model, self.timeout_s = provider, model, timeout_s

    def _rollout(self, task: Task, sampling: SamplingParams, metadata: dict[str, str]) -> Trajectory:
        with ArenaClient(self.arena_url, self.trajectory_url) as client:
            view = client.submit(task, sampling=sampling, model=self.model, metadata=metadata,
                                 provider=self.provider)
            final = client.wait(view.rollout_id, timeout=self.timeout_s)
            if not final.state.is_final:
                raise ArenaRolloutError(f"rollout {view.rollout_id} not final after {self.timeout_s}s "
                                        f"({final.state.value})")
            return client.wait_trajectory(view.rollout_id, timeout=min(self.timeout_s, 120.0))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        task = self.task_factory(kwargs)
        metadata = {"verl_uid": str(kwargs["uid"])} if kwargs.get("uid") is not None else {}
        started = time.monotonic()
        trajectory = await asyncio.to_thread(self._rollout, task, sampling_from_verl(sampling_params), metadata)
        return output_from_trajectory(trajectory, max_response_len=self.rollout_config.response_length,
                                      wait_s=time.monotonic() - started)
