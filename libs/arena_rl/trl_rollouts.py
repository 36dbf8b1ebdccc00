"""Arena as the rollout and reward source of TRL's ``GRPOTrainer`` (its ``rollout_func`` hook).

``ArenaRollouts`` runs each prompt of a batch as an Arena group and hands TRL the captured ids,
logprobs and the verifier's reward; ``ArenaWeightSync`` pushes the trained LoRA adapter to the
policy server after every optimizer step. docs/rl.md ("TRL").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from transformers import TrainerCallback

from arena.sdk import ArenaClient
from arena_core.schemas import SamplingParams, Task, Trajectory
from arena_core.sequences import sequences_of
from arena_rl.lm import LoRASpec, lora_config
from arena_rl.policy_server import VERSION_HEADER

#: The extra field ``ArenaRollouts`` returns and ``arena_reward`` reads (TRL forwards it).
REWARD_FIELD = "arena_reward"
#: The extra field with the policy version that served each completion ("" unknown).
VERSION_FIELD = "arena_policy_version"
ROLLOUT_FIELD = "arena_rollout_id"


class AdapterMismatch(ValueError):
    """TRL's LoRA adapter is not the one the policy server loads."""


# ----------------------------------------------------------------------------- LoRA


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The PEFT model's adapter weights, named as ``LanguageModel.load_adapter`` expects them."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous().cpu() for k, v in get_peft_model_state_dict(model).items()}


def expected_adapter_shapes(config: Any, spec: LoRASpec) -> dict[str, tuple[int, ...]]:
    """The adapter (names, shapes) a server with ``spec`` loads for a model of ``config``,
    computed on the meta device (nothing allocated)."""
    from peft import get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(config)
        state = get_peft_model_state_dict(get_peft_model(base, lora_config(spec)))
    return {k: tuple(v.shape) for k, v in state.items()}


def check_adapter(model: Any, spec: LoRASpec) -> None:
    """Raise ``AdapterMismatch`` unless ``model``'s adapter has the server's names and shapes."""
    ours = {k: tuple(v.shape) for k, v in adapter_state(model).items()}
    if not ours:
        raise AdapterMismatch("the trained model has no LoRA adapter: pass GRPOTrainer(peft_config=lora_config(spec))")
    config = model.active_peft_config
    if (config.r, config.lora_alpha, bool(config.use_rslora)) != (spec.r, spec.alpha, False):
        raise AdapterMismatch(f"TRL's LoRA (r={config.r}, alpha={config.lora_alpha}, rslora={config.use_rslora}) "
                              f"scales differently from the policy server's (r={spec.r}, alpha={spec.alpha})")
    theirs = expected_adapter_shapes(model.get_base_model().config, spec)
    if ours != theirs:
        missing, extra = sorted(set(theirs) - set(ours))[:3], sorted(set(ours) - set(theirs))[:3]
        shapes = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])[:3]
        raise AdapterMismatch(f"TRL's LoRA adapter does not fit the policy server's ({spec}): missing {missing}, "
                              f"unexpected {extra}, other shapes {shapes}")


# ----------------------------------------------------------------------------- rollouts


