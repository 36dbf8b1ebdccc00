"""``arena eval export``: each attempt's trajectory as Arena's own JSON and in Harbor's ATIF
(``atif.py``), under the job's ``trajectories/`` (docs/evaluation.md, Interchange)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Literal, Protocol

import msgspec

from arena.evaluation.atif import to_atif
from arena.evaluation.records import final_results, read_log, read_spec
from arena_core.errors import NotFound
from arena_core.schemas import Trajectory

Format = Literal["arena", "atif", "both"]
INDEX_FILE = "index.jsonl"


class TrajectorySource(Protocol):
    def trajectory(self, rollout_id: str) -> Trajectory: ...


class Exported(msgspec.Struct, kw_only=True):
    """One attempt's line of ``trajectories/index.jsonl``: its result and the files written (None:
    not written; ``missing``: the trajectory plane has no trajectory for it)."""

    task_id: str
    model: str
    attempt: int
    rollout_id: str
    outcome: str
    reward: float | None
    arena: str | None = None
    atif: str | None = None
    missing: bool = False


def _version() -> str:
    try:
        return importlib.metadata.version("arena")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def export_job(directory: Path, source: TrajectorySource, *, fmt: Format = "both", out: Path | None = None) -> list[Exported]:
    """Every settled attempt's trajectory (its result's try) in ``out`` (default
    ``JOB/trajectories``): ``ROLLOUT.json`` (Arena's) and/or ``ROLLOUT.atif.json``, and ``index.jsonl``."""
    spec = read_spec(directory)
    out = out or directory / "trajectories"
    out.mkdir(parents=True, exist_ok=True)
    final = sorted(final_results(read_log(directory)).values(), key=lambda r: (r.task_id, r.model, r.attempt))
    instructions: dict[str, str] | None = None
    agent = spec.agent if spec.agent != "task" else "arena-task-agent"
    encoder = msgspec.json.Encoder()

    def fetch(rollout_id: str) -> Trajectory | None:
        try:
            return source.trajectory(rollout_id)
        except NotFound:
            return None

    rows = []
    for r in final:
        traj = fetch(r.rollout_id)
        row = Exported(task_id=r.task_id, model=r.model, attempt=r.attempt, rollout_id=r.rollout_id,
                       outcome=r.outcome, reward=r.reward, missing=traj is None)
        if traj is not None:
            if fmt in ("arena", "both"):
                row.arena = f"{r.rollout_id}.json"
                (out / row.arena).write_bytes(msgspec.json.format(encoder.encode(traj), indent=2) + b"\n")
            if fmt in ("atif", "both"):
                if not traj.steps and instructions is None:  # a rollout with no LLM call: the task's words
                    from arena.evaluation.runner import load_dataset

                    instructions = {t.id: t.instructions for _, t in load_dataset(spec.dataset)}
                doc = to_atif(traj, agent_name=agent, agent_version=_version(), model=r.model,
                              instructions=(instructions or {}).get(r.task_id, ""),
                              extra={"eval_job": spec.job_id, "eval_attempt": r.attempt, "eval_outcome": r.outcome})
                row.atif = f"{r.rollout_id}.atif.json"
                (out / row.atif).write_bytes(msgspec.json.format(encoder.encode(doc), indent=2) + b"\n")
        rows.append(row)
    (out / INDEX_FILE).write_bytes(b"".join(encoder.encode(row) + b"\n" for row in rows))
    return rows
