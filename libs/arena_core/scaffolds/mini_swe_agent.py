"""mini-swe-agent (``pip install mini-swe-agent``, its ``mini`` command) under the sandbox contract:
unattended, its LLM calls to Arena's proxy, its commands run in the sandbox (LocalEnvironment),
``done`` written when it submits. See docs/agents.md ("mini-swe-agent").
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

import msgspec

from arena_core.scaffolds import SCAFFOLD_DIR, Context, Launch

if TYPE_CHECKING:
    from arena_core.schemas import ScaffoldSpec

NAME = "mini-swe-agent"
#: What ``python -m arena_core.scaffolds.install mini-swe-agent`` puts in its virtualenv.
REQUIREMENTS = ("mini-swe-agent==2.4.6",)
CONFIG = f"{SCAFFOLD_DIR}/mini-swe-agent.yaml"
WRAPPER = f"{SCAFFOLD_DIR}/mini-swe-agent.sh"
FINISH = f"{SCAFFOLD_DIR}/mini-swe-agent-finish.py"
MODELS = f"{SCAFFOLD_DIR}/litellm-models.json"
TRAJECTORY = "/sandbox/.arena/mini-swe-agent.traj.json"
#: Seconds each command the model runs may take (mini's ``environment.timeout``; its default is 30).
COMMAND_TIMEOUT_S = 120
#: mini's own configs the preset starts from (``config_files`` in the scaffold's config replaces it).
BASE_CONFIGS = ("mini.yaml",)

#: Unattended and offline: no first-run set-up prompt, no cost-map download, cost tracking that
#: accepts a model litellm has no price for, its global config in the sandbox's /tmp.
ENV = {
    "MSWEA_CONFIGURED": "true",
    "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mini-swe-agent",
    "MSWEA_COST_TRACKING": "ignore_errors",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}

#: After mini exits: its trajectory's ``info.exit_status`` decides; ``Submitted`` writes ``done``.
#: ``result.json`` carries the exit status and the submission either way.
_FINISH = '''\
import json, pathlib, sys
arena = pathlib.Path("/sandbox/.arena")
try:
    info = json.loads(pathlib.Path(sys.argv[1]).read_text())["info"]
except (OSError, ValueError, KeyError, TypeError) as exc:
    print(f"arena: no mini-swe-agent trajectory to read ({exc}); not done", file=sys.stderr)
    sys.exit(0)
status = info.get("exit_status", "")
result = {"scaffold": "mini-swe-agent", "exit_status": status, "submission": info.get("submission", ""),
          "api_calls": (info.get("model_stats") or {}).get("api_calls")}
(arena / "result.json").write_text(json.dumps(result))
if status == "Submitted":
    (arena / "done").touch()
else:
    print(f"arena: mini-swe-agent exited with status {status!r}, not Submitted; not done", file=sys.stderr)
'''


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``, dictionaries merged key by key (as mini merges its configs)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def config(scaffold: ScaffoldSpec, context: Context) -> dict[str, Any]:
    """The config file Arena adds after mini's own (JSON, which mini reads as YAML)."""
    preset = {
        "run": {"task": context.instructions},
        "agent": {"mode": "yolo", "confirm_exit": False, "output_path": TRAJECTORY},
        "model": {
            "model_name": scaffold.model,
            "cost_tracking": "ignore_errors",
            "litellm_model_registry": MODELS,
            # the key stays in OPENAI_API_KEY (litellm reads it): never in the trajectory file
            "model_kwargs": {"api_base": context.openai_base_url, "custom_llm_provider": "openai"},
        },
        # the commands it runs keep their bytecode out of the workspace (the sandbox's own setting,
        # repeated in case a task's environment drops it); a sandbox has one CPU: mini's 30 s per
        # command is short for a test suite there
        "environment": {"environment_class": "local", "cwd": context.workdir, "timeout": COMMAND_TIMEOUT_S,
                        "env": {"PYTHONDONTWRITEBYTECODE": "1"}},
    }
    own = {k: v for k, v in scaffold.config.items() if k != "config_files"}
    return merge(preset, own)


def model_registry(model: str) -> dict[str, Any]:
    """litellm's entry for the model: served through Arena's proxy, priced at 0 (so litellm
    neither looks the name up among its providers nor prints its provider list on every call)."""
    return {model: {"litellm_provider": "openai", "mode": "chat", "input_cost_per_token": 0.0,
                    "output_cost_per_token": 0.0, "cache_creation_input_token_cost": 0.0,
                    "cache_read_input_token_cost": 0.0}}


def launch(scaffold: ScaffoldSpec, context: Context) -> Launch:
    bin_dir = f"{context.home.rstrip('/')}/bin/" if context.home else ""
    mini, python = f"{bin_dir}mini", (f"{bin_dir}python" if bin_dir else "python3")
    bases = scaffold.config.get("config_files", list(BASE_CONFIGS))
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ValueError("mini-swe-agent: config.config_files must be a list of mini config names or paths")
    specs = " ".join(f"-c {shlex.quote(b)}" for b in [*bases, CONFIG])
    wrapper = (
        "#!/bin/sh\n"
        "# mini-swe-agent under Arena's sandbox contract (arena_core.scaffolds.mini_swe_agent)\n"
        f"{shlex.quote(mini)} -y --exit-immediately {specs} -o {shlex.quote(TRAJECTORY)} </dev/null\n"
        "rc=$?\n"
        f"{shlex.quote(python)} {shlex.quote(FINISH)} {shlex.quote(TRAJECTORY)}\n"
        "exit $rc\n"
    )
    return Launch(
        command=["sh", WRAPPER],
        env=dict(ENV),
        files={
            CONFIG: msgspec.json.encode(config(scaffold, context)),
            WRAPPER: wrapper.encode(),
            FINISH: _FINISH.encode(),
            MODELS: msgspec.json.encode(model_registry(scaffold.model)),
        },
        artifacts={"mini-swe-agent.traj.json": TRAJECTORY},
    )
