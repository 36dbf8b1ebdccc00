"""Closed-loop online RL for Arena (needs the ``rl`` extra: ``pip install -e '.[rl]'``).

- :mod:`arena.rl.tokenizer` — a character-level tokenizer with a small, explicit alphabet;
- :mod:`arena.rl.model` — a small decoder-only transformer policy, checkpoints;
- :mod:`arena.rl.loss` — the GRPO loss (pure tensor math);
- :mod:`arena.rl.policy_server` — the policy behind an OpenAI/vLLM-shaped HTTP API;
- :mod:`arena.rl.trainer` — GRPO on the trajectory stream, pushing weights to servers;
- :mod:`arena.rl.vllm_sync` — weight sync to vLLM replicas (LoRA adapters).

The services never import this package: torch is only needed by the trainer side.
"""
