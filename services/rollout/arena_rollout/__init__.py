"""The rollout plane: HTTP rollout API, the LLM proxy, and the rollout state machine."""