@dataclass
class Sample:
    """One completion as TRL takes it: the first training sequence of a trajectory, split
    where the policy's first sampled token is. ``env_mask`` is the sequence's loss mask
    (0 on later turns' context: the partner's messages and the chat template)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]


def sample_of(trajectory: Trajectory) -> Sample:
    """The trajectory's first training sequence (``Trajectory.sequences``; a single-turn
    rollout has exactly one) as a TRL sample. Raises if there is none (no token ids)."""
    sequences, breaks = sequences_of(trajectory)
    if not sequences:
        why = "; ".join(b.reason for b in breaks) or trajectory.reason or "no LLM call"
        raise RuntimeError(f"rollout {trajectory.rollout_id} ({trajectory.final_state}) has no training sequence: "
                           f"{why}")
    seq = sequences[0]
    start = seq.loss_mask.index(1)
    return Sample(prompt_ids=seq.token_ids[:start], completion_ids=seq.token_ids[start:],
                  logprobs=seq.logprobs[start:], env_mask=seq.loss_mask[start:])


@dataclass
class ArenaBatch:
    """What one ``rollout_func`` call did: for tests and logs."""

    global_step: int
    group_ids: list[str]
    rollout_ids: list[str]
    trajectories: list[Trajectory]
    output: dict[str, list]
    seconds: float


@dataclass
class ArenaRollouts:
    """TRL's ``rollout_func``: ``GRPOTrainer(..., rollout_func=ArenaRollouts(client, task_factory))``.

    TRL passes the batch's prompts, each repeated ``num_generations`` times in a row (its
    ``RepeatSampler``); each run of equal prompts becomes one Arena group of that size, its
    task made by ``task_factory(prompt)``. All groups are submitted, then waited for; the
    answer holds, per completion in TRL's order, the captured ``prompt_ids``,
    ``completion_ids``, ``logprobs`` and ``env_mask`` (``sample_of``) and the extra fields
    ``arena_reward`` (the trajectory's reward: the verifier's), ``arena_policy_version``
    and ``arena_rollout_id``. Sampling: ``sampling`` or TRL's ``temperature``/``top_p``."""

    client: ArenaClient
    task_factory: Callable[[Any], Task]
    sampling: SamplingParams | None = None
    seed: int = 0
    timeout: float = 900.0
    provider: str = "local"
    batches: list[ArenaBatch] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        t0 = time.monotonic()
        training = bool(trainer.model.training)
        n = int(trainer.num_generations if training else trainer.num_generations_eval)
        if len(prompts) % n:
            raise ValueError(f"{len(prompts)} prompts do not split into groups of num_generations={n}")
        runs = [prompts[i:i + n] for i in range(0, len(prompts), n)]
        for run in runs:
            if any(p != run[0] for p in run):
                raise ValueError("TRL's prompts are not repeated num_generations times in a row")
        sampling = self.sampling or SamplingParams(temperature=float(trainer.args.temperature),
                                                   top_p=float(trainer.args.top_p))
        submitted = [self.client.submit_group(self.task_factory(run[0]), n=n, seed=self._rng.getrandbits(30),
                                              sampling=sampling, provider=self.provider) for run in runs]
        rollout_ids = [rid for group in submitted for rid in group.rollout_ids]
        trajectories = []
        for rid in rollout_ids:
            view = self.client.wait(rid, timeout=self.timeout)
            if not view.state.is_final:
                raise TimeoutError(f"rollout {rid} still {view.state} after {self.timeout:.0f}s")
            trajectories.append(self.client.wait_trajectory(rid, timeout=120))
        samples = [sample_of(t) for t in trajectories]
        output: dict[str, list] = {
            "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids for s in samples],
            "logprobs": [s.logprobs for s in samples],
            "env_mask": [s.env_mask for s in samples],
            REWARD_FIELD: [t.reward for t in trajectories],
            VERSION_FIELD: [",".join(t.policy_versions) for t in trajectories],
            ROLLOUT_FIELD: [t.rollout_id for t in trajectories],
        }
        self.batches.append(ArenaBatch(global_step=int(trainer.state.global_step),
                                       group_ids=[g.group_id for g in submitted], rollout_ids=rollout_ids,
                                       trajectories=trajectories, output=output, seconds=time.monotonic() - t0))
        return output


def arena_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """TRL reward function: the reward Arena's verifier gave each completion (``None``:
    Arena could not verify it; TRL leaves it out of the group's baseline)."""
    rewards = kwargs.get(REWARD_FIELD)
    if rewards is None or len(rewards) != len(completions):
        raise ValueError(f"arena_reward needs the {REWARD_FIELD!r} field of ArenaRollouts (rollout_func)")
    return [None if r is None else float(r) for r in rewards]


# ----------------------------------------------------------------------------- weights


class ArenaWeightSync(TrainerCallback):
    """Keeps the policy server serving the model TRL trains: at the start it checks the
    adapter fits the server's LoRA (``spec``) and that the server serves version
    ``global_step``; after every optimizer step it pushes the adapter (safetensors) as
    version ``global_step`` and fails unless the server confirms it. ``url``: the server's
    OpenAI base URL (``http://host:port/v1``)."""

    def __init__(self, url: str, spec: LoRASpec, *, timeout: float = 120.0):
        self.api = url.rstrip("/")
        self.root = self.api.removesuffix("/v1")
        self.spec = spec
        self.timeout = timeout
        self.pushed: list[int] = []  # the versions pushed, in order
        self.push_seconds: list[float] = []

    def served_version(self) -> int:
        answer = httpx.get(self.root + "/health", timeout=self.timeout)
        answer.raise_for_status()
        return int(answer.json()["policy_version"])

    def push(self, model: Any, version: int) -> None:
        from safetensors.torch import save

        t0 = time.monotonic()
        answer = httpx.post(self.api + "/weights", content=save(adapter_state(model)),
                            headers={VERSION_HEADER: str(version), "content-type": "application/octet-stream"},
                            timeout=self.timeout)
        if answer.status_code != 200 or answer.json().get("policy_version") != str(version):
            raise RuntimeError(f"the policy server refused adapter version {version}: "
                               f"HTTP {answer.status_code} {answer.text[:300]}")
        self.pushed.append(version)
        self.push_seconds.append(time.monotonic() - t0)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        check_adapter(model, self.spec)
        served = self.served_version()
        if served != state.global_step:
            raise RuntimeError(f"the policy server serves version {served}, TRL starts at step {state.global_step}: "
                               "start the server fresh so that it serves the model TRL trains")

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.push(model, int(state.global_step))
