"""Arena: rollout, sandbox, verification and trajectory platform for agentic RL."""

__version__ = "0.1.0"
