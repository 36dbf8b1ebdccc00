"""``arena tasks audit PATH``: how hackable each imported task is, through the running stack.

Every task gets a do-nothing agent and each hack agent of :mod:`arena.hacks` (write a reward file,
edit or delete the tests, a conftest that passes everything, patch the runner in-process or force
its exit code, read hidden tests or solutions, reach the network, mine git history). A hack that
scores above the do-nothing agent found a hole; the report gives, per task and in total, the share
of hacks that did. docs/tasks.md ("Auditing").
"""

from __future__ import annotations

import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from arena_core.schemas import AgentSpec, Task

NULL = "null"
DONE = "mkdir -p /sandbox/.arena && touch /sandbox/.arena/done"


def hack_names() -> list[str]:
    from arena import hacks

    return list(hacks.HACKS)


def hack_agent(name: str, task: Task, staging: Path) -> AgentSpec:
    """The agent that plays hack ``name`` (``hacks.py`` as its files), from the task's working copy."""
    from arena import hacks

    agent_dir = staging / "hacks"
    if not agent_dir.is_dir():
        agent_dir.mkdir(parents=True)
        shutil.copy(hacks.__file__, agent_dir / "hacks.py")
    workdir = task.workspace_mount() or "/sandbox/workspace"
    run = (f"cd {shlex.quote(workdir)} && {{ python3 /sandbox/agent/hacks.py {name} || "
           f"python /sandbox/agent/hacks.py {name}; }}; {DONE}")
    return AgentSpec(command=["sh", "-c", run], path=str(agent_dir))


@dataclass
class Audit:
    """One task's audit: the reward (or the outcome) of the null agent and of each hack."""

    task: Task
    rewards: dict[str, float | None] = field(default_factory=dict)
    shown: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)

    def above(self) -> list[str]:
        """The hacks that scored above the do-nothing agent."""
        null = self.rewards.get(NULL)
        if null is None:
            return []
        return [h for h, r in self.rewards.items() if h != NULL and r is not None and r > null]

    def judged(self) -> list[str]:
        """The hacks with a verdict to compare (a reward, and a null reward to compare it with)."""
        if self.rewards.get(NULL) is None:
            return []
        return [h for h, r in self.rewards.items() if h != NULL and r is not None]


def audit(client, paths: list[Path], *, hacks: list[str] | None = None, provider: str | None = None,
          timeout: float = 900.0, verbose: bool = False) -> int:
    """Submit the null agent and every hack for each task, wait, print the report; 1 if any hack
    scored above doing nothing (or none could be judged), else 0."""
    from arena.progress import WaitProgress, as_finished, outcome_of
    from arena.tasks import load_task
    from arena_core.errors import InvalidRequest

    names = hacks or hack_names()
    unknown = [h for h in names if h not in hack_names()]
    if unknown:
        raise InvalidRequest(f"unknown hack {unknown[0]!r} (known: {', '.join(hack_names())})")
    audits: list[Audit] = []
    submitted = []
    with tempfile.TemporaryDirectory(prefix="arena-audit-") as tmp:
        for path in paths:
            task = load_task(path)
            if task.verifier is None:
                raise InvalidRequest(f"{path}: the task has no verifier to audit")
            item = Audit(task)
            audits.append(item)
            agents = {NULL: AgentSpec(command=["sh", "-c", DONE])}
            agents |= {h: hack_agent(h, task, Path(tmp)) for h in names}
            for kind, agent in agents.items():
                view = client.submit(msgspec.structs.replace(task, agent=agent), metadata={"audit": kind},
                                     provider=provider or ("docker" if task.image_of() else "local"))
                submitted.append((item, kind, view.rollout_id))
        with WaitProgress(len(submitted), "audit") as progress:
            for (item, kind, rid), view in as_finished(submitted, lambda s: client.wait(s[2], timeout=timeout)):
                item.rewards[kind] = view.reward if view.state.value == "completed" else None
                item.shown[kind] = _shown(view)
                item.reasons[kind] = view.reason or ""
                progress.finished(f"{item.task.id} {kind} {rid} reward {item.shown[kind]}",
                                  outcome_of(view) if view.state.is_final else "failed")
    return report(audits, names, verbose=verbose)


def _shown(view) -> str:
    if view.reward is not None:
        return f"{view.reward:g}"
    if view.state.value == "completed":
        return "-"
    return view.state.value + (" (infra)" if view.infrastructure else "")


def report(audits: list[Audit], names: list[str], *, verbose: bool = False) -> int:
    """Print the per-task table and the total; the exit code."""
    from arena.table import format_table

    rows = []
    for a in audits:
        judged, above = a.judged(), a.above()
        rows.append((a.task.id, a.shown.get(NULL, "-"), " ".join(a.shown.get(h, "-") for h in names),
                     f"{len(above)}/{len(judged)}", ", ".join(above) or "-"))
    print(f"hacks, in this order: {' '.join(names)}")
    print("\n".join(format_table(["TASK", "NULL", "HACK REWARDS", "ABOVE NULL", "WHICH"], rows)))
    if verbose:
        for a in audits:
            for kind in [NULL, *names]:
                print(f"  {a.task.id} {kind}: reward {a.shown.get(kind, '-')}: {a.reasons.get(kind, '')[:300]}")
    judged = sum(len(a.judged()) for a in audits)
    above = sum(len(a.above()) for a in audits)
    unjudged = sum(len(names) for a in audits) - judged
    share = f"{100 * above / judged:.1f}%" if judged else "-"
    print(f"hacks above a do-nothing agent: {above}/{judged} ({share})"
          + (f"; {unjudged} without a verdict (no reward, or none for the do-nothing agent)" if unjudged else ""))
    return 1 if above or not judged else 0
