"""Closed-loop online RL for Arena (needs the ``rl`` extra: ``pip install -e '.[rl]'``).

- :mod:`arena_rl.tokenizer` — a character-level tokenizer with a small, explicit alphabet;
- :mod:`arena_rl.model` — a small decoder-only transformer policy, checkpoints;
- :mod:`arena_rl.loss` — the GRPO loss (pure tensor math);
- :mod:`arena_rl.policy_server` — the policy behind an OpenAI/vLLM-shaped HTTP API;
- :mod:`arena_rl.trainer` — GRPO on the trajectory stream, pushing weights to servers;
- :mod:`arena_rl.vllm_sync` — weight sync to vLLM replicas (LoRA adapters).

The services never import this package: torch is only needed by the trainer side.
"""
