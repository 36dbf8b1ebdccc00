"""Harbor's Terminus-2 (``pip install harbor``, agent ``terminus-2``) under the sandbox contract: run
inside the sandbox by a small driver on a local harbor environment (tmux in the sandbox), its LLM
calls to Arena's proxy, ``done`` written when it confirms the task complete. See docs/agents.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch

if TYPE_CHECKING:
    from arena_core.schemas import ScaffoldSpec

NAME = "terminus-2"
#: What ``python -m arena_core.scaffolds.install terminus-2`` puts in its virtualenv.
REQUIREMENTS = ("harbor==0.26.0",)
#: harbor needs Python 3.12 or later (the installer copies the host's into the scaffold's directory).
PYTHON = "3.12"
#: Where its image (``arena/terminus-2``, deploy/images) holds that directory: used when the provider
#: names no installation (``Context.home`` empty: the docker provider), as the image's own ``python3``
#: is the tasks' 3.11.
IMAGE_HOME = "/opt/terminus-2"
CONFIG = f"{SCAFFOLD_DIR}/terminus-2.json"
DRIVER = f"{SCAFFOLD_DIR}/terminus-2.py"
TRAJECTORY = "/sandbox/.arena/terminus-2.trajectory.json"
ROLLOUT_DETAILS = "/sandbox/.arena/terminus-2.rollout-details.json"

#: Offline and quiet: no cost-map download, no hub look-ups, output as it comes.
ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}

#: Terminus2 keyword arguments ``config`` may set (harbor's ``--ak``); the rest are Arena's.
AGENT_OPTIONS = frozenset({
    "max_turns", "parser_name", "temperature", "reasoning_effort", "collect_rollout_details",
    "enable_summarize", "proactive_summarization_threshold", "model_info", "trajectory_config",
    "tmux_pane_width", "tmux_pane_height", "interleaved_thinking", "llm_kwargs", "llm_call_kwargs",
})

#: The model as litellm sees it: context and output limits, priced at 0 (the proxy counts tokens).
DEFAULT_MODEL_INFO = {"max_input_tokens": 131072, "max_output_tokens": 8192,
                      "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
                      "cache_creation_input_token_cost": 0.0, "cache_read_input_token_cost": 0.0}


def config(scaffold: ScaffoldSpec, context: Context) -> dict[str, Any]:
    """What the driver reads: the task, where to work, and Terminus2's keyword arguments."""
    unknown = sorted(set(scaffold.config) - AGENT_OPTIONS)
    if unknown:
        raise ValueError(f"terminus-2: unknown config keys {unknown} (known: {', '.join(sorted(AGENT_OPTIONS))})")
    agent: dict[str, Any] = {
        # litellm's OpenAI client against the proxy; the key stays in OPENAI_API_KEY (never in a file)
        "model_name": f"openai/{scaffold.model}",
        "api_base": context.openai_base_url,
        "parser_name": "json",
        "collect_rollout_details": True,  # token ids and logprobs in its own record
        "record_terminal_session": False,  # asciinema is not in the sandbox (nor installable)
        "suppress_max_turns_warning": True,
        "model_info": dict(DEFAULT_MODEL_INFO),
        **scaffold.config,
    }
    return {"instruction": context.instructions, "workdir": context.workdir, "agent": agent,
            "trajectory": TRAJECTORY, "rollout_details": ROLLOUT_DETAILS}


