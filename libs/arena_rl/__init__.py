"""Closed-loop online RL for Arena (needs the ``rl`` extra: ``pip install -e '.[rl]'``).

A small policy and its vLLM-shaped server, the GRPO loss and trainer, weight sync to vLLM. The
services never import this package: torch is only needed by the trainer side. See docs/rl.md (Modules).
"""
