"""``arena tasks validate`` / ``arena tasks check``: through the running stack, each task's oracle must
score 1 and a do-nothing agent 0, on every run; a per-task table, and why each failing task fails
(``build``, ``oracle``, ``null``, ``flaky``). docs/tasks.md ("Validating").

The oracle is what the import left beside the task file: ``gold/<id>.patch`` (SWE-bench-style rows:
applied with ``git apply``) or ``solutions/<id>/`` (Harbor and Terminal-Bench: ``solve.sh`` run from the
task's working directory, or in each step's turn that step's ``steps/<name>/solve.sh``), mounted as the agent's
files, read-only, in the oracle's runs only.
"""

from __future__ import annotations

import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from arena_core.schemas import AgentSpec, RewardFileVerifier, Task

DONE = "mkdir -p /sandbox/.arena && touch /sandbox/.arena/done"
APPLY_GOLD = f"git apply --whitespace=nowarn /sandbox/agent/gold.patch && {DONE}"


@dataclass
class Check:
    """One task's validation: its rollouts' rewards by kind (``oracle``, ``null``) and what failed."""

    task: Task
    rewards: dict[str, list[str]] = field(default_factory=lambda: {"oracle": [], "null": []})
    reasons: dict[str, list[str]] = field(default_factory=lambda: {"oracle": [], "null": []})
    problem: str = ""  # a failure before any rollout (build, no oracle)

    def verdict(self) -> str:
        if self.problem:
            return self.problem
        why = []
        for kind, want in (("oracle", "1"), ("null", "0")):
            got = self.rewards[kind]
            if not got:
                continue
            infra = [i for i, shown in enumerate(got) if shown.endswith("(infra)")]
            if infra:  # Arena could not run it: no verdict on the task from that run
                reason = self.reasons[kind][infra[0]] if infra[0] < len(self.reasons[kind]) else ""
                why.append(f"infrastructure: {len(infra)} of {len(got)} {kind} run(s) ended without a reward"
                           + (f" ({reason[:200]})" if reason else "") + "; validate again")
                got = [shown for shown in got if not shown.endswith("(infra)")]
                if not got:
                    continue
            if len(set(got)) > 1:
                why.append(f"flaky: {kind} scored {', '.join(got)} across {len(got)} runs")
            elif got[0] != want:
                reason = next((r for r in self.reasons[kind] if r), "")
                why.append(f"{kind}: scored {got[0]}, not {want}" + (f" ({reason[:200]})" if reason else ""))
        if not self.rewards["oracle"]:
            why.append("oracle: none (no gold/<id>.patch nor solutions/<id>/ beside the task)")
        return "; ".join(why) or "ok"


def oracle_agent(task_file: Path, task: Task, staging: Path, *, required: bool) -> AgentSpec | None:
    """The agent that plays the task's oracle, its files staged under ``staging``; ``None`` when
    the task has none (an error when ``required``)."""
    from arena.authoring import oracle_patch

    gold = oracle_patch(task_file, task) if required else task_file.parent / "gold" / f"{task.id}.patch"
    solution = task_file.parent / "solutions" / task.id
    agent_dir = staging / task.id
    if gold.is_file():
        agent_dir.mkdir(parents=True, exist_ok=True)
        (agent_dir / "gold.patch").write_bytes(gold.read_bytes())
        return AgentSpec(command=["sh", "-c", APPLY_GOLD], path=str(agent_dir))
    if not solution.is_dir():
        return None
    workdir = task.workspace_mount() or "/sandbox/workspace"
    verifier = task.verifier
    steps = [s.name for s in verifier.steps] if isinstance(verifier, RewardFileVerifier) else []
    scripts = [f"steps/{name}/solve.sh" for name in steps] or ["solve.sh"]
    missing = [s for s in scripts if not (solution / s).is_file()]
    if missing:
        return None
    if steps and task.steps:  # a turn per step: this turn's solve.sh (ARENA_STEP names the step)
        run = f'cd {shlex.quote(workdir)} && bash "/sandbox/agent/steps/$ARENA_STEP/solve.sh"'
    else:
        run = " && ".join(f"(cd {shlex.quote(workdir)} && bash /sandbox/agent/{shlex.quote(s)})" for s in scripts)
    return AgentSpec(command=["sh", "-c", f"{run}; {DONE}"], path=str(solution.resolve()))