# The driver, run with the scaffold's Python. harbor normally drives a container from outside; here
# a BaseEnvironment runs its commands (tmux) locally, in the sandbox. Public harbor names only.
_DRIVER = '''\
"""Terminus-2 in Arena's sandbox (arena_core.scaffolds.terminus2): a local harbor environment."""
import asyncio, json, os, shutil, subprocess, sys, tempfile
sys.pycache_prefix = None  # harbor's imports use the bytecode installed beside them, whatever the task sets
from pathlib import Path

from harbor.agents.terminus_2 import Terminus2
from harbor.environments.base import BaseEnvironment, ExecResult
from harbor.models.agent.context import AgentContext
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths

ARENA = Path("/sandbox/.arena")


class SandboxEnvironment(BaseEnvironment):
    """Commands run here, in the sandbox, as its user: ``bash -c`` in the working directory."""

    workdir = "/sandbox/workspace"

    @staticmethod
    def type():
        return "arena-sandbox"

    def _validate_definition(self):
        pass

    async def start(self, force_build):
        pass

    async def stop(self, delete):
        pass

    async def exec(self, command, cwd=None, env=None, timeout_sec=None, user=None):
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=cwd or self.workdir, env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_sec)
        except asyncio.TimeoutError:
            proc.kill()
            out, err = await proc.communicate()
            return ExecResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"), return_code=124)
        return ExecResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                          return_code=proc.returncode)

    async def upload_file(self, source_path, target_path):
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_path, target_path)

    async def upload_dir(self, source_dir, target_dir):
        shutil.copytree(source_dir, target_dir, dirs_exist_ok=True)

    async def download_file(self, source_path, target_path):
        Path(target_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source_path, target_path)

    async def download_dir(self, source_dir, target_dir):
        shutil.copytree(source_dir, target_dir, dirs_exist_ok=True)


def confirmed(trajectory):
    """Terminus-2 ends a run on a second task_complete in a row (the first asks to confirm)."""
    steps = [s for s in trajectory.get("steps", []) if s.get("source") == "agent"]
    marks = [any(c.get("function_name") == "mark_task_complete" for c in s.get("tool_calls") or []) for s in steps]
    return len(marks) >= 2 and marks[-1] and marks[-2]


async def main(config):
    logs = Path(tempfile.mkdtemp(prefix="terminus-2-"))
    trial = TrialPaths(trial_dir=logs / "trial")
    trial.agent_dir.mkdir(parents=True, exist_ok=True)
    (logs / "agent").mkdir()  # where Terminus2 writes trajectory.json (harbor's trial makes it)
    SandboxEnvironment.workdir = config["workdir"]
    environment = SandboxEnvironment(environment_dir=Path(config["workdir"]), environment_name="arena",
                                     session_id="arena", trial_paths=trial, task_env_config=EnvironmentConfig())
    agent = Terminus2(logs_dir=logs / "agent", **config["agent"])
    context = AgentContext()
    error = None
    try:
        await environment.start(force_build=False)
        await agent.setup(environment)
        await agent.run(config["instruction"], environment, context)
    except Exception as exc:  # recorded in result.json; the rollout fails (no done)
        error = f"{type(exc).__name__}: {exc}"
        print(f"arena: terminus-2 raised {error}", file=sys.stderr)
    finally:
        subprocess.run(["tmux", "kill-server"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    trajectory = {}
    if (logs / "agent" / "trajectory.json").is_file():
        shutil.copyfile(logs / "agent" / "trajectory.json", config["trajectory"])
        trajectory = json.loads(Path(config["trajectory"]).read_text())
    Path(config["rollout_details"]).write_text(json.dumps(context.rollout_details or [], default=str))
    done = error is None and confirmed(trajectory)
    result = {"scaffold": "terminus-2", "task_complete": done, "error": error,
              "episodes": (context.metadata or {}).get("n_episodes"),
              "input_tokens": context.n_input_tokens, "output_tokens": context.n_output_tokens}
    (ARENA / "result.json").write_text(json.dumps(result))
    if done:
        (ARENA / "done").touch()
    else:
        print("arena: terminus-2 did not confirm the task complete; not done", file=sys.stderr)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(json.loads(Path(sys.argv[1]).read_text()))))
'''


def launch(scaffold: ScaffoldSpec, context: Context) -> Launch:
    python = f"{(context.home or IMAGE_HOME).rstrip('/')}/bin/python"
    return Launch(
        command=[python, DRIVER, CONFIG],
        env=dict(ENV),
        files={CONFIG: msgspec.json.encode(config(scaffold, context)), DRIVER: _DRIVER.encode()},
        artifacts={"terminus-2.trajectory.json": TRAJECTORY, "terminus-2.rollout-details.json": ROLLOUT_DETAILS},
    )
