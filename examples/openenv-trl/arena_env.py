"""An Arena environment for TRL's ``GRPOTrainer(environment_factory=ArenaToolEnv)``.

TRL (1.x) makes one instance per generation, calls ``reset(**row)`` before each rollout
(the returned text is appended to the prompt), offers every other public method as a tool
(its docstring's ``Args:`` is the schema) and adds ``get_reward`` to the reward functions.
Each instance holds one OpenEnv episode of an Arena environment over OpenEnv's own client:
the task's sandbox, Arena's verifier for the reward, the episode stored as a trajectory.
The model generates inside TRL, so its tokens are TRL's (Arena records the actions and
observations, not the LLM calls). docs/openenv.md ("TRL").

    ARENA_ENV_URL=http://127.0.0.1:9090/openenv/quickstart python train.py
"""

from __future__ import annotations

import os

from openenv.core import GenericEnvClient


class ArenaToolEnv:
    def __init__(self, url: str | None = None):
        self._url = url or os.environ.get("ARENA_ENV_URL", "http://127.0.0.1:9090/openenv/quickstart")
        self._env = None
        self._reward: float | None = None

    def _call(self, tool: str, **arguments) -> dict:
        result = self._env.step({"type": "call_tool", "tool_name": tool, "arguments": arguments})
        if result.done:
            self._reward = result.reward
        observation = result.observation
        if observation.get("error"):
            return {"error": observation["error"]["message"]}
        return observation.get("result") or {}

    def reset(self, **row) -> str:
        """A new episode (a new Arena rollout); the task's instructions for the prompt."""
        if self._env is not None:
            self._env.close()
        self._env = GenericEnvClient(base_url=self._url, message_timeout_s=300).sync()
        self._env.connect()
        self._reward = None
        seed = row.get("seed")
        first = self._env.reset(**({"seed": seed} if isinstance(seed, int) else {}))
        return first.observation["prompt"]

    def shell(self, command: str) -> str:
        """Run a shell command in the task's repository.

        Args:
            command: The command, run with /bin/sh -c in the repository's directory.
        """
        result = self._call("shell", command=command)
        return result.get("error") or f"exit code {result['exit_code']}\n{result['output']}"

    def read_file(self, path: str) -> str:
        """Read a file of the repository.

        Args:
            path: The file's path, relative to the repository.
        """
        result = self._call("read_file", path=path)
        return result.get("error") or result["content"]

    def edit_file(self, path: str, old_str: str, new_str: str) -> str:
        """Replace text in a file of the repository.

        Args:
            path: The file's path, relative to the repository.
            old_str: The exact text to replace; it must occur once.
            new_str: The text to put in its place.
        """
        result = self._call("edit_file", path=path, old_str=old_str, new_str=new_str)
        return result.get("error") or f"{result['replacements']} replacement(s)"

    def submit(self) -> str:
        """Submit the repository as it is now: it is verified and the episode ends."""
        self._call("submit")
        return f"submitted; reward {self._reward}"

    def get_reward(self) -> float:
        """Arena's verified reward (0.0 until the episode is submitted)."""
        return self._reward or 0.0