def null_agent() -> AgentSpec:
    return AgentSpec(command=["sh", "-c", DONE])


def shown_reward(view) -> str:
    """A final rollout's reward as the table shows it (``-``: no reward; the state otherwise)."""
    if view.reward is not None:
        return f"{view.reward:g}"
    if view.state.value == "completed":
        return "-"
    return view.state.value + (" (infra)" if view.infrastructure else "")


def validate(client, paths: list[Path], *, oracle_required: bool = False, runs: int = 1, provider: str | None = None,
             timeout: float = 900.0, verbose: bool = False, build: bool = False, base_map: str = "") -> int:
    """Submit each task's oracle and null agents ``runs`` times each, wait, print the table.
    ``provider`` ``None``: ``docker`` for a task with its own image, else ``local``."""
    from arena import images
    from arena.progress import WaitProgress, as_finished, outcome_of
    from arena.table import format_table
    from arena.tasks import load_task

    checks: list[Check] = []
    submitted = []
    details: list[str] = []  # -v: each rollout, after the table
    with tempfile.TemporaryDirectory(prefix="arena-validate-") as tmp:
        for path in paths:
            task = load_task(path)
            check = Check(task)
            checks.append(check)
            if task.metadata.get("environment"):
                if build:
                    result = images.build_task(path, task, base_map=images.parse_base_map(base_map))
                    if result.status == "failed":
                        check.problem = f"build: {result.reason}" + (f" (log: {result.log})" if result.log else "")
                        continue
                elif not images.exists(task.image or ""):
                    check.problem = f"build: image {task.image} is not built (arena images build {path.parent})"
                    continue
            agents = {"null": null_agent()}
            oracle = oracle_agent(path, task, Path(tmp), required=oracle_required)
            if oracle is not None:
                agents["oracle"] = oracle
            for _ in range(runs):
                for kind, agent in agents.items():
                    view = client.submit(msgspec.structs.replace(task, agent=agent), metadata={"validate": kind},
                                         provider=provider or ("docker" if task.image_of() else "local"))
                    submitted.append((check, kind, view.rollout_id))
        with WaitProgress(len(submitted), "validate") as progress:
            for (check, kind, rid), view in as_finished(submitted, lambda s: client.wait(s[2], timeout=timeout)):
                shown = shown_reward(view)
                progress.finished(f"{check.task.id} {kind} {rid} reward {shown}",
                                  outcome_of(view) if view.state.is_final else "failed")
                check.rewards[kind].append(shown)
                check.reasons[kind].append(view.reason or "")
                details.append(f"  {check.task.id} {kind} {rid}: {view.state.value}: reward {shown}: {view.reason}")
    rows = [(c.task.id, " ".join(c.rewards["oracle"]) or "-", " ".join(c.rewards["null"]) or "-",
             "ok" if c.verdict() == "ok" else "INFRA" if c.verdict().startswith("infrastructure")
             else "INVALID") for c in checks]
    print("\n".join(format_table(["TASK", "ORACLE", "NULL", "VERDICT"], rows)))
    if verbose:
        print("\n".join(sorted(details)))
    bad = [c for c in checks if c.verdict() != "ok"]
    for c in bad:
        print(f"invalid: {c.task.id}: {c.verdict()}")
    print(f"{len(checks) - len(bad)}/{len(checks)} valid" + (f" ({runs} runs each)" if runs > 1 else ""))
    return 1 if bad else 0
